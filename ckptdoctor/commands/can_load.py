"""``ckptdoctor can-load``."""

from __future__ import annotations

import click

from ckptdoctor.commands import ITERATION_HELP
from ckptdoctor.commands.options import format_option, trust_global_option
from ckptdoctor.ops.can_load.run import MAX_TARGET, SHARDING_TYPES, STRICTNESS


@click.command("can-load", short_help="Predict whether Megatron loads a checkpoint at a layout.")
@trust_global_option
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option(
    "--target",
    "target",
    default=None,
    metavar="tp=N,pp=N[,ep=N,etp=N,cp=N,dp=N|world=N]",
    help="The loading run's layout; omitted fields keep the saved layout (ETP defaults to the target TP, as "
    "Megatron-LM's does). Give --target or --suggest.",
)
@click.option(
    "--suggest",
    is_flag=True,
    help="Instead of one --target: list the layouts (TP/PP/CP/EP/ETP, DP the rest of the world size) and load "
    "flags under which it loads, fewest changes first (load flags before layout changes, nearest layouts first).",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1, max=MAX_TARGET),
    default=None,
    help="With --suggest: the world size the layouts fill (default: the saved one).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="With --suggest: list at most N candidates (0: all); the output says how many more load.",
)
@click.option("--finetune", is_flag=True, help="The run loads with --finetune (model only, iteration 0).")
@click.option("--no-load-optim", is_flag=True, help="The run loads with --no-load-optim.")
@click.option("--no-load-rng", is_flag=True, help="The run loads with --no-load-rng.")
@click.option(
    "--strictness",
    type=click.Choice(STRICTNESS),
    default="assume_ok_unexpected",
    show_default=True,
    help="The run's --dist-ckpt-strictness (megatron's StrictHandling).",
)
@click.option(
    "--use-distributed-optimizer/--no-use-distributed-optimizer",
    "use_distributed_optimizer",
    default=None,
    help="Whether the run uses the distributed optimizer (default: as saved).",
)
@click.option(
    "--dist-optim-sharding-type",
    type=click.Choice(SHARDING_TYPES),
    default=None,
    help="The distributed-optimizer format assumed for a checkpoint whose content metadata names none.",
)
@click.option(
    "--args-from",
    "args_from",
    metavar="CKPT_OR_YAML",
    default=None,
    help="Take the run's model args from another checkpoint or a YAML file (e.g. Megatron-Bridge run_config.yaml).",
)
@click.option("--set", "sets", metavar="NAME=VALUE", multiple=True, help="Change one arg of the run (repeatable).")
@click.option(
    "--use-checkpoint-args",
    is_flag=True,
    help="The run keeps every saved arg except the layout ones (as converters do), GTP weight shards included.",
)
@click.option(
    "--te-version",
    metavar="MAJOR.MINOR[.PATCH]",
    default=None,
    help="Transformer Engine of the loading run (default: 2.20.2, the newest modelled): TE 2.16.1, 2.17.1 and "
    ">= 2.18 refuse pickled delayed-scaling and TE 1.x _extra_state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 "
    "(2.16.0, 2.17.0 and older load it). 2.16 and 2.17 need the patch level.",
)
@click.option(
    "--te-unsafe-pickle",
    is_flag=True,
    help="The run sets NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (a refusing TE release then unpickles those states).",
)
@click.option(
    "--ckpt-drop-redundant-extra-state",
    "drop_redundant_extra_state",
    is_flag=True,
    help="The run sets Megatron-LM's --ckpt-drop-redundant-extra-state (PR #5552; Megatron-LM main, not in "
    "megatron-core 0.19.x): without delayed-scaling FP8 its load requests no _extra_state, so a checkpoint whose "
    "redundant extra state was dropped loads at any strictness.",
)
@click.option(
    "--num-virtual-stages-per-pipeline-rank",
    "virtual_stages",
    type=click.IntRange(min=1, max=MAX_TARGET),
    default=None,
    help="The run's virtual pipeline stages per rank (Megatron-LM's flag; 1: no virtual pipeline). Default: the "
    "saved virtual_pipeline_model_parallel_size. The distributed optimizer's dp_reshardable buckets are kept per "
    "model chunk, so they load only at the saved value.",
)
@format_option(schema="can-load")
def command(
    checkpoint: str,
    iteration: str | None,
    target: str | None,
    suggest: bool,
    world_size: int | None,
    limit: int,
    finetune: bool,
    no_load_optim: bool,
    no_load_rng: bool,
    strictness: str,
    use_distributed_optimizer: bool | None,
    dist_optim_sharding_type: str | None,
    args_from: str | None,
    sets: tuple[str, ...],
    use_checkpoint_args: bool,
    te_version: str | None,
    te_unsafe_pickle: bool,
    drop_redundant_extra_state: bool,
    virtual_stages: int | None,
    output_format: str,
) -> int:
    """Predict whether Megatron will load CHECKPOINT at the --target layout, section by section (metadata only);
    with --suggest, list the layouts and load flags under which it loads.

    Exit 0: it loads (--suggest: at some candidate); 1: it will not; 2: bad input.
    """
    from ckptdoctor.checkpoint import open_checkpoint, refuse_plain_dcp
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.formats import BACKEND_DCP
    from ckptdoctor.ops.can_load.args_from import model_args_from
    from ckptdoctor.ops.can_load.plain_dcp import predict_plain_dcp
    from ckptdoctor.ops.can_load.predict import predict, read_saved
    from ckptdoctor.ops.can_load.run import LoadRun, parse_sets
    from ckptdoctor.ops.can_load.suggest import suggest as suggest_layouts
    from ckptdoctor.render.can_load import render_can_load, render_suggestions
    from ckptdoctor.render.common import echo_json
    from ckptdoctor.render.wrap import output_width

    if suggest == (target is not None):
        raise click.UsageError("give --target LAYOUT or --suggest (one of them)")
    if not suggest and world_size is not None:
        raise click.UsageError("--world-size goes with --suggest (with --target: world=N)")
    run = LoadRun(
        finetune=finetune,
        no_load_optim=no_load_optim,
        no_load_rng=no_load_rng,
        strictness=strictness,
        use_distributed_optimizer=use_distributed_optimizer,
        dist_optim_sharding_type=dist_optim_sharding_type,
        use_checkpoint_args=use_checkpoint_args,
        sets=parse_sets(sets),
        te_version=_te_version(te_version),
        te_unsafe_pickle=te_unsafe_pickle,
        drop_redundant_extra_state=drop_redundant_extra_state,
        virtual_stages=virtual_stages,
    )
    ckpt = open_checkpoint(checkpoint, iteration)
    if ckpt.location.backend == BACKEND_DCP and not suggest:  # DCP's own resharding, not Megatron's load rules
        assert target is not None
        report = predict_plain_dcp(ckpt, target, run)
        if output_format == "json":
            echo_json(report)
        else:
            click.echo(render_can_load(report, width=output_width()))
        return EXIT_OK if report.will_load else EXIT_FINDINGS
    ckpt = refuse_plain_dcp(ckpt, "can-load --suggest", "lists Megatron layouts")
    model_args = model_args_from(args_from) if args_from else None
    if suggest:
        # flags LoadRun does not hold, echoed in each candidate's command
        extra = (*(("--iteration", iteration) if iteration else ()), *(("--args-from", args_from) if args_from else ()))
        found = suggest_layouts(read_saved(ckpt, model_args), run, world_size, limit, extra)
        if output_format == "json":
            echo_json(found)
        else:
            click.echo(render_suggestions(found, width=output_width()))
        return EXIT_OK if found.will_load else EXIT_FINDINGS
    assert target is not None
    report = predict(ckpt, target, run, model_args)
    if output_format == "json":
        echo_json(report)
    else:
        click.echo(render_can_load(report, width=output_width()))
    return EXIT_OK if report.will_load else EXIT_FINDINGS


def _te_version(text: str | None) -> tuple[int, int, int] | None:
    from ckptdoctor.formats.te_extra_state import parse_te_version

    if text is None:
        return None
    try:
        return parse_te_version(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--te-version") from None
