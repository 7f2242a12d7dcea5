"""``ckptdoctor rules``: every rule ``check`` applies, with its code, summary and rationale."""

from __future__ import annotations

import click

from ckptdoctor.commands import complete_rule_codes
from ckptdoctor.commands.options import format_option


@click.command("rules", short_help="List the rules of `check`, with codes and rationale.")
@click.argument("codes", nargs=-1, shell_complete=complete_rule_codes)
@format_option(schema="rules")
def command(codes: tuple[str, ...], output_format: str) -> int:
    """List the rules of `ckptdoctor check` (only those matching CODES, codes or prefixes, if given).

    Exit code: 0 listed, 2 error (a CODE that is no rule code or prefix).
    """
    from ckptdoctor.render.common import render_rules, to_json
    from ckptdoctor.rules.registry import all_rules, validate_selectors

    select = validate_selectors(codes, "CODES", listing=True) if codes else ["ALL"]
    rules = [r for r in all_rules() if any(s == "ALL" or r.code.startswith(s) for s in select)]
    if output_format == "json":
        click.echo(to_json({"schema": "ckptdoctor.rules/1", "rules": rules}))
    else:
        click.echo(render_rules(rules))
    return 0
