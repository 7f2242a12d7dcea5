"""``ckptdoctor verify-export``: does a Hugging Face export match its Megatron checkpoint?"""

from __future__ import annotations

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, jobs_option, trust_global_option


@click.command("verify-export", short_help="Verify a Hugging Face export against its Megatron checkpoint.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.argument("hf_dir", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option(
    "--family",
    default=None,
    metavar="NAME",
    help="The model family's mapping (llama, mixtral, qwen_moe, deepseek, or one of --mapping's). Default: from "
    "config.json's model_type.",
)
@click.option(
    "--mapping",
    "mapping_file",
    type=click.Path(path_type=str),
    default=None,
    metavar="FILE",
    help="A TOML file of family mappings in the built-in tables' schema (added to them, replacing a same-named one).",
)
@click.option(
    "--values",
    is_flag=True,
    help="Also compare each tensor's values with the checkpoint slice it should equal (needs torch).",
)
@jobs_option("--values compares runs of slices")
@click.option("--strict", is_flag=True, help="Warnings (a dtype change, an unmapped tensor) make a mismatch (exit 1).")
@click.option("--stat", is_flag=True, help="Add counts by finding code (and the largest value difference) to the text.")
@click.option("--name-only", is_flag=True, help="Print only the names of the tensors with findings, one a line.")
@format_option(schema="verify-export")
def command(
    checkpoint: str,
    hf_dir: str,
    iteration: str | None,
    family: str | None,
    mapping_file: str | None,
    values: bool,
    jobs: int | None,
    strict: bool,
    stat: bool,
    name_only: bool,
    output_format: str,
) -> int:
    """Verify that the Hugging Face model in HF_DIR (config.json, safetensors shards and their index) matches the
    Megatron checkpoint CHECKPOINT, in either direction (an export from it, or the model it was imported from).

    Without torch: the export's own files (missing shards, ghost and orphan tensors, headers that claim more bytes
    than the file has), every checkpoint tensor's HF tensors with their shapes for every layer and expert (fused
    QKV and gate/up split, fused layer norms, vocab padding), every HF tensor accounted for, and config.json
    against the saved args. --values compares the values too.

    Exit code: 0 match, 1 mismatch (an error finding; a warning only with --strict), 2 error.
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.commands.diff import quiet_library_warnings
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.ops.verify_export.verify import VerifyOptions, verify_export
    from ckptdoctor.render.verify_export import render_names, render_verify_export, to_json_text
    from ckptdoctor.render.wrap import output_width

    options = VerifyOptions(family=family, mapping_file=mapping_file, values=values, strict=strict, jobs=jobs)
    progress = progress_bar(values and output_format == "text")
    with quiet_library_warnings():
        try:
            report = verify_export(open_checkpoint(checkpoint, iteration), hf_dir, options, progress)
        finally:
            if progress is not None:
                progress.finish()
    if output_format == "json":
        click.echo(to_json_text(report))
    elif name_only:
        names = render_names(report)
        if names:
            click.echo(names)
    else:
        click.echo(render_verify_export(report, stat=stat, width=output_width()))
    return EXIT_OK if report.verdict == "match" else EXIT_FINDINGS
