"""Safety rules (CKD4xx): pickles and archives that a real load would execute, or that attack the reader.

PyTorch DCP reads ``.metadata`` with plain ``pickle.load`` and Megatron reads the common state and sharded
objects with ``weights_only=False``: a global in those pickles is code that runs on load. Every pickle
ckptdoctor reads goes through :mod:`ckptdoctor.safe_pickle` (an exact allowlist, refused before anything
runs) after :mod:`ckptdoctor.pickle_scan` (resource limits), and every archive through
:mod:`ckptdoctor.formats.archive`; these rules turn the refusals into findings naming the file, so a check
carries on.
"""

from __future__ import annotations

from ckptdoctor import problems
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.rules import ERROR, WARNING, Finding, RuleInfo, finding

UNSAFE_PICKLE = RuleInfo(
    problems.UNSAFE_PICKLE,
    "unsafe-pickle",
    "safety",
    ERROR,
    "a pickle references a global outside the allowlist",
    "common.pt, .metadata, common_state and bytes items are pickles; PyTorch DCP and Megatron load them with "
    "plain pickle / weights_only=False, so a reference to os.system, eval, subprocess, or a torch/numpy helper "
    "that reaches them (torch.os.system, execWrapper) executes on load. The allowlist is exact (module and "
    "name); dotted names and names that are not identifiers are refused. ckptdoctor refuses without executing "
    "anything, and write commands never copy such a pickle; the checkpoint must not be loaded until the file "
    "is replaced.",
)
UNLISTED_GLOBAL = RuleInfo(
    "CKD402",
    "unlisted-class",
    "safety",
    WARNING,
    "a pickle references a megatron / transformer_engine / nemo class that is not on the allowlist",
    "ckptdoctor reads it as an inert stand-in (nothing runs), but a real load imports and calls it. A new "
    "Megatron release can add classes to its checkpoints: check that the name is one you expect.",
)
PICKLE_LIMIT = RuleInfo(
    problems.PICKLE_LIMIT,
    "pickle-limit",
    "safety",
    ERROR,
    "a pickle breaks a resource limit (nesting, memo, size, or it mutates a shared class)",
    "A few MB of hostile pickle can crash a loader (a million-deep tuple overflows the C stack when hashed) "
    "or make it allocate gigabytes. Real checkpoints stay far inside the limits; raise --max-pickle-bytes "
    "for a legitimate giant.",
)
ARCHIVE_ANOMALY = RuleInfo(
    problems.ARCHIVE_ANOMALY,
    "archive-anomaly",
    "safety",
    ERROR,
    "a torch.save archive holds duplicate members, several prefixes or unsafe member names",
    "torch reads the first of two members with one name, other zip readers the last: the checkpoint means "
    "different things to different tools, and a check of one is no check of the other. torch refuses "
    "archives with several prefixes and member names that leave the archive directory.",
)

RULES = [UNSAFE_PICKLE, UNLISTED_GLOBAL, PICKLE_LIMIT, ARCHIVE_ANOMALY]


def refused_pickle(error: CkptError, path: object, what: str) -> Finding:
    """The CKD4xx finding for a refusal raised while reading ``what`` (e.g. "common state", "item <key>")."""
    from ckptdoctor.formats.archive import ArchiveError

    if isinstance(error, UnsafePickleError):
        why = error.detail or "not on the allowlist"
        return finding(
            UNSAFE_PICKLE, path, f"{what}: pickle references {error.global_name}, {why} (refused, nothing executed)"
        )
    if isinstance(error, PickleLimitError):
        return finding(PICKLE_LIMIT, path, f"{what}: {_without_place(str(error))}")
    if isinstance(error, ArchiveError):
        return finding(ARCHIVE_ANOMALY, path, f"{what}: {_without_place(str(error))}")
    return finding(UNSAFE_PICKLE, path, f"{what}: {error}")


def unsafe_pickle(error: UnsafePickleError, path: object, what: str) -> Finding:
    """CKD401 for a refused global found in ``what``."""
    return refused_pickle(error, path, what)


def unlisted_globals(names: list[str], path: object, what: str) -> list[Finding]:
    """CKD402, once per distinct unlisted global of one pickle."""
    return [
        finding(
            UNLISTED_GLOBAL,
            path,
            f"{what}: pickle references {name}, a class not on the allowlist (read as an inert stand-in)",
        )
        for name in sorted(set(names))
    ]


def _without_place(message: str) -> str:
    # Errors name their file ("<path>: ..."); the finding already carries the path.
    head, sep, rest = message.partition(": ")
    return rest if sep and ("/" in head or head.startswith("item ")) else message
