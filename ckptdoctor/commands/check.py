"""``ckptdoctor check``: validate checkpoints with coded rules; exit 0 clean, 1 findings, 2 usage/I/O error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ckptdoctor.commands import complete_rule_codes
from ckptdoctor.commands.options import format_option, jobs_option, normalize_format, trust_global_option

_MULTI: dict = {"multiple": True, "metavar": "CODES", "shell_complete": complete_rule_codes}


@click.command("check", short_help="Check checkpoints for damage, bad args, unsafe pickles.")
@trust_global_option
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@click.option("--select", **_MULTI, help="Only these rule codes or prefixes (e.g. CKD1,CKD220). Default: all.")
@click.option("--ignore", **_MULTI, help="Skip these rule codes or prefixes.")
@format_option(
    "github",
    "sarif",
    default=None,
    aliases=("--output-format",),
    help="Output format (default text): json (`ckptdoctor schema check` prints its schema), github (workflow "
    "annotations), sarif (SARIF 2.1.0, for code scanning).",
)
@click.option(
    "--statistics",
    is_flag=True,
    help="Counts per rule code instead of one line per finding (text; JSON adds a statistics list).",
)
@click.option(
    "--recursive/--no-recursive",
    default=None,
    help="Search a directory that is no checkpoint for checkpoints below it (default on).",
)
@click.option(
    "--deep/--no-deep",
    default=None,
    help="Also read every chunk and item and decode it through the safe unpickler (reads all data).",
)
@click.option(
    "--health/--no-health",
    default=None,
    help="Also (implies --deep) compute every model and optimizer tensor's statistics in the same pass and "
    "apply the health rules (CKD5xx: all-zero weights, equal experts, optimizer moments); needs numpy.",
)
@click.option(
    "--all-iterations/--no-all-iterations",
    default=None,
    help="In a save dir, check every iteration dir, not only the tracker's.",
)
@click.option(
    "--verify-integrity/--no-verify-integrity",
    default=None,
    help="Hash files listed in integrity.json (default on; off checks only that they exist).",
)
@click.option(
    "--te-version",
    metavar="MAJOR.MINOR[.PATCH]",
    default=None,
    help="Transformer Engine of the loading run (default: 2.20.2, the newest modelled): a release without the "
    "extra-state classifier (before 2.18, except 2.16.1 and 2.17.1) loads pickled _extra_state, and CKD230 is info "
    "(what an upgrade will refuse) that does not fail the check. 2.16 and 2.17 need the patch level.",
)
@jobs_option("--deep reads data files")
@click.option("--quiet", "-q", is_flag=True, help="Findings only: no summary line, no progress bar.")
@click.option("--isolated", is_flag=True, help="Ignore [tool.ckptdoctor] in pyproject.toml.")
@click.option(
    "--staged",
    is_flag=True,
    help="Instead of PATHS: the checkpoint dirs of every path staged in git (git diff --cached), deletions "
    "included (the ckptdoctor-check-staged pre-commit hook).",
)
def command(
    paths: tuple[str, ...],
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    output_format: str | None,
    statistics: bool,
    recursive: bool | None,
    deep: bool | None,
    health: bool | None,
    all_iterations: bool | None,
    verify_integrity: bool | None,
    te_version: str | None,
    jobs: int | None,
    quiet: bool,
    isolated: bool,
    staged: bool,
) -> int:
    """Check checkpoints for missing or truncated files, inconsistent args and chunks, unsafe pickles.

    Each PATH is a save dir (the tracker is followed), an iteration dir, a file inside one (as
    pre-commit passes them), or a directory holding checkpoints below it (searched recursively; hidden
    dirs skipped); every iteration dir is checked once. A PATH that does not exist is reported on stderr
    after the others are checked (exit 2). Defaults come from [tool.ckptdoctor] in the nearest
    pyproject.toml that is not inside a checkpoint dir. The safety rules (CKD4xx) are always on: exit 0
    means nothing checked runs code when Megatron or PyTorch loads it; --trust-global is the only
    override. `ckptdoctor rules` lists the rule codes and what fixes them. With --staged (no PATHS), the
    checkpoint dirs of the paths staged in git are checked, deleted files included; none staged: exit 0.
    Exit code: 0 no findings (info findings do not count), 1 findings or no checkpoint found, 2 usage or I/O
    error (a missing PATH, an unknown rule code, an invalid [tool.ckptdoctor]).
    """
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.config import check_defaults, health_rules_defaults, load_tool_config
    from ckptdoctor.exit_codes import EXIT_ERROR, EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.check import CheckOptions, ConfigUse, check_paths, staged_checkpoint_dirs
    from ckptdoctor.render.check import FORMATS, render_check, render_github, render_sarif
    from ckptdoctor.render.common import jsonable
    from ckptdoctor.render.wrap import output_width
    from ckptdoctor.rules.health import HealthSettings
    from ckptdoctor.rules.registry import validate_selectors
    from ckptdoctor.text_safety import escape

    if staged and paths:
        raise click.UsageError("give PATHS or --staged (the checkpoint dirs of what git has staged), not both")
    if not staged and not paths:
        raise click.UsageError("give PATHS (checkpoint dirs, save dirs or files in them) or --staged")
    passed_over: list[Path] = []
    table, config_path = ({}, None) if isolated else load_tool_config(passed_over=passed_over)
    config = check_defaults(table, config_path)
    health_rules = health_rules_defaults(table, config_path)
    cli_values = {
        "select": select,
        "ignore": ignore,
        "deep": deep,
        "health": health,
        "all-iterations": all_iterations,
        "verify-integrity": verify_integrity,
        "format": output_format,
        "recursive": recursive,
        "te-version": te_version,
    }
    changed = {key: value for key, value in config.items() if cli_values.get(key) in (None, ())}

    def pick(cli_value: Any, key: str, default: Any) -> Any:
        return cli_value if cli_value not in (None, ()) else config.get(key, default)

    def selectors(cli_value: tuple[str, ...], key: str, default: list[str]) -> list[str]:
        if cli_value:
            return validate_selectors(cli_value, f"--{key}")
        return validate_selectors(config.get(key, default), f"{config_path}: [tool.ckptdoctor] {key}")

    per_path = [
        (glob, validate_selectors(codes, f"{config_path}: [tool.ckptdoctor] per-path-ignores {glob!r}"))
        for glob, codes in config.get("per-path-ignores", {}).items()
    ]
    options = CheckOptions(
        select=selectors(select, "select", ["ALL"]),
        ignore=selectors(ignore, "ignore", []),
        deep=pick(deep, "deep", False),
        all_iterations=pick(all_iterations, "all-iterations", False),
        verify_integrity=pick(verify_integrity, "verify-integrity", True),
        recursive=pick(recursive, "recursive", True),
        per_path_ignores=per_path,
        base_dir=config_path.parent if config_path is not None else None,
        jobs=jobs,
        health=pick(health, "health", False),
        health_settings=HealthSettings(
            ignore_keys=health_rules.get("ignore-keys", []),
            init_std_tolerance=health_rules.get("init-std-tolerance", HealthSettings.init_std_tolerance),
            init_mean_tolerance=health_rules.get("init-mean-tolerance", HealthSettings.init_mean_tolerance),
        ),
        te_version=_te_version(te_version, config.get("te-version"), config_path),
    )
    output_format = normalize_format(str(pick(output_format, "format", "text")))
    if output_format not in FORMATS:
        raise click.BadParameter(
            f"{output_format!r} is not one of {', '.join(map(repr, FORMATS))}",
            param_hint=f"{config_path}: [tool.ckptdoctor] format",
        )
    options.health_statistics = output_format == "json"  # the other formats show the findings only
    if statistics and output_format not in ("text", "json"):
        raise click.BadParameter("--statistics goes with --format text or json", param_hint="--statistics")
    show_bar = (options.deep or options.health) and not quiet and output_format == "text" and sys.stderr.isatty()
    staged_findings = None
    if staged:
        targets = staged_checkpoint_dirs()
        paths, staged_findings = tuple(targets.paths), targets.findings
    report = check_paths(list(paths), options, progress_bar(show_bar), missing_ok=True, staged=staged_findings)
    if any(f.fix for f in report.findings):  # the fixers' plans are imported and made only then
        from ckptdoctor.ops.fixes import verified_fixes

        report = verified_fixes(report)
    if not isolated:
        in_use = str(config_path) if config_path is not None and table else None  # a file without the table: none
        report.config = ConfigUse(in_use, changed, [str(p) for p in passed_over])
    only_missing = report.missing and not report.checked and not report.findings
    if only_missing and output_format != "json":
        pass  # nothing but errors to say (on stderr, below); JSON says it in "missing"
    elif output_format == "json":
        plain = jsonable(report)
        if statistics:
            from ckptdoctor.render.check import statistics as count_codes

            plain["statistics"] = count_codes(report)
        click.echo(json.dumps(plain, indent=2))
    elif output_format == "sarif":
        click.echo(render_sarif(report))
    elif output_format == "github":
        text = render_github(report)
        if text:
            click.echo(text)
    else:
        text = render_check(report, quiet=quiet, statistics=statistics, width=output_width())
        if text:
            click.echo(text)
    for missing in report.missing:
        click.echo(escape(f"ckptdoctor: error: {missing}: no such file or directory"), err=True)
    if report.missing:
        return EXIT_ERROR
    if staged and not paths:
        return EXIT_OK  # no staged path belongs to a checkpoint
    if report.nothing_found:
        click.echo(escape(f"ckptdoctor: no checkpoint found under {', '.join(paths)}"), err=True)
        return EXIT_FINDINGS
    return EXIT_OK if report.clean else EXIT_FINDINGS


def _te_version(cli_value: str | None, configured: str | None, config_path: Path | None) -> tuple[int, int, int] | None:
    """--te-version, else [tool.ckptdoctor] te-version (None: neither, the newest modelled release)."""
    from ckptdoctor.formats.te_extra_state import parse_te_version

    text, hint = (cli_value, "--te-version") if cli_value is not None else (configured, None)
    if text is None:
        return None
    try:
        return parse_te_version(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint or f"{config_path}: [tool.ckptdoctor] te-version") from None
