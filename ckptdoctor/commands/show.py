"""``ckptdoctor show``."""

from __future__ import annotations

from pathlib import Path

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, trust_global_option


@click.command("show", short_help="Show one saved item: metadata, chunk grid, statistics.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.argument("key")
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option(
    "--stats/--no-stats",
    default=None,
    help="Statistics (min/max/mean/std, NaN/Inf counts; streamed per chunk). Default: when torch is installed.",
)
@click.option(
    "--slice",
    "slice_spec",
    metavar="SPEC",
    default=None,
    help='Print a slice of the global tensor, numpy style: "0,:4,:4" (needs torch).',
)
@click.option(
    "--save",
    "save_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Export the tensor (or its --slice) to a .pt (torch.save) or .npy file (needs torch).",
)
@click.option("--force", is_flag=True, help="Replace an existing --save file.")
@click.option(
    "--decode",
    is_flag=True,
    help="Decode a bytes item or sharded object (rng_state, _extra_state, common_state) through the safe "
    "unpickler and show its fields.",
)
@format_option(schema="show")
def command(
    checkpoint: str,
    key: str,
    iteration: str | None,
    stats: bool | None,
    slice_spec: str | None,
    save_path: Path | None,
    force: bool,
    decode: bool,
    output_format: str,
) -> int:
    """Show one saved item KEY of CHECKPOINT: metadata and chunk grid (no torch needed), and with torch its
    statistics, a slice and an export; with --decode a bytes item's decoded fields.

    KEY `args` shows every saved arg, `args.NAME` one; `common` the common state, `common.PATH` a field of it
    (`common.optimizer.param_groups[0].lr`). Decoded through the safe unpickler, no torch needed.

    Exit code: 0 shown, 2 error (unknown key, arg or field: the closest names are suggested).
    """
    from ckptdoctor.commands.diff import quiet_library_warnings

    with quiet_library_warnings():  # torch's "Failed to initialize NumPy", as diff hides it
        return _show(checkpoint, key, iteration, stats, slice_spec, save_path, force, decode, output_format)


def _show(
    checkpoint: str,
    key: str,
    iteration: str | None,
    stats: bool | None,
    slice_spec: str | None,
    save_path: Path | None,
    force: bool,
    decode: bool,
    output_format: str,
) -> int:
    from ckptdoctor.checkpoint import Entry, open_checkpoint
    from ckptdoctor.errors import CkptError
    from ckptdoctor.logical_items import KIND_OBJECT, logical_items
    from ckptdoctor.ops.show import (
        decode_item,
        describe,
        describe_object,
        extra_state_views,
        find_entry,
        is_value_path,
        save_tensor,
        show_value,
        slice_values,
        stand_ins_notes,
        statistics,
        take_slice,
    )
    from ckptdoctor.render.show import render_show, render_value, to_json_text
    from ckptdoctor.render.wrap import output_width
    from ckptdoctor.values.read import read_tensor, require_torch

    ckpt = open_checkpoint(checkpoint, iteration)
    wants_values = stats or slice_spec is not None or save_path is not None
    if is_value_path(key) and not (  # a saved item of that name (Megatron saves none) comes first
        key in ckpt.entries or getattr(logical_items(ckpt).get(key), "kind", None) == KIND_OBJECT
    ):
        if wants_values:
            raise CkptError(f"{ckpt.iteration_dir}: {key} is no tensor: no statistics, slice or save")
        value = show_value(ckpt, key)
        value.notes += stand_ins_notes(ckpt)
        click.echo(to_json_text(value) if output_format == "json" else render_value(value, width=output_width()))
        return 0
    entry = find_entry(ckpt, key)
    report = describe(ckpt, entry) if isinstance(entry, Entry) else describe_object(ckpt, entry)
    if not (isinstance(entry, Entry) and entry.kind == "tensor"):
        report.extra_state = extra_state_views(ckpt, entry)
    if decode:
        if isinstance(entry, Entry) and entry.kind == "tensor":
            raise CkptError(f"{ckpt.iteration_dir}: {key} is a tensor, not a bytes item: nothing to decode")
        report.decoded = decode_item(ckpt, entry)
    if not isinstance(entry, Entry) or entry.kind != "tensor":
        if wants_values:
            what = "a bytes item" if isinstance(entry, Entry) else "a sharded object"
            raise CkptError(f"{ckpt.iteration_dir}: {key} is {what}, not a tensor: no statistics, slice or save")
    else:
        if wants_values:
            require_torch("show --stats/--slice/--save")
            have_torch = True
        else:
            try:
                import torch  # noqa: F401

                have_torch = True
            except ImportError:
                have_torch = False
        if stats or (stats is None and have_torch):
            report.stats = statistics(ckpt, entry)
        elif stats is None:
            report.notes.append(
                "statistics need torch: pip install torch --index-url https://download.pytorch.org/whl/cpu"
            )
        if slice_spec is not None or save_path is not None:
            tensor = read_tensor(ckpt, key)
            if slice_spec is not None:
                tensor = take_slice(tensor, slice_spec)
                report.slice = {"spec": slice_spec, "shape": list(tensor.shape), "values": slice_values(tensor)}
            if save_path is not None:
                note = save_tensor(tensor, save_path, force)
                report.saved = str(save_path)
                if note:
                    report.notes.append(note)
    report.notes += stand_ins_notes(ckpt)
    click.echo(to_json_text(report) if output_format == "json" else render_show(report, width=output_width()))
    return 0
