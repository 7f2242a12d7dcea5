"""Command-line interface: parse options, call one operation, render. No file reading here."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence

import click

from ckptdoctor import __version__
from ckptdoctor.commands import LazyGroup
from ckptdoctor.errors import CkptError
from ckptdoctor.report import EXIT_ERROR


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="ckptdoctor")
def cli() -> None:
    """Diagnose and repair Megatron-Core distributed checkpoints offline (no GPU, no Megatron)."""


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


def run() -> None:
    """The console entry point (``ckptdoctor``, ``python -m ckptdoctor``): :func:`main` in a short-lived process.

    A metadata-only command builds ~10^5 small objects and exits: cyclic garbage collection only rescans
    them (they hold no cycles; reference counting frees what is dropped) and tearing the interpreter down
    frees them one by one. Together that was ~15 % of an ``inspect`` of a 20,000-key checkpoint, so the
    process runs without the cyclic collector and ends with ``os._exit`` once its output is flushed
    (nothing of ours is left to clean up at exit: every file is closed by then).
    """
    gc.disable()
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        code = code or EXIT_ERROR
    os._exit(code)


if __name__ == "__main__":
    run()
