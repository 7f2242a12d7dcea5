"""Output of ``ckptdoctor show``: text (a table of the chunks, values and statistics asked for) and JSON of
:class:`~ckptdoctor.ops.show.ShowReport`."""

from __future__ import annotations

import json
from typing import Any

from ckptdoctor.ops.show import TEXT_CHUNK_LIMIT, ShowReport
from ckptdoctor.render.common import LABEL_INDENT, human_bytes, jsonable, tabulate
from ckptdoctor.render.wrap import wrap_block, wrap_lines
from ckptdoctor.text_safety import text_safe


def to_json_text(report: ShowReport) -> str:
    return json.dumps(jsonable(report), indent=2)


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
            f"   (over {s['finite']:,} finite values)"
        )
        lines.append(f"nan {s['nan']:,}   +inf {s['posinf']:,}   -inf {s['neginf']:,}")
    if report.slice is not None:
        sl = report.slice
        lines.append("")
        lines.append(f"slice [{sl['spec']}]  shape {'x'.join(map(str, sl['shape'])) or '()'}")
        lines.append(json.dumps(sl["values"]) if not isinstance(sl["values"], list) else _matrix(sl["values"]))
    if report.saved:
        lines.append("")
        lines.append(wrap_block(f"saved           {report.saved}", width, LABEL_INDENT))
    lines.extend(wrap_block(note, width) for note in report.notes)
    return "\n".join(lines)


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
