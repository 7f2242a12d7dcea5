"""Args checks of a loading run: what fails at startup (before any load) and after the load.

Startup, in the order a Megatron-LM launch meets them: the ``fix-args`` rule table (:mod:`ckptdoctor.arg_rules`,
megatron-core's ``resolve_tensor_parallel_weight_shards``) evaluated at the target layout, ``validate_args``'s
layout checks (world size by TP x PP x CP, EP only with experts), ``initialize_model_parallel``'s (world size by
EP x ETP x PP, dense models too), and the divisibility checks of ``TransformerConfig.__post_init__``,
``TransformerBlock`` and ``MoELayer``. After the load (not with
``--finetune``): Megatron-LM's ``check_checkpoint_args``, which compares num_layers, hidden_size and
num_attention_heads with the saved ones.

Adding a startup check is adding a :class:`StartupCheck` to :data:`STARTUP_CHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptdoctor.arg_rules import ERROR, check_args

VIRTUAL_STAGES_ARG = "num_virtual_stages_per_pipeline_rank"  # the run's --num-virtual-stages-per-pipeline-rank


def _int(args: dict[str, Any], name: str, default: int = 0) -> int:
    value = args.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class StartupCheck:
    """One validation megatron runs while building the model: ``fails(args)`` -> megatron's error or None."""

    args: tuple[str, ...]  # the args a --set can fix
    fails: Callable[[dict[str, Any]], str | None]
    fix: str | None = None  # default: choose a target layout that divides the args
    why: str = "the model cannot be built at the target layout"


def _remat(args: dict[str, Any], shards: str, remat: str, tp: int) -> int:
    """The GTP weight remat size megatron resolves (``resolve_tensor_parallel_weight_shards``): shards // TP where
    the shards are set (the saved ones under --use-checkpoint-args, or a --set), else the remat arg."""
    value = _int(args, shards)
    if value and tp and value >= tp and value % tp == 0:
        return value // tp
    return max(1, _int(args, remat, 1))


def _world(args: dict[str, Any]) -> str | None:
    """Megatron-LM ``validate_args``: the world size is a multiple of TP x PP x CP (x the GTP remat size)."""
    world, tp = _int(args, "world_size"), _int(args, "tensor_model_parallel_size", 1)
    size = tp * _int(args, "pipeline_model_parallel_size", 1)
    size *= _int(args, "context_parallel_size", 1)
    size *= _remat(args, "tensor_parallel_num_weight_shards", "gtp_weight_remat_size", tp)
    if world and world % size:
        return f"AssertionError: world size ({world}) is not divisible by total_model_size (total_model_size={size})"
    return None


def _context_parallel_seq(args: dict[str, Any]) -> str | None:
    """Megatron-LM ``validate_args``: with CP > 1 the sequence splits into 2 x CP chunks."""
    seq, cp = _int(args, "seq_length"), _int(args, "context_parallel_size", 1)
    if seq and cp > 1 and seq % (2 * cp):
        return (
            "AssertionError: seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1."
        )
    return None


def _ep_without_experts(args: dict[str, Any]) -> str | None:
    """Megatron-LM ``validate_args``: EP > 1 needs experts (num_experts 0 reads as None)."""
    if _int(args, "expert_model_parallel_size", 1) > 1 and not _int(args, "num_experts"):
        return "AssertionError: num_experts must be non None to use expert model parallelism"
    return None


def _expert_world(args: dict[str, Any]) -> str | None:
    """megatron-core ``initialize_model_parallel`` (dense models too): the world size is a multiple of
    ETP x EP x PP (x the expert GTP remat size); ETP is TP where the run sets none."""
    world, tp = _int(args, "world_size"), _int(args, "tensor_model_parallel_size", 1)
    etp = _int(args, "expert_tensor_parallel_size", tp)
    size = etp * _int(args, "expert_model_parallel_size", 1) * _int(args, "pipeline_model_parallel_size", 1)
    size *= _remat(args, "expert_tensor_parallel_num_weight_shards", "expert_gtp_weight_remat_size", etp)
    if world and world % size:
        return (
            f"RuntimeError: world_size ({world}) is not divisible by expert_tensor_model_pipeline_parallel size "
            f"({size})"
        )
    return None


def _heads(args: dict[str, Any]) -> str | None:
    heads, tp = _int(args, "num_attention_heads"), _int(args, "tensor_model_parallel_size", 1)
    if heads and heads % tp:
        return f"ValueError: num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp})."
    return None


def _groups(args: dict[str, Any]) -> str | None:
    tp = _int(args, "tensor_model_parallel_size", 1)
    groups = _int(args, "num_query_groups") if args.get("group_query_attention") else 0
    groups = groups or _int(args, "num_attention_heads")
    if groups and groups % tp and tp % groups:
        return (
            f"ValueError: num_query_groups ({groups}) must be a multiple or divisor of "
            f"tensor_model_parallel_size ({tp})."
        )
    return None


def _layers(args: dict[str, Any]) -> str | None:
    layers, pp = _int(args, "num_layers"), _int(args, "pipeline_model_parallel_size", 1)
    uneven = args.get("decoder_first_pipeline_num_layers") or args.get("pipeline_model_parallel_layout")
    if layers and layers % pp and not uneven:
        return f"AssertionError: num_layers={layers} should be divisible by config.pipeline_model_parallel_size={pp}"
    return None


def _uneven_pipeline(args: dict[str, Any]) -> str | None:
    """``TransformerConfig.__post_init__`` (uneven PP): the first/last stage's layers are set apart, the rest
    must split evenly over the middle stages (none left when there are no middle stages)."""
    first, last = args.get("decoder_first_pipeline_num_layers"), args.get("decoder_last_pipeline_num_layers")
    if (first is None and last is None) or args.get("pipeline_model_parallel_layout"):
        return None
    layers, pp = _int(args, "num_layers"), _int(args, "pipeline_model_parallel_size", 1)
    for name, value in (("first", first), ("last", last)):
        if value is None:
            continue
        if not isinstance(value, int) or value <= 0:
            return f"ValueError: num_layers_in_{name}_pipeline_stage must be larger than 0"
        layers, pp = layers - value, pp - 1
    if bool(layers) != bool(pp):
        return f"ValueError: Mismatch: {layers} middle layers remaining but {pp} middle PP stages available."
    if pp and layers % pp:
        return (
            f"ValueError: number of layers at middle stage: {layers} must be divisible by"
            f"the middle pipeline model parallel size {pp}"
        )
    return None


def _mlp_split(args: dict[str, Any]) -> str | None:
    """megatron-core's parallel linears (``ensure_divisibility``): an MLP's fc1 rows (2 x FFN with SwiGLU) and fc2
    columns (FFN) split over their TP: the dense layers' and the shared expert's over TP, the experts' over ETP."""
    tp = _int(args, "tensor_model_parallel_size", 1)
    etp = _int(args, "expert_tensor_parallel_size", tp) or tp
    gated = 2 if args.get("swiglu") else 1
    experts = _int(args, "num_experts")
    pattern = args.get("moe_layer_freq")
    dense = not experts or (isinstance(pattern, list) and 0 in pattern)
    ffn = _int(args, "ffn_hidden_size")
    splits = [(ffn, tp)] if dense else []
    if experts:
        splits += [
            (_int(args, "moe_ffn_hidden_size") or ffn, etp),
            (_int(args, "moe_shared_expert_intermediate_size"), tp),
        ]
    for size, parts in splits:
        for numerator in (gated * size, size):
            if numerator and parts and numerator % parts:
                return f"AssertionError: {numerator} is not divisible by {parts}"
    return None


def _virtual_pipeline(args: dict[str, Any]) -> str | None:
    """--num-virtual-stages-per-pipeline-rank: Megatron-LM ``validate_args`` needs PP > 1 (> 2 without p2p
    overlap), ``TransformerBlock`` a rank's layers divisible by the virtual stages."""
    vpp, pp = _int(args, VIRTUAL_STAGES_ARG), _int(args, "pipeline_model_parallel_size", 1)
    if vpp <= 1:
        return None
    overlap = args.get("overlap_p2p_comm", True) is not False
    if pp <= (1 if overlap else 2):
        if overlap:
            return (
                "AssertionError: When interleaved schedule is used, pipeline-model-parallel size should be greater "
                "than 1"
            )
        return (
            "AssertionError: When interleaved schedule is used and p2p communication overlap is disabled, "
            "pipeline-model-parallel size should be greater than 2 to avoid having multiple p2p sends and recvs "
            "between same 2 ranks per communication batch"
        )
    layers = _int(args, "num_layers")
    uneven = args.get("decoder_first_pipeline_num_layers") or args.get("decoder_last_pipeline_num_layers")
    if layers and not uneven and layers % pp == 0 and (layers // pp) % vpp:
        return f"AssertionError: num_layers_per_pipeline_rank {layers // pp} should be divisible by vp_size {vpp}"
    return None


def _experts(args: dict[str, Any]) -> str | None:
    experts, ep = _int(args, "num_experts"), _int(args, "expert_model_parallel_size", 1)
    if experts and experts % ep:
        return f"AssertionError (MoELayer: num_moe_experts {experts} % expert_model_parallel_size {ep} != 0)"
    return None


def _moe_pattern(args: dict[str, Any]) -> str | None:
    pattern, layers = args.get("moe_layer_freq"), _int(args, "num_layers")
    if isinstance(pattern, list) and layers and len(pattern) != layers:
        return (
            f"AssertionError: Invalid length of moe_layer_pattern: {len(pattern)}, expected {layers}, "
            f"current moe layer pattern: {pattern}"
        )
    return None


_LAYOUT_REFUSED = "megatron refuses the target layout at startup"
STARTUP_CHECKS: list[StartupCheck] = [
    StartupCheck(
        (), _world, "a --target world=N that TP x PP x CP divides (or dp=N)", "validate_args: " + _LAYOUT_REFUSED
    ),
    StartupCheck(
        ("seq_length",),
        _context_parallel_seq,
        "a --target cp=N whose 2 x N divides seq_length",
        "validate_args: the sequence does not split over context parallelism",
    ),
    StartupCheck(
        ("num_experts",),
        _ep_without_experts,
        "--target ep=1 (the model has no experts to spread)",
        "validate_args: expert parallelism without experts",
    ),
    StartupCheck(
        (),
        _expert_world,
        "a --target whose EP x ETP x PP divides the world size (etp=N, ep=N, dp=N or world=N)",
        "initialize_model_parallel: " + _LAYOUT_REFUSED,
    ),
    StartupCheck(("num_attention_heads",), _heads),
    StartupCheck(("num_query_groups",), _groups),
    StartupCheck(("num_layers",), _layers),
    StartupCheck(
        ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"),
        _mlp_split,
        "a --target tp=N / etp=N that divides the MLP sizes (the experts' over ETP)",
    ),
    StartupCheck(
        ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"),
        _uneven_pipeline,
        "a PP whose middle stages split the remaining layers evenly, or other "
        "--set decoder_first_pipeline_num_layers=N / decoder_last_pipeline_num_layers=N (null: an even split)",
    ),
    StartupCheck(
        (),
        _virtual_pipeline,
        "a --num-virtual-stages-per-pipeline-rank that divides each rank's layers, at a PP > 1",
    ),
    StartupCheck(("num_experts",), _experts),
    StartupCheck(
        ("moe_layer_freq",), _moe_pattern, "give moe_layer_freq one entry per layer (--set moe_layer_freq=[...])"
    ),
]
RESUME_COMPARED = ("num_layers", "hidden_size", "num_attention_heads")


@dataclass(frozen=True)
class ArgsProblem:
    why: str
    error: str
    fix: str


def args_problem(saved: dict[str, Any], args: dict[str, Any], finetune: bool, kept: bool) -> ArgsProblem | None:
    """The first args failure of the run, in the order megatron meets them; ``kept``: --use-checkpoint-args."""
    for finding in check_args(args, None):
        if finding.severity == ERROR and finding.megatron_error:
            fix = f"--set {finding.arg}={finding.correct}"
            return ArgsProblem(
                f"{finding.arg}={finding.saved!r} fails validation at the target layout",
                f"ValueError: {finding.megatron_error}",
                f"{fix}, or `ckptdoctor fix-args` the checkpoint" if kept else fix,
            )
    for check in STARTUP_CHECKS:
        error = check.fails(args)
        if error:
            return ArgsProblem(
                check.why,
                error,
                check.fix or f"choose a target layout that divides {', '.join(check.args)}",
            )
    if not finetune:
        for name in RESUME_COMPARED:
            old, new = saved.get(name), args.get(name)
            if old != new:
                return ArgsProblem(
                    f"check_checkpoint_args compares {name} after the load",
                    f"AssertionError: {name} value from checkpoint ({old}) is not equal to the input argument "
                    f"value ({new}).",
                    "--finetune (a new model shape is fine-tuning), or keep the saved value",
                )
    return None
