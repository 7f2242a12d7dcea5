"""``can-load --suggest``: the layouts and load flags under which a checkpoint loads, fewest changes first.

Every candidate is a verdict of :func:`.predict.predict_at` (the one predictor), at a ``--target`` that
:func:`.run.parse_target` reads back as the same layout, so ``can-load CKPT --target SPEC FLAGS`` repeats it.

The candidates: every TP x PP x CP that divides the world size (DP is the rest; default world: the saved one),
and for an MoE checkpoint every EP and ETP that divide it. A layout megatron refuses at startup (the predictor's
args check: heads or query groups by TP, layers by PP or the uneven split, experts by EP, world by EP x ETP x PP,
the GTP rule table) is dropped before the rest is predicted. A layout that fails only in sections that load flags
change (model, optimizer, rng, rerun, common) is tried again with the flags that address a failing section, one
flag first, then two, ...: ``--no-load-rng`` (rng), ``--no-load-optim`` (optimizer), another ``--strictness``
(any key section); the first set that loads is its candidate (one per layout).

Order: by how little changes. Load flags alone (the saved layout) before any layout change; then layouts by how
many of TP, PP, CP, EP, ETP change (DP follows from the world size; an ETP kept as saved, or following TP as
megatron's default does, is no change); among those, fewest added flags first, then the nearest (the smallest
factor of change). The search is bounded (:data:`MAX_LAYOUTS` layouts, :data:`MAX_PREDICTIONS` predictions,
nearest first); the report says when it stopped early.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import combinations, product
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.ops.can_load.args import args_problem
from ckptdoctor.ops.can_load.predict import CanLoadReport, SavedCheckpoint, lost_whatever_the_flags, predict_at
from ckptdoctor.ops.can_load.run import (
    MAX_TARGET,
    Layout,
    LoadRun,
    default_etp,
    load_flags,
    parse_target,
    run_args,
    target_spec,
)

SCHEMA = "ckptdoctor.can-load/1"
ORDERING = (
    "ordered by how little changes: the saved layout (load flags only) first, then layouts that change one of "
    "TP, PP, CP, EP, ETP (DP is the rest of the world size), then two, ...; among those, fewest added load flags, "
    "then the nearest layout"
)
MAX_LAYOUTS = 20000  # layouts whose startup args are checked
MAX_PREDICTIONS = 2000  # full predictions (flag sets included)
# Sections whose verdict the load flags change; a failure elsewhere (safety, format, args) no flag fixes.
FLAG_SECTIONS = frozenset({"model", "optimizer", "rng", "rerun", "common", "data"})  # (data: see _flag_options)
KEY_SECTIONS = frozenset({"model", "optimizer", "rng", "rerun"})
# Strictness modes worth trying instead of the run's: return_* fails Megatron-LM itself, raise_all only adds failures.
OTHER_STRICTNESS = ("assume_ok_unexpected", "raise_unexpected", "log_unexpected", "log_all", "ignore_all")


@dataclass
class Suggestion:
    target: dict[str, int]
    spec: str  # the --target that repeats it
    flags: list[str]  # the load flags added to the run's
    changes: list[str]  # e.g. ["TP 2->1", "--no-load-optim"]; empty: as saved
    layout_changes: int
    flag_changes: int
    argv: list[str]  # can-load's arguments after CKPT that repeat this prediction
    sections: dict[str, str]  # section -> verdict
    warnings: list[str] = field(default_factory=list)


@dataclass
class SearchStats:
    layouts: int = 0  # layouts considered
    refused_at_startup: int = 0  # dropped by the args check
    predictions: int = 0
    complete: bool = True  # False: a bound stopped the search (nearer layouts were searched first)


@dataclass
class SuggestReport:
    schema: str
    path: str
    iteration_dir: str
    backend: str
    era: str | None
    saved: dict
    world_size: int
    world_source: str  # "saved" or "--world-size"
    options: dict  # the run's own load flags (as can-load --target reports them)
    ordering: str
    will_load: bool  # some candidate loads
    loading: int  # candidates found
    more: int  # found but not listed (--limit)
    suggestions: list[Suggestion]
    as_saved_failing: list[str]  # the saved layout's failing sections with the run's flags (empty: it loads)
    blocked: list[str]  # failing sections no layout or load flag changes (safety, format, data): nothing searched
    search: SearchStats


@dataclass(frozen=True)
class _Change:
    """A load flag added to the run: a LoadRun field and its new value."""

    name: str
    value: Any

    @property
    def flags(self) -> list[str]:
        return ["--strictness", self.value] if self.name == "strictness" else [f"--{self.name.replace('_', '-')}"]


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` (at most :data:`~.run.MAX_TARGET`: trial division to its root, 31,623 steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _changes(layout: Layout, saved: Layout, experts: bool) -> list[tuple[str, int, int]]:
    fields = ("tp", "pp", "cp", "ep", "etp") if experts else ("tp", "pp", "cp", "ep")
    out = []
    for name in fields:
        old, new = getattr(saved, name), getattr(layout, name)
        if name == "etp" and (new == old or (saved.etp == saved.tp and layout.etp == layout.tp)):
            continue  # kept, or following TP as it did
        if new != old:
            out.append((name, old, new))
    return out


def _distance(changes: list[tuple[str, int, int]]) -> float:
    return sum(abs(math.log2(new / old)) for _, old, new in changes)


def _kept_etps(saved: Layout, experts: bool, tp: int) -> list[int]:
    """The ETPs that are no change at ``tp``: the one Megatron picks when none is named, and for an MoE checkpoint
    the saved one too (a dense run's ETP is always its TP: --target names none)."""
    return sorted({saved.etp, default_etp(saved, experts, tp)}) if experts else [tp]


def _layouts(saved: Layout, experts: bool, world: int) -> Iterator[Layout]:
    """Every layout of ``world`` GPUs, by number of changed fields, then nearest first; at most
    :data:`MAX_LAYOUTS`."""
    divisors = _divisors(world)
    fields = ("tp", "pp", "cp", "ep", "etp") if experts else ("tp", "pp", "cp")
    generated = 0
    for count in range(len(fields) + 1):
        shell: list[tuple[float, tuple[int, ...], Layout]] = []
        for changed in combinations(fields, count):
            choices = [[d for d in divisors if d != getattr(saved, f)] if f in changed else [0] for f in fields]
            for values in product(*choices):
                picked = {f: v if f in changed else getattr(saved, f) for f, v in zip(fields, values, strict=True)}
                tp, pp, cp = picked["tp"], picked["pp"], picked["cp"]
                if world % (tp * pp * cp):
                    continue  # DP = world / (TP x PP x CP)
                etps = [picked["etp"]] if "etp" in changed else _kept_etps(saved, experts, tp)
                for etp in etps:
                    ep = picked.get("ep", saved.ep)
                    layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, dp=world // (tp * pp * cp))
                    changes = _changes(layout, saved, experts)
                    if len(changes) != count:
                        continue  # an ETP that is no change (kept, or following TP): in a smaller shell
                    shell.append((_distance(changes), (tp, pp, cp, ep, etp), layout))
                    generated += 1
                if generated >= MAX_LAYOUTS:
                    break
            if generated >= MAX_LAYOUTS:
                break
        shell.sort(key=lambda item: item[:2])
        yield from (layout for _, _, layout in shell)
        if generated >= MAX_LAYOUTS:
            return


def _flag_options(run: LoadRun, failing: list[str]) -> list[_Change]:
    """The flags that address a failing section, in the order they are tried."""
    options = []
    # (a data failure left to the flags lost chunks only of the optimizer's or the RNG state's: not reading them)
    if ("rng" in failing or "data" in failing) and not run.no_load_rng and not run.finetune:
        options.append(_Change("no_load_rng", True))
    if ("optimizer" in failing or "data" in failing) and not run.no_load_optim and not run.finetune:
        options.append(_Change("no_load_optim", True))
    if set(failing) & (KEY_SECTIONS | {"common"}):
        options += [_Change("strictness", s) for s in OTHER_STRICTNESS if s != run.strictness]
    return options


def _flag_sets(options: list[_Change]) -> Iterator[tuple[_Change, ...]]:
    for size in range(1, len(options) + 1):
        for chosen in combinations(options, size):
            if sum(c.name == "strictness" for c in chosen) <= 1:
                yield chosen


def _apply(run: LoadRun, changes: tuple[_Change, ...]) -> LoadRun:
    return replace(run, **{c.name: c.value for c in changes})


def suggest(
    state: SavedCheckpoint,
    run: LoadRun,
    world_size: int | None = None,
    limit: int = 10,
    extra_flags: tuple[str, ...] = (),
) -> SuggestReport:
    """The candidates that load, ordered by how little changes (``limit`` listed; 0: all). ``extra_flags``: flags
    of the run that :class:`LoadRun` does not hold (``--args-from PATH``), echoed in each candidate's argv."""
    saved, experts = state.saved, state.experts
    world = world_size or saved.world
    if world > MAX_TARGET:  # every candidate is a --target, whose fields stop there
        raise CkptError(f"--suggest: the saved world size {world:,} is past {MAX_TARGET:,}: give --world-size")
    stats = SearchStats()
    as_saved = predict_at(state, saved, run)
    found: list[tuple[tuple[Any, ...], Suggestion]] = []
    blocked = [  # no layout or load flag changes them
        s
        for s in as_saved.failing_sections
        if s in ("safety", "format") or (s == "data" and lost_whatever_the_flags(state.lost))
    ]
    if not blocked:
        for layout in _layouts(saved, experts, world):
            if stats.layouts >= MAX_LAYOUTS or stats.predictions >= MAX_PREDICTIONS:
                stats.complete = False
                break
            stats.layouts += 1
            spec = target_spec(layout, saved, experts)
            target = parse_target(spec, saved, experts)  # what `--target SPEC` gives: the same layout
            if _refused_at_startup(state, target, run):
                stats.refused_at_startup += 1
                continue
            hit = _first_loading(state, target, run, stats)
            if hit is not None:
                report, added = hit
                found.append(_suggestion(report, target, spec, added, state, run, extra_flags))
    if stats.layouts >= MAX_LAYOUTS:
        stats.complete = False
    found.sort(key=lambda item: item[0])
    listed = [s for _, s in (found if limit <= 0 else found[:limit])]
    return SuggestReport(
        schema=SCHEMA,
        path=as_saved.path,
        iteration_dir=as_saved.iteration_dir,
        backend=as_saved.backend,
        era=as_saved.era,
        saved=as_saved.saved,
        world_size=world,
        world_source="--world-size" if world_size else "saved",
        options=as_saved.options,
        ordering=ORDERING,
        will_load=bool(found),
        loading=len(found),
        more=len(found) - len(listed),
        suggestions=listed,
        as_saved_failing=as_saved.failing_sections,
        blocked=blocked,
        search=stats,
    )


def _refused_at_startup(state: SavedCheckpoint, target: Layout, run: LoadRun) -> bool:
    """The predictor's args check (what megatron refuses before any key is read): no load flag changes it, so the
    layout needs no full prediction."""
    args = run_args(state.saved_args, state.model_args, target, run)
    return args_problem(state.saved_args, args, run.finetune, run.use_checkpoint_args) is not None


def _first_loading(
    state: SavedCheckpoint, target: Layout, run: LoadRun, stats: SearchStats
) -> tuple[CanLoadReport, tuple[_Change, ...]] | None:
    """The prediction at ``target`` with the run's flags, else with the first flag set that makes it load."""
    report = predict_at(state, target, run)
    stats.predictions += 1
    if report.will_load:
        return report, ()
    if not set(report.failing_sections) <= FLAG_SECTIONS:
        return None
    for changes in _flag_sets(_flag_options(run, report.failing_sections)):
        if stats.predictions >= MAX_PREDICTIONS:
            stats.complete = False
            return None
        tried = predict_at(state, target, _apply(run, changes))
        stats.predictions += 1
        if tried.will_load:
            return tried, changes
    return None


def _suggestion(
    report: CanLoadReport,
    target: Layout,
    spec: str,
    added: tuple[_Change, ...],
    state: SavedCheckpoint,
    run: LoadRun,
    extra_flags: tuple[str, ...],
) -> tuple[tuple[Any, ...], Suggestion]:
    """The candidate, and its place in the order: (layout changes, added flags, distance, the layout)."""
    layout_changes = _changes(target, state.saved, state.experts)
    suggestion = Suggestion(
        target=dict(report.target),
        spec=spec,
        flags=[flag for change in added for flag in change.flags],
        changes=[f"{name.upper()} {old}->{new}" for name, old, new in layout_changes]
        + ["=".join(change.flags) for change in added],  # --strictness=MODE: one piece
        layout_changes=len(layout_changes),
        flag_changes=len(added),
        argv=["--target", spec, *load_flags(_apply(run, added)), *extra_flags],
        sections={s.section: s.verdict for s in report.sections},
        warnings=list(report.warnings),
    )
    values = tuple(getattr(target, f) for f in ("tp", "pp", "cp", "ep", "etp"))
    return (len(layout_changes), len(added), _distance(layout_changes), values), suggestion
