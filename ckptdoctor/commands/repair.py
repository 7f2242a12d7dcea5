"""``ckptdoctor repair``: fix what check finds, each repair only when provably safe."""

from __future__ import annotations

from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, gate_refusals, trust_global_option
from ckptdoctor.commands.write_target import echo_written, remote_output


@click.command("repair")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option("--write", is_flag=True, help="Apply the repairs; needs --output or --in-place.")
@click.option(
    "--output",
    "output",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the repaired checkpoint to a new dir; unchanged files are hard-linked (or copied).",
)
@click.option(
    "--in-place",
    is_flag=True,
    help="Repair CHECKPOINT itself, keeping each replaced file as "
    "<name>.bak-<timestamp>; unreferenced data files and leftovers of interrupted ckptdoctor "
    "writes are moved to <iter>.quarantine-<timestamp>/ (never deleted).",
)
@click.option("--force", is_flag=True, help="Write into a non-empty --output dir.")
@format_option()
@gate_refusals
def command(
    checkpoint: str,
    iteration: str | None,
    write: bool,
    output: Path | None,
    in_place: bool,
    force: bool,
    output_format: str,
) -> int:
    """Repair what `check` finds in CHECKPOINT (a save dir or an iteration dir), each repair only when it is
    provably safe: the tracker (to the latest good iteration; Megatron-Bridge's latest_train_state.pt with it), a
    missing metadata.json of a complete save, unreferenced data files (quarantined), inconsistent args (as
    fix-args; Megatron-Bridge's run_config.yaml where no args are saved).

    Reports by default. Exit code: 0 nothing to repair (or, with --write, every repaired finding gone),
    1 findings remain, 2 error.
    """
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.repair.write import repair
    from ckptdoctor.render.recovery import render_repair

    if write and (output is None) == (not in_place):
        raise click.UsageError("--write needs exactly one of --output DIR or --in-place")
    if not write and (output is not None or in_place):
        raise click.UsageError("--output/--in-place only apply with --write")
    with remote_output(output, force, write and not in_place) as remote:
        target = remote.local if remote else output
        report = repair(checkpoint, iteration, write=write, output=target, in_place=in_place, force=force)
        if remote is not None:
            remote.upload()
        echo_written(report, render_repair, remote, output_format)
    return EXIT_OK if report.ok else EXIT_FINDINGS
