"""The write model of every command that writes a checkpoint (``fix-args``, ``repair``, ``strip-frozen``, ``edit``),
defined once: its options, the one decision whether to write, object storage (a remote source's local copy, a
staged ``--output`` delivered last), the printed result."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckptdoctor.errors import CkptError

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint
    from ckptdoctor.ops.remote_output import SourceCopy, StagedOutput


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
def local_source(checkpoint: Checkpoint, writing: bool, in_place: bool) -> Iterator[SourceCopy | None]:
    """For a write from a checkpoint on object storage: its local copy (metadata files downloaded, data files as
    sparse stand-ins; see :mod:`ckptdoctor.ops.remote_output`) for the writer to read, removed here in every case;
    None for a local source or no write. In place on object storage is refused: no atomic rename or lock there."""
    from ckptdoctor.ops.remote_output import SourceCopy
    from ckptdoctor.write_guard import is_local, refuse_remote_write

    if not writing or is_local(checkpoint.iteration_dir):
        yield None
        return
    if in_place:
        refuse_remote_write(checkpoint.iteration_dir, in_place=True)
    source = SourceCopy.of(checkpoint)
    try:
        yield source
    except CkptError as exc:  # a refusal names the source as given (its URL), not the local copy's private dir
        exc.args = (source.shown(str(exc)), *exc.args[1:])
        raise
    finally:
        source.cleanup()


@contextlib.contextmanager
def staged_output(
    output: Path | None, force: bool, writing: bool = True, source: SourceCopy | None = None
) -> Iterator[StagedOutput | None]:
    """For an ``--output`` URL, or any ``--output`` of a source on object storage (``source``): a local staging dir
    to write instead (``.local``), delivered by the caller with ``.deliver()`` once the write succeeded and removed
    here in every case; None where the writer writes ``--output`` itself."""
    from ckptdoctor.ops.remote_output import StagedOutput

    staged = StagedOutput.of(output, source) if writing else None
    if staged is None:
        yield None
        return
    try:
        staged.refuse_existing(force)
        yield staged
    finally:
        staged.cleanup()


def deliver(staged: StagedOutput | None, jobs: int | None, output_format: str) -> None:
    """Deliver a staged write to its ``--output``, with a progress bar (text, on a terminal) and the line saying
    how the data files travel (server-side copy or streaming) on stderr first."""
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.parallel import default_jobs

    if staged is None:
        return
    staged.deliver(
        jobs or default_jobs(),
        progress_bar(output_format == "text"),
        lambda line: click.echo(f"ckptdoctor: {line}", err=True),
    )


def echo_written(
    report: Any, render_text: Callable[[Any], str], staged: StagedOutput | None, output_format: str
) -> None:
    """Print a write command's report: JSON streamed as it is walked (a 200k-key report is never one string), or
    ``render_text``'s text; with a staged ``--output`` the staging dir is named by the output (and a remote source's
    local copy by its URL), and the delivery is summed up on stderr (text output)."""
    from ckptdoctor.render.common import echo_json, to_json

    if staged is None:
        if output_format == "json":
            echo_json(report)
        else:
            click.echo(render_text(report))
        return
    click.echo(staged.shown(to_json(report) if output_format == "json" else render_text(report)))
    done = staged.delivered
    if output_format != "text" or not (done.uploaded or done.server_side or done.streamed):
        return
    parts = []
    if done.server_side:
        parts.append(f"copied {done.server_side} objects on the server")
    if done.streamed:
        parts.append(f"streamed {done.streamed} data files ({done.streamed_bytes} bytes)")
    if done.uploaded:
        parts.append(f"uploaded {len(done.uploaded)} objects ({done.bytes} bytes)")
    last = ", metadata.json last" if staged.remote else ""
    click.echo(f"{'; '.join(parts)} to {staged.target}{last}", err=True)
