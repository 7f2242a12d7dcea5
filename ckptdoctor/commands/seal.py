"""``ckptdoctor seal``: write Megatron's integrity.json (sha256 of every file) for a checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, gate_refusals, jobs_option, trust_global_option


@click.command("seal", short_help="Write integrity.json: the sha256 of every file.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@jobs_option("threads hashing files")
@click.option(
    "--force", is_flag=True, help="Re-seal a checkpoint that already has an integrity.json (else left unchanged)."
)
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="Write a sealed copy to this new dir or URL; the source is not changed (required on object storage).",
)
@format_option(schema="seal")
@gate_refusals
def command(
    checkpoint: str, iteration: str | None, jobs: int | None, force: bool, output: Path | None, output_format: str
) -> int:
    """Write integrity.json (Megatron's format: sha256 of every file) so later `check` runs and Megatron's
    --verify-integrity load detect any changed byte.

    Refuses a checkpoint that fails `check` (errors). One already sealed (an integrity.json listing
    its files) is left unchanged, exit 0 ("seal if not sealed"); --force re-seals it. Exit code: 0
    sealed or already sealed, 2 refused or error.

    -o DIR or URL writes a sealed copy instead (every file linked, or on object storage copied on the server in
    the same bucket or MSC profile and streamed elsewhere); a checkpoint on object storage is sealed only so.
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.commands.write_target import deliver, echo_written, local_source, staged_output
    from ckptdoctor.exit_codes import EXIT_OK
    from ckptdoctor.ops.seal import seal, seal_copy
    from ckptdoctor.render.common import to_json
    from ckptdoctor.render.recovery import render_seal
    from ckptdoctor.storage.dispatch import is_url
    from ckptdoctor.write_guard import refuse_remote_write

    progress = progress_bar(output_format == "text")
    if output is None:
        if is_url(checkpoint):  # adding integrity.json in place: no lock or atomic rename on object storage
            refuse_remote_write(open_checkpoint(checkpoint, iteration).iteration_dir, in_place=True)
        result = seal(checkpoint, iteration, jobs=jobs, force=force, progress=progress)
        click.echo(to_json(result) if output_format == "json" else render_seal(result))
        return EXIT_OK
    ckpt = open_checkpoint(checkpoint, iteration, "seal")
    with local_source(ckpt, True, False) as local, staged_output(output, force, True, local) as staged:
        ckpt.release_entries()
        result = seal_copy(
            checkpoint,
            iteration,
            staged.local if staged is not None else output,
            files_from=Path(local.local_path(ckpt.iteration_dir)) if local is not None else None,
            jobs=jobs,
            force=force,
            progress=progress,
        )
        deliver(staged, jobs, output_format)
        echo_written(result, render_seal, staged, output_format)
    return EXIT_OK
