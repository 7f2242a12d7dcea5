"""Transformer Engine ``_extra_state`` rules (CKD230-233, consistency family): what each item holds
(:mod:`ckptdoctor.formats.te_extra_state`), whether a TE release refuses it at load, and whether the items agree
with each other and with the saved args.

:func:`census` reads every ``_extra_state`` item (a few KB each) through the safe unpickler; ``inspect
--extra-state``, ``show`` and ``edit --drop-redundant-extra-state`` use it too. An item the gate refuses (CKD401)
or that is damaged (``check --deep``) is listed as unreadable and judged by those rules, not here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ckptdoctor.args import saved_config
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import te_extra_state as te
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.rules import INFO, WARNING, Finding, RuleInfo
from ckptdoctor.rules.structure import Scanned

REFUSED = RuleInfo(
    "CKD230",
    "te-refused-extra-state",
    "consistency",
    WARNING,
    "_extra_state items that Transformer Engine 2.16.1, 2.17.1 and >= 2.18 refuse at load unless "
    "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1",
    "TE 2.18.0, and the 2.16.1 and 2.17.1 patch releases (transformer_engine/pytorch/_extra_state.py, the same file "
    "in every one of them) classify each pickled extra state by its opcodes before "
    "unpickling it: pickled delayed-scaling FP8 state (scale_fwd, amax_history_fwd, ...) and every TE 1.x BytesIO "
    "state raise a RuntimeError ('Refusing to load pickled Transformer Engine extra state') unless the environment "
    "variable NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 is set. Set it for a checkpoint you trust (ckptdoctor's gate "
    "has read every global in these pickles), or drop the state (the FP8 scales and amax histories restart) with "
    "`ckptdoctor edit CKPT --drop-extra-state`. With `check --te-version` naming a release without the classifier "
    "(2.16.0, 2.17.0 or older: the run's TE loads them) the finding is info: it says what an upgrade will refuse, "
    "and does not fail the check.",
)
MIXED = RuleInfo(
    "CKD231",
    "te-mixed-extra-state",
    "consistency",
    WARNING,
    "_extra_state items written by Transformer Engine releases that cannot have saved together, or with "
    "different recipes",
    "One training run saves every TE module's extra state with one TE release and one recipe. A TE 1.x BytesIO "
    "beside a TE 2.x uint8 state, a pickled None (TE 2.0-2.3) beside an empty tensor (TE >= 2.4), or two recipe "
    "classes mean the checkpoint was assembled from several runs or converted in part; a load then restores "
    "some modules' FP8 state and not others, and the refusing releases (TE 2.16.1, 2.17.1, >= 2.18) refuse the "
    "old forms (CKD230).",
)
FP8_ARGS = RuleInfo(
    "CKD232",
    "te-extra-state-fp8-args",
    "consistency",
    WARNING,
    "delayed-scaling FP8 state saved while the saved args say FP8 is off, or the reverse",
    "Megatron passes --fp8 and --fp8-recipe to TE; TE saves delayed-scaling state (scales and amax histories) only "
    "for modules that ran in FP8. Delayed-scaling state in a checkpoint whose args say fp8=None was written by "
    "another run (or the args were edited); args that say FP8 with the delayed recipe while no module saved FP8 "
    "state mean the state was dropped. Stateless recipes (current scaling, MXFP8, block scaling, NVFP4) "
    "legitimately save empty states and are not reported.",
)
GROUPED = RuleInfo(
    "CKD233",
    "te-grouped-extra-state",
    "consistency",
    WARNING,
    "a grouped linear's per-expert _extra_state shards disagree: some hold FP8 state, some are empty",
    "Megatron's TEGroupedLinear saves one _extra_state shard per expert (the expert axis last) and, at load, "
    "merges a rank's local experts (_extra_state, _extra_state1, ...) into one state "
    "(merge_extra_states, megatron/core/extensions/transformer_engine.py): when the first is empty it returns "
    "early and the others' FP8 state is silently dropped; when the first holds state and another is empty, the "
    "merge indexes a None and the load fails with a TypeError.",
)
RULES = [REFUSED, MIXED, FP8_ARGS, GROUPED]

UNREADABLE = "unreadable"


@dataclass
class CensusItem:
    key: str  # the stored item's key (``<module>._extra_state/shard_<...>``)
    state: te.ExtraState | None  # None: unreadable (refused by the gate or damaged; ``error`` says why)
    error: str | None = None


def census(checkpoint: Checkpoint, skip_files: Collection[str] = ()) -> list[CensusItem]:
    """Every stored ``_extra_state`` item described, in key order."""
    out = []
    for key, entry in sorted(checkpoint.entries.items()):
        if entry.kind == "tensor" or not te.is_extra_state_key(key):
            continue
        location = entry.chunks[0].storage if entry.chunks else None
        if location is None or location.relative_path in skip_files:
            continue
        try:
            data, where = checkpoint.bytes_item_data(key)
            out.append(CensusItem(key, te.describe_item(data, where)))
        except (CkptError, ArchiveError) as exc:  # refused (CKD401/402) or damaged: those rules report it
            out.append(CensusItem(key, None, str(exc)))
    return out


def generation_range(state: te.ExtraState) -> tuple[te.TeVersion, te.TeVersion] | None:
    """The TE releases ``[lo, hi)`` that write this form (None: no TE form). A pickled stateless recipe is
    2.0-2.17's (2.16.1 and 2.17.1 save an empty tensor instead, inside the range: good enough for mixing)."""
    forever = (99, 0, 0)
    if state.form == te.FORM_BYTESIO:
        return (1, 0, 0), (2, 0, 0)
    if state.form == te.FORM_PICKLED_NONE:
        return (2, 0, 0), (2, 4, 0)
    if state.form == te.FORM_EMPTY:
        return (2, 4, 0), forever
    if state.form == te.FORM_PICKLE and state.generation == te.GEN_TE20_21:
        return (2, 0, 0), (2, 2, 0)
    if state.form == te.FORM_PICKLE:
        return ((2, 0, 0), te.REFUSING_TE) if state.recipe in te.STATELESS_RECIPES else ((2, 0, 0), forever)
    return None


def check(state: Scanned, te_version: te.TeVersion | None = None) -> list[Finding]:
    """The rules on one iteration dir; ``te_version`` is the loading run's Transformer Engine (None: the newest
    modelled), which decides whether CKD230 is a warning (it refuses the items) or info (an upgrade will)."""
    checkpoint = state.checkpoint
    if checkpoint is None or checkpoint.dcp is None:
        return []
    items = census(checkpoint, state.bad_files)
    read = [(i.key, i.state) for i in items if i.state is not None]
    if not read:
        return []
    shown = str(state.shown / ".metadata")
    out: list[Finding] = []
    out += _refused(read, shown, te_version)
    out += _mixed(read, shown)
    out += _grouped(read, shown)
    if state.common is not None:
        args, _ = saved_config(state.common, checkpoint.iteration_dir)
        out += _fp8_args(read, args, shown)
    return out


def _examples(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _refused(read: list[tuple[str, te.ExtraState]], shown: str, te_version: te.TeVersion | None) -> list[Finding]:
    refused = [(k, s) for k, s in read if s.te_2_18 == "refuse"]
    if not refused:
        return []
    kinds = Counter(
        "TE 1.x BytesIO"
        if s.form == te.FORM_BYTESIO
        else "pickled delayed-scaling state"
        if s.recipe == te.DELAYED or s.needed
        else "pickled state TE cannot classify"
        for _, s in refused
    )
    what = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    refusing = te.refuses_pickled(te_version)
    if te_version is None:
        whose = f"{te.REFUSING_RELEASES} will refuse {_items(len(refused))}"
    elif refusing:
        whose = f"TE {te.format_te_version(te_version)} will refuse {_items(len(refused))}"
    else:  # the run's TE loads them: say what an upgrade will refuse
        whose = (
            f"TE {te.format_te_version(te_version)} loads {_items(len(refused))} that an upgrade to "
            f"{te.REFUSING_RELEASES} will refuse"
        )
    message = (
        f"{whose} unless "
        f"{te.UNSAFE_PICKLE_ENV}=1 ({what}): {_examples([k for k, _ in refused])}; for a trusted checkpoint set "
        f"{te.UNSAFE_PICKLE_ENV}=1 at load, or drop the extra state (FP8 scaling restarts)"
    )
    return [Finding(REFUSED.code, shown, message, REFUSED.severity if refusing else INFO)]


def _mixed(read: list[tuple[str, te.ExtraState]], shown: str) -> list[Finding]:
    out = []
    ranges = [(k, s, generation_range(s)) for k, s in read]
    ranged = [(k, s, r) for k, s, r in ranges if r is not None]
    if ranged:
        lo = max(r[0] for _, _, r in ranged)
        hi = min(r[1] for _, _, r in ranged)
        if lo >= hi:
            seen = Counter(s.generation for _, s, _ in ranged)
            what = ", ".join(f"{n} {gen}" for gen, n in sorted(seen.items()))
            out.append(
                Finding(
                    MIXED.code,
                    shown,
                    f"_extra_state items of Transformer Engine generations that never saved together: {what}",
                    MIXED.severity,
                )
            )
    recipes = Counter(s.recipe for _, s in read if s.recipe is not None)
    if len(recipes) > 1:
        what = ", ".join(f"{n} {name}" for name, n in sorted(recipes.items()))
        out.append(Finding(MIXED.code, shown, f"_extra_state items with different FP8 recipes: {what}", MIXED.severity))
    return out


def _fp8_args(read: list[tuple[str, te.ExtraState]], args: dict, shown: str) -> list[Finding]:
    if not args or "fp8" not in args:
        return []
    fp8 = args.get("fp8")
    delayed = [k for k, s in read if s.needed]
    te_items = [s for _, s in read if s.form != te.FORM_NONE]
    if not fp8 and delayed:
        return [
            Finding(
                FP8_ARGS.code,
                shown,
                f"{_items(len(delayed))} with delayed-scaling FP8 state, but the saved args say fp8=None: "
                f"{_examples(delayed)}",
                FP8_ARGS.severity,
            )
        ]
    recipe = args.get("fp8_recipe", "delayed")
    if fp8 and recipe == "delayed" and te_items and not delayed:
        return [
            Finding(
                FP8_ARGS.code,
                shown,
                f"the saved args say fp8={fp8!r} with the delayed recipe but none of the {len(te_items)} Transformer "
                "Engine _extra_state items holds delayed-scaling FP8 state",
                FP8_ARGS.severity,
            )
        ]
    return []


def _grouped(read: list[tuple[str, te.ExtraState]], shown: str) -> list[Finding]:
    """Grouped experts save one shard per expert of one key (``...experts.linear_fc1._extra_state/shard_<layer>.
    <expert>_<L>.<E>``, the expert axis last); at load each rank's local experts become ``_extra_state``,
    ``_extra_state1``, ... of one TEGroupedLinear and are merged."""
    groups: dict[tuple[str, str], dict[int, te.ExtraState]] = {}
    for key, s in read:
        base, _, shard = key.partition("/")
        parts = shard.split("_")
        if ".experts.linear_fc" not in base or ".experts.experts." in base or len(parts) != 3:  # TEGroupedLinear only
            continue
        offsets = parts[1].split(".")
        if len(offsets) < 2 or not offsets[-1].isdigit():
            continue
        groups.setdefault((te.module_of(base), ".".join(offsets[:-1])), {})[int(offsets[-1])] = s
    out = []
    for (module, layer), states in sorted(groups.items()):
        holding = sorted(i for i, s in states.items() if s.fp8)
        if not holding or len(holding) == len(states):
            continue
        empty = sorted(set(states) - set(holding))
        out.append(
            Finding(
                GROUPED.code,
                shown,
                f"{module} (layer offset {layer}): FP8 state in expert(s) {_indices(holding)}, empty in "
                f"expert(s) {_indices(empty)}: a rank whose first local expert is empty drops the others' FP8 "
                "state at load; one whose first holds state fails the merge on the empty ones",
                GROUPED.severity,
            )
        )
    return out


def _items(count: int) -> str:
    return f"{count} _extra_state item{'' if count == 1 else 's'}"


def _indices(indices: Iterable[int]) -> str:
    return ", ".join(str(i) for i in indices)
