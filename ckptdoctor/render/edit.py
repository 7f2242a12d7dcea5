"""Text for ``ckptdoctor edit``: every key change (dry run) or counts, common-state changes, load flags, sizes."""

from __future__ import annotations

from ckptdoctor.logical_items import logical_key
from ckptdoctor.ops.edit.write import EditReport
from ckptdoctor.render.common import (
    LABEL_INDENT,
    columns,
    count_keys,
    human_bytes,
    keys_and_entries,
    short_value,
    summary_rows,
)
from ckptdoctor.render.wrap import wrap_block, wrap_lines
from ckptdoctor.text_safety import text_safe


def _common_line(what: str, name: str, old: object, new: object, reason: str) -> str:
    if what == "drop":
        return f"common state    drop {name} ({reason})"
    if what == "set-arg":
        return f"common state    args.{name}: {short_value(old)} -> {short_value(new)} ({reason})"
    return f"common state    content_metadata.{name}: {short_value(old)} dropped ({reason})"


@text_safe
def render_edit(
    report: EditReport, all_keys: bool = False, width: int | None = None, carried: str | None = None
) -> str:
    """Text for ``edit``: the changes counted in logical keys (DCP entries beside them), by reason on a dry run
    (every key with ``all_keys``), the load flags the result needs, what was written. Lines are wrapped to
    ``width`` (None: not wrapped), the tables are not. ``carried``: how the data files reached an output on
    object storage or from it (the writer hard-linked them in its staging dir)."""
    return "\n".join(wrap_lines(_edit_lines(report, all_keys, width, carried), width, LABEL_INDENT))


def _edit_lines(report: EditReport, all_keys: bool, width: int | None, carried: str | None = None) -> list[str]:
    plan, result = report.plan, report.result
    lines = [
        f"checkpoint      {plan.iteration_dir}",
        f"changes         {count_keys(plan.removed)} removed ({human_bytes(sum(c.bytes for c in plan.removed))}), "
        f"{count_keys(plan.renamed)} renamed, {keys_and_entries(plan.kept_keys, plan.kept_entries)} kept",
    ]
    if plan.dropped_sections:
        lines.append(f"sections        dropped: {', '.join(plan.dropped_sections)}")
    if report.dry_run and all_keys:
        rows = [["remove", c.key, "", human_bytes(c.bytes), c.reason] for c in plan.removed]
        rows += [["rename", c.key, c.new_key or "", human_bytes(c.bytes), c.reason] for c in plan.renamed]
        lines += ["", columns(rows, ["", "key", "new key", "size", "why"]), ""]
    elif report.dry_run and (plan.removed or plan.renamed):
        groups: dict[tuple[str, str], tuple[set[str], int, int]] = {}
        for action, changes in (("remove", plan.removed), ("rename", plan.renamed)):
            for c in changes:
                keys, entries, size = groups.get((action, c.reason), (set(), 0, 0))
                keys.add(logical_key(c.key, c.kind))
                groups[(action, c.reason)] = (keys, entries + 1, size + c.bytes)
        lines += ["", columns(summary_rows(groups), ["", "keys", "size", "why"]), "(--keys lists every key)", ""]
    for change in plan.common_changes:
        lines.append(_common_line(change.what, change.name, change.old, change.new, change.reason))
    flags = (
        " ".join(plan.load_flags)
        if plan.load_flags
        else "none certain: see below"
        if plan.load_notes
        else "none (a plain load works)"
    )
    lines.append(f"load flags      {flags}")
    lines += [wrap_block(f"{LABEL_INDENT}{note}", width, LABEL_INDENT + "  ") for note in plan.load_notes]
    if report.dry_run or result is None:
        how = "kept items byte-copied (--compact)" if report.compact else "new .metadata, data files hard-linked"
        lines.append(f"size after      ~{human_bytes(plan.bytes_kept)} of data referenced ({how})")
        lines.append("dry run         nothing written")
        return lines
    lines.append(f"written         {result.output}" + (" (in place)" if result.in_place else ""))
    if result.backup:
        lines.append(f"backup          {result.backup}")
    linked = f"{report.linked_files} {carried or 'hard-linked'}"
    data = f"{linked}, {report.copied_files} copied ({human_bytes(result.bytes_copied)})"
    lines.append(f"data files      {len(result.files)} files: {data}; written in {result.seconds:.2f} s")
    for name, why in result.skipped.items():
        lines.append(f"not carried     {name}: {why}")
    if result.resealed:
        how = "fresh sha256 of its own files" if report.compact else "linked files keep the source's sha256"
        lines.append(f"integrity.json  written for the output ({how})")
    lines.append(f"size before     {human_bytes(result.source_bytes)} ({result.source_bytes} bytes)")
    lines.append(
        f"size after      {human_bytes(result.output_bytes)} ({result.output_bytes} bytes"
        + ("" if report.compact or carried else "; linked files share the source's blocks")
        + ")"
    )
    return lines
