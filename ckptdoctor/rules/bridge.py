"""Megatron-Bridge's train state (structure family): its tracker ``latest_train_state.pt``, ``iter_*/train_state.pt``.

Bridge resumes from the step in ``<save>/latest_train_state.pt`` and reads ``latest_checkpointed_iteration.txt``
only where that file does not exist (:mod:`ckptdoctor.formats.train_state`). A save dir holding both can therefore
resume from two different iteration dirs, Megatron-LM's and Bridge's, and a torn or stale Bridge tracker fails a
Bridge resume while the text tracker looks fine. Findings about the text tracker stay in :mod:`.structure`.
"""

from __future__ import annotations

from pathlib import Path

from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError, without_path
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.train_state import (
    BRIDGE_TRACKER_NAME,
    TRAIN_STATE_NAME,
    has_bridge_tracker,
    read_train_state_step,
)
from ckptdoctor.locate import ITER_DIR_RE, TRACKER_NAME, iteration_dir_name
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.rules import ERROR, WARNING, Finding, family_rule, finding
from ckptdoctor.rules.safety import gate_findings
from ckptdoctor.severity import OVERRIDDEN

_rule = family_rule("structure")


BRIDGE_TRACKER_INVALID = _rule(
    "CKD123",
    "bridge-tracker-invalid",
    ERROR,
    "latest_train_state.pt (Megatron-Bridge's tracker) is unreadable or holds no usable step",
    "Megatron-Bridge reads this file before latest_checkpointed_iteration.txt; a torn copy (Bridge writes it "
    "with a plain copy after every save) or a wrong content fails the resume even though the text tracker is fine.",
)
BRIDGE_TRACKER_TARGET_MISSING = _rule(
    "CKD124",
    "bridge-tracker-target-missing",
    ERROR,
    "latest_train_state.pt names a step whose iteration dir does not exist",
    "Megatron-Bridge resumes from iter_<step> of this file; the dir was deleted, not copied along, or never written.",
)
TRACKERS_DISAGREE = _rule(
    "CKD125",
    "trackers-disagree",
    WARNING,
    "latest_train_state.pt and latest_checkpointed_iteration.txt name different iteration dirs",
    "Megatron-Bridge resumes from the first, Megatron-LM from the second: editing or repairing only the text "
    "tracker (a usual roll-back) does not move a Bridge run.",
)
TRAIN_STATE_INVALID = _rule(
    "CKD133",
    "train-state-invalid",
    ERROR,
    "the iteration dir's train_state.pt is unreadable or its step differs from the dir name",
    "Megatron-Bridge restores its step and sample counters from this file where it exists: a corrupt one fails "
    "the resume, a mismatched one resumes the schedule at the wrong step.",
)

RULES = [BRIDGE_TRACKER_INVALID, BRIDGE_TRACKER_TARGET_MISSING, TRACKERS_DISAGREE, TRAIN_STATE_INVALID]
TRACKER_CODES = (BRIDGE_TRACKER_INVALID.code, BRIDGE_TRACKER_TARGET_MISSING.code, TRACKERS_DISAGREE.code)


def check_bridge_tracker(
    save_dir: Path, shown: Path, text_value: str | None, iterations: list[Path]
) -> tuple[Path | None, list[Finding]]:
    """(the iteration dir Bridge resumes from, if it exists; findings). ``text_value``: the text tracker's value
    where it reads and its dir exists (None otherwise: its own findings cover it)."""
    if not has_bridge_tracker(save_dir):
        return None, []
    tracker = save_dir / BRIDGE_TRACKER_NAME
    step, gate, damage = _read_step(tracker, shown / BRIDGE_TRACKER_NAME, BRIDGE_TRACKER_NAME)
    if damage is not None:
        gate.append(finding(BRIDGE_TRACKER_INVALID, shown / BRIDGE_TRACKER_NAME, without_path(damage, tracker)))
    if step is None:
        return None, gate
    target = save_dir / iteration_dir_name(step)
    if not target.is_dir():
        newest = f"newest present: {iterations[-1].name}" if iterations else "no iteration dirs present"
        message = f"says step {step} but {target.name} does not exist ({newest}): Megatron-Bridge cannot resume"
        return None, [*gate, finding(BRIDGE_TRACKER_TARGET_MISSING, shown / BRIDGE_TRACKER_NAME, message)]
    if text_value is not None and iteration_dir_name(text_value) != target.name:
        message = (
            f"says step {step} (Megatron-Bridge resumes from {target.name}) but {TRACKER_NAME} says {text_value} "
            f"(Megatron-LM resumes from {iteration_dir_name(text_value)})"
        )
        return target, [*gate, finding(TRACKERS_DISAGREE, shown / BRIDGE_TRACKER_NAME, message)]
    return target, gate


def _read_step(path: Path, shown: Path, what: str) -> tuple[int | None, list[Finding], CkptError | None]:
    """(the step, the gate's findings, damage) of a Bridge train state file, read through the one unpickler: torch
    loads it with ``weights_only=False``, so an unsafe pickle there is a safety finding (CKD4xx), not damage."""
    steps: list[int] = []
    damage: list[CkptError] = []

    def read(unlisted: list[UnlistedGlobal]) -> None:
        try:
            steps.append(read_train_state_step(path, unlisted=unlisted))
        except (UnsafePickleError, PickleLimitError, ArchiveError):
            raise
        except CkptError as exc:
            damage.append(exc)

    gate = gate_findings(read, shown, what)
    if any(f.severity != OVERRIDDEN for f in gate):
        steps.clear()  # a pickle that fails the gate is not followed
    return (steps[0] if steps else None), gate, (damage[0] if damage else None)


def check_train_state(iteration_dir: Path, shown: Path) -> list[Finding]:
    """CKD133 for an iteration dir's ``train_state.pt`` (none where it has none: Bridge then rebuilds the counters
    from the checkpoint)."""
    path = iteration_dir / TRAIN_STATE_NAME
    if not (path.exists() or path.is_symlink()):
        return []
    step, gate, damage = _read_step(path, shown / TRAIN_STATE_NAME, TRAIN_STATE_NAME)
    if damage is not None:
        message = f"unreadable: {without_path(damage, path)}"
        gate.append(finding(TRAIN_STATE_INVALID, shown / TRAIN_STATE_NAME, message))
    if step is None:
        return gate
    match = ITER_DIR_RE.match(iteration_dir.name)
    if match is not None and int(match.group(1)) != step:
        message = f"says step {step}, the dir name {int(match.group(1))}: Megatron-Bridge would resume at step {step}"
        return [*gate, finding(TRAIN_STATE_INVALID, shown / TRAIN_STATE_NAME, message)]
    return gate


def bridge_gate(iteration_dir: Path) -> list[Finding]:
    """The gate on an iteration dir's ``train_state.pt`` (what a write carries; the save dir's tracker is a copy
    of one): its safety findings only."""
    path = iteration_dir / TRAIN_STATE_NAME
    if not path.is_file():
        return []
    return _read_step(path, path, TRAIN_STATE_NAME)[1]
