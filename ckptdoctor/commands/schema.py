"""``ckptdoctor schema``: the JSON Schema of a command's ``--format json`` output, as installed with the package.

The schemas are package data (``ckptdoctor/schemas/<command>.schema.json``), read with :mod:`importlib.resources`
so that an installed wheel, a zipped package and a source checkout answer alike; ``error`` is the object every
command prints on stdout in JSON mode when it fails.
"""

from __future__ import annotations

from importlib import resources

import click

SUFFIX = ".schema.json"


def schema_names() -> list[str]:
    """The names ``ckptdoctor schema`` knows: every command with a JSON output, and ``error``."""
    folder = resources.files("ckptdoctor") / "schemas"
    return sorted(item.name[: -len(SUFFIX)] for item in folder.iterdir() if item.name.endswith(SUFFIX))


def schema_text(name: str) -> str:
    """The shipped schema file of ``name``, exactly as installed."""
    return (resources.files("ckptdoctor") / "schemas" / f"{name}{SUFFIX}").read_text(encoding="utf-8")


def _complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    return [name for name in schema_names() if name.startswith(incomplete)]


@click.command("schema", short_help="Print the JSON schema of a command's JSON output.")
@click.argument("name", metavar="[COMMAND]", required=False, shell_complete=_complete)
@click.option("--list", "list_names", is_flag=True, help="List the names that have a schema, one a line.")
def command(name: str | None, list_names: bool) -> int:
    """Print the JSON Schema (draft 2020-12) of COMMAND's `--format json` output, as installed with ckptdoctor.

    `ckptdoctor schema error` prints the object every command prints on stdout in `--format json` mode when it
    fails. Each output names its schema in its top-level "schema" field (e.g. "ckptdoctor.diff/1"). Exit code:
    0 printed, 2 error (a COMMAND without a JSON output).
    """
    names = schema_names()
    if list_names:
        if name is not None:
            raise click.UsageError("give COMMAND or --list, not both")
        click.echo("\n".join(names))
        return 0
    if name is None:
        raise click.UsageError(f"give COMMAND (one of: {', '.join(names)}) or --list")
    if name not in names:
        raise click.BadParameter(f"no schema for {name!r} (one of: {', '.join(names)})", param_hint="COMMAND")
    click.echo(schema_text(name), nl=False)
    return 0
