"""The ``fix:`` lines of ``check``, each verified by the command it names: a fix line appears only where that
command, run as printed, would do the fix. Check itself cannot know (a metadata.json of a save that also lost a
data file must stay missing; a dir holding a stray ``.distcp`` is no checkpoint to repair; ``--in-place`` is
refused on object storage): the fixer's own plan, made without writing, decides. Only findings that carry a fix
line cost anything here, so a clean check (a pre-commit hook) pays nothing.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Collection
from pathlib import Path

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.check import CheckReport
from ckptdoctor.ops.edit.plan import EditRequest, plan_edit
from ckptdoctor.ops.fix_args.plan import build_report
from ckptdoctor.ops.pickle_gate import gate_failures
from ckptdoctor.ops.repair.plan import plan as plan_repair
from ckptdoctor.rules import Finding, is_safety, leftovers
from ckptdoctor.severity import OVERRIDDEN
from ckptdoctor.storage.dispatch import is_url


def verified_fixes(report: CheckReport) -> CheckReport:
    """``report`` with each finding's ``fix`` kept only where the named command's plan fixes that code."""
    fixable: dict[str, set[str]] = {}  # fix command -> the codes its plan fixes
    for f in report.findings:
        if f.fix is not None and f.fix not in fixable:
            fixable[f.fix] = _codes_fixed(f.fix, report.findings)
    if not fixable:
        return report
    findings = [
        f if f.fix is None or f.code in fixable[f.fix] else dataclasses.replace(f, fix=None) for f in report.findings
    ]
    return dataclasses.replace(report, findings=findings)


def _codes_fixed(command: str, findings: Collection[Finding] = ()) -> set[str]:
    """The finding codes ``command`` (``ckptdoctor repair|fix-args CKPT --in-place``, ``ckptdoctor edit CKPT
    --drop-extra-state --in-place``) fixes when run; ``findings``: the check's own, for the gate's verdict."""
    words = shlex.split(command)
    fixer, path = words[1], words[2]
    if is_url(path):  # an in-place write needs a rename and a lock: refused on object storage
        return set()
    try:
        if fixer == "repair":
            repair, _ = plan_repair(path)
            return {code for action in repair.actions for code in action.fixes}
        if fixer == "fix-args":
            return _fix_args_codes(path)
        if fixer == "edit" and "--drop-extra-state" in words:
            return _drop_extra_state_codes(path, findings)
    except CkptError:  # the fixer would refuse the checkpoint outright
        return set()
    return set()


def _drop_extra_state_codes(path: str, findings: Collection[Finding]) -> set[str]:
    """``edit --drop-extra-state --in-place`` removes every _extra_state item: what TE 2.16.1, 2.17.1 and >= 2.18
    refuse goes. The gate's verdict is the check's own (CKD230 comes from a check that has just gated every bytes
    item of the dir, and safety findings are never deselected): no second read of the items."""
    checkpoint = open_checkpoint(path)
    leftovers.refuse_if_interrupted(checkpoint.iteration_dir)
    if _gate_refused(Path(path), findings):
        return set()
    plan_edit(checkpoint, EditRequest(drop_extra_state=True))  # refuses an edit that would change nothing
    return {"CKD230"}


def _gate_refused(iteration_dir: Path, findings: Collection[Finding]) -> bool:
    """Whether the check refused something of ``iteration_dir`` at its gate (a safety finding not overridden: the
    fix command, run without --trust-global, would refuse it too)."""
    return any(
        is_safety(f.code)
        and f.severity != OVERRIDDEN
        and (Path(f.path) == iteration_dir or iteration_dir in Path(f.path).parents)
        for f in findings
    )


def _fix_args_codes(path: str) -> set[str]:
    checkpoint = open_checkpoint(path)
    leftovers.refuse_if_interrupted(checkpoint.iteration_dir)  # fix-args refuses a dir an interrupted write left
    if gate_failures(checkpoint):  # every write refuses a checkpoint that fails the gate
        return set()
    plan = build_report(checkpoint, None, [], force=False)
    changed = {change.arg for change in plan.changes}
    return {f.code for f in plan.findings if f.arg in changed}
