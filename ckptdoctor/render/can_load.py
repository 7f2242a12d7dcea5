"""Text rendering of ``ckptdoctor can-load`` (values read from the checkpoint are escaped by ``text_safe``)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from ckptdoctor.render.wrap import wrap_block
from ckptdoctor.text_safety import text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.can_load.predict import CanLoadReport
    from ckptdoctor.ops.can_load.suggest import SuggestReport


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
        if s.fix and s.verdict in ("fails", "corrupts"):  # flags and prose (not one command): breaks between flags only
            lines.append(wrap_block(f"{column}fix: {s.fix}", width, column + " " * len("fix: ")))
    lines += [wrap_block(f"warning: {w}", width, " " * len("warning: ")) for w in report.warnings]
    lines.append("")
    if report.will_load:
        lines.append("verdict: LOADS")
    elif report.verdict == "corrupts":
        corrupting = (
            f"verdict: LOADS WRONG (corrupts: {', '.join(report.failing_sections)}): megatron raises nothing, and "
            "the run goes on from another state"
        )
        lines.append(wrap_block(corrupting, width))
    else:
        failing = f"verdict: WILL NOT LOAD (fails: {', '.join(report.failing_sections)})"
        lines.append(wrap_block(failing, width))
    return "\n".join(lines)


@text_safe
def render_suggestions(report: SuggestReport, width: int | None = None) -> str:
    """The candidates that load, one block each (layout, what changes, the can-load command that repeats it,
    warnings), the ordering, how many more, and what was searched."""
    where = "the saved one" if report.world_source == "saved" else "--world-size"
    lines = [
        f"checkpoint: {report.iteration_dir} ({report.era or report.backend})",
        f"saved:  {_layout(report.saved)} (from {report.saved['source']})",
        f"world size: {report.world_size} ({where})",
        "",
    ]
    lines = [wrap_block(line, width) for line in lines]
    if report.suggestions:
        lines.append(wrap_block(f"it loads with ({report.ordering}):", width))
    number_width = len(str(len(report.suggestions)))
    indent = " " * (2 + number_width + 2)
    for n, s in enumerate(report.suggestions, 1):
        layout = " ".join(f"{k.upper()}={s.target[k]}" for k in ("tp", "pp", "ep", "etp", "cp", "dp"))
        changes = ", ".join(s.changes) or "as saved"
        lines.append(wrap_block(f"  {n:>{number_width}}  {layout}  {changes}", width, indent + "  "))
        command = shlex.join(["ckptdoctor", "can-load", report.path, *s.argv])
        lines.append(wrap_block(f"{indent}{command}", width, indent + "    "))
        lines += [wrap_block(f"{indent}warning: {w}", width, indent + " " * len("warning: ")) for w in s.warnings]
    if report.more:
        lines.append(f"  ... and {report.more} more (--limit 0 lists them all)")
    if report.suggestions:
        lines.append("")
    search = report.search
    if report.blocked:
        lines.append(
            wrap_block(
                f"not searched: a {', '.join(report.blocked)} failure holds at every layout, whatever the flags", width
            )
        )
    else:
        searched = (
            f"searched {search.layouts} layout{'s' if search.layouts != 1 else ''} of world size "
            f"{report.world_size}: {search.refused_at_startup} refused at startup, {search.predictions} "
            f"prediction{'s' if search.predictions != 1 else ''}"
        )
        if not search.complete:
            searched += " (stopped at the search bound: farther layouts not searched)"
        lines.append(wrap_block(searched, width))
    if report.will_load:
        lines.append(f"verdict: LOADS ({report.loading} candidate{'s' if report.loading != 1 else ''})")
    else:
        failing = ", ".join(report.as_saved_failing) or "none"
        lines.append(
            wrap_block(
                f"verdict: WILL NOT LOAD at any layout of world size {report.world_size}, with or without "
                f"--no-load-optim, --no-load-rng or another --strictness (at the saved layout it fails: {failing}; "
                "`can-load --target` says why)"
                + (
                    "; the _extra_state a Transformer Engine release refuses loads with --te-unsafe-pickle "
                    "(NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, for a trusted checkpoint) or another --te-version"
                    if "extra_state" in report.as_saved_failing
                    else ""
                ),
                width,
            )
        )
    return "\n".join(lines)
