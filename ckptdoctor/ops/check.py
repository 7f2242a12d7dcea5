"""``ckptdoctor check``: validate checkpoint dirs with coded rules (see :mod:`ckptdoctor.rules`).

Paths may be save dirs, iteration dirs or files inside them (pre-commit passes file names); each iteration
dir is checked once. A directory that is no checkpoint is searched for checkpoints below it (``recursive``;
hidden dirs and the contents of checkpoints are not entered). Problems with the checkpoint are findings; only
usage errors (a PATH that does not exist, unless ``missing_ok``, an unknown rule code) raise
:class:`~ckptdoctor.errors.CkptError`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.gc_pause import gc_paused
from ckptdoctor.locate import (
    BRIDGE_TRACKER_NAME,
    NEMO_WEIGHTS_DIR,
    TRACKER_NAME,
    list_dir,
    list_iteration_dirs,
    looks_like_iteration_dir,
)
from ckptdoctor.pickle.plain import OMIT_NONE
from ckptdoctor.pickle.policy import trusted_names
from ckptdoctor.progress import Progress
from ckptdoctor.rules import (
    Finding,
    consistency,
    deep_decode,
    extra_state,
    finding,
    health,
    integrity,
    is_safety,
    is_selected,
    leftovers,
    safety,
    structure,
    with_fix,
)
from ckptdoctor.rules.health import HealthSettings
from ckptdoctor.severity import INFO, OVERRIDDEN
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.values.health import HealthScan, KeyHealth, require_numpy, summarise

SCHEMA = "ckptdoctor.check/1"


@dataclass
class CheckOptions:
    select: list[str] = field(default_factory=lambda: ["ALL"])
    ignore: list[str] = field(default_factory=list)
    deep: bool = False
    all_iterations: bool = False
    verify_integrity: bool = True
    recursive: bool = True  # a dir that is no checkpoint: search below it (off: it is a CKD100 finding)
    # (glob, codes) pairs: findings whose path matches the glob (as named, or relative to ``base_dir``) and
    # one of the codes or prefixes are not reported ([tool.ckptdoctor] per-path-ignores)
    per_path_ignores: list[tuple[str, list[str]]] = field(default_factory=list)
    base_dir: Path | None = None  # where per-path-ignores globs are relative to (the pyproject.toml's dir)
    jobs: int | None = None  # --deep: worker processes (None: the available cores; see ckptdoctor.parallel)
    health: bool = False  # --health (implies deep): per-key statistics and the CKD5xx rules (needs numpy)
    health_settings: HealthSettings = field(default_factory=HealthSettings)  # [tool.ckptdoctor.health-rules]
    health_statistics: bool = True  # --health: the per-key statistics in the report (off: the findings only)
    te_version: tuple[int, int, int] | None = None  # --te-version: the loading run's Transformer Engine (None: newest)


# The files pre-commit passes to the hook (.pre-commit-hooks.yaml `files:`): one that belongs to no checkpoint
# is skipped quietly; any other file that belongs to none is a user naming the wrong thing.
CHECKPOINT_FILE_RE = re.compile(
    r"(^|/)(latest_checkpointed_iteration\.txt|(latest_)?train_state\.pt|metadata\.json|\.metadata|common\.pt|integrity\.json|__\d+_\d+\.distcp)$"
)


@dataclass
class Gate:
    """What the gate found: every safety finding (CKD4xx) is a failure, none deselectable; the only override is a
    global trusted on the command line (``--trust-global``), whose findings are listed as overridden."""

    failing: list[Finding]  # the safety findings reported (each an error)
    trusted: list[str]  # the globals trusted on the command line (module.name)
    overridden: list[Finding]  # safety findings about trusted globals: not reported as findings, not counted

    @property
    def safe(self) -> bool:
        return not self.failing


@dataclass
class ConfigUse:
    """Where ``check``'s settings came from besides the command line (JSON ``config``; a text line when it changed
    anything)."""

    path: str | None  # the pyproject.toml whose [tool.ckptdoctor] was read, None when none
    changed: dict[str, object]  # the settings it set that the command line did not
    not_read: list[str]  # pyproject.toml files passed over: in or below a checkpoint dir being checked


@dataclass
class HealthReport:
    """``check --health``: the statistics of every model and optimizer tensor of one checkpoint (JSON ``health``)."""

    checkpoint: str  # the iteration dir, as named
    keys: list[KeyHealth]


@dataclass
class CheckReport:
    schema: str
    checked: list[str]  # iteration dirs checked, as named from the given paths
    skipped: list[str]  # given files that belong to no checkpoint
    findings: list[Finding]
    counts: dict[str, int]  # findings by severity ("error", "warning"; "info" when there are some)
    missing: list[str] = field(default_factory=list)  # given paths that do not exist (only with missing_ok)
    # no safety finding in what was read, and every path read: nothing here runs code when a loader reads it
    safe_for_loaders: bool = True
    gate: Gate = field(default_factory=lambda: Gate([], [], []))
    config: ConfigUse | None = None
    health: list[HealthReport] | None = field(default=None, metadata=OMIT_NONE)  # only with --health

    @property
    def clean(self) -> bool:
        """No finding but info ones (what a newer release would refuse; they do not fail the check)."""
        return all(f.severity == INFO for f in self.findings)

    @property
    def nothing_found(self) -> bool:
        """No checkpoint found and nothing reported, unless every given path is a file with a checkpoint file
        name that belongs to none (pre-commit passing files of no checkpoint: a quiet pass)."""
        if self.checked or self.findings or self.missing:
            return False
        return not (self.skipped and all(CHECKPOINT_FILE_RE.search(Path(p).as_posix()) for p in self.skipped))


@dataclass
class _Targets:
    save_dirs: dict[Path, Path] = field(default_factory=dict)  # resolved -> as named
    iteration_dirs: dict[Path, Path] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def check_paths(
    paths: list[str],
    options: CheckOptions | None = None,
    progress: Progress | None = None,
    missing_ok: bool = False,
    staged: list[Finding] | None = None,
) -> CheckReport:
    """Run every selected rule on the checkpoints ``paths`` name. A path that does not exist raises
    :class:`CkptError`, or with ``missing_ok`` is listed in the report's ``missing`` (the others are checked).
    ``staged``: ``check --staged``'s findings of what the commit holds otherwise (the gate vouches for nothing
    then)."""
    options = options or CheckOptions()
    if options.health:
        require_numpy()  # one clear error before any work
    targets = resolve_targets(paths, options.recursive, missing_ok)
    reports: list[HealthReport] | None = [] if options.health and options.health_statistics else None
    # (finding, the checkpoint its fix command names); None: no checkpoint a fixer could take
    found: dict[Finding, Path | None] = dict.fromkeys([*targets.findings, *(staged or [])])
    iteration_dirs: dict[Path, Path] = {}
    for save_dir, shown in targets.save_dirs.items():
        chosen, tracker_findings = structure.check_save_dir(save_dir, shown, options.all_iterations)
        for f in tracker_findings + leftovers.scan_beside(save_dir, shown):  # also those of a dir gone missing
            found.setdefault(f, shown)  # a leftover beside an iteration dir is seen from the save dir too
        # an interrupted --output write to this save dir (its rerun then succeeded) leaves its staging dir
        # beside it; the message gives the rm command (repair moves only leftovers of an iteration dir)
        for f in leftovers.scan_beside(save_dir.parent, shown.parent, save_dir.name):
            found.setdefault(f, None)
        for directory in chosen:
            iteration_dirs.setdefault(directory.resolve(), shown / directory.name)
    for resolved, shown in targets.iteration_dirs.items():
        iteration_dirs.setdefault(resolved, shown)
    for shown in iteration_dirs.values():  # keyed by resolved path (each once), read as named (messages match)
        for f in check_iteration_dir(shown, shown, options, progress, reports):
            found.setdefault(f, shown)
    overridden = [f for f in found if f.severity == OVERRIDDEN]
    kept = [
        f if ckpt is None else with_fix(f, ckpt)
        for f, ckpt in found.items()
        if f.severity != OVERRIDDEN
        and (
            f.code == structure.STAGED_DIFFERS.code  # like the gate: not what the commit holds, whatever is selected
            or (
                is_selected(f.code, options.select, options.ignore)
                and (is_safety(f.code) or not _path_ignored(f, options))
            )
        )
    ]
    counts = {"error": 0, "warning": 0}
    for f in kept:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    gate = Gate([f for f in kept if is_safety(f.code)], trusted_names(), overridden)
    # The gate vouches only for what it read: a path that is missing, holds no checkpoint, or holds one in a
    # format nothing here reads (legacy mp_rank_* pickles) is not "safe", whatever --select leaves shown.
    # Nor where the commit holds other bytes than were read (check --staged: CKD160).
    unread_codes = (structure.NOT_A_CHECKPOINT.code, structure.UNSUPPORTED_FORMAT.code, structure.STAGED_DIFFERS.code)
    unread = [f for f in found if f.code in unread_codes]
    vouched = bool(iteration_dirs) and not targets.missing and not unread
    return CheckReport(
        SCHEMA,
        [str(s) for s in iteration_dirs.values()],
        targets.skipped,
        kept,
        counts,
        targets.missing,
        gate.safe and vouched,
        gate,
        health=reports,
    )


def _scan_values(options: CheckOptions) -> bool:
    return is_selected(integrity.NON_FINITE.code, options.select, options.ignore)


def _path_ignored(f: Finding, options: CheckOptions) -> bool:
    """A per-path-ignores glob matches the finding's path (as named, or relative to the config's dir) and one
    of its codes matches the finding's code."""
    if not options.per_path_ignores:
        return False
    names = [Path(f.path).as_posix()]
    if options.base_dir is not None:
        try:
            names.append(Path(os.path.abspath(f.path)).relative_to(options.base_dir.resolve()).as_posix())
        except ValueError:
            pass
    for glob, codes in options.per_path_ignores:
        if any(
            fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(name, glob.rstrip("/") + "/*") for name in names
        ) and is_selected(f.code, codes, []):
            return True
    return False


def check_iteration_dir(
    directory: Path,
    shown: Path,
    options: CheckOptions,
    progress: Progress | None = None,
    health_reports: list[HealthReport] | None = None,
) -> list[Finding]:
    """Every rule family on one iteration dir; structure problems never stop the other families. With
    ``options.health``, the dir's statistics are appended to ``health_reports``."""
    return scan_and_check(directory, shown, options, progress, health_reports)[1]


def scan_and_check(
    directory: Path,
    shown: Path,
    options: CheckOptions,
    progress: Progress | None = None,
    health_reports: list[HealthReport] | None = None,
) -> tuple[structure.Scanned, list[Finding]]:
    """:func:`check_iteration_dir`, and what the scan could read (for a caller that plans on it: repair)."""
    # ~10 small objects per chunk, none cyclic: the collector's repeated scans of them cost more than the work.
    with gc_paused():
        state, findings = structure.scan_iteration(directory, shown)
        if state.checkpoint is not None:  # the gate on every bytes item's pickle (the common state: above)
            findings += safety.check_items(state.checkpoint, shown, state.bad_files)
        findings += leftovers.check_iteration_dir(directory, shown)
        findings += consistency.check(state)
        findings += extra_state.check(state, options.te_version)
        findings += integrity.check_manifest(state, verify_hashes=options.verify_integrity)
        if options.deep or options.health:
            stats = HealthScan() if options.health else None
            if progress is not None:
                progress.start(str(shown), deep_decode.deep_bytes(state))
            try:
                advance = progress.advance if progress is not None else None
                findings += deep_decode.check_deep(state, advance, _scan_values(options), options.jobs, stats)
            finally:
                if progress is not None:
                    progress.finish()
            if stats is not None:
                findings += health.check_health(state, stats, options.health_settings)
                if health_reports is not None:
                    keys = [summarise(key, stats.keys[key]) for key in sorted(stats.keys)]
                    health_reports.append(HealthReport(str(shown), keys))
    return state, findings


def health_scan(directory: Path, shown: Path, jobs: int | None = None, progress: Progress | None = None) -> HealthScan:
    """The statistics of every model and optimizer tensor of one iteration dir: ``check --health``'s streaming
    pass (``deep_decode.check_deep`` filling a :class:`HealthScan`), without the rules (``diff --stats``)."""
    require_numpy()
    stats = HealthScan()
    with gc_paused():
        state, found = structure.scan_iteration(directory, shown)
        _refuse_unreadable(found, shown)
        if progress is not None:
            progress.start(str(shown), deep_decode.deep_bytes(state))
        try:
            advance = progress.advance if progress is not None else None
            _refuse_unreadable(deep_decode.check_deep(state, advance, False, jobs, stats), shown)
        finally:
            if progress is not None:
                progress.finish()
    return stats


# What leaves a tensor's statistics partial or wrong: the index, a data file or a chunk that cannot be read whole
# (``diff --stats --all-iterations`` measured a half-written iteration's one rank as a change of the weights).
UNREADABLE_DATA = frozenset({"CKD110", "CKD111", "CKD112", "CKD113", "CKD114", "CKD310", "CKD311"})


def _refuse_unreadable(found: list[Finding], shown: Path) -> None:
    bad = [f for f in found if f.code in UNREADABLE_DATA]
    if bad:
        more = f" (and {len(bad) - 1} more: ckptdoctor check --deep {shown})" if len(bad) > 1 else ""
        raise CkptError(f"{shown}: cannot measure its tensors: {bad[0].path}: {bad[0].code} {bad[0].message}{more}")


def resolve_targets(paths: list[str], recursive: bool = True, missing_ok: bool = False) -> _Targets:
    """Map each path to a save dir or an iteration dir (each once); non-checkpoint files are skipped; a dir
    that is no checkpoint is searched below (``recursive``) or is a CKD100 finding."""
    targets = _Targets()
    for raw in paths:
        path = as_path(raw)
        if not path.exists():
            # an output dir that an interrupted write never renamed into place: report its leftovers
            left = leftovers.scan_beside(path.parent, path.parent, path.name)
            if left:
                targets.findings += left
            elif missing_ok:
                targets.missing.append(raw)
            else:
                raise CkptError(f"{raw}: no such file or directory")
            continue
        if path.is_file():
            _add_file(path, targets)
            continue
        if path.is_dir():
            list_dir(path)  # a dir that cannot be listed: one error naming it, before a stat inside it fails
        if _add_checkpoint_dir(path, targets):
            continue
        before = len(targets.save_dirs) + len(targets.iteration_dirs)
        if recursive:
            _discover(path, targets, {path.resolve()})
        if len(targets.save_dirs) + len(targets.iteration_dirs) == before:
            why = "no tracker, iteration dirs, metadata.json, .metadata or .distcp files"
            if recursive:
                why = f"no checkpoint found under it ({why}, in it or in any dir below it)"
            targets.findings.append(finding(structure.NOT_A_CHECKPOINT, path, why))
        targets.findings += leftovers.scan_beside(path, path)
    return targets


def _add_checkpoint_dir(path: Path, targets: _Targets) -> bool:
    """Add ``path`` if it is a save dir or an iteration dir (NeMo 2's ``weights/`` included)."""
    if (path / TRACKER_NAME).is_file() or (not looks_like_iteration_dir(path) and list_iteration_dirs(path)):
        targets.save_dirs.setdefault(path.resolve(), path)
    elif looks_like_iteration_dir(path):
        targets.iteration_dirs.setdefault(path.resolve(), path)
    elif looks_like_iteration_dir(path / NEMO_WEIGHTS_DIR):  # NeMo 2 style: <ckpt>/weights/
        targets.iteration_dirs.setdefault((path / NEMO_WEIGHTS_DIR).resolve(), path / NEMO_WEIGHTS_DIR)
    else:
        return False
    return True


def _discover(directory: Path, targets: _Targets, seen: set[Path]) -> None:
    """Checkpoints below ``directory`` (not itself one), in name order: a save or iteration dir is added and
    not entered; hidden dirs (ckptdoctor's staging and backup dirs among them) are not entered; a symlinked
    dir is followed once (each resolved dir is visited once), except a link to ``directory`` or a dir above it
    (a tree from someone else linking ``/`` would make the search walk the filesystem). Depth-first with an
    explicit stack: a tree thousands of dirs deep must not exhaust Python's recursion. A dir's resolved path is
    its resolved parent's plus its name unless it is a symlink (resolving each full path again was quadratic in
    the depth)."""
    root = directory.resolve()
    stack = [(directory, root, iter(sorted(list_dir(directory))))]
    while stack:
        parent, parent_resolved, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        child = parent / name
        if name.startswith(".") or not child.is_dir():
            continue
        resolved = child.resolve() if child.is_symlink() else parent_resolved / name
        if resolved in seen or root.is_relative_to(resolved):
            continue  # visited, or a link to the root or above it: the search would cover the whole tree above
        seen.add(resolved)
        below = sorted(list_dir(child))  # one error naming a dir that cannot be listed
        if not _add_checkpoint_dir(child, targets):
            targets.findings += leftovers.scan_beside(child, child)
            stack.append((child, resolved, iter(below)))


@dataclass
class StagedTargets:
    """What ``check --staged`` checks: the checkpoint dirs of the staged paths, and (CKD160) where the working tree
    it reads differs from what the commit holds there."""

    paths: list[str]
    findings: list[Finding]


def staged_checkpoint_dirs(cwd: Path | None = None) -> StagedTargets:
    """The checkpoint dirs that the paths staged in git belong to, deletions included (``check --staged``, the
    ``ckptdoctor-check-staged`` pre-commit hook): pre-commit passes a hook only files that still exist, so a commit
    deleting ``__1_0.distcp`` or ``metadata.json`` passed ``ckptdoctor-check`` unchecked. Each staged path maps to
    the iteration dir it lies in, or the save dir (a deleted iteration dir, a tracker); a path of no checkpoint (a
    deleted checkpoint as a whole among them) or outside the repository maps to none. Named relative to ``cwd``
    where below it, in name order. The check reads the working tree: files there that the commit leaves out or holds
    otherwise are CKD160 findings (pre-commit stashes unstaged changes, not untracked files)."""
    cwd = cwd or Path.cwd()
    top = Path(_git(cwd, "rev-parse", "--show-toplevel").rstrip("\n")).resolve()
    # --no-renames: a rename is its deletion and its addition; no external diff or textconv (name-only runs neither)
    names = _git(cwd, "diff", "--cached", "--name-only", "-z", "--no-renames", "--no-ext-diff", "--no-textconv")
    found: dict[Path, str] = {}
    for name in filter(None, names.split("\0")):
        directory = _checkpoint_dir_of(top / name, top)
        if directory is not None and directory.resolve() not in found:
            shown = os.path.relpath(directory, cwd)
            found[directory.resolve()] = directory.as_posix() if shown.startswith("..") else Path(shown).as_posix()
    return StagedTargets(sorted(found.values()), _unstaged_differences(top, found))


UNSTAGED_EXAMPLES = 3


# Dot files a loader reads; other dot files (.DS_Store, an editor's swap file, a .metadata.bak-* backup) and a
# desktop's thumbnails are nobody's checkpoint, whether committed or not.
_LOADER_DOT_FILES = frozenset({".metadata", ".zarray", ".zgroup", ".zattrs"})
_DESKTOP_FILES = frozenset({"Thumbs.db", "desktop.ini"})


def _commit_matters(name: str) -> bool:
    """Whether a file left out of the commit (or committed as staged) changes the checkpoint it lies in."""
    base = name.rsplit("/", 1)[-1]
    if base in _DESKTOP_FILES:
        return False
    return not base.startswith(".") or base in _LOADER_DOT_FILES


def _unstaged_differences(top: Path, dirs: dict[Path, str]) -> list[Finding]:
    """CKD160 per checkpoint dir: its files that are not staged (untracked or ignored: ``ls-files --others``), and
    those changed since they were staged (``diff`` of the working tree against the index)."""
    if not dirs:
        return []
    specs = [f":(literal){d.relative_to(top).as_posix() if d != top else '.'}" for d in dirs]
    untracked = _git(top, "ls-files", "-z", "--others", "--full-name", "--", *specs)
    changed = _git(top, "diff", "-z", "--name-only", "--no-renames", "--no-ext-diff", "--no-textconv", "--", *specs)
    findings = []
    kinds = (
        (
            untracked,
            "not staged (untracked, ignored or removed with git rm --cached)",
            "leaves {it} out",
            "git add {it} (-f where ignored) or move {it} out of the checkpoint",
        ),
        (
            changed,
            "changed since staged",
            "holds the staged version",
            "git add {it}, or check with the rest stashed (git stash --keep-index)",
        ),
    )
    for listing, what, commit, remedy in kinds:
        by_dir: dict[Path, list[str]] = {}
        for name in filter(None, listing.split("\0")):
            if not _commit_matters(name):
                continue
            path = top / name
            owner = max((d for d in dirs if d == path or d in path.parents), key=lambda d: len(d.parts), default=None)
            if owner is not None:
                by_dir.setdefault(owner, []).append(path.relative_to(owner).as_posix())
        for owner, files in sorted(by_dir.items()):
            files.sort()
            shown = ", ".join(files[:UNSTAGED_EXAMPLES]) + (
                f" and {len(files) - UNSTAGED_EXAMPLES} more" if len(files) > UNSTAGED_EXAMPLES else ""
            )
            one = len(files) == 1
            it = "it" if one else "them"
            message = (
                f"{len(files)} file{'' if one else 's'} {what}: {shown}; check read the working tree, the commit "
                f"{commit.format(it=it)}: {remedy.format(it=it)}"
            )
            findings.append(finding(structure.STAGED_DIFFERS, dirs[owner], message))
    return findings


def _git(cwd: Path, *args: str) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False)
    except OSError as exc:
        raise CkptError(f"--staged runs git: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise CkptError(f"--staged: git {args[0]} failed: {why[-1] if why else f'exit {proc.returncode}'}")
    return proc.stdout.decode("utf-8", "surrogateescape")


def _checkpoint_dir_of(path: Path, top: Path) -> Path | None:
    """The iteration dir or save dir ``path`` (which may no longer exist) belongs to, or None; never a dir above the
    repository's top (``top``): what lies outside it is not committed."""
    inside = [p for p in (path, *path.parents) if p == top or top in p.parents]
    existing = next((p for p in inside if p.exists() or p.is_symlink()), None)
    if existing is None:
        return None
    start = existing if existing.is_dir() and not existing.is_symlink() else existing.parent
    if looks_like_iteration_dir(start):
        return start
    if (start / TRACKER_NAME).exists() or (start / BRIDGE_TRACKER_NAME).exists() or list_iteration_dirs(start):
        return start  # a save dir: a tracker staged, an iteration dir deleted
    for parent in [p for p in start.parents if p in inside][:2]:  # a zarr array dir, NeMo 2's weights/ below it
        if looks_like_iteration_dir(parent):
            return parent
    return None


def _add_file(path: Path, targets: _Targets) -> None:
    if path.name in (TRACKER_NAME, BRIDGE_TRACKER_NAME):  # a save dir's tracker, Megatron-LM's or Megatron-Bridge's
        targets.save_dirs.setdefault(path.parent.resolve(), path.parent)
        return
    parent = path.parent
    if (parent / ".zarray").is_file():  # a chunk or .zarray of a legacy zarr array dir
        parent = parent.parent
    if looks_like_iteration_dir(parent):
        targets.iteration_dirs.setdefault(parent.resolve(), parent)
    else:
        targets.skipped.append(str(path))
