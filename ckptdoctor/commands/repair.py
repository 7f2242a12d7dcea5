"""``ckptdoctor repair``: fix what check finds, each repair only when provably safe."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, gate_refusals, trust_global_option
from ckptdoctor.commands.write_target import deliver, echo_written, staged_output, write_target_options, writing


@click.command("repair", short_help="Repair what `check` finds, where provably safe.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@write_target_options(
    force_help="Write into a non-empty --output dir.",
    output_help="Write the repaired checkpoint to a new dir; unchanged files are hard-linked (or copied).",
    in_place_help="Repair CHECKPOINT itself, keeping each replaced file as <name>.bak-<timestamp>; unreferenced "
    "data files and leftovers of interrupted ckptdoctor writes are moved to <iter>.quarantine-<timestamp>/ (never "
    "deleted).",
    dry_run_help="Report the repairs that would be made; write nothing (as with no -o/--in-place).",
    no_backup=False,
)
@format_option(schema="repair")
@gate_refusals
def command(
    checkpoint: str,
    iteration: str | None,
    output: Path | None,
    in_place: bool,
    dry_run: bool,
    force: bool,
    write_flag: bool,
    output_format: str,
) -> int:
    """Repair what `check` finds in CHECKPOINT (a save dir or an iteration dir), each repair only when it is
    provably safe: the tracker (to the latest good iteration; Megatron-Bridge's latest_train_state.pt with it), a
    missing metadata.json of a complete save, unreferenced data files (quarantined), inconsistent args (as
    fix-args; Megatron-Bridge's run_config.yaml where no args are saved).

    Reports the plan by default; -o DIR or --in-place repairs. Exit code: 0 nothing to repair (or, when
    writing, every repaired finding gone), 1 findings remain, 2 error.
    """
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.repair.write import repair
    from ckptdoctor.render.recovery import render_repair
    from ckptdoctor.render.wrap import output_width

    write = writing(output, in_place, dry_run, write_flag)
    with staged_output(output, force, write and not in_place) as remote:
        target = remote.local if remote else output
        report = repair(
            checkpoint,
            iteration,
            write=write,
            output=target if write else None,
            in_place=in_place and write,
            force=force,
        )
        deliver(remote, None, output_format)
        echo_written(report, functools.partial(render_repair, width=output_width()), remote, output_format)
    return EXIT_OK if report.ok else EXIT_FINDINGS
