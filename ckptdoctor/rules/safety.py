"""Safety rules (CKD4xx): pickles that would run code if loaded with ``torch.load(weights_only=False)``.

Every pickle ckptdoctor reads goes through :mod:`ckptdoctor.safe_pickle`, which refuses callables outside
its allowlist *before* anything runs and raises :class:`~ckptdoctor.errors.UnsafePickleError`; these rules
turn that refusal into a finding naming the file and the refused global, so a check carries on.
"""

from __future__ import annotations

from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.rules import ERROR, Finding, RuleInfo, finding

UNSAFE_PICKLE = RuleInfo(
    "CKD401", "unsafe-pickle", "safety", ERROR,
    "a pickle references a callable outside the allowlist",
    "common.pt, .metadata, common_state and bytes items are pickles; Megatron and older torch load them with "
    "weights_only=False, so a reference to os.system, eval, subprocess... executes on load. ckptdoctor "
    "refuses it without executing anything; the checkpoint must not be loaded until the file is replaced.",
)

RULES = [UNSAFE_PICKLE]


def unsafe_pickle(error: UnsafePickleError, path: object, what: str) -> Finding:
    """CKD401 for a refused global found in ``what`` (e.g. "common state", "item <key>")."""
    return finding(UNSAFE_PICKLE, path,
                   f"{what}: pickle references {error.module}.{error.name}, not on the allowlist "
                   "(refused, nothing executed)")
