"""The gate every write command passes before its output can carry a checkpoint's pickles to a new place.

Write commands hard-link or copy bytes items (rng state, ``_extra_state``, optimizer leftovers), ``common.pt``,
``.metadata`` and Megatron-Bridge's train state files unchanged; the next loader unpickles them (plain
``pickle.load``, ``torch.load(weights_only=False)``) and instantiates ``run_config.yaml``'s targets. A pickle
naming a global outside the exact allowlist (refused, or read here as an inert stand-in), breaking a limit, or
an archive torch would read differently is never carried: the write is refused with exit 1 and one line naming
the file, the item, the global and the code. ``--force`` does not override it; ``--trust-global MODULE.NAME`` does,
for that name. What a write makes anew (a rewritten ``.metadata`` or common state) is read back through the same
gate before its rename (``unpickler.dumps``).
"""

from __future__ import annotations

from collections.abc import Collection

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError, GateRefusal
from ckptdoctor.formats.archive import ArchiveError, is_torch_zip
from ckptdoctor.rules import Finding
from ckptdoctor.rules.bridge import bridge_gate
from ckptdoctor.rules.safety import (
    check_items,
    gate_findings,
    refused_pickle,
    run_config_findings,
    saved_spec_findings,
    unlisted_globals,
)
from ckptdoctor.severity import OVERRIDDEN
from ckptdoctor.storage.files import open_regular


def gate_failures(
    checkpoint: Checkpoint, keys: Collection[str] | None = None, metadata_carried: bool = True
) -> list[Finding]:
    """The gate's failures in what a write carries of ``checkpoint`` unchanged: the bytes items (of ``keys``, when
    given), ``common.pt``, the ``.metadata`` (unless the write makes it anew: ``metadata_carried``), the iteration
    dir's Bridge files. Damage is not the gate's business (torch reads nothing of a damaged zip)."""
    directory = checkpoint.iteration_dir
    found: list[Finding] = []
    if metadata_carried and checkpoint.dcp is not None:
        found += unlisted_globals(list(checkpoint.dcp.unlisted), directory / ".metadata", "DCP metadata")
    if checkpoint.common_source == "common.pt":
        found += _common_pt(checkpoint)
    found += check_items(checkpoint, directory, keys=keys, with_common=True)
    try:
        found += saved_spec_findings(checkpoint.common_state().get("args"), directory, "common state")
    except CkptError:
        pass  # an unreadable common state: its refusal is above, damage is not the gate's business
    found += bridge_gate(directory)
    found += run_config_findings(directory, directory)
    return [f for f in found if f.severity != OVERRIDDEN]


def refusal(failure: Finding) -> GateRefusal:
    """The one line a write refuses with: file, item, global and code (exit 1)."""
    return _refusing(f"{failure.path}: {failure.code} {failure.message}", failure)


def as_refusal(error: CkptError) -> GateRefusal:
    """A refusal of the one unpickler met while a write command reads its source (a ``.metadata`` naming
    ``os.system``, say), as the write's one-line refusal with its code (exit 1)."""
    failure = refused_pickle(error, "", "")
    return _refusing(f"{failure.code} {error}", failure)


# The codes a trusted name overrides (a global or target named by the finding); limits and archives: nothing does
_TRUSTABLE = frozenset({"CKD401", "CKD402", "CKD405"})


def _refusing(what: str, failure: Finding) -> GateRefusal:
    trustable = (
        failure.subject is not None
        and failure.code in _TRUSTABLE
        and "not a valid dotted Python name" not in failure.message  # refused before any trust is asked
    )
    override = f"--trust-global {failure.subject} overrides it" if trustable else "nothing overrides it"
    return GateRefusal(
        f"{what}; refusing to write an output that carries it: a real load would run code or choke on it "
        f"({override}; --force does not)"
    )


def refuse_unsafe_pickles(
    checkpoint: Checkpoint, keys: Collection[str] | None = None, metadata_carried: bool = True
) -> None:
    """Raise :class:`GateRefusal` at the first of :func:`gate_failures`."""
    failures = gate_failures(checkpoint, keys, metadata_carried)
    if failures:
        raise refusal(failures[0])


def _common_pt(checkpoint: Checkpoint) -> list[Finding]:
    path = checkpoint.iteration_dir / "common.pt"

    def read(unlisted: list) -> None:
        with open_regular(path) as f:
            head = f.read(4)
        if head and not is_torch_zip(head):  # torch.load unpickles it as a legacy save, as a bytes item
            raise ArchiveError(f"{path}: not a torch.save archive, which torch.load unpickles as a legacy save")
        checkpoint.common_state()
        unlisted.extend(checkpoint.common_unlisted)

    try:
        return gate_findings(read, path, "common state")
    except CkptError:
        return []
