"""Options of the commands that write a new checkpoint dir (``strip-frozen``, ``edit``), defined once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def write_target_options(force_help: str) -> Callable[[Any], Any]:
    """``--output/-o DIR``, ``--in-place``, ``--no-backup`` and ``--force`` (its help names what it overrides)."""
    options = [
        click.option(
            "--output",
            "-o",
            type=click.Path(path_type=Path),
            default=None,
            help="New checkpoint dir to write (a save dir when CHECKPOINT is one).",
        ),
        click.option(
            "--in-place", is_flag=True, help="Replace the iteration dir (new dir + atomic rename; backup kept)."
        ),
        click.option("--no-backup", is_flag=True, help="With --in-place: delete the old iteration dir after the swap."),
        click.option("--force", is_flag=True, help=force_help),
    ]

    def apply(function: Any) -> Any:
        for option in reversed(options):
            function = option(function)
        return function

    return apply


def check_write_target(output: Path | None, in_place: bool, no_backup: bool, dry_run: bool) -> None:
    """Usage errors (exit 2) of the write-target options, before any checkpoint is opened."""
    if not dry_run and in_place == (output is not None):
        raise click.UsageError("give exactly one of --output DIR and --in-place (or --dry-run)")
    if no_backup and not in_place:
        raise click.UsageError("--no-backup only applies to --in-place")
