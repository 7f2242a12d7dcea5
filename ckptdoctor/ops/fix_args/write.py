"""Writing fixed args: O(metadata) work, no tensor byte rewritten, every step crash-safe.

* core <= 0.18: the common state is ``common.pt``; it is replaced atomically.
* core >= 0.19: the common state is the DCP bytes item ``common_state/shard_0_1`` inside a ``.distcp``
  file shared with tensors. Rewriting that file would touch tensor bytes, so the new common state goes to
  a new small data file and ``.metadata`` is atomically repointed to it; the old bytes stay, unreferenced.
* Megatron-Bridge's ``run_config.yaml`` and Megatron's ``integrity.json`` (sha256 manifest) are kept
  consistent with the files that changed.

``--output`` builds a new checkpoint dir: unchanged files are hard-linked (or copied), never modified;
``metadata.json`` and the tracker come last, as Megatron marks a save complete. ``--in-place`` keeps every
replaced file as ``<name>.bak-<timestamp>`` (hard link) before swapping in the new one.

Both modes hold the checkpoint lock (:mod:`ckptdoctor.locking`) and refuse a checkpoint an interrupted run
left leftovers on (:mod:`ckptdoctor.rules.leftovers`). ``--in-place`` writes a journal
(``.ckptdoctor-fixargs-<stamp>.json``) first and removes it last, Ctrl-C is held back while it runs, and a
failing step (a full disk) undoes the steps before it; a kill leaves the journal, which ``check`` turns into
exact restore commands. A failed ``--output`` write removes what it wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ckptdoctor import dist, locking
from ckptdoctor.atomic import (
    backup_file,
    backup_name,
    defer_sigint,
    fault_point,
    fsync_dir,
    link_or_copy,
    prepare_output_dir,
    refuse_overlap,
    restore_from_backup,
    timestamp,
    token,
    write_atomic,
)
from ckptdoctor.checkpoint import Checkpoint, open_checkpoint
from ckptdoctor.data_files import storage_problems
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.run_config import RUN_CONFIG, model_field_lines, read_run_config
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.formats.torch_zip import dump_torch_zip
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME, output_bridge_tracker
from ckptdoctor.locate import TRACKER_NAME
from ckptdoctor.ops.fix_args.plan import (
    ArgChange,
    FixArgsReport,
    WriteResult,
    checked_config,
    diagnose,
    fixed_common_state,
)
from ckptdoctor.ops.pickle_gate import refuse_unsafe_pickles
from ckptdoctor.ops.staging import not_carried
from ckptdoctor.pickle import unpickler
from ckptdoctor.rules import leftovers
from ckptdoctor.storage.files import read_json
from ckptdoctor.tree_removal import remove_tree

INTEGRITY = "integrity.json"


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def updated_run_config(text: str, changes: list[ArgChange], model_only: bool = False) -> tuple[str, list[str]]:
    """``run_config.yaml`` with each changed arg's ``name: old`` lines set to the new value.

    Line-based on purpose: no YAML dependency, and comments, order and formatting survive. Only lines
    whose current value equals the saved arg are touched; with ``model_only`` (the model section is the config
    checked: Megatron-Bridge), only the model section's own fields.
    """
    updated: list[str] = []
    lines = text.splitlines(keepends=True)
    eligible = model_field_lines(text) if model_only else None
    for change in changes:
        # greedy and matching at the first try (a lazy value before optional spaces backtracked quadratically:
        # a line of 100,000 spaces took minutes); no newline after the colon (``lr:`` got its value on the next line)
        pattern = re.compile(rf"^(\s*{re.escape(change.arg)}:[ \t]*)([^#\n]*)(#.*)?(\r?\n)?$")
        old_values = {_yaml_scalar(change.old)} | ({"~", ""} if change.old is None else set())
        for i, line in enumerate(lines):
            if eligible is not None and i not in eligible:
                continue
            match = pattern.match(line)
            value = match.group(2).rstrip() if match else ""
            if match and value.strip("'\"") in old_values:
                rest = match.group(2)[len(value) :] + (match.group(3) or "") + (match.group(4) or "")
                key = match.group(1) if match.group(1)[-1] != ":" else match.group(1) + " "  # ``lr:`` (null)
                lines[i] = key + _yaml_scalar(change.new) + rest
                if change.arg not in updated:
                    updated.append(change.arg)
    return "".join(lines), updated


def _new_files(checkpoint: Checkpoint, changes: list[ArgChange], stamp: str) -> tuple[dict[str, bytes], str]:
    """Relative path -> new content for every file the fix replaces or adds; and the new data file (if any)."""
    refuse_unsafe_pickles(checkpoint)  # the other items are linked or copied unchanged
    if checked_config(checkpoint)[1] == RUN_CONFIG:  # Megatron-Bridge: only run_config.yaml changes (_side_files)
        return {}, ""
    common = fixed_common_state(checkpoint, changes)
    files: dict[str, bytes] = {}
    new_data_file = ""
    source = checkpoint.common_source
    if source == "common.pt":
        files["common.pt"] = dump_torch_zip(common)
    elif source is not None:
        # Megatron writes ShardedObjects as torch.save([obj]).
        new_data_file = f"common_state.fixargs-{stamp}.distcp"
        payload = dump_torch_zip([common])
        held = [torch_dist.load_metadata_object(checkpoint.iteration_dir / ".metadata")]  # its one reference
        repointed = 0
        for index, info in torch_dist.storage_items(held[0]).items():
            if torch_dist.index_fqn(index) == source:
                torch_dist.set_storage(info, StorageLocation(new_data_file, 0, len(payload)))
                repointed += 1
        if repointed != 1:
            raise CkptError(
                f"{checkpoint.iteration_dir / '.metadata'}: expected one storage entry for {source}, found {repointed}"
            )
        files[new_data_file] = payload
        files[".metadata"] = unpickler.dumps_taken(held)  # let go once pickled, before the read-back
    else:
        raise CkptError(f"{checkpoint.iteration_dir}: no common state to rewrite")
    return files, new_data_file


def _side_files(checkpoint: Checkpoint, changes: list[ArgChange], files: dict[str, bytes], result: WriteResult) -> None:
    """run_config.yaml and integrity.json updates of the source's, computed from the new file contents."""
    iteration_dir = checkpoint.iteration_dir
    text = read_run_config(iteration_dir)
    if text is not None:
        model_only = checked_config(checkpoint)[1] == RUN_CONFIG  # Megatron-Bridge: its model section only
        new_text, updated = updated_run_config(text, changes, model_only)
        missed = sorted({c.arg for c in changes} - set(updated)) if model_only else []
        if missed:  # the changes live only here: a line-based edit of existing lines says so rather than skip one
            raise CkptError(
                f"{iteration_dir / RUN_CONFIG}: no line 'NAME: VALUE' holding the saved value of "
                f"{', '.join(missed)} to change (ckptdoctor edits existing lines of run_config.yaml only)"
            )
        if updated:
            files[RUN_CONFIG] = new_text.encode("utf-8")
            result.run_config_args = updated
    integrity = iteration_dir / INTEGRITY
    if integrity.is_file():
        try:
            manifest = read_json(integrity)
            listed = manifest["files"]
            if not isinstance(listed, dict):
                raise ValueError("not a manifest of file names")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CkptError(f"{integrity}: unreadable integrity manifest ({exc})") from None
        for name, data in files.items():
            listed[name] = hashlib.sha256(data).hexdigest()
        files[INTEGRITY] = (json.dumps(manifest, indent=2)).encode("utf-8")
        result.integrity_updated = True


# Order matters for crash safety: data first, then the index that points to it, side files last.
_WRITE_ORDER = ("common_state", "common.pt", ".metadata", RUN_CONFIG, INTEGRITY)


def _step(name: str) -> str:
    """A stable name for a write step (the new data file's name carries a timestamp)."""
    return "common_state" if name.startswith("common_state.") else name


def _ordered(files: dict[str, bytes]) -> list[str]:
    def rank(name: str) -> int:
        return next((i for i, prefix in enumerate(_WRITE_ORDER) if name.startswith(prefix)), len(_WRITE_ORDER))

    return sorted(files, key=rank)


_REPLACEABLE = ("common.pt", ".metadata", RUN_CONFIG, INTEGRITY)


def _free_run_stamp(iteration_dir: Path) -> str:
    """A stamp no backup, new data file or journal of this dir uses yet (a token is added after a run in the
    same second): backups are then created with O_EXCL and never land on an existing path."""
    stamp = timestamp()
    while any(
        os.path.lexists(p)
        for p in (
            *(backup_name(iteration_dir / n, stamp) for n in _REPLACEABLE),
            iteration_dir / f"common_state.fixargs-{stamp}.distcp",
            iteration_dir / leftovers.journal_name(stamp),
        )
    ):
        stamp = f"{timestamp()}-{token()}"
    return stamp


def write_in_place(checkpoint: Checkpoint, changes: list[ArgChange]) -> WriteResult:
    iteration_dir = checkpoint.iteration_dir
    with locking.checkpoint_lock(iteration_dir):
        leftovers.refuse_if_interrupted(iteration_dir)
        stamp = _free_run_stamp(iteration_dir)
        result = WriteResult("in-place", str(iteration_dir))
        files, _ = _new_files(checkpoint, changes, stamp)
        _side_files(checkpoint, changes, files, result)
        order = _ordered(files)
        replaced = [n for n in order if (iteration_dir / n).exists()]
        created = [n for n in order if n not in replaced]
        journal = iteration_dir / leftovers.journal_name(stamp)
        record = {"command": "fix-args --in-place", "stamp": stamp, "replaced": replaced, "created": created}
        backups: dict[str, Path] = {}
        written: list[str] = []
        with defer_sigint():  # O(metadata): Ctrl-C waits for the few steps to finish
            write_atomic(journal, (json.dumps(record, indent=2) + "\n").encode())
            fault_point("journal")
            try:
                for name in order:
                    target = iteration_dir / name
                    if name in replaced:
                        backups[name] = backup_file(target, stamp)
                        result.backups.append(str(backups[name]))
                        fault_point(f"backup:{_step(name)}")
                    write_atomic(target, files[name])
                    written.append(name)
                    result.written.append(str(target))
                    fault_point(f"write:{_step(name)}")
            except (CkptError, OSError) as exc:
                raise CkptError(_roll_back(iteration_dir, exc, written, backups, created, journal)) from None
            journal.unlink()
            fsync_dir(iteration_dir)
            fault_point("done")
        return result


def _roll_back(
    iteration_dir: Path,
    error: Exception,
    written: list[str],
    backups: dict[str, Path],
    created: list[str],
    journal: Path,
) -> str:
    """Undo a failed in-place write (restore replaced files, delete new ones); the one-line message to show."""
    detail = getattr(error, "strerror", None) or error
    reason = str(error) if isinstance(error, CkptError) else f"{iteration_dir}: {detail}"
    try:
        for name in reversed(written):
            if name in backups:
                restore_from_backup(backups[name], iteration_dir / name)
        for name in created:
            with contextlib.suppress(FileNotFoundError):
                (iteration_dir / name).unlink()
        removed = []
        for name, backup in backups.items():
            if os.stat(backup).st_ino == os.stat(iteration_dir / name).st_ino:  # the file itself: not needed
                backup.unlink()
                removed.append(backup.name)
        journal.unlink()
        fsync_dir(iteration_dir)
    except OSError as exc:
        kept = ", ".join(str(b) for b in backups.values()) or "none yet"
        return (
            f"{reason}; undoing the partial write failed too ({exc.strerror or exc}): the originals are kept "
            f"as {kept}; run `ckptdoctor check {iteration_dir}` for the restore commands"
        )
    gone = [*created, *removed]
    undone = f" (removed {', '.join(gone)})" if gone else ""
    return f"{reason}; nothing was changed{undone}"


def write_output(checkpoint: Checkpoint, changes: list[ArgChange], output: Path, force: bool = False) -> WriteResult:
    location = checkpoint.location
    source = location.save_dir or location.iteration_dir
    refuse_overlap(output, [source, location.iteration_dir], "use --in-place to rewrite the source")
    with locking.checkpoint_lock(location.iteration_dir, exclusive=False, optional=True):
        leftovers.refuse_if_interrupted(location.iteration_dir)
        existed = output.exists()
        prepare_output_dir(output, force=force)
        with locking.checkpoint_lock(output):
            was_empty = not any(output.iterdir())
            try:
                return _write_output(checkpoint, changes, output)
            except BaseException as exc:
                if was_empty:  # everything in it is ours: leave no half-written checkpoint behind
                    if existed:
                        for child in list(output.iterdir()):
                            _remove(child)
                    else:
                        remove_tree(output, ignore_errors=True)
                if isinstance(exc, OSError):
                    raise CkptError(f"{exc.filename or output}: cannot write ({exc.strerror})") from None
                raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _write_output(checkpoint: Checkpoint, changes: list[ArgChange], output: Path) -> WriteResult:
    location = checkpoint.location
    if location.save_dir is not None:
        iteration_dir = output / location.iteration_dir.name
        iteration_dir.mkdir(exist_ok=True)
    else:
        iteration_dir = output
    result = WriteResult("output", str(iteration_dir))
    files, _ = _new_files(checkpoint, changes, timestamp())
    _side_files(checkpoint, changes, files, result)

    # Unchanged files first, then the new ones, then metadata.json and the tracker: Megatron's own
    # completeness markers come last, so an interrupted write never looks like a complete checkpoint.
    completeness_marker = location.iteration_dir / "metadata.json"
    for path in sorted(p for p in location.iteration_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(location.iteration_dir)
        if str(relative) in files or path == completeness_marker or not_carried(path.name):
            continue
        dest = iteration_dir / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        how = link_or_copy(path, dest, replace=True)  # a file an interrupted run left (--force)
        result.linked += how == "linked"
        result.copied += how == "copied"
    fault_point("links")
    for name in _ordered(files):
        write_atomic(iteration_dir / name, files[name])
        result.written.append(str(iteration_dir / name))
        fault_point(f"write:{_step(name)}")
    how = link_or_copy(completeness_marker, iteration_dir / "metadata.json", replace=True)
    result.linked += how == "linked"  # counted as every other carried file (it is one, linked last)
    result.copied += how == "copied"
    if location.save_dir is not None:
        value = "release" if location.release else str(location.iteration)
        write_atomic(output / TRACKER_NAME, value.encode())
        result.written.append(str(output / TRACKER_NAME))
        bridge_tracker = output_bridge_tracker(location.save_dir, location.iteration_dir)  # Megatron-Bridge's
        if bridge_tracker is not None:
            write_atomic(output / BRIDGE_TRACKER_NAME, bridge_tracker)
            result.written.append(str(output / BRIDGE_TRACKER_NAME))
    return result


def _refuse_damaged(checkpoint: Checkpoint) -> None:
    """A source whose data files are missing, unreadable or short (a partial copy or upload) is refused, as every
    write refuses one: a fixed copy would carry the damage on under new args (and, on object storage, a
    metadata.json saying it is complete)."""
    problems = [problem for problem in storage_problems(checkpoint)[0] if problem.fatal]
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CkptError(
            f"{first.path}: {first.code} {first.detail}{more}; refusing to fix the args of a damaged checkpoint "
            "(`ckptdoctor repair` says what can be done)"
        )


def write_fix(
    report: FixArgsReport, checkpoint: Checkpoint, output: Path | None = None, force: bool = False
) -> FixArgsReport:
    """Write ``report.changes`` to ``output`` (or in place when ``output`` is None), then prove the fix.
    ``checkpoint``'s entries are released once written (see :meth:`Checkpoint.release_entries`).

    The written checkpoint is re-read and re-diagnosed by our own reader before anyone is told it worked:
    ``report.remaining`` holds what is still wrong there (``report.findings`` keep what was wrong before).
    """
    dist.refuse_write("fix-args")
    if report.changes:
        _refuse_damaged(checkpoint)
    if not report.changes:
        refuse_unsafe_pickles(checkpoint)  # --write of a checkpoint failing the gate: refused, as every write
        # As every write: a leftover of an interrupted write is resolved first (a run killed after replacing its
        # last file, before removing its journal, leaves consistent args: its rerun found nothing to change and
        # exited 0 with check still reporting CKD150, whose restore steps undo that run).
        with locking.checkpoint_lock(checkpoint.iteration_dir, exclusive=False, optional=True):
            leftovers.refuse_if_interrupted(checkpoint.iteration_dir)
        report.notes.append("nothing to write: the args are consistent")
        return report
    if output is None:
        report.written = write_in_place(checkpoint, report.changes)
    else:
        report.written = write_output(checkpoint, report.changes, output, force=force)
    checkpoint.release_entries()  # the source's index goes before the output's is read: one in memory, not two
    report.remaining, _ = diagnose(open_checkpoint(report.written.iteration_dir))
    report.would_remain = None  # written: what remains is re-read from disk
    return report
