"""Options of the commands that write a new checkpoint dir (``strip-frozen``, ``edit``), defined once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from ckptdoctor.ops.remote_output import RemoteOutput


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


@contextlib.contextmanager
def remote_output(output: Path | None, force: bool, writing: bool = True) -> Iterator[RemoteOutput | None]:
    """For an ``--output`` URL: a local staging dir to write instead (``.local``), uploaded by the caller with
    ``.upload()`` once the write succeeded and removed here in every case; None for a local ``--output``."""
    from ckptdoctor.ops.remote_output import RemoteOutput

    remote = RemoteOutput.of(output) if writing else None
    if remote is None:
        yield None
        return
    try:
        remote.refuse_existing(force)
        yield remote
    finally:
        remote.cleanup()


def echo_written(
    report: Any, render_text: Callable[[Any], str], remote: RemoteOutput | None, output_format: str
) -> None:
    """Print a write command's report: JSON streamed as it is walked (a 200k-key report is never one string), or
    ``render_text``'s text; with a remote ``--output`` the staging dir is named by its URL, and the upload is summed
    up on stderr (text output)."""
    from ckptdoctor.render.common import echo_json, to_json

    if remote is None:
        if output_format == "json":
            echo_json(report)
        else:
            click.echo(render_text(report))
        return
    click.echo(remote.shown(to_json(report) if output_format == "json" else render_text(report)))
    if remote.uploaded and output_format == "text":
        click.echo(
            f"uploaded {len(remote.uploaded)} objects ({remote.bytes} bytes) to {remote.url}, metadata.json last",
            err=True,
        )
