"""``ckptdoctor check``: validate checkpoints with coded rules; exit 0 clean, 1 findings, 2 usage/I/O error."""

from __future__ import annotations

import sys
from typing import Any

import click

_MULTI: dict = {"multiple": True, "metavar": "CODES"}


@click.command("check")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--select", **_MULTI, help="Only these rule codes or prefixes (e.g. CKD1,CKD220). Default: all.")
@click.option("--ignore", **_MULTI, help="Skip these rule codes or prefixes.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default=None,
              help="Output format (default text); the JSON schema is in the README.")
@click.option("--deep/--no-deep", default=None,
              help="Also read every chunk and item and decode it through the safe unpickler (reads all data).")
@click.option("--all-iterations/--no-all-iterations", default=None,
              help="In a save dir, check every iteration dir, not only the tracker's.")
@click.option("--verify-integrity/--no-verify-integrity", default=None,
              help="Hash files listed in integrity.json (default on; off checks only that they exist).")
@click.option("--quiet", "-q", is_flag=True, help="Findings only: no summary line, no progress bar.")
@click.option("--isolated", is_flag=True, help="Ignore [tool.ckptdoctor] in pyproject.toml.")
def command(paths: tuple[str, ...], select: tuple[str, ...], ignore: tuple[str, ...], output_format: str | None,
            deep: bool | None, all_iterations: bool | None, verify_integrity: bool | None, quiet: bool,
            isolated: bool) -> int:
    """Check checkpoints for missing or truncated files, inconsistent args and chunks, unsafe pickles.

    Each PATH is a save dir (the tracker is followed), an iteration dir, or a file inside one (as
    pre-commit passes them); every iteration dir is checked once. Defaults come from [tool.ckptdoctor]
    in the nearest pyproject.toml. `ckptdoctor rules` lists the rule codes.
    """
    from ckptdoctor.config import check_defaults, load_tool_config
    from ckptdoctor.ops.check import CheckOptions, check_paths
    from ckptdoctor.report import EXIT_FINDINGS, EXIT_OK, render_check, to_json
    from ckptdoctor.rules import validate_selectors

    config = {} if isolated else check_defaults(*load_tool_config())

    def pick(cli_value: Any, key: str, default: Any) -> Any:
        return cli_value if cli_value not in (None, ()) else config.get(key, default)

    options = CheckOptions(
        select=validate_selectors(pick(select, "select", ["ALL"]), "--select"),
        ignore=validate_selectors(pick(ignore, "ignore", []), "--ignore"),
        deep=pick(deep, "deep", False),
        all_iterations=pick(all_iterations, "all-iterations", False),
        verify_integrity=pick(verify_integrity, "verify-integrity", True),
    )
    output_format = pick(output_format, "format", "text")
    if output_format not in ("text", "json"):
        raise click.BadParameter(f"{output_format!r} is not one of 'text', 'json'", param_hint="format")
    show_bar = options.deep and not quiet and output_format == "text" and sys.stderr.isatty()
    report = check_paths(list(paths), options, _progress_bar() if show_bar else None)
    if output_format == "json":
        click.echo(to_json(report))
    else:
        text = render_check(report, quiet=quiet)
        if text:
            click.echo(text)
    return EXIT_OK if report.clean else EXIT_FINDINGS


def _progress_bar() -> Any:
    """A click progress bar on stderr for ``--deep`` (built lazily: ops.check is imported only when run)."""
    from ckptdoctor.ops.check import Progress
    from ckptdoctor.text_safety import escape

    class Bar(Progress):
        def __init__(self) -> None:
            self._bar: Any = None

        def start(self, label: str, total_bytes: int) -> None:
            self._bar = click.progressbar(length=max(total_bytes, 1), label=escape(label), file=sys.stderr)
            self._bar.__enter__()

        def advance(self, nbytes: int) -> None:
            self._bar.update(nbytes)

        def finish(self) -> None:
            if self._bar is not None:
                self._bar.__exit__(None, None, None)
                self._bar = None

    return Bar()
