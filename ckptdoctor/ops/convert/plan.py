"""``ckptdoctor convert``, planning half: every source key's place in the target format, from metadata only.

torch_dist -> fsdp_dtensor follows the conventions Megatron-FSDP loads (megatron-core's
``transformer/fsdp_dtensor_checkpoint.py`` and Megatron-LM's checkpoint inspector):

- a model tensor ``K`` becomes ``model.module.K``; an optimizer state ``optimizer.state.<stat>.K`` becomes
  ``optimizer.state.module.module.module.K.<stat>`` (the wrappers' prefixes of the FSDP model's named params);
- torch_dist stacks the layers of a transformer block on a leading axis (``decoder.layers.<name>``): each layer
  becomes its own key ``decoder.layers.<i>.<name>``;
- torch_dist stacks a MoE layer's experts on an expert axis (after the layer axis) under
  ``mlp.experts.experts.linear_fc1.weight`` (SequentialMLP and TEGroupedMLP save the same keys): each expert
  becomes the model's own parameter, ``mlp.experts.linear_fc1.weight<E>`` with grouped GEMM
  (``moe_grouped_gemm``) or ``mlp.experts.local_experts.<E>.linear_fc1.weight`` without, ``E`` the global
  expert index (``get_global_unique_param_name``: expert-parallel ranks' local experts numbered globally);
- a multi-token prediction layer keeps its index (``mtp.layers.<i>.``, never stacked) and its transformer layer is
  named as the module names it, ``mtp_model_layer`` (torch_dist keeps the older ``transformer_layer``);
- with SwiGLU, a ``linear_fc1`` weight (or bias), dense, shared expert or per expert, is the gate half over the up
  half on dim 0 (``apply_swiglu_sharded_factory``): it becomes ``<name>_w`` and ``<name>_v``
  (``handle_swiglu_in_state_dict``);
- the common state (``args`` saying ``ckpt_format='fsdp_dtensor'``, ``iteration``, the scheduler, the optimizer's
  param groups, ...) becomes top-level bytes items, nested dicts and lists flattened into dotted keys as DCP's
  default planner flattens Megatron-LM's ``generate_state_dict``; ``optimizer.optimizer.param_groups`` is
  renamed ``optimizer.param_groups``, as the FSDP optimizer's state dict names it.

A distributed optimizer saved ``fully_reshardable`` carries its per-parameter state (``exp_avg``, ``exp_avg_sq``
and the fp32 main ``param``) like a model-space optimizer's, param groups included.

Mixed precision (the saved args say ``bf16`` or ``fp16``): Megatron-FSDP's state dict holds its fp32 main params
under ``model.module.<name>`` (a state-dict pre-hook swaps the module's parameters for the optimizer's DTensors,
built on the main-weight buffer whenever ``main_params_dtype`` is set, fp32 by default), and its optimizer keeps
no separate ``param`` state. So ``model.module.<name>`` takes the optimizer's fp32 ``optimizer.state.param.<name>``
where the source has it (the bf16/fp16 model copy, which is that value rounded, is not carried), and is the model
tensor cast up to fp32 where no main params were saved (no optimizer state); with main params saved, a parameter
without one is frozen and stays in the model's dtype (Megatron-FSDP builds main weights only for parameters that
require grad), and tensors the model keeps in fp32 (the router's ``expert_bias``) stay as they are.

What the target has no place for is listed, not converted: Transformer Engine ``_extra_state`` (Megatron-FSDP
drops it), the per-rank RNG and rerun states (the inspector drops them too) and a ``dp_reshardable`` distributed
optimizer's flat buckets (no parameter-to-offset map in the checkpoint). Nothing here reads a tensor or imports torch.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.args import args_as_dict
from ckptdoctor.checkpoint import Checkpoint, Entry
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_TORCH_DIST
from ckptdoctor.optimizer_keys import chain_prefix, is_distributed_key, is_optimizer_key
from ckptdoctor.pickle.plain import OMIT_NONE

SCHEMA = "ckptdoctor.convert/1"
TARGET_FSDP_DTENSOR = "fsdp_dtensor"
TARGETS = (TARGET_FSDP_DTENSOR, "torch_dist")

# The prefixes Megatron-FSDP's state dict puts before a parameter name (the inspector's defaults)
MODEL_PREFIX = "model.module"
OPTIMIZER_STATE_PREFIX = "optimizer.state.module.module.module"

_OPTIMIZER_STATE_RE = re.compile(r"\Aoptimizer\.state\.([A-Za-z0-9_]+)\.(.+)\Z")
_LAYER_INDEX_RE = re.compile(r"layers\.[0-9]+\.")
# megatron-core's is_swiglu_key, on the torch_dist name (its experts' fc1 stacked under experts.experts.)
_SWIGLU_RE = re.compile(r"\.mlp\.(shared_experts\.|experts\.experts\.)?linear_fc1\.(weight|bias)\Z")
# the experts' stacked tensors (SequentialMLP/TEGroupedMLP sharded_state_dict)
_STACKED_EXPERTS_RE = re.compile(r"\.mlp\.experts\.experts\.(linear_fc[12])\.(weight|bias)\Z")
# a multi-token prediction layer: its own index, never stacked; Megatron-FSDP names its layer mtp_model_layer
MTP_RE = re.compile(r"(\A|\.)mtp\.layers\.[0-9]+\.")
MTP_TORCH_DIST_LAYER = ".transformer_layer."
MTP_FSDP_LAYER = ".mtp_model_layer."

# A dp_reshardable distributed optimizer saves each data-parallel group's state as flat buckets (the grad buffer's
# layout: parameters in reverse registration order, padded per bucket) plus per-bucket sizes; the checkpoint holds
# no parameter-to-offset map, which only the model that wrote it can rebuild (DistributedOptimizer's
# _build_model_gbuf_param_range_map). fully_reshardable saves per-parameter optimizer.state.<stat>.<param>, which
# maps as a model-space optimizer's state does.
DP_RESHARDABLE_WHY = (
    "dp_reshardable distributed optimizer state: flat per data-parallel bucket with no parameter-to-offset map in "
    "the checkpoint, so not converted (re-save with --dist-ckpt-optim-fully-reshardable to carry optimizer state)"
)
HOW_RENAME = "rename"
HOW_LAYERS = "per-layer split"
HOW_EXPERTS = "per-expert split"
HOW_OBJECT = "common state item"

# Mixed precision: the args' flag and the model's dtype; the main params' dtype and their optimizer stat
MIXED_PRECISION = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
MAIN_DTYPE = "torch.float32"
MAIN_PARAM_STAT = "param"


@dataclass
class TargetTensor:
    """One tensor of the output: its global shape and dtype (``torch.float32``)."""

    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class KeyMapping:
    """A source key and the output keys its values go to."""

    source: str
    targets: list[str]
    how: str
    cast: str | None = field(default=None, metadata=OMIT_NONE)  # the dtype its values are cast to (None: as saved)


@dataclass
class NotCarried:
    key: str
    why: str


@dataclass
class ConvertPlan:
    schema: str = field(init=False, default=SCHEMA)
    source: str
    source_format: str
    target_format: str
    swiglu: bool
    mappings: list[KeyMapping]
    not_carried: list[NotCarried]
    arg_changes: dict[str, str]  # arg -> new value, set in the output's saved args
    target_tensors: list[TargetTensor] = field(default_factory=list, repr=False)
    grouped_experts: bool = field(default=False, repr=False)  # experts named weight<E> (moe_grouped_gemm)
    # mixed precision: the model's dtype (bf16/fp16 in the saved args), None otherwise
    model_dtype: str | None = None

    def tensor_bytes(self, checkpoint: Checkpoint) -> int:
        sources = {m.source for m in self.mappings if m.how != HOW_OBJECT}
        return sum(checkpoint.entries[k].nbytes for k in sources if k in checkpoint.entries)


@dataclass(frozen=True)
class ChunkRule:
    """How one source tensor's chunks are placed: ``base`` is the output key (``{layer}`` and ``{expert}`` stand
    for the indices of a stacked key's leading axes), ``axes`` the leading axes that are consumed (``layer``,
    ``expert``, in that order), ``swiglu`` the half size of dim 0 (after those axes) where the key is cut into
    ``_w``/``_v``, else 0."""

    base: str
    axes: tuple[str, ...]
    swiglu: int
    cast: str | None = None  # the output dtype where the values are cast (None: the source's)

    @property
    def layered(self) -> bool:
        return "layer" in self.axes


def _is_mtp(name: str) -> bool:
    return MTP_RE.search(name) is not None


def _layered_name(name: str) -> str | None:
    """``decoder.layers.<name>`` -> ``decoder.layers.{layer}.<name>``; None when the key is not stacked."""
    if ".layers." not in name or _LAYER_INDEX_RE.search(name) or _is_mtp(name):
        return None
    return name.replace(".layers.", ".layers.{layer}.", 1)


def expert_name(name: str, grouped: bool) -> str | None:
    """``...mlp.experts.experts.linear_fc1.weight`` -> the per-expert parameter name with ``{expert}`` for its
    global index (``weight{expert}`` with grouped GEMM, ``local_experts.{expert}.`` without); None otherwise."""
    match = _STACKED_EXPERTS_RE.search(name)
    if match is None:
        return None
    fc, kind = match.group(1), match.group(2)
    tail = f".mlp.experts.{fc}.{kind}{{expert}}" if grouped else f".mlp.experts.local_experts.{{expert}}.{fc}.{kind}"
    return name[: match.start()] + tail


def mtp_name(name: str) -> str:
    """A multi-token prediction layer's transformer layer under the module's name (``mtp_model_layer``)."""
    if _is_mtp(name) and MTP_TORCH_DIST_LAYER in name:
        return name.replace(MTP_TORCH_DIST_LAYER, MTP_FSDP_LAYER, 1)
    return name


def split_name(key: str, half: str) -> str:
    """Megatron-FSDP's name of a SwiGLU half: ``<param>_w``/``<param>_v`` (before an optimizer stat's suffix)."""
    if key.startswith(OPTIMIZER_STATE_PREFIX + "."):
        param, _, stat = key.rpartition(".")
        return f"{param}_{half}.{stat}"
    return f"{key}_{half}"


def target_param(key: str) -> tuple[str, str | None] | None:
    """A tensor key's parameter name and optimizer stat (None for a model tensor); None outside both sections."""
    match = _OPTIMIZER_STATE_RE.match(key)
    if match:
        return match.group(2), match.group(1)
    if is_optimizer_key(key) or key.startswith("rng_state") or key.startswith("rerun_state"):
        return None  # (a chained optimizer's chained_<i>.optimizer.* too)
    return key, None


def mixed_precision_dtype(args: dict) -> str | None:
    """The model's dtype when the args say mixed precision (``bf16``/``fp16``), else None."""
    for flag, dtype in MIXED_PRECISION.items():
        if args.get(flag):
            return dtype
    return None


def main_params(checkpoint: Checkpoint) -> set[str]:
    """The parameters whose fp32 main params the optimizer saved per parameter (``optimizer.state.param.<name>``,
    the shape of the model tensor ``<name>``)."""
    found = set()
    for key, entry in checkpoint.entries.items():
        named = target_param(key)
        if named is None or named[1] != MAIN_PARAM_STAT or entry.kind != "tensor":
            continue
        model = checkpoint.entries.get(named[0])
        if model is not None and model.kind == "tensor" and model.shape == entry.shape:
            found.add(named[0])
    return found


def chunk_rule(
    entry: Entry, swiglu: bool, grouped: bool = False, as_model: bool = False, cast: str | None = None
) -> ChunkRule:
    """The :class:`ChunkRule` of a convertible tensor (see :func:`plan_convert` for which are); ``grouped``: the
    model's experts are one grouped GEMM (``moe_grouped_gemm``), named ``weight<E>``; ``as_model``: an fp32 main
    param that becomes the model tensor (mixed precision); ``cast``: the dtype the values are cast to."""
    named = target_param(entry.key)
    assert named is not None and entry.shape is not None
    param, stat = named
    if as_model:
        stat = None
    name = param
    axes: tuple[str, ...] = ()
    layered = _layered_name(name)
    if layered is not None:
        name, axes = layered, ("layer",)
    per_expert = expert_name(name, grouped)
    if per_expert is not None:
        name, axes = per_expert, (*axes, "expert")
    name = mtp_name(name)
    shape = entry.shape[len(axes) :]
    base = f"{MODEL_PREFIX}.{name}" if stat is None else f"{OPTIMIZER_STATE_PREFIX}.{name}.{stat}"
    half = 0
    if swiglu and _SWIGLU_RE.search(param) and shape and shape[0] % 2 == 0:
        half = shape[0] // 2
    return ChunkRule(base, axes, half, cast)


def precision_rule(
    checkpoint: Checkpoint, key: str, model_dtype: str | None, mains: set[str]
) -> tuple[bool, str | None]:
    """(``as_model``, ``cast``) of a convertible tensor under mixed precision: an fp32 main param becomes its model
    tensor; a model tensor in the model's dtype with no main param saved is cast up to fp32."""
    if model_dtype is None:
        return False, None
    named = target_param(key)
    assert named is not None
    param, stat = named
    if stat == MAIN_PARAM_STAT and param in mains:
        return True, None
    # no main params saved (no optimizer state): every parameter in the model's dtype is cast up, as Megatron-FSDP's
    # main-weight buffer holds it; with main params saved, one without is frozen and Megatron-FSDP keeps it as is
    if stat is None and not mains and checkpoint.entries[key].dtype == model_dtype:
        return False, MAIN_DTYPE
    return False, None


def forward_rules(checkpoint: Checkpoint, plan: ConvertPlan) -> dict[str, ChunkRule]:
    """The :class:`ChunkRule` of every tensor ``plan`` converts (as :func:`plan_convert` placed it)."""
    mains = main_params(checkpoint) if plan.model_dtype else set()
    rules = {}
    for mapping in plan.mappings:
        if mapping.how == HOW_OBJECT:
            continue
        as_model, cast = precision_rule(checkpoint, mapping.source, plan.model_dtype, mains)
        entry = checkpoint.entries[mapping.source]
        rules[mapping.source] = chunk_rule(entry, plan.swiglu, plan.grouped_experts, as_model, cast)
    return rules


def rule_key(rule: ChunkRule, indices: tuple[int, ...]) -> str:
    """The output key for the stacked axes' ``indices`` (as many as ``rule.axes``)."""
    return rule.base.format(**dict(zip(rule.axes, indices)))


def rule_targets(rule: ChunkRule, entry: Entry) -> list[TargetTensor]:
    """Every output tensor one source tensor fills."""
    assert entry.shape is not None and entry.dtype is not None
    lead = len(rule.axes)
    shape = entry.shape[lead:]
    out = []
    for indices in itertools.product(*(range(n) for n in entry.shape[:lead])):
        key = rule_key(rule, indices)
        if rule.swiglu:
            half_shape = (rule.swiglu, *shape[1:])
            out += [TargetTensor(split_name(key, h), half_shape, rule.cast or entry.dtype) for h in ("w", "v")]
        else:
            out.append(TargetTensor(key, tuple(shape), rule.cast or entry.dtype))
    return out


def _why_not(entry: Entry, checkpoint: Checkpoint) -> str | None:
    """Why a source item has no place in fsdp_dtensor (None: it is converted)."""
    key = entry.key
    if "_extra_state" in key:
        return "Transformer Engine extra state: Megatron-FSDP drops it (handle_fp8_extra_state_case)"
    if key.startswith("rng_state"):
        return "per-rank RNG state: not converted (Megatron-LM's reference converter drops it too)"
    if key.startswith("rerun_state"):
        return "rerun state machine: not converted"
    if key.startswith("common_state"):
        return None  # its items are planned one by one
    if is_distributed_key(key):  # an MoE model's chained_<i>.optimizer.distributed.* buckets too
        return DP_RESHARDABLE_WHY
    if chain_prefix(key):
        return "a chained optimizer's item (chained_<i>.optimizer.*): no place in fsdp_dtensor's one optimizer"
    if entry.kind != "tensor" or entry.shape is None:
        return "a bytes item with no place in fsdp_dtensor"
    named = target_param(key)
    if named is None:
        return "an optimizer item outside optimizer.state.<stat>.<param>: no place in fsdp_dtensor"
    param, stat = named
    if stat is not None:
        model = checkpoint.entries.get(param)
        if model is None or model.shape != entry.shape:
            return "optimizer state in a layout other than its parameter's (distributed optimizer): not converted"
    if ".experts.experts." in param and _STACKED_EXPERTS_RE.search(param) is None:
        return "an expert tensor other than linear_fc1/linear_fc2 weight or bias: no known per-expert name"
    lead = (_layered_name(param) is not None) + (_STACKED_EXPERTS_RE.search(param) is not None)
    if any(size != 1 for c in entry.chunks for size in c.sizes[:lead]):
        return "stacked layers or experts whose chunks span several of them: not converted"
    # one output key per layer (and expert): each needs its chunk, and a .metadata's shape of 2^40 layers held
    # by two chunks is never expanded into 2^40 keys
    slots = math.prod(entry.shape[:lead])
    covered = len({tuple(c.offsets[:lead]) for c in entry.chunks})
    if covered < slots:
        return f"stacked layers or experts of which the chunks hold {covered:,} of {slots:,}: not converted"
    return None


def flattened(obj: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    """(output path, value) of a common state item: DCP's default planner flattening (non-empty dicts and lists
    become dotted keys), with the optimizer's param groups where the FSDP optimizer's state dict has them."""
    if isinstance(obj, dict) and obj:
        for name, value in obj.items():
            yield from flattened(value, (*path, str(name)))
    elif isinstance(obj, list) and obj:
        for index, value in enumerate(obj):
            yield from flattened(value, (*path, index))
    elif path[:3] == ("optimizer", "optimizer", "param_groups"):
        yield ("optimizer", *path[2:]), obj
    else:
        yield path, obj


def dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _how(rule: ChunkRule) -> str:
    steps = []
    if "layer" in rule.axes:
        steps.append(HOW_LAYERS)
    if "expert" in rule.axes:
        steps.append(HOW_EXPERTS)
    if rule.swiglu:
        steps.append("SwiGLU split")
    return ", ".join(steps) or HOW_RENAME


def plan_convert(checkpoint: Checkpoint, target: str) -> ConvertPlan:
    """Every source key's output keys, or why it has none; refuses what this converter cannot do."""
    if target not in TARGETS:
        raise CkptError(f"--to {target}: not supported (choose from {', '.join(TARGETS)})")
    where = checkpoint.iteration_dir
    if checkpoint.location.backend != BACKEND_TORCH_DIST:
        raise CkptError(f"{where}: convert --to {target} reads a torch_dist checkpoint (metadata.json, DCP files)")
    common = checkpoint.common_state()
    args = args_as_dict(common.get("args"))
    if not args:
        raise CkptError(f"{where}: no saved args in the common state; convert needs them (swiglu, layers)")
    swiglu = bool(args.get("swiglu"))
    grouped = bool(args.get("moe_grouped_gemm"))
    model_dtype = mixed_precision_dtype(args)
    mains = main_params(checkpoint) if model_dtype else set()
    mappings: list[KeyMapping] = []
    not_carried: list[NotCarried] = []
    tensors: list[TargetTensor] = []
    for key in sorted(checkpoint.entries):
        entry = checkpoint.entries[key]
        why = _why_not(entry, checkpoint)
        if why is not None:
            not_carried.append(NotCarried(key, why))
            continue
        if key.startswith("common_state"):
            continue
        if key in mains:
            not_carried.append(NotCarried(key, _main_copy_why(key, model_dtype)))
            continue
        as_model, cast = precision_rule(checkpoint, key, model_dtype, mains)
        rule = chunk_rule(entry, swiglu, grouped, as_model, cast)
        targets = rule_targets(rule, entry)
        how = _how(rule)
        mappings.append(KeyMapping(key, [t.key for t in targets], how, cast))
        tensors += targets
    for name in sorted(common):
        keys = [dotted(path) for path, _value in flattened(common[name], (name,))]
        mappings.append(KeyMapping(f"common state: {name}", keys, HOW_OBJECT))
    seen: dict[str, str] = {}
    for mapping in mappings:
        for out in mapping.targets:
            if out in seen:
                raise CkptError(f"{where}: {mapping.source} and {seen[out]} would both become {out}")
            seen[out] = mapping.source
    return ConvertPlan(
        source=str(where),
        source_format="torch_dist",
        target_format=target,
        swiglu=swiglu,
        mappings=mappings,
        not_carried=not_carried,
        arg_changes={"ckpt_format": target},
        grouped_experts=grouped,
        target_tensors=tensors,
        model_dtype=model_dtype,
    )


def _main_copy_why(key: str, model_dtype: str | None) -> str:
    return (
        f"the {model_dtype} model copy of the fp32 main params: Megatron-FSDP's {MODEL_PREFIX}.<name> holds the "
        f"main params, taken from optimizer.state.{MAIN_PARAM_STAT}.{key} (the model copy is rounded from them "
        "after every optimizer step)"
    )
