"""Text rendering of ``ckptdoctor diff`` (JSON goes through :func:`ckptdoctor.report.to_json`).

Kept apart from report.py so that the diff's many sections do not crowd the shared renderer.
"""

from __future__ import annotations

import json
from typing import Any

from ckptdoctor.report import human_bytes, jsonable
from ckptdoctor.text_safety import text_safe

_MAX_VALUE = 80


def _short(value: Any) -> str:
    plain = jsonable(value)
    text = plain if isinstance(plain, str) else json.dumps(plain)
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def _more(shown: int, count: int) -> list[str]:
    return [f"    ... {count - shown} more (--limit N, --all)"] if count > shown else []


def _shape(meta: dict) -> str:
    shape = meta.get("shape")
    return "-" if shape is None else "x".join(map(str, shape)) or "()"


@text_safe
def render_diff(report: Any) -> str:
    a, b = report.a, report.b
    lines = [f"A  {a.iteration_dir}  [{a.era}]", f"B  {b.iteration_dir}  [{b.era}]"]
    filters = {k: v for k, v in report.filters.items() if v}
    if filters:
        lines.append("filters  " + "  ".join(f"{k}={','.join(v)}" for k, v in filters.items()))
    lines += ["", "keys"]
    any_keys = False
    for section, keys in report.keys.items():
        if not (keys.only_a.count or keys.only_b.count or keys.common):
            continue
        any_keys = True
        lines.append(f"  {section:<10} only in A: {keys.only_a.count:<5} only in B: {keys.only_b.count:<5} "
                     f"in both: {keys.common}")
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
    lines += ["", f"layout  {layout.summary}"]
    if layout.count:
        lines.append(f"  {layout.count} keys chunked differently (layout, not content):")
        for change in layout.keys:
            lines.append(f"    {change.key}: {change.a} -> {change.b}")
        lines += _more(len(layout.keys), layout.count)

    if report.args is not None:
        args = report.args
        lines += ["", f"args: {args.count} differ" + ("" if args.compared else " (args missing on one side)")]
        for group, changes in args.groups.items():
            if not changes:
                continue
            lines.append(f"  {group}:")
            for c in changes:
                if c.change == "only_a":
                    lines.append(f"    {c.name}: {_short(c.a)} (only in A)")
                elif c.change == "only_b":
                    lines.append(f"    {c.name}: {_short(c.b)} (only in B)")
                else:
                    lines.append(f"    {c.name}: {_short(c.a)} -> {_short(c.b)}")
        if args.flags:
            lines.append("  args contradicting their own checkpoint's layout:")
            for f in args.flags:
                same = ", equal in A and B" if f.equal_in_both else ""
                lines.append(f"    {f.side.upper()} {f.code} {f.severity}: {f.arg}={_short(f.saved)} "
                             f"(should be {_short(f.correct)}{same}): {f.reason}")
    if report.common is not None:
        lines += ["", f"common state and metadata.json: {report.common.count} differ"]
        for c in report.common.items:
            if c.change == "only_a":
                lines.append(f"  {c.field}: only in A: {_short(c.a)}")
            elif c.change == "only_b":
                lines.append(f"  {c.field}: only in B: {_short(c.b)}")
            else:
                lines.append(f"  {c.field}: {_short(c.a)} -> {_short(c.b)}")
    if report.era:
        lines += ["", "era (not content differences):"]
        lines += [f"  {note}" for note in report.era]
    if report.values is not None:
        lines += [""] + _render_values(report.values)
    lines += ["", _verdict(report)]
    return "\n".join(lines)


def _render_values(v: Any) -> list[str]:
    mode = "bitwise" if v.mode == "bitwise" else f"atol={v.atol:g} rtol={v.rtol:g}"
    read = human_bytes(v.bytes_read["a"] + v.bytes_read["b"])
    lines = [f"values ({mode}): {v.compared} compared, {v.equal} equal, {v.different} differ, "
             f"{v.not_compared} not compared; max abs diff {v.max_abs_diff}; read {read} in {v.seconds:.1f} s"]
    for r in v.different_keys:
        parts = [f"max abs diff {r.max_abs_diff}, {r.mismatched} of {r.elements} elements"] if r.kind == "tensor" \
            else [f"sha256 {r.sha256_a[:12]} -> {r.sha256_b[:12]}"] if r.sha256_a and r.sha256_b else []
        parts += [r.note] if r.note else []
        lines.append(f"  differs  {r.key}: " + "; ".join(parts))
    lines += _more(len(v.different_keys), v.different)
    for r in v.not_compared_keys:
        lines.append(f"  not compared  {r.key}: {r.note}")
    lines += _more(len(v.not_compared_keys), v.not_compared)
    return lines


def _verdict(report: Any) -> str:
    if report.identical:
        return "no differences"
    s = report.summary
    parts = [f"{n} {label}" for label, n in (
        ("keys only in A", s["only_a"]), ("keys only in B", s["only_b"]), ("kind/dtype/shape changes", s["changed"]),
        ("layout differences", s["layout"]), ("args differ", s["args"]), ("common-state differences", s["common"]),
        ("values differ", s["values_different"])) if n]
    return "differences: " + ", ".join(parts)
