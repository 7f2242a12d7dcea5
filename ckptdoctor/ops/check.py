"""``ckptdoctor check``: validate checkpoint dirs with coded rules (see :mod:`ckptdoctor.rules`).

Paths may be save dirs, iteration dirs or files inside them (pre-commit passes file names); each iteration
dir is checked once. Problems with the checkpoint are findings; only usage errors (a PATH that does not
exist, an unknown rule code) raise :class:`~ckptdoctor.errors.CkptError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.torch_dist import gc_paused
from ckptdoctor.layout import NEMO_WEIGHTS_DIR, TRACKER_NAME, list_dir, list_iteration_dirs, looks_like_iteration_dir
from ckptdoctor.rules import Finding, consistency, finding, integrity, is_selected, leftovers, structure

SCHEMA = "ckptdoctor.check/1"


@dataclass
class CheckOptions:
    select: list[str] = field(default_factory=lambda: ["ALL"])
    ignore: list[str] = field(default_factory=list)
    deep: bool = False
    all_iterations: bool = False
    verify_integrity: bool = True


@dataclass
class CheckReport:
    schema: str
    checked: list[str]  # iteration dirs checked, as named from the given paths
    skipped: list[str]  # given files that belong to no checkpoint
    findings: list[Finding]
    counts: dict[str, int]  # findings by severity ("error", "warning")

    @property
    def clean(self) -> bool:
        return not self.findings


class Progress:
    """Where ``--deep`` reports how far it got; the CLI draws a bar from it (operations never print)."""

    def start(self, label: str, total_bytes: int) -> None:
        """A checkpoint's deep pass begins."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes were read and checked."""

    def finish(self) -> None:
        """The checkpoint's deep pass ended."""


@dataclass
class _Targets:
    save_dirs: dict[Path, Path] = field(default_factory=dict)  # resolved -> as named
    iteration_dirs: dict[Path, Path] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def check_paths(paths: list[str], options: CheckOptions | None = None,
                progress: Progress | None = None) -> CheckReport:
    """Run every selected rule on the checkpoints ``paths`` name."""
    options = options or CheckOptions()
    targets = resolve_targets(paths)
    findings = list(targets.findings)
    iteration_dirs: dict[Path, Path] = {}
    for save_dir, shown in targets.save_dirs.items():
        chosen, tracker_findings = structure.check_save_dir(save_dir, shown, options.all_iterations)
        findings += tracker_findings
        findings += leftovers.scan_beside(save_dir, shown)  # also those of an iteration dir gone missing
        for directory in chosen:
            iteration_dirs.setdefault(directory.resolve(), shown / directory.name)
    for resolved, shown in targets.iteration_dirs.items():
        iteration_dirs.setdefault(resolved, shown)
    for shown in iteration_dirs.values():  # keyed by resolved path (each once), read as named (messages match)
        findings += check_iteration_dir(shown, shown, options, progress)
    findings = list(dict.fromkeys(findings))  # a leftover beside an iteration dir is seen from the save dir too
    kept = [f for f in findings if is_selected(f.code, options.select, options.ignore)]
    counts = {"error": 0, "warning": 0}
    for f in kept:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    return CheckReport(SCHEMA, [str(s) for s in iteration_dirs.values()], targets.skipped, kept, counts)


def check_iteration_dir(directory: Path, shown: Path, options: CheckOptions,
                        progress: Progress | None = None) -> list[Finding]:
    """Every rule family on one iteration dir; structure problems never stop the other families."""
    # ~10 small objects per chunk, none cyclic: the collector's repeated scans of them cost more than the work.
    with gc_paused():
        state, findings = structure.scan_iteration(directory, shown)
        findings += leftovers.check_iteration_dir(directory, shown)
        findings += consistency.check(state)
        findings += integrity.check_manifest(state, verify_hashes=options.verify_integrity)
        if options.deep:
            if progress is not None:
                progress.start(str(shown), integrity.deep_bytes(state))
            try:
                findings += integrity.check_deep(state, progress.advance if progress is not None else None)
            finally:
                if progress is not None:
                    progress.finish()
    return findings


def resolve_targets(paths: list[str]) -> _Targets:
    """Map each path to a save dir or an iteration dir (each once); non-checkpoint files are skipped."""
    targets = _Targets()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            # an output dir that an interrupted write never renamed into place: report its leftovers
            left = leftovers.scan_beside(path.parent, path.parent, path.name)
            if not left:
                raise CkptError(f"{raw}: no such file or directory")
            targets.findings += left
            continue
        if path.is_file():
            _add_file(path, targets)
            continue
        if path.is_dir():
            list_dir(path)  # a dir that cannot be listed: one error naming it, before a stat inside it fails
        if (path / TRACKER_NAME).is_file() or (not looks_like_iteration_dir(path) and list_iteration_dirs(path)):
            targets.save_dirs.setdefault(path.resolve(), path)
        elif looks_like_iteration_dir(path):
            targets.iteration_dirs.setdefault(path.resolve(), path)
        elif looks_like_iteration_dir(path / NEMO_WEIGHTS_DIR):  # NeMo 2 style: <ckpt>/weights/
            targets.iteration_dirs.setdefault((path / NEMO_WEIGHTS_DIR).resolve(), path / NEMO_WEIGHTS_DIR)
        else:
            targets.findings.append(finding(structure.NOT_A_CHECKPOINT, path,
                                            "no tracker, iteration dirs, metadata.json, .metadata or .distcp files"))
            targets.findings += leftovers.scan_beside(path, path)
    return targets


def _add_file(path: Path, targets: _Targets) -> None:
    if path.name == TRACKER_NAME:
        targets.save_dirs.setdefault(path.parent.resolve(), path.parent)
        return
    parent = path.parent
    if (parent / ".zarray").is_file():  # a chunk or .zarray of a legacy zarr array dir
        parent = parent.parent
    if looks_like_iteration_dir(parent):
        targets.iteration_dirs.setdefault(parent.resolve(), parent)
    else:
        targets.skipped.append(str(path))
