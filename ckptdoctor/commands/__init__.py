"""One module per CLI command; each defines a Click command and keeps heavy imports inside it."""

from __future__ import annotations

import click

ITERATION_HELP = "Iteration to read from a save dir instead of the tracker's (a number or 'release')."


def all_commands() -> list[click.Command]:
    from ckptdoctor.commands import fix_args, inspect

    return [inspect.command, fix_args.command]
