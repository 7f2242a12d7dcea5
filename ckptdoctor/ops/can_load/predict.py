"""``ckptdoctor can-load``: will Megatron load this checkpoint at another layout, and how (metadata only).

Models ``megatron/training/checkpointing.py: load_checkpoint`` and ``megatron/core/dist_checkpointing``
(core 0.19): what the loading run requests per section, then what the load does with it.

* rng: requested only when the saved (TP, PP) args equal the run's and neither ``--finetune`` nor
  ``--no-load-rng`` nor a saved ``no_save_rng``; otherwise ignored (never an error). A requested rng state whose
  per-rank objects are missing fails the load.
* rerun: requested only when the saved world size, (TP, PP) and DP args equal the run's (and not finetune), and
  the saved state passes ``validate_state_dict``.
* optimizer: requested unless ``--finetune``/``--no-load-optim``/saved ``no_save_optim``; when requested from a
  checkpoint without one, ``optimizer.load_state_dict`` raises KeyError 'optimizer'. Distributed optimizer
  formats, a (TP, PP) change and the expert param groups are in :mod:`ckptdoctor.ops.can_load.optim`.
* Keys: "unexpected" = requested but absent (``assume_ok_unexpected``: a KeyError for a tensor, "Missing key in
  checkpoint state_dict" for an object; ``raise_*``: raised before the load; ``log_*``/``ignore_all``: dropped,
  the param stays at its initial value, unless a dropped key is a SwiGLU ``linear_fc1`` factory, whose merge then
  fails); "missing" = saved but requested by no rank (``raise_all`` raises, ``log_all`` warns). Global shapes must
  be equal, except the vocabulary keys. ``return_*`` fails Megatron-LM itself (``load`` returns a tuple).
* rerun, in practice: every normal save holds ``NOT_RUNNING_YET``, which ``validate_state_dict`` declines.

Every rule is checked by a real megatron-core 0.19.2 load in tests/can_load_matrix.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ckptdoctor.args import args_as_dict
from ckptdoctor.checkpoint import Checkpoint, section_of
from ckptdoctor.data_files import storage_problems
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.formats import read_by_current_megatron
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.te_extra_state import (
    FORM_NONE,
    FORM_OTHER,
    NEWEST_MODELLED_TE,
    REFUSING_RELEASES,
    UNSAFE_PICKLE_ENV,
    format_te_version,
    refuses_pickled,
)
from ckptdoctor.ops.can_load.args import args_problem
from ckptdoctor.ops.can_load.keys import DROP_REDUNDANT_FLAG, DROP_REDUNDANT_SINCE, SWIGLU_FC1, KeyPlan, model_plan
from ckptdoctor.ops.can_load.optim import optimizer_verdict
from ckptdoctor.ops.can_load.run import Layout, LoadRun, parse_target, run_args, saved_layout
from ckptdoctor.ops.can_load.shapes import VOCAB_KEYS
from ckptdoctor.ops.can_load.verdict import CORRUPTS, FAILS, LOADS, RESHARDS, SKIPPED, SectionVerdict
from ckptdoctor.ops.pickle_gate import gate_failures
from ckptdoctor.parallelism import infer_layout
from ckptdoctor.problems import Problem
from ckptdoctor.rules.extra_state import census

SCHEMA = "ckptdoctor.can-load/1"
SECTION_ORDER = ("safety", "format", "data", "args", "common", "model", "extra_state", "optimizer", "rng", "rerun")
_RAISING = ("raise_unexpected", "raise_all")
_DROPPING = ("log_unexpected", "log_all", "ignore_all", "return_unexpected", "return_all")
UNEXPECTED_TITLE = "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict."
MISSING_TITLE = "Some keys found in the checkpoint are missing in the provided sharded state dict."


@dataclass
class CanLoadReport:
    schema: str
    path: str
    iteration_dir: str
    backend: str
    era: str | None
    saved: dict
    target: dict
    options: dict
    will_load: bool  # loads, and correctly: not with a failing or a corrupting section
    verdict: str  # loads / fails / corrupts (the load raises nothing but puts saved state on other parameters)
    failing_sections: list[str]  # the failing sections, else the corrupting ones
    sections: list[SectionVerdict]
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Context:
    ckpt: Checkpoint
    saved_args: dict[str, Any]
    args: dict[str, Any]
    saved: Layout
    target: Layout
    run: LoadRun
    common: dict[str, Any]
    warnings: list[str]

    @property
    def ckpt_tp_pp(self) -> tuple[int, int]:
        """What load_checkpoint compares: the saved args' (TP, PP), 1 where missing (not the chunk grids)."""
        return (
            _arg(self.saved_args, "tensor_model_parallel_size", 1),
            _arg(self.saved_args, "pipeline_model_parallel_size", 1),
        )

    @property
    def tp_pp_same(self) -> bool:
        return self.ckpt_tp_pp == (self.target.tp, self.target.pp)

    @property
    def sharding_same(self) -> bool:
        """load_checkpoint's test for the rerun state: world size, (TP, PP) and DP args (0 where missing)."""
        world, dp = _arg(self.saved_args, "world_size", 0), _arg(self.saved_args, "data_parallel_size", 0)
        return self.tp_pp_same and world == self.target.world and dp == self.target.dp

    @property
    def mismatch_msg(self) -> str:
        run = (self.target.tp, self.target.pp)
        return f"(TP, PP) mismatch after resume ({run} vs {self.ckpt_tp_pp} from checkpoint)"


def _arg(args: dict[str, Any], name: str, default: int) -> int:
    value = args.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _strictness_failure(section: str, plan: KeyPlan, strictness: str) -> SectionVerdict | None:
    """The failure the strictness mode makes of requested-but-absent keys (``plan.unexpected``)."""
    if not plan.unexpected:
        return None
    # Tensors are validated first (MCoreLoadPlanner.create_local_plan: shapes, then the allow_shape_mismatch
    # vocabulary keys), objects then by PyTorch DCP.
    first = min(
        plan.unexpected,
        key=lambda k: (k in plan.unexpected_objects or "_extra_state" in k, bool(VOCAB_KEYS.search(k)), k),
    )
    n = len(plan.unexpected)
    if strictness in _DROPPING:
        return None
    if strictness in _RAISING:
        error = f"CheckpointingException: {UNEXPECTED_TITLE} Unexpected keys (for this rank): {{{first!r}, ...}}"
    elif plan.unexpected_objects and first in plan.unexpected_objects:
        error = f"CheckpointException: Missing key in checkpoint state_dict: {plan.unexpected_objects[first]}."
    elif VOCAB_KEYS.search(first):  # looked up by _temporarily_bypass_shape_validation
        error = f"KeyError: {first!r}"
    else:
        error = f"KeyError: {first} from model not in state dict: [...]"
    return SectionVerdict(
        section,
        FAILS,
        f"the run requests {'at least ' if plan.unexpected_at_least else ''}{n} key{'s' if n != 1 else ''} the "
        f"checkpoint lacks (e.g. {first})",
        error,
        plan.fix or "make the loading run's model match the checkpoint (--set / --args-from), or convert it",
        len(plan.requested),
        len(plan.present),
    )


def _section_from_plan(section: str, plan: KeyPlan, ctx: _Context, changed: str | None) -> SectionVerdict:
    failure = plan.shape_failure or _strictness_failure(section, plan, ctx.run.strictness)
    if failure is not None:
        return failure
    factories = sorted(k for k in plan.unexpected if ctx.args.get("swiglu") and SWIGLU_FC1.search(k))
    if factories and ctx.run.strictness in _DROPPING:
        return SectionVerdict(
            section,
            FAILS,
            f"{ctx.run.strictness} drops the requested keys the checkpoint lacks, among them SwiGLU linear_fc1 "
            f"(a ShardedTensorFactory, e.g. {factories[0]}), whose merge then fails",
            "ValueError: Different dict keys encountered in `apply_factory_merges` (dict_keys([...]) vs "
            "dict_keys([...]))",
            plan.fix or "make the run request only what the checkpoint holds",
            len(plan.requested),
            len(plan.present),
        )
    if plan.unexpected:
        n = len(plan.unexpected)
        ctx.warnings.append(
            f"{section}: {n} requested key{'s' if n != 1 else ''} not in the checkpoint "
            f"(e.g. {sorted(plan.unexpected)[0]}) dropped under strictness {ctx.run.strictness}: "
            "left at their initial values"
        )
    if plan.ignored and ctx.run.strictness not in ("raise_all", "log_all"):
        n = len(plan.ignored)
        ctx.warnings.append(
            f"{section}: {n} saved key{'s' if n != 1 else ''} requested by no rank (e.g. {sorted(plan.ignored)[0]}: "
            f"the run's model lacks {'them' if n != 1 else 'it'}) not loaded, silently under strictness "
            f"{ctx.run.strictness}"
        )
    verdict = RESHARDS if changed or plan.reshards else LOADS
    same = "same TP, PP, EP and ETP" if ctx.args.get("num_experts") else "same TP and PP (no experts for EP and ETP)"
    why = plan.why or (f"resharded: {changed}" if changed else f"{same}: chunks read as saved")
    return SectionVerdict(section, verdict, why, requested=len(plan.requested), present=len(plan.present))


def _layout_change(ctx: _Context) -> str | None:
    # What cuts model tensors (DP and CP replicate them; EP and ETP cut experts only: nothing of a dense model).
    fields = ("tp", "pp", "ep", "etp") if ctx.args.get("num_experts") else ("tp", "pp")
    changes = [
        f"{f.upper()} {getattr(ctx.saved, f)}->{getattr(ctx.target, f)}"
        for f in fields
        if getattr(ctx.saved, f) != getattr(ctx.target, f)
    ]
    return ", ".join(changes) or None


def _rng_verdict(ctx: _Context) -> tuple[SectionVerdict, set[str]]:
    """(verdict, requested keys) for ``rng_state``."""
    present = {e.key for e in ctx.ckpt.section_entries("rng")}
    no_save = bool(ctx.saved_args.get("no_save_rng"))
    if ctx.ckpt.location.release:
        return SectionVerdict("rng", SKIPPED, "not requested (a release checkpoint)", present=len(present)), set()
    if ctx.run.finetune or ctx.run.no_load_rng:
        why = "--finetune" if ctx.run.finetune else "--no-load-rng"
        return SectionVerdict("rng", SKIPPED, f"not requested ({why})", present=len(present)), set()
    if not ctx.tp_pp_same:
        return SectionVerdict(
            "rng", SKIPPED, f"{ctx.mismatch_msg}: RNG state will be ignored", present=len(present)
        ), set()
    if no_save:
        why = "not requested: the checkpoint was saved with no_save_rng (load_checkpoint then ignores the rng state)"
        return SectionVerdict("rng", SKIPPED, why, present=len(present)), set()
    wanted = {
        f"rng_state/shard_{p}.{t}_{ctx.target.pp}.{ctx.target.tp}"
        for p in range(ctx.target.pp)
        for t in range(ctx.target.tp)
    }
    return _object_verdict(ctx, "rng", wanted, present, "--no-load-rng"), {"rng_state"}


def _rerun_verdict(ctx: _Context) -> tuple[SectionVerdict, set[str]]:
    present = {e.key for e in ctx.ckpt.section_entries("rerun")}
    machine = ctx.common.get("rerun_state_machine")
    if not machine:
        return SectionVerdict("rerun", SKIPPED, "no rerun state machine in the checkpoint", present=len(present)), set()
    if _rerun_state(machine) == 0:
        why = "the saved rerun state is NOT_RUNNING_YET: validate_state_dict declines it, nothing to restore"
        return SectionVerdict("rerun", SKIPPED, why, present=len(present)), set()
    if ctx.run.finetune or ctx.ckpt.location.release:
        why = "not requested (--finetune)" if ctx.run.finetune else "not requested (a release checkpoint)"
        return SectionVerdict("rerun", SKIPPED, why, present=len(present)), set()
    if not ctx.sharding_same:
        why = "Job sharding has changed: Rerun state will be ignored"
        return SectionVerdict("rerun", SKIPPED, why, present=len(present)), set()
    world = ctx.target.world
    wanted = {f"rerun_state_machine_state/shard_{r}_{world}" for r in range(world)}
    return _object_verdict(ctx, "rerun", wanted, present, "--finetune"), {"rerun_state_machine_state"}


def _rerun_state(machine: Any) -> int | None:
    """The saved ``RerunState`` value (a stand-in enum read without megatron), None if unknown."""
    state = machine.get("state") if isinstance(machine, dict) else None
    value = getattr(state, "value", None)
    args = getattr(state, "stand_in_args", None)
    if value is None and isinstance(args, tuple):
        value = args[0] if args else None
    return value if isinstance(value, int) else None


def _object_verdict(ctx: _Context, section: str, wanted: set[str], present: set[str], fix: str) -> SectionVerdict:
    absent = sorted(wanted - present)
    if absent and ctx.run.strictness not in _DROPPING:
        return SectionVerdict(
            section,
            FAILS,
            f"{len(absent)} of the {len(wanted)} per-rank objects the run requests are not saved",
            f"CheckpointException: Missing key in checkpoint state_dict: {absent[0]}.",
            fix,
            len(wanted),
            len(present),
        )
    return SectionVerdict(
        section,
        LOADS,
        "the per-rank objects the run requests are all saved",
        requested=len(wanted),
        present=len(present),
    )


def _args_verdict(ctx: _Context) -> SectionVerdict:
    problem = args_problem(ctx.saved_args, ctx.args, ctx.run.finetune, ctx.run.use_checkpoint_args)
    if problem is None:
        return SectionVerdict("args", LOADS, "the run's args validate at the target layout")
    return SectionVerdict("args", FAILS, problem.why, problem.error, problem.fix)


def safety_verdict(ckpt: Checkpoint) -> SectionVerdict | None:
    """Fails where the gate fails on anything the load reads (``.metadata``, the common state, the sharded objects,
    Bridge's files): the load would run code, whatever else it does."""
    failures = gate_failures(ckpt)
    if not failures:
        return None
    first = failures[0]
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return SectionVerdict(
        "safety",
        FAILS,
        f"unsafe: loading runs code: {first.path}: {first.code} {first.message}{more}",
        None,
        "do not load it; `ckptdoctor check` lists every finding (--trust-global MODULE.NAME for a global you know)",
    )


def lost_data(ckpt: Checkpoint) -> list[Problem]:
    """Chunks ``.metadata`` places in data files that are missing, unreadable or too short, or places nowhere
    (``check``'s CKD112-CKD114): read once per checkpoint, from the files' sizes."""
    return [problem for problem in storage_problems(ckpt)[0] if problem.fatal]


def _read_lost(lost: list[Problem], unread: set[str]) -> list[Problem]:
    """The problems whose lost chunks a run that does not read the sections ``unread`` still reads."""
    return [p for p in lost if not p.lost or any(section_of(c.key) not in unread for c in p.lost)]


def lost_whatever_the_flags(lost: list[Problem]) -> bool:
    """Whether chunks are lost that every run reads (the model's, the common state's...): no load flag helps."""
    return bool(_read_lost(lost, {"optimizer", "rng"}))


def _data_verdict(ctx: _Context, lost: list[Problem]) -> SectionVerdict | None:
    """Fails where a chunk the run reads is gone: torch's reader raises on the missing file or the short read,
    whatever the layout. Lost chunks only of sections the run does not read (the optimizer's with
    --no-load-optim or --finetune, the RNG state's with --no-load-rng or --finetune) are a warning."""
    if not lost:
        return None
    unread = set()
    if ctx.run.no_load_optim or ctx.run.finetune:
        unread.add("optimizer")
    if ctx.run.no_load_rng or ctx.run.finetune:
        unread.add("rng")
    read = _read_lost(lost, unread)
    if not read:
        ctx.warnings += [f"{p.path}: {p.detail} (not read by this run)" for p in lost]
        return None
    first = read[0]
    more = f" (and {len(read) - 1} more file(s))" if len(read) > 1 else ""
    return SectionVerdict(
        "data",
        FAILS,
        f"{first.code}: {first.path}: {first.detail}{more}",
        None,
        "restore the lost files from where the save was copied (`ckptdoctor check` lists every lost chunk; a copy "
        "still running? wait for it)",
    )


def _format_verdict(ctx: _Context) -> SectionVerdict | None:
    if not read_by_current_megatron(ctx.ckpt.location.backend):
        where = ctx.ckpt.iteration_dir / ".metadata"
        return SectionVerdict(
            "format",
            FAILS,
            "legacy zarr backend: megatron-core >= 0.16 reads only torch_dist (zarr support was removed)",
            f"AssertionError: metadata is None; global metadata read failed: [Errno 2] No such file or "
            f"directory: '{where}'",
            "load it with megatron-core <= 0.15 (tensorstore) and save it again as torch_dist",
        )
    return None


@dataclass
class SavedCheckpoint:
    """What a prediction reads from the checkpoint once, whatever the target (``--suggest`` predicts many)."""

    ckpt: Checkpoint
    safety: SectionVerdict | None
    common: dict[str, Any]
    saved_args: dict[str, Any]
    saved: Layout
    experts: bool  # an MoE checkpoint (saved num_experts, or expert chunks)
    model_args: dict[str, Any] | None = None  # --args-from
    # Transformer Engine _extra_state items (those TE wrote; read once): what the refusing TE releases refuse, and
    # how many
    te_refused: list[str] = field(default_factory=list)
    te_items: int = 0
    lost: list[Problem] = field(default_factory=list)  # lost_data: chunks whose bytes are gone


def read_saved(ckpt: Checkpoint, model_args: dict[str, Any] | None = None) -> SavedCheckpoint:
    safety = safety_verdict(ckpt)
    try:
        common = ckpt.common_state()
    except (UnsafePickleError, PickleLimitError, ArchiveError):
        if safety is None:
            raise
        common = {}  # refused by the gate: the safety section says so, the rest is predicted without it
    saved_args = args_as_dict(common.get("args"))
    layout = infer_layout(ckpt)
    experts = bool(_arg(saved_args, "num_experts", 0)) or layout.ep is not None
    saved = saved_layout(saved_args, layout.tp, layout.pp, layout.ep, layout.etp if experts else None)
    te_states = [i for i in census(ckpt) if i.state is not None and i.state.form not in (FORM_NONE, FORM_OTHER)]
    refused = [i.key for i in te_states if i.state is not None and i.state.te_2_18 == "refuse"]
    return SavedCheckpoint(
        ckpt, safety, common, saved_args, saved, experts, model_args, refused, len(te_states), lost_data(ckpt)
    )


def _delayed_fp8(args: dict[str, Any]) -> bool:
    """The run trains in FP8 with delayed scaling (Megatron's --fp8-recipe defaults to delayed): its modules' extra
    state is persistent, so --ckpt-drop-redundant-extra-state still requests it."""
    return bool(args.get("fp8")) and (args.get("fp8_recipe") or "delayed") == "delayed"


def _extra_state_verdict(state: SavedCheckpoint, run: LoadRun, local: bool = False) -> SectionVerdict | None:
    """Transformer Engine's ``set_extra_state`` on the saved items (only where TE wrote some): TE 2.16.1, 2.17.1 and
    >= 2.18 refuse pickled delayed-scaling state and TE 1.x BytesIO state unless
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1."""
    if not state.te_items:
        return None
    items = state.te_items
    if local:
        why = (
            f"the {items} saved _extra_state items are not requested: {DROP_REDUNDANT_FLAG} keeps a module's extra "
            "state local where the run's recipe saves no delayed-scaling state, so TE reads none of them"
        )
        return SectionVerdict("extra_state", LOADS, why, requested=0, present=items)
    version = run.te_version or NEWEST_MODELLED_TE
    shown = format_te_version(version)
    refused = state.te_refused
    if not refused or not refuses_pickled(version):
        why = f"TE {shown} loads the {items} Transformer Engine _extra_state items"
        if refused:  # an upgrade to a refusing release would fail: say so while it still loads
            why += (
                f" ({len(refused)} of them pickled states that {REFUSING_RELEASES} refuse without "
                f"{UNSAFE_PICKLE_ENV}=1)"
            )
        return SectionVerdict("extra_state", LOADS, why, requested=items, present=items)
    if run.te_unsafe_pickle:
        why = (
            f"TE {shown} unpickles {len(refused)} of the {items} _extra_state items because {UNSAFE_PICKLE_ENV}=1 "
            "(check's gate has read every global in them)"
        )
        return SectionVerdict("extra_state", LOADS, why, requested=items, present=items)
    examples = ", ".join(refused[:3]) + (f" and {len(refused) - 3} more" if len(refused) > 3 else "")
    return SectionVerdict(
        "extra_state",
        FAILS,
        f"TE {shown} refuses {len(refused)} of the {state.te_items} _extra_state items (pickled delayed-scaling "
        f"state or TE 1.x BytesIO): {examples}",
        "RuntimeError: Refusing to load pickled Transformer Engine extra state for <module>. ... To load it "
        f"anyway, set {UNSAFE_PICKLE_ENV}=1.",
        f"set {UNSAFE_PICKLE_ENV}=1 for a checkpoint you trust (--te-unsafe-pickle here), or drop the state: "
        f"ckptdoctor edit {state.ckpt.iteration_dir} --drop-extra-state -o OUT",
        requested=items,
        present=items,
    )


def predict(
    ckpt: Checkpoint, target_spec: str, run: LoadRun, model_args: dict[str, Any] | None = None
) -> CanLoadReport:
    state = read_saved(ckpt, model_args)
    return predict_at(state, parse_target(target_spec, state.saved, state.experts), run)


def predict_at(state: SavedCheckpoint, target: Layout, run: LoadRun) -> CanLoadReport:
    """The prediction at ``target`` (a layout :func:`parse_target` made) for the loading run ``run``."""
    ckpt, safety, common, saved_args = state.ckpt, state.safety, state.common, state.saved_args
    saved, model_args = state.saved, state.model_args
    args = run_args(saved_args, model_args, target, run)
    ctx = _Context(ckpt, saved_args, args, saved, target, run, common, [])
    base = {**saved_args, **(model_args or {})}
    _check_set_types(run.sets, base)
    ctx.warnings += [
        f"--set {name}: not an arg of the checkpoint (a new arg, or a typo?)" for name in run.sets if name not in base
    ]
    if state.experts and target.tp > 1 and not args.get("sequence_parallel"):
        # megatron-core's MoELayer.forward, not the load: nothing at load time says so
        ctx.warnings.append(
            f"MoE at TP={target.tp} without sequence parallelism: the load is not affected, but the first training "
            "step raises (MoELayer: ValueError: During training, performance may degrade if MoE and tensor "
            "parallelismare enabled without also enabling sequence parallelism.); launch with --sequence-parallel "
            "(--set sequence_parallel=true here)"
        )
    sections: list[SectionVerdict] = [safety] if safety is not None else []
    fmt = _format_verdict(ctx)
    if fmt is not None:
        sections.append(fmt)
    data = _data_verdict(ctx, state.lost)
    if data is not None:
        sections.append(data)
    sections.append(_args_verdict(ctx))
    if run.strictness.startswith("return_"):
        sections.append(
            SectionVerdict(
                "common",
                FAILS,
                f"with {run.strictness}, dist_checkpointing.load returns (state_dict, missing_keys, unexpected_keys); "
                "Megatron-LM's load_checkpoint reads it as the state dict",
                "AttributeError: 'tuple' object has no attribute 'get'",
                "--strictness log_unexpected or log_all (log instead of return the mismatches)",
            )
        )
    changed = _layout_change(ctx)
    local = run.drop_redundant_extra_state and not _delayed_fp8(args)
    vocab_set = bool(run.sets and "padded_vocab_size" in run.sets)
    plan = model_plan(ckpt, saved_args, args, saved.tp, target.tp, vocab_set, local)
    sections.append(_section_from_plan("model", plan, ctx, changed))
    if plan.absent_extra_state and local:
        ctx.warnings.append(
            f"model: {len(plan.absent_extra_state)} module(s) without a saved _extra_state (e.g. "
            f"{plan.absent_extra_state[0]}) load under {DROP_REDUNDANT_FLAG} without a dropping strictness: the run "
            f"does not request non-persistent extra state ({DROP_REDUNDANT_SINCE})"
        )
    extra_state = _extra_state_verdict(state, run, local)
    if extra_state is not None:
        sections.append(extra_state)
    compare = replace(saved, tp=ctx.ckpt_tp_pp[0], pp=ctx.ckpt_tp_pp[1])
    optim, optim_plan = optimizer_verdict(ctx.ckpt, ctx.saved_args, ctx.args, compare, target, run, common, plan)
    if optim is None and optim_plan is not None:
        optim = _section_from_plan("optimizer", optim_plan, ctx, changed)
    requested = set(plan.requested) | (set(optim_plan.requested) if optim_plan else set())
    if optim is not None:
        sections.append(optim)
    rng, rng_keys = _rng_verdict(ctx)
    rerun, rerun_keys = _rerun_verdict(ctx)
    sections += [rng, rerun]
    requested |= rng_keys | rerun_keys
    _missing_keys(ctx, sections, requested)
    sections.sort(key=lambda s: SECTION_ORDER.index(s.section))
    failing = [s.section for s in sections if s.verdict == FAILS]
    corrupting = [s.section for s in sections if s.verdict == CORRUPTS]
    return CanLoadReport(
        schema=SCHEMA,
        path=str(ckpt.location.input_path),
        iteration_dir=str(ckpt.iteration_dir),
        backend=ckpt.location.backend,
        era=ckpt.location.era,
        saved={**_layout_dict(saved), "source": _saved_source(saved_args, saved)},
        target=_layout_dict(target),
        options=run.report_options(bool(args.get("use_distributed_optimizer"))),
        will_load=not failing and not corrupting,
        verdict=FAILS if failing else CORRUPTS if corrupting else LOADS,
        failing_sections=failing or corrupting,
        sections=sections,
        warnings=ctx.warnings,
    )


def _missing_keys(ctx: _Context, sections: list[SectionVerdict], requested: set[str]) -> None:
    """``*_all`` strictness: saved keys that no rank requests (the common state excluded)."""
    if ctx.run.strictness not in ("raise_all", "log_all"):
        return
    by_section: dict[str, list[str]] = {}
    for entry in ctx.ckpt.entries.values():
        if entry.section in ("common", "other"):
            continue
        key = entry.key.split("/shard_", 1)[0] if entry.kind == "bytes" else entry.key
        if key not in requested:
            by_section.setdefault(entry.section, []).append(key)
    if not by_section:
        return
    if ctx.run.strictness == "log_all":
        n = sum(len(set(v)) for v in by_section.values())
        ctx.warnings.append(f"{n} saved keys requested by no rank are logged (strictness log_all)")
        return
    for verdict in sections:
        keys = sorted(set(by_section.get(verdict.section, ())))
        if keys and verdict.verdict != FAILS:
            verdict.verdict = FAILS
            verdict.why = f"{len(keys)} saved key(s) requested by no rank, e.g. {keys[0]} (strictness raise_all)"
            verdict.error = (
                f"CheckpointingException: {MISSING_TITLE} Missing keys (for all ranks): {{{keys[0]!r}, ...}}"
            )
            verdict.fix = "--strictness log_all (or assume_ok_unexpected, the default), which ignores unrequested keys"


def _accepted_types(saved: Any) -> tuple[type, ...] | None:
    """The value types a ``--set`` of an arg saved as ``saved`` may take (None: not checked)."""
    if isinstance(saved, bool):
        return (bool,)
    if isinstance(saved, int):
        return (int,)
    if isinstance(saved, float):
        return (int, float)
    return (str,) if isinstance(saved, str) else None


# Model sizes: a tensor dimension or a divisor in Megatron's args, never zero or negative; the first three have no
# default (Megatron-LM's validate_args asserts them)
_POSITIVE_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "padded_vocab_size",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "seq_length",
    "max_position_embeddings",
)
_REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


def _check_set_types(sets: dict[str, Any], base: dict[str, Any]) -> None:
    """A ``--set`` value of another type than the saved arg's (``num_layers=abc``): Megatron-LM's argparse refuses
    it at launch, so it is a usage error here, not a prediction reasoned from it. None (Megatron's default) and an
    int for a float arg pass, except where a model size must be a positive int (``hidden_size=-32``,
    ``num_layers=None``)."""
    for name, value in sets.items():
        saved = base.get(name)
        kinds = _accepted_types(saved)
        if (
            kinds is not None
            and value is not None
            and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds))
        ):
            what = {(bool,): "a bool", (int,): "an int", (int, float): "a float", (str,): "a string"}[kinds]
            raise CkptError(
                f"--set {name}={value!r}: the saved {name} is {what} ({saved!r}); give a value of that type"
            )
        if name in _POSITIVE_ARGS and value is not None and (type(value) is not int or value <= 0):
            raise CkptError(
                f"--set {name}={value!r}: a model size, a positive integer (Megatron sizes or divides by it)"
            )
        if name in _REQUIRED_ARGS and value is None:
            raise CkptError(f"--set {name}=None: Megatron-LM requires {name} (it has no default)")


def _saved_source(saved_args: dict[str, Any], saved: Layout) -> str:
    if not saved_args:
        return "chunk grids"
    expert_args = {
        "ep": saved_args.get("expert_model_parallel_size"),
        "etp": saved_args.get("expert_tensor_parallel_size"),
    }
    if any(value is not None and value != getattr(saved, name) for name, value in expert_args.items()):
        return "args, expert layout from the chunk grids"  # the args disagree with the chunks (check: CKD203/CKD205)
    return "args"


def _layout_dict(layout: Layout) -> dict[str, int]:
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "etp": layout.etp,
        "cp": layout.cp,
        "dp": layout.dp,
        "world": layout.world,
    }
