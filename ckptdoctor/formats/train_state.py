"""Megatron-Bridge's train state files: ``<save>/latest_train_state.pt`` (its tracker) and ``iter_*/train_state.pt``.

Bridge (``training/checkpointing.py``, 0.3 to main as of 2026-08) writes, on rank 0 after each save,
``torch.save(TrainState.state_dict())`` into the iteration dir, copies it to ``<save>/latest_train_state.pt`` and
then writes ``latest_checkpointed_iteration.txt`` "for compatibility". At load it reads ``latest_train_state.pt``
first (``torch.load(weights_only=True)``, then ``.item()`` of each of :data:`TRAIN_STATE_KEYS`) and resumes from
``iter_<step>``; the text tracker only where that file does not exist. The iteration dir's ``train_state.pt``,
where present, then sets the resumed step and sample counters.

Read through the one safe unpickler, never torch; the file is a few KB (:data:`MAX_TRAIN_STATE_BYTES` caps it).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

from ckptdoctor.errors import CkptError, PickleLimitError
from ckptdoctor.formats.torch_zip import load_torch_zip
from ckptdoctor.pickle.limits import current_limits
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.torch_stand_ins import TensorRef
from ckptdoctor.storage.files import read_small_file

BRIDGE_TRACKER_NAME = "latest_train_state.pt"  # Megatron-Bridge's tracker in a save dir (locate follows it)

TRAIN_STATE_NAME = "train_state.pt"
# TrainState.state_dict()'s keys; load_state_dict reads every one (a KeyError fails Bridge's resume)
TRAIN_STATE_KEYS = (
    "step",
    "consumed_train_samples",
    "skipped_train_samples",
    "consumed_valid_samples",
    "floating_point_operations_so_far",
    "do_train",
    "do_valid",
    "do_test",
)
MAX_TRAIN_STATE_BYTES = 1 << 20  # Bridge's is ~3.5 KB
_INT_FORMATS = {"int64": "<q", "int32": "<i", "int16": "<h", "int8": "<b", "uint8": "<B"}


def read_train_state_step(path: Path, data: bytes | None = None, unlisted: list[UnlistedGlobal] | None = None) -> int:
    """The ``step`` of a Bridge train state file (``data``: its bytes, already read), checked as Bridge's resume
    uses it.

    Raises :class:`~ckptdoctor.errors.CkptError` naming ``path`` where Bridge's load would fail (not a
    ``torch.save`` archive of a dict holding the eight one-element tensors) or resume from nowhere (a step that is
    not a non-negative integer); refusals of the safe unpickler (:class:`UnsafePickleError`, limits, archive
    anomalies) pass through as they are; globals read as stand-ins though not on the allowlist go to ``unlisted``.
    """
    limits = current_limits()
    capped = dataclasses.replace(limits, max_bytes=min(limits.max_bytes, MAX_TRAIN_STATE_BYTES))
    try:
        state = load_torch_zip(path if data is None else data, str(path), capped, unlisted)
    except PickleLimitError as exc:
        if str(exc).startswith(f"{path}: larger than the limit"):  # the cap, not --max-pickle-bytes
            raise CkptError(f"{path}: larger than {MAX_TRAIN_STATE_BYTES} bytes: not a train state file") from None
        raise
    if not isinstance(state, dict):
        raise CkptError(f"{path}: holds a {type(state).__name__}, not the dict of TrainState.state_dict()")
    missing = [key for key in TRAIN_STATE_KEYS if key not in state]
    if missing:
        raise CkptError(f"{path}: no {', '.join(missing)} (Bridge's TrainState.load_state_dict reads all eight)")
    for key in TRAIN_STATE_KEYS:
        value = state[key]
        if not isinstance(value, TensorRef) or value.numel != 1:
            what = f"a tensor of {value.numel} elements" if isinstance(value, TensorRef) else type(value).__name__
            raise CkptError(f"{path}: {key} is {what}, not a one-element tensor (Bridge calls .item() on it)")
    return _integer_item(state["step"], path)


def _integer_item(ref: TensorRef, path: Path) -> int:
    dtype = ref.dtype.name if ref.dtype is not None else None
    fmt = _INT_FORMATS.get(dtype or "")
    if fmt is None:
        raise CkptError(f"{path}: step is a {dtype} tensor, not an integer one (the iteration dir is iter_<step>)")
    size = struct.calcsize(fmt)
    start = ref.storage_offset * size
    try:
        data = ref.storage.data()
    except (CkptError, ValueError) as exc:
        raise CkptError(f"{path}: step's storage cannot be read ({exc})") from None
    if ref.storage_offset < 0 or len(data) < start + size:
        raise CkptError(f"{path}: step's storage holds {len(data)} bytes, too few for its element")
    (step,) = struct.unpack_from(fmt, data, start)
    if step < 0:
        raise CkptError(f"{path}: step is {step}, not an iteration")
    return int(step)


def read_train_state_bytes(path: Path) -> bytes:
    """The bytes of a train state file as a regular file within the cap, for a copy (CkptError naming it)."""
    return read_small_file(path, MAX_TRAIN_STATE_BYTES)


def bridge_tracker_bytes(iteration_dir: Path) -> bytes:
    """The checked bytes of ``iteration_dir``'s train state, as Bridge copies them to ``latest_train_state.pt``
    (CkptError naming the file where it does not read or its step is not the dir's)."""
    source = iteration_dir / TRAIN_STATE_NAME
    data = read_train_state_bytes(source)
    step = read_train_state_step(source, data)
    if iteration_dir.name != f"iter_{step:07d}":
        raise CkptError(f"{source}: says step {step}, not the iteration of {iteration_dir.name}")
    return data


def has_bridge_tracker(save_dir: Path) -> bool:
    """Whether the save dir holds Bridge's tracker in any state (a file, a broken link, something else)."""
    tracker = save_dir / BRIDGE_TRACKER_NAME
    return tracker.exists() or tracker.is_symlink()


def output_bridge_tracker(source_save_dir: object, iteration_dir: Path) -> bytes | None:
    """What a save dir written from ``iteration_dir`` holds as ``latest_train_state.pt``: a copy of its train state
    where the source save dir has a Bridge tracker and that copy is usable; None otherwise (Bridge then resumes from
    the text tracker, which every written save dir has)."""
    if not isinstance(source_save_dir, Path) or not has_bridge_tracker(source_save_dir):
        return None
    try:
        return bridge_tracker_bytes(iteration_dir)
    except CkptError:
        return None
