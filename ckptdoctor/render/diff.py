"""Text rendering of ``ckptdoctor diff`` (JSON goes through :func:`ckptdoctor.render.common.to_json`).

Kept apart from render/common.py so that the diff's many sections do not crowd the shared renderer.
"""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING, Any

from ckptdoctor.render.common import human_bytes, short_value
from ckptdoctor.render.wrap import wrap_lines
from ckptdoctor.rules.safety import stand_ins_note
from ckptdoctor.text_safety import text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.diff.report import DiffReport, SliceStats, StatsDiff, StatsRow, StatsSeries
    from ckptdoctor.values.diff import ValuesReport


_MAX_VALUE = 80


def _short(value: Any) -> str:
    return short_value(value, _MAX_VALUE)


def _more(shown: int, count: int) -> list[str]:
    return [f"    ... {count - shown} more (--limit N, --all)"] if count > shown else []


def _shape(meta: dict) -> str:
    shape = meta.get("shape")
    return "-" if shape is None else "x".join(map(str, shape)) or "()"


@text_safe
def render_diff(report: DiffReport, width: int | None = None) -> str:
    """The differences, section by section; each line wrapped to ``width`` (None: not wrapped) under its own
    text."""
    a, b = report.a, report.b
    lines = [f"A  {a.iteration_dir}  [{a.era}]", f"B  {b.iteration_dir}  [{b.era}]"]
    for name, side in (("A", a), ("B", b)):
        if side.stand_ins_read:
            lines.append(f"{name}: {stand_ins_note(side.stand_ins_read)}")
    filters = {k: v for k, v in report.filters.items() if v}
    if filters:
        lines.append("filters  " + "  ".join(f"{k}={','.join(v)}" for k, v in filters.items()))
    lines += ["", "keys"]
    any_keys = False
    for section, keys in report.keys.items():
        if not (keys.only_a.count or keys.only_b.count or keys.common):
            continue
        any_keys = True
        lines.append(
            f"  {section:<10} only in A: {keys.only_a.count:<5} only in B: {keys.only_b.count:<5} "
            f"in both: {keys.common}"
        )
        for label, listed in (("A", keys.only_a), ("B", keys.only_b)):
            for key in listed.keys:
                lines.append(f"    only in {label}  {key}")
            lines += _more(len(listed.keys), listed.count)
    if not any_keys:
        lines.append("  (no keys selected)")
    lines += ["", f"kind/dtype/shape changes: {report.summary['changed']}"]
    for change in report.changed:
        parts = []
        for name in change.fields:
            va = _shape(change.a) if name == "shape" else change.a[name]
            vb = _shape(change.b) if name == "shape" else change.b[name]
            parts.append(f"{name} {va} -> {vb}")
        lines.append(f"  {change.key}: " + ", ".join(parts))
    lines += _more(len(report.changed), report.summary["changed"])

    layout = report.layout
    ignored = report.ignored.get("layout")
    lines += ["", f"layout  {layout.summary}" + ("  (ignored: --ignore-layout)" if ignored and layout.differs else "")]
    if layout.count:
        lines.append(f"  {layout.count} keys chunked differently (layout, not content):")
        for moved in layout.keys:
            lines.append(f"    {moved.key}: {moved.a} -> {moved.b}")
        lines += _more(len(layout.keys), layout.count)

    if report.args is not None:
        args = report.args
        lines += [
            "",
            f"args: {args.count} differ"
            + ("" if args.compared else " (args missing on one side)")
            + (f"; {len(args.ignored)} ignored ({', '.join(args.ignored)})" if args.ignored else "")
            + (
                f"; {len(args.era)} only in the side whose core saves them (era, "
                + ("counted" if report.ignored.get("strict_args") else "not counted")
                + ")"
                if args.era
                else ""
            ),
        ]
        for group, changes in args.groups.items():
            if not changes:
                continue
            lines.append(f"  {group}:")
            for c in changes:
                era = "; era: B's core never saved it" if c.era and c.change == "only_a" else ""
                era = "; era: A's core never saved it" if c.era and c.change == "only_b" else era
                if c.change == "only_a":
                    lines.append(f"    {c.name}: {_short(c.a)} (only in A{era})")
                elif c.change == "only_b":
                    lines.append(f"    {c.name}: {_short(c.b)} (only in B{era})")
                else:
                    lines.append(f"    {c.name}: {_short(c.a)} -> {_short(c.b)}")
        if args.flags:
            lines.append("  args contradicting their own checkpoint's layout:")
            for f in args.flags:
                same = ", equal in A and B" if f.equal_in_both else ""
                lines.append(
                    f"    {f.side.upper()} {f.code} {f.severity}: {f.arg}={_short(f.saved)} "
                    f"(should be {_short(f.correct)}{same}): {f.reason}"
                )
    if report.common is not None:
        fields = sum(item.fields_count for item in report.common.items)
        detail = f" ({fields} fields)" if fields != report.common.count else ""
        lines += ["", f"common state and metadata.json: {report.common.count} differ{detail}"]
        for item in report.common.items:
            # each differing field by its path, not the two values of the whole key
            for differing in item.fields:
                if differing.change == "only_a":
                    lines.append(f"  {differing.path}: only in A: {_short(differing.a)}")
                elif differing.change == "only_b":
                    lines.append(f"  {differing.path}: only in B: {_short(differing.b)}")
                else:
                    lines.append(f"  {differing.path}: {_short(differing.a)} -> {_short(differing.b)}")
            lines += _more(len(item.fields), item.fields_count)
            if not item.fields_complete:
                lines.append(f"    ... {item.field}: not compared further (node or depth limit)")
    if report.era:
        lines += ["", "era (not content differences):"]
        lines += [f"  {note}" for note in report.era]
    if report.values is not None:
        lines += [""] + _render_values(report.values)
    if report.stats is not None:
        lines += [""] + _render_stats(report.stats)
    left_out = _left_out(report)
    if left_out:
        lines += ["", f"{left_out} more not listed (at most {report.limit} per list; --limit N, --all)"]
    lines += ["", _verdict(report)]
    return "\n".join(wrap_lines(lines, width))


def _left_out(report: DiffReport) -> int:
    """Entries the lists leave out under ``limit`` (the counts above them are complete)."""
    n = sum(k.only_a.count - len(k.only_a.keys) + k.only_b.count - len(k.only_b.keys) for k in report.keys.values())
    n += report.summary["changed"] - len(report.changed) + report.layout.count - len(report.layout.keys)
    if report.common is not None:
        n += sum(item.fields_count - len(item.fields) for item in report.common.items)
    v = report.values
    if v is not None:
        n += v.different - len(v.different_keys) + v.not_compared - len(v.not_compared_keys)
    if report.stats is not None:
        n += report.stats.count - len(report.stats.rows)
    return n


def differing_keys(report: DiffReport) -> list[str]:
    """Logical keys that differ (only in A or B, kind/dtype/shape, layout unless ignored, values), sorted."""
    keys = {k for s in report.keys.values() for k in (*s.only_a.keys, *s.only_b.keys)}
    keys.update(c.key for c in report.changed)
    if not report.ignored.get("layout"):
        keys.update(c.key for c in report.layout.keys)
    if report.values is not None:
        keys.update(r.key for r in report.values.different_keys)
    return sorted(keys)


@text_safe
def render_name_only(report: DiffReport) -> str:
    """``--name-only``: the differing keys, one per line (args and common state are not keys: see --stat)."""
    return "\n".join(differing_keys(report))


@text_safe
def render_stat(report: DiffReport) -> str:
    """``--stat``: counts per section (complete lists are expected: limit None)."""
    changed: dict[str, int] = {}
    layout: dict[str, int] = {}
    values: dict[str, int] = {}
    for counter, rows in (
        (changed, report.changed),
        (layout, report.layout.keys),
        (values, report.values.different_keys if report.values is not None else []),
    ):
        for row in rows:
            counter[row.section] = counter.get(row.section, 0) + 1
    header = f"{'section':<10} {'only A':>7} {'only B':>7} {'changed':>8} {'layout':>7}"
    header += f" {'values':>7}" if report.values is not None else ""
    lines = [header]
    for section, keys in report.keys.items():
        counts = [keys.only_a.count, keys.only_b.count, changed.get(section, 0), layout.get(section, 0)]
        counts += [values.get(section, 0)] if report.values is not None else []
        if not any(counts) and not keys.common:
            continue
        widths = (7, 7, 8, 7, 7)
        lines.append(f"{section:<10} " + " ".join(f"{n:>{w}}" for n, w in zip(counts, widths)))
    if report.args is not None:
        ignored = f" ({len(report.args.ignored)} ignored)" if report.args.ignored else ""
        lines.append(f"args: {report.args.count} differ{ignored}")
    if report.common is not None:
        lines.append(f"common state and metadata.json: {report.common.count} differ")
    lines.append(_verdict(report))
    return "\n".join(lines)


def _render_values(v: ValuesReport) -> list[str]:
    mode = "bitwise" if v.mode == "bitwise" else f"atol={v.atol:g} rtol={v.rtol:g}"
    read = human_bytes(v.bytes_read["a"] + v.bytes_read["b"])
    lines = [
        f"values ({mode}): {v.compared} compared, {v.equal} equal, {v.different} differ, "
        f"{v.not_compared} not compared; max abs diff "
        f"{'-' if v.max_abs_diff is None else v.max_abs_diff}; read {read} in {v.seconds:.1f} s"
    ]
    for r in v.different_keys:
        parts = (
            [
                f"max abs diff {_num(r.max_abs_diff)}, max rel diff {_num(r.max_rel_diff)}, "
                f"norm of diff {_num(r.norm_diff)}, {r.mismatched} of {r.elements} elements"
            ]
            if r.kind == "tensor"
            else [f"sha256 {r.sha256_a[:12]} -> {r.sha256_b[:12]}"]
            if r.sha256_a and r.sha256_b
            else []
        )
        parts += [r.note] if r.note else []
        lines.append(f"  differs  {r.key}: " + "; ".join(parts))
        for m in r.mismatches or ():
            shown_a, shown_b = mismatch_values(m["a"], m["b"])
            lines.append(f"    [{', '.join(map(str, m['index']))}]  A {shown_a}  B {shown_b}")
        for f in r.fields or ():  # a bytes item's differing fields by path
            if f.change == "changed":
                lines.append(f"    {f.path}: {_short(f.a)} -> {_short(f.b)}")
            else:
                lines.append(f"    {f.path}: only in {'A' if f.change == 'only_a' else 'B'}: {_short(f.a or f.b)}")
        if r.fields is not None and r.fields_count is not None:
            lines += [line[2:] for line in _more(len(r.fields), r.fields_count)]
    lines += _more(len(v.different_keys), v.different)
    for r in v.not_compared_keys:
        lines.append(f"  not compared  {r.key}: {r.note}")
    lines += _more(len(v.not_compared_keys), v.not_compared)
    return lines


_STATS_HEADER = ("key", "slice", "L2 A", "L2 B", "L2 change", "std change", "mean change", "zeros A", "zeros B", "")


def _render_stats(stats: StatsDiff) -> list[str]:
    """A compact table, one row per key or per layer / expert of a stacked key, the largest change first."""
    lines = [
        f"stats (as check --health): {stats.keys} keys in {stats.count} rows (one per key or layer / expert), "
        f"{stats.changed} changed; largest change first"
    ]
    table = [_STATS_HEADER] + [_stats_cells(row) for row in stats.rows]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(_STATS_HEADER))]
    for cells in table:
        left = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        lines.append(("  " + "  ".join(left + [c.rjust(w) for c, w in zip(cells[2:], widths[2:])])).rstrip())
    lines += _more(len(stats.rows), stats.count)
    return lines


def _stats_cells(row: StatsRow) -> tuple[str, ...]:
    where = " ".join(f"{axis} {index}" for axis, index in row.slice.items()) or "-"
    return (
        row.key,
        where,
        _num(row.a.l2),
        _num(row.b.l2),
        _change(row.l2_change, row.a.l2, row.b.l2),
        _change(row.std_change, row.a.std, row.b.std),
        _change(row.mean_change, row.a.mean, row.b.mean),
        str(row.a.zeros),
        str(row.b.zeros),
        "same" if row.equal else "moved",
    )


@text_safe
def render_stats_series(report: StatsSeries) -> str:
    """``--all-iterations``: the per-layer table (the model weights of each decoder layer together: L2 norm per
    iteration, its change from the one before, the rows that moved), then one row per key or slice with its L2
    norm per iteration and the change."""
    its = report.iterations
    series = report.series
    lines = [
        f"save dir {report.save_dir}: iterations {', '.join(map(str, its))}",
        f"stats (as check --health): {series.keys} keys in {series.count} rows (one per key or layer / expert), "
        f"{series.changed} moved; change: of the L2 norm from the iteration before",
    ]
    if series.layers:
        lines += ["", "layers (model weights of each decoder layer together: L2 norm, change, rows moved)"]
        header = ("layer", *(f"iter {it}" for it in its))
        table = [header] + [
            (
                str(layer.layer),
                *(
                    _num(l2) if i == 0 else f"{_num(l2)} ({_change(change, prev, l2)}, {moved}/{layer.rows} moved)"
                    for i, (l2, change, moved, prev) in enumerate(
                        zip(layer.l2, layer.l2_change, layer.moved, [None, *layer.l2])
                    )
                ),
            )
            for layer in series.layers
        ]
        lines += _table(table, left=len(header))  # each cell starts with its L2 norm, under its header
    lines += ["", "keys (L2 norm per iteration, change from the iteration before)"]
    header = ("key", "slice", *(f"iter {it}" for it in its))
    rows = []
    for row in series.rows:
        at = {p.iteration: p for p in row.points}
        cells = []
        for it in its:
            point = at.get(it)
            if point is None:
                cells.append("-")
            elif point.equal_previous is None:
                cells.append(_num(point.stats.l2))
            else:
                cells.append(f"{_num(point.stats.l2)} ({'same' if point.equal_previous else _l2_change(point)})")
        rows.append((row.key, " ".join(f"{axis} {index}" for axis, index in row.slice.items()) or "-", *cells))
    lines += _table([header, *rows], left=2)
    lines += _more(len(series.rows), series.count)
    return "\n".join(lines)


def _l2_change(point: Any) -> str:
    change = point.l2_change
    return "from 0" if change is None else "0" if change == 0 else f"{change * 100:+.3g}%"


def _table(rows: list[tuple[str, ...]], left: int) -> list[str]:
    """Aligned columns: the first ``left`` to the left, the others to the right."""
    widths = [max(len(cells[i]) for cells in rows) for i in range(len(rows[0]))]
    out = []
    for cells in rows:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        out.append(("  " + "  ".join(parts)).rstrip())
    return out


CSV_HEADER = ("key", "layer", "expert", "iteration", "count", "zeros", "min", "max", "mean", "std", "l2", "rel_change")


@text_safe
def render_stats_csv(report: DiffReport | StatsSeries) -> str:
    """``--format csv``: one row per key (or slice) per iteration (``--all-iterations``) or per side (``A``,
    ``B``), for plotting; ``rel_change`` is the L2 norm's relative change from the iteration before (from A for
    B), empty where there is none."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    stats = getattr(report, "stats", None)
    if stats is not None:  # two checkpoints: A, then B with the change from A
        for pair in stats.rows:
            writer.writerow(_csv_cells(pair.key, pair.slice, "A", pair.a, None, first=True))
            writer.writerow(_csv_cells(pair.key, pair.slice, "B", pair.b, pair.l2_change, first=False))
    series = getattr(report, "series", None)
    for row in series.rows if series is not None else []:
        for i, point in enumerate(row.points):
            writer.writerow(_csv_cells(row.key, row.slice, point.iteration, point.stats, point.l2_change, i == 0))
    return out.getvalue().rstrip("\n")


def _csv_cells(
    key: str, where: dict[str, int], iteration: int | str, side: SliceStats, change: float | None, first: bool
) -> tuple[Any, ...]:
    def cell(x: Any) -> Any:
        return "" if x is None else repr(x) if isinstance(x, float) else x

    return (
        key,
        cell(where.get("layer")),
        cell(where.get("expert")),
        iteration,
        side.count,
        side.zeros,
        cell(side.min),
        cell(side.max),
        cell(side.mean),
        cell(side.std),
        cell(side.l2),
        "" if first or change is None else repr(change),
    )


def _change(change: float | None, a: float | None, b: float | None) -> str:
    if change is None:
        return "from 0" if a == 0 and b is not None else "-"
    return "0" if change == 0 else f"{change * 100:+.3g}%"


def _num(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def mismatch_values(a: Any, b: Any) -> tuple[str, str]:
    """Two differing elements as text that tells them apart: 6 significant digits, else 9 (any two float32), else
    every digit (1.0 and 1.0000001 both showed as 1)."""
    for shown in (_num, lambda x: f"{x:.9g}" if isinstance(x, float) else str(x), repr):
        pair = shown(a), shown(b)
        if pair[0] != pair[1]:
            return pair
    return pair


def _verdict(report: DiffReport) -> str:
    ignored = []
    if report.ignored.get("layout") and report.layout.differs:
        ignored.append(f"layout ({report.layout.count} keys chunked differently)" if report.layout.count else "layout")
    if report.args is not None and report.args.ignored:
        ignored.append(f"{len(report.args.ignored)} args")
    if report.args is not None and report.args.era and not report.ignored.get("strict_args"):
        ignored.append(f"{len(report.args.era)} args one side's core never saved (--strict-args)")
    suffix = f" (ignored: {', '.join(ignored)})" if ignored else ""
    if report.identical:
        return "no differences" + suffix
    s = report.summary
    layout = 0 if report.ignored.get("layout") else s["layout"]
    parts = [
        f"{n} {label if n != 1 else one}"
        for label, one, n in (
            ("keys only in A", "key only in A", s["only_a"]),
            ("keys only in B", "key only in B", s["only_b"]),
            ("kind/dtype/shape changes", "kind/dtype/shape change", s["changed"]),
            ("keys chunked differently (layout)", "key chunked differently (layout)", layout),
            ("args differ", "arg differs", s["args"]),
            ("common-state differences", "common-state difference", s["common"]),
            ("values differ", "value differs", s["values_different"]),
        )
        if n
    ]
    if report.layout.differs and not report.ignored.get("layout") and not s["layout"]:
        parts.append("layout differs")
    return "differences: " + ", ".join(parts) + suffix
