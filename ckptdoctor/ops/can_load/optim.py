"""The optimizer section of a load (``load_checkpoint`` + ``megatron/core/optimizer``, core 0.19).

* Not requested with ``--finetune``, ``--no-load-optim`` or a saved ``no_save_optim``; but without the first
  two, ``optimizer.load_state_dict(state_dict['optimizer'])`` still runs and raises KeyError 'optimizer'.
* Distributed optimizer: the format is the checkpoint's ``content_metadata.distrib_optim_sharding_type``
  (older checkpoints: ``fully_sharded_model_space`` when saved with ``ckpt_fully_parallel_save``, else
  ``dp_zero_gather_scatter``). A (TP, PP) change raises unless the format is fully reshardable;
  ``dp_reshardable`` buckets (``optimizer.distributed.*``) then reshard across DP only (their unpadded numel
  is fixed by the model and TP/PP). A run without the distributed optimizer requests model-space
  ``optimizer.state.*`` keys, which a ``dp_reshardable`` checkpoint lacks (and the reverse); a
  ``fully_reshardable`` checkpoint has them, but its param groups (common state ``optimizer.optimizer``) match
  none of that run's ("Could not find parameter group with key ...").
* Experts get their own param groups (``is_expert_parallel``) only when EP > 1 or ETP != TP; a change of that
  makes the saved param groups unmatched ("Could not find parameter group with key ...").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptdoctor.ops.can_load.buckets import bucket_regrouping, expert_buckets, expert_groups
from ckptdoctor.ops.can_load.keys import KeyPlan, logical
from ckptdoctor.ops.can_load.verdict import FAILS, SKIPPED, SectionVerdict
from ckptdoctor.optimizer_keys import is_distributed_key

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint
    from ckptdoctor.ops.can_load.run import Layout, LoadRun

FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def sharding_type(common: dict[str, Any], saved_args: dict[str, Any], run: LoadRun) -> str:
    """The distributed-optimizer format the run builds its request in: the checkpoint's content metadata, else
    ``--dist-optim-sharding-type``, else megatron's defaults (``DistributedOptimizer.sharded_state_dict``:
    ``fully_sharded_model_space``; without content metadata, ``load_checkpoint``'s pre-0.13 fallback)."""
    content = common.get("content_metadata")
    if isinstance(content, dict) and content.get("distrib_optim_sharding_type"):
        return str(content["distrib_optim_sharding_type"])
    if run.dist_optim_sharding_type:
        return run.dist_optim_sharding_type
    if isinstance(content, dict):
        return "fully_sharded_model_space"
    return "fully_sharded_model_space" if saved_args.get("ckpt_fully_parallel_save") else "dp_zero_gather_scatter"


def optimizer_verdict(
    ckpt: Checkpoint,
    saved_args: dict[str, Any],
    args: dict[str, Any],
    saved: Layout,
    target: Layout,
    run: LoadRun,
    common: dict[str, Any],
    model: KeyPlan,
) -> tuple[SectionVerdict | None, KeyPlan | None]:
    """(a final verdict, None) or (None, the key plan whose strictness check decides)."""
    entries = ckpt.section_entries("optimizer")
    present = {logical(e.key, e.kind): tuple(e.shape) if e.shape else None for e in entries}
    if run.finetune or run.no_load_optim or ckpt.location.release:
        why = "--finetune" if run.finetune else "--no-load-optim" if run.no_load_optim else "a release checkpoint"
        why = f"not requested ({why})"
        return SectionVerdict("optimizer", SKIPPED, why, present=len(present)), None
    if saved_args.get("no_save_optim") or (not entries and "optimizer" not in common):
        return SectionVerdict(
            "optimizer",
            FAILS,
            "the checkpoint holds no optimizer state (saved with no_save_optim), and the run loads it",
            "KeyError: 'optimizer' (Unable to load optimizer from checkpoint. Specify --no-load-optim or "
            "--finetune to prevent attempting to load the optimizer state, exiting ...)",
            "--no-load-optim (or --finetune)",
            present=len(present),
        ), None
    distributed = bool(args.get("use_distributed_optimizer"))
    kind = sharding_type(common, saved_args, run)
    mismatch = f"(TP, PP) mismatch after resume ({(target.tp, target.pp)} vs {(saved.tp, saved.pp)} from checkpoint)"
    if distributed and (saved.tp, saved.pp) != (target.tp, target.pp) and kind not in FULLY_RESHARDABLE:
        return SectionVerdict(
            "optimizer",
            FAILS,
            f"the distributed optimizer's {kind} format cannot change TP/PP",
            f"RuntimeError: {mismatch}: not supported for DistributedOptimizer with sharding type {kind}. "
            "Please use `--ckpt-fully-parallel-save` flag during checkpoint saving.",
            "--no-load-optim (fresh optimizer), or resume at the saved TP/PP and save with "
            "--dist-ckpt-optim-fully-reshardable",
            present=len(present),
        ), None
    if distributed and kind == "dp_reshardable":
        regrouped = bucket_regrouping(present, saved_args, args, run, saved, target)
        if regrouped is not None:
            return regrouped, None
    if distributed and kind == "fully_sharded_model_space":
        return SectionVerdict(
            "optimizer",
            FAILS,
            "the distributed optimizer builds a fully_sharded_model_space request (the checkpoint names no other "
            "format), whose flattened ShardedTensors megatron-core 0.19 no longer supports",
            "CheckpointingException: ShardedTensor.flattened_range is not supported.",
            "--no-use-distributed-optimizer when the checkpoint was saved without it, else --no-load-optim",
            present=len(present),
        ), None
    saved_optim = common.get("optimizer")
    saved_kind = saved_optim.get("param_state_sharding_type") if isinstance(saved_optim, dict) else None
    if not distributed and saved_kind in FULLY_RESHARDABLE:
        return SectionVerdict(
            "optimizer",
            FAILS,
            f"the checkpoint's optimizer is the distributed optimizer's {saved_kind} format: its model-space "
            "tensors load, but its param groups sit under optimizer.optimizer, where a run without the "
            "distributed optimizer finds none to match its own",
            "ValueError: Could not find parameter group with key (...) in loaded checkpoint.",
            "--use-distributed-optimizer (the format reshards across TP/PP/DP), or --no-load-optim",
            present=len(present),
        ), None
    has_experts = bool(args.get("num_experts")) and bool(saved_args.get("num_experts"))
    if has_experts and distributed and kind == "dp_reshardable":
        buckets = expert_buckets(present, saved, target)
        if buckets is not None:
            return buckets, None
    if has_experts and expert_groups(saved) != expert_groups(target):
        return SectionVerdict(
            "optimizer",
            FAILS,
            "experts use separate param groups only when EP > 1 or ETP != TP: the saved param groups do not "
            f"match the run's (EP {saved.ep}->{target.ep}, ETP {saved.etp}->{target.etp})",
            "ValueError: Could not find parameter group with key (...) in loaded checkpoint.",
            "--no-load-optim, or keep EP > 1 (or EP = 1) as saved",
            present=len(present),
        ), None
    plan = KeyPlan(present=present)
    bucket_keys = [k for k in present if is_distributed_key(k)]  # a chained optimizer's too
    if distributed and bucket_keys and kind == "dp_reshardable":
        plan.requested = {k: present[k] for k in bucket_keys}
        # the distributed optimizer shards over DP x CP (the data-parallel group with context parallelism)
        plan.reshards = saved.dp * saved.cp != target.dp * target.cp
        plan.why = "dp_reshardable buckets resharded across DP" if plan.reshards else None
    else:
        model_keys = [k for k, shape in model.requested.items() if shape is not None and "_extra_state" not in k]
        saved_state = {k for k in present if k.startswith("optimizer.state.")}
        for key in model_keys:
            names = [f"optimizer.state.{m}.{key}" for m in _MOMENTS]
            if saved_state and not any(n in saved_state for n in names):
                continue  # a frozen param: no optimizer state saved for it
            for name in names:
                plan.requested[name] = model.requested[key]
                if name not in present:
                    plan.unexpected.add(name)
    if model.shape_failure is not None:
        failure = model.shape_failure
        plan.shape_failure = SectionVerdict(
            "optimizer", FAILS, "its state has the model's shapes: " + failure.why, failure.error, failure.fix
        )
    if not any(e.kind == "tensor" for e in entries):  # the state was dropped (a conversion, an edit): no run finds it
        plan.fix = plan.fix or (
            "--no-load-optim: the checkpoint holds no optimizer tensors (its common state still describes an "
            "optimizer), whichever optimizer the run builds"
        )
    plan.fix = plan.fix or (
        "--no-load-optim, or load with the optimizer the checkpoint was saved with "
        f"(--{'no-' if distributed else ''}use-distributed-optimizer)"
    )
    return None, plan
