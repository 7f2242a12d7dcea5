"""Leftovers of an interrupted ckptdoctor write (CKD150, CKD151), and how to restore or remove each.

ckptdoctor's write commands only ever create hidden, uniquely named paths beside or inside a checkpoint and
rename them into place at the end (see :mod:`ckptdoctor.atomic`). A kill, a crash or a full disk can leave
one behind; each name says what it was:

* ``.<iter>.ckptdoctor-swap-<inode>-<stamp>-<token>/`` beside an iteration dir: the staging dir of
  ``strip-frozen --in-place``. ``<inode>`` is the inode number of the original iteration dir, so whether the
  atomic swap happened (the staging name then holds the original) is read from the disk, not guessed.
* ``.<name>.ckptdoctor-tmp-<stamp>-<token>/``: the staging dir of ``strip-frozen --output`` (new data only).
* ``.<name>.ckptdoctor-old-<stamp>-<token>/``: the previous content of an ``--output`` dir replaced with ``--force``.
* ``.<name>.ckptdoctor-del-<stamp>-<token>/``: an old tree being deleted (``--no-backup``).
* ``.<file>.ckptdoctor-part-<token>`` inside a dir: a temp file of an atomic write.
* ``.ckptdoctor-fixargs-<stamp>.json`` inside an iteration dir: the journal of ``fix-args --write
  --in-place``, removed when the run completes (or is rolled back).

CKD150 (error) means the checkpoint is not as either run state would leave it and says how to restore the
original; CKD151 (warning) is a leftover that is safe to delete. Write commands refuse to start on a
checkpoint with either until it is resolved. Lock files (:mod:`ckptdoctor.locking`) are never reported.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.rules import ERROR, WARNING, Finding, RuleInfo, finding
from ckptdoctor.storage.files import list_names, read_json

INTERRUPTED_WRITE = RuleInfo(
    "CKD150",
    "interrupted-write",
    "structure",
    ERROR,
    "an interrupted ckptdoctor write left the checkpoint displaced or partly rewritten",
    "fix-args --in-place or strip-frozen was killed (or hit a full disk) between two of its steps: the original "
    "is complete but under another name (a staging or backup dir) or some files are rewritten and others not. "
    "The finding names every path and the exact commands that put the original back; write commands refuse to "
    "run on the checkpoint until it is resolved.",
)
WRITE_LEFTOVER = RuleInfo(
    "CKD151",
    "write-leftover",
    "structure",
    WARNING,
    "a staging dir or temp file of an interrupted ckptdoctor write (safe to delete)",
    "An interrupted run left unfinished new data beside or inside the checkpoint; the checkpoint itself is "
    "untouched or complete. It wastes space and blocks the next write command until it is deleted (the "
    "finding gives the command).",
)

RULES = [INTERRUPTED_WRITE, WRITE_LEFTOVER]

SWAP_MARK = ".ckptdoctor-swap-"
TMP_MARK = ".ckptdoctor-tmp-"
OLD_MARK = ".ckptdoctor-old-"
DEL_MARK = ".ckptdoctor-del-"
JOURNAL_RE = re.compile(r"^\.ckptdoctor-fixargs-(?P<stamp>[0-9T]+(?:-[0-9a-f]+)?)\.json$")
_BESIDE_RE = re.compile(r"^\.(?P<target>.+)\.ckptdoctor-(?P<kind>swap|tmp|old|del)-(?P<rest>.+)$")
_SWAP_REST_RE = re.compile(r"^(?P<ino>\d+)-(?P<stamp>\d{8}T\d{6})-(?P<token>[0-9a-f]+)$")
_PART_RE = re.compile(r"^\.(?P<name>.+)\.ckptdoctor-part-[0-9a-f]+$")


def journal_name(stamp: str) -> str:
    return f".ckptdoctor-fixargs-{stamp}.json"


def _q(path: object) -> str:
    return shlex.quote(str(path))


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _find_inode(parent: Path, inode: int) -> str | None:
    """The name of the entry of ``parent`` with inode number ``inode`` (the original iteration dir)."""
    try:
        with os.scandir(parent) as it:
            for entry in it:
                try:
                    if entry.inode() == inode:
                        return entry.name
                except OSError:
                    continue
    except OSError:
        return None
    return None


# --- beside an iteration (or output) dir ------------------------------------------------------------------


def scan_beside(parent: Path, shown_parent: Path, target: str | None = None) -> list[Finding]:
    """Findings for ckptdoctor staging/old/delete dirs in ``parent`` (only those of ``target`` when given)."""
    try:
        names = sorted(list_names(parent))
    except OSError:
        return []
    findings = []
    for name in names:
        match = _BESIDE_RE.match(name)
        if not match or (target is not None and match.group("target") != target):
            continue
        st = _lstat(parent / name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            continue
        findings.append(_beside(parent, shown_parent, name, match, st))
    return findings


def _beside(parent: Path, shown_parent: Path, name: str, match: re.Match[str], st: os.stat_result) -> Finding:
    target, kind, rest = match.group("target"), match.group("kind"), match.group("rest")
    here, shown_target = shown_parent / name, shown_parent / target
    target_st = _lstat(parent / target)
    if kind == "swap":
        swap = _SWAP_REST_RE.match(rest)
        if swap:
            return _swap(parent, shown_parent, name, target, int(swap.group("ino")), swap.group("stamp"), st, target_st)
    if kind == "tmp" and rest.isdigit():  # an older ckptdoctor's pid-named staging dir: its role is unknown
        return finding(
            INTERRUPTED_WRITE,
            here,
            f"staging dir of an interrupted ckptdoctor write (older ckptdoctor): it may hold the original "
            f"{target} (an --in-place run cut short right after its swap) or an unfinished new copy; "
            f"compare `ckptdoctor inspect {_q(here)}` with `ckptdoctor inspect {_q(shown_target)}` "
            "before deleting either",
        )
    if kind == "tmp":
        return finding(
            WRITE_LEFTOVER,
            here,
            f"unfinished output of an interrupted ckptdoctor write (the source was "
            f"not modified); delete it: rm -rf {_q(here)}",
        )
    if kind == "old":
        if target_st is None:
            return finding(
                INTERRUPTED_WRITE,
                here,
                f"{target} is missing: a ckptdoctor write with --force was interrupted while replacing it and this "
                f"is its previous content; restore it: mv {_q(here)} {_q(shown_target)}",
            )
        return finding(
            WRITE_LEFTOVER,
            here,
            f"previous content of {target}, replaced by a ckptdoctor write with --force (the "
            f"new output is in place); delete it: rm -rf {_q(here)}",
        )
    return finding(
        WRITE_LEFTOVER,
        here,
        f"old tree of {target} being deleted when a run was interrupted (--no-backup); delete it: rm -rf {_q(here)}",
    )


def _swap(
    parent: Path,
    shown_parent: Path,
    name: str,
    target: str,
    inode: int,
    stamp: str,
    st: os.stat_result,
    target_st: os.stat_result | None,
) -> Finding:
    here, shown_target = shown_parent / name, shown_parent / target
    if st.st_ino == inode:
        stripped = shown_parent / f"{target}.stripped-{stamp}"
        backup = shown_parent / f"{target}.bak-{stamp}"
        return finding(
            INTERRUPTED_WRITE,
            here,
            f"holds the original {target}: a ckptdoctor --in-place write was interrupted right after its "
            f"atomic swap ({target} holds the complete stripped checkpoint); restore the original: "
            f"mv {_q(shown_target)} {_q(stripped)} && mv {_q(here)} {_q(shown_target)}; "
            f"or keep the stripped one and this as its backup: mv {_q(here)} {_q(backup)}",
        )
    if target_st is not None and target_st.st_ino == inode:
        return finding(
            WRITE_LEFTOVER,
            here,
            f"unfinished new copy of {target} from an interrupted ckptdoctor --in-place write; "
            f"{target} is the untouched original; delete it: rm -rf {_q(here)}",
        )
    original = _find_inode(parent, inode)
    if original is not None and target_st is None:
        return finding(
            INTERRUPTED_WRITE,
            here,
            f"{target} is missing: a ckptdoctor --in-place write was interrupted between its two renames; "
            f"the original is {original}; restore it: mv {_q(shown_parent / original)} "
            f"{_q(shown_target)} && rm -rf {_q(here)}",
        )
    if original is not None:
        return finding(
            WRITE_LEFTOVER,
            here,
            f"staging dir of a ckptdoctor --in-place write of {target} (the original is kept as "
            f"{original}); delete it: rm -rf {_q(here)}",
        )
    return finding(
        INTERRUPTED_WRITE,
        here,
        f"staging dir of an interrupted ckptdoctor --in-place write; the original {target} (inode {inode}) "
        f"is not beside it: check it with `ckptdoctor inspect {_q(here)}` before deleting anything",
    )


# --- inside an iteration dir --------------------------------------------------------------------------------


def scan_inside(directory: Path, shown: Path) -> list[Finding]:
    """Findings for a fix-args journal and for temp files of atomic writes inside ``directory``."""
    try:
        names = sorted(list_names(directory))
    except OSError:
        return []
    findings = []
    for name in names:
        journal = JOURNAL_RE.match(name)
        if journal:
            findings.append(_journal(directory, shown, name, journal.group("stamp")))
        elif _PART_RE.match(name):
            findings.append(
                finding(
                    WRITE_LEFTOVER,
                    shown / name,
                    f"partial file of an interrupted write; delete it: rm -f {_q(shown / name)}",
                )
            )
    return findings


def restore_commands(directory: Path, shown: Path, stamp: str, replaced: list[str], created: list[str]) -> str:
    """Shell commands that put back what an interrupted ``fix-args --in-place`` changed, valid in every state:
    ``ln -f`` also works where the backup is still a hard link of the unchanged file (``mv`` refuses that)."""
    steps = [f"cd {_q(shown)}"]
    for name in replaced:
        backup = f"{name}.bak-{stamp}"
        if os.path.lexists(directory / backup):
            steps.append(f"ln -f {_q(backup)} {_q(name)} && rm -f {_q(backup)}")
    present = [n for n in created if os.path.lexists(directory / n)]
    steps.append("rm -f " + " ".join(_q(n) for n in [*present, journal_name(stamp)]))
    return " && ".join(steps)


def _journal(directory: Path, shown: Path, name: str, stamp: str) -> Finding:
    try:
        record = read_json(directory / name)
        replaced, created = list(record["replaced"]), list(record["created"])
    except (OSError, ValueError, KeyError, TypeError):
        replaced, created = (
            [".metadata", "common.pt", "run_config.yaml", "integrity.json"],
            [f"common_state.fixargs-{stamp}.distcp"],
        )
    return finding(
        INTERRUPTED_WRITE,
        shown / name,
        f"fix-args --in-place (backups .bak-{stamp}) was interrupted; some files may be "
        f"rewritten; restore the original: {restore_commands(directory, shown, stamp, replaced, created)}",
    )


# --- one iteration dir, and the refusal of write commands ---------------------------------------------------


def check_iteration_dir(directory: Path, shown: Path) -> list[Finding]:
    """Leftovers inside ``directory`` and beside it (named after it)."""
    return scan_inside(directory, shown) + scan_beside(directory.parent, shown.parent, directory.name)


def refuse_if_interrupted(iteration_dir: Path) -> None:
    """Raise a one-line :class:`CkptError` when an interrupted write left something on ``iteration_dir``."""
    found = check_iteration_dir(iteration_dir, iteration_dir)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CkptError(
            f"{iteration_dir}: an interrupted ckptdoctor write left {found[0].path}{more}; run "
            f"`ckptdoctor check {iteration_dir}` and follow its restore steps before writing again"
        )
