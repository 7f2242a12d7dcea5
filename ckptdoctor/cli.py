"""Command-line interface: parse options, call one operation, render. No file reading here."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import click

from ckptdoctor import __version__
from ckptdoctor.errors import CkptError
from ckptdoctor.report import EXIT_ERROR

ITERATION_HELP = "Iteration to read from a save dir instead of the tracker's (a number or 'release')."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="ckptdoctor")
def cli() -> None:
    """Diagnose and repair Megatron-Core distributed checkpoints offline (no GPU, no Megatron)."""


@cli.command("inspect")
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--iteration", "-i", default=None, help=ITERATION_HELP)
@click.option("--keys", "with_keys", is_flag=True, help="Also print the key table.")
@click.option("--filter", "key_filter", metavar="REGEX", default=None,
              help="Only keys matching REGEX in the key table (implies --keys).")
@click.option("--format", "output_format", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="Output format; the JSON schema is in the README.")
def inspect_command(checkpoint: str, iteration: str | None, with_keys: bool, key_filter: str | None,
                    output_format: str) -> None:
    """Show what CHECKPOINT is: format, era, layout, sections, args (metadata only).

    CHECKPOINT is a save dir (the tracker is followed), an iteration dir, or a file inside one.
    """
    import re

    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.inspect import inspect_checkpoint
    from ckptdoctor.report import render_inspect, to_json

    if key_filter is not None:
        try:
            re.compile(key_filter)
        except re.error as exc:
            raise click.BadParameter(f"invalid regex: {exc}", param_hint="--filter") from None
    ckpt = open_checkpoint(checkpoint, iteration)
    report = inspect_checkpoint(ckpt, with_keys=with_keys or key_filter is not None, key_filter=key_filter)
    click.echo(to_json(report) if output_format == "json" else render_inspect(report))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: runs the CLI and turns every failure into one line and exit code 2."""
    try:
        # Commands return their exit code (0 clean, 1 findings); errors raise CkptError (exit 2).
        result = cli.main(args=list(argv) if argv is not None else None, prog_name="ckptdoctor",
                          standalone_mode=False)
    except CkptError as exc:
        click.echo(f"ckptdoctor: error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("ckptdoctor: aborted", err=True)
        return EXIT_ERROR
    except click.ClickException as exc:
        exc.show()
        return EXIT_ERROR
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:
        return EXIT_ERROR
    except KeyboardInterrupt:
        click.echo("ckptdoctor: interrupted", err=True)
        return 130
    except Exception as exc:  # last resort: a one-line message, the traceback only on request
        if os.environ.get("CKPTDOCTOR_DEBUG"):
            raise
        click.echo(f"ckptdoctor: internal error: {type(exc).__name__}: {exc} "
                   "(set CKPTDOCTOR_DEBUG=1 for a traceback)", err=True)
        return EXIT_ERROR
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
