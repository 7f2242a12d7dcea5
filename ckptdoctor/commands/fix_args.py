"""``ckptdoctor fix-args``."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, gate_refusals, jobs_option, trust_global_option
from ckptdoctor.commands.write_target import (
    deliver,
    echo_written,
    local_source,
    staged_output,
    write_target_options,
    writing,
)


@click.command("fix-args", short_help="Find and fix saved args that contradict the layout.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option(
    "--source",
    "source_path",
    metavar="SRC",
    default=None,
    help="The checkpoint this one was converted from: marks wrong values equal to the source's.",
)
@click.option("--source-iteration", default=None, help="Iteration of SRC (default: its tracker's).")
@click.option(
    "--set",
    "sets",
    metavar="NAME=VALUE",
    multiple=True,
    help="Set an arg by hand (repeatable); VALUE takes the saved value's type.",
)
@write_target_options(
    force_help="Allow --set of args the checkpoint does not have; write into a non-empty --output dir.",
    output_help="Write a new checkpoint dir; unchanged files are hard-linked (or copied), never modified.",
    in_place_help="Rewrite CKPT itself, keeping each replaced file as <name>.bak-<timestamp>.",
    dry_run_help="Report what would change; write nothing (as with no -o/--in-place).",
    no_backup=False,
)
@click.option("--only-set", is_flag=True, help="Apply only the --set edits, not the fixes.")
@format_option(schema="fix-args")
@jobs_option("threads copying data files from object storage to another bucket or a local dir", torchrun=False)
@gate_refusals
def command(
    checkpoint: str,
    iteration: str | None,
    source_path: str | None,
    source_iteration: str | None,
    sets: tuple[str, ...],
    output: Path | None,
    in_place: bool,
    dry_run: bool,
    force: bool,
    write_flag: bool,
    only_set: bool,
    output_format: str,
    jobs: int | None,
) -> int:
    """Find saved args that contradict CHECKPOINT's own parallelism, and fix them (a Megatron-Bridge checkpoint,
    which saves no args: its run_config.yaml model section).

    Reports each inconsistent arg (saved value, correct value, the error megatron-core would raise); -o DIR or
    --in-place writes the fixes. Exit code: 0 consistent (or, when writing, none left after writing), 1
    inconsistencies found (or left after writing, or left by the planned changes), 2 error. No tensor data is
    read or rewritten; writing is O(metadata). From object storage, -o URL in the same bucket or MSC profile
    copies the data files on the server and uploads only the changed files; another bucket, profile or a local
    dir streams them.
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.fix_args.plan import build_report
    from ckptdoctor.ops.fix_args.write import write_fix
    from ckptdoctor.render.common import render_fix_args
    from ckptdoctor.render.wrap import output_width

    write = writing(output, in_place, dry_run, write_flag)
    ckpt = open_checkpoint(checkpoint, iteration, "fix-args")
    with local_source(ckpt, write, in_place) as local:
        if local is not None:  # on object storage: the write reads and links a local copy (its data files sparse)
            ckpt = open_checkpoint(local.local_path(checkpoint), iteration)
        source = open_checkpoint(source_path, source_iteration) if source_path else None
        report = build_report(ckpt, source, list(sets), force=force, apply_fixes=not only_set)
        with staged_output(output, force, write and not in_place, local) as staged:
            if write:
                write_fix(report, ckpt, None if in_place else (staged.local if staged else output), force=force)
            deliver(staged, jobs, output_format)
            echo_written(report, functools.partial(render_fix_args, width=output_width()), staged, output_format)
    if write and report.remaining is not None:
        return EXIT_FINDINGS if report.remaining else EXIT_OK
    return EXIT_FINDINGS if report.findings or report.would_remain else EXIT_OK
