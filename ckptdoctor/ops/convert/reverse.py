"""``ckptdoctor convert --to torch_dist``, planning half: a Megatron-FSDP fsdp_dtensor save back to torch_dist keys.

The inverse of :mod:`ckptdoctor.ops.convert.plan`: ``model.module.<name>`` loses its prefix, optimizer states go
back to ``optimizer.state.<stat>.<name>``, per-layer keys ``decoder.layers.<i>.<name>`` are stacked again on a
leading layer axis (megatron-core's ``prepend_axis_num=1``) where the block's layers hold the same parameters (a
block of dense and MoE layers keeps per-layer keys, as ``TransformerBlock.sharded_state_dict`` saves it),
per-expert parameters (``weight<E>`` or ``local_experts.<E>.``) are stacked on the expert axis under
``mlp.experts.experts.``, multi-token prediction layers keep their index and get their ``transformer_layer`` name
back, and SwiGLU ``<name>_w``/``<name>_v`` halves are joined on dim 0 (gate half first, as
``apply_swiglu_sharded_factory`` lays ``linear_fc1`` out). The top-level bytes items are gathered back into the
common state (dotted keys unflattened along the paths DCP's planner recorded), written as ``common.pt`` with the
args saying ``ckpt_format='torch_dist'``.

Mixed precision (the saved args say ``bf16`` or ``fp16``): Megatron-FSDP's ``model.module.<name>`` holds the fp32
main params (see :mod:`ckptdoctor.ops.convert.plan`), while torch_dist holds the model in its own dtype and a
``fully_reshardable`` distributed optimizer its fp32 main params as ``optimizer.state.param.<name>``. So an fp32
model tensor is cast to the model's dtype (as Megatron's optimizer copies main params to model params: round to
nearest), except the router's ``expert_bias``, which megatron-core keeps in fp32; and where the parameter has
optimizer state but the save carries no ``param`` state for it, its fp32 values are also written as
``optimizer.state.param.<name>`` (so too for an fp32 model whose args say the distributed optimizer: its
``fully_reshardable`` state has the main params as ``param``, which Megatron-FSDP keeps as the model).
Metadata only: nothing here reads a tensor or imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckptdoctor.args import args_as_dict
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_DCP, torch_dist
from ckptdoctor.formats.plain_dcp import FLAVOUR_FSDP_DTENSOR, is_megatron
from ckptdoctor.ops.convert.plan import (
    HOW_OBJECT,
    MAIN_DTYPE,
    MAIN_PARAM_STAT,
    MODEL_PREFIX,
    MTP_FSDP_LAYER,
    MTP_RE,
    MTP_TORCH_DIST_LAYER,
    OPTIMIZER_STATE_PREFIX,
    ConvertPlan,
    KeyMapping,
    NotCarried,
    TargetTensor,
    mixed_precision_dtype,
)

TARGET_TORCH_DIST = "torch_dist"
HOW_MERGE = "layers stacked"
HOW_MERGE_EXPERTS = "experts stacked"
HOW_JOIN = "SwiGLU halves joined"

_LAYER_RE = re.compile(r"\.layers\.([0-9]+)\.")
_HALF_RE = re.compile(r"\.linear_fc1\.((?:weight|bias)[0-9]*)_([wv])\Z")
_GROUPED_EXPERT_RE = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)([0-9]+)\Z")
_LOCAL_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.([0-9]+)\.(linear_fc[12])\.(weight|bias)\Z")
# what megatron-core keeps in fp32 in a bf16/fp16 model (TopKRouter's _maintain_float32_expert_bias)
_KEEP_FP32_RE = re.compile(r"(\A|\.)expert_bias\Z")


@dataclass(frozen=True)
class ReverseRule:
    """Where one fsdp_dtensor tensor goes: ``target`` key, ``lead`` its indices on the target's stacked leading
    axes (layer, then expert; empty: not stacked), ``half`` offset on dim 0 where a SwiGLU ``_v`` half starts
    (0 for ``_w`` and unsplit keys)."""

    target: str
    lead: tuple[int, ...]
    half: int
    main: str | None = None  # mixed precision: the fp32 main param key its values are also written to


@dataclass(frozen=True)
class _Parsed:
    stacked: str  # the torch_dist parameter name (layer and expert indices removed)
    layer: int | None
    expert: int | None
    half: str | None


def _source_param(key: str) -> tuple[str, str | None] | None:
    if key.startswith(MODEL_PREFIX + "."):
        return key[len(MODEL_PREFIX) + 1 :], None
    if key.startswith(OPTIMIZER_STATE_PREFIX + "."):
        param, _, stat = key[len(OPTIMIZER_STATE_PREFIX) + 1 :].rpartition(".")
        return (param, stat) if param else None
    return None


def _block_layer(param: str) -> re.Match[str] | None:
    """The ``.layers.<i>.`` of a transformer block's layer (a multi-token prediction layer is not one)."""
    match = _LAYER_RE.search(param)
    if match is None or MTP_RE.search(param[: match.end()]):
        return None
    return match


def _homogeneous_blocks(checkpoint: Checkpoint) -> set[str]:
    """The blocks (the name before ``.layers.<i>.``) whose layers hold the same parameters: torch_dist stacks those
    (``TransformerBlock.sharded_state_dict``), and keeps per-layer keys where layers differ (e.g. dense and MoE)."""
    per_block: dict[str, dict[str, set[str]]] = {}
    for key in checkpoint.entries:
        if not key.startswith(MODEL_PREFIX + "."):
            continue
        param = key[len(MODEL_PREFIX) + 1 :]
        match = _block_layer(param)
        if match is not None:
            layers = per_block.setdefault(param[: match.start()], {})
            layers.setdefault(match.group(1), set()).add(param[match.end() :])
    return {
        block for block, layers in per_block.items() if all(s == next(iter(layers.values())) for s in layers.values())
    }


def _parse(param: str, stacked_blocks: set[str]) -> _Parsed:
    """An fsdp_dtensor parameter name back to its torch_dist name and the indices it had there."""
    if MTP_RE.search(param) and MTP_FSDP_LAYER in param:
        param = param.replace(MTP_FSDP_LAYER, MTP_TORCH_DIST_LAYER, 1)
    half = None
    match = _HALF_RE.search(param)
    if match is not None:
        half = match.group(2)
        param = param[: match.start()] + f".linear_fc1.{match.group(1)}"
    expert = None
    grouped = _GROUPED_EXPERT_RE.search(param)
    local = _LOCAL_EXPERT_RE.search(param)
    if grouped is not None:
        expert = int(grouped.group(3))
        param = param[: grouped.start()] + f".mlp.experts.experts.{grouped.group(1)}.{grouped.group(2)}"
    elif local is not None:
        expert = int(local.group(1))
        param = param[: local.start()] + f".mlp.experts.experts.{local.group(2)}.{local.group(3)}"
    layer = None
    block = _block_layer(param)
    if block is not None and param[: block.start()] in stacked_blocks:
        layer = int(block.group(1))
        param = param[: block.start()] + ".layers." + param[block.end() :]
    return _Parsed(param, layer, expert, half)


def _indices(checkpoint: Checkpoint, target: str, found: set[int | None], what: str) -> list[int]:
    indices = sorted(i for i in found if i is not None)
    if indices and (None in found or indices != list(range(len(indices)))):
        raise CkptError(f"{checkpoint.iteration_dir}: {target}: {what} {indices} are not 0..{len(indices) - 1}")
    return indices


def saved_args(checkpoint: Checkpoint) -> dict[str, Any]:
    """The save's ``args`` item as a dict (empty without one)."""
    entry = checkpoint.entries.get("args")
    if entry is None or entry.kind != "bytes":
        return {}
    return args_as_dict(checkpoint.read_bytes_item("args"))


def _model_target_dtype(target: str, dtype: str, model_dtype: str | None) -> str:
    """The dtype torch_dist holds a model tensor in: an fp32 main param goes back to the model's dtype."""
    if model_dtype is None or dtype != MAIN_DTYPE or _KEEP_FP32_RE.search(target):
        return dtype
    return model_dtype


def reverse_rules(
    checkpoint: Checkpoint, model_dtype: str | None = None, distributed: bool = False
) -> tuple[dict[str, ReverseRule], list[TargetTensor], list[KeyMapping]]:
    """Every convertible tensor's :class:`ReverseRule`, the output tensors and the key mappings; ``model_dtype``:
    the model's dtype under mixed precision (fp32 model tensors are cast to it, their main params kept);
    ``distributed``: the args say the distributed optimizer, whose torch_dist state has the main params as
    ``param`` (written from the model tensor where the save has no ``param`` state)."""
    stacked_blocks = _homogeneous_blocks(checkpoint)
    groups: dict[str, dict[tuple[int | None, int | None, str | None], str]] = {}
    dtypes: dict[str, str] = {}
    for key, entry in sorted(checkpoint.entries.items()):
        named = _source_param(key) if entry.kind == "tensor" and entry.shape is not None else None
        if named is None or named[1] == _STEP_STAT:
            continue
        param, stat = named
        parsed = _parse(param, stacked_blocks)
        target = parsed.stacked if stat is None else f"optimizer.state.{stat}.{parsed.stacked}"
        groups.setdefault(target, {})[(parsed.layer, parsed.expert, parsed.half)] = key
        dtypes[target] = str(entry.dtype)
    rules: dict[str, ReverseRule] = {}
    tensors: list[TargetTensor] = []
    mappings: list[KeyMapping] = []
    with_state = {t.split(".", 3)[3] for t in groups if t.startswith("optimizer.state.") and t.count(".") >= 3}
    for target, parts in sorted(groups.items()):
        cast = None
        main = None
        if not target.startswith("optimizer.state."):
            dtype = _model_target_dtype(target, dtypes[target], model_dtype)
            if dtype != dtypes[target]:
                cast, dtypes[target] = dtype, dtype
            main_key = f"optimizer.state.{MAIN_PARAM_STAT}.{target}"
            if (cast or distributed) and target in with_state and main_key not in groups:
                main = main_key
        layers = _indices(checkpoint, target, {layer for layer, _e, _h in parts}, "layers")
        experts = _indices(checkpoint, target, {expert for _l, expert, _h in parts}, "experts")
        halves = {half for _l, _e, half in parts}
        if halves not in ({None}, {"w", "v"}):
            raise CkptError(f"{checkpoint.iteration_dir}: {target}: SwiGLU halves {sorted(map(str, halves))} unpaired")
        if len(parts) != max(len(layers), 1) * max(len(experts), 1) * len(halves):
            raise CkptError(f"{checkpoint.iteration_dir}: {target}: some layers or experts lack a piece")
        first = checkpoint.entries[next(iter(parts.values()))]
        assert first.shape is not None
        inner = tuple(first.shape)
        half_size = inner[0] if halves == {"w", "v"} else 0
        if half_size:
            inner = (2 * half_size, *inner[1:])
        for (layer, expert, half), key in parts.items():
            shape = checkpoint.entries[key].shape
            if shape is None or tuple(shape[1:]) != inner[1:] or shape[0] != (half_size or inner[0]):
                raise CkptError(f"{checkpoint.iteration_dir}: {key}: shape {shape} differs from its siblings'")
            lead = tuple(i for i in (layer, expert) if i is not None)
            rules[key] = ReverseRule(target, lead, half_size if half == "v" else 0, main)
        lead_shape = tuple(len(axis) for axis in (layers, experts) if axis)
        tensors.append(TargetTensor(target, (*lead_shape, *inner), dtypes[target]))
        if main is not None:
            tensors.append(TargetTensor(main, (*lead_shape, *inner), MAIN_DTYPE))
        steps = [HOW_MERGE] if layers else []
        steps += [HOW_MERGE_EXPERTS] if experts else []
        steps += [HOW_JOIN] if half_size else []
        how = ", ".join(steps) or "rename"
        for key in sorted(parts.values()):
            mappings.append(KeyMapping(key, [target] if main is None else [target, main], how, cast))
    return rules, tensors, mappings


def planner_paths(checkpoint: Checkpoint) -> dict[str, tuple]:
    """Each item's nested path as DCP's default planner recorded it in ``.metadata`` (``planner_data``): dict keys
    as strings, list indices as ints; empty where the save recorded none."""
    metadata = torch_dist.load_metadata_object(checkpoint.iteration_dir / ".metadata")
    recorded = torch_dist.record_attr(metadata, "planner_data")
    if not isinstance(recorded, dict):
        return {}
    return {key: tuple(path) for key, path in recorded.items() if isinstance(key, str) and isinstance(path, tuple)}


def unflatten(items: dict[str, Any], paths: dict[str, tuple] | None = None) -> dict:
    """The common state from its dotted keys. Where the planner's ``paths`` say, an int step is a list index and a
    string step a dict key (digit keys back to ints: DCP writes a ChainedOptimizer's ``{0: ..., 1: ...}`` keys as
    strings); without them a dict whose keys are exactly ``0..n-1`` becomes a list."""
    root: dict = {}
    kinds: dict[tuple[str, ...], str] = {}  # dotted prefix -> "list" or "dict", from the recorded paths
    for key, value in items.items():
        parts = key.split(".")
        path = (paths or {}).get(key)
        if path is not None and len(path) == len(parts):
            for depth in range(1, len(parts)):
                kinds[tuple(parts[:depth])] = "list" if isinstance(path[depth], int) else "dict"
        node = root
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CkptError(f"{key}: {part} is both an item and a prefix of items")
            node = child
        node[parts[-1]] = value
    return _listed(root, (), kinds)


def _listed(node: Any, where: tuple[str, ...], kinds: dict[tuple[str, ...], str]) -> Any:
    if not isinstance(node, dict):
        return node
    out = {name: _listed(value, (*where, name), kinds) for name, value in node.items()}
    digits = bool(out) and all(k.isdigit() for k in out)
    kind = kinds.get(where)
    if kind == "dict":
        return {int(k) if digits else k: v for k, v in out.items()}
    if digits and sorted(out) == sorted(str(i) for i in range(len(out))):
        return [out[str(i)] for i in range(len(out))]
    return out


def distributed_optimizer_groups(common: dict) -> dict:
    """A distributed optimizer's common state (it says ``param_state_sharding_type``) nests its param groups under
    ``optimizer.optimizer``, where the forward conversion took them from (the FSDP optimizer names them
    ``optimizer.param_groups``)."""
    optimizer = common.get("optimizer")
    if isinstance(optimizer, dict) and "param_state_sharding_type" in optimizer and "param_groups" in optimizer:
        optimizer = dict(optimizer)
        optimizer["optimizer"] = {"param_groups": optimizer.pop("param_groups")}
        common = {**common, "optimizer": optimizer}
    return common


GROUP_META_PREFIX = "optimizer.param_to_group_meta."
FULLY_RESHARDABLE = "fully_reshardable"
CONTENT_METADATA = "content_metadata"
# Megatron-LM's _build_sharded_state_dict_metadata for torch_dist with --dist-ckpt-optim-fully-reshardable
_FULLY_RESHARDABLE_CONTENT = {
    "distrib_optim_sharding_type": FULLY_RESHARDABLE,
    "distrib_optim_fully_reshardable_mem_efficient": False,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
# Megatron-LM's get_rng_state for fsdp_dtensor: ``rng_state.(<pp>, <tp>).<dp>.<field>``, bytes and tensors
RNG_PREFIX = "rng_state."
# ChainedOptimizer.sharded_state_dict with several sub-optimizers (e.g. expert parameters in their own):
# ``{0: {"state", "param_to_group_meta"}, 1: ...}``, its states keyed by Megatron-FSDP's parameter names
# (a chained model-space optimizer's common state, ``optimizer.<i>.state.common_step``, is carried)
_CHAINED_RE = re.compile(r"\Aoptimizer\.[0-9]+\.(state\.module\.|param_to_group_meta\.)")


def not_convertible(key: str) -> str | None:
    """Why a Megatron-FSDP save's item has no place in the torch_dist save (``None``: it has one)."""
    if key.startswith(RNG_PREFIX):
        return "per-rank RNG state: torch_dist keeps one ShardedObject per (pp, tp) rank; resume with --no-load-rng"
    if _CHAINED_RE.match(key):
        return (
            "a chained optimizer's sub-optimizer (several param-group sets): not rebuilt; resume with --no-load-optim"
        )
    return None


# what a fully_reshardable distributed optimizer's torch_dist state holds per parameter (Megatron-FSDP's wrapped
# torch Adam also keeps a per-parameter ``step``, which torch_dist keeps in the param groups)
_STEP_STAT = "step"


def param_groups_from_group_meta(items: dict[str, Any]) -> dict[str, Any]:
    """Megatron-FSDP's own save keeps its param groups per parameter, ``optimizer.param_to_group_meta.<name>.<field>``
    (``DistributedOptimizer._param_groups_to_param2group_meta``: each group's fields less ``params``, under each
    of its parameters' names); torch_dist's distributed optimizer keeps the list ``optimizer.optimizer.param_groups``
    without ``params`` and matches saved groups to its own by their identifier fields (``param_group_identifier_keys``)
    on load. So the groups are rebuilt as the distinct field sets, in the order their first parameter was saved,
    and flattened as the forward conversion writes them; the sharding type says ``fully_reshardable`` (the layout
    the per-parameter state is written in), and so does the content metadata, which Megatron-FSDP's save has
    none of (without it Megatron-LM's load assumes ``fully_sharded_model_space`` or ``dp_zero_gather_scatter``):
    the fields ``_build_sharded_state_dict_metadata`` gives a ``--dist-ckpt-optim-fully-reshardable`` torch_dist
    save. Items without group metadata come back unchanged."""
    metas: dict[str, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for key, value in items.items():
        if key.startswith(GROUP_META_PREFIX):  # a parameter's name holds dots; a group's fields are flat
            name, _, field = key[len(GROUP_META_PREFIX) :].rpartition(".")
            metas.setdefault(name, {})[field] = value
        else:
            rest[key] = value
    if not metas:
        return items
    groups: list[dict[str, Any]] = []
    for meta in metas.values():
        if meta not in groups:
            groups.append(meta)
    for index, group in enumerate(groups):
        for field, value in group.items():
            rest[f"optimizer.param_groups.{index}.{field}"] = value
    rest.setdefault("optimizer.param_state_sharding_type", FULLY_RESHARDABLE)
    if rest.get(f"{CONTENT_METADATA}.distrib_optim_sharding_type") in (None, FLAVOUR_FSDP_DTENSOR):
        for field, value in _FULLY_RESHARDABLE_CONTENT.items():
            rest[f"{CONTENT_METADATA}.{field}"] = value
    return rest


def plan_to_torch_dist(checkpoint: Checkpoint) -> tuple[ConvertPlan, dict[str, ReverseRule]]:
    where = checkpoint.iteration_dir
    if checkpoint.location.backend == BACKEND_DCP and is_megatron(checkpoint.flavour):
        checkpoint.common_state()  # its args tell fsdp_dtensor where the keys cannot (no SwiGLU: no _w/_v keys)
    if checkpoint.flavour != FLAVOUR_FSDP_DTENSOR:
        raise CkptError(
            f"{where}: convert --to torch_dist reads a Megatron-FSDP fsdp_dtensor save, not this one "
            f"({checkpoint.location.era})"
        )
    args = saved_args(checkpoint)
    model_dtype = mixed_precision_dtype(args)
    rules, tensors, mappings = reverse_rules(checkpoint, model_dtype, bool(args.get("use_distributed_optimizer")))
    not_carried = []
    objects = []
    for key, entry in sorted(checkpoint.entries.items()):
        if key in rules:
            continue
        reason = not_convertible(key)
        if reason is not None:
            not_carried.append(NotCarried(key, reason))
        elif entry.kind == "bytes":
            objects.append(key)
        elif key.startswith(OPTIMIZER_STATE_PREFIX + ".") and key.endswith("." + _STEP_STAT):
            why = "a per-parameter Adam step: torch_dist keeps the step in the param groups (their saved metadata)"
            not_carried.append(NotCarried(key, why))
        else:
            not_carried.append(NotCarried(key, "a tensor outside model.module. and the optimizer states"))
    mappings.append(KeyMapping("top-level bytes items", ["common.pt"], HOW_OBJECT))
    plan = ConvertPlan(
        source=str(where),
        source_format=FLAVOUR_FSDP_DTENSOR,
        target_format=TARGET_TORCH_DIST,
        swiglu=any(r.half for r in rules.values()),
        grouped_experts=any(_GROUPED_EXPERT_RE.search(_HALF_RE.sub(r".linear_fc1.\1", key)) for key in rules),
        mappings=mappings,
        not_carried=not_carried,
        arg_changes={"ckpt_format": TARGET_TORCH_DIST},
        target_tensors=tensors,
        model_dtype=model_dtype,
    )
    return plan, rules
