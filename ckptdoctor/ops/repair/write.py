"""``ckptdoctor repair --write``: apply the plan of :mod:`ckptdoctor.ops.repair.plan` and re-check the result.

Writing follows fix-args' rules: the checkpoint lock, atomic writes, ``<name>.bak-<stamp>`` backups of replaced
files with ``--in-place``, an ``--output`` never inside the source, no tensor byte rewritten. An existing
``integrity.json`` is kept consistent. The order keeps every intermediate state loadable: a kill between two steps
leaves at most an unlisted file (a warning), never a listed file missing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from ckptdoctor import locking
from ckptdoctor.atomic import (
    fault_point,
    fsync_dir,
    keep_previous,
    link_or_copy,
    prepare_output_dir,
    refuse_overlap,
    rename_noreplace,
    timestamp,
    token,
    write_atomic,
)
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME, output_bridge_tracker
from ckptdoctor.locate import (
    TRACKER_NAME,
    iteration_dir_name,
)
from ckptdoctor.ops.check import CheckOptions, check_paths
from ckptdoctor.ops.fix_args import write as fix_args_write
from ckptdoctor.ops.latest_good import iteration_value
from ckptdoctor.ops.pickle_gate import refusal, refuse_unsafe_pickles
from ckptdoctor.ops.repair.bridge import write_bridge_tracker
from ckptdoctor.ops.repair.plan import (
    INTERRUPTED_CODE,
    LEFTOVER_CODE,
    RepairWork,
    plan,
    recorded_hash,
)
from ckptdoctor.ops.repair.report import RepairReport, RepairWrite
from ckptdoctor.ops.staging import not_carried, quarantine_dir
from ckptdoctor.rules import is_safety, leftovers
from ckptdoctor.rules.integrity import INTEGRITY_NAME
from ckptdoctor.storage.files import read_json
from ckptdoctor.tree_removal import remove_tree


def _updated_manifest(iteration_dir: Path, drop: list[str], add: dict[str, bytes]) -> bytes | None:
    path = iteration_dir / INTEGRITY_NAME
    if not path.is_file():
        return None
    try:
        manifest = read_json(path)
        listed = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CkptError(f"{path}: unreadable integrity manifest ({exc})") from None
    for name in drop:
        listed.pop(name, None)
    for name, data in add.items():
        listed[name] = hashlib.sha256(data).hexdigest()
    return json.dumps(manifest, indent=2).encode("utf-8")


def _write_in_place(report: RepairReport, work: RepairWork) -> RepairWrite:
    candidate = work.candidate
    result = RepairWrite("in-place", str(work.save_dir or candidate))
    stamp = timestamp() + "-" + token()
    if candidate is not None and (work.orphans or work.metadata_json or work.changes or work.leftovers):
        with locking.checkpoint_lock(candidate):
            manifest = candidate / INTEGRITY_NAME
            qdir: list[Path] = []

            def quarantine() -> Path:  # beside the dir, so that check sees no new file inside it
                if not qdir:
                    qdir.append(quarantine_dir(candidate))
                return qdir[0]

            def replace_manifest(data: bytes | None) -> None:
                if data is None:
                    return
                backup = quarantine() / f"{INTEGRITY_NAME}.bak-{stamp}"
                if not backup.exists():  # the manifest as it was before this run
                    link_or_copy(manifest, backup)
                    result.backups.append(str(backup))
                write_atomic(manifest, data)
                result.integrity_updated = True

            if work.leftovers:
                _quarantine_leftovers(candidate, work.leftovers, quarantine, replace_manifest, result)
            leftovers.refuse_if_interrupted(candidate)  # anything else (or new) left by an interrupted write
            if work.orphans:
                # first drop them from the manifest: a kill then leaves them unlisted, never listed and missing
                replace_manifest(_updated_manifest(candidate, work.orphans, {}))
                for name in work.orphans:
                    rename_noreplace(candidate / name, quarantine() / name)
                    result.moved.append(f"{candidate / name} -> {quarantine() / name}")
                    fault_point("repair:quarantine")
                fsync_dir(quarantine())
                fsync_dir(candidate)
            if work.metadata_json is not None:
                data = json.dumps(work.metadata_json).encode("utf-8")
                write_atomic(candidate / "metadata.json", data)  # then the manifest: a kill leaves it unlisted
                result.written.append(str(candidate / "metadata.json"))
                fault_point("repair:metadata-json")
                replace_manifest(_updated_manifest(candidate, [], {"metadata.json": data}))
            if work.changes:
                written = fix_args_write.write_in_place(open_checkpoint(candidate), work.changes)
                result.written += written.written
                result.backups += written.backups
                result.integrity_updated |= written.integrity_updated
                fault_point("repair:fix-args")
    if work.tracker_value is not None and work.save_dir is not None:
        with locking.checkpoint_lock(work.save_dir):
            tracker = work.save_dir / TRACKER_NAME
            backup = keep_previous(tracker, stamp)  # a FIFO or a dir there too is moved aside, never replaced
            if backup is not None:
                result.backups.append(str(backup))
                fault_point("repair:tracker-backup")
            write_atomic(tracker, work.tracker_value.encode())
            result.written.append(str(tracker))
    if work.bridge_value is not None and work.save_dir is not None:
        with locking.checkpoint_lock(work.save_dir):
            write_bridge_tracker(work.save_dir, work.bridge_value, stamp, result)
    return result


def _quarantine_leftovers(
    candidate: Path,
    planned: list[Path],
    quarantine: Callable[[], Path],
    replace_manifest: Callable[[bytes | None], None],
    result: RepairWrite,
) -> None:
    """Move the planned CKD151 leftovers that are still CKD151 now (under the lock) into the quarantine dir."""
    safe = {Path(f.path) for f in leftovers.check_iteration_dir(candidate, candidate) if f.code == LEFTOVER_CODE}
    moving = [p for p in planned if p in safe]
    # A temp file listed in integrity.json (a manifest written after it): first unlisted, as for orphans.
    listed = [p.name for p in moving if p.parent == candidate and recorded_hash(candidate, p.name) is not None]
    if listed:
        replace_manifest(_updated_manifest(candidate, listed, {}))
    for path in moving:
        dest = quarantine() / path.name
        rename_noreplace(path, dest)
        result.moved.append(f"{path} -> {dest}")
        fault_point("repair:quarantine-leftover")
    if moving:
        fsync_dir(quarantine())
        fsync_dir(candidate)
        fsync_dir(candidate.parent)


def _refuse_if_displaced(iteration_dir: Path) -> None:
    """--output reads the source only: a CKD151 leftover is not copied (no reason to refuse), a CKD150 is."""
    found = [f for f in leftovers.check_iteration_dir(iteration_dir, iteration_dir) if f.code == INTERRUPTED_CODE]
    if found:
        raise CkptError(
            f"{iteration_dir}: an interrupted ckptdoctor write left {found[0].path}; run "
            f"`ckptdoctor check {iteration_dir}` and follow its restore steps before writing again"
        )


def _write_output(report: RepairReport, work: RepairWork, output: Path, force: bool) -> RepairWrite:
    save_dir, candidate = work.save_dir, work.candidate
    if work.tracker_value is not None:
        chosen = save_dir / iteration_dir_name(work.tracker_value)  # type: ignore[operator]
        iteration_work = RepairWork(save_dir, chosen)  # a good checkpoint: copied as is
    else:
        assert candidate is not None
        chosen, iteration_work = candidate, work
    refuse_overlap(
        output, [p for p in (save_dir, candidate, chosen) if p is not None], "use --in-place to repair the source"
    )
    result = RepairWrite("output", str(output))
    with locking.checkpoint_lock(chosen, exclusive=False, optional=True):
        _refuse_if_displaced(chosen)
        existed = output.exists()
        prepare_output_dir(output, force=force)
        with locking.checkpoint_lock(output):
            was_empty = not any(output.iterdir())
            try:
                _fill_output(chosen, iteration_work, output, result)
            except BaseException as exc:
                if was_empty:  # everything in it is ours: leave no half-written checkpoint behind
                    if existed:
                        for child in list(output.iterdir()):
                            remove_tree(child, ignore_errors=True) if child.is_dir() else child.unlink()
                    else:
                        remove_tree(output, ignore_errors=True)
                if isinstance(exc, OSError):
                    raise CkptError(f"{exc.filename or output}: cannot write ({exc.strerror})") from None
                raise
    return result


def _fill_output(chosen: Path, work: RepairWork, output: Path, result: RepairWrite) -> None:
    """Links of the unchanged files, the repaired ones, metadata.json, then the tracker (completeness last)."""
    out_iter = output / chosen.name if work.save_dir is not None else output
    out_iter.mkdir(exist_ok=True)
    skip = set(work.orphans) | {"metadata.json"}
    for path in sorted(p for p in chosen.rglob("*") if p.is_file()):
        relative = path.relative_to(chosen)
        if str(relative) in skip or not_carried(path.name):
            continue
        dest = out_iter / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(path, dest, replace=True)  # a file an interrupted run left (--force)
    if work.orphans:
        result.moved += [f"{chosen / n} not carried over (the source keeps it)" for n in work.orphans]
    result.moved += [f"{p} not carried over (the source keeps it)" for p in work.leftovers]
    if work.metadata_json is not None:
        data = json.dumps(work.metadata_json).encode("utf-8")
    else:
        data = (chosen / "metadata.json").read_bytes()
    # temp files of an interrupted write are not carried over: unlisted if a manifest lists them
    dropped = work.orphans + [p.name for p in work.leftovers if p.parent == chosen and recorded_hash(chosen, p.name)]
    new_manifest = _updated_manifest(chosen, dropped, {"metadata.json": data} if work.metadata_json else {})
    if new_manifest is not None and (dropped or work.metadata_json is not None):
        write_atomic(out_iter / INTEGRITY_NAME, new_manifest)  # replaces the link: the source's file is untouched
        result.integrity_updated = True
    write_atomic(out_iter / "metadata.json", data)
    result.written.append(str(out_iter / "metadata.json"))
    if work.changes:
        written = fix_args_write.write_in_place(open_checkpoint(out_iter), work.changes)
        result.written += written.written
        result.integrity_updated |= written.integrity_updated
        for backup in written.backups:  # the source is the backup of a new output
            Path(backup).unlink()
    if work.save_dir is not None:
        bridge_tracker = output_bridge_tracker(work.save_dir, chosen)  # Megatron-Bridge's, as Bridge writes it
        if bridge_tracker is not None:
            write_atomic(output / BRIDGE_TRACKER_NAME, bridge_tracker)
            result.written.append(str(output / BRIDGE_TRACKER_NAME))
        tracker = output / TRACKER_NAME
        write_atomic(tracker, (work.tracker_value or iteration_value(chosen)).encode())
        result.written.append(str(tracker))


def repair(
    path: str | Path,
    iteration: str | None = None,
    write: bool = False,
    output: Path | None = None,
    in_place: bool = False,
    force: bool = False,
    options: CheckOptions | None = None,
) -> RepairReport:
    """Plan the repairs of ``path`` (a save dir or an iteration dir); with ``write``, apply them and re-check."""
    options = options or CheckOptions()
    report, work = plan(path, iteration, options)
    if not write:
        return report
    gate = [f for f in report.findings if is_safety(f.code)]
    if gate:  # whatever it would write, the save dir keeps (or --output copies) a pickle that runs code on load
        raise refusal(gate[0])
    if not report.actions:
        report.notes.append("nothing to write: no finding can be repaired safely")
        return report
    # what the write completes (metadata.json) or copies (--output) holds no pickle a real load would execute
    # (the tracker's target, where --output copies it)
    if output is not None and work.tracker_value is not None:
        refuse_unsafe_pickles(open_checkpoint(work.save_dir / iteration_dir_name(work.tracker_value)))  # type: ignore[operator]
    elif work.tracker_value is None and work.checkpoint is not None:
        refuse_unsafe_pickles(work.checkpoint)
    report.written = _write_in_place(report, work) if in_place else _write_output(report, work, output, force)  # type: ignore[arg-type]
    if output is not None:
        recheck = output
    else:
        recheck = work.save_dir if work.save_dir is not None else work.candidate  # type: ignore[assignment]
    after = check_paths([str(recheck)], options)
    report.after = after.findings
    fixed = {code for a in report.actions for code in a.fixes}
    report.remaining = [f for f in after.findings if f.code in fixed]
    return report
