"""``ckptdoctor seal``: write Megatron's integrity.json (sha256 of every file) for a checkpoint."""

from __future__ import annotations

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
@format_option(schema="seal")
@gate_refusals
def command(checkpoint: str, iteration: str | None, jobs: int | None, force: bool, output_format: str) -> int:
    """Write integrity.json (Megatron's format: sha256 of every file) so later `check` runs and Megatron's
    --verify-integrity load detect any changed byte.

    Refuses a checkpoint that fails `check` (errors). One already sealed (an integrity.json listing
    its files) is left unchanged, exit 0 ("seal if not sealed"); --force re-seals it. Exit code: 0
    sealed or already sealed, 2 refused or error.
    """
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.exit_codes import EXIT_OK
    from ckptdoctor.ops.seal import seal
    from ckptdoctor.render.common import to_json
    from ckptdoctor.render.recovery import render_seal

    result = seal(checkpoint, iteration, jobs=jobs, force=force, progress=progress_bar(output_format == "text"))
    click.echo(to_json(result) if output_format == "json" else render_seal(result))
    return EXIT_OK
