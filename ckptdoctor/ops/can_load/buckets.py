"""The distributed optimizer's ``dp_reshardable`` buckets at a load (megatron-core 0.19 ``DistributedOptimizer``,
``DistributedDataParallel``): which layout and flag changes put other parameters in them.

A bucket is a flat range of one rank's parameters (``optimizer.distributed.dp_group_idx_<mp rank>.gbuf_idx_<buffer>
.dtype_(...).bucket_idx_<i>.{param,exp_avg,exp_avg_sq}``): one buffer per model chunk, cut into buckets where DDP
closes one, each saved at its unpadded size and resharded across DP only. Megatron-core checks nothing but each
bucket's size, so a run that fills the buckets otherwise fails a Global shape mismatch, or, where the sizes happen
to match (an MoE model's EP x ETP kept), loads the saved state onto other parameters without an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptdoctor.ops.can_load.verdict import CORRUPTS, FAILS, SectionVerdict
from ckptdoctor.optimizer_keys import chain_prefix, is_bucket_key, unchained

if TYPE_CHECKING:
    from ckptdoctor.ops.can_load.run import Layout, LoadRun


# The args that decide which layers a pipeline rank holds at a given PP (Megatron-LM's uneven split).
PIPELINE_SPLIT_ARGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def bucket_regrouping(
    present: dict[str, Any],
    saved_args: dict[str, Any],
    args: dict[str, Any],
    run: LoadRun,
    saved: Layout,
    target: Layout,
) -> SectionVerdict | None:
    """The failure of dp_reshardable buckets that the run, at the saved TP and PP, fills with other parameters,
    else None. A bucket is a flat range of a rank's parameters (one buffer per model chunk, ``gbuf_idx_<chunk>``,
    cut into buckets where DDP closes one), keyed by its index: megatron-core checks only its size."""
    keys = sorted(k for k in present if is_bucket_key(k))
    if not keys:
        return None
    change = _layers_change(saved_args, args, run, target) or _bucket_size_change(
        present, saved_args, args, saved, target
    )
    if change is None:
        return None
    what, fix = change
    return SectionVerdict(
        "optimizer",
        FAILS,
        f"the distributed optimizer's dp_reshardable buckets hold each rank's parameters, flattened, one buffer per "
        f"model chunk (gbuf_idx_<chunk>) cut into buckets: {what}",
        f"CheckpointingException: Global shape mismatch for loaded (...) and expected (...) tensor for key {keys[0]}",
        f"--no-load-optim (fresh optimizer), or {fix}",
        present=len(present),
    )


def _layers_change(
    saved_args: dict[str, Any], args: dict[str, Any], run: LoadRun, target: Layout
) -> tuple[str, str] | None:
    """(what changes, the fix) where the run holds other layers on a rank or in a model chunk than the save did:
    another virtual pipeline size (the run's comes from its launch flags, --num-virtual-stages-per-pipeline-rank,
    never the checkpoint), or at PP > 1 another uneven split."""
    value = saved_args.get("virtual_pipeline_model_parallel_size")
    saved_vpp = value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1
    if run.virtual_stages is not None and run.virtual_stages != saved_vpp:
        return (
            f"virtual pipeline stages {saved_vpp}->{run.virtual_stages} give each chunk other layers",
            f"--num-virtual-stages-per-pipeline-rank {saved_vpp} as saved",
        )
    if target.pp > 1 and _stage_layers(saved_args, target.pp) != _stage_layers(args, target.pp):
        for name in PIPELINE_SPLIT_ARGS:
            old, new = saved_args.get(name), args.get(name)
            if old != new and (old or new):  # None, False and 0 alike: Megatron's default
                return f"{name} {old}->{new} gives each rank other layers", f"keep {name}={old} as saved"
    return None


DEFAULT_BUCKET_ELEMENTS = 40_000_000  # DistributedDataParallel: max(40M, 1M x DP size) without --ddp-bucket-size


def _bucket_elements(args: dict[str, Any], dp: int) -> int | None:
    """Where DDP closes a bucket (elements), None for one bucket a buffer (no --overlap-grad-reduce)."""
    if not args.get("overlap_grad_reduce"):
        return None
    size = args.get("ddp_bucket_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    return max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp)


def _data_parallel(layout: Layout, expert: bool) -> int:
    """The data-parallel group a buffer is reduced over: DP x CP, or an expert buffer's expert DP."""
    if expert:
        return max(1, layout.world // max(1, layout.ep * layout.etp * layout.pp))
    return layout.dp * layout.cp


def _bucket_size_change(
    present: dict[str, Any], saved_args: dict[str, Any], args: dict[str, Any], saved: Layout, target: Layout
) -> tuple[str, str] | None:
    """(what changes, the fix) where the run closes buckets elsewhere: another --ddp-bucket-size or
    --overlap-grad-reduce, or without --ddp-bucket-size a DP past 40 that moves the default. A buffer saved in
    one bucket is cut again only where the run's size is below that bucket's elements."""
    buffers: dict[str, dict[int, int]] = {}  # buffer (key before .bucket_idx_) -> bucket index -> elements
    for key, shape in present.items():
        head, sep, tail = key.partition(".bucket_idx_")
        index = tail.split(".", 1)[0]
        if sep and is_bucket_key(key) and index.isdigit() and shape:
            buffers.setdefault(head, {})[int(index)] = int(shape[0])
    for head, sizes in sorted(buffers.items()):
        expert = chain_prefix(head) not in ("", "chained_0.")
        before = _bucket_elements(saved_args, _data_parallel(saved, expert))
        after = _bucket_elements(args, _data_parallel(target, expert))
        if before == after or (len(sizes) == 1 and (after is None or after >= max(sizes.values()))):
            continue
        shown = f"{_elements(before)}->{_elements(after)}"
        if not saved_args.get("overlap_grad_reduce"):
            fix = "the saved bucketing: no --overlap-grad-reduce"
        else:
            fix = f"the saved bucketing: --overlap-grad-reduce --ddp-bucket-size {before} (pinned at any DP)"
        return f"the run cuts them at another size ({shown}: --ddp-bucket-size, --overlap-grad-reduce, DP)", fix
    return None


def _elements(size: int | None) -> str:
    return "one bucket a buffer" if size is None else f"{size:,} elements"


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


def expert_groups(layout: Layout) -> bool:
    """Experts get their own param groups (a ChainedOptimizer with the distributed optimizer)."""
    return layout.ep > 1 or layout.etp != layout.tp


def expert_buckets(present: dict[str, Any], saved: Layout, target: Layout) -> SectionVerdict | None:
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
    if bool(chained) != expert_groups(target):
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
