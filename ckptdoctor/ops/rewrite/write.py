"""A staged rewrite of a checkpoint's keys, the writer of ``strip-frozen`` and ``edit``: build the new checkpoint in
a staging dir, then swap it in.

The complete new checkpoint is written into a hidden staging dir beside the target (same filesystem) and only then
renamed into place, so an interrupted run leaves the source untouched and no half-written output under the target's
name. ``--in-place`` swaps the iteration dir and the staging dir atomically (Linux ``renameat2(RENAME_EXCHANGE)``;
two renames elsewhere), then the old one is renamed to ``<iter>.bak-<stamp>`` (kept unless ``--no-backup``; Megatron
ignores names that are not ``iter_*``). ``metadata.json`` is written last inside the staging dir, as Megatron does,
followed only by a fresh ``integrity.json`` when the source had one (the manifest ``seal`` writes, over the new
files; the source's own is verified first, so a changed source byte is refused instead of re-sealed).

Once the swap has happened no error path deletes the old tree, and Ctrl-C is held back from just before the
swap until the old tree has its backup name. Staging names carry a timestamp and a random token (the in-place
one also the original dir's inode number, so ``check`` can tell from the disk which tree it holds; see
:mod:`ckptdoctor.rules.leftovers`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

from ckptdoctor import atomic, dist, locking
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.data_files import storage_problems
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_DCP
from ckptdoctor.formats.plain_dcp import STEP_DIR_RE
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME, output_bridge_tracker
from ckptdoctor.locate import TRACKER_NAME
from ckptdoctor.ops.pickle_gate import refuse_unsafe_pickles
from ckptdoctor.ops.rewrite import metadata as metadata_write
from ckptdoctor.ops.rewrite.request import KeyEdit, Progress, StripResult, dir_bytes
from ckptdoctor.ops.seal import write_manifest
from ckptdoctor.ops.staged_integrity import carried_hashes
from ckptdoctor.ops.staging import SwapState, not_carried, swap_in_place, swap_output
from ckptdoctor.rules import leftovers
from ckptdoctor.rules.integrity import INTEGRITY_NAME
from ckptdoctor.tree_removal import remove_tree
from ckptdoctor.write_guard import is_local, refuse_remote_write

# Files of an iteration dir rebuilt (not copied) by strip-frozen. Megatron's integrity.json is not carried (its
# sha256s are those of the unstripped files): a source that has one gets a fresh one, written as `seal` does.
_REBUILT = {".metadata", "metadata.json", "common.pt", INTEGRITY_NAME}


def input_was_save_dir(checkpoint: Checkpoint) -> bool:
    location = checkpoint.location
    if location.save_dir is None:
        return False
    if not is_local(location.save_dir):  # a URL: compared as given (nothing to resolve)
        given_url = str(location.input_path).rstrip("/")
        return given_url in (str(location.save_dir).rstrip("/"), str(location.save_dir / TRACKER_NAME))
    given = Path(location.input_path).resolve()
    return given in (location.save_dir.resolve(), (location.save_dir / TRACKER_NAME).resolve())


def _dir_bytes(directory: Path) -> int:
    return dir_bytes(directory)


def _check_output(
    checkpoint: Checkpoint, output: Path, force: bool, source_local: bool = True, in_place_option: bool = True
) -> None:
    source = checkpoint.location.save_dir or checkpoint.iteration_dir
    if source_local:  # a local output cannot lie inside a source on object storage
        hint = "use --in-place to replace the source" if in_place_option else "write the output elsewhere"
        atomic.refuse_overlap(output, [source, checkpoint.iteration_dir], hint)
    try:
        if output.exists():
            if not output.is_dir():
                raise CkptError(f"{output}: exists and is not a directory")
            if any(output.iterdir()) and not force:
                raise CkptError(f"{output}: exists and is not empty (use --force to replace it)")
        parent = next((p for p in output.absolute().parents if p.exists()), None)
    except OSError as exc:
        raise CkptError(f"{exc.filename or output}: cannot use as output ({exc.strerror})") from None
    if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise CkptError(f"{parent}: not a writable directory; cannot write {output}")


def structural_problems(checkpoint: Checkpoint) -> list[str]:
    """What check reports as errors about the storage (CKD112-114: chunks without a storage entry, missing,
    unreadable or truncated data files), one line each naming the file; an unreferenced file is no problem here."""
    problems, _ = storage_problems(checkpoint)
    return [f"{p.path}: {p.code} {p.detail}" for p in problems if p.fatal]


def check_integrity(checkpoint: Checkpoint, verb: str = "strip", carried: Collection[str] | None = None) -> None:
    """Refuse a structurally damaged checkpoint, and one whose bytes items (``carried``: those the write keeps),
    ``common.pt`` or Bridge files hold a pickle a real load would refuse or execute (the ``.metadata`` is written
    anew and read back through the gate)."""
    problems = structural_problems(checkpoint)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CkptError(f"{problems[0]}{more}; refusing to {verb} a damaged checkpoint")
    refuse_unsafe_pickles(checkpoint, carried, metadata_carried=False)


def check_target(
    checkpoint: Checkpoint,
    output: Path | None,
    in_place: bool,
    force: bool,
    keep_backup: bool = True,
    remote_source: bool = False,
    in_place_option: bool = True,
) -> None:
    """Refuse a bad target before any work is done (nothing is written by a refusal). ``remote_source``: the
    command reads a source on object storage chunk by chunk and writes a new local ``output`` (convert), so only
    the output must be local. ``in_place_option``: the command has ``--in-place`` (a refusal may point to it)."""
    dist.refuse_write("this command")
    if in_place == (output is not None):
        raise CkptError("give exactly one of --output DIR and --in-place")
    source_local = is_local(checkpoint.iteration_dir)
    if not (remote_source and output is not None and not source_local):
        refuse_remote_write(checkpoint.iteration_dir, in_place)  # writes are local only
    if output is not None:
        refuse_remote_write(output, in_place=False)
    if output is not None:
        _check_output(checkpoint, output, force, source_local, in_place_option)
        return
    iteration_dir = checkpoint.iteration_dir
    if not os.access(iteration_dir.parent, os.W_OK):
        raise CkptError(f"{iteration_dir.parent}: not writable; cannot replace the checkpoint in place")
    if iteration_dir.is_symlink() and not keep_backup:
        raise CkptError(
            f"{iteration_dir}: is a symbolic link (to {os.path.realpath(iteration_dir)}); "
            "--in-place --no-backup would replace the link and delete only the link, not the old "
            "checkpoint: run it on the link's target instead"
        )


def _fill_iteration_dir(
    checkpoint: Checkpoint,
    edit: KeyEdit,
    stage: Path,
    progress: Progress,
    result: StripResult,
) -> None:
    src = checkpoint.iteration_dir
    checkpoint.release_entries()  # not held beside the records of the source's .metadata
    rebuilt = metadata_write.edited(checkpoint, edit, stage, progress, result)
    if checkpoint.location.has_common_pt and "common.pt" not in rebuilt:
        atomic.link_or_copy(src / "common.pt", stage / "common.pt")
    for path in sorted(src.iterdir()):
        name = path.name
        if name in _REBUILT or name in rebuilt or name.endswith(".distcp") or not_carried(name):
            continue
        _carry(path, stage / name, name, result)
    # Last, as Megatron does: a dir without metadata.json is an incomplete checkpoint to every reader. A plain
    # DCP save has none (Megatron would then read it as torch_dist): its .metadata, written above, is its own.
    if checkpoint.location.backend != BACKEND_DCP:
        atomic.write_atomic(stage / "metadata.json", (src / "metadata.json").read_bytes())
    if (src / INTEGRITY_NAME).is_file():
        # Still in the staging dir: no run leaves a checkpoint under its name whose manifest lists other bytes.
        write_manifest(stage, None if edit.compact else carried_hashes(src, stage))
        result.resealed = True
        atomic.fault_point(f"{edit.step}:resealed")
    atomic.fsync_dir(stage)


def _carry(path: Path, dest: Path, name: str, result: StripResult) -> None:
    """Link (or copy) what the rewrite does not change into the staged dir: a file (at the top, through a symlink
    too, as before), a dir (ModelOpt's nested ``modelopt_state`` checkpoint, Megatron-Bridge's ``tokenizer``) file
    by file, a symlink inside it, or one at the top to a dir or to nothing, as the same link (never followed). An
    in-place rewrite swaps the whole iteration dir, so what is not carried would be left in the backup only (and
    deleted with ``--no-backup``); only special files (FIFOs, sockets, devices) are not, and the report names them.
    Iterative: a hostile dir nesting thousands deep costs no recursion."""
    pending = [(path, dest, name, False)]
    made: list[Path] = []  # dirs created here: fsynced once filled (the staging dir itself is fsynced last)
    while pending:
        path, dest, name, nested = pending.pop()
        if path.is_symlink() and (nested or not path.is_file()):
            os.symlink(os.readlink(path), dest)
            result.carried.append(name)
        elif path.is_file():
            atomic.link_or_copy(path, dest)
            result.carried.append(name)
        elif path.is_dir():
            dest.mkdir()
            made.append(dest)
            children = sorted(path.iterdir(), reverse=True)  # popped in name order
            pending += [(child, dest / child.name, f"{name}/{child.name}", True) for child in children]
        else:
            result.skipped[name] = "a special file (FIFO, socket or device): not carried"
    for directory in reversed(made):
        atomic.fsync_dir(directory)


def write_keys(
    checkpoint: Checkpoint,
    edit: KeyEdit,
    output: Path | None,
    in_place: bool = False,
    force: bool = False,
    keep_backup: bool = True,
    progress: Callable[[int], None] | None = None,
) -> StripResult:
    """Write the source with ``edit`` applied to ``output`` (or in place); returns what was written."""
    started = time.perf_counter()
    check_target(checkpoint, output, in_place, force, keep_backup)
    src_iter = checkpoint.iteration_dir
    target = src_iter if in_place else output
    assert target is not None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CkptError(f"{exc.filename or target.parent}: cannot create ({exc.strerror})") from None
    # In place: the checkpoint lock (re-entrant: strip_frozen holds it already). An --output dir needs none:
    # the staging name is unique and the final rename never replaces an existing dir (but with --force).
    lock = locking.checkpoint_lock(target) if in_place else contextlib.nullcontext()
    with lock:
        return _write_locked(checkpoint, edit, target, in_place, keep_backup, progress, started)


def _write_locked(
    checkpoint: Checkpoint,
    edit: KeyEdit,
    target: Path,
    in_place: bool,
    keep_backup: bool,
    progress: Callable[[int], None] | None,
    started: float,
) -> StripResult:
    src_iter = checkpoint.iteration_dir
    save_layout = not in_place and input_was_save_dir(checkpoint)
    if in_place:  # the original's inode in the name: check tells from the disk which tree the staging dir holds
        prefix = f".{target.name}{leftovers.SWAP_MARK}{os.lstat(src_iter).st_ino}-"
    else:
        prefix = f".{target.name}{leftovers.TMP_MARK}"
    swap = SwapState()
    staging: Path | None = None
    try:
        # An interrupt between the mkdir and the assignment is delivered after it, inside this try: nothing
        # that created the staging dir runs outside the handler that removes it.
        with atomic.defer_sigint():
            staging = atomic.make_unique_dir(target.parent, prefix)
        stage_iter = staging / src_iter.name if save_layout else staging
        result = StripResult(
            output=str(target),
            in_place=in_place,
            backup=None,
            files=[],
            bytes_copied=0,
            metadata_bytes=0,
            output_bytes=0,
            source_bytes=_dir_bytes(src_iter),
            iteration_dir=str(target / src_iter.name if save_layout else target),
        )
        atomic.fault_point(f"{edit.step}:staging-created")
        if save_layout:
            stage_iter.mkdir()
        _fill_iteration_dir(checkpoint, edit, stage_iter, progress, result)
        if save_layout:
            location = checkpoint.location
            value = "release" if location.release else str(location.iteration)
            if not STEP_DIR_RE.match(src_iter.name):  # TorchTitan keeps no tracker: it resumes from the newest step
                atomic.write_atomic(staging / TRACKER_NAME, value.encode())
            bridge_tracker = output_bridge_tracker(location.save_dir, src_iter)  # Megatron-Bridge's, where it had one
            if bridge_tracker is not None:
                atomic.write_atomic(staging / BRIDGE_TRACKER_NAME, bridge_tracker)
        result.output_bytes = _dir_bytes(stage_iter)
        atomic.fault_point(f"{edit.step}:before-swap")
        if in_place:
            backup = swap_in_place(src_iter, staging, keep_backup, swap, edit.step)
            result.backup = str(backup) if backup is not None else None
        else:
            swap_output(target, staging, swap, edit.step)
    except BaseException as exc:
        if staging is not None and not swap.done:  # only new data there: remove it (the source was not touched)
            remove_tree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CkptError(f"{exc.filename or staging}: cannot write ({exc.strerror})") from None
        raise
    result.seconds = round(time.perf_counter() - started, 3)
    return result
