"""``ckptdoctor latest-good``: the newest iteration dir of a save dir that passes ``check`` (errors only).

Each iteration dir is checked with :func:`ckptdoctor.ops.check.check_iteration_dir` (the same rules, the same
``--select/--ignore/--deep``), newest first; the first one without a selected error is the answer. Warnings
never disqualify a checkpoint. Numbered iterations come first (newest to oldest), ``release`` last: a
``release`` dir is a converted or final checkpoint, not a point in the training run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME, read_train_state_step
from ckptdoctor.locate import TRACKER_NAME, iteration_number, list_dir, list_iteration_dirs, read_tracker
from ckptdoctor.ops.check import CheckOptions, check_iteration_dir
from ckptdoctor.pickle.policy import trusted_names
from ckptdoctor.progress import Progress
from ckptdoctor.rules import ERROR, Finding, finding, is_selected, leftovers, structure
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.interface import StorageUnavailable

SCHEMA = "ckptdoctor.latest-good/1"


@dataclass
class Skipped:
    """A newer iteration dir that failed check, and the errors that disqualified it."""

    iteration_dir: str
    errors: list[Finding]


@dataclass
class LatestGoodReport:
    schema: str
    save_dir: str
    tracker: str | None  # the tracker's value, None when missing or unreadable
    iteration_dir: str | None  # the newest good iteration dir, None when none passes
    iteration: int | None  # its number; None for release (and when none passes), as inspect has it
    release: bool = False  # the good dir is the release dir
    skipped: list[Skipped] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # the iteration dirs checked, newest first
    bridge_tracker: str | None = None  # the step of Megatron-Bridge's latest_train_state.pt, None when none reads
    trusted: list[str] = field(default_factory=trusted_names)  # globals the gate trusted (--trust-global)

    @property
    def found(self) -> bool:
        return self.iteration_dir is not None

    @property
    def tracker_value(self) -> str | None:
        """What a tracker naming the good dir holds ("10" or "release")."""
        if self.iteration_dir is None:
            return None
        return "release" if self.release else str(self.iteration)


def candidates(save_dir: Path) -> list[Path]:
    """Iteration dirs of ``save_dir``, newest first, ``release`` last."""
    dirs = list_iteration_dirs(save_dir)
    numbered = [d for d in dirs if d.name != "release"]
    numbered.sort(key=lambda d: iteration_number(d.name) or 0, reverse=True)
    return numbered + [d for d in dirs if d.name == "release"]


def iteration_value(directory: Path) -> str:
    """The tracker value naming ``directory`` ("10" for ``iter_0000010`` or ``step-10``, or "release")."""
    number = iteration_number(directory.name)
    return "release" if number is None else str(number)


def findings_of(directory: Path, options: CheckOptions, progress: Progress | None = None) -> list[Finding]:
    """The selected findings of one iteration dir (with leftovers of interrupted writes beside it); a dir that
    cannot even be listed is one CKD100 error. ``history`` shows them all, ``latest-good`` decides on the errors."""
    try:
        found = check_iteration_dir(directory, directory, options, progress)
        found += leftovers.scan_beside(directory.parent, directory.parent, directory.name)
    except StorageUnavailable:
        raise  # the storage failed, not this iteration: no verdict on it (exit 2)
    except CkptError as exc:
        return [finding(structure.NOT_A_CHECKPOINT, directory, str(exc))]
    return [f for f in dict.fromkeys(found) if is_selected(f.code, options.select, options.ignore)]


def errors_of(directory: Path, options: CheckOptions, progress: Progress | None = None) -> list[Finding]:
    """The selected error findings of one iteration dir (see :func:`findings_of`)."""
    return [f for f in findings_of(directory, options, progress) if f.severity == ERROR]


def save_dir_of(save_dir: str | Path) -> tuple[Path, list[Path]]:
    """``save_dir`` (or its tracker file) as a path and its iteration dirs (:func:`candidates`: newest first,
    ``release`` last); refuses (:class:`CkptError`) a path that is no dir or holds no iteration dir."""
    path = as_path(save_dir)
    if path.name in (TRACKER_NAME, BRIDGE_TRACKER_NAME) and path.is_file():  # named as the other commands take it
        path = path.parent
    if not path.is_dir():
        raise CkptError(f"{path}: no such file or directory" if not path.exists() else f"{path}: not a directory")
    list_dir(path)
    dirs = candidates(path)
    if not dirs:
        raise CkptError(f"{path}: not a save dir (no iter_NNNNNNN, step-N or release dirs)")
    return path, dirs


def read_trackers(save_dir: Path) -> tuple[str | None, str | None]:
    """What the save dir's trackers name: Megatron-LM's text tracker and Megatron-Bridge's
    ``latest_train_state.pt`` (each None when missing or unreadable; ``check`` reports why)."""
    tracker = _readable(read_tracker, save_dir / TRACKER_NAME)
    step = _readable(read_train_state_step, save_dir / BRIDGE_TRACKER_NAME)
    return tracker, None if step is None else str(step)


def _readable(read: Callable[[Path], Any], path: Path) -> Any:
    """``read(path)``, or None where the file is missing or unreadable; storage that fails stops the command (the
    storage failed, not the tracker: exit 2)."""
    if not path.is_file():
        return None
    try:
        return read(path)
    except StorageUnavailable:
        raise
    except CkptError:
        return None


def find_latest_good(
    save_dir: str | Path, options: CheckOptions | None = None, progress: Progress | None = None
) -> LatestGoodReport:
    """Check the iteration dirs of ``save_dir`` newest first; stop at the first one without errors."""
    options = options or CheckOptions()
    path, dirs = save_dir_of(save_dir)
    tracker, bridge = read_trackers(path)
    report = LatestGoodReport(SCHEMA, str(path), tracker, None, None, bridge_tracker=bridge)
    for directory in dirs:
        report.checked.append(str(directory))
        errors = errors_of(directory, options, progress)
        if not errors:
            report.iteration_dir = str(directory)
            value = iteration_value(directory)
            report.release = value == "release"
            report.iteration = None if report.release else int(value)
            return report
        report.skipped.append(Skipped(str(directory), errors))
    return report
