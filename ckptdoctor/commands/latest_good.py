"""``ckptdoctor latest-good``: the newest iteration dir of a save dir that passes check."""

from __future__ import annotations

import sys

import click

from ckptdoctor.commands import complete_rule_codes
from ckptdoctor.commands.options import format_option, trust_global_option

_MULTI: dict = {"multiple": True, "metavar": "CODES", "shell_complete": complete_rule_codes}


@click.command("latest-good", short_help="Print the newest iteration dir that passes `check`.")
@trust_global_option
@click.argument("save_dir", type=click.Path(path_type=str))
@click.option("--select", **_MULTI, help="Only these rule codes or prefixes decide (as in check). Default: all.")
@click.option("--ignore", **_MULTI, help="These rule codes or prefixes never disqualify a checkpoint.")
@click.option("--deep", is_flag=True, help="Also decode every chunk and item (reads all data).")
@click.option(
    "--iteration-only",
    is_flag=True,
    help="Print only the iteration number (or 'release'), e.g. for Megatron's --ckpt-step.",
)
@format_option(schema="latest-good")
def command(
    save_dir: str,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    deep: bool,
    iteration_only: bool,
    output_format: str,
) -> int:
    """Print the newest iteration dir of SAVE_DIR that passes `check` (errors only; warnings never disqualify).

    Newer dirs that fail are named on stderr with the errors that disqualified them. Exit code: 0 found
    (the dir on stdout), 1 none passes, 2 error.
    """
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.check import CheckOptions
    from ckptdoctor.ops.latest_good import find_latest_good
    from ckptdoctor.render.common import echo_json
    from ckptdoctor.render.recovery import render_skipped
    from ckptdoctor.render.wrap import output_width
    from ckptdoctor.rules.registry import validate_selectors
    from ckptdoctor.text_safety import escape

    options = CheckOptions(
        select=validate_selectors(select or ["ALL"], "--select"),
        ignore=validate_selectors(ignore, "--ignore"),
        deep=deep,
    )
    report = find_latest_good(save_dir, options)
    if output_format == "json":
        echo_json(report)
    else:
        skipped = render_skipped(report, width=output_width(sys.stderr))
        if skipped:
            click.echo(skipped, err=True)
        if report.trusted:
            click.echo(escape(f"trusted globals (--trust-global): {', '.join(report.trusted)}"), err=True)
        if report.found:
            click.echo(escape(report.tracker_value if iteration_only else report.iteration_dir))  # type: ignore[arg-type]
        else:
            click.echo(f"no iteration dir of {escape(report.save_dir)} passes check", err=True)
    sys.stdout.flush()
    return EXIT_OK if report.found else EXIT_FINDINGS
