"""The write model of every command that writes a checkpoint (``fix-args``, ``repair``, ``strip-frozen``, ``edit``),
defined once: its options, the one decision whether to write, the remote ``--output``, the printed result."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from ckptdoctor.ops.remote_output import RemoteOutput


DRY_RUN_HELP = "Print what would be written; write nothing."
WRITE_DEPRECATED = (
    "ckptdoctor: --write is deprecated and goes in 0.2: -o/--output DIR or --in-place writes, --dry-run plans"
)


def write_target_options(
    force_help: str,
    output_help: str = "New checkpoint dir to write (a save dir when CHECKPOINT is one).",
    in_place_help: str = "Replace the iteration dir (new dir + atomic rename; backup kept).",
    dry_run_help: str = DRY_RUN_HELP,
    no_backup: bool = True,
) -> Callable[[Any], Any]:
    """The one write model of every command that writes a checkpoint: ``-o/--output DIR`` or ``--in-place``
    (exactly one) writes, ``--dry-run`` plans and writes nothing, neither prints the plan or report; ``--force``
    (its help names what it overrides), ``--no-backup`` where an in-place write keeps a whole backup dir, and the
    deprecated ``--write`` (hidden; :func:`writing` says so on stderr)."""
    options = [
        click.option("--output", "-o", type=click.Path(path_type=Path), default=None, help=output_help),
        click.option("--in-place", is_flag=True, help=in_place_help),
        *(
            [
                click.option(
                    "--no-backup", is_flag=True, help="With --in-place: delete the old iteration dir after the swap."
                )
            ]
            if no_backup
            else []
        ),
        click.option("--dry-run", is_flag=True, help=dry_run_help),
        click.option("--force", is_flag=True, help=force_help),
        click.option("--write", "write_flag", is_flag=True, hidden=True, help="Deprecated: -o/--in-place writes."),
    ]

    def apply(function: Any) -> Any:
        for option in reversed(options):
            function = option(function)
        return function

    return apply


def writing(output: Path | None, in_place: bool, dry_run: bool, write_flag: bool, no_backup: bool = False) -> bool:
    """Whether the command writes, from the write-target options; usage errors (exit 2) before any checkpoint is
    opened. ``--write`` still works with a target, with one deprecation line on stderr."""
    if output is not None and in_place:
        raise click.UsageError("give one of -o/--output DIR and --in-place, not both")
    if no_backup and not in_place:
        raise click.UsageError("--no-backup only applies to --in-place")
    if write_flag:
        click.echo(WRITE_DEPRECATED, err=True)
        if dry_run:
            raise click.UsageError("--dry-run writes nothing: drop --write")
        if output is None and not in_place:
            raise click.UsageError("--write needs -o/--output DIR or --in-place")
    return not dry_run and (output is not None or in_place)


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
