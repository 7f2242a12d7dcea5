"""Options shared by several commands, defined once so that every command spells them alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

# Earlier releases called the text output "table" in inspect and strip-frozen; the old name still works.
FORMAT_ALIASES = {"table": "text"}


class FormatChoice(click.Choice):
    """``text|json`` (plus a command's own extras), accepting the aliases above; help lists only real names."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            value = FORMAT_ALIASES.get(value.lower(), value)
        return super().convert(value, param, ctx)


def normalize_format(value: str) -> str:
    """A format name from a config file, with the same aliases as the option."""
    return FORMAT_ALIASES.get(value.lower(), value.lower())  # any case, as --format takes it


def schema_help(name: str) -> str:
    """Where ``--help`` sends a reader for the JSON output of command ``name``: the installed schema."""
    return f"the JSON schema: `ckptdoctor schema {name}`"


def format_option(
    *extra: str,
    help: str | None = None,
    default: str | None = "text",
    aliases: tuple[str, ...] = (),
    schema: str | None = None,
) -> Callable[[Any], Any]:
    """``--format text|json[|extra...]`` stored as ``output_format``; ``aliases`` are further option names.
    ``schema``: the command whose JSON schema the help names (``ckptdoctor schema NAME``)."""
    if help is None:
        help = "Output format." if schema is None else f"Output format; {schema_help(schema)}."
    return click.option(
        "--format",
        *aliases,
        "output_format",
        type=FormatChoice(["text", "json", *extra], case_sensitive=False),
        default=default,
        show_default=default is not None,
        help=help,
    )


def jobs_option(what: str, torchrun: bool = True) -> Callable[[Any], Any]:
    """``--jobs/-j N``: worker processes for byte-bound work (``what``); default: the available cores.
    ``torchrun``: the command runs under torchrun too (the write commands do not: one process writes)."""
    per_rank = "; under torchrun, per rank" if torchrun else ""
    return click.option(
        "--jobs",
        "-j",
        type=click.IntRange(min=1),
        default=None,
        help=f"Parallel workers ({what}) [default: the available cores{per_rank}].",
    )


def _trust(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    from ckptdoctor.errors import CkptError
    from ckptdoctor.pickle.policy import parse_trusted, set_trusted

    try:
        set_trusted(parse_trusted(value))
    except CkptError as exc:
        raise click.BadParameter(str(exc).split(": ", 1)[-1]) from None
    if value and ctx.command.name in _NOTED_HERE:  # the others list them in their reports
        from ckptdoctor.pickle.policy import trusted_names
        from ckptdoctor.text_safety import escape

        click.echo(escape(f"trusted globals (--trust-global): {', '.join(trusted_names())}"), err=True)
    return value


# Commands whose reports have no "trusted" field: the trusted globals are named on stderr as they are set.
_NOTED_HERE = frozenset({"inspect", "show", "diff", "verify-export"})


def trust_global_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--trust-global MODULE.NAME`` (repeatable): the gate's only override, command line only (no config file, and
    nothing inside a checkpoint, can trust a name). Set for the process before any read; not passed on."""
    return click.option(
        "--trust-global",
        "trust_global",
        multiple=True,
        metavar="MODULE.NAME",
        callback=_trust,
        expose_value=False,
        is_eager=True,
        help="Trust this exact global (repeatable): a pickle naming it passes the gate; it is read as an inert "
        "stand-in here and listed as trusted in the output. The only override of the safety rules (CKD4xx).",
    )(command)


def gate_refusals(command: Callable[..., Any]) -> Callable[..., Any]:
    """A write command's body, its source's refused pickles (met while reading it) turned into the gate's one-line
    refusal with exit 1 (a finding about the checkpoint, not a usage error)."""
    import functools

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from ckptdoctor.errors import GateRefusal, PickleLimitError, UnsafePickleError
        from ckptdoctor.formats.archive import ArchiveError

        try:
            return command(*args, **kwargs)
        except GateRefusal:
            raise
        except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
            from ckptdoctor.ops.pickle_gate import as_refusal

            raise as_refusal(exc) from None

    return run
