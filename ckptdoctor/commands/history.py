"""``ckptdoctor history``: one line per iteration dir of a save dir (status, size, seal, trackers)."""

from __future__ import annotations

import click

from ckptdoctor.commands import complete_rule_codes
from ckptdoctor.commands.options import format_option, jobs_option, trust_global_option

_MULTI: dict = {"multiple": True, "metavar": "CODES", "shell_complete": complete_rule_codes}


@click.command("history", short_help="List the iteration dirs of a save dir: status, size, seal.")
@trust_global_option
@click.argument("save_dir", type=click.Path(path_type=str))
@click.option("--select", **_MULTI, help="Only these rule codes or prefixes count (as in check). Default: all.")
@click.option("--ignore", **_MULTI, help="These rule codes or prefixes never count.")
@click.option(
    "--verify-integrity",
    is_flag=True,
    help="Hash the files of every sealed dir against its integrity.json, as latest-good and check do "
    "(reads all their bytes). Default: metadata only.",
)
@jobs_option("processes checking iteration dirs")
@format_option(schema="history")
def command(
    save_dir: str,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    verify_integrity: bool,
    jobs: int | None,
    output_format: str,
) -> int:
    """List every iteration dir of SAVE_DIR, newest first: iteration, status (good, warnings, or broken, with the
    first error or warning), size, sealed (holds an integrity.json) and which tracker names it.

    Each dir is checked as `latest-good` checks it, but from metadata only: no chunk is decoded and
    integrity.json's hashes are verified only with --verify-integrity (`latest-good` and `check` verify them).
    Exit code: 0 listed and some dir passes check (errors only,
    as `latest-good` decides), 1 listed but none passes, 2 error.
    """
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.check import CheckOptions
    from ckptdoctor.ops.history import history
    from ckptdoctor.render.common import echo_json
    from ckptdoctor.render.recovery import render_history
    from ckptdoctor.render.wrap import output_width
    from ckptdoctor.rules.registry import validate_selectors
    from ckptdoctor.text_safety import escape

    options = CheckOptions(
        select=validate_selectors(select or ["ALL"], "--select"),
        ignore=validate_selectors(ignore, "--ignore"),
        verify_integrity=verify_integrity,
    )
    report = history(save_dir, options, jobs)
    if output_format == "json":
        echo_json(report)
    else:
        if report.trusted:
            click.echo(escape(f"trusted globals (--trust-global): {', '.join(report.trusted)}"), err=True)
        click.echo(render_history(report, width=output_width()))
    return EXIT_OK if report.resumable else EXIT_FINDINGS
