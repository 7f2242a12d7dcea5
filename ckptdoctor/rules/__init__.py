"""Rules of ``ckptdoctor check``: stable codes, one-line summaries, rationales, and the findings they produce.

One module per family (codes are never reused or renumbered, so configs and CI logs stay meaningful):

* :mod:`.structure`   CKD1xx  files present, parseable, in range; tracker; common state
* :mod:`.leftovers`   CKD15x  staging dirs, temp files and journals of an interrupted ckptdoctor write
* :mod:`.consistency` CKD2xx  args vs chunk layout (the :mod:`ckptdoctor.arg_rules` table), chunk coverage
* :mod:`.integrity`   CKD3xx  ``integrity.json`` hashes; ``--deep`` blob decoding
* :mod:`.safety`      CKD4xx  pickles referencing callables outside the allowlist

This package is pure: it returns :class:`Finding` objects and never prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptdoctor.errors import CkptError

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class RuleInfo:
    """What ``ckptdoctor rules`` prints for one rule."""

    code: str
    name: str
    family: str
    severity: str
    summary: str
    rationale: str


@dataclass(frozen=True)
class Finding:
    """One problem, one line: ``<path>: <code> <message>``."""

    code: str
    path: str  # the file the finding is about, or the iteration/save dir when the file is missing
    message: str
    severity: str


def all_rules() -> list[RuleInfo]:
    """Every rule, in code order (imports the families lazily: they are small and torch-free)."""
    from ckptdoctor.rules import consistency, integrity, leftovers, safety, structure

    rules = [*structure.RULES, *leftovers.RULES, *consistency.RULES, *integrity.RULES, *safety.RULES]
    return sorted(rules, key=lambda r: r.code)


def rule_by_code() -> dict[str, RuleInfo]:
    return {r.code: r for r in all_rules()}


def finding(rule: RuleInfo, path: object, message: str) -> Finding:
    return Finding(rule.code, str(path), message, rule.severity)


def validate_selectors(selectors: Iterable[str], option: str) -> list[str]:
    """Normalize ``--select``/``--ignore`` values (codes or prefixes, comma separated); unknown ones are errors."""
    codes = [r.code for r in all_rules()]
    out: list[str] = []
    for raw in selectors:
        for part in str(raw).split(","):
            sel = part.strip().upper()
            if not sel:
                continue
            if sel != "ALL" and not any(code.startswith(sel) for code in codes):
                raise CkptError(f"{option}: {part.strip()!r} matches no rule code (see `ckptdoctor rules`)")
            out.append(sel)
    return out


def is_selected(code: str, select: list[str], ignore: list[str]) -> bool:
    """A code is reported when a ``select`` prefix matches it and no ``ignore`` prefix does."""

    def matches(selectors: list[str]) -> bool:
        return any(s == "ALL" or code.startswith(s) for s in selectors)

    return matches(select or ["ALL"]) and not matches(ignore)
