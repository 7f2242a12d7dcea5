"""The Checkpoint model (entries, sections, data files, common state and args) and :func:`scan`, the one way
to build one: from metadata only, recording every problem found (see :mod:`ckptdoctor.problems`).

Tensor bytes are never read here; :mod:`ckptdoctor.values.read` streams them when values are asked for.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.args import args_as_dict, saved_config
from ckptdoctor.errors import CkptError, PickleLimitError, UnlistedGlobalError, UnsafePickleError, without_path
from ckptdoctor.formats import (
    BACKEND_DCP,
    has_common_pt,
    index_file,
    read_index,
    torch_dist,
)
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.dcp_index import CHUNK_STORAGE, STORAGE_LENGTH
from ckptdoctor.formats.legacy_torch import check_te_extra_state
from ckptdoctor.formats.plain_dcp import (
    FLAVOUR_NAMES,
    MEGATRON_COMMON_ITEMS,
    flavour_of,
    is_megatron,
    megatron_flavour,
)
from ckptdoctor.formats.plain_dcp import section_of as dcp_section_of
from ckptdoctor.formats.torch_dist import DcpChunk, DcpIndex, DcpItem
from ckptdoctor.formats.torch_zip import is_torch_zip, load_torch_zip
from ckptdoctor.locate import CheckpointLocation, iteration_location, locate, read_backend
from ckptdoctor.optimizer_keys import chain_prefix
from ckptdoctor.pickle.limits import current_limits
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.torch_stand_ins import DtypeRef
from ckptdoctor.pickle.unpickler import refuse_unlisted
from ckptdoctor.problems import (
    ARCHIVE_ANOMALY,
    INDEX_MISSING,
    INDEX_UNREADABLE,
    METADATA_JSON_MISSING,
    PICKLE_LIMIT,
    UNLISTED_GLOBAL,
    UNSAFE_PICKLE,
    UNSUPPORTED_FORMAT,
    Problem,
)
from ckptdoctor.storage.files import list_names
from ckptdoctor.storage.interface import StorageUnavailable

SECTIONS = ("model", "optimizer", "rng", "rerun", "common", "other")
_SECTION_PREFIXES = (
    ("optimizer.", "optimizer"),
    ("optimizer/", "optimizer"),
    ("rng_state", "rng"),
    ("rerun_state_machine_state", "rerun"),
    ("common_state", "common"),
    ("train_state", "other"),
    ("modelopt_state", "other"),
)
_SECTION_FIRST_LETTERS = frozenset(prefix[0] for prefix, _ in _SECTION_PREFIXES) | {"c"}  # chained_<i>.
COMMON_STATE_PREFIX = "common_state"
MAX_KEPT_ITEM_BYTES = 64 << 20  # Checkpoint.keep_item_bytes: bytes items kept for a second reader, in all


def section_of(key: str) -> str:
    """The checkpoint section a key belongs to; bare module keys (no prefix) are model keys, a chained optimizer's
    ``chained_<i>.optimizer.*`` items (:mod:`ckptdoctor.optimizer_keys`) optimizer keys."""
    # Runs for every key of a large checkpoint: most are model keys, rejected by their first letter.
    if key[:1] not in _SECTION_FIRST_LETTERS:
        return "model"
    for prefix, section in _SECTION_PREFIXES:
        if key.startswith(prefix):
            return section
    return "optimizer" if chain_prefix(key) else "model"


_FRAMING_SLACK = 1 << 20


@dataclass(slots=True)
class Entry(DcpItem):
    """One saved item: a tensor (global shape, dtype, chunks) or a bytes item (ShardedObject, extra state).

    Built directly by the metadata reader (one per key: up to hundreds of thousands), saving a second object
    per key; slotted (no ``__dict__`` per entry).
    """

    section: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.section = section_of(self.key)

    @property
    def nbytes(self) -> int:
        """Bytes on disk (serialized chunk sizes as stored)."""
        return sum(map(STORAGE_LENGTH, filter(None, map(CHUNK_STORAGE, self.chunks))))  # storage None: no location

    @property
    def numel(self) -> int:
        if self.shape is None:
            return 0
        n = 1
        for d in self.shape:
            n *= d
        return n

    def misranked_chunk(self) -> DcpChunk | None:
        """A chunk of this tensor whose offsets or sizes do not have its number of dims (None if there is none):
        readers that index a chunk by the tensor's axes skip or refuse such a tensor (``check`` reports it as CKD
        coverage)."""
        if self.kind != "tensor":
            return None
        ndim = len(self.shape or ())
        for chunk in self.chunks:
            if len(chunk.offsets) != ndim or len(chunk.sizes) != ndim:
                return chunk
        return None

    def require_chunk_ranks(self, iteration_dir: Path) -> None:
        """Refuse (:class:`CkptError` naming ``.metadata``) a tensor whose chunks do not have its number of dims:
        value readers index a chunk's offsets and sizes by the tensor's axes (``check`` reports it as CKD coverage)."""
        chunk = self.misranked_chunk()
        if chunk is not None:
            raise CkptError(
                f"{iteration_dir / '.metadata'}: {self.key}: chunk at {list(chunk.offsets)} of size "
                f"{list(chunk.sizes)} does not have the tensor's {len(self.shape or ())} dims"
            )

    def max_range_bytes(self, chunk: DcpChunk) -> int:
        """The most bytes one stored range of this item can legitimately span: a tensor chunk's elements plus
        torch.save framing (zip headers, data.pkl, alignment: well under 1 MiB); a bytes item, the pickle size
        limit. A hostile ``.metadata`` cannot make a reader pull a 100 GB range into memory."""
        nbytes = self.chunk_nbytes(chunk)
        return current_limits().max_bytes if nbytes is None else nbytes + _FRAMING_SLACK

    def chunk_nbytes(self, chunk: DcpChunk) -> int | None:
        """A tensor chunk's element bytes (numel x itemsize); None for a bytes item or an unknown dtype."""
        itemsize = DtypeRef.get(self.dtype.removeprefix("torch.")).itemsize if self.dtype else None
        if self.kind != "tensor" or itemsize is None:
            return None
        numel = 1
        for size in chunk.sizes:
            numel *= size
        return numel * itemsize

    @property
    def is_extra_state(self) -> bool:
        return "_extra_state" in self.key


@dataclass
class Checkpoint:
    location: CheckpointLocation
    entries: dict[str, Entry]
    data_files: dict[str, int]  # relative path -> size in bytes, of files present on disk
    dcp: DcpIndex | None = None
    _common: Any = field(default=None, repr=False)
    _common_loaded: bool = field(default=False, repr=False)
    common_unlisted: list[UnlistedGlobal] = field(
        default_factory=list, repr=False
    )  # CKD402 globals of the common state
    _config: tuple[dict[str, Any], str | None] | None = field(default=None, repr=False)
    # bytes items already read (the gate's pass, which reads them coalesced per file), so that a later rule reading
    # the same item (the extra-state census) makes no second request on object storage; bounded in total bytes
    _item_bytes: dict[str, bytes] = field(default_factory=dict, repr=False)
    _item_bytes_total: int = field(default=0, repr=False)
    _referenced: frozenset[str] | None = field(default=None, repr=False)  # referenced_files, computed once

    @property
    def iteration_dir(self) -> Path:
        return self.location.iteration_dir

    def release_entries(self) -> None:
        """Free the index (every entry and chunk) of a checkpoint whose entries will not be read again: a write
        command drops its source's before it re-reads what it wrote, so that two indexes are never in memory at
        once (at 200k keys each is ~200 MB). ``entries`` is then empty."""
        self.entries.clear()  # the DcpIndex's items are this dict
        self.data_files.clear()
        self._referenced = None

    def section_entries(self, section: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.section == section]

    @property
    def flavour(self) -> str | None:
        """Plain DCP only: whose conventions the state dict follows (:mod:`ckptdoctor.formats.plain_dcp`)."""
        return self.location.flavour

    @property
    def common_source(self) -> str | None:
        """Where the common (non-sharded) state lives: ``common.pt`` or the DCP bytes item's key; for a Megatron-LM
        plain DCP save, its top-level ``args`` item (``iteration`` and the others beside it)."""
        if self.location.backend == BACKEND_DCP:
            return "args" if is_megatron(self.flavour) else None
        if self.location.has_common_pt:
            return "common.pt"
        for key, entry in self.entries.items():
            if key.startswith(COMMON_STATE_PREFIX) and entry.kind == "bytes":
                return key
        return None

    def common_state(self) -> dict:
        """The common state dict (args, iteration, ...); raises :class:`CkptError` if unreadable."""
        if not self._common_loaded:
            self._common = self._load_common()
            self._common_loaded = True
        return self._common

    def _load_common(self) -> dict:
        if self.location.backend == BACKEND_DCP:
            return self._plain_dcp_common()
        source = self.common_source
        if source is None:
            raise CkptError(f"{self.iteration_dir}: no common state (neither common.pt nor a common_state item)")
        if source == "common.pt":
            path = self.iteration_dir / "common.pt"
            state = load_torch_zip(path, str(path), unlisted=self.common_unlisted)
            where = str(path)
        else:
            state = self.read_bytes_item(source, self.common_unlisted)
            where = f"{self.iteration_dir}: item {source}"
        if not isinstance(state, dict):
            error = CkptError(f"{where}: common state is a {type(state).__name__}, expected a dict")
            refuse_unlisted(self.common_unlisted, error)
            raise error
        return state

    def _plain_dcp_common(self) -> dict:
        """A plain DCP save's counterpart of the common state: Megatron-LM's top-level items (``args``,
        ``iteration``, ...), each decoded through the safe unpickler; empty for the other flavours."""
        if self.flavour is None or not is_megatron(self.flavour):
            return {}
        state = {
            name: self.read_bytes_item(name, self.common_unlisted)
            for name in MEGATRON_COMMON_ITEMS
            if name in self.entries and self.entries[name].kind == "bytes"
        }
        self.location.flavour = megatron_flavour(self.flavour, args_as_dict(state.get("args")))
        return state

    def saved_config(self) -> tuple[dict[str, Any], str | None]:
        """The saved config the arg rules check and where it is: Megatron-LM's args, else Megatron-Bridge's
        ``run_config.yaml`` model section (:func:`ckptdoctor.args.saved_config`); read once, so every caller
        of one run sees the same file."""
        if self._config is None:
            self._config = saved_config(self.common_state(), self.iteration_dir)
        return self._config

    @property
    def args(self) -> Any:
        """The saved ``argparse.Namespace`` (or None when the common state holds no args)."""
        return self.common_state().get("args")

    def referenced_files(self) -> frozenset[str]:
        """The data files the index places chunks in (present or not: ``data_files`` lists those on disk)."""
        if self._referenced is None:  # one pass over every chunk: inspect asks twice (layout, missing files)
            self._referenced = torch_dist.data_files_of(self.entries.values())
        return self._referenced

    def untrusted_globals_read(self) -> list[str]:
        """The globals off the allowlist (and not trusted with --trust-global) that the reads of ``.metadata`` and
        the common state so far met: read here as inert stand-ins, run by a real load (check: CKD402)."""
        read = [*(self.dcp.unlisted if self.dcp is not None else ()), *self.common_unlisted]
        return sorted({u.name for u in read if not u.trusted})

    def read_bytes_item(self, key: str, unlisted: list[UnlistedGlobal] | None = None) -> Any:
        """Decode a bytes item (ShardedObject, ``_extra_state``, ``common_state``) through the safe unpickler."""
        data, where = self.bytes_item_data(key)
        return decode_object_bytes(data, where, unlisted, listed=self.dcp is not None)

    def keep_item_bytes(self, key: str, data: bytes) -> None:
        """Remember a bytes item's stored bytes, read by a pass over many items, for :meth:`bytes_item_data`; up to
        :data:`MAX_KEPT_ITEM_BYTES` in all (beyond it an item is read again when asked for)."""
        if key not in self._item_bytes and self._item_bytes_total + len(data) <= MAX_KEPT_ITEM_BYTES:
            self._item_bytes[key] = data
            self._item_bytes_total += len(data)

    def bytes_item_data(self, key: str) -> tuple[bytes, str]:
        """A bytes item's stored bytes (not decoded) and how messages name it."""
        entry = self.entries[key]
        location = entry.chunks[0].storage if entry.chunks else None
        where = f"{self.iteration_dir}: item {key}"
        kept = self._item_bytes.get(key)
        if kept is not None:
            return kept, where
        if location is None:
            raise CkptError(f"{where}: no storage entry in .metadata")
        return torch_dist.read_range(self.iteration_dir, location, entry.max_range_bytes(entry.chunks[0])), where


def decode_object_bytes(
    data: bytes, where: str, unlisted: list[UnlistedGlobal] | None = None, listed: bool = True
) -> Any:
    """A Megatron ShardedObject's bytes, as its load hands it back: a DCP record is ``torch.save([obj])`` (megatron-core
    saves a rank's objects of one key as a list, ``listed``), unwrapped; a legacy zarr save's object file is
    ``torch.save(obj)`` (an rng state ``[dict]`` stays a list: unwrapping it too made zarr and torch_dist differ)."""
    if not is_torch_zip(data):
        return data
    obj = load_torch_zip(data, where, unlisted=unlisted)
    if isinstance(obj, io.BytesIO) and is_torch_zip(obj.getvalue()[:4]):
        obj = load_torch_zip(obj.getvalue(), where, unlisted=unlisted)
    if listed and isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if isinstance(obj, io.BytesIO) and obj.getvalue():
        # Transformer Engine 1.x extra state (Megatron saves torch.save([BytesIO])): TE's load torch.load()s it,
        # as a legacy save (unpickled from its first byte) when it is no zip archive
        if not is_torch_zip(obj.getvalue()[:4]):
            raise ArchiveError(f"{where}: a BytesIO that is no torch.save archive, which torch.load unpickles")
        load_torch_zip(obj.getvalue(), where, unlisted=unlisted)
    check_te_extra_state(obj, where, unlisted)  # Transformer Engine 2.x: a pickle in a uint8 tensor
    return obj


# --- scan: the one way to build a Checkpoint ----------------------------------------------------------------


@dataclass
class Scan:
    """What could be read of one iteration dir, and what is wrong with it."""

    location: CheckpointLocation
    checkpoint: Checkpoint | None  # None when the dir is in no format ckptdoctor reads
    problems: list[Problem]
    metadata: Any = field(default=None, repr=False)  # the unpickled DCP Metadata (``for_rewrite`` only)

    @property
    def index_known(self) -> bool:
        """The index was read: a missing common_state item (for instance) is really missing."""
        return self.checkpoint is not None and not any(p.code in _INDEX_CODES for p in self.problems)

    def raise_fatal(self) -> Checkpoint:
        """The checkpoint, or the first fatal problem as a :class:`CkptError`."""
        for problem in self.problems:
            if problem.fatal:
                raise problem.as_error()
        assert self.checkpoint is not None
        return self.checkpoint


_INDEX_CODES = frozenset({INDEX_MISSING, INDEX_UNREADABLE, UNSAFE_PICKLE, PICKLE_LIMIT, ARCHIVE_ANOMALY})


def scan(location: CheckpointLocation, for_rewrite: bool = False) -> Scan:
    """Read what can be read of ``location.iteration_dir`` (metadata only) and record every problem.

    Fills in ``location``'s backend, metadata.json and common.pt flag. Storage problems (missing or truncated
    data files) are not looked for here: :func:`storage_problems` costs a pass over every chunk."""
    directory = location.iteration_dir
    problems: list[Problem] = []
    try:
        names = set(list_names(directory))
    except OSError as exc:
        raise CkptError(f"{directory}: cannot list ({exc.strerror or exc})") from None
    if any(n.startswith("mp_rank_") for n in names):
        problems.append(
            Problem(
                UNSUPPORTED_FORMAT,
                directory,
                "legacy non-distributed checkpoint (mp_rank_* files, ckpt_format=torch): ckptdoctor reads "
                "torch_dist and zarr distributed checkpoints",
            )
        )
        return Scan(location, None, problems)
    backend = read_backend(location, names, problems)
    if backend is None:
        return Scan(location, None, problems)
    location.backend = backend
    location.has_common_pt = has_common_pt(backend, names)
    index = None
    name = index_file(backend)
    if name is not None and name not in names:
        problems.append(Problem(INDEX_MISSING, directory, f"{name} missing: the {backend} index cannot be read"))
    else:
        where = directory / name if name is not None else directory
        try:
            index = read_index(backend, directory, Entry, for_rewrite)
        except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
            problems.append(Problem(_refusal_code(exc), where, str(exc), error=exc))
        except StorageUnavailable:
            raise  # the storage failed, not the checkpoint: the command stops (exit 2)
        except CkptError as exc:
            problems.append(Problem(INDEX_UNREADABLE, where, without_path(exc, where, directory)))
    if index is None:
        return Scan(location, Checkpoint(location, {}, {}), problems)
    checkpoint = Checkpoint(location, index.items, index.data_files, dcp=index.dcp)
    if any(p.code == METADATA_JSON_MISSING for p in problems) and _plain_dcp(checkpoint):
        problems = [p for p in problems if p.code != METADATA_JSON_MISSING]
        location.backend = BACKEND_DCP
        location.flavour = flavour_of({key: entry.kind for key, entry in checkpoint.entries.items()})
        for entry in checkpoint.entries.values():
            entry.section = dcp_section_of(entry.key, location.flavour)
    return Scan(location, checkpoint, problems, index.metadata)


def _plain_dcp(checkpoint: Checkpoint) -> bool:
    """Whether an index without metadata.json is a plain PyTorch DCP save (Megatron-LM torch_dcp / fsdp_dtensor,
    FSDP2, TorchTitan, any ``dcp.save``), not an interrupted torch_dist one: no common state (common.pt or a
    common_state item, which every torch_dist save has), and either DCP's default planner's flattening map in
    ``.metadata`` (torch_dist saves unflattened) or Megatron-LM's top-level ``args`` and ``iteration`` items."""
    if checkpoint.common_source is not None:
        return False
    entries = checkpoint.entries
    megatron = all((e := entries.get(name)) is not None and e.kind == "bytes" for name in ("args", "iteration"))
    return megatron or (checkpoint.dcp is not None and checkpoint.dcp.flattened)


def refuse_plain_dcp(
    checkpoint: Checkpoint, command: str, does: str = "writes Megatron torch_dist checkpoints only; nothing was changed"
) -> Checkpoint:
    """``checkpoint``, or one :class:`CkptError` line naming its flavour where it is a plain DCP save, which the
    write commands (their outputs are Megatron torch_dist: metadata.json, common state) do not write."""
    if checkpoint.location.backend == BACKEND_DCP:
        name = FLAVOUR_NAMES.get(checkpoint.flavour or "", "plain PyTorch DCP")
        raise CkptError(
            f"{checkpoint.iteration_dir}: {name} checkpoint (plain PyTorch DCP, no metadata.json): {command} {does}"
        )
    return checkpoint


def _refusal_code(error: CkptError) -> str:
    if isinstance(error, UnlistedGlobalError):
        return UNLISTED_GLOBAL
    if isinstance(error, PickleLimitError):
        return PICKLE_LIMIT
    if isinstance(error, ArchiveError):
        return ARCHIVE_ANOMALY
    return UNSAFE_PICKLE


def scan_path(path: str | Path, iteration: str | int | None = None, for_rewrite: bool = False) -> Scan:
    """:func:`scan` of the iteration dir a user's path names (a save dir, an iteration dir, a file, a URL)."""
    return scan(locate(path, iteration), for_rewrite)


def scan_iteration_dir(iteration_dir: Path) -> Scan:
    """:func:`scan` of one iteration dir as given (``check`` walks save dirs itself)."""
    return scan(iteration_location(iteration_dir))


def open_checkpoint(path: str | Path, iteration: str | int | None = None, writer: str | None = None) -> Checkpoint:
    """Locate and index a checkpoint from metadata; the one entry point operations use. ``writer``: the write
    command that will change it (a plain DCP save is then refused, :func:`refuse_plain_dcp`)."""
    checkpoint = scan_path(path, iteration).raise_fatal()
    return checkpoint if writer is None else refuse_plain_dcp(checkpoint, writer)


class HeldMetadata:
    """The ``.metadata`` object (stand-ins) of a checkpoint about to be rewritten, passed on by reference and
    taken once by the writer (:meth:`take`), which then holds the only reference: it lets the stand-ins go as
    soon as the new pickle exists (:func:`ckptdoctor.pickle.unpickler.dumps_taken`), so that reading that pickle back
    reuses their memory (they are the largest thing a rewrite holds, ~1.4 KB per chunk)."""

    __slots__ = ("_metadata",)

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata

    def take(self) -> Any:
        metadata, self._metadata = self._metadata, None
        if metadata is None:
            raise ValueError("the .metadata object was taken already")
        return metadata


def open_for_rewrite(
    path: str | Path, iteration: str | int | None = None, writer: str | None = "this command"
) -> tuple[Checkpoint, HeldMetadata | None]:
    """:func:`open_checkpoint` for a command that rewrites ``.metadata``: also the metadata object, from the same
    read (one pass of the safety scan instead of two), held for the writer to take; None where there is no
    ``.metadata`` (legacy zarr). A plain DCP save is refused (:func:`refuse_plain_dcp`) unless ``writer`` is None
    (a command that writes plain DCP too: edit)."""
    result = scan_path(path, iteration, for_rewrite=True)
    checkpoint = result.raise_fatal()
    if writer is not None:
        refuse_plain_dcp(checkpoint, writer)
    metadata, result.metadata = result.metadata, None
    return checkpoint, None if metadata is None else HeldMetadata(metadata)
