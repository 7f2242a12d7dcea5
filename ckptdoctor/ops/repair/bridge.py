"""``repair`` of Megatron-Bridge's tracker ``latest_train_state.pt`` (CKD123/124/125, :mod:`ckptdoctor.rules.bridge`).

Bridge resumes from that file's step, not from ``latest_checkpointed_iteration.txt``. So wherever repair moves the
text tracker, and wherever the Bridge tracker is torn, names a missing dir or disagrees with a text tracker whose
checkpoint passes check, the Bridge tracker is pointed at the same iteration dir the way Bridge itself writes it
after a save: a copy of that dir's ``train_state.pt``, only where it reads and its step is the dir's. The text
tracker is the one followed because it is the one users (and repair) edit to roll back; where its own checkpoint
fails check, both go to the latest good one. The old file is kept as ``latest_train_state.pt.bak-<stamp>``.
"""

from __future__ import annotations

from pathlib import Path

from ckptdoctor.atomic import fault_point, keep_previous, write_atomic
from ckptdoctor.errors import CkptError, without_path
from ckptdoctor.formats.train_state import (
    BRIDGE_TRACKER_NAME,
    TRAIN_STATE_NAME,
    bridge_tracker_bytes,
    has_bridge_tracker,
    read_train_state_step,
)
from ckptdoctor.locate import ITER_DIR_RE, TRACKER_NAME, iteration_dir_name
from ckptdoctor.ops.repair.report import Action, Refusal, RepairReport, RepairWrite
from ckptdoctor.rules import Finding, bridge


def plan_bridge(
    save_dir: Path, findings: list[Finding], text_value: str | None, moved: bool, report: RepairReport
) -> str | None:
    """The step the Bridge tracker is to name (None: leave it), with the action or refusal added to ``report``.

    ``findings``: the save dir's tracker findings; ``text_value``: where the text tracker will point (repair's new
    value when ``moved``, else its current one where its checkpoint passes check; None where there is none)."""
    if not has_bridge_tracker(save_dir):
        return None
    own = [f for f in findings if f.code in bridge.TRACKER_CODES]
    if not own and not moved:
        return None
    tracker = save_dir / BRIDGE_TRACKER_NAME
    if text_value is None:  # the text tracker had nothing to point to: neither can this one
        report.unrepairable += own
        return None
    if moved and not own and _names(tracker, text_value):
        return None  # already where the text tracker goes
    codes = sorted({f.code for f in own})
    refusal = _refusal(save_dir, text_value)
    if refusal is not None:
        report.refused.append(Refusal(codes[0] if codes else bridge.TRACKERS_DISAGREE.code, str(tracker), refusal))
        report.unrepairable += own
        return None
    name = iteration_dir_name(text_value)
    why = (
        f"{TRACKER_NAME} is pointed to {text_value} too"
        if moved
        else "; ".join(f"{f.code} {f.message}" for f in own) + f"; {TRACKER_NAME} says {text_value}"
    )
    report.actions.append(
        Action(
            "bridge-tracker",
            codes,
            str(tracker),
            f"point {BRIDGE_TRACKER_NAME} to step {text_value} (a copy of {name}/{TRAIN_STATE_NAME}, as "
            f"Megatron-Bridge writes it after a save), so that Megatron-Bridge resumes from {name}: {why}",
            text_value,
        )
    )
    return text_value


def _names(tracker: Path, value: str) -> bool:
    try:
        return iteration_dir_name(read_train_state_step(tracker)) == iteration_dir_name(value)
    except CkptError:
        return False


def _refusal(save_dir: Path, value: str) -> str | None:
    """Why the Bridge tracker cannot be made to name ``value`` (None: it can)."""
    name = iteration_dir_name(value)
    if not ITER_DIR_RE.match(name):
        return f"Megatron-Bridge's tracker holds a step and cannot name {name}"
    source = save_dir / name / TRAIN_STATE_NAME
    if not source.is_file():
        return f"{name} has no {TRAIN_STATE_NAME} to copy (not saved by Megatron-Bridge)"
    try:
        step = read_train_state_step(source)
    except CkptError as exc:
        return f"{name}/{TRAIN_STATE_NAME} is not a usable copy: {without_path(exc, source)}"
    if step != int(value):
        return f"{name}/{TRAIN_STATE_NAME} says step {step}, not {int(value)}"
    return None


def write_bridge_tracker(save_dir: Path, value: str, stamp: str, result: RepairWrite) -> None:
    """Replace ``save_dir``'s Bridge tracker with the train state of ``iter_<value>`` (under the save dir's lock);
    the old one is kept as a backup (a hard link, or the thing itself moved aside where it is not a regular file)."""
    data = bridge_tracker_bytes(save_dir / iteration_dir_name(value))
    tracker = save_dir / BRIDGE_TRACKER_NAME
    backup = keep_previous(tracker, stamp)
    if backup is not None:
        result.backups.append(str(backup))
    fault_point("repair:bridge-tracker-backup")
    write_atomic(tracker, data)
    result.written.append(str(tracker))
