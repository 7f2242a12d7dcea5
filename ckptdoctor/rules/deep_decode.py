"""``check --deep``: decode every tensor chunk and bytes item of a checkpoint (CKD310-314).

Streams one chunk's byte range at a time (memory stays bounded by the largest chunk) and needs no torch: chunks
decode to :class:`~ckptdoctor.pickle.stand_ins.TensorRef` through the safe unpickler. Each data file is one unit of
:func:`ckptdoctor.parallel.map_units` (``--jobs`` processes, or torchrun ranks); CKD313's NaN/Inf counting is
:mod:`ckptdoctor.rules.non_finite`. Every record's CRC-32 is verified (CKD314: torch.load does not). The rules
themselves are in the family's table, :mod:`.integrity`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ckptdoctor import parallel
from ckptdoctor.checkpoint import Entry, decode_object_bytes
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError, without_path
from ckptdoctor.formats.archive import (
    ArchiveError,
    CorruptRecord,
    Member,
    chunk_limits,
    is_torch_zip,
    parse_archive,
    storage_ref,
    stored_record_problem,
)
from ckptdoctor.formats.torch_dist import DcpChunk, check_range_length
from ckptdoctor.optimizer_keys import bucket_padding
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.torch_stand_ins import StorageRef, TensorRef
from ckptdoctor.rules import Finding, finding
from ckptdoctor.rules.integrity import BLOB_SIZE, BLOB_UNDECODABLE, CRC_MISMATCH, ITEM_UNDECODABLE, NON_FINITE
from ckptdoctor.rules.non_finite import NonFinite
from ckptdoctor.rules.safety import item_findings, refused_pickle, unlisted_globals
from ckptdoctor.rules.structure import Scanned
from ckptdoctor.severity import OVERRIDDEN
from ckptdoctor.storage.stream import read_ranges
from ckptdoctor.values.archive_memo import parse, plain_key
from ckptdoctor.values.health import HealthScan, crowded_keys
from ckptdoctor.values.moments import KINDS

NON_FINITE_SECTIONS = ("model", "optimizer")

Progress = Callable[[int], None]  # called with the bytes just processed


def _values_scanned(entry: Entry) -> bool:
    """Model and optimizer tensors, the distributed optimizer's flat buckets included (their padding chunks are
    left out chunk by chunk: :func:`ckptdoctor.optimizer_keys.bucket_padding`)."""
    return entry.section in NON_FINITE_SECTIONS


def deep_bytes(state: Scanned, values: bool = True) -> int:
    """Bytes ``--deep`` will read (for a progress bar's length); ``values``: as :func:`check_deep` reads them."""
    work = _work(state, values)
    return sum(c.storage.length for items in work.values() for _, c in items if c.storage is not None)


def _work(state: Scanned, values: bool) -> dict[str, list[tuple[Entry, DcpChunk]]]:
    """Every chunk and item in a readable data file, by file, in offset order (sequential reads); a legacy zarr
    checkpoint's tensor chunks only where their ``values`` are read (they hold raw elements: nothing to decode)."""
    checkpoint = state.checkpoint
    by_file: dict[str, list[tuple[Entry, DcpChunk]]] = {}
    if checkpoint is None:
        return by_file
    zarr = checkpoint.dcp is None
    for entry in checkpoint.entries.values():
        if zarr and entry.kind == "tensor" and not (values and entry.section in NON_FINITE_SECTIONS):
            continue  # their sizes are checked with the data files (CKD114)
        for chunk in entry.chunks:
            if chunk.storage is not None and chunk.storage.relative_path not in state.bad_files:
                by_file.setdefault(chunk.storage.relative_path, []).append((entry, chunk))
    for items in by_file.values():
        items.sort(key=lambda item: item[1].storage.offset)  # type: ignore[union-attr]
    return dict(sorted(by_file.items()))


def check_deep(
    state: Scanned,
    progress: Progress | None = None,
    scan_values: bool = True,
    jobs: int | None = None,
    health: HealthScan | None = None,
) -> list[Finding]:
    """Decode every chunk and bytes item through the safe unpickler, reading each data file front to back;
    with ``scan_values``, also count NaN/Inf in model and optimizer tensors (CKD313, no torch needed); with
    ``health``, add every model and optimizer tensor chunk's statistics to it (``check --health``, numpy).

    Data files are the units of :func:`ckptdoctor.parallel.map_units` (``jobs`` processes, or the ranks of a
    torchrun job); their findings are merged in file order, so the result does not depend on ``jobs``."""
    checkpoint = state.checkpoint
    out: list[Finding] = []
    work = _work(state, scan_values or health is not None)
    if checkpoint is None or not work:
        return out
    files: list[tuple[Path, list[tuple[int, int, tuple[Entry, DcpChunk]]]]] = []
    shown = [state.shown / relative for relative in work]  # how findings name each file (zarr: <key>/<file>)
    for relative, items in work.items():
        ranges = []
        data_file = checkpoint.iteration_dir / relative
        for entry, chunk in items:
            location = chunk.storage
            assert location is not None
            try:  # a range longer than its item can need is never read (a hostile .metadata could name 100 GB)
                check_range_length(data_file, location, entry.max_range_bytes(chunk))
            except PickleLimitError as exc:
                out.append(refused_pickle(exc, state.shown / relative, f"{entry.key} chunk at {list(chunk.offsets)}"))
                continue
            ranges.append((location.offset, location.length, (entry, chunk)))
        files.append((data_file, ranges))
    weights = [sum(length for _, length, _ in ranges) for _, ranges in files]
    inline = parallel.runs_inline(jobs, len(files))

    decoder = _ChunkDecoder()  # one per process (forked workers inherit it empty): verdicts shared across files
    # the stacked keys measured whole (the metadata's, once: each file's scan is given them)
    crowded = (
        crowded_keys((entry.key, entry.dtype, entry.shape) for entry in checkpoint.entries.values())
        if health is not None
        else frozenset()
    )

    def task(index: int) -> tuple[list[Finding], NonFinite | None, HealthScan | None]:
        return _check_file(
            state,
            files[index],
            scan_values,
            progress if inline else None,
            decoder,
            path=shown[index],
            health=health is not None,
            crowded=crowded,
        )

    done = None if inline or progress is None else (lambda index: progress(weights[index]))
    non_finite = NonFinite() if scan_values else None
    for found, counts, stats in parallel.map_units(weights, task, jobs, done):
        out += found
        if non_finite is not None and counts is not None:
            non_finite.merge(counts)
        if health is not None and stats is not None:
            health.merge(stats)
    if non_finite is not None:
        out += non_finite.findings(NON_FINITE)
    return out


def _check_file(
    state: Scanned,
    file: tuple[Path, list[tuple[int, int, tuple[Entry, DcpChunk]]]],
    scan_values: bool,
    progress: Progress | None,
    decoder: _ChunkDecoder | None = None,
    *,
    path: Path,
    health: bool = False,
    crowded: frozenset[str] = frozenset(),
) -> tuple[list[Finding], NonFinite | None, HealthScan | None]:
    """One data file read front to back (named ``path`` in findings): its findings, (``scan_values``) its
    NaN/Inf counts and (``health``) its chunks' statistics (``crowded``: see :func:`crowded_keys`)."""
    out: list[Finding] = []
    decoder = decoder or _ChunkDecoder()
    non_finite = NonFinite() if scan_values else None
    stats = HealthScan(crowded) if health else None
    for file_path, tag, blob in read_ranges([file]):
        if isinstance(blob, CkptError):  # unreadable file (I/O error): the rest of it cannot be checked
            out.append(finding(BLOB_UNDECODABLE, path, without_path(blob, file_path)))
            continue
        entry, chunk = tag  # type: ignore[misc]
        if entry.kind == "tensor":
            scan = non_finite if non_finite is not None and _values_scanned(entry) else None
            # a bucket's padding (never written: arbitrary bits) is no value of the model's or the optimizer's
            measured = entry.section in NON_FINITE_SECTIONS and not bucket_padding(
                entry.key, chunk.offsets, chunk.sizes
            )
            measure = stats if stats is not None and measured else None
            if state.checkpoint is not None and state.checkpoint.dcp is None:
                problem = _scan_zarr_chunk(entry, chunk, blob, path, scan, measure)
            else:
                problem = _check_chunk(decoder, entry, chunk, blob, path, scan, measure)
        else:
            problem = _check_item(entry, blob, path)
        if problem is not None:
            out.append(problem)
        if progress is not None:
            progress(len(blob))
    return out, non_finite, stats


@dataclass(frozen=True)
class _Verdict:
    """What a chunk's ``data.pkl`` says, checked against the chunk's metadata (shared by identical chunks)."""

    refused: CkptError | None = None  # a refused global, a broken limit or an archive anomaly (CKD4xx)
    problem: str | None = None  # a CKD310 reason
    size_problem: str | None = None  # a CKD311 reason
    record: str | None = None  # the storage record's key
    record_bytes: int = 0  # numel x itemsize the record must hold
    view: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None  # storage offset, size, stride
    unlisted: tuple[UnlistedGlobal, ...] = ()  # globals read as stand-ins though not on the allowlist (the gate)


class _ChunkDecoder:
    """Decodes tensor blobs; a ``data.pkl`` byte-identical to one already decoded gives the same verdict.

    Chunks of equal shape and dtype pickle to identical bytes, so most of a checkpoint's chunks cost one
    dict lookup instead of an unpickling; every distinct pickle still goes through the safe unpickler. One
    decoder serves every file a process checks (a pickle's verdict depends only on the pickle, the chunk's sizes
    and the key's dtype); it remembers at most ``MAX_VERDICTS`` of them.
    """

    MAX_VERDICTS = 1 << 14

    def __init__(self) -> None:
        self._cache: dict[tuple, _Verdict] = {}
        # parse_archive, or the same validation from a remembered directory layout (archives of equal chunks
        # differ only in CRC-32s: values.archive_memo), imported here so that metadata-only checks never load it
        self.parse = parse
        self.plain_key = plain_key
        # (layout, data.pkl, sizes, dtype, pickle limit) -> (start, size, view) of the storage record of a chunk that
        # decoded cleanly: a later archive with that directory layout and pickle decodes the same way
        self.clean: dict[tuple, _Clean] = {}

    def verdict(self, pickled: bytes, entry: Entry, chunk: DcpChunk) -> _Verdict:
        key = (pickled, chunk.sizes, entry.dtype)
        verdict = self._cache.get(key)
        if verdict is None:
            verdict = _decide(pickled, entry, chunk)
            if len(self._cache) < self.MAX_VERDICTS:
                self._cache[key] = verdict
        return verdict


def _decide(pickled: bytes, entry: Entry, chunk: DcpChunk) -> _Verdict:
    unlisted: list[UnlistedGlobal] = []
    try:
        ref = unpickler.loads(pickled, _persistent_load, None, unlisted)
    except (UnsafePickleError, PickleLimitError) as exc:
        return _Verdict(refused=exc)
    except Exception as exc:  # a corrupt pickle can raise almost anything
        return _Verdict(problem=f"corrupt pickle ({type(exc).__name__}: {exc})")
    if any(not entry.trusted for entry in unlisted):
        return _Verdict(unlisted=tuple(unlisted))
    if not isinstance(ref, TensorRef):
        return _Verdict(problem=f"expected a tensor, found {type(ref).__name__}")
    problem = _metadata_problem(ref, entry, chunk)
    if problem:
        return _Verdict(problem=problem)
    problem = _view_problem(ref)
    if problem:
        return _Verdict(size_problem=problem)
    itemsize = ref.dtype.itemsize if ref.dtype is not None else None
    if itemsize is None:
        return _Verdict(problem=f"unknown dtype {ref.dtype}")
    view = (ref.storage_offset, tuple(ref.size), tuple(ref.stride))
    return _Verdict(record=ref.storage.key, record_bytes=ref.storage.numel * itemsize, view=view)


def _persistent_load(pid: object) -> StorageRef:
    return storage_ref(pid, "")


class _Clean(NamedTuple):
    """A cleanly decoded chunk archive: what a later archive of its layout is read by (the storage record's view,
    the stored members, whose bytes and CRC-32 fields lie at the same places in every archive of the layout: the
    record first, then the others, each checked against its CRC-32)."""

    view: tuple | None
    record: Member
    others: tuple[Member, ...]


def _check_chunk(
    decoder: _ChunkDecoder,
    entry: Entry,
    chunk: DcpChunk,
    blob: memoryview,
    path: Path,
    non_finite: NonFinite | None = None,
    health: HealthScan | None = None,
) -> Finding | None:
    key = decoder.plain_key(blob, chunk.sizes, entry.dtype)  # an archive like one decoded before
    what = f"{entry.key} chunk at {list(chunk.offsets)}"
    if key is not None:
        clean = decoder.clean.get(key)
        if clean is not None:  # decodes as that archive did: cleanly, its record at the same place
            record = clean.record
            _scan_values(
                non_finite, health, entry, chunk, blob[record.start : record.start + record.size], clean.view, path
            )
            problem = stored_record_problem(blob, record)
            for member in clean.others:
                problem = problem or stored_record_problem(blob, member)
            return None if problem is None else finding(CRC_MISMATCH, path, f"{what}: {problem}")
    try:
        archive = decoder.parse(blob, what)
        pickled = archive.pickle(chunk_limits(), verify_crc=False)  # its CRC-32 is checked last (CKD314)
        verdict = decoder.verdict(bytes(pickled), entry, chunk)
        if verdict.refused is not None:
            return refused_pickle(verdict.refused, path, what)
        if verdict.unlisted:
            return next(f for f in unlisted_globals(list(verdict.unlisted), path, what) if f.severity != OVERRIDDEN)
        if verdict.problem is not None:
            return finding(BLOB_UNDECODABLE, path, f"{what}: {verdict.problem}")
        if verdict.size_problem is not None:
            return finding(BLOB_SIZE, path, f"{what}: {verdict.size_problem}")
        record = archive.storage(verdict.record or "")
        if record.size != verdict.record_bytes:
            return finding(
                BLOB_SIZE,
                path,
                f"{what}: storage record has {record.size} bytes, {verdict.record_bytes} expected (numel x itemsize)",
            )
        # a view of a stored record (no copy); a compressed one inflated, bounded by what the tensor needs
        data = archive.read(record.name, verdict.record_bytes, verify_crc=False)
        if not (record.method or archive.general) and key is not None and len(decoder.clean) < decoder.MAX_VERDICTS:
            others = tuple(m for m in archive.members.values() if m.name != record.name)
            decoder.clean[key] = _Clean(verdict.view, record, others)
        if non_finite is not None or health is not None:
            _scan_values(non_finite, health, entry, chunk, data, verdict.view, path)
        problem = archive.members_crc_problem({record.name: data, f"{archive.prefix}data.pkl": pickled})
        if problem is not None:
            return finding(CRC_MISMATCH, path, f"{what}: {problem}")
    except (ArchiveError, PickleLimitError) as exc:
        return refused_pickle(exc, path, what)
    except CkptError as exc:
        return finding(BLOB_UNDECODABLE, path, f"{what}: {without_path(exc, what)}")
    return None


def _scan_zarr_chunk(
    entry: Entry,
    chunk: DcpChunk,
    blob: memoryview,
    path: Path,
    non_finite: NonFinite | None,
    health: HealthScan | None,
) -> Finding | None:
    """A legacy zarr chunk: its file is the chunk's raw row-major elements (no compressor, no filters, no edge
    padding: zarr_meta refuses the rest); one whose size is not that is CKD114's (the data files' sizes), not
    scanned."""
    dtype = KINDS.get(entry.dtype or "")
    if dtype is None or len(blob) != math.prod(chunk.sizes) * dtype.itemsize:
        return None
    _scan_values(non_finite, health, entry, chunk, blob, None, path)
    return None


def _scan_values(
    non_finite: NonFinite | None,
    health: HealthScan | None,
    entry: Entry,
    chunk: DcpChunk,
    data: object,
    view: object,
    path: Path,
) -> None:
    """A chunk's values: ``--health``'s statistics and the NaN/Inf count, in one pass where the statistics cover
    every element of the record (their NaN and Inf counts are then the count's), else each its own."""
    counted = None
    if health is not None:
        counted = health.scan(entry.key, entry.dtype, entry.shape, tuple(chunk.offsets), tuple(chunk.sizes), data, view)  # type: ignore[arg-type]
    if non_finite is not None:
        if counted is None:
            non_finite.scan(entry, chunk, data, path)
        else:
            non_finite.add(entry, chunk, *counted, path)


def _metadata_problem(ref: TensorRef, entry: Entry, chunk: DcpChunk) -> str | None:
    if tuple(ref.size) != tuple(chunk.sizes):
        return f"stored shape {list(ref.size)} differs from metadata {list(chunk.sizes)}"
    if entry.dtype is not None and str(ref.dtype) != entry.dtype:
        return f"stored dtype {ref.dtype} differs from metadata {entry.dtype}"
    return None


def _view_problem(ref: TensorRef) -> str | None:
    if ref.numel:
        last = ref.storage_offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
        if ref.storage_offset < 0 or last >= ref.storage.numel:
            return f"view {list(ref.size)} (offset {ref.storage_offset}) reaches past its {ref.storage.numel} elements"
    return None


def _check_item(entry: Entry, blob: memoryview, path: Path) -> Finding | None:
    what = f"item {entry.key}"
    if not is_torch_zip(blob):  # DCP saves every bytes item with torch.save and torch.load()s it back
        why = f"not a torch.save archive ({len(blob)} bytes, starting {bytes(blob[:8])!r})"
        return finding(ITEM_UNDECODABLE, path, f"{what}: {why}")
    gate = [f for f in item_findings(entry.key, bytes(blob), path) if f.severity != OVERRIDDEN]
    if gate:  # the finding plain check reports too (the same one: reported once)
        return gate[0]
    try:
        decode_object_bytes(bytes(blob), what)
        problem = parse_archive(blob, what).members_crc_problem()  # the records the decode left unread too
    except CkptError as exc:
        if isinstance(exc, (UnsafePickleError, PickleLimitError, ArchiveError)):
            return None  # trusted (--trust-global): the gate above said what it is
        rule = CRC_MISMATCH if isinstance(exc, CorruptRecord) else ITEM_UNDECODABLE
        return finding(rule, path, f"{what}: {without_path(exc, what)}")
    return None if problem is None else finding(CRC_MISMATCH, path, f"{what}: {problem}")
