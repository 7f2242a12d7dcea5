"""``ckptdoctor diff A B``: exit 0 when nothing differs, 1 when something does, 2 on error (as diff(1))."""

from __future__ import annotations

import gc
import re
import sys
from typing import Any

import click

from ckptdoctor.checkpoint import SECTIONS


def _check_regexes(values: tuple[str, ...], option: str) -> None:
    for value in values:
        try:
            re.compile(value)
        except re.error as exc:
            raise click.BadParameter(f"invalid regex {value!r}: {exc}", param_hint=option) from None


class _Progress:
    """A click progress bar over bytes read, shown only when stderr is a terminal."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.shown = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=max(total, 1), label="reading values", file=sys.stderr,
                                         show_pos=False, show_percent=True, show_eta=True)
            self.bar.__enter__()
        self.bar.update(done - self.shown)
        self.shown = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


@click.command("diff")
@click.argument("checkpoint_a", type=click.Path(path_type=str))
@click.argument("checkpoint_b", type=click.Path(path_type=str))
@click.option("--section", "sections", multiple=True, type=click.Choice(SECTIONS),
              help="Only keys of this section (repeatable). Args and common state are compared with 'common'.")
@click.option("--key", "keys", multiple=True, metavar="REGEX", help="Only keys matching REGEX (repeatable: any).")
@click.option("--exclude", multiple=True, metavar="REGEX", help="Leave out keys matching REGEX (repeatable).")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Output format; the JSON schema is docs/diff.schema.json.")
@click.option("--values", "with_values", is_flag=True,
              help="Also compare tensor values (streamed chunk by chunk) and bytes items (sha256).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance for --values (default: bitwise).")
@click.option("--rtol", type=float, default=None, help="Relative tolerance for --values (default: bitwise).")
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True,
              help="Keys listed per list (counts are always complete).")
@click.option("--all", "show_all", is_flag=True, help="List every key (no --limit).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(checkpoint_a: str, checkpoint_b: str, sections: tuple[str, ...], keys: tuple[str, ...],
            exclude: tuple[str, ...], output_format: str, with_values: bool, atol: float | None, rtol: float | None,
            limit: int, show_all: bool, quiet: bool) -> int:
    """Compare two checkpoints: keys, dtypes and shapes, layout, args, common state and, with --values, values.

    A and B may differ in TP/PP, Megatron era (core 0.16 common.pt vs core 0.19 common_state) and backend.
    Exit status: 0 no differences, 1 differences, 2 error.
    """
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.diff import KeyFilter, diff_checkpoints
    from ckptdoctor.render_diff import render_diff
    from ckptdoctor.report import EXIT_FINDINGS, EXIT_OK, to_json

    _check_regexes(keys, "--key")
    _check_regexes(exclude, "--exclude")
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not value >= 0:
            raise click.BadParameter("must be >= 0", param_hint=name)
    progress = _Progress() if with_values and not quiet and sys.stderr.isatty() else None
    # Two 20,000-key indexes are ~10^6 long-lived objects that the cyclic GC would re-walk on every allocation
    # burst (a third of a structural diff's time); nothing here makes cyclic garbage worth collecting.
    gc.disable()
    try:
        a = open_checkpoint(checkpoint_a)
        b = open_checkpoint(checkpoint_b)
        report = diff_checkpoints(a, b, KeyFilter(sections, keys, exclude), limit=None if show_all else limit,
                                  values=with_values, atol=atol, rtol=rtol, progress=progress)
    finally:
        gc.enable()
        if progress is not None:
            progress.close()
    click.echo(to_json(report) if output_format == "json" else render_diff(report))
    return EXIT_OK if report.identical else EXIT_FINDINGS
