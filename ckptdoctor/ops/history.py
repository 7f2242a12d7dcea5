"""``ckptdoctor history``: one line per iteration dir of a save dir: its status, size, seal and the trackers.

Each iteration dir is checked as ``latest-good`` checks it (:func:`ckptdoctor.ops.latest_good.findings_of`: the
same rules and ``--select``/``--ignore``), newest first, ``release`` last, but from metadata only: no chunk is
decoded, no torch is imported, and ``integrity.json``'s hashes are not verified unless asked
(``--verify-integrity``, which reads every byte of the sealed dirs, as ``latest-good`` and ``check`` do). The
dirs are independent units of :func:`ckptdoctor.parallel.map_units` (``--jobs`` processes), merged in dir order,
so the listing does not depend on ``--jobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import parallel
from ckptdoctor.locate import NEMO_WEIGHTS_DIR, list_dir, looks_like_iteration_dir
from ckptdoctor.ops.check import CheckOptions
from ckptdoctor.ops.latest_good import findings_of, iteration_value, read_trackers, save_dir_of
from ckptdoctor.pickle.policy import trusted_names
from ckptdoctor.rules import ERROR, Finding, is_selected, structure
from ckptdoctor.rules.integrity import INTEGRITY_NAME
from ckptdoctor.storage.files import list_tree, tree_bytes

SCHEMA = "ckptdoctor.history/1"

GOOD = "good"  # no finding
WARNINGS = "warnings"  # warnings only: latest-good would take it
BROKEN = "broken"  # at least one error: latest-good skips it


@dataclass
class IterationStatus:
    """One iteration dir, one line."""

    iteration_dir: str
    iteration: int | None  # None for release
    release: bool
    status: str  # GOOD, WARNINGS or BROKEN
    errors: int
    warnings: int
    top: Finding | None  # why: the first error, else the first warning; None when good
    bytes: int  # the sizes of its files, all of them (subdirs included)
    files: int
    sealed: bool  # holds integrity.json (from `seal`; whether it verifies is a finding of its own)
    tracker: bool  # latest_checkpointed_iteration.txt names it
    bridge_tracker: bool  # Megatron-Bridge's latest_train_state.pt names it


@dataclass
class HistoryReport:
    schema: str
    save_dir: str
    tracker: str | None  # the text tracker's value; None when missing or unreadable
    bridge_tracker: str | None  # the step of latest_train_state.pt; None when there is none that reads
    iterations: list[IterationStatus]  # newest first, release last
    findings: list[Finding] = field(default_factory=list)  # the save dir's own: its trackers (CKD12x)
    trusted: list[str] = field(default_factory=trusted_names)  # globals the gate trusted (--trust-global)
    integrity_verified: bool = False  # the sealed dirs' files were hashed (--verify-integrity), as latest-good does

    @property
    def resumable(self) -> bool:
        """Some iteration dir passes check (errors only, as latest-good decides)."""
        return any(line.status != BROKEN for line in self.iterations)


def checkpoint_dir(directory: Path) -> Path:
    """Where an iteration dir's checkpoint is: itself, or its NeMo 2 style ``weights/`` when it holds none."""
    nested = directory / NEMO_WEIGHTS_DIR
    if NEMO_WEIGHTS_DIR in list_dir(directory) and not _holds_checkpoint(directory) and nested.is_dir():
        return nested if looks_like_iteration_dir(nested) else directory
    return directory


def _holds_checkpoint(directory: Path) -> bool:
    names = set(list_dir(directory))
    return bool(names & {".metadata", "metadata.json", "common.pt"}) or any(n.endswith(".distcp") for n in names)


def history(save_dir: str | Path, options: CheckOptions | None = None, jobs: int | None = None) -> HistoryReport:
    """Every iteration dir of ``save_dir``, newest first, each checked from metadata (see the module doc)."""
    options = options or CheckOptions(verify_integrity=False)
    path, dirs = save_dir_of(save_dir)
    list_tree(path)  # object storage: the whole tree in a few listings, which the workers inherit
    tracker, bridge = read_trackers(path)
    _, save_findings = structure.check_save_dir(path, path, all_iterations=True)
    report = HistoryReport(
        SCHEMA,
        str(path),
        tracker,
        bridge,
        [],
        [f for f in save_findings if is_selected(f.code, options.select, options.ignore)],
        integrity_verified=options.verify_integrity,
    )

    def task(index: int) -> IterationStatus:
        return _status(dirs[index], options, tracker, bridge)

    report.iterations = parallel.map_units([1] * len(dirs), task, jobs)
    return report


def _status(directory: Path, options: CheckOptions, tracker: str | None, bridge: str | None) -> IterationStatus:
    checkpoint = checkpoint_dir(directory)
    found = findings_of(checkpoint, options)  # no fix lines: check verifies them by planning each fix
    errors = [f for f in found if f.severity == ERROR]
    warnings = [f for f in found if f.severity != ERROR]
    status = BROKEN if errors else WARNINGS if warnings else GOOD
    value = iteration_value(directory)
    try:
        size, files = tree_bytes(directory)
    except OSError:  # vanished or unreadable since it was listed: its findings say so
        size, files = 0, 0
    return IterationStatus(
        str(directory),
        None if value == "release" else int(value),
        value == "release",
        status,
        len(errors),
        len(warnings),
        next(iter(errors or warnings), None),
        size,
        files,
        (checkpoint / INTEGRITY_NAME).is_file(),
        tracker == value,
        bridge == value,
    )
