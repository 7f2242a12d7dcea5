"""Rendering: text tables (tabulate) and JSON. Operations return data; this turns it into output.

Every text renderer is wrapped in :func:`~ckptdoctor.text_safety.text_safe`: control characters in values read
from a checkpoint are escaped, so a checkpoint cannot drive the terminal. JSON needs nothing (json.dumps escapes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptdoctor.formats.plain_dcp import STEP_DIR_RE
from ckptdoctor.locate import TRACKER_NAME
from ckptdoctor.logical_items import logical_key
from ckptdoctor.pickle.plain import iter_json, to_plain
from ckptdoctor.render.wrap import wrap_block, wrap_lines
from ckptdoctor.rules.safety import stand_ins_note
from ckptdoctor.text_safety import text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.fix_args.plan import FixArgsReport
    from ckptdoctor.ops.inspect import InspectReport
    from ckptdoctor.ops.strip.write import StripReport
    from ckptdoctor.rules import RuleInfo


def jsonable(value: Any) -> Any:
    """Plain JSON values; dataclasses become dicts, stand-ins and dtypes their readable form (bounded:
    see :mod:`ckptdoctor.pickle.plain`, a checkpoint's values can expand exponentially)."""
    return to_plain(value)


def to_json(report: Any) -> str:
    return "".join(iter_json(report))


def echo_json(report: Any) -> None:
    """Print a report as JSON, piece by piece (a 200k-key report is never held as a tree of plain values)."""
    out = sys.stdout  # looked up now, as click.echo does (tests capture it)
    for piece in iter_json(report):
        out.write(piece)
    out.write("\n")
    out.flush()


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def tabulate(*args: Any, **kwargs: Any) -> str:
    """tabulate, imported on first use: it costs ~50 ms of start-up that ``check`` (a pre-commit hook) skips."""
    from tabulate import tabulate as _tabulate

    return _tabulate(*args, **kwargs)


def columns(rows: list[list[str]], headers: list[str]) -> str:
    """A table of strings, laid out as tabulate's "simple" format but without its per-cell type detection (a
    200k-key plan has ~800k cells: tabulate spent 72% of a dry run's time guessing their types)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                widths[i] = len(cell)

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 key``, ``2 keys``, ``1 entry``, ``3 entries``."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def keys_and_entries(keys: int, entries: int) -> str:
    """Logical keys first (as inspect and diff count them: a sharded object is one key), DCP entries beside."""
    return f"{plural(keys, 'key')} ({plural(entries, 'entry', 'entries')})"


def count_keys(decisions: list[Any]) -> str:
    """:func:`keys_and_entries` of a plan's decisions (each has ``key`` and ``kind``)."""
    return keys_and_entries(len({logical_key(d.key, d.kind) for d in decisions}), len(decisions))


def summary_rows(groups: dict[tuple[str, str], tuple[set[str], int, int]]) -> list[list[str]]:
    """Rows of a plan's summary: (action, why) -> its logical keys, DCP entries and bytes, largest first."""
    ordered = sorted(groups.items(), key=lambda item: (item[0][0], -item[1][2]))
    return [
        [action, keys_and_entries(len(keys), entries), human_bytes(size), why]
        for (action, why), (keys, entries, size) in ordered
    ]


LABEL_INDENT = " " * 16  # continuation lines of a "label           value" line start under the value


@text_safe
def render_inspect(report: InspectReport, width: int | None = None) -> str:
    """Text of ``inspect``; prose lines wrapped to ``width`` (None: not wrapped), tables and the fix line never."""
    fmt = report.format
    lines = [f"checkpoint      {report.iteration_dir}"]
    if report.save_dir:
        tracker = f"tracker says {report.tracker['value']}" if report.tracker else "no tracker"
        if not report.tracker and STEP_DIR_RE.match(Path(report.iteration_dir).name):
            tracker = "no tracker; TorchTitan resumes from the newest step-N"
        if report.tracker and not report.tracker["path"].endswith(TRACKER_NAME):  # Megatron-Bridge's, the only one
            tracker = f"Megatron-Bridge's tracker says {report.tracker['value']}, no {TRACKER_NAME}"
        bridge = (report.tracker or {}).get("bridge")
        if bridge is not None and bridge != report.tracker["value"]:  # type: ignore[index]
            tracker += f"; Megatron-Bridge's latest_train_state.pt says {bridge}"
        lines.append(f"save dir        {report.save_dir} ({tracker})")
    meta = ", ".join(f"{k}={v}" for k, v in fmt["metadata_json"].items())
    lines.append(f"format          {fmt['era']}")
    if fmt.get("flavour") is not None:  # plain DCP: Megatron would read a metadata.json here as torch_dist
        meta = "none (plain PyTorch DCP: loaded with torch.distributed.checkpoint)"
    lines.append(f"metadata.json   {meta}")
    if fmt["dcp_version"] is not None or fmt["metadata_class"]:
        version = f"version {fmt['dcp_version']}" if fmt["dcp_version"] is not None else "no version field"
        lines.append(f"DCP metadata    {version}, {fmt['metadata_class']}")
    if fmt.get("flavour") is not None and fmt["common_source"] is not None:
        lines.append(f"common state    top-level items of the state dict ({fmt['common_source']}, iteration, ...)")
    elif fmt.get("flavour") is not None:
        lines.append("common state    none (the state dict is all there is)")
    else:
        lines.append(f"common state    {fmt['common_source']}")
    iteration = "release" if report.release else report.iteration
    version = fmt["checkpoint_version"]
    lines.append(f"iteration       {iteration}   checkpoint_version {'none saved' if version is None else version}")
    files = report.data_files
    count = files["count"]
    line = f"data files      {count} file{'' if count == 1 else 's'}, {human_bytes(files['bytes'])}"
    missing = files.get("missing") or []
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        verb = "is" if len(missing) == 1 else "are"
        line += f"; {len(missing)} more the index references {verb} MISSING: {shown} (check: CKD113)"
    lines.append(line)
    lines.append(f"saved layout    {report.layout['summary']}")
    if report.stand_ins_read:
        lines.append(stand_ins_note(report.stand_ins_read))
    lines = wrap_lines(lines, width, LABEL_INDENT)
    lines.append("")
    rows = [
        [name, t["keys"], t["tensors"], t["bytes_items"], t["entries"], f"{t['parameters']:,}", human_bytes(t["bytes"])]
        for name, t in report.sections.items()
        if t["keys"]
    ]
    lines.append(
        tabulate(
            rows,
            headers=["section", "keys", "tensors", "objects", "entries", "parameters", "size"],
            colalign=("left", "right", "right", "right", "right", "right", "right"),
        )
    )
    if report.args is not None:
        lines.append("")
        if getattr(report, "args_source", None):
            none_saved = f"args            (none saved; Megatron-Bridge's {report.args_source}, model section)"
            lines.append(wrap_block(none_saved, width, LABEL_INDENT))
        else:
            lines.append("args")
        for group, values in report.args.items():
            if values:
                shown = "  ".join(f"{k}={short_value(v)}" for k, v in values.items())
                lines.append(wrap_block(f"  {group}: {shown}", width, " " * (len(group) + 4), sep="  "))
    else:
        lines.append("")
        lines.append("args            (none saved in the common state)")
    findings = getattr(report, "arg_findings", None) or []
    if findings:
        lines.append("")
        head = f"inconsistent args ({len(findings)}): the saved args contradict the checkpoint's parallelism"
        lines.append(wrap_block(head, width))
        for f in findings:
            correct = "" if f["correct"] is None else f" (should be {short_value(f['correct'])})"
            finding = f"  {f['code']} [{f['severity']}] {f['arg']}={short_value(f['saved'])}{correct}: {f['reason']}"
            lines.append(wrap_block(finding, width))
        lines.append(f"  fix: ckptdoctor fix-args {report.iteration_dir} -o DIR (or --in-place)")
    if report.extra_state is not None:
        lines.extend(_extra_state_census_lines(report.extra_state, width))
    lines.append("")
    common_keys = "common state keys: " + ", ".join(report.common_state_keys)
    lines.append(wrap_block(common_keys, width, " " * len("common state keys: ")))
    if report.keys is not None:
        lines.append("")
        rows = [
            [
                r.key,
                r.kind,
                r.dtype or "-",
                "-" if r.shape is None else "x".join(map(str, r.shape)) or "()",
                r.chunks,
                human_bytes(r.bytes),
            ]
            for r in report.keys
        ]
        lines.append(tabulate(rows, headers=["key", "kind", "dtype", "global shape", "chunks", "size"]))
    return "\n".join(lines)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"


def _extra_state_census_lines(census: Any, width: int | None) -> list[str]:
    lines = ["", f"Transformer Engine extra state ({census.items} items)"]
    if census.unreadable:
        lines.append(f"  unreadable      {census.unreadable} (refused by the gate or damaged: see check)")
    lines.append(wrap_block(f"  generations     {_counts(census.generations)}", width, " " * 18))
    lines.append(wrap_block(f"  recipes         {_counts(census.recipes)}", width, " " * 18))
    lines.append(f"  FP8             {census.fp8_on} on, {census.fp8_off} off")
    if census.te_2_18_refused:
        lines.append(
            wrap_block(
                f"  refused         {census.te_2_18_refused} at load by TE 2.16.1, 2.17.1 and >= 2.18 unless "
                "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (check: CKD230)",
                width,
                " " * 18,
            )
        )
    lines.append(f"  redundant       {census.redundant} (no delayed-scaling state: --drop-redundant-extra-state)")
    if census.rows:
        rows = [
            [
                r.module,
                r.generation,
                r.form,
                r.recipe or "-",
                "on" if r.fp8 else "off",
                "-" if r.amax_history_len is None else r.amax_history_len,
                r.te_2_18,
                r.count,
            ]
            for r in census.rows
        ]
        lines.append("")
        lines.append(
            tabulate(rows, headers=["module", "generation", "form", "recipe", "FP8", "history", "refusing TE", "items"])
        )
    return lines


def short_value(value: Any, limit: int = 200) -> str:
    """A value as JSON text (strings bare), cut to ``limit`` characters."""
    plain = jsonable(value)
    text = plain if isinstance(plain, str) else json.dumps(plain)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fix_args_table(findings: list[Any], width: int | None) -> list[str]:
    """The findings as a table (one element of the list: a table is never wrapped), the errors megatron-core would
    raise below. Where the table is wider than ``width`` (None: never), the free-text "why" column leaves it:
    each finding's why is its row's continuation, wrapped under the arg column, so a finding stays one block."""
    rows = []
    for f in findings:
        inherited = {True: "yes", False: "no", None: "-"}[f.inherited]
        rows.append([f.code, f.arg, short_value(f.saved), short_value(f.correct), f.severity, inherited, f.reason])
    headers = ["code", "arg", "saved", "correct", "severity", "inherited", "why"]
    table = tabulate(rows, headers=headers)
    if width is not None and max(map(len, table.split("\n"))) > width:
        head, rule, *row_lines = tabulate([row[:-1] for row in rows], headers=headers[:-1]).split("\n")
        indent = " " * (rule.index(" ") + 2)  # under the arg column
        blocks = [head, rule]
        for row, line in zip(rows, row_lines):  # one line per row: values are single lines (text_safe)
            blocks += [line, wrap_block(indent + row[-1], width, indent)]
        table = "\n".join(blocks)
    lines = [table]
    errors = [f for f in findings if f.megatron_error]
    if errors:
        lines.append("")
        lines.append("megatron-core would raise:")
        lines.extend(f"  ValueError: {f.megatron_error}" for f in errors)
    return lines


@text_safe
def render_fix_args(report: FixArgsReport, width: int | None = None) -> str:
    """Report mode: the findings, then what a write would change. Write mode leads with what was wrong and
    what was changed, then what was written and the re-check of the written checkpoint. Lines are wrapped to
    ``width`` (None: not wrapped); the tables are not."""
    lines = [f"{report.checkpoint}: saved layout {report.layout}; {report.era}"]
    if report.config_source != "args":
        lines.append(f"no args saved: Megatron-Bridge's {report.config_source} (model section) checked in their place")
    if report.source:
        lines.append(f"source: {report.source}")
    written = report.written
    if report.findings:
        lines.append("")
        n = len(report.findings)
        lines.append(
            f"was wrong ({n} inconsistent arg{'s' if n != 1 else ''}):"
            if written
            else f"{n} inconsistent arg{'s' if n != 1 else ''}:"
        )
        lines.extend(_fix_args_table(report.findings, width))
    else:
        lines.append(
            "args were consistent with the checkpoint's parallelism"
            if written
            else "args are consistent with the checkpoint's parallelism"
        )
    if written and report.changes:
        lines.append("")
        lines.append("changed:")
        lines.extend(f"  {c.arg}: {short_value(c.old)} -> {short_value(c.new)} ({c.why})" for c in report.changes)
    consistent = [i for i in report.inherited if i.consistent]
    if consistent:
        shown = ", ".join(f"{i.arg}={short_value(i.value)}" for i in consistent)
        lines.append(f"inherited from the source but consistent (kept): {shown}")
    if report.changes and not written:
        lines.append("")
        lines.append("would change (write with -o DIR or --in-place):")
        lines.extend(f"  {c.arg}: {short_value(c.old)} -> {short_value(c.new)} ({c.why})" for c in report.changes)
        if report.would_remain:
            n = len(report.would_remain)
            lines.append("")
            lines.append(
                f"after the change{'s' if len(report.changes) != 1 else ''}: {n} inconsistent "
                f"arg{'s' if n != 1 else ''} would remain:"
            )
            lines.extend(_fix_args_table(report.would_remain, width))
    if written:
        w = written
        lines.append("")
        lines.append(
            f"wrote {w.iteration_dir} ({w.mode}): {len(w.written)} file(s) written, "
            f"{w.linked} linked, {w.copied} copied"
        )
        for backup in w.backups:
            lines.append(f"  backup: {backup}")
        if w.run_config_args:
            lines.append(f"  run_config.yaml updated: {', '.join(w.run_config_args)}")
        if w.integrity_updated:
            lines.append("  integrity.json updated for the rewritten files")
    if report.remaining is not None:
        lines.append("")
        if report.remaining:
            n = len(report.remaining)
            lines.append(f"after writing: {n} inconsistent arg{'s' if n != 1 else ''} remain{'s' if n == 1 else ''}:")
            lines.extend(_fix_args_table(report.remaining, width))
        else:
            lines.append("after writing: the args are consistent with the checkpoint's parallelism")
    lines.extend(report.notes)
    return "\n".join(wrap_lines(lines, width))


# --- strip-frozen ------------------------------------------------------------------------------------------


@text_safe
def render_strip(report: StripReport, all_keys: bool = False, width: int | None = None) -> str:
    """Text for ``strip-frozen``: the source used, kept/dropped logical keys (and DCP entries beside them), the
    plan by reason (every key with ``all_keys``) on a dry run, or what was written; sizes before/after. Lines
    are wrapped to ``width`` (None: not wrapped), the tables are not."""
    return "\n".join(wrap_lines(_strip_lines(report, all_keys, width), width, LABEL_INDENT))


def _strip_lines(report: StripReport, all_keys: bool, width: int | None) -> list[str]:
    plan, result = report.plan, report.result
    model_kept = [d for d in plan.kept if d.section == "model"]
    other_kept = [d for d in plan.kept if d.section != "model"]
    # With nothing frozen, the only keys a (--force) write drops are the model's _extra_state items.
    dropped = (
        f"{count_keys(plan.dropped)} dropped ({plan.dropped_model_params:,} frozen params)"
        if not report.nothing_frozen
        else f"{count_keys(plan.dropped)} of model _extra_state dropped with --force"
        if plan.dropped
        else "none dropped"
    )
    lines = [
        f"checkpoint      {plan.iteration_dir}",
        f"trainable from  {plan.trainable_source} ({plan.trainable_detail})",
        f"model section   {count_keys(model_kept)} kept ({plan.kept_model_params:,} trainable params), {dropped}",
        f"other sections  {count_keys(other_kept)} kept untouched",
    ]
    if report.nothing_frozen:
        force = (
            "--force writes a copy without the model _extra_state" + (" (the plan below)" if report.dry_run else "")
            if plan.dropped
            else "there is no model _extra_state to drop either"
        )
        nothing = (
            f"no frozen parameters: every model parameter is trainable ({plan.trainable_source}), "
            f"so there is nothing to strip; {force}"
        )
        lines.append(wrap_block(nothing, width))
        if report.result is None and not report.dry_run:
            lines.append("nothing written")
            return lines
    if report.dry_run:
        lines.append("")
        if all_keys:
            rows = [["keep", d.key, human_bytes(d.bytes), d.reason] for d in plan.kept]
            rows += [["drop", d.key, human_bytes(d.bytes), d.reason] for d in plan.dropped]
            lines.append(columns(rows, ["", "key", "size", "why"]))
        else:
            groups: dict[tuple[str, str], tuple[set[str], int, int]] = {}
            for action, decisions in (("keep", plan.kept), ("drop", plan.dropped)):
                for d in decisions:
                    keys, entries, size = groups.get((action, d.reason), (set(), 0, 0))
                    keys.add(logical_key(d.key, d.kind))
                    groups[(action, d.reason)] = (keys, entries + 1, size + d.bytes)
            lines.append(columns(summary_rows(groups), ["", "keys", "size", "why"]))
            lines.append("(--keys lists every key)")
        lines.append("")
        ratio = plan.bytes_after / plan.bytes_before if plan.bytes_before else 0.0
        lines.append(f"size before     {human_bytes(plan.bytes_before)} ({plan.bytes_before} bytes)")
        lines.append(
            f"size after      ~{human_bytes(plan.bytes_after)} ({plan.bytes_after} bytes, {ratio:.1%}; "
            "estimate; dry run, nothing written)"
        )
        return lines
    if result is None:  # no dry run and nothing written: only the nothing-frozen refusal above ends so
        return lines
    lines.append(f"written         {result.output}" + (" (in place)" if result.in_place else ""))
    if result.backup:
        lines.append(f"backup          {result.backup}")
    lines.append(
        f"data files      {len(result.files)} files, {human_bytes(result.bytes_copied)} copied; "
        f"written in {result.seconds:.2f} s"
    )
    for name, why in result.skipped.items():
        lines.append(f"not carried     {name}: {why}")
    for change in result.args_changed:
        lines.append(
            f"args            {change['arg']}: {short_value(change['old'])} -> {short_value(change['new'])} "
            "(as Megatron saves it; --keep-args keeps the saved value)"
        )
    if result.resealed:
        lines.append("integrity.json  written afresh for the output (sha256 of its own files; the source's verified)")
    ratio = result.output_bytes / result.source_bytes if result.source_bytes else 0.0
    lines.append(f"size before     {human_bytes(result.source_bytes)} ({result.source_bytes} bytes)")
    lines.append(f"size after      {human_bytes(result.output_bytes)} ({result.output_bytes} bytes, {ratio:.1%})")
    return lines


# --- rules (check's own output: render/check.py) ---------------------------------------------


def render_rules(rules: list[RuleInfo]) -> str:
    """Each rule: code, name, severity and summary, with its rationale and the command that fixes it below."""
    import textwrap

    blocks = []
    for rule in rules:
        head = f"{rule.code}  {rule.name}  [{rule.severity}]  {rule.summary}"
        body = textwrap.fill(rule.rationale, width=100, initial_indent="        ", subsequent_indent="        ")
        fix = f"fix: {rule.fix}" if getattr(rule, "fix", None) else "fix: none (no automatic fix)"
        blocks.append(f"{head}\n{body}\n        {fix}")
    return "\n".join(blocks)
