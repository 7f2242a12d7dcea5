"""Consistency rules (CKD2xx): do the args, the chunk grids and the keys agree with each other?

The parallelism-derived args rules are :data:`ckptdoctor.arg_rules.RULES` (shared with fix-args): they are
listed and run from that table, never re-implemented here. This module adds chunk coverage and orphan
``_extra_state`` items.
"""

from __future__ import annotations

from ckptdoctor import arg_rules
from ckptdoctor.args import saved_config
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.coverage import coverage_problems
from ckptdoctor.formats import BACKEND_DCP
from ckptdoctor.formats.plain_dcp import is_megatron
from ckptdoctor.formats.run_config import RUN_CONFIG
from ckptdoctor.formats.te_extra_state import module_family
from ckptdoctor.gpt_shapes import expected_shape
from ckptdoctor.parallelism import infer_layout
from ckptdoctor.rules import ERROR, WARNING, Finding, RuleInfo
from ckptdoctor.rules.structure import Scanned

_ARGS_RATIONALE = (
    "Converters (tools/checkpoint) copy every source arg not in their keep-list, so a re-sharded checkpoint "
    "can carry the source's value; megatron-core validates or silently recomputes it on load "
    "(model_parallel_config.resolve_tensor_parallel_weight_shards). `ckptdoctor fix-args` rewrites it. "
    "Derived from: {derives}."
)
VARIES = "error/warning"  # arg findings carry their own severity: error where megatron-core would refuse


def _arg_rule_info(rule: arg_rules.Rule) -> RuleInfo:
    return RuleInfo(
        rule.code,
        "arg-" + rule.arg.replace("_", "-"),
        "consistency",
        VARIES,
        rule.description,
        _ARGS_RATIONALE.format(derives=rule.derives_from),
    )


# CKD204 lives in arg_rules' world-size check, outside its per-arg table.
WORLD_SIZE = RuleInfo(
    "CKD204",
    "arg-world-size",
    "consistency",
    WARNING,
    "world_size must be a multiple of TP x PP x CP and data_parallel_size their quotient",
    _ARGS_RATIONALE.format(derives="tensor/pipeline/context_parallel_size"),
)
CHUNK_COVERAGE = RuleInfo(
    "CKD220",
    "chunk-coverage",
    "consistency",
    ERROR,
    "a tensor's chunks do not cover its global shape exactly once",
    "Every element of a saved tensor must come from exactly one chunk: a gap is data no rank saved (a rank's "
    "plan missing from .metadata), an overlap or an out-of-bounds chunk is a corrupt or badly merged index; "
    "DCP's load planner fails or reads garbage.",
)
ORPHAN_EXTRA_STATE = RuleInfo(
    "CKD221",
    "orphan-extra-state",
    "consistency",
    ERROR,
    "a model _extra_state item whose module has no saved weight",
    "Filters that drop weights (trainable-params-only saves, PEFT adapter filters) must drop the module's "
    "_extra_state too: a ShardedObject kept beside a dropped weight makes the load request and the checkpoint "
    "disagree and the load fails.",
)
LOCAL_SHARDS = RuleInfo(
    "CKD222",
    "dcp-local-shards",
    "consistency",
    ERROR,
    "a Megatron-LM plain DCP save holds a model tensor smaller than its saved args imply",
    "A torch_dcp / fsdp_dtensor save made from per-rank local tensors (TP > 1, which Megatron-LM's argument "
    "validation refuses for torch_dcp) stores every rank's shard under the same name; DCP keeps one of them and "
    "the other ranks' parts are lost, with nothing in .metadata to say so. The saved args give the whole shape.",
)

_ARG_INFOS = [_arg_rule_info(r) for r in arg_rules.RULES]
RULES = [*_ARG_INFOS, WORLD_SIZE, CHUNK_COVERAGE, ORPHAN_EXTRA_STATE, LOCAL_SHARDS]

# Modules that carry TE FP8 metadata (_extra_state) but no weights of their own.
_WEIGHTLESS_MODULES = ("core_attention",)


def check(state: Scanned) -> list[Finding]:
    checkpoint = state.checkpoint
    if checkpoint is None:
        return []
    findings = _check_args(state, checkpoint)
    shown = str(state.shown / ".metadata") if checkpoint.dcp is not None else str(state.shown)
    tensors = (entry for entry in checkpoint.entries.values() if entry.kind == "tensor" and entry.shape is not None)
    for entry, problem in coverage_problems(tensors):
        findings.append(Finding(CHUNK_COVERAGE.code, shown, f"{entry.key}: {problem}", ERROR))
    findings.extend(_orphan_extra_state(checkpoint, shown))
    findings.extend(_local_shards(state, checkpoint, shown))
    return findings


def _local_shards(state: Scanned, checkpoint: Checkpoint, shown: str) -> list[Finding]:
    """Model tensors of a Megatron-LM plain DCP save whose saved shape is smaller than the args imply."""
    if checkpoint.location.backend != BACKEND_DCP or not is_megatron(checkpoint.flavour) or state.common is None:
        return []
    args, _ = saved_config(state.common, checkpoint.iteration_dir)
    tp = args.get("tensor_model_parallel_size")
    out = []
    for entry in checkpoint.section_entries("model"):
        if entry.kind != "tensor" or entry.shape is None:
            continue
        implied = expected_shape(entry.key, args)
        if implied is None or len(implied) != len(entry.shape) or tuple(entry.shape) == implied:
            continue
        short = [d for d, (saved, whole) in enumerate(zip(entry.shape, implied)) if saved < whole]
        if not short:
            continue
        parts = ", ".join(f"dim {d}: {entry.shape[d]} of {implied[d]}" for d in short)
        out.append(
            Finding(
                LOCAL_SHARDS.code,
                shown,
                f"{entry.key}: saved shape {list(entry.shape)}, the args imply {list(implied)} ({parts}); one "
                f"rank's local shard, the rest is lost (tensor_model_parallel_size={tp})",
                ERROR,
            )
        )
    return out


def _check_args(state: Scanned, checkpoint: Checkpoint) -> list[Finding]:
    if state.common is None or not checkpoint.entries:
        return []  # no args to check, or no chunks to check them against
    args, where = saved_config(state.common, checkpoint.iteration_dir)
    path = str(state.common_path()) if where != RUN_CONFIG else str(state.shown / RUN_CONFIG)
    out = []
    for f in arg_rules.check_args(args, infer_layout(checkpoint)):
        text = f.reason if f.correct is None else f"{f.reason}; correct value: {f.correct!r}"
        if where == RUN_CONFIG:  # Megatron-Bridge: no args saved, its resume reads this file's model section
            text = f"model section (Megatron-Bridge's config; no args saved): {text}"
        if f.megatron_error:
            text += f"; megatron-core: {f.megatron_error}"
        out.append(Finding(f.code, path, text, f.severity))
    return out


def _orphan_extra_state(checkpoint: Checkpoint, shown: str) -> list[Finding]:
    modules_with_tensors = {
        e.key.rsplit(".", 1)[0]
        for e in checkpoint.entries.values()
        if e.kind == "tensor" and e.section == "model" and "." in e.key
    }
    out = []
    seen: set[str] = set()
    for entry in checkpoint.entries.values():
        if entry.section != "model" or not entry.is_extra_state or "._extra_state" not in entry.key:
            continue
        module = entry.key.split("._extra_state", 1)[0]
        if module in modules_with_tensors or module in seen or module.rsplit(".", 1)[-1] in _WEIGHTLESS_MODULES:
            continue
        seen.add(module)
        family = module_family(module)
        what = f" (a {family} in megatron-core's Transformer Engine spec)" if family else ""
        out.append(
            Finding(
                ORPHAN_EXTRA_STATE.code,
                shown,
                f"{entry.key}: _extra_state kept but no weight of {module}{what} is saved",
                ERROR,
            )
        )
    return out
