"""``ckptdoctor diff A B``: exit 0 when nothing differs, 1 when something does, 2 on error (as diff(1))."""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from ckptdoctor.checkpoint import SECTIONS
from ckptdoctor.commands.options import format_option, jobs_option, trust_global_option

if TYPE_CHECKING:
    from ckptdoctor.ops.diff.compare import KeyFilter


def _check_regexes(values: tuple[str, ...], option: str) -> None:
    for value in values:
        try:
            re.compile(value)
        except re.error as exc:
            raise click.BadParameter(f"invalid regex {value!r}: {exc}", param_hint=option) from None


TEXT_LIMIT = 20  # keys listed per list in text output unless --limit/--all; JSON is complete unless --limit


@contextlib.contextmanager
def quiet_library_warnings() -> Iterator[None]:
    """Silence warnings raised by the libraries ckptdoctor imports (torch's "Failed to initialize NumPy",
    deprecations): the one place ``diff`` imports and runs torch goes through here. ckptdoctor's own warnings
    stay visible."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(?!ckptdoctor(\.|$))")
        yield


@click.command("diff", short_help="Compare two checkpoints: keys, shapes, layout and args.")
@trust_global_option
@click.argument("checkpoint_a", type=click.Path(path_type=str))
@click.argument("checkpoint_b", type=click.Path(path_type=str), required=False)
@click.option(
    "--section",
    "sections",
    multiple=True,
    type=click.Choice(SECTIONS),
    help="Only keys of this section (repeatable). Args and common state are compared with 'common'.",
)
@click.option(
    "--key",
    "keys",
    multiple=True,
    metavar="REGEX",
    help="Only keys matching REGEX (repeatable: any; one that matches no key of A or B is an error).",
)
@click.option("--exclude", multiple=True, metavar="REGEX", help="Leave out keys matching REGEX (repeatable).")
@format_option("csv", schema="diff")
@click.option(
    "--values",
    "with_values",
    is_flag=True,
    help="Also compare tensor values (streamed chunk by chunk) and bytes items (sha256).",
)
@click.option("--atol", type=float, default=None, help="Absolute tolerance for --values (default: bitwise).")
@click.option("--rtol", type=float, default=None, help="Relative tolerance for --values (default: bitwise).")
@click.option(
    "--report",
    "report_n",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="With --values: the first N mismatching elements of each differing tensor (global index, "
    "both values), as h5diff --report; 0: off.",
)
@click.option(
    "--stats",
    "with_stats",
    is_flag=True,
    help="With --values: both sides' statistics (check --health's: count, zeros, min, max, mean, std, L2 norm, "
    "fingerprint) per key and per layer / expert of stacked keys, with relative change (needs numpy).",
)
@click.option(
    "--all-iterations",
    is_flag=True,
    help="With --values --stats: CHECKPOINT_A is a save dir; the statistics of every iteration dir, oldest first, "
    "each with the change from the one before, and a per-layer table (no CHECKPOINT_B).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=None,
    help=f"Keys listed per list (counts are always complete). Default: {TEXT_LIMIT} in text, every key in JSON.",
)
@click.option("--all", "show_all", is_flag=True, help="List every key (no --limit).")
@click.option(
    "--ignore-layout/--no-ignore-layout",
    default=None,
    help="Layout differences (chunk/shard grids, TP/PP) are shown but do not make exit status 1.",
)
@click.option(
    "--ignore-arg",
    "ignore_args",
    multiple=True,
    metavar="REGEX",
    help="Leave out saved args whose name fully matches REGEX (repeatable), e.g. 'save|load'.",
)
@click.option(
    "--strict-args",
    is_flag=True,
    help="Count an arg absent on one side because that side's core version never saved it (see the era notes) "
    "as a difference; by default it is reported, not counted.",
)
@jobs_option("--values reads chunks")
@click.option("--stat", "stat", is_flag=True, help="Only the counts per section.")
@click.option("--name-only", is_flag=True, help="Only the differing keys, one per line.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing; the exit status says whether they differ.")
def command(
    checkpoint_a: str,
    checkpoint_b: str | None,
    sections: tuple[str, ...],
    keys: tuple[str, ...],
    exclude: tuple[str, ...],
    output_format: str,
    with_values: bool,
    atol: float | None,
    rtol: float | None,
    report_n: int,
    with_stats: bool,
    all_iterations: bool,
    limit: int | None,
    show_all: bool,
    ignore_layout: bool | None,
    ignore_args: tuple[str, ...],
    strict_args: bool,
    jobs: int | None,
    stat: bool,
    name_only: bool,
    quiet: bool,
) -> int:
    """Compare two checkpoints: keys, dtypes and shapes, layout, args, common state and, with --values, values.

    With --values --stats --all-iterations SAVE_DIR: the statistics of every iteration of a save dir side by side.

    A and B may differ in TP/PP, Megatron era (core 0.16 common.pt vs core 0.19 common_state) and backend.
    An arg absent on one side because that side's core never saved it (named in the era notes) is reported but
    does not decide the exit status, unless --strict-args.
    Exit status: 0 no differences, 1 differences, 2 error. Defaults for --ignore-arg and --ignore-layout come
    from [tool.ckptdoctor.diff] (ignore-args, ignore-layout) of the nearest pyproject.toml.
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.config import diff_defaults, load_tool_config
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.gc_pause import gc_paused, hold_until_exit
    from ckptdoctor.ops.diff.compare import KeyFilter, diff_checkpoints
    from ckptdoctor.render.common import echo_json
    from ckptdoctor.render.diff import render_diff, render_name_only, render_stat, render_stats_csv
    from ckptdoctor.render.wrap import output_width

    if stat and name_only:
        raise click.UsageError("--stat and --name-only are exclusive")
    if (stat or name_only) and output_format == "json":
        raise click.UsageError(
            f"--{'stat' if stat else 'name-only'} is a text output; JSON holds both (summary, key lists)"
        )
    if report_n and not with_values:
        raise click.BadParameter("needs --values", param_hint="--report")
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not with_values:  # a tolerance compares values: without them it would do nothing
            raise click.BadParameter("needs --values", param_hint=name)
    if with_stats:
        if not with_values:
            raise click.BadParameter("needs --values", param_hint="--stats")
        from ckptdoctor.values.health import require_numpy

        require_numpy("diff --stats (tensor statistics)")  # one clear error before any work
    if all_iterations:
        if not with_stats:
            raise click.BadParameter("needs --values --stats", param_hint="--all-iterations")
        if checkpoint_b is not None:
            raise click.UsageError("--all-iterations takes one save dir (CHECKPOINT_A), no CHECKPOINT_B")
        if stat or name_only or report_n:
            raise click.UsageError("--all-iterations shows statistics only (no --stat, --name-only, --report)")
    elif checkpoint_b is None:
        raise click.UsageError("Missing argument 'CHECKPOINT_B' (or --values --stats --all-iterations SAVE_DIR).")
    if output_format == "csv" and not with_stats:
        raise click.UsageError("--format csv is the statistics' table: it needs --values --stats")
    if output_format == "csv" and (stat or name_only):
        raise click.UsageError("--format csv holds the statistics only (no --stat, --name-only)")
    config = diff_defaults(*load_tool_config())
    _check_regexes(keys, "--key")
    _check_regexes(exclude, "--exclude")
    _check_regexes(ignore_args, "--ignore-arg")
    try:
        config_args = tuple(config.get("ignore-args", ()))
        _check_regexes(config_args, "ignore-args")
    except click.BadParameter as exc:
        from ckptdoctor.errors import CkptError

        raise CkptError(f"[tool.ckptdoctor.diff] {exc.format_message()}") from None
    all_ignored = config_args + tuple(a for a in ignore_args if a not in config_args)
    layout_ignored = config.get("ignore-layout", False) if ignore_layout is None else ignore_layout
    if show_all or name_only or stat:
        limit = None
    elif limit is None and output_format == "text":
        limit = TEXT_LIMIT
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and math.isnan(value):
            raise click.BadParameter("must be a number >= 0, not nan", param_hint=name)
        if value is not None and not value >= 0:
            raise click.BadParameter("must be >= 0", param_hint=name)
    if all_iterations:
        return _all_iterations(checkpoint_a, KeyFilter(sections, keys, exclude), output_format, limit, jobs, quiet)
    assert checkpoint_b is not None
    progress = progress_bar(with_values and not quiet)
    # Two 20,000-key indexes are ~10^6 long-lived objects that the cyclic GC would re-walk on every allocation
    # burst (a third of a structural diff's time); nothing here makes cyclic garbage worth collecting.
    try:
        with gc_paused(), quiet_library_warnings():
            a = open_checkpoint(checkpoint_a)
            hold_until_exit(a)
            b = open_checkpoint(checkpoint_b)
            hold_until_exit(b)
            report = diff_checkpoints(
                a,
                b,
                KeyFilter(sections, keys, exclude),
                limit=limit,
                values=with_values,
                atol=atol,
                rtol=rtol,
                progress=progress,
                ignore_layout=layout_ignored,
                ignore_args=all_ignored,
                report_mismatches=report_n,
                jobs=jobs,
                strict_args=strict_args,
                stats=with_stats,
            )
    finally:
        if progress is not None:
            progress.finish()
    if quiet:
        pass
    elif output_format == "json":
        echo_json(report)
    elif output_format == "csv":
        click.echo(render_stats_csv(report))
    elif stat:
        click.echo(render_stat(report))
    elif name_only:
        out = render_name_only(report)
        if out:
            click.echo(out)
    else:
        click.echo(render_diff(report, width=output_width()))
    return EXIT_OK if report.identical else EXIT_FINDINGS


def _all_iterations(
    save_dir: str, key_filter: KeyFilter, output_format: str, limit: int | None, jobs: int | None, quiet: bool
) -> int:
    """``--values --stats --all-iterations SAVE_DIR``: exit 0 when no row moved between iterations, else 1."""
    from ckptdoctor.commands.progress_bar import progress_bar
    from ckptdoctor.exit_codes import EXIT_FINDINGS, EXIT_OK
    from ckptdoctor.gc_pause import gc_paused
    from ckptdoctor.ops.diff.stats import stats_series
    from ckptdoctor.render.common import echo_json
    from ckptdoctor.render.diff import render_stats_csv, render_stats_series

    progress = progress_bar(not quiet)
    try:
        with gc_paused(), quiet_library_warnings():
            series = stats_series(
                save_dir, key_filter.accepts, None if output_format == "csv" else limit, jobs, progress
            )
    finally:
        if progress is not None:
            progress.finish()
    if quiet:
        pass
    elif output_format == "json":
        echo_json(series)
    elif output_format == "csv":
        click.echo(render_stats_csv(series))
    else:
        click.echo(render_stats_series(series))
    return EXIT_FINDINGS if series.series.changed else EXIT_OK
