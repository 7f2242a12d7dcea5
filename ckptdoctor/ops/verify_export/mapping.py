"""The name and layout grammar of Megatron <-> Hugging Face, as data: one table per model family.

A table (built in here, or a TOML file given with ``--mapping``, the same schema) has:

* ``model_types``: the ``config.json`` ``model_type`` values it is chosen for;
* ``global``: whole Megatron keys -> ``{transform, hf}``;
* ``layer``: keys below ``decoder.layers.`` (torch_dist stacks the layers in the leading axis of one global
  tensor; per-layer keys ``decoder.layers.<i>.`` hold one layer) -> ``{transform, hf}``; an ``hf`` name with
  ``{expert}`` makes the key per expert (its next axis is the expert axis);
* ``mtp`` (optional): keys below ``mtp.layers.<n>.`` (multi-token prediction layers, DeepSeek-V3 style) ->
  ``{transform, hf}``; HF numbers MTP layer ``n`` as layer ``num_layers + n`` (``{layer}``), and the MTP layer's
  own transformer layer (``mtp.layers.<n>.transformer_layer.``) follows the ``layer`` rules at that index;
* ``mtp_shared`` (optional): whole Megatron keys the MTP layers share with the model (the embedding, the output
  layer) -> ``{transform, hf}`` in each MTP layer (``{layer}``): DeepSeek-V3's own checkpoints repeat them there,
  exporters such as Megatron-Bridge's leave them out, so they are compared where present and never missing;
* ``requires`` (optional): layer key -> layer key: where a layer has the first but not the second, the family's
  HF model still has the second's tensors, which no checkpoint tensor fills (transformers initialises them at
  random: the export cannot compute the checkpoint's model);
* ``config``: ``config.json`` fields -> the saved arg (or derived value, :data:`DERIVED`) each must equal.

``hf`` names take ``{layer}`` and ``{expert}``. The transforms undo what Megatron does to the layout:

* ``copy``: the same tensor;
* ``qkv``: the fused ``linear_qkv``, rows per query group ``[q_1 .. q_{heads/groups}, k, v]``, into q, k, v;
* ``gate_up``: SwiGLU's ``linear_fc1`` ``[gate; up]`` into gate and up;
* ``vocab``: the embedding / output layer padded to ``padded_vocab_size``; HF keeps ``vocab_size`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from ckptdoctor.errors import CkptError

TRANSFORMS = ("copy", "qkv", "gate_up", "vocab")
PARTS = {"copy": 1, "qkv": 3, "gate_up": 2, "vocab": 1}

# derived values a config field may be compared with (beside any saved arg by name)
DERIVED = (
    "num_key_value_heads",
    "tie_word_embeddings",
    "vocab_size",
    "mtp_num_layers",  # 0 where the args have none
    "moe_shared_experts",  # moe_shared_expert_intermediate_size / moe_ffn_hidden_size (DeepSeek's n_shared_experts)
    "moe_first_dense_layers",  # the dense layers before the first MoE one (DeepSeek's first_k_dense_replace)
    "moe_topk_normalized",  # whether the router renormalises the top-k weights (HF's norm_topk_prob)
    "moe_router_groups",  # moe_router_num_groups, 1 without group-limited routing (DeepSeek's n_group)
    "moe_router_groups_chosen",  # moe_router_group_topk, 1 without group-limited routing (DeepSeek's topk_group)
    "moe_router_topk_method",  # DeepSeek's topk_method: noaux_tc (expert bias), group_limited_greedy or greedy
    "moe_router_score_function",  # the saved arg, else Megatron's default softmax (DeepSeek's scoring_func)
)

_L = "model.layers.{layer}."


def _r(transform: str, *hf: str) -> dict[str, Any]:
    return {"transform": transform, "hf": list(hf)}


_GLOBAL = {
    "embedding.word_embeddings.weight": _r("vocab", "model.embed_tokens.weight"),
    "output_layer.weight": _r("vocab", "lm_head.weight"),
    "decoder.final_layernorm.weight": _r("copy", "model.norm.weight"),
}

# A layer's norms and dense MLP, every family alike (the fused TE layer norms and the local spec's own)
_NORMS_AND_MLP = {
    "input_layernorm.weight": _r("copy", _L + "input_layernorm.weight"),
    "pre_mlp_layernorm.weight": _r("copy", _L + "post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_weight": _r("copy", _L + "post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": _r("gate_up", _L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": _r("copy", _L + "mlp.down_proj.weight"),
}

# Llama/Mistral/Qwen2/Qwen3 dense layers (q/k norm: Qwen3)
_DENSE = {
    **_NORMS_AND_MLP,
    "self_attention.linear_qkv.layer_norm_weight": _r("copy", _L + "input_layernorm.weight"),
    "self_attention.linear_qkv.weight": _r(
        "qkv", _L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"
    ),
    "self_attention.linear_qkv.bias": _r(
        "qkv", _L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"
    ),
    "self_attention.linear_proj.weight": _r("copy", _L + "self_attn.o_proj.weight"),
    "self_attention.q_layernorm.weight": _r("copy", _L + "self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _r("copy", _L + "self_attn.k_norm.weight"),
}

_CONFIG = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "kv_channels",
    "vocab_size": "vocab_size",
    "rope_theta": "rotary_base",
    "rms_norm_eps": "norm_epsilon",
    "tie_word_embeddings": "tie_word_embeddings",
}


def _experts(block: str, gate: str, up: str, down: str) -> dict[str, Any]:
    e = _L + block + ".experts.{expert}."
    rules = {
        "mlp.router.weight": _r("copy", _L + block + ".gate.weight"),
        "mlp.experts.experts.linear_fc1.weight": _r("gate_up", e + gate + ".weight", e + up + ".weight"),
        "mlp.experts.experts.linear_fc2.weight": _r("copy", e + down + ".weight"),
    }
    return rules


_S = _L + "mlp.shared_expert."
_DS = _L + "mlp.shared_experts."
_A = _L + "self_attn."

# DeepSeek-V2/V3 layers: multi-latent attention (the local spec's norms and the TE spec's fused ones), a dense MLP or
# MoE with shared experts and the router's expert bias (sigmoid scores: e_score_correction_bias)
_DEEPSEEK = {
    **_NORMS_AND_MLP,
    "self_attention.linear_q_proj.layer_norm_weight": _r("copy", _L + "input_layernorm.weight"),
    "self_attention.linear_q_proj.weight": _r("copy", _A + "q_proj.weight"),  # q_lora_rank None
    "self_attention.linear_q_down_proj.weight": _r("copy", _A + "q_a_proj.weight"),
    "self_attention.q_layernorm.weight": _r("copy", _A + "q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.layer_norm_weight": _r("copy", _A + "q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": _r("copy", _A + "q_b_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": _r("copy", _A + "kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": _r("copy", _A + "kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.layer_norm_weight": _r("copy", _A + "kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": _r("copy", _A + "kv_b_proj.weight"),
    "self_attention.linear_proj.weight": _r("copy", _A + "o_proj.weight"),
    **_experts("mlp", "gate_proj", "up_proj", "down_proj"),
    "mlp.router.expert_bias": _r("copy", _L + "mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": _r("gate_up", _DS + "gate_proj.weight", _DS + "up_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": _r("copy", _DS + "down_proj.weight"),
}

# multi-token prediction layers' own modules (their transformer layer follows the family's layer rules)
_MTP = {
    "enorm.weight": _r("copy", _L + "enorm.weight"),
    "hnorm.weight": _r("copy", _L + "hnorm.weight"),
    "eh_proj.weight": _r("copy", _L + "eh_proj.weight"),  # [enorm(embedding); hnorm(hidden)] -> hidden, both
    "final_layernorm.weight": _r("copy", _L + "shared_head.norm.weight"),
}
_MTP_SHARED = {
    "embedding.word_embeddings.weight": _r("vocab", _L + "embed_tokens.weight"),
    "output_layer.weight": _r("vocab", _L + "shared_head.head.weight"),
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "model_types": ["llama", "mistral", "qwen2", "qwen3"],
        "global": _GLOBAL,
        "layer": _DENSE,
        "config": {**_CONFIG, "intermediate_size": "ffn_hidden_size"},
    },
    "mixtral": {
        "model_types": ["mixtral"],
        "global": _GLOBAL,
        "layer": {**_DENSE, **_experts("block_sparse_moe", "w1", "w3", "w2")},
        "config": {
            **_CONFIG,
            "intermediate_size": "moe_ffn_hidden_size",
            "num_local_experts": "num_experts",
            "num_experts_per_tok": "moe_router_topk",
        },
    },
    "qwen_moe": {
        "model_types": ["qwen2_moe", "qwen3_moe"],
        "global": _GLOBAL,
        "layer": {
            **_DENSE,
            **_experts("mlp", "gate_proj", "up_proj", "down_proj"),
            "mlp.shared_experts.linear_fc1.weight": _r("gate_up", _S + "gate_proj.weight", _S + "up_proj.weight"),
            "mlp.shared_experts.linear_fc2.weight": _r("copy", _S + "down_proj.weight"),
            # moe_shared_expert_gate: sigmoid(x @ gate_weight^T) scales the shared expert; [1, hidden] on both sides
            "mlp.shared_experts.gate_weight": _r("copy", _L + "mlp.shared_expert_gate.weight"),
        },
        # Qwen2-MoE always gates its shared expert; Megatron does only with moe_shared_expert_gate
        "requires": {"mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.gate_weight"},
        "config": {
            **_CONFIG,
            "intermediate_size": "ffn_hidden_size",
            "moe_intermediate_size": "moe_ffn_hidden_size",
            "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
            "num_experts": "num_experts",
            "num_experts_per_tok": "moe_router_topk",
            "norm_topk_prob": "moe_topk_normalized",
        },
    },
    "deepseek": {
        "model_types": ["deepseek_v3", "deepseek_v2", "kimi_k2"],
        "global": _GLOBAL,
        "layer": _DEEPSEEK,
        "mtp": _MTP,
        "mtp_shared": _MTP_SHARED,
        "config": {
            **{k: v for k, v in _CONFIG.items() if k != "head_dim"},  # HF's head_dim is qk_rope_head_dim
            "intermediate_size": "ffn_hidden_size",
            "moe_intermediate_size": "moe_ffn_hidden_size",
            "n_routed_experts": "num_experts",
            "n_shared_experts": "moe_shared_experts",
            "num_experts_per_tok": "moe_router_topk",
            "norm_topk_prob": "moe_topk_normalized",
            "routed_scaling_factor": "moe_router_topk_scaling_factor",
            "n_group": "moe_router_groups",
            "topk_group": "moe_router_groups_chosen",
            "topk_method": "moe_router_topk_method",
            "scoring_func": "moe_router_score_function",
            "first_k_dense_replace": "moe_first_dense_layers",
            "q_lora_rank": "q_lora_rank",
            "kv_lora_rank": "kv_lora_rank",
            "qk_nope_head_dim": "qk_head_dim",
            "qk_rope_head_dim": "qk_pos_emb_head_dim",
            "v_head_dim": "v_head_dim",
            "num_nextn_predict_layers": "mtp_num_layers",
        },
    },
}


@dataclass(frozen=True)
class Rule:
    transform: str
    hf: tuple[str, ...]
    per_expert: bool = field(init=False)  # an hf name takes {expert}: the key's next axis is the expert axis

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_expert", any("{expert}" in name for name in self.hf))


@dataclass(frozen=True)
class Mapping:
    family: str
    model_types: tuple[str, ...]
    global_rules: dict[str, Rule]
    layer_rules: dict[str, Rule]
    config: dict[str, str]
    mtp_rules: dict[str, Rule] = field(default_factory=dict)  # below mtp.layers.<n>. (besides transformer_layer.)
    mtp_shared_rules: dict[str, Rule] = field(default_factory=dict)  # whole keys repeated in each MTP layer, optional
    requires: dict[str, str] = field(default_factory=dict)  # layer key -> the layer key the HF model always needs


def _rules(table: Any, where: str) -> dict[str, Rule]:
    if not isinstance(table, dict):
        raise CkptError(f"{where}: not a table")
    rules = {}
    for key, spec in table.items():
        transform = spec.get("transform") if isinstance(spec, dict) else None
        hf = spec.get("hf") if isinstance(spec, dict) else None
        if transform not in TRANSFORMS:
            raise CkptError(f"{where}.{key}: transform {transform!r} is not one of {', '.join(TRANSFORMS)}")
        if not isinstance(hf, list) or len(hf) != PARTS[transform] or not all(isinstance(n, str) for n in hf):
            raise CkptError(f"{where}.{key}: hf must list {PARTS[transform]} tensor name(s) for {transform!r}")
        rules[key] = Rule(transform, tuple(hf))
    return rules


def mapping_from_table(family: str, table: Any, where: str) -> Mapping:
    """One family's table (built in or from a file) checked and made a :class:`Mapping`."""
    if not isinstance(table, dict):
        raise CkptError(f"{where}: family {family!r} is not a table")
    config = table.get("config", {})
    if not isinstance(config, dict) or not all(isinstance(v, str) for v in config.values()):
        raise CkptError(f"{where}: {family}.config must map config.json fields to arg names")
    layer_rules = _rules(table.get("layer", {}), f"{where}: {family}.layer")
    requires = table.get("requires", {})
    if not isinstance(requires, dict) or not all(
        isinstance(v, str) and k in layer_rules and v in layer_rules for k, v in requires.items()
    ):
        raise CkptError(f"{where}: {family}.requires must map layer keys to layer keys of {family}.layer")
    types = table.get("model_types", [])
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise CkptError(f"{where}: {family}.model_types must be a list of strings")
    return Mapping(
        family,
        tuple(types),
        _rules(table.get("global", {}), f"{where}: {family}.global"),
        layer_rules,
        dict(config),
        _rules(table.get("mtp", {}), f"{where}: {family}.mtp"),
        _rules(table.get("mtp_shared", {}), f"{where}: {family}.mtp_shared"),
        dict(requires),
    )


def load_mapping_file(path: str | Path) -> dict[str, Mapping]:
    """The families of a ``--mapping`` TOML file (each a top-level table in the built-in tables' schema)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read the mapping file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise CkptError(f"{path}: the mapping file is not TOML ({exc})") from None
    if not doc:
        raise CkptError(f"{path}: the mapping file defines no family")
    return {name: mapping_from_table(name, table, str(path)) for name, table in doc.items()}


def builtin_mappings() -> dict[str, Mapping]:
    return {name: mapping_from_table(name, table, "built-in") for name, table in FAMILIES.items()}


def choose_mapping(mappings: dict[str, Mapping], config: dict[str, Any], family: str | None) -> Mapping:
    """The family ``--family`` names, else the one whose ``model_types`` has config.json's ``model_type``."""
    known = ", ".join(sorted(mappings))
    how = "pass --family NAME, or --mapping FILE with a table for it"
    if family is not None:
        if family not in mappings:
            raise CkptError(f"unknown family {family!r}; known families: {known}; {how}")
        return mappings[family]
    model_type = config.get("model_type")
    for mapping in mappings.values():
        if model_type in mapping.model_types:
            return mapping
    raise CkptError(f"config.json model_type {model_type!r} is not a family ckptdoctor knows ({known}); {how}")
