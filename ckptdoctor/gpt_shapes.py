"""The global shape Megatron-LM's saved args imply for a GPT model key (dense layers; experts are not covered).

A plain DCP save of Megatron-LM (``--ckpt-format torch_dcp`` / ``fsdp_dtensor``) stores each parameter under its
module name with whatever shape the saving rank held: a save made from per-rank *local* tensors (TP > 1, which
Megatron-LM's argument validation refuses for torch_dcp) keeps one rank's shard, and nothing in ``.metadata`` says
so. The args say what the whole tensor is.
"""

from __future__ import annotations

import re
from typing import Any

_MODEL_PREFIX_RE = re.compile(r"^model[0-9]*\.")


def _int(args: dict[str, Any], name: str) -> int | None:
    value = args.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def expected_shape(key: str, args: dict[str, Any]) -> tuple[int, ...] | None:
    """The global shape of ``key`` (``model.`` prefix optional) the args imply; None for a key this table does not
    cover or args that do not say."""
    name = _MODEL_PREFIX_RE.sub("", key)
    if ".experts." in name or "_extra_state" in name:
        return None
    hidden = _int(args, "hidden_size")
    vocab = _int(args, "padded_vocab_size")
    heads = _int(args, "num_attention_heads")
    if hidden is None:
        return None
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return None if vocab is None else (vocab, hidden)
    if heads is None:
        return None
    kv_channels = _int(args, "kv_channels") or hidden // heads
    groups = (_int(args, "num_query_groups") if args.get("group_query_attention") else None) or heads
    ffn = _int(args, "ffn_hidden_size")
    qkv_rows = (heads + 2 * groups) * kv_channels
    fc1_rows = None if ffn is None else ffn * (2 if args.get("swiglu") else 1)
    shapes: dict[str, tuple[int, ...] | None] = {
        ".self_attention.linear_qkv.weight": (qkv_rows, hidden),
        ".self_attention.linear_qkv.bias": (qkv_rows,),
        ".self_attention.linear_proj.weight": (hidden, heads * kv_channels),
        ".mlp.linear_fc1.weight": None if fc1_rows is None else (fc1_rows, hidden),
        ".mlp.linear_fc1.bias": None if fc1_rows is None else (fc1_rows,),
        ".mlp.linear_fc2.weight": None if ffn is None else (hidden, ffn),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix) and name.startswith("decoder.layers."):
            return shape
    return None
