"""``ckptdoctor strip-frozen``, planning half: which keys a trainable-params-only checkpoint keeps, and why.

What Megatron-LM's ``--save-trainable-params-only`` writes (PR 7280) is the target: the model section
filtered to trainable parameters, every model ``_extra_state`` dropped (a ShardedObject has no requires_grad
and keeping it beside a dropped weight breaks loading), everything else (optimizer, rng, rerun, common state)
untouched. The trainable set comes from one source, reported to the user:

1. ``--trainable REGEX`` / ``--preset``: key names (Megatron-Bridge adapter naming for the presets);
2. default: the optimizer section, which holds state only for trainable params
   (``optimizer.state.<name>.<model key>``);
3. ``--base``: model tensors bitwise equal to a base checkpoint's are frozen (streamed compare).

Planning reads metadata only (and, with ``--base``, tensor bytes one chunk at a time); it never writes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptdoctor.checkpoint import Checkpoint, Entry
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.rewrite.request import dir_bytes
from ckptdoctor.optimizer_keys import is_distributed_key, unchained
from ckptdoctor.values.tensor import tensors_bitwise_equal

SCHEMA = "ckptdoctor.strip-frozen/1"

# Megatron-Bridge's apply_peft_adapter_filter_to_state_dict keeps ".adapter." keys and "*.adapters";
# DoRA adds a per-output-channel "weight_magnitude" (under the adapter, but matched on its own too).
_BRIDGE = [r"\.adapter\.", r"\.adapters$"]
PRESETS: dict[str, list[str]] = {
    "lora": _BRIDGE,
    "canonical-lora": _BRIDGE,  # adapter.adapter_q|k|v|up|gate.linear_in/out: still under ".adapter."
    "dora": _BRIDGE + [r"(^|\.)weight_magnitude$"],
}
# Model-space optimizer keys, possibly with a chained-optimizer index: optimizer[.N].state.<name>.<model key>
# (matched without a ChainedOptimizer's chained_<i>. prefix: optimizer_keys.unchained)
_OPTIMIZER_STATE_RE = re.compile(r"^optimizer\.(?:\d+\.)?state\.([A-Za-z0-9_]+)\.(.+)$")
_NEEDS_SELECTION = "pass --trainable REGEX, --preset lora|canonical-lora|dora or --base BASE_CKPT"


@dataclass(slots=True)  # one per key (hundreds of thousands), reasons shared
class KeyDecision:
    key: str
    section: str
    kind: str
    bytes: int
    reason: str


@dataclass
class TrainableSelection:
    """The trainable model keys and where that judgement came from."""

    source: str  # "optimizer" | "regex" | "preset:<name>" | "base"
    detail: str  # human-readable: the patterns, the optimizer state names, the base path
    keys: set[str]
    compared: dict[str, str] = field(default_factory=dict)  # with --base: key -> "equal"/"differs"/"absent in base"


@dataclass
class StripPlan:
    schema: str
    source: str
    iteration_dir: str
    trainable_source: str
    trainable_detail: str
    kept: list[KeyDecision]
    dropped: list[KeyDecision]
    # One definition of size everywhere (dry run and write): every plain file of the iteration dir, as
    # StripResult.source_bytes/output_bytes count them. bytes_after is the estimate before writing: the kept
    # items' data bytes plus the source's other (non-data) files.
    bytes_before: int
    bytes_after: int
    kept_model_params: int
    dropped_model_params: int

    @property
    def keep_keys(self) -> set[str]:
        return {d.key for d in self.kept}


# --- trainable selection ---------------------------------------------------------------------------


def model_parameters(checkpoint: Checkpoint) -> dict[str, Entry]:
    """Model-section tensors: the candidates for 'trainable' (objects and _extra_state never are)."""
    return {
        k: e
        for k, e in checkpoint.entries.items()
        if e.section == "model" and e.kind == "tensor" and not e.is_extra_state
    }


def trainable_from_patterns(checkpoint: Checkpoint, patterns: list[str], preset: str | None) -> TrainableSelection:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise CkptError(f"--trainable: invalid regex {pattern!r}: {exc}") from None
    preset_patterns = PRESETS[preset] if preset else []
    compiled += [re.compile(p) for p in preset_patterns]
    keys = {k for k in model_parameters(checkpoint) if any(p.search(k) for p in compiled)}
    source = "+".join(s for s in (f"preset:{preset}" if preset else "", "regex" if patterns else "") if s)
    return TrainableSelection(source, " | ".join(patterns + preset_patterns), keys)


def trainable_from_optimizer(checkpoint: Checkpoint) -> TrainableSelection:
    """Model keys with model-space optimizer state; the optimizer holds state only for trainable params."""
    optimizer_keys = [k for k, e in checkpoint.entries.items() if e.section == "optimizer"]
    where = str(checkpoint.iteration_dir)
    if not optimizer_keys:
        raise CkptError(f"{where}: no optimizer state to infer trainable params from; {_NEEDS_SELECTION}")
    params = model_parameters(checkpoint)
    keys: set[str] = set()
    names: set[str] = set()
    for key in optimizer_keys:
        match = _OPTIMIZER_STATE_RE.match(unchained(key))
        if match and match.group(2) in params:
            keys.add(match.group(2))
            names.add(match.group(1))
    if not keys:
        if any(is_distributed_key(k) for k in optimizer_keys):
            raise CkptError(
                f"{where}: the optimizer state is the distributed optimizer's dp_reshardable buckets "
                f"([chained_<i>.]optimizer.distributed.*), which do not name model keys; {_NEEDS_SELECTION}"
            )
        raise CkptError(
            f"{where}: no optimizer.state.<name>.<model key> item names a model parameter "
            f"({len(optimizer_keys)} optimizer keys); {_NEEDS_SELECTION}"
        )
    return TrainableSelection("optimizer", "state " + ", ".join(sorted(names)), keys)


def trainable_from_base(
    checkpoint: Checkpoint, base: Checkpoint, progress: Callable[[int], None] | None = None
) -> TrainableSelection:
    """Model tensors that differ from (or are absent in) ``base``; bitwise, streamed one chunk at a time."""
    keys: set[str] = set()
    compared: dict[str, str] = {}
    for key, entry in model_parameters(checkpoint).items():
        other = base.entries.get(key)
        if other is None or other.kind != "tensor":
            verdict = "absent in base"
        elif other.shape != entry.shape or other.dtype != entry.dtype:
            verdict = "differs (shape or dtype)"
        else:
            verdict = "equal" if tensors_bitwise_equal(checkpoint, entry, base, other) else "differs"
        if progress is not None:
            progress(entry.nbytes)
        compared[key] = verdict
        if verdict != "equal":
            keys.add(key)
    return TrainableSelection("base", str(base.iteration_dir), keys, compared)


# --- the plan ---------------------------------------------------------------------------------------


def plan_strip(checkpoint: Checkpoint, selection: TrainableSelection) -> StripPlan:
    """Kept and dropped items; refuses (CkptError) a selection that keeps no model parameter."""
    kept: list[KeyDecision] = []
    dropped: list[KeyDecision] = []
    kept_params = dropped_params = 0
    # one string per reason, shared by the decisions that give it
    untouched: dict[str, str] = {}
    trainable, frozen = f"trainable ({selection.source})", f"frozen ({selection.source})"
    for key in sorted(checkpoint.entries):
        entry = checkpoint.entries[key]
        decision = KeyDecision(key, entry.section, entry.kind, entry.nbytes, "")
        if entry.section != "model":
            reason = untouched.get(entry.section)
            if reason is None:
                reason = untouched[entry.section] = f"{entry.section} section: kept untouched"
            decision.reason = reason
            kept.append(decision)
        elif entry.is_extra_state:
            decision.reason = "model _extra_state: dropped"
            dropped.append(decision)
        elif entry.kind != "tensor":
            decision.reason = "model object (not a parameter): dropped"
            dropped.append(decision)
        elif key in selection.keys:
            decision.reason = trainable
            kept.append(decision)
            kept_params += entry.numel
        else:
            decision.reason = frozen
            dropped.append(decision)
            dropped_params += entry.numel
    if not any(d.section == "model" for d in kept):
        raise CkptError(
            f"{checkpoint.iteration_dir}: the trainable selection ({selection.source}: "
            f"{selection.detail}) keeps no model parameter; nothing written"
        )
    return StripPlan(
        schema=SCHEMA,
        source=str(checkpoint.location.input_path),
        iteration_dir=str(checkpoint.iteration_dir),
        trainable_source=selection.source,
        trainable_detail=selection.detail,
        kept=kept,
        dropped=dropped,
        bytes_before=dir_bytes(checkpoint.iteration_dir),
        bytes_after=sum(d.bytes for d in kept) + dir_bytes(checkpoint.iteration_dir, data=False),
        kept_model_params=kept_params,
        dropped_model_params=dropped_params,
    )


def select_trainable(
    checkpoint: Checkpoint,
    patterns: list[str],
    preset: str | None,
    base: Checkpoint | None,
    progress: Callable[[int], None] | None = None,
) -> TrainableSelection:
    """The one selection source the options ask for: names, else base compare, else the optimizer."""
    if (patterns or preset) and base is not None:
        raise CkptError("--base cannot be combined with --trainable/--preset: choose one source")
    if patterns or preset:
        return trainable_from_patterns(checkpoint, patterns, preset)
    if base is not None:
        return trainable_from_base(checkpoint, base, progress)
    return trainable_from_optimizer(checkpoint)
