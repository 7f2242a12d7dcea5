"""``ckptdoctor convert --to torch_dist``, planning half: a Megatron-FSDP fsdp_dtensor save back to torch_dist keys.

The inverse of :mod:`ckptdoctor.ops.convert.plan`: ``model.module.<name>`` loses its prefix, optimizer states go
back to ``optimizer.state.<stat>.<name>``, per-layer keys ``decoder.layers.<i>.<name>`` are stacked again on a
leading layer axis (megatron-core's ``prepend_axis_num=1``), and SwiGLU ``<name>_w``/``<name>_v`` halves are
joined on dim 0 (gate half first, as ``apply_swiglu_sharded_factory`` lays ``linear_fc1`` out). The top-level
bytes items are gathered back into the common state (dotted keys unflattened), written as ``common.pt`` with
the args saying ``ckpt_format='torch_dist'``.
Metadata only: nothing here reads a tensor or imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.plain_dcp import FLAVOUR_FSDP_DTENSOR
from ckptdoctor.ops.convert.plan import (
    HOW_OBJECT,
    MODEL_PREFIX,
    OPTIMIZER_STATE_PREFIX,
    ConvertPlan,
    KeyMapping,
    NotCarried,
    TargetTensor,
)

TARGET_TORCH_DIST = "torch_dist"
HOW_MERGE = "layers stacked"
HOW_MERGE_SWIGLU = "layers stacked, SwiGLU halves joined"

_LAYER_RE = re.compile(r"\.layers\.([0-9]+)\.")
_HALF_RE = re.compile(r"\.linear_fc1\.(weight|bias)_([wv])\Z")


@dataclass(frozen=True)
class ReverseRule:
    """Where one fsdp_dtensor tensor goes: ``target`` key, ``layer`` index on the stacked axis (None: not
    stacked), ``half`` offset on dim 0 where a SwiGLU ``_v`` half starts (0 for ``_w`` and unsplit keys)."""

    target: str
    layer: int | None
    half: int


def _source_param(key: str) -> tuple[str, str | None] | None:
    if key.startswith(MODEL_PREFIX + "."):
        return key[len(MODEL_PREFIX) + 1 :], None
    if key.startswith(OPTIMIZER_STATE_PREFIX + "."):
        param, _, stat = key[len(OPTIMIZER_STATE_PREFIX) + 1 :].rpartition(".")
        return (param, stat) if param else None
    return None


def _unsplit(param: str) -> tuple[str, str | None]:
    match = _HALF_RE.search(param)
    if match is None:
        return param, None
    return param[: match.start()] + f".linear_fc1.{match.group(1)}", match.group(2)


def reverse_rules(checkpoint: Checkpoint) -> tuple[dict[str, ReverseRule], list[TargetTensor], list[KeyMapping]]:
    """Every convertible tensor's :class:`ReverseRule`, the output tensors and the key mappings."""
    groups: dict[str, dict[tuple[int | None, str | None], str]] = {}
    dtypes: dict[str, str] = {}
    for key, entry in sorted(checkpoint.entries.items()):
        named = _source_param(key) if entry.kind == "tensor" and entry.shape is not None else None
        if named is None:
            continue
        param, stat = named
        layer_match = _LAYER_RE.search(param)
        layer = int(layer_match.group(1)) if layer_match else None
        stacked = param
        if layer_match is not None:
            stacked = param[: layer_match.start()] + ".layers." + param[layer_match.end() :]
        stacked, half = _unsplit(stacked)
        target = stacked if stat is None else f"optimizer.state.{stat}.{stacked}"
        groups.setdefault(target, {})[(layer, half)] = key
        dtypes[target] = str(entry.dtype)
    rules: dict[str, ReverseRule] = {}
    tensors: list[TargetTensor] = []
    mappings: list[KeyMapping] = []
    for target, parts in sorted(groups.items()):
        layers = sorted({layer for layer, _half in parts if layer is not None})
        if layers and (len(layers) != len({layer for layer, _ in parts}) or layers != list(range(len(layers)))):
            raise CkptError(f"{checkpoint.iteration_dir}: {target}: layers {layers} are not 0..{len(layers) - 1}")
        halves = {half for _layer, half in parts}
        if halves not in ({None}, {"w", "v"}):
            raise CkptError(f"{checkpoint.iteration_dir}: {target}: SwiGLU halves {sorted(map(str, halves))} unpaired")
        first = checkpoint.entries[next(iter(parts.values()))]
        assert first.shape is not None
        inner = tuple(first.shape)
        half_size = inner[0] if halves == {"w", "v"} else 0
        if half_size:
            inner = (2 * half_size, *inner[1:])
        for (layer, half), key in parts.items():
            shape = checkpoint.entries[key].shape
            if shape is None or tuple(shape[1:]) != inner[1:] or shape[0] != (half_size or inner[0]):
                raise CkptError(f"{checkpoint.iteration_dir}: {key}: shape {shape} differs from its siblings'")
            rules[key] = ReverseRule(target, layer, half_size if half == "v" else 0)
        shape = (len(layers), *inner) if layers else inner
        tensors.append(TargetTensor(target, shape, dtypes[target]))
        how = (HOW_MERGE_SWIGLU if half_size else HOW_MERGE) if layers else "rename"
        if half_size and not layers:
            how = "SwiGLU halves joined"
        for key in sorted(parts.values()):
            mappings.append(KeyMapping(key, [target], how))
    return rules, tensors, mappings


def unflatten(items: dict[str, Any]) -> dict:
    """The common state from its dotted keys: a dict whose keys are exactly ``0..n-1`` becomes a list
    (``optimizer.param_groups`` stays where megatron-core 0.19's common state has it)."""
    root: dict = {}
    for key, value in items.items():
        parts = key.split(".")
        node = root
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CkptError(f"{key}: {part} is both an item and a prefix of items")
            node = child
        node[parts[-1]] = value
    return _listed(root)


def _listed(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {name: _listed(value) for name, value in node.items()}
    if out and sorted(out) == sorted(str(i) for i in range(len(out))) and all(k.isdigit() for k in out):
        return [out[str(i)] for i in range(len(out))]
    return out


def plan_to_torch_dist(checkpoint: Checkpoint) -> tuple[ConvertPlan, dict[str, ReverseRule]]:
    where = checkpoint.iteration_dir
    if checkpoint.flavour != FLAVOUR_FSDP_DTENSOR:
        raise CkptError(f"{where}: convert --to torch_dist reads a Megatron-FSDP fsdp_dtensor save")
    rules, tensors, mappings = reverse_rules(checkpoint)
    not_carried = []
    objects = []
    for key, entry in sorted(checkpoint.entries.items()):
        if key in rules:
            continue
        if entry.kind == "bytes":
            objects.append(key)
        else:
            not_carried.append(NotCarried(key, "a tensor outside model.module. and the optimizer states"))
    mappings.append(KeyMapping("top-level bytes items", ["common.pt"], HOW_OBJECT))
    plan = ConvertPlan(
        source=str(where),
        source_format=FLAVOUR_FSDP_DTENSOR,
        target_format=TARGET_TORCH_DIST,
        swiglu=any(r.half for r in rules.values()),
        mappings=mappings,
        not_carried=not_carried,
        arg_changes={"ckpt_format": TARGET_TORCH_DIST},
        target_tensors=tensors,
    )
    return plan, rules
