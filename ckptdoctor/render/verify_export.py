"""Output of ``ckptdoctor verify-export``: text (the findings, a per layer / expert summary of what is missing,
``--stat`` counts, and a verdict line) or ``--name-only`` (the HF tensor names of the findings)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from ckptdoctor.render.common import plural
from ckptdoctor.render.wrap import wrap_block
from ckptdoctor.text_safety import escape_output

if TYPE_CHECKING:
    from ckptdoctor.ops.verify_export.report import VerifyExportReport

MAX_LISTED = 200  # findings listed in text; JSON has them all


_FINDING_HEAD = 26  # "severity code" columns: a finding's continuation lines start under its message


def render_verify_export(report: VerifyExportReport, stat: bool = False, width: int | None = None) -> str:
    export = (
        f"export      {report.hf_dir} ({report.model_type}, family {report.family}; "
        f"{plural(report.shards, 'shard')}, {plural(report.hf_tensors, 'tensor')})"
    )
    lines = [f"checkpoint  {report.checkpoint}", wrap_block(export, width, " " * 12)]
    shown = [f for f in report.findings if f.severity != "info" or stat]
    for finding in shown[:MAX_LISTED]:
        line = f"{finding.severity:<8} {finding.code:<16} {finding.message}"
        lines.append(wrap_block(line, width, " " * _FINDING_HEAD, head=_FINDING_HEAD))
    if len(shown) > MAX_LISTED:
        lines.append(f"... and {len(shown) - MAX_LISTED} more (--format json lists them all)")
    missing = Counter((f.layer, f.expert) for f in report.findings if f.code == "missing" and f.layer is not None)
    if missing:
        lines.append("missing by layer / expert:")
        for (layer, expert), n in sorted(
            missing.items(), key=lambda x: (x[0][0] or 0, -1 if x[0][1] is None else x[0][1])
        ):
            where = f"layer {layer}" + (f" expert {expert}" if expert is not None else "")
            lines.append(f"  {where}: {plural(n, 'tensor')}")
    if stat:
        by_code = Counter(f.code for f in report.findings)
        lines.append("findings by code: " + (", ".join(f"{c} {n}" for c, n in sorted(by_code.items())) or "none"))
        if report.values_compared:
            worst = max((t.max_abs_diff or 0.0 for t in report.tensors), default=0.0)
            lines.append(f"values: {plural(report.values_compared, 'tensor')} compared, largest abs diff {worst:.6g}")
    lines.extend(wrap_block(f"note: {note}", width, "      ") for note in report.notes)
    counts = report.counts
    values = f", values of {plural(report.values_compared, 'tensor')} compared" if report.values_compared else ""
    verdict = (
        f"{report.verdict}: {report.expected_tensors} expected tensors{values}; "
        f"{plural(counts['errors'], 'error')}, {plural(counts['warnings'], 'warning')}"
    )
    lines.append(wrap_block(verdict, width))
    return escape_output("\n".join(lines))


def _row(value: Any) -> dict[str, Any]:
    """A finding or tensor row as the generic JSON walk shows it: its fields, those marked omit-none only when set."""
    return {
        f.name: getattr(value, f.name)
        for f in dataclasses.fields(value)
        if getattr(value, f.name) is not None or not f.metadata.get("omit_none")
    }


def to_json_text(report: VerifyExportReport) -> str:
    """The report's JSON, the same document as ``render.common.echo_json`` writes, built directly: an export of
    100k tensors is 100k rows, which the generic bounded walk takes seconds over (its bounds guard values decoded
    from a checkpoint; every value here is a string, number or list of ints from the headers, or config.json's
    ``model_type`` as parsed)."""
    doc = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    doc["findings"] = [_row(f) for f in report.findings]
    doc["tensors"] = [_row(t) for t in report.tensors]
    return json.dumps(doc, indent=2, allow_nan=False)


def render_names(report: VerifyExportReport) -> str:
    """The HF tensor names (else the checkpoint key, else the shard) of the error and warning findings, once each."""
    names: list[str] = []
    for f in report.findings:
        if f.severity == "info":
            continue
        name = f.hf_name or f.megatron_key or f.shard
        if name and name not in names:
            names.append(name)
    return escape_output("\n".join(names))
