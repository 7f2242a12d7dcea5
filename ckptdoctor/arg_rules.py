"""The rule table for args derived from a checkpoint's parallelism (shared by fix-args, diff and check).

Converters (``tools/checkpoint/convert.py``) copy every source arg not in their keep-list, so a re-sharded
checkpoint can carry the source's parallelism-derived values. Each rule below is one arg: what it derives
from, how its correct value follows from the checkpoint's real layout, and the validation megatron-core
applies (``megatron/core/model_parallel_config.py: resolve_tensor_parallel_weight_shards``).

Adding an arg is adding an entry to :data:`RULES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptdoctor.parallelism import SavedLayout
from ckptdoctor.severity import ERROR, WARNING


@dataclass(frozen=True)
class ArgFinding:
    """One saved arg that contradicts the checkpoint's own parallelism."""

    code: str  # stable rule code, e.g. CKD201 (shared with `ckptdoctor check`)
    arg: str
    saved: Any
    correct: Any
    severity: str
    reason: str
    megatron_error: str | None = None  # the exact error megatron-core would raise, if any
    inherited: bool | None = None  # set by compare_with_source: the wrong value equals the source's


@dataclass(frozen=True)
class Target:
    """The parallelism a checkpoint really has: its layout where the chunks show it, else its args."""

    tp: int
    pp: int
    etp: int
    ep: int | None
    has_experts: bool


@dataclass(frozen=True)
class Rule:
    code: str
    arg: str
    derives_from: str
    description: str
    check: Callable[[dict[str, Any], Target], ArgFinding | None]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def target_parallelism(args: dict[str, Any], layout: SavedLayout | None) -> Target:
    """The real TP/PP/ETP: chunk grids win over args (args may be inherited from a source)."""
    tp = (layout.tp if layout and layout.tp else None) or _int(args.get("tensor_model_parallel_size")) or 1
    pp = (layout.pp if layout and layout.pp else None) or _int(args.get("pipeline_model_parallel_size")) or 1
    has_experts = bool(layout and layout.ep) or bool(_int(args.get("num_experts")))
    etp = layout.etp if layout and layout.etp else _int(args.get("expert_tensor_parallel_size"))
    if etp is None or not has_experts:
        # megatron-core: expert_tensor_parallel_size defaults to tensor_model_parallel_size; without experts
        # nothing but that default can have produced a saved value.
        etp = tp
    return Target(tp=tp, pp=pp, etp=etp, ep=layout.ep if layout else None, has_experts=has_experts)


def _parallel_size_rule(code: str, arg: str, attr: str, what: str) -> Rule:
    def check(args: dict[str, Any], target: Target) -> ArgFinding | None:
        saved = _int(args.get(arg))
        correct = getattr(target, attr)
        if saved is None or correct is None or saved == correct:
            return None
        return ArgFinding(
            code, arg, saved, correct, WARNING, f"args say {arg}={saved} but the saved chunks show {what}={correct}"
        )

    return Rule(code, arg, "chunk layout", f"{arg} must match the {what} the chunk grids show", check)


def _expert_tp_rule() -> Rule:
    arg = "expert_tensor_parallel_size"

    def check(args: dict[str, Any], target: Target) -> ArgFinding | None:
        saved = _int(args.get(arg))
        if saved is None or saved == target.etp:
            return None
        if target.has_experts:
            # tools/checkpoint savers keep the target's TP, PP and EP but copy this arg from the source.
            return ArgFinding(
                "CKD203",
                arg,
                saved,
                target.etp,
                WARNING,
                f"args say {arg}={saved} but the expert tensors' chunks show ETP={target.etp} ("
                + ("experts saved whole" if target.etp == 1 else f"each expert cut {target.etp} ways")
                + ")",
            )
        return ArgFinding(
            "CKD203",
            arg,
            saved,
            target.tp,
            WARNING,
            f"no experts in this checkpoint, so {arg} can only be megatron's default "
            f"(tensor_model_parallel_size={target.tp}), not {saved}",
        )

    return Rule(
        "CKD203",
        arg,
        "expert chunk layout (without experts: tensor_model_parallel_size)",
        "expert_tensor_parallel_size must match the ETP the expert chunks show; without experts it defaults to "
        "tensor_model_parallel_size",
        check,
    )


def _expert_parallel_rule() -> Rule:
    arg = "expert_model_parallel_size"

    def check(args: dict[str, Any], target: Target) -> ArgFinding | None:
        saved = _int(args.get(arg))
        if saved is None or target.ep is None or saved == target.ep:
            return None
        return ArgFinding(
            "CKD205",
            arg,
            saved,
            target.ep,
            WARNING,
            f"args say {arg}={saved} but the expert tensors' chunks show EP={target.ep}",
        )

    return Rule("CKD205", arg, "expert chunk layout", f"{arg} must match the EP the expert chunks show", check)


def _shards_rules(
    code_shards: str, code_remat: str, shards_field: str, remat_field: str, tp_field: str, tp_attr: str
) -> list[Rule]:
    """The GTP weight-shard pair. ``shards_field`` is the knob (``--tensor-parallel-num-weight-shards``) and
    ``remat_field`` is derived from it (``shards // tp``; no flag), so a real save holds them consistent at its
    TP. tools/checkpoint savers copy both from the source while the TP changes: the saved remat is then the
    source's GTP intent, and the shards that keep it at the real TP are ``tp x remat``. Keeping the saved shards
    instead would either fail validation (fewer than TP) or turn on GTP weight remat the source never ran
    (``shards // tp`` > 1 also divides the data-parallel size)."""

    def saved_remat(args: dict[str, Any]) -> int:
        remat = _int(args.get(remat_field))
        return remat if remat is not None and remat > 0 else 1

    def megatron_error(shards: int, tp: int) -> str | None:
        """The ValueError megatron-core's resolve_tensor_parallel_weight_shards raises, if any."""
        if shards < tp:
            return f"{shards_field} ({shards}) must be >= {tp_field} ({tp})."
        if shards % tp:
            return f"{shards_field} ({shards}) must be divisible by {tp_field} ({tp})."
        return None

    def check_shards(args: dict[str, Any], target: Target) -> ArgFinding | None:
        if shards_field not in args:
            return None
        saved = args[shards_field]
        tp = getattr(target, tp_attr)
        if saved is None:
            return None  # megatron derives it: tp * remat
        remat = saved_remat(args)
        correct = tp * remat
        shards = _int(saved)
        if shards is None:
            return ArgFinding(code_shards, shards_field, saved, correct, ERROR, f"{shards_field} is not an int")
        if shards == correct:
            return None
        # What megatron-core sees is the saved tp_field (ETP defaults to TP), which may itself be wrong.
        saved_tp = _int(args.get(tp_field)) or _int(args.get("tensor_model_parallel_size")) or 1
        error = megatron_error(shards, saved_tp)
        if error is not None:
            severity, why = ERROR, f"{shards_field}={shards} is invalid at {tp_field}={tp}"
        elif megatron_error(shards, tp) is not None:
            severity, why = (
                WARNING,
                f"{shards_field}={shards} is invalid at the corrected {tp_field}={tp} (saved: {saved_tp})",
            )
        else:
            severity, why = (
                WARNING,
                (
                    f"{shards_field}={shards} at {tp_field}={tp} makes megatron derive {remat_field}={shards // tp} "
                    f"(GTP weight remat) where the saved one is {remat}; {tp} x {remat} = {correct} keeps it"
                ),
            )
        return ArgFinding(code_shards, shards_field, saved, correct, severity, why, error)

    def check_remat(args: dict[str, Any], target: Target) -> ArgFinding | None:
        if remat_field not in args or args[remat_field] is None:
            return None
        saved = args[remat_field]
        remat = _int(saved)
        if remat is not None and remat > 0:
            return None
        if args.get(shards_field) is None:  # megatron takes the shards from it: tp x remat
            severity, why = (
                ERROR,
                (
                    f"{remat_field}={saved!r} with {shards_field} None: megatron derives the shards as "
                    f"{tp_field} x {remat_field}; without GTP it is 1"
                ),
            )
        else:
            severity, why = (
                WARNING,
                (
                    f"{remat_field} must be a positive int (megatron derives it again from {shards_field}; "
                    "without GTP: 1)"
                ),
            )
        return ArgFinding(code_remat, remat_field, saved, 1, severity, why)

    return [
        Rule(
            code_shards,
            shards_field,
            f"{tp_field} x {remat_field}",
            f"{shards_field} must be None or {tp_field} x {remat_field} (the saved GTP weight remat at the real "
            f"{tp_field})",
            check_shards,
        ),
        Rule(code_remat, remat_field, shards_field, f"{remat_field} must be a positive int", check_remat),
    ]


RULES: list[Rule] = [
    _parallel_size_rule("CKD201", "tensor_model_parallel_size", "tp", "TP"),
    _parallel_size_rule("CKD202", "pipeline_model_parallel_size", "pp", "PP"),
    _expert_tp_rule(),
    _expert_parallel_rule(),
    *_shards_rules(
        "CKD210",
        "CKD211",
        "tensor_parallel_num_weight_shards",
        "gtp_weight_remat_size",
        "tensor_model_parallel_size",
        "tp",
    ),
    *_shards_rules(
        "CKD212",
        "CKD213",
        "expert_tensor_parallel_num_weight_shards",
        "expert_gtp_weight_remat_size",
        "expert_tensor_parallel_size",
        "etp",
    ),
]


def _world_findings(args: dict[str, Any], target: Target) -> list[ArgFinding]:
    world = _int(args.get("world_size"))
    dp = _int(args.get("data_parallel_size"))
    cp = _int(args.get("context_parallel_size")) or 1
    model_parallel = target.tp * target.pp * cp
    if world is None:
        return []
    if world % model_parallel:
        # With data_parallel_size saved, the world size is pinned: TP x PP x CP x DP.
        correct = model_parallel * dp if dp is not None and dp > 0 else None
        derived = f"; TP x PP x CP x DP = {correct}" if correct is not None else ""
        return [
            ArgFinding(
                "CKD204",
                "world_size",
                world,
                correct,
                WARNING,
                f"world_size={world} is not a multiple of TP x PP x CP = {model_parallel}{derived}",
            )
        ]
    if dp is not None and dp != world // model_parallel:
        return [
            ArgFinding(
                "CKD204",
                "data_parallel_size",
                dp,
                world // model_parallel,
                WARNING,
                f"data_parallel_size must be world_size / (TP x PP x CP) = {world // model_parallel}",
            )
        ]
    return []


def check_args(args: dict[str, Any], layout: SavedLayout | None) -> list[ArgFinding]:
    """Every saved arg that contradicts the checkpoint's real parallelism, in rule order."""
    if not args:
        return []
    target = target_parallelism(args, layout)
    findings = [f for rule in RULES if (f := rule.check(args, target)) is not None]
    return findings + _world_findings(args, target)


def compare_with_source(findings: list[ArgFinding], source_args: dict[str, Any]) -> list[ArgFinding]:
    """Mark findings whose wrong value equals the source checkpoint's value: inherited by a converter."""
    from dataclasses import replace

    return [replace(f, inherited=f.arg in source_args and source_args[f.arg] == f.saved) for f in findings]
