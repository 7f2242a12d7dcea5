"""One module per CLI command; each defines a Click command and keeps heavy imports inside it."""

from __future__ import annotations

import click

ITERATION_HELP = "Iteration to read from a save dir instead of the tracker's (a number or 'release')."


def all_commands() -> list[click.Command]:
    from ckptdoctor.commands import check, diff, fix_args, inspect, rules, strip_frozen

    return [inspect.command, fix_args.command, strip_frozen.command, check.command, rules.command, diff.command]
