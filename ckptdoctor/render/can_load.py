"""Text rendering of ``ckptdoctor can-load`` (values read from the checkpoint are escaped by ``text_safe``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptdoctor.render.wrap import wrap_block
from ckptdoctor.text_safety import text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.can_load.predict import CanLoadReport


def _layout(layout: dict) -> str:
    return " ".join(f"{k.upper()}={layout[k]}" for k in ("tp", "pp", "ep", "etp", "cp", "dp", "world"))


@text_safe
def render_can_load(report: CanLoadReport, width: int | None = None) -> str:
    """The layouts, one block per section (verdict, why, megatron's error, the fix), the verdict. Lines are wrapped
    to ``width`` (None: not wrapped): a section's lines continue under their own text, flags and values whole."""
    lines = [
        f"checkpoint: {report.iteration_dir} ({report.era or report.backend})",
        f"saved:  {_layout(report.saved)} (from {report.saved['source']})",
        f"target: {_layout(report.target)}",
        "",
    ]
    lines = [wrap_block(line, width) for line in lines]
    name_width = max(len(s.section) for s in report.sections)
    column = " " * (2 + name_width + 2 + 8 + 2)  # where each section's text starts
    for s in report.sections:
        lines.append(wrap_block(f"  {s.section:<{name_width}}  {s.verdict:<8}  {s.why}", width, column + "  "))
        if s.error:
            lines.append(wrap_block(f"{column}megatron: {s.error}", width, column + " " * len("megatron: ")))
        if s.fix and s.verdict == "fails":  # flags and prose (not one command): breaks between flags only
            lines.append(wrap_block(f"{column}fix: {s.fix}", width, column + " " * len("fix: ")))
    lines += [wrap_block(f"warning: {w}", width, " " * len("warning: ")) for w in report.warnings]
    lines.append("")
    if report.will_load:
        lines.append("verdict: LOADS")
    else:
        failing = f"verdict: WILL NOT LOAD (fails: {', '.join(report.failing_sections)})"
        lines.append(wrap_block(failing, width))
    return "\n".join(lines)
