"""``ckptdoctor edit``: remove, rename and drop keys and sections without rewriting tensor bytes."""

from __future__ import annotations

import contextlib
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

SECTION_CHOICES = ["optimizer", "rng", "rerun"]
PRESET_CHOICES = ["te-to-local", "local-to-te"]


@click.command("edit", short_help="Remove, rename or drop keys without copying tensors.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option("--remove", "removes", metavar="REGEX", multiple=True, help="Remove keys matching REGEX (repeatable).")
@click.option(
    "--rename",
    "renames",
    nargs=2,
    metavar="REGEX REPLACEMENT",
    multiple=True,
    help="Rename keys: re.sub(REGEX, REPLACEMENT) (repeatable, applied in order).",
)
@click.option(
    "--drop-section",
    "drop_sections",
    type=click.Choice(SECTION_CHOICES),
    multiple=True,
    help="Drop a whole section; the common state is updated to match (repeatable).",
)
@click.option("--drop-extra-state", is_flag=True, help="Remove every _extra_state item.")
@click.option(
    "--drop-redundant-extra-state",
    is_flag=True,
    help="Remove the _extra_state items that hold no delayed-scaling FP8 state (no amax_history_fwd, scale_fwd or "
    "scale_bwd), as Megatron-LM's --ckpt-drop-redundant-extra-state saves them; reads each item (a few KB).",
)
@click.option(
    "--preset",
    type=click.Choice(PRESET_CHOICES),
    default=None,
    help="Rename the norm keys between megatron-core's Transformer Engine and local GPT layer spec names.",
)
@write_target_options(
    force_help="Replace an --output dir that exists and is not empty.",
    dry_run_help="List every change; write nothing (as with no -o/--in-place).",
)
@click.option(
    "--compact", is_flag=True, help="Byte-copy only the kept items into new data files (default: hard links)."
)
@click.option("--keys", "all_keys", is_flag=True, help="List every key of the plan, not the summary by reason.")
@format_option(schema="edit")
@jobs_option("--compact: threads copying kept items; from object storage: threads copying data files", torchrun=False)
@gate_refusals
def command(
    checkpoint: str,
    iteration: str | None,
    removes: tuple[str, ...],
    renames: tuple[tuple[str, str], ...],
    drop_sections: tuple[str, ...],
    drop_extra_state: bool,
    drop_redundant_extra_state: bool,
    preset: str | None,
    output: Path | None,
    in_place: bool,
    no_backup: bool,
    force: bool,
    write_flag: bool,
    compact: bool,
    dry_run: bool,
    output_format: str,
    all_keys: bool,
    jobs: int | None,
) -> int:
    """Remove, rename or drop keys of CHECKPOINT in O(metadata): a new .metadata, data files hard-linked.

    Renames are checked before anything is written (no two keys to one, no collision with a key that stays,
    bytes items keep their /shard_ suffix, keys stay in their section). Dropping a whole section also updates
    the common state, and the report names the Megatron-LM load flags the result needs. From object storage
    (without --compact), -o URL in the same bucket or MSC profile copies the data files on the server and uploads
    only the changed files; another bucket, profile or a local dir streams them. Exit code: 0 written
    (or planned), 1 refused by the safety gate (the output would carry a pickle failing it), 2 error (bad regex,
    an edit that changes nothing, a damaged source).
    """
    from ckptdoctor.checkpoint import open_checkpoint, open_for_rewrite
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.errors import CkptError
    from ckptdoctor.exit_codes import EXIT_OK
    from ckptdoctor.ops.edit.plan import EditRequest
    from ckptdoctor.ops.edit.write import edit
    from ckptdoctor.parallel import default_jobs
    from ckptdoctor.render.edit import render_edit
    from ckptdoctor.render.wrap import output_width
    from ckptdoctor.storage.dispatch import is_url

    dry_run = not writing(output, in_place, dry_run, write_flag, no_backup)
    request = EditRequest(
        removes=list(removes),
        renames=[(a, b) for a, b in renames],
        drop_sections=list(dict.fromkeys(drop_sections)),
        drop_extra_state=drop_extra_state,
        drop_redundant_extra_state=drop_redundant_extra_state,
        preset=preset,
    )
    wanted = request.removes or request.renames or request.drop_sections or drop_extra_state or preset
    if not (wanted or drop_redundant_extra_state):
        raise click.UsageError(
            "nothing to do: give --remove, --rename, --drop-section, --drop-extra-state, "
            "--drop-redundant-extra-state or --preset"
        )
    with contextlib.ExitStack() as stack:
        local = None
        if not dry_run and is_url(checkpoint):  # O(metadata) from object storage: the write runs on a local copy
            if compact:
                raise CkptError(
                    f"{checkpoint}: edit --compact rewrites tensor bytes, which stay on object storage; run it on "
                    "a local copy, or drop --compact (the data files are then copied as they are)"
                )
            local = stack.enter_context(local_source(open_checkpoint(checkpoint, iteration), True, in_place))
        source = local.local_path(checkpoint) if local is not None else checkpoint
        # a write rewrites the .metadata objects: read them with the index, in one pass (a dry run needs the index)
        if request.renames or preset or not dry_run:
            ckpt, metadata = open_for_rewrite(source, iteration, None)
        else:
            ckpt, metadata = open_checkpoint(source, iteration), None
        remote = stack.enter_context(staged_output(output, force, not dry_run, local))
        report = edit(
            ckpt,
            request,
            output=remote.local if remote else output,
            in_place=in_place,
            compact=compact,
            dry_run=dry_run,
            force=force,
            keep_backup=not no_backup,
            progress=progress_bar(compact and not dry_run),
            metadata=metadata,
            jobs=jobs or default_jobs(),
        )
        deliver(remote, jobs, output_format)
        carried = remote.delivered.data_files_how() if remote is not None else None
        render_text = functools.partial(render_edit, all_keys=all_keys, width=output_width(), carried=carried)
        echo_written(report, render_text, remote, output_format)
    return EXIT_OK
