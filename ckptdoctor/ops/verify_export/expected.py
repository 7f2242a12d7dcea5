"""What a Megatron checkpoint's model section should be in Hugging Face names: each HF tensor, its shape, and the
Megatron slice it equals (for ``--values``), derived from the global shapes, the saved args and the family's
mapping."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor.checkpoint import Checkpoint, Entry
from ckptdoctor.init_std import megatron_init_stds
from ckptdoctor.ops.verify_export.mapping import Mapping, Rule

_LAYER_KEY = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)\Z")
# a multi-token prediction layer's key (per layer); its transformer layer's keys follow the layer rules
_MTP_KEY = re.compile(r"mtp\.layers\.(\d+)\.(.+)\Z")
_MTP_LAYER = "transformer_layer."
# one expert's own key: SequentialMLP with singleton local shards (``experts.experts.<e>.``, the global index) and
# the module names of a non-distributed save (``experts.local_experts.<e>.``); the rule is the stacked key's
_EXPERT_KEY = re.compile(r"(.*\.experts\.)(?:experts|local_experts)\.(\d+)\.(.+)\Z")
# HF tensors one verification lists: a large MoE export has 100k; a .metadata's shapes (a few bytes of a stacked key
# of 2^40 layers or experts) could name more than memory holds, so a key past it is unmapped, not expanded.
MAX_EXPECTED = 1 << 20


@dataclass(slots=True)  # one per HF tensor (100k in a large export): not frozen, whose __init__ is slower
class Expected:
    """One HF tensor as the Megatron checkpoint says it should be."""

    hf_name: str
    megatron_key: str
    transform: str
    part: int  # which piece of the transform (q=0, k=1, v=2; gate=0, up=1)
    shape: tuple[int, ...]
    dtype: str  # the Megatron tensor's dtype ("float32")
    layer: int | None
    expert: int | None
    index: tuple[int, ...]  # the leading (layer, expert) indices into the Megatron global tensor
    optional: bool = False  # compared where the export has it, not missing where it does not (mtp_shared)


@dataclass
class Unmapped:
    megatron_key: str
    reason: str


@dataclass(frozen=True)
class Dims:
    """The args the transforms need."""

    heads: int | None
    groups: int | None
    kv_channels: int | None
    vocab_rows: int | None  # config.json's vocab_size where it fits in the padded rows
    layers: int | None = None  # num_layers: HF numbers MTP layer n as layer num_layers + n
    # the stds of a fresh normal init: Megatron's init_method_std, and its output layers' scaled std (none: unknown)
    init_stds: tuple[float, ...] = ()

    @staticmethod
    def from_args(args: dict[str, Any], config: dict[str, Any]) -> Dims:
        heads = _int(args.get("num_attention_heads"))
        groups = _int(_query_groups(args)) or heads
        kv = _int(args.get("kv_channels"))
        if kv is None and heads and _int(args.get("hidden_size")):
            kv = args["hidden_size"] // heads
        stds = megatron_init_stds(args)
        return Dims(
            heads,
            groups,
            kv,
            _int(config.get("vocab_size")),
            _int(args.get("num_layers")),
            stds.both() if stds is not None else (),
        )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _query_groups(args: dict[str, Any]) -> Any:
    """The KV heads: Megatron-LM's ``num_query_groups`` counts only with ``group_query_attention`` (else one group
    per head); a Megatron-Bridge model config has no such flag and sets ``num_query_groups`` itself."""
    heads = args.get("num_attention_heads")
    if "group_query_attention" in args and not args["group_query_attention"]:
        return heads
    return args.get("num_query_groups") or heads


def derived_args(args: dict[str, Any]) -> dict[str, Any]:
    """The saved args with the values config.json states differently (:data:`mapping.DERIVED`)."""
    values = dict(args)
    heads = args.get("num_attention_heads")
    values["num_key_value_heads"] = _query_groups(args)
    if "untie_embeddings_and_output_weights" in args:
        values["tie_word_embeddings"] = not args["untie_embeddings_and_output_weights"]
    elif "share_embeddings_and_output_weights" in args:  # Megatron-Bridge's model config
        values["tie_word_embeddings"] = bool(args["share_embeddings_and_output_weights"])
    if values.get("kv_channels") is None and isinstance(heads, int) and heads and args.get("hidden_size"):
        values["kv_channels"] = args["hidden_size"] // heads
    values["mtp_num_layers"] = args.get("mtp_num_layers") or 0
    shared, moe_ffn = _int(args.get("moe_shared_expert_intermediate_size")), _int(args.get("moe_ffn_hidden_size"))
    if shared and moe_ffn:
        values["moe_shared_experts"] = shared / moe_ffn if shared % moe_ffn else shared // moe_ffn
    elif args.get("num_experts"):
        values["moe_shared_experts"] = 0
    values.update(_router_choice(args))
    normalized = _topk_normalized(args)
    if normalized is not None:
        values["moe_topk_normalized"] = normalized
    freq = args.get("moe_layer_freq")
    if isinstance(freq, list) and args.get("num_experts"):
        values["moe_first_dense_layers"] = next((i for i, moe in enumerate(freq) if moe), len(freq))
    elif freq == 1 and args.get("num_experts"):
        values["moe_first_dense_layers"] = 0
    return values


def _router_choice(args: dict[str, Any]) -> dict[str, Any]:
    """How Megatron's router chooses experts, in DeepSeek's config.json terms (n_group, topk_group, topk_method,
    scoring_func). Group-limited routing (``moe_router_num_groups`` / ``moe_router_group_topk``, unset or absent:
    off) is one group of every expert, all chosen; the expert bias (``moe_router_enable_expert_bias``) is
    DeepSeek-V3's auxiliary-loss-free ``noaux_tc``; Megatron's score function defaults to softmax."""
    if not args.get("num_experts"):
        return {}
    groups = _int(args.get("moe_router_num_groups"))
    chosen = _int(args.get("moe_router_group_topk"))
    if args.get("moe_router_enable_expert_bias"):
        method = "noaux_tc"
    else:
        method = "group_limited_greedy" if groups and groups > 1 else "greedy"
    return {
        "moe_router_groups": groups or 1,
        "moe_router_groups_chosen": chosen or 1,
        "moe_router_topk_method": method,
        "moe_router_score_function": args.get("moe_router_score_function") or "softmax",
    }


def _topk_normalized(args: dict[str, Any]) -> bool | None:
    """Whether Megatron's router weights sum to one over the chosen experts (megatron-core's
    ``topk_routing_with_score_function``): softmax after the top-k (``moe_router_pre_softmax`` off) does; a
    softmax before it does not; sigmoid scores are renormalised when top-k > 1."""
    if not args.get("num_experts"):
        return None
    if args.get("moe_router_score_function", "softmax") == "sigmoid":
        topk = args.get("moe_router_topk")
        return isinstance(topk, int) and topk > 1
    return not args.get("moe_router_pre_softmax")


def _split_shape(rule: Rule, shape: tuple[int, ...], dims: Dims, key: str) -> list[tuple[int, ...]] | str:
    """The HF shapes of one Megatron tensor (one layer, one expert), or why they cannot be derived."""
    if rule.transform == "copy":
        return [shape]
    if not shape:
        return f"a {rule.transform} tensor with no dims"
    rows, rest = shape[0], shape[1:]
    if rule.transform == "gate_up":
        if rows % 2:
            return f"{rows} rows do not split into gate and up"
        return [(rows // 2, *rest), (rows // 2, *rest)]
    if rule.transform == "vocab":
        if dims.vocab_rows is not None and dims.vocab_rows <= rows:
            return [(dims.vocab_rows, *rest)]
        return [shape]
    heads, groups, kv = dims.heads, dims.groups, dims.kv_channels
    if heads is None or groups is None or kv is None:
        return "the saved args lack num_attention_heads / num_query_groups / kv_channels"
    if heads % groups or rows != (heads + 2 * groups) * kv:
        return f"{rows} rows are not (heads {heads} + 2 x groups {groups}) x kv_channels {kv}"
    return [(heads * kv, *rest), (groups * kv, *rest), (groups * kv, *rest)]


def expected_tensors(checkpoint: Checkpoint, mapping: Mapping, dims: Dims) -> tuple[list[Expected], list[Unmapped]]:
    """Every HF tensor the model section maps to, and the model tensors the mapping does not know."""
    expected: list[Expected] = []
    unmapped: list[Unmapped] = []
    model = [
        (key, entry)
        for key, entry in checkpoint.entries.items()
        if entry.section == "model" and entry.kind == "tensor" and not entry.is_extra_state
    ]
    for key, entry in sorted(model):
        rule, layers, expert = _rule_for(key, entry, mapping, dims)
        if rule is None:
            unmapped.append(Unmapped(key, f"no rule of family {mapping.family} for it"))
            continue
        names = _names(entry, rule, layers, expert)
        if len(expected) + names > MAX_EXPECTED:
            why = f"its shape {list(entry.shape or ())} names {names:,} HF tensors, past the {MAX_EXPECTED:,} listed"
            unmapped.append(Unmapped(key, why))
            continue
        expected.extend(_expand(key, entry, rule, layers, expert, dims, unmapped))
    expected.extend(_mtp_shared(checkpoint, model, mapping, dims))
    return expected, unmapped


def _mtp_shared(checkpoint: Checkpoint, model: list[tuple[str, Entry]], mapping: Mapping, dims: Dims) -> list[Expected]:
    """The optional copies of shared keys (embedding, output layer) in each MTP layer the checkpoint has."""
    if not mapping.mtp_shared_rules or dims.layers is None:
        return []
    indices = sorted({int(m.group(1)) for key, _ in model if (m := _MTP_KEY.match(key)) is not None})
    out: list[Expected] = []
    for key, rule in mapping.mtp_shared_rules.items():
        entry = checkpoint.entries.get(key)
        if entry is None or entry.section != "model" or entry.kind != "tensor":
            continue
        for want in _expand(key, entry, rule, [(dims.layers + n, False) for n in indices], None, dims, []):
            want.optional = True
            out.append(want)
    return out


@dataclass(frozen=True)
class _StackedLayers:
    """Layers 0..count-1 of a stacked key as ``(layer, True)``, without a list: ``count`` is a .metadata's."""

    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[int | None, bool]]:
        return ((layer, True) for layer in range(self.count))


_Layers = list[tuple[int | None, bool]] | _StackedLayers


def _names(entry: Entry, rule: Rule, layers: _Layers, own_expert: int | None) -> int:
    """How many HF tensors :func:`_expand` makes of a key (counted from the shape, none made)."""
    experts = 1
    if own_expert is None and rule.per_expert:
        shape = tuple(entry.shape or ())
        layer_shape = shape[1:] if isinstance(layers, _StackedLayers) else shape
        experts = layer_shape[0] if layer_shape else 1
    return len(layers) * experts * len(rule.hf)


def _rule_for(key: str, entry: Entry, mapping: Mapping, dims: Dims) -> tuple[Rule | None, _Layers, int | None]:
    """The rule of a key, its layers (``(layer, stacked)`` per layer it holds; ``None``: not a layer key) and, for
    one expert's own key, that expert."""
    if key in mapping.global_rules:
        return mapping.global_rules[key], [(None, False)], None
    mtp = _MTP_KEY.match(key)
    if mtp is not None:
        return _mtp_rule_for(int(mtp.group(1)), mtp.group(2), mapping, dims)
    match = _LAYER_KEY.match(key)
    if match is None:
        return None, [], None
    rule, expert = _layer_rule(match.group(2), mapping)
    if rule is None:
        return None, [], None
    if match.group(1) is not None:
        return rule, [(int(match.group(1)), False)], expert
    return rule, _StackedLayers(entry.shape[0] if entry.shape else 0), expert


def _mtp_rule_for(
    index: int, name: str, mapping: Mapping, dims: Dims
) -> tuple[Rule | None, list[tuple[int | None, bool]], int | None]:
    """MTP layer ``index``'s key below ``mtp.layers.<index>.``: HF's layer ``num_layers + index``."""
    if dims.layers is None:
        return None, [], None
    layer: list[tuple[int | None, bool]] = [(dims.layers + index, False)]
    if name.startswith(_MTP_LAYER):
        rule, expert = _layer_rule(name.removeprefix(_MTP_LAYER), mapping)
        return (rule, layer, expert) if rule is not None else (None, [], None)
    rule = mapping.mtp_rules.get(name)
    return (rule, layer, None) if rule is not None else (None, [], None)


def _layer_rule(name: str, mapping: Mapping) -> tuple[Rule | None, int | None]:
    """The layer rule of a key below ``decoder.layers.[<i>.]`` and, for one expert's own key, that expert."""
    expert = None
    own = _EXPERT_KEY.match(name)
    if own is not None:
        name, expert = f"{own.group(1)}experts.{own.group(3)}", int(own.group(2))
    rule = mapping.layer_rules.get(name)
    if rule is None or (expert is not None and not rule.per_expert):
        return None, None
    return rule, expert


def _expand(
    key: str,
    entry: Entry,
    rule: Rule,
    layers: _Layers,
    own_expert: int | None,
    dims: Dims,
    unmapped: list[Unmapped],
) -> list[Expected]:
    out: list[Expected] = []
    dtype = (entry.dtype or "").removeprefix("torch.")
    shape = tuple(entry.shape or ())
    for layer, stacked in layers:
        layer_shape = shape[1:] if stacked else shape
        head: tuple[int, ...] = (layer,) if stacked and layer is not None else ()
        experts: list[int | None] = [None]
        piece = layer_shape
        if own_expert is not None:
            experts = [own_expert]
        elif rule.per_expert:
            if not layer_shape:
                unmapped.append(Unmapped(key, "a per-expert rule for a tensor with no expert axis"))
                return out
            experts = list(range(layer_shape[0]))
            piece = layer_shape[1:]
        shapes = _split_shape(rule, piece, dims, key)
        if isinstance(shapes, str):
            unmapped.append(Unmapped(key, shapes))
            return out
        for expert in experts:
            index = head + ((expert,) if expert is not None and own_expert is None else ())
            for part, (template, hf_shape) in enumerate(zip(rule.hf, shapes)):
                name = template.format(layer=layer, expert=expert)
                out.append(Expected(name, key, rule.transform, part, hf_shape, dtype, layer, expert, index))
    return out
