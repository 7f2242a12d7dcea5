"""``ckptdoctor inspect``."""

from __future__ import annotations

import re

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, trust_global_option


@click.command("inspect", short_help="Show a checkpoint's format, layout, sections and args.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option("--keys", "with_keys", is_flag=True, help="Also print the key table.")
@click.option(
    "--filter",
    "key_filter",
    metavar="REGEX",
    default=None,
    help="Only keys matching REGEX in the key table (implies --keys).",
)
@click.option(
    "--extra-state",
    "with_extra_state",
    is_flag=True,
    help="Also read every Transformer Engine _extra_state item (a few KB each) and count them: TE generation, "
    "recipe, FP8 on/off, what TE 2.16.1, 2.17.1 and >= 2.18 refuse at load, what is redundant.",
)
@format_option(schema="inspect")
def command(
    checkpoint: str,
    iteration: str | None,
    with_keys: bool,
    key_filter: str | None,
    with_extra_state: bool,
    output_format: str,
) -> int:
    """Show what CHECKPOINT is: format, era, layout, sections, args (metadata only; --extra-state also reads the
    Transformer Engine _extra_state items).

    CHECKPOINT is a save dir (the tracker is followed), an iteration dir, or a file inside one. Exit code: 0
    shown, 2 error (no checkpoint there, an unreadable index, a pickle the gate refuses).
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.gc_pause import hold_until_exit
    from ckptdoctor.ops.inspect import extra_state_census, inspect_checkpoint
    from ckptdoctor.render.common import echo_json, render_inspect
    from ckptdoctor.render.wrap import output_width

    if key_filter is not None:
        try:
            re.compile(key_filter)
        except re.error as exc:
            raise click.BadParameter(f"invalid regex {key_filter!r}: {exc}", param_hint="--filter") from None
    ckpt = open_checkpoint(checkpoint, iteration)
    hold_until_exit(ckpt)
    report = inspect_checkpoint(ckpt, with_keys=with_keys or key_filter is not None, key_filter=key_filter)
    if with_extra_state:
        report.extra_state = extra_state_census(ckpt)
    if output_format == "json":
        echo_json(report)
    else:
        click.echo(render_inspect(report, width=output_width()))
    return 0
