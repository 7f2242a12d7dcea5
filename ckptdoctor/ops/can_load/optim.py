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

from ckptdoctor.ops.can_load.keys import KeyPlan, logical
from ckptdoctor.ops.can_load.verdict import CORRUPTS, FAILS, SKIPPED, SectionVerdict
from ckptdoctor.optimizer_keys import chain_prefix, is_bucket_key, is_distributed_key, unchained

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


# The args that decide which layers a pipeline rank holds at a given PP (Megatron-LM's uneven split).
PIPELINE_SPLIT_ARGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _buckets_regrouped(
    saved_args: dict[str, Any], args: dict[str, Any], run: LoadRun, target: Layout
) -> tuple[str, str] | None:
    """(what changes, the fix) where the run, at the saved TP and PP, holds other layers on a rank or in a model
    chunk than the save did: another virtual pipeline size (the run's comes from its launch flags,
    --num-virtual-stages-per-pipeline-rank, never the checkpoint), or at PP > 1 another uneven split."""
    value = saved_args.get("virtual_pipeline_model_parallel_size")
    saved_vpp = value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1
    if run.virtual_stages is not None and run.virtual_stages != saved_vpp:
        return (
            f"virtual pipeline stages {saved_vpp}->{run.virtual_stages}",
            f"--num-virtual-stages-per-pipeline-rank {saved_vpp} as saved",
        )
    if target.pp > 1 and _stage_layers(saved_args, target.pp) != _stage_layers(args, target.pp):
        for name in PIPELINE_SPLIT_ARGS:
            old, new = saved_args.get(name), args.get(name)
            if old != new and (old or new):  # None, False and 0 alike: Megatron's default
                return f"{name} {old}->{new}", f"keep {name}={old} as saved"
    return None


def _stage_layers(args: dict[str, Any], pp: int) -> tuple[Any, ...]:
    """The transformer layers of each pipeline stage as ``args`` split them (TransformerConfig's uneven split: the
    first/last stage's set apart, the rest even), or the split args themselves where a layout string or the
    embedding/loss accounting decides it."""
    if any(args.get(name) for name in PIPELINE_SPLIT_ARGS[2:]):
        return tuple(args.get(name) for name in PIPELINE_SPLIT_ARGS)
    first, last = args.get("decoder_first_pipeline_num_layers"), args.get("decoder_last_pipeline_num_layers")
    layers = args.get("num_layers")
    if not isinstance(layers, int) or not all(v is None or isinstance(v, int) for v in (first, last)):
        return (layers, first, last)
    middle = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle <= 0 or rest % middle:
        return (layers, first, last)  # a split megatron refuses at startup (args section)
    stages = [rest // middle] * middle
    return tuple(([first] if first is not None else []) + stages + ([last] if last is not None else []))


def _expert_groups(layout: Layout) -> bool:
    return layout.ep > 1 or layout.etp != layout.tp


def _expert_buckets(present: dict[str, Any], saved: Layout, target: Layout) -> SectionVerdict | None:
    """The failure of an MoE model's dp_reshardable buckets at a target of other expert groups, else None.

    With separate expert param groups (EP > 1 or ETP != TP) megatron-core builds a ChainedOptimizer of the dense and
    the expert optimizer and saves their buckets as ``chained_0.``/``chained_1.optimizer.distributed.*``; one
    optimizer saves and requests them unprefixed. A bucket holds the rank's own parameters, flattened: the expert
    buckets hold its local experts (num_experts / EP, each cut ETP ways), so they only load at the saved EP and
    ETP (across expert DP they reshard like any bucket)."""
    saved_keys = [k for k in present if is_bucket_key(k)]
    if not saved_keys:
        return None
    chained = {chain_prefix(k) for k in saved_keys} - {""}
    if bool(chained) != _expert_groups(target):
        shown = saved_keys[0]
        requested = unchained(shown) if chained else f"chained_0.{shown}"
        return SectionVerdict(
            "optimizer",
            FAILS,
            "the dp_reshardable buckets are saved by "
            + (
                f"a chained optimizer ({', '.join(c.rstrip('.') for c in sorted(chained))}: dense, experts)"
                if chained
                else "one optimizer"
            )
            + f" and the run (EP {target.ep}, ETP {target.etp}, TP {target.tp}) builds "
            + ("one: it requests them unprefixed" if chained else "a chained one: it requests chained_<i>. keys"),
            f'KeyError: "{requested} from model not in state dict: [...]"',
            "--no-load-optim, or keep EP and ETP as saved",
            present=len(present),
        )
    if chained and (saved.ep, saved.etp) != (target.ep, target.etp):
        expert_keys = sorted(k for k in saved_keys if chain_prefix(k) != "chained_0.") or sorted(saved_keys)
        if saved.ep * saved.etp == target.ep * target.etp:
            return _expert_buckets_misplaced(expert_keys, saved, target, len(present))
        return SectionVerdict(
            "optimizer",
            FAILS,
            "the expert optimizer's dp_reshardable buckets hold each rank's local experts: "
            f"EP {saved.ep}->{target.ep}, ETP {saved.etp}->{target.etp} changes their size",
            f"CheckpointingException: Global shape mismatch for loaded (...) and expected (...) tensor for key "
            f"{expert_keys[0]}",
            "--no-load-optim, or keep EP and ETP as saved (the buckets reshard across data parallel only)",
            present=len(present),
        )
    return None


def _expert_buckets_misplaced(expert_keys: list[str], saved: Layout, target: Layout, present: int) -> SectionVerdict:
    """EP x ETP kept (EP 1->2 with ETP 2->1, ...): each rank holds as many expert elements as saved (every local
    expert parameter starts 64-element aligned: whole multiples here), so the expert buckets keep their keys and
    sizes and megatron-core, which checks nothing more, copies the saved flat ranges over the run's own local
    experts: other experts, or other slices of them. The model section's load then restores fp32 parameters (the
    main params are views of them), not the separate fp32 main params of a bf16/fp16 model."""
    buckets = {k.split(".bucket_idx_", 1)[1].split(".", 1)[0] for k in expert_keys if ".bucket_idx_" in k}
    boundaries = (
        ""
        if len(buckets) <= 1
        else " (where the run's buckets end at other parameters than the saved ones, the load raises a Global "
        "shape mismatch instead)"
    )
    return SectionVerdict(
        "optimizer",
        CORRUPTS,
        f"the expert optimizer's dp_reshardable buckets hold each rank's local experts, flattened: EP "
        f"{saved.ep}->{target.ep}, ETP {saved.etp}->{target.etp} keeps their size (EP x ETP = "
        f"{target.ep * target.etp}), so the load raises nothing and puts the saved Adam moments and fp32 main "
        "params on other experts or other slices of them; the first step then writes those main params into the "
        f"weights of a bf16/fp16 model{boundaries}",
        None,  # megatron raises nothing
        "--no-load-optim (a fresh optimizer), or resume at the saved EP and ETP and save with "
        "--dist-ckpt-optim-fully-reshardable (optimizer state per parameter, any layout)",
        present=present,
    )


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
    regrouped = _buckets_regrouped(saved_args, args, run, target)
    if distributed and kind == "dp_reshardable" and regrouped and any(is_bucket_key(k) for k in present):
        shown = sorted(k for k in present if is_bucket_key(k))[0]
        return SectionVerdict(
            "optimizer",
            FAILS,
            "the distributed optimizer's dp_reshardable buckets hold each rank's layers, flattened, one buffer per "
            f"model chunk (gbuf_idx_<chunk>); with {regrouped[0]} they hold other layers",
            f"CheckpointingException: Global shape mismatch for loaded (...) and expected (...) tensor for key {shown}",
            f"--no-load-optim (fresh optimizer), or {regrouped[1]}",
            present=len(present),
        ), None
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
        buckets = _expert_buckets(present, saved, target)
        if buckets is not None:
            return buckets, None
    if has_experts and _expert_groups(saved) != _expert_groups(target):
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
        plan.reshards = saved.dp != target.dp
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
    plan.fix = plan.fix or (
        "--no-load-optim, or load with the optimizer the checkpoint was saved with "
        f"(--{'no-' if distributed else ''}use-distributed-optimizer)"
    )
    return None, plan
