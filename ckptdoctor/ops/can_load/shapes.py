"""The model keys a loading run requests and their global shapes, from its args (no model built, no torch).

GPT keys have a global shape that follows from a few args (hidden size, heads, query groups, FFN size, SwiGLU,
experts, padded vocabulary, layers). A key's formula is trusted only when it reproduces the key's saved shape
from the saved args; otherwise the saved shape is kept and only the layer axis follows ``num_layers``.
Stacked layer keys (``decoder.layers.<name>``) have the layer axis first; per-layer keys
(``decoder.layers.<i>.<name>``) come and go with ``num_layers``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptdoctor.parallelism import is_stacked_layer_key

# Keys Megatron builds with allow_shape_mismatch: the padded vocabulary depends on TP.
VOCAB_KEYS = re.compile(r"(^|\.)(word_embeddings|output_layer)\.weight$")
_LAYER_INDEX = re.compile(r"^(.*?\blayers)\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    groups: int
    kv: int
    ffn: int
    glu: int
    experts: int
    moe_ffn: int
    shared: int  # moe_shared_expert_intermediate_size (0: no shared expert)
    vocab: int
    positions: int
    layers: int


def _positive(args: dict[str, Any], name: str) -> int | None:
    value = args.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def pad_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``vocab_size_with_padding``: up to a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def padded_vocab(args: dict[str, Any], tp: int, explicit: bool) -> int | None:
    """The run's padded vocabulary: set explicitly, else padded from vocab_size at this TP, else as saved."""
    vocab, divisible = _positive(args, "vocab_size"), _positive(args, "make_vocab_size_divisible_by") or 128
    if not explicit and vocab is not None:
        return pad_vocab(vocab, divisible, tp)
    return _positive(args, "padded_vocab_size")


def dims_of(args: dict[str, Any], vocab: int | None) -> Dims | None:
    hidden, heads = _positive(args, "hidden_size"), _positive(args, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    groups = _positive(args, "num_query_groups") if args.get("group_query_attention") else heads
    ffn = _positive(args, "ffn_hidden_size") or 4 * hidden
    return Dims(
        hidden=hidden,
        heads=heads,
        groups=groups or heads,
        kv=_positive(args, "kv_channels") or hidden // heads,
        ffn=ffn,
        glu=2 if args.get("swiglu") else 1,
        experts=_positive(args, "num_experts") or 0,
        moe_ffn=_positive(args, "moe_ffn_hidden_size") or ffn,
        shared=_positive(args, "moe_shared_expert_intermediate_size") or 0,
        vocab=vocab or 0,
        positions=_positive(args, "max_position_embeddings") or _positive(args, "seq_length") or 0,
        layers=_positive(args, "num_layers") or 0,
    )


_Formula = Callable[[Dims], tuple[int, ...]]
_LAYER_FORMULAS: dict[str, _Formula] = {
    "self_attention.linear_qkv.weight": lambda d: ((d.heads + 2 * d.groups) * d.kv, d.hidden),
    "self_attention.linear_qkv.bias": lambda d: ((d.heads + 2 * d.groups) * d.kv,),
    "self_attention.linear_qkv.layer_norm_weight": lambda d: (d.hidden,),
    "self_attention.linear_qkv.layer_norm_bias": lambda d: (d.hidden,),
    "input_layernorm.weight": lambda d: (d.hidden,),
    "input_layernorm.bias": lambda d: (d.hidden,),
    "self_attention.linear_proj.weight": lambda d: (d.hidden, d.heads * d.kv),
    "self_attention.linear_proj.bias": lambda d: (d.hidden,),
    "self_attention.q_layernorm.weight": lambda d: (d.kv,),
    "self_attention.k_layernorm.weight": lambda d: (d.kv,),
    "pre_mlp_layernorm.weight": lambda d: (d.hidden,),
    "pre_mlp_layernorm.bias": lambda d: (d.hidden,),
    "mlp.linear_fc1.weight": lambda d: (d.glu * d.ffn, d.hidden),
    "mlp.linear_fc1.bias": lambda d: (d.glu * d.ffn,),
    "mlp.linear_fc1.layer_norm_weight": lambda d: (d.hidden,),
    "mlp.linear_fc1.layer_norm_bias": lambda d: (d.hidden,),
    "mlp.linear_fc2.weight": lambda d: (d.hidden, d.ffn),
    "mlp.linear_fc2.bias": lambda d: (d.hidden,),
    "mlp.router.weight": lambda d: (d.experts, d.hidden),
    "mlp.router.expert_bias": lambda d: (d.experts,),
    "mlp.experts.experts.linear_fc1.weight": lambda d: (d.experts, d.glu * d.moe_ffn, d.hidden),
    "mlp.experts.experts.linear_fc2.weight": lambda d: (d.experts, d.hidden, d.moe_ffn),
    "mlp.shared_experts.linear_fc1.weight": lambda d: (d.glu * d.shared, d.hidden),
    "mlp.shared_experts.linear_fc2.weight": lambda d: (d.hidden, d.shared),
}
_MODEL_FORMULAS: dict[str, _Formula] = {
    "embedding.word_embeddings.weight": lambda d: (d.vocab, d.hidden),
    "output_layer.weight": lambda d: (d.vocab, d.hidden),
    "embedding.position_embeddings.weight": lambda d: (d.positions, d.hidden),
    "decoder.final_layernorm.weight": lambda d: (d.hidden,),
    "decoder.final_layernorm.bias": lambda d: (d.hidden,),
}


def _formula(key: str) -> tuple[_Formula | None, bool]:
    """(formula, stacked) for a model key; per-layer keys use the layer formulas without the layer axis."""
    if key in _MODEL_FORMULAS:
        return _MODEL_FORMULAS[key], False
    stacked = is_stacked_layer_key(key)
    indexed = _LAYER_INDEX.match(key)
    name = indexed.group(3) if indexed else key.split("layers.", 1)[-1]
    return _LAYER_FORMULAS.get(name), stacked


def target_shape(key: str, shape: tuple[int, ...], saved: Dims | None, target: Dims | None) -> tuple[int, ...]:
    """The global shape the loading run requests for a saved model tensor."""
    formula, stacked = _formula(key)
    body = shape[1:] if stacked else shape
    if formula is not None and saved is not None and target is not None:
        try:
            if formula(saved) == tuple(body):
                body = formula(target)
        except (TypeError, ValueError):
            pass
    if stacked and saved is not None and target is not None and shape and shape[0] == saved.layers:
        return (target.layers, *body)
    return (shape[0], *body) if stacked and shape else tuple(body)  # a 0-dim "stacked" tensor: nothing to stack


def layer_index(key: str) -> tuple[str, int, str] | None:
    """(prefix, layer, rest) of a per-layer key ``...layers.<i>.<rest>``; None for other keys."""
    match = _LAYER_INDEX.match(key)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None
