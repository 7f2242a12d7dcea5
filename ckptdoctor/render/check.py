"""Output of ``ckptdoctor check``: text (ruff-style lines), ``--statistics``, GitHub workflow annotations, SARIF.

JSON is :func:`ckptdoctor.render.common.to_json` of the report itself. Text renderers escape control characters
(:func:`~ckptdoctor.text_safety.text_safe`); annotations escape them and percent-encode what GitHub's
workflow-command syntax reserves; SARIF is JSON (json.dumps escapes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptdoctor import __version__
from ckptdoctor.render.wrap import wrap_block
from ckptdoctor.rules.registry import all_rules, rule_by_code
from ckptdoctor.text_safety import escape, text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.check import CheckReport


FORMATS = ("text", "json", "github", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


@text_safe
def render_check(report: CheckReport, quiet: bool = False, statistics: bool = False, width: int | None = None) -> str:
    """``<path>: <code> [<severity>] <message>`` per finding, its fix command indented below when one fixes it
    (or, with ``statistics``, counts per code), then a one-line summary (unless ``quiet``).

    A finding longer than ``width`` (None: not wrapped) continues on lines indented as its fix line; the fix
    line itself, a command, is never broken (nor is the ``--statistics`` table)."""
    if statistics:
        lines = _statistics_lines(report)
    else:
        lines = []
        for f in report.findings:
            head = f"{f.path}: {f.code} [{f.severity}]"
            lines.append(wrap_block(f"{head} {f.message}", width, head=len(head)))
            if f.fix:
                lines.append(f"    fix: {f.fix}")
    if quiet:
        return "\n".join(lines)
    lines += [wrap_block(line, width) for line in _config_lines(report)]
    summary = len(lines)
    n = len(report.checked)
    where = _plural(n, "checkpoint")
    overridden = len(report.gate.overridden)
    if report.gate.trusted:
        lines.append(f"Trusted globals (--trust-global): {', '.join(report.gate.trusted)}.")
        where += f"; {_plural(overridden, 'safety finding')} overridden by --trust-global"
    notes = report.counts.get("info", 0)
    if notes:  # info findings (what a newer release would refuse) are no problems: they do not fail the check
        where += f"; {_plural(notes, 'info finding')}"
    if not report.clean:
        errors, warnings = report.counts.get("error", 0), report.counts.get("warning", 0)
        fixable = sum(1 for f in report.findings if f.fix)
        fix_note = f"; {fixable} fixable (see the fix: lines)" if fixable and not statistics else ""
        lines.append(
            f"Found {_plural(errors + warnings, 'problem')} ({_plural(errors, 'error')}, "
            f"{_plural(warnings, 'warning')}) in {where}{fix_note}."
        )
    elif n == 0:
        skipped = f" (no checkpoint holds the {_plural(len(report.skipped), 'file')} given)" if report.skipped else ""
        lines.append(f"No checkpoint checked{skipped}.")
    else:
        lines.append(f"All checks passed ({where}).")
    lines[summary:] = [wrap_block(line, width) for line in lines[summary:]]
    return "\n".join(lines)


def _config_lines(report: CheckReport) -> list[str]:
    """Where settings came from, when a config file changed anything or one was passed over."""
    config = report.config
    if config is None:
        return []
    lines = []
    if config.path is not None and config.changed:
        settings = ", ".join(f"{key}={json.dumps(value)}" for key, value in config.changed.items())
        lines.append(f"Config: {config.path} [tool.ckptdoctor] set {settings}.")
    for passed in config.not_read:
        lines.append(f"Config: {passed} not read (inside a checkpoint dir: a checkpoint never configures its check).")
    return lines


def statistics(report: CheckReport) -> list[dict[str, Any]]:
    """Findings counted per code (most frequent first, then by code), with the rule's name and fix command."""
    rules = rule_by_code()
    counts: dict[str, dict[str, Any]] = {}
    for f in report.findings:
        rule = rules.get(f.code)
        row = counts.setdefault(
            f.code,
            {
                "code": f.code,
                "name": rule.name if rule else "",
                "count": 0,
                "error": 0,
                "warning": 0,
                "fix": rule.fix if rule else None,
            },
        )
        row["count"] += 1
        row[f.severity] = row.get(f.severity, 0) + 1
    return sorted(counts.values(), key=lambda r: (-r["count"], r["code"]))


def _statistics_lines(report: CheckReport) -> list[str]:
    rows = statistics(report)
    if not rows:
        return []
    width = max(len(str(r["count"])) for r in rows)
    name_width = max(len(r["name"]) for r in rows)
    lines = []
    for r in rows:
        severity = "/".join(s for s in ("error", "warning", "info") if r.get(s)) or "error"
        fix = f"fix: {r['fix']}" if r["fix"] else ""
        lines.append(
            f"{r['count']:>{width}}  {r['code']}  {r['name']:<{name_width}}  {'[' + severity + ']':<15}{fix}".rstrip()
        )
    return lines


# --- GitHub workflow annotations -----------------------------------------------------------------------------


def _gh_data(text: str) -> str:
    return escape(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(report: CheckReport) -> str:
    """One ``::error``/``::warning`` workflow command per finding (file, title = code; the fix in the
    message), shown by GitHub Actions on the run and the files of a pull request."""
    lines = []
    for f in report.findings:
        level = {"error": "error", "info": "notice"}.get(f.severity, "warning")
        message = f.message + (f" (fix: {f.fix})" if f.fix else "")
        lines.append(
            f"::{level} file={_gh_property(f.path)},title={_gh_property(f.code)}::{_gh_data(f'{f.code} {message}')}"
        )
    return "\n".join(lines)


# --- SARIF 2.1.0 ---------------------------------------------------------------------------------------------


def _uri(path: str) -> str:
    from urllib.parse import quote

    p = Path(path)
    return p.as_uri() if p.is_absolute() else quote(p.as_posix())


def sarif(report: CheckReport) -> dict[str, Any]:
    """A minimal valid SARIF 2.1.0 log: every rule in ``tool.driver.rules`` and one result per finding."""
    rules = all_rules()
    index = {r.code: i for i, r in enumerate(rules)}
    driver_rules = []
    for r in rules:
        entry: dict[str, Any] = {
            "id": r.code,
            "name": r.name,
            "shortDescription": {"text": r.summary},
            "fullDescription": {"text": r.rationale},
        }
        if r.severity in ("error", "warning"):
            entry["defaultConfiguration"] = {"level": r.severity}
        if r.fix:
            entry["help"] = {"text": f"fix: {r.fix}"}
        driver_rules.append(entry)
    results = []
    for f in report.findings:
        result: dict[str, Any] = {
            "ruleId": f.code,
            "level": {"error": "error", "info": "note"}.get(f.severity, "warning"),
            "message": {"text": f.message + (f" (fix: {f.fix})" if f.fix else "")},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": _uri(f.path)}}}],
        }
        if f.code in index:
            result["ruleIndex"] = index[f.code]
        if f.fix:
            result["properties"] = {"fix": f.fix}
        results.append(result)
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "ckptdoctor",
                        "version": __version__,
                        "informationUri": "https://github.com/ckptdoctor/ckptdoctor",
                        "rules": driver_rules,
                    }
                },
                "results": results,
            }
        ],
    }


def render_sarif(report: CheckReport) -> str:
    return json.dumps(sarif(report), indent=2)
