"""``ckptdoctor seal``: write Megatron's ``integrity.json`` for a checkpoint that has none (one that has a manifest
listing its files is left unchanged, exit 0; ``force`` re-seals it).

The manifest is exactly what megatron-core's ``save_integrity_manifest``
(``megatron/core/dist_checkpointing/validation.py``) writes and ``verify_integrity_manifest`` reads:
``{"algorithm": "sha256", "files": {name: hexdigest}}`` as ``json.dump(..., indent=2)``, listing every regular
file directly in the iteration dir (sorted by name, ``integrity.json`` itself excluded), each hashed whole.

Files are hashed by a pool of threads (``hashlib`` releases the GIL while hashing, so the pool scales with the
cores and the disk); under torchrun each rank hashes a share of the files balanced by bytes
(:mod:`ckptdoctor.parallel`) and rank 0 alone locks, checks for changes and writes. The checkpoint is sealed
only when ``check`` finds no error in it, under the checkpoint lock, and each file's size and mtime are
compared before and after hashing, so a file changed meanwhile (a training job still writing) is refused
instead of sealed. The manifest is written atomically.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import dist, locking, parallel
from ckptdoctor.atomic import (
    fsync_dir,
    keep_previous,
    link_or_copy,
    make_unique_dir,
    refuse_overlap,
    timestamp,
    write_atomic,
)
from ckptdoctor.checkpoint import refuse_plain_dcp, scan_path
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_ZARR
from ckptdoctor.locate import TRACKER_NAME, CheckpointLocation
from ckptdoctor.ops.check import CheckOptions, check_iteration_dir
from ckptdoctor.ops.pickle_gate import refusal
from ckptdoctor.ops.staging import SwapState, not_carried, quarantine_dir, swap_output
from ckptdoctor.parallel import default_jobs
from ckptdoctor.progress import Progress
from ckptdoctor.rules import ERROR, is_safety, leftovers
from ckptdoctor.rules.integrity import INTEGRITY_NAME, sha256_file
from ckptdoctor.tree_removal import remove_tree

SCHEMA = "ckptdoctor.seal/1"
ALGORITHM = "sha256"  # megatron.core.dist_checkpointing.validation._HASH_ALGORITHM
_MANIFEST_CODES = ("CKD301", "CKD302", "CKD303", "CKD304")  # about the manifest --force replaces

Advance = Callable[[int], None]  # bytes just hashed


@dataclass
class SealResult:
    schema: str
    iteration_dir: str
    manifest: str
    files: int
    bytes: int
    jobs: int
    seconds: float
    replaced: bool  # an existing integrity.json was replaced (--force)
    notes: list[str] = field(default_factory=list)
    unchanged: bool = False  # already sealed (a manifest listing every file), nothing written or hashed


def manifest_files(iteration_dir: Path) -> list[Path]:
    """The files Megatron's ``save_integrity_manifest`` lists: regular files directly in the dir, sorted."""
    return [
        p for p in sorted(iteration_dir.iterdir(), key=lambda p: str(p)) if p.is_file() and p.name != INTEGRITY_NAME
    ]


def manifest_bytes(hashes: dict[str, str]) -> bytes:
    """The manifest as Megatron writes it (``json.dump(payload, f, indent=2)``, no trailing newline)."""
    return json.dumps({"algorithm": ALGORITHM, "files": hashes}, indent=2).encode("utf-8")


def hash_files(paths: list[Path], jobs: int, progress: Advance | None = None) -> dict[str, str]:
    """name -> sha256 hexdigest of each file (in the order of ``paths``), hashed by ``jobs`` threads; under
    torchrun each rank hashes its share of the files (balanced by bytes) and every rank gets all digests."""
    sizes = [p.stat().st_size for p in paths]
    done = None if progress is None else (lambda index: progress(sizes[index]))
    digests = parallel.map_units(sizes, lambda index: sha256_file(paths[index]), jobs, done, threads=True)
    return {p.name: digest for p, digest in zip(paths, digests)}


def write_manifest(iteration_dir: Path, hashes: dict[str, str] | None = None, jobs: int | None = None) -> int:
    """Write ``iteration_dir``'s ``integrity.json`` atomically: ``hashes`` (name -> sha256 of
    :func:`manifest_files`), or every file hashed now. Returns the bytes hashed (0 when ``hashes`` is given).

    The one writer of the manifest: ``seal`` and ``strip-frozen`` (which re-seals the checkpoint it builds).
    """
    hashed = 0
    if hashes is None:
        files = manifest_files(iteration_dir)
        hashed = sum(p.stat().st_size for p in files)
        hashes = hash_files(files, jobs or default_jobs())
    write_atomic(iteration_dir / INTEGRITY_NAME, manifest_bytes(hashes))
    return hashed


def _snapshot(paths: list[Path]) -> dict[str, tuple[int, int]]:
    out = {}
    for p in paths:
        st = p.stat()
        out[p.name] = (st.st_size, st.st_mtime_ns)
    return out


def _refuse_changed(
    iteration_dir: Path, files: list[Path], before: dict[str, tuple[int, int]], hashes: dict[str, str]
) -> None:
    """Refuse (nothing written) where a file changed, came or went since ``before``: a manifest would record
    hashes of bytes that are no longer there."""
    if _snapshot(files) != before or [p.name for p in manifest_files(iteration_dir)] != list(hashes):
        raise CkptError(
            f"{iteration_dir}: files changed while they were hashed (is a job still writing this checkpoint?); "
            "nothing was written"
        )


def _sealable(path: str | Path, iteration: str | None) -> CheckpointLocation:
    """Where the checkpoint ``path`` names is; a plain DCP save is refused (its manifest would be Megatron's)."""
    scanned = scan_path(path, iteration)
    if scanned.checkpoint is not None:
        refuse_plain_dcp(scanned.checkpoint, "seal")
    if scanned.location.backend == BACKEND_ZARR:
        # Megatron's manifest names files directly in the dir; a zarr save keeps its tensors in subdirectories, so
        # a manifest would vouch for the common state alone.
        raise CkptError(
            f"{scanned.location.iteration_dir}: legacy zarr checkpoint: its tensors are files in per-tensor "
            f"subdirectories, which {INTEGRITY_NAME} (file names in the dir only) cannot list; seal writes "
            "torch_dist manifests only; nothing was changed"
        )
    return scanned.location


def seal(
    path: str | Path,
    iteration: str | None = None,
    jobs: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> SealResult:
    """Hash every file of the checkpoint ``path`` names and write ``integrity.json`` (see the module doc).

    ``progress`` gets one "hashing" phase, advanced as files finish.
    """
    location = _sealable(path, iteration)
    iteration_dir = location.iteration_dir
    jobs = jobs or default_jobs()
    manifest = iteration_dir / INTEGRITY_NAME
    group = dist.group()
    speaks = group is None or group.rank == 0  # under torchrun rank 0 locks and writes, every rank hashes
    with locking.checkpoint_lock(iteration_dir) if speaks else contextlib.nullcontext():
        leftovers.refuse_if_interrupted(iteration_dir)
        existed = manifest.exists() or manifest.is_symlink()  # a dangling link too (CKD303)
        if existed and not force:  # "seal if not sealed": done, unless the manifest does not describe the dir
            return _already_sealed(iteration_dir, manifest, jobs)
        # Never seal a checkpoint that fails check: the manifest would vouch for a broken save.
        found = check_iteration_dir(iteration_dir, iteration_dir, CheckOptions(verify_integrity=True))
        errors = [f for f in found if f.severity == ERROR and not (existed and f.code in _MANIFEST_CODES)]
        gate = [f for f in errors if is_safety(f.code)]
        if gate:  # a manifest would vouch for a pickle that runs code in the next loader
            raise refusal(gate[0])
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise CkptError(
                f"{iteration_dir}: refusing to seal a checkpoint that fails check: {errors[0].path}: "
                f"{errors[0].code} {errors[0].message}{more}"
            )
        notes = [
            f"the previous manifest disagreed: {f.code} {f.path}: {f.message}"
            for f in found
            if existed and f.code in _MANIFEST_CODES
        ]
        files = manifest_files(iteration_dir)
        before = _snapshot(files)
        total = sum(size for size, _ in before.values())
        hashes, seconds = _hash_timed(files, total, jobs, progress)
        if speaks:
            _refuse_changed(iteration_dir, files, before, hashes)
        if speaks:
            if existed:  # the manifest --force replaces is the record of the old hashes: kept beside, never lost
                kept = _keep_previous_manifest(iteration_dir, manifest)
                if kept is not None:
                    notes.append(f"the previous manifest is kept as {kept}")
            write_manifest(iteration_dir, hashes)
    used = max(1, min(jobs, len(hashes)))  # the threads that hashed: one a file at most (parallel.map_units)
    return SealResult(SCHEMA, str(iteration_dir), str(manifest), len(hashes), total, used, seconds, existed, notes)


def seal_copy(
    path: str | Path,
    iteration: str | None,
    output: Path,
    *,
    files_from: Path | None = None,
    jobs: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> SealResult:
    """Write a sealed copy of the checkpoint ``path`` names to the new dir ``output``: every file of its iteration
    dir hard-linked (or copied) there and an ``integrity.json`` over them; the source is not changed (``seal -o``).

    The source is checked and hashed where it is (on object storage: streamed, nothing downloaded whole);
    ``files_from`` is the local stand-in of its iteration dir to link from (a source on object storage, whose data
    files are carried from the source objects when the copy is delivered). A source whose manifest already lists
    its files is refused without ``force`` (copy it as it is). Given the save dir, ``output`` is a save dir too
    (iteration dir and tracker)."""
    if dist.group() is not None:  # one writer of the copy: the ranks would race for the output
        raise CkptError("seal -o runs in one process, not under torchrun (use --jobs for parallel hashing)")
    location = _sealable(path, iteration)
    iteration_dir = location.iteration_dir
    if files_from is None:  # --force replaces the output: never the source, a dir holding it, or one inside it
        source_paths = [Path(location.input_path), iteration_dir, *([location.save_dir] if location.save_dir else [])]
        refuse_overlap(output, source_paths, "seal without -o writes the manifest into the source")
        # shared: other copies may read it at the same time, an in-place write may not change it meanwhile
        with locking.checkpoint_lock(iteration_dir, exclusive=False, optional=True):
            return _seal_copy(location, output, files_from, jobs, force, progress)
    return _seal_copy(location, output, files_from, jobs, force, progress)


def _seal_copy(
    location: CheckpointLocation,
    output: Path,
    files_from: Path | None,
    jobs: int | None,
    force: bool,
    progress: Progress | None,
) -> SealResult:
    iteration_dir = location.iteration_dir
    leftovers.refuse_if_interrupted(iteration_dir)
    jobs = jobs or default_jobs()
    existed = (iteration_dir / INTEGRITY_NAME).is_file()
    if existed and not force:
        raise CkptError(
            f"{iteration_dir / INTEGRITY_NAME}: the checkpoint is already sealed; copy it as it is, "
            "or use --force to re-seal the copy"
        )
    found = check_iteration_dir(iteration_dir, iteration_dir, CheckOptions(verify_integrity=True))
    errors = [f for f in found if f.severity == ERROR and not (existed and f.code in _MANIFEST_CODES)]
    gate = [f for f in errors if is_safety(f.code)]
    if gate:
        raise refusal(gate[0])
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CkptError(
            f"{iteration_dir}: refusing to seal a checkpoint that fails check: {errors[0].path}: "
            f"{errors[0].code} {errors[0].message}{more}"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not force:
        raise CkptError(f"{output}: exists and is not empty (use --force to replace it)")
    files = manifest_files(iteration_dir)
    total = sum(p.stat().st_size for p in files)
    before = _snapshot(files) if files_from is None else None  # object storage: no mtimes (its objects stay put)
    hashes, seconds = _hash_timed(files, total, jobs, progress)
    if before is not None:
        _refuse_changed(iteration_dir, files, before, hashes)
    save_dir = location.save_dir
    given = str(location.input_path).rstrip("/")
    given_save_dir = save_dir is not None and given in (str(save_dir), str(save_dir / TRACKER_NAME))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = make_unique_dir(output.parent, f".{output.name}{leftovers.TMP_MARK}")
    swap = SwapState()
    try:
        stage_iter = staging / iteration_dir.name if given_save_dir else staging
        stage_iter.mkdir(exist_ok=True)
        source = files_from or iteration_dir
        for item in sorted(source.rglob("*")):
            relative = item.relative_to(source)
            if not_carried(item.name):
                continue
            if item.is_dir():
                (stage_iter / relative).mkdir(exist_ok=True)
            elif item.name != INTEGRITY_NAME or item.parent != source:
                link_or_copy(item, stage_iter / relative)
        if before is not None:
            _refuse_changed(iteration_dir, files, before, hashes)  # the links are the files hashed
        write_manifest(stage_iter, hashes)
        if given_save_dir:
            value = "release" if location.release else str(location.iteration)
            write_atomic(staging / TRACKER_NAME, value.encode())
        fsync_dir(stage_iter)
        swap_output(output, staging, swap, "seal")
    except BaseException as exc:
        if not swap.done:
            remove_tree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CkptError(f"{exc.filename or staging}: cannot write ({exc.strerror})") from None
        raise
    written = output / iteration_dir.name if given_save_dir else output
    notes = ["the source's previous manifest is not carried: the copy has a fresh one"] if existed else []
    used = max(1, min(jobs, len(hashes)))  # the threads that hashed: one a file at most (parallel.map_units)
    return SealResult(
        SCHEMA, str(written), str(written / INTEGRITY_NAME), len(hashes), total, used, seconds, existed, notes
    )


def _already_sealed(iteration_dir: Path, manifest: Path, jobs: int) -> SealResult:
    """The result for a checkpoint whose ``integrity.json`` is a manifest listing exactly its files: unchanged, no
    file hashed (``check`` verifies the hashes). A manifest that does not parse or lists other files is refused,
    naming --force; a checkpoint that fails the gate is refused as by every write command."""
    found = check_iteration_dir(iteration_dir, iteration_dir, CheckOptions(verify_integrity=False))
    gate = [f for f in found if f.severity == ERROR and is_safety(f.code)]
    if gate:  # as every write command: a checkpoint that fails the gate is refused, sealed or not
        raise refusal(gate[0])
    wrong = [f for f in found if f.code in _MANIFEST_CODES]
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise CkptError(
            f"{manifest}: the checkpoint holds a manifest that does not describe it: {wrong[0].code} "
            f"{wrong[0].message}{more}; use --force to re-seal it"
        )
    files = len(manifest_files(iteration_dir))
    note = "already sealed, unchanged (--force re-seals it; `ckptdoctor check` verifies the hashes)"
    return SealResult(SCHEMA, str(iteration_dir), str(manifest), files, 0, jobs, 0.0, False, [note], unchanged=True)


def _keep_previous_manifest(iteration_dir: Path, manifest: Path) -> Path | None:
    """The manifest about to be replaced, kept in ``<iter>.quarantine-<stamp>/`` beside the dir (so the new manifest
    need not list it): hard-linked, or moved there where it is not a regular file."""
    return keep_previous(manifest, timestamp(), into=quarantine_dir(iteration_dir))


def _hash_timed(files: list[Path], total: int, jobs: int, progress: Progress | None) -> tuple[dict[str, str], float]:
    """The sha256 of each file (``hash_files``) with a "hashing" progress of ``total`` bytes, and the seconds taken."""
    if progress is not None:
        progress.start("hashing", total)
    start = time.perf_counter()
    try:
        hashes = hash_files(files, jobs, progress.advance if progress is not None else None)
    finally:
        if progress is not None:
            progress.finish()
    return hashes, time.perf_counter() - start
