"""``ckptdoctor strip-frozen``, writing half: build the stripped checkpoint in a staging dir, then swap it in.

The complete new checkpoint is written into a hidden staging dir beside the target (same filesystem) and only
then renamed into place, so an interrupted run leaves the source untouched and no half-written output under
the target's name. ``--in-place`` swaps the iteration dir and the staging dir atomically (Linux
``renameat2(RENAME_EXCHANGE)``; two renames elsewhere), then the old one is renamed to ``<iter>.bak-<stamp>``
(kept unless ``--no-backup``; Megatron ignores names that are not ``iter_*``). ``metadata.json`` is written
last inside the staging dir, as Megatron does.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import atomic
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import dcp_writer, torch_dist
from ckptdoctor.formats.dcp_writer import CopiedFile
from ckptdoctor.layout import TRACKER_NAME
from ckptdoctor.ops.strip import StripPlan

# Files of an iteration dir rebuilt (not copied) by strip-frozen, and those deliberately not carried over.
_REBUILT = {".metadata", "metadata.json", "common.pt"}
_STALE = {"integrity.json": "sha256 manifest of the unstripped files (stale after stripping)"}


@dataclass
class StripResult:
    output: str  # the dir written: a save dir (tracker + iteration dir) or an iteration dir
    iteration_dir: str
    in_place: bool
    backup: str | None
    files: list[CopiedFile]
    bytes_copied: int
    metadata_bytes: int
    output_bytes: int  # every file of the new iteration dir
    source_bytes: int  # every file of the source iteration dir
    carried: list[str] = field(default_factory=list)  # other files linked or copied over
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was not carried
    seconds: float = 0.0


def input_was_save_dir(checkpoint: Checkpoint) -> bool:
    location = checkpoint.location
    if location.save_dir is None:
        return False
    given = Path(location.input_path).resolve()
    return given in (location.save_dir.resolve(), (location.save_dir / TRACKER_NAME).resolve())


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _check_output(checkpoint: Checkpoint, output: Path, force: bool) -> None:
    source = (checkpoint.location.save_dir or checkpoint.iteration_dir).resolve()
    iteration_dir = checkpoint.iteration_dir.resolve()
    target = output.resolve()
    for protected in {source, iteration_dir}:
        if target == protected or protected in target.parents or target in protected.parents:
            raise CkptError(f"{output}: is, contains or lies inside the source checkpoint {protected}; "
                            "use --in-place to replace the source")
    if output.exists():
        if not output.is_dir():
            raise CkptError(f"{output}: exists and is not a directory")
        if any(output.iterdir()) and not force:
            raise CkptError(f"{output}: exists and is not empty (use --force to replace it)")


def check_target(checkpoint: Checkpoint, output: Path | None, in_place: bool, force: bool) -> None:
    """Refuse a bad target before any work is done (nothing is written by a refusal)."""
    if in_place == (output is not None):
        raise CkptError("give exactly one of --output DIR and --in-place")
    if output is not None:
        _check_output(checkpoint, output, force)
    elif not os.access(checkpoint.iteration_dir.parent, os.W_OK):
        raise CkptError(f"{checkpoint.iteration_dir.parent}: not writable; cannot replace the checkpoint in place")


def _fill_iteration_dir(checkpoint: Checkpoint, plan: StripPlan, stage: Path,
                        progress: Callable[[int], None] | None, result: StripResult) -> None:
    src = checkpoint.iteration_dir
    metadata = torch_dist.load_metadata_object(src / ".metadata")  # pauses the cyclic GC itself
    keep = plan.keep_keys
    by_file = dcp_writer.kept_storage(metadata, keep)
    result.files = dcp_writer.copy_items(src, stage, by_file, progress)
    result.bytes_copied = sum(f.bytes for f in result.files)
    atomic.fault_point("strip-frozen:data-written")
    dcp_writer.restrict_metadata(metadata, keep)
    with torch_dist.gc_paused():
        payload = torch_dist.dump_metadata_object(metadata)
    atomic.write_atomic(stage / ".metadata", payload)
    result.metadata_bytes = len(payload)
    if checkpoint.location.has_common_pt:
        atomic.link_or_copy(src / "common.pt", stage / "common.pt")
    for path in sorted(src.iterdir()):
        name = path.name
        if name in _REBUILT or name.endswith(".distcp") or name.startswith("."):
            continue
        if name in _STALE:
            result.skipped[name] = _STALE[name]
        elif not path.is_file():
            result.skipped[name] = "not a plain file (a nested checkpoint or dir is not carried)"
        else:
            atomic.link_or_copy(path, stage / name)
            result.carried.append(name)
    # Last, as Megatron does: a dir without metadata.json is an incomplete checkpoint to every reader.
    atomic.write_atomic(stage / "metadata.json", (src / "metadata.json").read_bytes())
    atomic.fsync_dir(stage)


def write_strip(checkpoint: Checkpoint, plan: StripPlan, output: Path | None, in_place: bool = False,
                force: bool = False, keep_backup: bool = True,
                progress: Callable[[int], None] | None = None) -> StripResult:
    """Write the stripped checkpoint to ``output`` (or in place); returns what was written."""
    started = time.perf_counter()
    check_target(checkpoint, output, in_place, force)
    src_iter = checkpoint.iteration_dir
    target = src_iter if in_place else output
    assert target is not None
    save_layout = not in_place and input_was_save_dir(checkpoint)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.ckptdoctor-tmp-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    stage_iter = staging / src_iter.name if save_layout else staging
    result = StripResult(output=str(target), in_place=in_place, backup=None, files=[], bytes_copied=0,
                         metadata_bytes=0, output_bytes=0, source_bytes=_dir_bytes(src_iter),
                         iteration_dir=str(target / src_iter.name if save_layout else target))
    try:
        if save_layout:
            stage_iter.mkdir()
        _fill_iteration_dir(checkpoint, plan, stage_iter, progress, result)
        if save_layout:
            location = checkpoint.location
            value = "release" if location.release else str(location.iteration)
            atomic.write_atomic(staging / TRACKER_NAME, value.encode())
        result.output_bytes = _dir_bytes(stage_iter)
        atomic.fault_point("strip-frozen:before-swap")
        if in_place:
            result.backup = str(_swap_in_place(src_iter, staging, keep_backup))
        else:
            _swap_output(target, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def _swap_output(output: Path, staging: Path) -> None:
    old: Path | None = None
    if output.exists():
        if any(output.iterdir()):  # --force: move the old content aside, delete it once the new dir is in place
            old = output.parent / f".{output.name}.ckptdoctor-old-{os.getpid()}"
            _rename(output, old)
        else:
            output.rmdir()
    _rename(staging, output)
    atomic.fsync_dir(output.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _swap_in_place(iteration_dir: Path, staging: Path, keep_backup: bool) -> Path | None:
    backup = iteration_dir.with_name(f"{iteration_dir.name}.bak-{atomic.timestamp()}")
    if backup.exists():
        raise CkptError(f"{backup}: backup already exists; refusing to overwrite it")
    if atomic.exchange_paths(staging, iteration_dir):
        # One atomic step: the iteration dir's name now holds the stripped checkpoint, staging the old one.
        atomic.fault_point("strip-frozen:after-exchange")
        _rename(staging, backup)
    else:  # no renameat2 exchange here: two renames, the source put back if the second fails
        _rename(iteration_dir, backup)
        atomic.fault_point("strip-frozen:between-renames")
        try:
            _rename(staging, iteration_dir)
        except CkptError:
            _rename(backup, iteration_dir)
            raise
    atomic.fsync_dir(iteration_dir.parent)
    if keep_backup:
        return backup
    shutil.rmtree(backup)
    return None


def _rename(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise CkptError(f"{src}: cannot rename to {dst.name} ({exc.strerror})") from None


@dataclass
class StripReport:
    plan: StripPlan
    result: StripResult | None  # None for --dry-run
    dry_run: bool


# progress(phase, bytes_done_now, phase_total): "compare" (--base) and "copy"
ProgressFn = Callable[[str, int, int], None]


def strip_frozen(checkpoint: Checkpoint, *, output: Path | None, in_place: bool = False,
                 patterns: list[str] | None = None, preset: str | None = None, base: Checkpoint | None = None,
                 dry_run: bool = False, force: bool = False, keep_backup: bool = True,
                 progress: ProgressFn | None = None) -> StripReport:
    """The strip-frozen operation: integrity check, trainable selection, plan, and (unless dry-run) write.

    Every refusal (damaged source, bad target, empty selection) happens before anything is written.
    """
    from ckptdoctor.ops.strip import check_integrity, model_parameters, plan_strip, select_trainable

    check_integrity(checkpoint)
    if not dry_run:
        check_target(checkpoint, output, in_place, force)
    compare_progress = None
    if progress is not None and base is not None:
        total = sum(e.nbytes for e in model_parameters(checkpoint).values())
        compare_progress = lambda n: progress("compare", n, total)  # noqa: E731
    selection = select_trainable(checkpoint, list(patterns or []), preset, base, compare_progress)
    plan = plan_strip(checkpoint, selection)
    if dry_run:
        return StripReport(plan, None, True)
    copy_progress = None
    if progress is not None:
        copy_progress = lambda n: progress("copy", n, plan.bytes_after)  # noqa: E731
    result = write_strip(checkpoint, plan, output, in_place, force, keep_backup, copy_progress)
    return StripReport(plan, result, False)
