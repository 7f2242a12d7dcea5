"""Saved Megatron-LM args: grouping and plain-value views shared by inspect, diff, fix-args and check; and, for
Megatron-Bridge checkpoints (no args saved), their ``run_config.yaml`` model section in their place."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.run_config import RUN_CONFIG, model_config, read_run_config

ARG_GROUPS: dict[str, tuple[str, ...]] = {
    "parallelism": (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "sequence_parallel",
        "world_size",
        "data_parallel_size",
        "use_distributed_optimizer",
    ),
    "parallelism-derived": (
        "tensor_parallel_num_weight_shards",
        "gtp_weight_remat_size",
        "expert_tensor_parallel_num_weight_shards",
        "expert_gtp_weight_remat_size",
    ),
    "model shape": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "seq_length",
        "max_position_embeddings",
        "padded_vocab_size",
        "vocab_size",
        "num_experts",
        "moe_ffn_hidden_size",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "normalization",
        "position_embedding_type",
        "group_query_attention",
    ),
    "dtype and format": ("params_dtype", "bf16", "fp16", "fp8", "ckpt_format", "dist_ckpt_format"),
    "training": (
        "iteration",
        "train_iters",
        "lr",
        "min_lr",
        "micro_batch_size",
        "global_batch_size",
        "consumed_train_samples",
        "seed",
        "save",
        "load",
    ),
}
_GROUP_OF = {name: group for group, names in ARG_GROUPS.items() for name in names}


def arg_group(name: str) -> str:
    return _GROUP_OF.get(name, "other")


def args_as_dict(args: Any) -> dict[str, Any]:
    """The saved args as a dict, whether a real Namespace, a stand-in or a plain dict."""
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(args)
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    state = getattr(args, "stand_in_state", None)
    if isinstance(state, dict):
        return dict(state)
    return {}


def summarize_args(args: Any) -> dict[str, dict[str, Any]]:
    """The args inspect shows, by group; groups list only args the checkpoint saved."""
    values = args_as_dict(args)
    return {
        group: {name: values[name] for name in names if name in values}
        for group, names in ARG_GROUPS.items()
        if group != "training"
    }


def saved_config(common: dict | None, iteration_dir: object) -> tuple[dict[str, Any], str | None]:
    """The saved config the arg rules check, and where it is: Megatron-LM's ``args`` (``"args"``), else, where the
    common state holds none, Megatron-Bridge's ``run_config.yaml`` model section (``"run_config.yaml"``: Bridge's
    resume reads its parallel sizes), else ``({}, None)``. A run_config.yaml that cannot be read is none."""
    args = (common or {}).get("args")
    if isinstance(args, argparse.Namespace):
        return args_as_dict(args), "args"
    if not isinstance(iteration_dir, Path):
        return {}, None
    try:
        text = read_run_config(iteration_dir)
    except CkptError:
        return {}, None
    config = model_config(text) if text is not None else {}
    return (config, RUN_CONFIG) if config else ({}, None)
