"""Swap a fully written staging dir into place: ``--output`` (rename, never replacing but with ``--force``) and
``--in-place`` (atomic exchange, or two renames; the original kept as ``<iter>.bak-<stamp>``).

Shared by every command that builds a new checkpoint dir beside its target (``strip-frozen``, ``edit``). Fault
points are named ``<step>:<where>`` after the calling command (tests stop a run at each of them).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ckptdoctor import atomic, locking
from ckptdoctor.errors import CkptError
from ckptdoctor.rules import leftovers
from ckptdoctor.tree_removal import remove_tree


class SwapState:
    """Whether the staging dir was renamed into place (from then on it never holds only new data)."""

    done = False


QUARANTINE_MARK = ".quarantine-"


def quarantine_dir(iteration_dir: Path) -> Path:
    """A new ``<iter>.quarantine-<stamp>/`` beside the iteration dir: where a write moves what it takes out of the
    dir (unreferenced data files, leftovers, a replaced manifest), so that nothing is deleted and ``check`` of the
    dir sees no new file inside it."""
    while True:
        path = iteration_dir.parent / f"{iteration_dir.name}{QUARANTINE_MARK}{atomic.timestamp()}"
        if not os.path.lexists(path):
            try:
                path.mkdir()
                return path
            except FileExistsError:
                pass
        path = iteration_dir.parent / f"{iteration_dir.name}{QUARANTINE_MARK}{atomic.timestamp()}-{atomic.token()}"
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            return path


def not_carried(name: str) -> bool:
    """Names in an iteration dir that are ckptdoctor's own, never part of the checkpoint: lock files and the
    leftovers of interrupted runs (temp files of atomic writes, fix-args journals). A write carries everything
    else it does not rebuild, hidden names included (a Hydra ``.hydra/`` dir, a ``.gitattributes``)."""
    return locking.is_lock_name(name) or atomic.PART_MARK in name or bool(leftovers.JOURNAL_RE.match(name))


def aside(directory: Path, mark: str) -> Path:
    """A new unique hidden name beside ``directory`` (not created)."""
    while True:
        path = directory.with_name(f".{directory.name}{mark}{atomic.timestamp()}-{atomic.token()}")
        if not os.path.lexists(path):
            return path


def swap_output(output: Path, staging: Path, swap: SwapState, step: str) -> None:
    old: Path | None = None
    with atomic.defer_sigint():
        if os.path.lexists(output):
            if any(output.iterdir()):  # --force: move the old content aside, delete it once the new dir is in place
                old = aside(output, leftovers.OLD_MARK)
                atomic.rename_noreplace(output, old)
                atomic.fault_point(f"{step}:old-output-aside")
            else:
                output.rmdir()
        try:
            atomic.rename_noreplace(staging, output)
        except CkptError:
            if old is not None:
                atomic.rename_noreplace(old, output)
            raise
        swap.done = True
        atomic.fault_point(f"{step}:output-renamed")
        atomic.fsync_dir(output.parent)
    if old is not None:
        remove_tree(old, ignore_errors=True)


def swap_in_place(iteration_dir: Path, staging: Path, keep_backup: bool, swap: SwapState, step: str) -> Path | None:
    """Swap the staging dir in; returns the backup (None with ``--no-backup``). Once swapped, every error
    names where the original is and nothing deletes it, except the requested ``--no-backup`` delete."""
    stamp = atomic.timestamp()
    backup = iteration_dir.with_name(f"{iteration_dir.name}.bak-{stamp}")
    while os.path.lexists(backup):
        backup = iteration_dir.with_name(f"{iteration_dir.name}.bak-{stamp}-{atomic.token()}")
    locking.also_lock(iteration_dir, staging)  # the name stays locked on either side of the swap
    with atomic.defer_sigint():  # Ctrl-C waits until the original has a name no error path deletes
        atomic.fault_point(f"{step}:before-exchange")
        if atomic.exchange_paths(staging, iteration_dir):
            # One atomic step: the iteration dir's name now holds the new checkpoint, staging the old one.
            swap.done = True
            atomic.fault_point(f"{step}:after-exchange")
            old = staging
        else:  # no renameat2 exchange here: two renames, the source put back if the second fails
            atomic.rename_noreplace(iteration_dir, backup)
            atomic.fault_point(f"{step}:between-renames")
            try:
                _rename(staging, iteration_dir)
            except CkptError as exc:
                try:
                    _rename(backup, iteration_dir)
                except CkptError:
                    swap.done = True  # keep the staging dir too: leave every tree for the user to sort out
                    raise CkptError(f"{exc}; putting the original back failed too: it is {backup}") from None
                raise
            swap.done = True
            old = backup
        kept = backup if keep_backup else aside(iteration_dir, leftovers.DEL_MARK)
        if old != kept:
            atomic.fault_point(f"{step}:before-backup-rename")
            try:
                atomic.rename_noreplace(old, kept)
            except CkptError as exc:
                raise CkptError(
                    f"{iteration_dir}: the new checkpoint is in place, but {exc}; the original "
                    f"is kept as {old}: run `ckptdoctor check {iteration_dir.parent}` for what to do "
                    "with it"
                ) from None
            atomic.fault_point(f"{step}:after-backup-rename")
        atomic.fsync_dir(iteration_dir.parent)
    if keep_backup:
        return backup
    atomic.fault_point(f"{step}:before-delete")
    try:
        remove_tree(kept)
    except OSError as exc:
        raise CkptError(
            f"{iteration_dir}: the new checkpoint is in place, but deleting the old one ({kept}) "
            f"failed ({exc.strerror or exc}); delete it with rm -rf"
        ) from None
    return None


def _rename(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise CkptError(f"{src}: cannot rename to {dst.name} ({exc.strerror})") from None
