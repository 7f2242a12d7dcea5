"""What ``ckptdoctor repair`` reports (schema ``ckptdoctor.repair/1``): the findings before, the actions planned
(or done, with ``--write``), the refusals and what no repair fixes; filled by :mod:`ckptdoctor.ops.repair.plan` (plan)
and :mod:`ckptdoctor.ops.repair.write` (write and re-check)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.rules import Finding

SCHEMA = "ckptdoctor.repair/1"


@dataclass
class Action:
    kind: str  # "tracker", "metadata-json", "quarantine", "quarantine-leftovers", "fix-args"
    fixes: list[str]  # the finding codes this action makes go away
    path: str
    description: str
    value: Any = None  # tracker value, metadata.json content, file names, or arg changes


@dataclass
class Refusal:
    code: str
    path: str
    reason: str


@dataclass
class RepairWrite:
    mode: str  # "in-place" or "output"
    target: str
    written: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    integrity_updated: bool = False


@dataclass
class RepairReport:
    schema: str
    checkpoint: str  # as given
    save_dir: str | None
    iteration_dir: str | None  # the iteration dir repaired (None: only the tracker is looked at)
    findings: list[Finding]  # what check found before
    actions: list[Action] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)  # repairable kinds that are not safe here
    unrepairable: list[Finding] = field(default_factory=list)
    untouched: list[Finding] = field(default_factory=list)  # warnings no repair is for
    way_out: str = ""
    latest_good: str | None = None
    written: RepairWrite | None = None
    after: list[Finding] | None = None  # check's findings on the result, after --write
    remaining: list[Finding] | None = None  # of those, the ones a repair was meant to fix
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Exit 0: report mode, nothing found; write mode, every repaired finding gone and nothing left unfixed."""
        if self.written is None:
            return not self.findings
        if any(a.kind == "tracker" for a in self.actions):  # the broken checkpoint is no longer resumed from
            return not self.remaining
        return not self.remaining and not self.refused and not self.unrepairable
