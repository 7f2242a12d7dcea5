"""``ckptdoctor strip-frozen``: shrink a full PEFT checkpoint to what ``--save-trainable-params-only`` writes."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, gate_refusals, jobs_option, trust_global_option
from ckptdoctor.commands.write_target import deliver, echo_written, staged_output, write_target_options, writing

PRESET_CHOICES = ["lora", "canonical-lora", "dora"]


@click.command("strip-frozen", short_help="Drop the frozen weights of a full PEFT checkpoint.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@write_target_options(
    force_help="Replace an --output dir that exists and is not empty; write even when no model parameter is frozen.",
    dry_run_help="List kept and dropped keys and sizes; write nothing (as with no -o/--in-place).",
)
@click.option(
    "--keep-args",
    is_flag=True,
    help="Keep the saved args as they are (default: set "
    "save_trainable_params_only to true, as Megatron's --save-trainable-params-only run saves it).",
)
@click.option(
    "--trainable",
    "patterns",
    metavar="REGEX",
    multiple=True,
    help="Model keys matching REGEX are trainable (repeatable).",
)
@click.option(
    "--preset",
    type=click.Choice(PRESET_CHOICES),
    default=None,
    help="Megatron-Bridge adapter naming: '.adapter.' keys, '*.adapters', DoRA weight_magnitude.",
)
@click.option(
    "--base",
    "base_path",
    metavar="BASE_CKPT",
    default=None,
    help="Model tensors bitwise equal to this checkpoint's are frozen (streamed compare).",
)
@click.option("--base-iteration", default=None, help="Iteration of BASE_CKPT when it is a save dir.")
@click.option("--keys", "all_keys", is_flag=True, help="List every key of the plan, not the summary by reason.")
@format_option(schema="strip-frozen")
@jobs_option("threads copying kept items", torchrun=False)
@gate_refusals
def command(
    checkpoint: str,
    iteration: str | None,
    output: Path | None,
    in_place: bool,
    no_backup: bool,
    force: bool,
    write_flag: bool,
    patterns: tuple[str, ...],
    preset: str | None,
    base_path: str | None,
    base_iteration: str | None,
    dry_run: bool,
    output_format: str,
    all_keys: bool,
    jobs: int | None,
    keep_args: bool,
) -> int:
    """Write what --save-trainable-params-only would have saved from a full PEFT CHECKPOINT.

    Keeps the model section's trainable tensors (default: those with optimizer state), drops frozen
    tensors and every model _extra_state, keeps optimizer, rng, rerun and common state untouched but for
    the saved arg save_trainable_params_only (set to true unless --keep-args). Kept items are byte-copied,
    never re-encoded. Exit code: 0 written (or planned), 1 no frozen parameter (nothing written; --force
    writes anyway) or refused by the safety gate (the output would carry a pickle failing it), 2 error.
    """
    from ckptdoctor.checkpoint import open_checkpoint, open_for_rewrite
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.strip.write import strip_frozen
    from ckptdoctor.parallel import default_jobs
    from ckptdoctor.render.common import render_strip
    from ckptdoctor.render.wrap import output_width

    dry_run = not writing(output, in_place, dry_run, write_flag, no_backup)
    # a write rewrites .metadata: read it once, for the plan and the rewrite (a dry run needs the index only)
    ckpt, metadata = (
        (open_checkpoint(checkpoint, iteration, "strip-frozen"), None)
        if dry_run
        else open_for_rewrite(checkpoint, iteration, "strip-frozen")
    )
    base = open_checkpoint(base_path, base_iteration) if base_path else None
    bars = progress_bar()
    with staged_output(output, force, not dry_run) as remote:
        try:
            report = strip_frozen(
                ckpt,
                output=remote.local if remote else output,
                in_place=in_place,
                patterns=list(patterns),
                preset=preset,
                base=base,
                dry_run=dry_run,
                force=force,
                keep_backup=not no_backup,
                progress=bars,
                keep_args=keep_args,
                jobs=jobs or default_jobs(),
                metadata=metadata,
            )
        finally:
            if bars is not None:
                bars.finish()
        deliver(remote, jobs, output_format)
        render_text = functools.partial(render_strip, all_keys=all_keys, width=output_width())
        echo_written(report, render_text, remote, output_format)
    return EXIT_FINDINGS if report.nothing_frozen and not force else EXIT_OK
