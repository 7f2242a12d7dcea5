"""``ckptdoctor convert``: torch_dist <-> Megatron-FSDP's fsdp_dtensor, offline on CPU."""

from __future__ import annotations

from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, gate_refusals, jobs_option, trust_global_option


@click.command("convert", short_help="Convert between torch_dist and Megatron-FSDP's fsdp_dtensor.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option(
    "--to", "target", type=click.Choice(["fsdp_dtensor", "torch_dist"]), required=True, help="The format to write."
)
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="New checkpoint dir to write (a save dir when CHECKPOINT is one).",
)
@click.option("--dry-run", is_flag=True, help="List every key mapping; write nothing (as with no -o/--output).")
@click.option("--force", is_flag=True, help="Replace an --output dir that exists and is not empty.")
@jobs_option("each writes its own data files", torchrun=False)
@format_option(schema="convert")
@gate_refusals
def command(
    checkpoint: str,
    iteration: str | None,
    target: str,
    output: Path | None,
    dry_run: bool,
    force: bool,
    jobs: int | None,
    output_format: str,
) -> int:
    """Convert CHECKPOINT (torch_dist) to Megatron-FSDP's fsdp_dtensor (a plain PyTorch DCP save), or back.

    Keys are renamed as Megatron-FSDP names them (model.module.<name>, optimizer states under
    optimizer.state.module.module.module.<name>.<stat>), stacked layers become one key per layer, and with SwiGLU
    each linear_fc1 weight is split into its _w and _v halves. Tensors stream chunk by chunk (memory holds one
    chunk); the common state becomes top-level items, args saying ckpt_format='fsdp_dtensor'. What the target has
    no place for (extra state, RNG and rerun states, distributed optimizer buckets) is listed. --to torch_dist
    converts an fsdp_dtensor save back (layers stacked, halves joined, common.pt and metadata.json). The output is
    built in a staging dir and renamed into place last. Exit code: 0 written (or planned), 1 refused by the
    safety gate (the output would carry a pickle failing it), 2 error.
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.exit_codes import EXIT_OK
    from ckptdoctor.ops.convert.write import convert
    from ckptdoctor.render.common import echo_json
    from ckptdoctor.render.convert import render_convert

    dry_run = dry_run or output is None  # the write model: only -o writes, --dry-run plans even with it
    report = convert(
        open_checkpoint(checkpoint, iteration),
        target,
        output=output,
        dry_run=dry_run,
        force=force,
        jobs=jobs,
        progress=progress_bar(not dry_run),
    )
    if output_format == "json":
        echo_json(report)
    else:
        click.echo(render_convert(report))
    return EXIT_OK
