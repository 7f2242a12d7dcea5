"""``ckptdoctor diff A B``: keys, metadata, layout, args, common state and (optionally) values of two checkpoints.

Everything except values comes from metadata (``.metadata``, ``metadata.json``, the common state), so a structural
diff costs the same for 1 GB and 10 TB. Differences are classified so that users see what matters:

* layout (TP/PP chunk grids, ShardedObject shard grids) is reported apart from content: a TP=4 re-shard of a
  TP=1 checkpoint has the same keys, dtypes, shapes and values;
* era (core <= 0.18 ``common.pt`` vs core >= 0.19 ``common_state`` DCP item, ``common_backend`` keys in
  ``metadata.json``, the DCP metadata class) is a note, never a content difference;
* args that are equal on both sides but contradict their own checkpoint's layout are flagged with the rule
  table of :mod:`ckptdoctor.arg_rules` (the same rules ``fix-args`` applies).

The report this builds is :class:`~ckptdoctor.ops.diff.report.DiffReport`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptdoctor.arg_rules import check_args
from ckptdoctor.args import ARG_GROUPS, arg_group
from ckptdoctor.checkpoint import SECTIONS, Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.plain_dcp import MODEL_PREFIX, model_under_prefix
from ckptdoctor.logical_items import KIND_TENSOR, Item, is_common_state_item, logical_items
from ckptdoctor.ops.diff.report import (
    SCHEMA,
    ArgDifference,
    ArgFlag,
    ArgsDiff,
    CommonChange,
    CommonDiff,
    DiffReport,
    KeyChange,
    KeyList,
    LayoutChange,
    LayoutDiff,
    SectionKeys,
    Side,
)
from ckptdoctor.ops.diff.stats import compare_stats
from ckptdoctor.parallelism import SavedLayout, infer_layout, is_stacked_layer_key, same_layout
from ckptdoctor.pickle.paths import FieldChange, FieldDiff, diff_fields, join
from ckptdoctor.pickle.plain import same_value
from ckptdoctor.values.diff import compare_values
from ckptdoctor.values.health_tap import HealthTap

if TYPE_CHECKING:
    from ckptdoctor.progress import Progress


ARG_GROUP_ORDER = (*ARG_GROUPS, "other")
# metadata.json keys core <= 0.18 writes and core >= 0.19 dropped with common.pt
_ERA_METADATA_KEYS = ("common_backend", "common_backend_version")
# Saved args that Megatron-LM writes from the core >= 0.19 era on (the common state in the DCP, no common.pt): the GTP
# weight-shard args (megatron/core/model_parallel_config.py resolve_tensor_parallel_weight_shards, core_v0.19.0) and
# the CUDA-graph enums that replaced cuda_graph_scope. A checkpoint of an older era (common.pt, zarr) lacks them
# because its core never saved them, not because the runs differ. The one table of this knowledge: the era notes
# name what it explains (era_absent_args) and compare_args leaves those out of the count (unless --strict-args).
ARGS_SINCE_CORE_019 = frozenset(
    {
        "tensor_parallel_num_weight_shards",
        "gtp_weight_remat_size",
        "expert_tensor_parallel_num_weight_shards",
        "expert_gtp_weight_remat_size",
        "cuda_graph_modules",
        "inference_cuda_graph_scope",
    }
)


@dataclass
class KeyFilter:
    """``--section``, ``--key`` (any matches) and ``--exclude`` (none matches) on logical keys."""

    sections: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._keys = [re.compile(k) for k in self.keys]
        self._exclude = [re.compile(k) for k in self.exclude]

    def accepts(self, item: Item) -> bool:
        if self.sections and item.section not in self.sections:
            return False
        if self._keys and not any(p.search(item.key) for p in self._keys):
            return False
        return not any(p.search(item.key) for p in self._exclude)

    def unmatched(self, keys: list[str]) -> list[str]:
        """The ``--key`` patterns that match none of ``keys``."""
        return [k for k, p in zip(self.keys, self._keys) if not any(p.search(key) for key in keys)]

    @property
    def accepts_all(self) -> bool:
        return not (self.sections or self.keys or self.exclude)

    @property
    def includes_common_state(self) -> bool:
        """Args and other common state are compared unless filters narrow the diff to some keys."""
        return not self.keys and (not self.sections or "common" in self.sections)


def _limited(keys: list[str], limit: int | None) -> KeyList:
    return KeyList(len(keys), keys if limit is None else keys[:limit])


def _side(ckpt: Checkpoint, layout_summary: dict, logical_keys: int) -> Side:
    location = ckpt.location
    return Side(
        path=str(location.input_path),
        iteration_dir=str(ckpt.iteration_dir),
        backend=location.backend,
        era=location.era,
        common_source=ckpt.common_source,
        iteration=location.iteration,
        keys=logical_keys,
        entries=len(ckpt.entries),
        data_files={"count": len(ckpt.data_files), "bytes": sum(ckpt.data_files.values())},
        layout=layout_summary,
    )


def _layout_dict(ckpt: Checkpoint) -> tuple[dict, Any]:
    saved = infer_layout(ckpt)
    return saved.as_dict(), saved


def _item_meta(item: Item) -> dict:
    return {"kind": item.kind, "dtype": item.dtype, "shape": None if item.shape is None else list(item.shape)}


def _layers_differ(a: Item, b: Item) -> bool:
    """A stacked layers' sharded object (``decoder.layers.<m>._extra_state``) whose grid counts other layers on its
    first axis: the model's depth changed, not its layout (2 vs 4 layers was listed as "chunked differently")."""
    if not (is_stacked_layer_key(a.key) and a.shape and b.shape and len(a.shape) == len(b.shape)):
        return False
    return a.shape[0] != b.shape[0]


def compare_keys(
    items_a: dict[str, Item], items_b: dict[str, Item], era_common: bool, limit: int | None
) -> tuple[dict[str, SectionKeys], list[KeyChange], list[LayoutChange], list[str]]:
    """Keys only in A/B per section, metadata changes and grid (layout) changes of keys in both."""
    only_a: dict[str, list[str]] = {s: [] for s in SECTIONS}
    only_b: dict[str, list[str]] = {s: [] for s in SECTIONS}
    common_count = dict.fromkeys(SECTIONS, 0)
    changed: list[KeyChange] = []
    layout: list[LayoutChange] = []
    both: list[str] = []
    for key in sorted(items_a.keys() | items_b.keys()):
        a, b = items_a.get(key), items_b.get(key)
        if era_common and is_common_state_item(key):
            continue  # the common state moved into the DCP (core 0.19): an era note, compared as common state
        if b is None:
            assert a is not None  # the key came from one of the two sides
            only_a[a.section].append(key)
            continue
        if a is None:
            only_b[b.section].append(key)
            continue
        common_count[a.section] += 1
        both.append(key)
        fields = [f for f in ("kind", "dtype", "shape") if getattr(a, f) != getattr(b, f)]
        if a.kind == b.kind != KIND_TENSOR and not _layers_differ(a, b):
            fields = [f for f in fields if f != "shape"]  # an object's shard grid shape is layout
        if fields:
            changed.append(KeyChange(key, a.section, fields, _item_meta(a), _item_meta(b)))
        elif not a.same_grid(b):
            layout.append(LayoutChange(key, a.section, a.kind, a.grid_summary(), b.grid_summary()))
    sections = {
        s: SectionKeys(_limited(only_a[s], limit), _limited(only_b[s], limit), common_count[s]) for s in SECTIONS
    }
    return sections, changed, layout, both


def era_absent_args(a: Checkpoint, b: Checkpoint, args_a: dict, args_b: dict) -> dict[str, str]:
    """Saved args absent on one side because that side's core version never saved them (:data:`ARGS_SINCE_CORE_019`):
    name -> the side that has it (``"a"``/``"b"``). Only where both sides saved args and their eras differ so."""
    if not args_a or not args_b:
        return {}
    out: dict[str, str] = {}
    for side, mine, other, new, old in (("a", args_a, args_b, a, b), ("b", args_b, args_a, b, a)):
        if new.location.has_common_pt or not old.location.has_common_pt:
            continue  # not a core >= 0.19 side against an older one
        for name in sorted(ARGS_SINCE_CORE_019 & mine.keys()):
            if name not in other:
                out[name] = side
    return out


def compare_args(
    a: SavedLayout,
    b: SavedLayout,
    args_a: dict,
    args_b: dict,
    ignore: tuple[str, ...] = (),
    era_absent: dict[str, str] | None = None,
    strict: bool = False,
) -> ArgsDiff:
    """Differing args by group, and args contradicting their own checkpoint's layout (``a``/``b``).

    Args whose name fully matches a regex of ``ignore`` are not compared (listed in ``ignored`` when they differ).
    Args of ``era_absent`` (:func:`era_absent_args`) are listed, marked ``era``, and counted only when ``strict``.
    """
    era_absent = era_absent or {}
    groups: dict[str, list[ArgDifference]] = {g: [] for g in ARG_GROUP_ORDER}
    patterns = [re.compile(p) for p in ignore]
    ignored: list[str] = []
    for name in sorted(args_a.keys() | args_b.keys()):
        if patterns and any(p.fullmatch(name) for p in patterns):
            if name not in args_a or name not in args_b or not same_value(args_a[name], args_b[name]):
                ignored.append(name)
            continue
        if name not in args_b:
            era = name in era_absent
            groups[arg_group(name)].append(ArgDifference(name, arg_group(name), "only_a", args_a[name], None, era))
        elif name not in args_a:
            era = name in era_absent
            groups[arg_group(name)].append(ArgDifference(name, arg_group(name), "only_b", None, args_b[name], era))
        elif not same_value(args_a[name], args_b[name]):
            groups[arg_group(name)].append(ArgDifference(name, arg_group(name), "changed", args_a[name], args_b[name]))
    flags: list[ArgFlag] = []
    for side, layout, mine, other in (("a", a, args_a, args_b), ("b", b, args_b, args_a)):
        for f in check_args(mine, layout):
            equal = f.arg in other and same_value(mine[f.arg], other[f.arg])
            flags.append(
                ArgFlag(side, f.code, f.arg, f.saved, f.correct, f.severity, f.reason, f.megatron_error, equal)
            )
    era_listed = sorted(d.name for v in groups.values() for d in v if d.era)
    count = sum(len(v) for v in groups.values()) - (0 if strict else len(era_listed))
    return ArgsDiff(bool(args_a) and bool(args_b), count, groups, flags, ignored, era_listed)


def compare_common(a: Checkpoint, b: Checkpoint, era_common: bool, limit: int | None = None) -> CommonDiff:
    """Common-state keys other than args, and metadata.json (era keys excluded); each differing key with its
    differing fields by path (``optimizer.param_groups[0].lr``), at most ``limit`` of them listed per key."""
    state_a = {k: v for k, v in a.common_state().items() if k != "args"}
    state_b = {k: v for k, v in b.common_state().items() if k != "args"}
    items: list[CommonChange] = []

    def add(prefix: str, da: dict, db: dict) -> None:
        for name in sorted(da.keys() | db.keys(), key=str):
            label = f"{prefix}{name}"
            if name not in db:
                change = CommonChange(label, "only_a", da[name], None)
            elif name not in da:
                change = CommonChange(label, "only_b", None, db[name])
            elif not same_value(da[name], db[name]):
                change = CommonChange(label, "changed", da[name], db[name])
            else:
                continue
            found = (
                diff_fields(change.a, change.b, join("", name) if not prefix else label)
                if change.change == "changed"
                else FieldDiff([FieldChange(label, change.change, change.a, change.b)])
            )
            change.fields = found.changes if limit is None else found.changes[:limit]
            change.fields_count = len(found.changes)
            change.fields_complete = found.complete
            items.append(change)

    add("", state_a, state_b)
    meta_a, meta_b = dict(a.location.metadata_json), dict(b.location.metadata_json)
    if era_common:
        for key in _ERA_METADATA_KEYS:
            if (key in meta_a) != (key in meta_b):
                meta_a.pop(key, None)
                meta_b.pop(key, None)
    add("metadata.json:", meta_a, meta_b)
    return CommonDiff(len(items), items)


def era_notes(
    a: Checkpoint, b: Checkpoint, era_absent: dict[str, str] | None = None, strict: bool = False
) -> list[str]:
    """Differences in how the checkpoints are stored (Megatron era, backend) that are not content; with
    ``era_absent`` (:func:`era_absent_args`), the saved args one side's core never saved."""
    la, lb = a.location, b.location
    notes: list[str] = []
    if la.backend != lb.backend:
        notes.append(f"backends differ: A is {la.era}, B is {lb.era}; keys and values are compared by key")
    elif la.era != lb.era and a.common_source is None and b.common_source is None:
        # two plain DCP flavours (a TorchTitan full save and its model-only last step): no common state to move
        notes.append(f"A is {la.era}, B is {lb.era}; keys and values are compared by key")
    elif la.era != lb.era:
        notes.append(
            f"A is {la.era}, B is {lb.era}: the common state moved from common.pt into the DCP item "
            f"{a.common_source if not la.has_common_pt else b.common_source}; it is compared as common "
            "state, not as a key"
        )
    ka = [k for k in _ERA_METADATA_KEYS if k in la.metadata_json]
    kb = [k for k in _ERA_METADATA_KEYS if k in lb.metadata_json]
    if (ka != kb) and la.has_common_pt != lb.has_common_pt:
        side = "A" if ka else "B"
        notes.append(f"metadata.json: {', '.join(ka or kb)} only in {side} (written by core <= 0.18 only)")
    for side in ("a", "b"):
        names = [n for n, holder in (era_absent or {}).items() if holder == side]
        if names:
            counted = "counted as differences (--strict-args)" if strict else "not counted (--strict-args counts them)"
            notes.append(
                f"args {', '.join(names)} only in {side.upper()}: first saved by core 0.19, and "
                f"{'B' if side == 'a' else 'A'}'s core (<= 0.18) never saved them; {counted}"
            )
    if a.dcp and b.dcp and a.dcp.metadata_class != b.dcp.metadata_class:
        notes.append(f"DCP metadata class: A {a.dcp.metadata_class}, B {b.dcp.metadata_class}")
    if a.dcp and b.dcp and a.dcp.version != b.dcp.version:
        notes.append(f"DCP metadata version: A {a.dcp.version}, B {b.dcp.version}")
    return notes


def _align_model_prefix(
    a: Checkpoint, b: Checkpoint, items_a: dict[str, Item], items_b: dict[str, Item]
) -> tuple[dict[str, Item], dict[str, Item], list[str]]:
    """TorchTitan's two layouts compared key by key: where one side keeps its model under ``model.`` (up to
    v0.1.0) and the other at the top level (since v0.2.0, and its model-only saves), the prefixed side's model
    keys are compared without the prefix (each item keeps its own key for reading), and an era note says so."""
    under_a = model_under_prefix((k for k, item in items_a.items() if item.section == "model"), a.flavour)
    under_b = model_under_prefix((k for k, item in items_b.items() if item.section == "model"), b.flavour)
    if under_a is None or under_b is None or under_a == under_b:
        return items_a, items_b, []

    def unprefixed(items: dict[str, Item]) -> dict[str, Item]:
        return {key[len(MODEL_PREFIX) :] if item.section == "model" else key: item for key, item in items.items()}

    side, other = ("A", "B") if under_a else ("B", "A")
    note = (
        f"{side} keeps the model under model. (TorchTitan up to v0.1.0), {other} at the top level (TorchTitan "
        f"since v0.2.0, or a model-only save): {side}'s model keys are compared without the prefix"
    )
    if under_a:
        return unprefixed(items_a), items_b, [note]
    return items_a, unprefixed(items_b), [note]


def diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    key_filter: KeyFilter | None = None,
    limit: int | None = 20,
    values: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    progress: Progress | None = None,
    ignore_layout: bool = False,
    ignore_args: tuple[str, ...] = (),
    report_mismatches: int = 0,
    jobs: int | None = None,
    strict_args: bool = False,
    stats: bool = False,
) -> DiffReport:
    """Compare two checkpoints; values are read (streamed, chunk by chunk) only when ``values`` is set, by
    ``jobs`` worker processes (default: the available cores) or the ranks of a torchrun job.

    ``ignore_layout``: layout differences are reported but are not differences (``identical`` may be true);
    ``ignore_args``: arg-name regexes (full match) left out of the args comparison;
    ``strict_args``: an arg absent on one side because that side's core never saved it counts as a difference;
    ``report_mismatches``: with ``values``, the first N mismatching elements of each differing tensor;
    ``stats``: with ``values``, both sides' per-key and per-slice statistics (:mod:`ckptdoctor.ops.diff.stats`).
    """
    key_filter = key_filter or KeyFilter()
    all_a, all_b = logical_items(a), logical_items(b)
    # no filter: the same dicts (not a copy of 200k entries per side)
    items_a = all_a if key_filter.accepts_all else {k: v for k, v in all_a.items() if key_filter.accepts(v)}
    items_b = all_b if key_filter.accepts_all else {k: v for k, v in all_b.items() if key_filter.accepts(v)}
    unmatched = key_filter.unmatched([*all_a, *all_b])
    if unmatched:  # a typo in a CI gate's --key compared nothing and passed
        listing = "`ckptdoctor inspect CKPT --keys` lists them"
        raise CkptError(f"--key {unmatched[0]!r} matches no key of A or B ({listing})")
    era_common = a.location.has_common_pt != b.location.has_common_pt
    items_a, items_b, model_note = _align_model_prefix(a, b, items_a, items_b)
    parts: list = []

    def structure() -> None:  # everything but the values; run while value workers read (compare_values)
        sections, changed, layout_changes, _ = compare_keys(items_a, items_b, era_common, limit)
        layout_a, saved_a = _layout_dict(a)
        layout_b, saved_b = _layout_dict(b)
        summary_line = f"A: {saved_a.summary()}  B: {saved_b.summary()}"
        layout = LayoutDiff(
            saved_a.summary(),
            saved_b.summary(),
            summary_line,
            bool(layout_changes) or not same_layout(saved_a, saved_b),
            len(layout_changes),
            layout_changes if limit is None else layout_changes[:limit],
        )
        args_diff = common = None
        era_absent: dict[str, str] = {}
        if key_filter.includes_common_state:
            # each side's saved args, or Megatron-Bridge's run_config.yaml model section where it saves none
            config_a = a.saved_config()[0]
            config_b = b.saved_config()[0]
            era_absent = era_absent_args(a, b, config_a, config_b)
            args_diff = compare_args(saved_a, saved_b, config_a, config_b, ignore_args, era_absent, strict_args)
            era_absent = {n: s for n, s in era_absent.items() if n in args_diff.era}  # not those --ignore-arg took
            common = compare_common(a, b, era_common, limit)
        report = DiffReport(
            schema=SCHEMA,
            a=_side(a, layout_a, len(all_a)),
            b=_side(b, layout_b, len(all_b)),
            filters={
                "sections": list(key_filter.sections),
                "keys": list(key_filter.keys),
                "exclude": list(key_filter.exclude),
            },
            limit=limit,
            keys=sections,
            changed=changed if limit is None else changed[:limit],
            layout=layout,
            args=args_diff,
            common=common,
            era=era_notes(a, b, era_absent, strict_args) + model_note,
            ignored={"layout": ignore_layout, "args": list(ignore_args), "strict_args": strict_args},
        )
        parts.extend((report, sections, changed, layout_changes, args_diff, common, layout))

    values_report = None
    measured = HealthTap() if values and stats else None  # the statistics measured in the values' one read
    if values:
        # compare_keys' keys in both, in its order
        both = [k for k in sorted(items_a.keys() & items_b.keys()) if not (era_common and is_common_state_item(k))]
        comparable = [
            (items_a[k], items_b[k]) for k in both if not (is_common_state_item(k) and items_a[k].kind != KIND_TENSOR)
        ]
        values_report = compare_values(
            a,
            b,
            comparable,
            atol=atol,
            rtol=rtol,
            limit=limit,
            progress=progress,
            workers=jobs,
            report=report_mismatches,
            meanwhile=structure,
            health=measured,
        )
    else:
        structure()
    stats_diff = None
    if values and stats:
        tensors = {
            k: (items_a[k].key, items_b[k].key)
            for k in items_a.keys() & items_b.keys()
            if items_a[k].kind == items_b[k].kind == KIND_TENSOR
        }
        stats_diff = compare_stats(a, b, tensors, limit, jobs, progress, measured)
    report, sections, changed, layout_changes, args_diff, common, layout = parts
    report.a.stand_ins_read = a.untrusted_globals_read() or None  # after every read of the pickles
    report.b.stand_ins_read = b.untrusted_globals_read() or None
    report.values = values_report
    report.stats = stats_diff
    report.summary = {
        "only_a": sum(s.only_a.count for s in sections.values()),
        "only_b": sum(s.only_b.count for s in sections.values()),
        "changed": len(changed),
        "layout": len(layout_changes),  # logical keys chunked (or sharded) differently
        "args": args_diff.count if args_diff else 0,
        "arg_flags": len(args_diff.flags) if args_diff else 0,
        "common": common.count if common else 0,
        "values_different": report.values.different if report.values else 0,
    }
    counted = {k: v for k, v in report.summary.items() if k not in ("arg_flags", "layout")}
    report.identical = not any(counted.values()) and (ignore_layout or not layout.differs)
    return report
