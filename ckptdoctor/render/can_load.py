"""Text rendering of ``ckptdoctor can-load`` (values read from the checkpoint are escaped by ``text_safe``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptdoctor.text_safety import text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.can_load.predict import CanLoadReport


def _layout(layout: dict) -> str:
    return " ".join(f"{k.upper()}={layout[k]}" for k in ("tp", "pp", "ep", "etp", "cp", "dp", "world"))


@text_safe
def render_can_load(report: CanLoadReport) -> str:
    lines = [
        f"checkpoint: {report.iteration_dir} ({report.era or report.backend})",
        f"saved:  {_layout(report.saved)} (from {report.saved['source']})",
        f"target: {_layout(report.target)}",
        "",
    ]
    width = max(len(s.section) for s in report.sections)
    for s in report.sections:
        lines.append(f"  {s.section:<{width}}  {s.verdict:<8}  {s.why}")
        if s.error:
            lines.append(f"  {'':<{width}}  {'':<8}  megatron: {s.error}")
        if s.fix and s.verdict == "fails":
            lines.append(f"  {'':<{width}}  {'':<8}  fix: {s.fix}")
    lines += [f"warning: {w}" for w in report.warnings]
    lines.append("")
    if report.will_load:
        lines.append("verdict: LOADS")
    else:
        lines.append(f"verdict: WILL NOT LOAD (fails: {', '.join(report.failing_sections)})")
    return "\n".join(lines)
