"""What ``ckptdoctor diff`` reports (schema ``ckptdoctor.diff/1``: ``ckptdoctor schema diff``): typed dataclasses
the renderers read, filled by :mod:`ckptdoctor.ops.diff.compare` (values: :mod:`ckptdoctor.values.diff`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptdoctor.pickle.paths import FieldChange
from ckptdoctor.pickle.plain import OMIT_NONE

if TYPE_CHECKING:
    from ckptdoctor.values.diff import ValuesReport


SCHEMA = "ckptdoctor.diff/1"


@dataclass
class Side:
    """What one checkpoint is (the header of the diff)."""

    path: str
    iteration_dir: str
    backend: str
    era: str
    common_source: str | None
    iteration: int | None
    keys: int  # logical keys: tensors, and ShardedObjects counted once by base key (see logical_items)
    entries: int  # DCP items (a ShardedObject counts once per shard)
    data_files: dict
    layout: dict
    # globals off the allowlist its pickles name, read as inert stand-ins (a real load runs them; check: CKD402)
    stand_ins_read: list[str] | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class KeyList:
    count: int
    keys: list[str]  # at most ``limit`` of them


@dataclass
class SectionKeys:
    only_a: KeyList
    only_b: KeyList
    common: int


@dataclass
class KeyChange:
    """A key in both whose kind, dtype or global shape differs."""

    key: str
    section: str
    fields: list[str]
    a: dict
    b: dict


@dataclass
class LayoutChange:
    """A key in both whose chunk grid (or object shard grid) differs: layout, not content."""

    key: str
    section: str
    kind: str
    a: str
    b: str


@dataclass
class LayoutDiff:
    a: str
    b: str
    summary: str
    differs: bool
    count: int
    keys: list[LayoutChange]


@dataclass
class ArgDifference:
    name: str
    group: str
    change: str  # "changed" | "only_a" | "only_b"
    a: Any
    b: Any
    era: bool = False  # absent on one side because that side's core version never saved it (see the era notes)


@dataclass
class ArgFlag:
    """A saved arg contradicting its own checkpoint's layout (rule from :mod:`ckptdoctor.arg_rules`)."""

    side: str  # "a" | "b"
    code: str
    arg: str
    saved: Any
    correct: Any
    severity: str
    reason: str
    megatron_error: str | None
    equal_in_both: bool  # the arg is equal in A and B, so only this flag shows the problem


@dataclass
class ArgsDiff:
    compared: bool  # both sides saved args
    count: int  # differing args, ignored ones excluded
    groups: dict[str, list[ArgDifference]]
    flags: list[ArgFlag]
    ignored: list[str] = field(default_factory=list)  # differing args left out by --ignore-arg / ignore-args
    # args absent on one side because that side's core version never saved them: listed, counted only with
    # --strict-args
    era: list[str] = field(default_factory=list)


@dataclass
class CommonChange:
    """A common-state key (or ``metadata.json:<key>``) that differs, and its differing fields."""

    field: str  # a common-state key, or "metadata.json:<key>"
    change: str  # "changed" | "only_a" | "only_b"
    a: Any
    b: Any
    # the differing fields under it, by path (optimizer.param_groups[0].lr), at most the diff's limit of them
    fields: list[FieldChange] = dataclasses.field(default_factory=list)  # (``field`` is the name above)
    fields_count: int = 0  # differing fields found (fields lists at most limit of them)
    fields_complete: bool = True  # False: the walk stopped at its node or depth limit; there may be more


@dataclass
class CommonDiff:
    count: int
    items: list[CommonChange]


@dataclass
class DiffReport:
    schema: str
    a: Side
    b: Side
    filters: dict
    limit: int | None
    keys: dict[str, SectionKeys]
    changed: list[KeyChange]
    layout: LayoutDiff
    args: ArgsDiff | None  # None when filters exclude the common state (--section without common, --key)
    common: CommonDiff | None
    era: list[str]
    values: ValuesReport | None = None  # with --values
    stats: StatsDiff | None = field(default=None, metadata=OMIT_NONE)  # with --values --stats
    # {"layout": bool, "args": [regex], "strict_args": bool}: what is not counted as a difference
    ignored: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    identical: bool = True


@dataclass
class SliceStats:
    """One side's statistics of a key, or of one slice of a stacked key (``check --health``'s numbers)."""

    count: int
    zeros: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    l2: float | None
    fingerprint: str  # 16 hex digits: equal slices have equal fingerprints at any layout


@dataclass
class StatsRow:
    """A key (or one layer / expert of a stacked key) in both checkpoints: both sides' statistics and their
    relative change ``(b - a) / |a|`` (0 when equal; None where A is 0 and B is not, or either has no value)."""

    key: str
    slice: dict[str, int]  # the stacked axes' indices ({"layer": 3, "expert": 1}); {} for the whole key
    a: SliceStats
    b: SliceStats
    equal: bool  # equal fingerprints: the same values
    l2_change: float | None
    std_change: float | None
    mean_change: float | None


@dataclass
class StatsDiff:
    """``diff --values --stats``: per-key and per-slice statistics side by side (rows: at most ``limit``)."""

    keys: int  # tensor keys compared (model and optimizer tensors in both)
    count: int  # rows: one per key, or per slice of a stacked key
    changed: int  # rows whose fingerprints differ
    rows: list[StatsRow]  # the largest relative change first, then in key and slice order


@dataclass
class SeriesPoint:
    """One iteration's statistics of a key or slice, and the relative change of its L2 norm from the previous
    iteration that has it (``(b - a) / |a|``; None for the first, or where the previous is 0 and this is not)."""

    iteration: int
    stats: SliceStats
    l2_change: float | None
    equal_previous: bool | None  # equal fingerprint to the previous iteration's; None for the first


@dataclass
class SeriesRow:
    """A key, or one layer / expert of a stacked key, across the iterations of a save dir (those that have it)."""

    key: str
    slice: dict[str, int]
    points: list[SeriesPoint]


@dataclass
class LayerRow:
    """One transformer layer's model weights across the iterations: the L2 norm of all of them together
    (``sqrt(Σ l2²)``), its relative change from the previous iteration, and how many of the layer's rows moved."""

    layer: int
    l2: list[float | None]  # one per iteration (StatsSeries.iterations); None where the layer has no value
    l2_change: list[float | None]  # the first is None
    moved: list[int]  # rows whose fingerprint differs from the previous iteration's (the first: 0)
    rows: int  # the layer's rows (keys and slices of model weights)


@dataclass
class SeriesStats:
    """The statistics of ``--all-iterations`` (JSON ``series``), as :class:`StatsDiff` has them for two."""

    keys: int  # tensor keys (those the filters kept), in any iteration
    count: int  # rows: one per key, or per slice of a stacked key
    changed: int  # rows whose fingerprint differs between some two consecutive iterations
    rows: list[SeriesRow]  # in key and slice order, at most ``limit``
    layers: list[LayerRow]  # model weights of decoder layers, by layer number


@dataclass
class StatsSeries:
    """``diff --values --stats --all-iterations SAVE_DIR``: check --health's statistics of every iteration of a
    save dir, oldest first, with the change between consecutive iterations."""

    schema: str
    save_dir: str
    iterations: list[int]  # the iteration dirs measured, oldest first (a release dir is left out)
    limit: int | None
    series: SeriesStats
