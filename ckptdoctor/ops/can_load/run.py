"""The loading run that ``can-load`` predicts for: its layout (``--target``), its load flags and its args.

A loading run is, by default, a fresh launch at the target layout whose model args equal the saved ones: the
layout args are the target's and the parallelism-derived args (GTP weight shards) are left to megatron, which
resolves them at the target TP. ``--use-checkpoint-args`` keeps every saved arg except the layout ones (what
``tools/checkpoint`` savers do: the saved GTP args then meet the new TP). ``--args-from`` takes the model args
from another checkpoint or a YAML file (a Megatron-Bridge ``run_config.yaml``: :mod:`.args_from`), ``--set``
changes single args.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.errors import CkptError

STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter")
TARGET_FIELDS = ("tp", "pp", "ep", "etp", "cp", "dp", "world")
MAX_TARGET = 10**9 - 1  # the largest value of a --target field (9 digits; Python refuses ints of over 4,300)
LAYOUT_ARGS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "cp": "context_parallel_size",
    "dp": "data_parallel_size",
    "world": "world_size",
}
# Parallelism-derived args a fresh launch leaves to megatron (resolved at the launch's TP / ETP).
DERIVED_DEFAULTS: dict[str, Any] = {
    "tensor_parallel_num_weight_shards": None,
    "gtp_weight_remat_size": 1,
    "expert_tensor_parallel_num_weight_shards": None,
    "expert_gtp_weight_remat_size": 1,
}
_TARGET_RE = re.compile(r"^\s*([a-z]+)\s*=\s*(\d+)\s*$")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    dp: int
    world_size: int | None = None  # a --target world=N that TP x PP x CP does not divide (megatron refuses it)

    @property
    def world(self) -> int:
        return self.world_size or self.tp * self.pp * self.cp * self.dp

    def summary(self) -> str:
        return f"TP={self.tp} PP={self.pp} EP={self.ep} ETP={self.etp} CP={self.cp} DP={self.dp} (world {self.world})"


@dataclass
class LoadRun:
    """What the loading run asks for (Megatron-LM's load flags), besides its layout and args."""

    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    strictness: str = "assume_ok_unexpected"
    use_distributed_optimizer: bool | None = None  # None: as saved
    dist_optim_sharding_type: str | None = None  # None: as the checkpoint's content metadata says
    use_checkpoint_args: bool = False
    sets: dict[str, Any] = field(default_factory=dict)
    te_version: tuple[int, int, int] | None = None  # Transformer Engine of the run (None: the newest modelled)
    te_unsafe_pickle: bool = False  # NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 in the run's environment
    drop_redundant_extra_state: bool = False  # Megatron-LM's --ckpt-drop-redundant-extra-state (PR #5552)
    virtual_stages: int | None = None  # --num-virtual-stages-per-pipeline-rank (1: no VPP; None: as saved)

    def report_options(self, use_distributed_optimizer: bool) -> dict[str, Any]:
        """The run's options as a can-load report gives them (``use_distributed_optimizer`` as the run resolves
        it: the saved args' unless set)."""
        return {
            "finetune": self.finetune,
            "no_load_optim": self.no_load_optim,
            "no_load_rng": self.no_load_rng,
            "strictness": self.strictness,
            "use_distributed_optimizer": use_distributed_optimizer,
            "dist_optim_sharding_type": self.dist_optim_sharding_type,
            "use_checkpoint_args": self.use_checkpoint_args,
            "set": dict(self.sets),
            "drop_redundant_extra_state": self.drop_redundant_extra_state,
            "virtual_stages": self.virtual_stages,
        }


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def saved_layout(
    args: dict[str, Any],
    chunk_tp: int | None,
    chunk_pp: int | None,
    chunk_ep: int | None = None,
    chunk_etp: int | None = None,
) -> Layout:
    """The layout Megatron compares against: the saved args (Megatron's default 1 where missing); the chunk grids
    only where the args say nothing. The expert layout (EP, ETP) is the chunks' where they show one: megatron
    compares neither arg with a run's, and tools/checkpoint savers copy ETP from their source."""
    tp = _int(args.get("tensor_model_parallel_size"), chunk_tp or 1)
    pp = _int(args.get("pipeline_model_parallel_size"), chunk_pp or 1)
    cp = _int(args.get("context_parallel_size"), 1)
    world = _int(args.get("world_size"), 0)
    dp = _int(args.get("data_parallel_size"), world // (tp * pp * cp) if world else 1)
    return Layout(
        tp=tp,
        pp=pp,
        ep=chunk_ep or _int(args.get("expert_model_parallel_size"), 1),
        etp=chunk_etp or _int(args.get("expert_tensor_parallel_size"), tp),
        cp=cp,
        dp=dp,
    )


def default_etp(saved: Layout, experts: bool, tp: int) -> int:
    """ETP of a run whose command line names none: its TP (Megatron-LM's default), unless an MoE checkpoint's
    experts were saved at an ETP other than TP (then that cut is kept, as an omitted EP is)."""
    return saved.etp if experts and saved.etp != saved.tp else tp


def parse_target(spec: str, saved: Layout, experts: bool = True) -> Layout:
    """``tp=4,pp=2[,ep=..,etp=..,cp=..,dp=..|world=..]``; omitted fields default to the saved layout, except ETP:
    the target TP (what Megatron-LM sets when its command line gives none: it never takes ETP from a checkpoint),
    unless ``experts`` were saved at an ETP other than TP (the experts' cut is kept, as an omitted EP is).
    Raises CkptError (exit 2) on a spec that names no layout; a layout megatron refuses (a world that TP x PP x CP
    or EP x ETP x PP does not divide) is returned: its failure is a prediction (section ``args``)."""
    values: dict[str, int] = {}
    for part in spec.split(","):
        match = _TARGET_RE.match(part)
        if not match:
            raise CkptError(f"--target: {part.strip()!r} is not NAME=N (names: {', '.join(TARGET_FIELDS)})")
        if len(match.group(2)) > len(str(MAX_TARGET)):  # no layout nears 10**9
            raise CkptError(f"--target: {match.group(1)}={match.group(2)[:12]}... is too large")
        name, number = match.group(1), int(match.group(2))
        if name not in TARGET_FIELDS:
            raise CkptError(f"--target: unknown field {name!r} (names: {', '.join(TARGET_FIELDS)})")
        if name in values:
            raise CkptError(f"--target: {name} given twice")
        if number < 1:
            raise CkptError(f"--target: {name} must be >= 1")
        values[name] = number
    if "dp" in values and "world" in values:
        raise CkptError("--target: give dp or world, not both")
    tp, pp, cp = values.get("tp", saved.tp), values.get("pp", saved.pp), values.get("cp", saved.cp)
    world_size = None
    if "world" in values:
        dp = max(1, values["world"] // (tp * pp * cp))
        if values["world"] % (tp * pp * cp):
            world_size = values["world"]  # validate_args refuses it (args section)
    else:
        dp = values.get("dp", saved.dp)
    etp = values.get("etp", default_etp(saved, experts, tp))
    return Layout(tp=tp, pp=pp, ep=values.get("ep", saved.ep), etp=etp, cp=cp, dp=dp, world_size=world_size)


def parse_value(text: str) -> Any:
    """A ``--set`` value: int, float, bool (true/false), None (none/null), else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null", "~"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_sets(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    sets: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
            raise CkptError(f"--set: {item!r} is not NAME=VALUE (an arg name as in args, e.g. num_layers=3)")
        name = name.strip()
        field_name = next((f for f, arg in LAYOUT_ARGS.items() if arg == name), None)
        if field_name is not None:
            raise CkptError(f"--set {name}: a layout arg; give it as --target {field_name}=N")
        sets[name] = parse_value(value)
    return sets


def run_args(saved: dict[str, Any], model_args: dict[str, Any] | None, target: Layout, run: LoadRun) -> dict:
    """The loading run's args (Megatron-LM names)."""
    args = dict(saved)
    if model_args:
        args.update({k: v for k, v in model_args.items() if k not in LAYOUT_ARGS.values()})
    if not run.use_checkpoint_args:
        args.update(DERIVED_DEFAULTS)
    for name, arg in LAYOUT_ARGS.items():
        args[arg] = getattr(target, name)
    args.update(finetune=run.finetune, no_load_optim=run.no_load_optim, no_load_rng=run.no_load_rng)
    args["dist_ckpt_strictness"] = run.strictness
    if run.use_distributed_optimizer is not None:
        args["use_distributed_optimizer"] = run.use_distributed_optimizer
    if run.virtual_stages is not None:  # a launch flag; Megatron-LM never reads it from the checkpoint
        args["num_virtual_stages_per_pipeline_rank"] = run.virtual_stages
    args.update(run.sets)
    return args


def target_spec(layout: Layout, saved: Layout, experts: bool) -> str:
    """The ``--target`` that :func:`parse_target` reads back as ``layout`` (every field it needs named; ETP and
    EP only where they can differ from what an omitted field gives: an MoE checkpoint, or an EP not the saved)."""
    fields = [("tp", layout.tp), ("pp", layout.pp)]
    if experts or layout.ep != saved.ep:
        fields.append(("ep", layout.ep))
    if experts:
        fields.append(("etp", layout.etp))
    fields += [("cp", layout.cp), ("dp", layout.dp)]
    return ",".join(f"{name}={value}" for name, value in fields)


def _flag_value(value: Any) -> str:
    """A ``--set`` value as :func:`parse_value` reads it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return value if isinstance(value, str) else repr(value)


def load_flags(run: LoadRun) -> list[str]:
    """The can-load flags (Megatron-LM's spelling) that describe ``run``: those not at their defaults."""
    flags = [
        f"--{name.replace('_', '-')}" for name in ("finetune", "no_load_optim", "no_load_rng") if getattr(run, name)
    ]
    if run.strictness != LoadRun.strictness:
        flags += ["--strictness", run.strictness]
    if run.use_distributed_optimizer is not None:
        flags.append(f"--{'' if run.use_distributed_optimizer else 'no-'}use-distributed-optimizer")
    if run.dist_optim_sharding_type:
        flags += ["--dist-optim-sharding-type", run.dist_optim_sharding_type]
    if run.use_checkpoint_args:
        flags.append("--use-checkpoint-args")
    for name, value in run.sets.items():
        flags += ["--set", f"{name}={_flag_value(value)}"]
    if run.te_version is not None:
        flags += ["--te-version", ".".join(str(part) for part in run.te_version)]
    if run.te_unsafe_pickle:
        flags.append("--te-unsafe-pickle")
    if run.drop_redundant_extra_state:
        flags.append("--ckpt-drop-redundant-extra-state")
    if run.virtual_stages is not None:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(run.virtual_stages)]
    return flags
