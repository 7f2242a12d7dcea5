"""Every rule of ``ckptdoctor check``, from all families: the list ``ckptdoctor rules`` prints, the codes
``--select``/``--ignore`` may name. Above the families (they import :mod:`ckptdoctor.rules`, not this)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ckptdoctor.errors import CkptError
from ckptdoctor.rules import (
    SAFETY_PREFIX,
    RuleInfo,
    bridge,
    consistency,
    extra_state,
    fix_command,
    health,
    integrity,
    leftovers,
    safety,
    structure,
)


def all_rules() -> list[RuleInfo]:
    """Every rule, in code order."""
    rules = [
        *structure.RULES,
        *bridge.RULES,
        *leftovers.RULES,
        *consistency.RULES,
        *extra_state.RULES,
        *integrity.RULES,
        *health.RULES,
        *safety.RULES,
    ]
    return sorted((dataclasses.replace(r, fix=fix_command(r.code)) for r in rules), key=lambda r: r.code)


def rule_by_code() -> dict[str, RuleInfo]:
    return {r.code: r for r in all_rules()}


def validate_selectors(selectors: Iterable[str], option: str, listing: bool = False) -> list[str]:
    """Normalize ``--select``/``--ignore`` values (codes or prefixes, comma separated); unknown ones are errors, and
    so is one naming a safety rule (the gate is always on), unless the selectors only pick rules to list
    (``listing``: ``ckptdoctor rules CKD4``)."""
    codes = [r.code for r in all_rules()]
    out: list[str] = []
    for raw in selectors:
        for part in str(raw).split(","):
            sel = part.strip().upper()
            if not sel:
                continue
            if sel != "ALL" and not any(code.startswith(sel) for code in codes):
                raise CkptError(f"{option}: {part.strip()!r} matches no rule code (see `ckptdoctor rules`)")
            if sel.startswith(SAFETY_PREFIX) and not listing:
                raise CkptError(
                    f"{option}: {part.strip()!r} names a safety rule (CKD4xx): the gate is always on and cannot be "
                    "selected or ignored; the only override is --trust-global MODULE.NAME on the command line"
                )
            out.append(sel)
    return out
