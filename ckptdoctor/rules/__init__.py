"""Rules of ``ckptdoctor check``: stable codes, one-line summaries, rationales, and the findings they produce.

One module per family (codes are never reused or renumbered, so configs and CI logs stay meaningful):

* :mod:`.structure`   CKD1xx  files present, parseable, in range; tracker; common state
  (:mod:`.bridge`: Megatron-Bridge's tracker ``latest_train_state.pt`` and ``train_state.pt``, CKD123-125, CKD133)
* :mod:`.leftovers`   CKD15x  staging dirs, temp files and journals of an interrupted ckptdoctor write
* :mod:`.consistency` CKD2xx  args vs chunk layout (the :mod:`ckptdoctor.arg_rules` table), chunk coverage
* :mod:`.integrity`   CKD3xx  ``integrity.json`` hashes; the ``--deep`` rules (decoding: :mod:`.deep_decode`)
* :mod:`.safety`      CKD4xx  pickles referencing callables outside the allowlist
* :mod:`.health`      CKD5xx  ``check --health``: all-zero weights, equal experts, optimizer moments (statistics:
  :mod:`ckptdoctor.values.health`)

Here: :class:`RuleInfo`, :class:`Finding`, the fix commands and the selectors, which every family imports;
:mod:`.registry` (above the families) lists every rule and validates ``--select``/``--ignore``.
This package is pure: it returns :class:`Finding` objects and never prints.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptdoctor.pickle.plain import OMIT_NONE
from ckptdoctor.problems import LostChunk
from ckptdoctor.severity import ERROR as ERROR  # re-exported: rules and renderers import it from here
from ckptdoctor.severity import INFO as INFO
from ckptdoctor.severity import WARNING as WARNING


@dataclass(frozen=True)
class RuleInfo:
    """What ``ckptdoctor rules`` prints for one rule."""

    code: str
    name: str
    family: str
    severity: str
    summary: str
    rationale: str
    fix: str | None = None  # the command that fixes it (``CKPT`` stands for the checkpoint), from FIX_COMMANDS


def family_rule(family: str) -> Callable[[str, str, str, str, str], RuleInfo]:
    """The rule maker of one family: ``_rule = family_rule("structure")``, then ``_rule(code, name, severity,
    summary, rationale)`` (the fix hint comes from FIX_COMMANDS)."""

    def rule(code: str, name: str, severity: str, summary: str, rationale: str) -> RuleInfo:
        return RuleInfo(code, name, family, severity, summary, rationale)

    return rule


@dataclass(frozen=True)
class Finding:
    """One problem, one line: ``<path>: <code> <message> [<severity>]``."""

    code: str
    path: str  # the file the finding is about, or the iteration/save dir when the file is missing
    message: str
    severity: str
    fix: str | None = None  # the command that fixes it, for this checkpoint (see FIX_COMMANDS); None: no fixer
    # the global (module.name) or config target a safety finding is about; absent from JSON elsewhere
    subject: str | None = field(default=None, metadata=OMIT_NONE)
    # CKD113/CKD114: every chunk whose bytes are gone (the message summarises them); absent from JSON elsewhere.
    # Not compared: the message already tells two such findings apart, and a lost list can be 10^5 chunks long.
    lost: tuple[LostChunk, ...] | None = field(default=None, metadata=OMIT_NONE, compare=False)


# The gate: safety findings (CKD4xx) are always reported; no --select/--ignore or config can deselect them.
SAFETY_PREFIX = "CKD4"


def is_safety(code: str) -> bool:
    return code.startswith(SAFETY_PREFIX)


# Which command fixes which finding: code or code prefix -> command template (``{ckpt}``: the checkpoint
# checked, the save dir for tracker findings). The one place `check` and `rules` take fix hints from; a code
# missing here has no automatic fix (truncated or missing data, unsafe pickles: the report says what is lost).
FIX_COMMANDS: dict[str, str] = {
    "CKD101": "ckptdoctor repair {ckpt} --in-place",  # metadata.json of a complete save
    "CKD115": "ckptdoctor repair {ckpt} --in-place",  # unreferenced .distcp quarantined
    "CKD12": "ckptdoctor repair {ckpt} --in-place",  # tracker -> latest good
    "CKD151": "ckptdoctor repair {ckpt} --in-place",  # leftovers quarantined
    "CKD20": "ckptdoctor fix-args {ckpt} --in-place",  # args vs parallelism (arg_rules table)
    "CKD21": "ckptdoctor fix-args {ckpt} --in-place",
    "CKD230": "ckptdoctor edit {ckpt} --drop-extra-state --in-place",  # or NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1
}


def fix_template(code: str) -> str | None:
    """The fix command template for ``code`` (longest matching prefix of FIX_COMMANDS), or None."""
    matches = [prefix for prefix in FIX_COMMANDS if code.startswith(prefix)]
    return FIX_COMMANDS[max(matches, key=len)] if matches else None


def fix_command(code: str, checkpoint: object = "CKPT") -> str | None:
    """The command that fixes a ``code`` finding of ``checkpoint`` (shell-quoted), or None."""
    template = fix_template(code)
    if template is None:
        return None
    shown = str(checkpoint)
    return template.format(ckpt=shown if shown == "CKPT" else shlex.quote(shown))


def with_fix(f: Finding, checkpoint: object) -> Finding:
    """``f`` with its fix command for ``checkpoint`` (unchanged when nothing fixes it)."""
    fix = fix_command(f.code, checkpoint)
    return f if fix is None or f.fix is not None else dataclasses.replace(f, fix=fix)


def finding(rule: RuleInfo, path: object, message: str) -> Finding:
    return Finding(rule.code, str(path), message, rule.severity)


def is_selected(code: str, select: list[str], ignore: list[str]) -> bool:
    """A code is reported when a ``select`` prefix matches it and no ``ignore`` prefix does; a safety code always
    (CKD4xx: the gate cannot be deselected, see :func:`ckptdoctor.rules.registry.validate_selectors`)."""
    if is_safety(code):
        return True

    def matches(selectors: list[str]) -> bool:
        return any(s == "ALL" or code.startswith(s) for s in selectors)

    return matches(select or ["ALL"]) and not matches(ignore)
