"""One module per CLI command; each defines a Click ``command`` and keeps heavy imports inside it.

Command modules are imported only when their command runs (or help lists them), so ``inspect`` does
not pay for the imports of ``diff`` or ``strip-frozen``.
"""

from __future__ import annotations

import importlib

import click

ITERATION_HELP = "Iteration to read from a save dir instead of the tracker's (a number or 'release')."

# command name -> module in ckptdoctor.commands, in the order help lists them
COMMAND_MODULES: dict[str, str] = {
    "inspect": "inspect",
    "show": "show",
    "diff": "diff",
    "fix-args": "fix_args",
    "strip-frozen": "strip_frozen",
    "edit": "edit",
    "convert": "convert",
    "check": "check",
    "rules": "rules",
    "latest-good": "latest_good",
    "history": "history",
    "seal": "seal",
    "repair": "repair",
    "can-load": "can_load",
    "verify-export": "verify_export",
    "schema": "schema",
}


def load_command(name: str) -> click.Command | None:
    module = COMMAND_MODULES.get(name)
    if module is None:
        return None
    return importlib.import_module(f"ckptdoctor.commands.{module}").command


class LazyGroup(click.Group):
    """A Click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMAND_MODULES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return load_command(cmd_name)


def complete_rule_codes(ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
    """Shell completion of rule codes (``--select``/``--ignore``, ``rules CODE``); the last of a comma list."""
    from click.shell_completion import CompletionItem

    from ckptdoctor.rules import is_safety
    from ckptdoctor.rules.registry import all_rules

    head, _, last = incomplete.rpartition(",")
    prefix = f"{head}," if head else ""
    selecting = param.name in ("select", "ignore")  # the gate's codes cannot be selected or ignored: not offered
    return [
        CompletionItem(prefix + r.code, help=r.summary)
        for r in all_rules()
        if r.code.startswith(last.strip().upper()) and not (selecting and is_safety(r.code))
    ]
