"""Output of ``ckptdoctor show``: text (a table of the chunks, values and statistics asked for; decoded fields one
``path  value`` line each) and JSON of :class:`~ckptdoctor.ops.show.ShowReport` and
:class:`~ckptdoctor.ops.show.ValueReport`."""

from __future__ import annotations

import enum
import json
from typing import Any

from ckptdoctor.args import ARG_GROUPS, arg_group
from ckptdoctor.ops.show import ARGS, TEXT_CHUNK_LIMIT, ShowReport, ValueReport
from ckptdoctor.pickle.paths import leaves
from ckptdoctor.pickle.plain import ELIDED
from ckptdoctor.render.common import LABEL_INDENT, human_bytes, jsonable, short_value, tabulate
from ckptdoctor.render.wrap import wrap_block, wrap_lines
from ckptdoctor.text_safety import text_safe

TEXT_FIELD_LIMIT = 200  # decoded fields listed in text (JSON has the whole value, within the walks' bounds)


def to_json_text(report: ShowReport | ValueReport) -> str:
    return json.dumps(jsonable(report), indent=2)


def _text(value: Any) -> str:
    """A decoded value in one line: an enum by its name (``Signals.SIGTERM``, not 15), else as JSON shows it."""
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else short_value(value)


def _field_lines(value: Any, prefix: str = "") -> list[str]:
    """One aligned ``path  value`` line per leaf of a decoded value (at most :data:`TEXT_FIELD_LIMIT`)."""
    rows: list[tuple[str, str]] = []
    more = 0
    for path, leaf in leaves(value, prefix):
        if len(rows) >= TEXT_FIELD_LIMIT:
            more += 1
            continue
        text = "... (not walked further: node or depth limit)" if leaf is ELIDED else _text(leaf)
        rows.append((path or "(value)", text))
    width = max((len(p) for p, _ in rows), default=0)
    lines = [f"  {p:<{width}}  {v}" for p, v in rows]
    if more:
        lines.append(f"  ... {more} more field(s) (all in --format json)")
    return lines


def _render_value(report: ValueReport, width: int | None = None) -> str:
    lines = [
        f"checkpoint      {report.checkpoint}",
        f"source          {report.source}",
        f"path            {report.path}   ({report.type})",
    ]
    lines = wrap_lines(lines, width, LABEL_INDENT)
    lines.append("")
    if report.kind == ARGS and report.path == ARGS:
        values: dict[str, Any] = report.value
        name_width = max((len(n) for n in values), default=0)
        for group in (*ARG_GROUPS, "other"):
            names = [n for n in values if arg_group(n) == group]
            if names:
                lines.append(group)
                lines.extend(f"  {n:<{name_width}}  {_text(values[n])}" for n in names)
    else:
        fields = _field_lines(report.value)
        if len(fields) == 1 and fields[0].startswith("  (value)"):
            fields = [f"value           {_text(report.value)}"]
        lines.extend(fields or ["  (empty)"])
    if report.notes:
        lines.append("")
    lines.extend(wrap_block(note, width) for note in report.notes)
    return "\n".join(lines)


def render_value(report: ValueReport, width: int | None = None) -> str:
    """Text of ``show CKPT args[.NAME]`` / ``common[.PATH]``: every saved arg by group, or the value's fields one
    line each; label lines and notes wrapped to ``width`` (None: not wrapped), field lines never."""
    return text_safe(_render_value)(report, width)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def _render(report: ShowReport, width: int | None = None) -> str:
    shape = "-" if report.shape is None else "x".join(map(str, report.shape)) or "()"
    unit = "shard" if report.kind == "object" else "chunk"  # a sharded object: its shard grid
    lines = [
        f"checkpoint      {report.checkpoint}",
        f"key             {report.key}",
        f"section         {report.section}   kind {report.kind}",
        f"dtype           {report.dtype or '-'}",
        f"shard grid      {shape}" if unit == "shard" else f"global shape    {shape}   ({report.numel:,} elements)",
        f"on disk         {human_bytes(report.bytes)} in {len(report.chunks)} {unit}(s)",
    ]
    lines = wrap_lines(lines, width, LABEL_INDENT)
    if report.grid is not None:
        lines.append(f"chunk grid      {' x '.join(map(str, report.grid)) or '1'} (chunks per axis)")
    rows = [
        [
            i,
            "(" + ", ".join(map(str, c.offsets)) + ")",
            "x".join(map(str, c.sizes)) or "()",
            c.file or "-",
            "-" if c.offset is None else c.offset,
            "-" if c.length is None else c.length,
        ]
        for i, c in enumerate(report.chunks[:TEXT_CHUNK_LIMIT])
    ]
    lines.append("")
    lines.append(tabulate(rows, headers=[unit, "offsets", "sizes", "file", "at", "bytes"]))
    if len(report.chunks) > TEXT_CHUNK_LIMIT:
        lines.append(f"... {len(report.chunks) - TEXT_CHUNK_LIMIT} more {unit}(s) (all in --format json)")
    if report.stats is not None:
        s = report.stats
        lines.append("")
        lines.append(
            f"min {_num(s['min'])}   max {_num(s['max'])}   mean {_num(s['mean'])}   std {_num(s['std'])}"
            f"   (over {s['finite']:,} finite values"
            + (f"; {s['padding']:,} bucket padding elements, never written, left out" if s["padding"] else "")
            + ")"
        )
        lines.append(f"nan {s['nan']:,}   +inf {s['posinf']:,}   -inf {s['neginf']:,}")
    if report.slice is not None:
        sl = report.slice
        lines.append("")
        lines.append(f"slice [{sl['spec']}]  shape {'x'.join(map(str, sl['shape'])) or '()'}")
        lines.append(json.dumps(sl["values"]) if not isinstance(sl["values"], list) else _matrix(sl["values"]))
    if report.decoded is not None:
        lines.append("")
        lines.append("decoded (safe unpickler)")
        lines.extend(_field_lines(report.decoded))
    if report.extra_state is not None:
        lines.append("")
        lines.append("Transformer Engine extra state")
        lines.extend(_extra_state_lines(report))
    if report.saved:
        lines.append("")
        lines.append(wrap_block(f"saved           {report.saved}", width, LABEL_INDENT))
    lines.extend(wrap_block(note, width) for note in report.notes)
    return "\n".join(lines)


def _extra_state_lines(report: ShowReport) -> list[str]:
    lines = []
    for view in report.extra_state or []:
        name = view.item.rpartition("/")[2] or view.item
        state = view.state
        if state is None:
            lines.append(f"  {name}  unreadable: {view.error}")
            continue
        fp8 = "FP8 on" if state.fp8 else "FP8 off"
        head = f"  {name}  {state.generation}  ({state.form}, {state.payload_bytes} bytes)  {fp8}"
        lines.append(head)
        if state.recipe is not None:
            fields = ", ".join(f"{k}={v}" for k, v in state.recipe_fields.items())
            factory = f", factory {state.custom_factory}: refused" if state.custom_factory else ""
            lines.append(f"      recipe {state.recipe}" + (f"({fields})" if fields else "") + factory)
        if state.tensors:
            shapes = ", ".join(f"{k} {'x'.join(map(str, v)) or '()'}" for k, v in state.tensors.items())
            lines.append(f"      tensors {shapes}")
        if state.extra_fp8_variables:
            extra = ", ".join(f"{k}={v}" for k, v in state.extra_fp8_variables.items())
            lines.append(f"      extra_fp8_variables {extra}")
        verdict = {
            "refuse": "refused unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1",
            "ignore": "ignored (never unpickled)",
            "load": "loaded",
        }[state.te_2_18]
        needed = "needed (holds delayed-scaling state)" if state.needed else "redundant (no delayed-scaling state)"
        lines.append(f"      TE 2.16.1, 2.17.1, >= 2.18 at load: {verdict}; {needed}")
        if state.note:
            lines.append(f"      {state.note}")
    return lines


def _matrix(values: list) -> str:
    """Nested lists one innermost row per line."""
    if not values or not isinstance(values[0], list):
        return "[" + ", ".join(_num(v) for v in values) + "]"
    return (
        "\n".join(_matrix(v) for v in values)
        if not isinstance(values[0][0], list)
        else "\n\n".join(_matrix(v) for v in values)
    )


def render_show(report: ShowReport, width: int | None = None) -> str:
    """Text of ``show``: its label lines and notes wrapped to ``width`` (None: not wrapped); the chunk table and
    the values of a slice never."""
    return text_safe(_render)(report, width)
