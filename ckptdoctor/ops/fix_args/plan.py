"""``ckptdoctor fix-args``: find saved args that contradict the checkpoint's own parallelism, plan the fix.

Diagnosis uses the rule table in :mod:`ckptdoctor.arg_rules`; writing lives in
:mod:`ckptdoctor.ops.fix_args.write`. Nothing here reads tensor bytes.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.arg_rules import ERROR, ArgFinding, check_args, compare_with_source
from ckptdoctor.args import ARG_GROUPS
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.run_config import RUN_CONFIG
from ckptdoctor.parallelism import infer_layout

SCHEMA = "ckptdoctor.fix-args/1"
DERIVED_ARGS = ARG_GROUPS["parallelism-derived"]


@dataclass
class ArgChange:
    arg: str
    old: Any
    new: Any
    why: str  # "fix" (from a finding) or "set" (--set)


@dataclass
class InheritedArg:
    """A parallelism-derived arg equal to the source's while the parallelism differs (may still be right)."""

    arg: str
    value: Any
    consistent: bool


@dataclass
class WriteResult:
    """What a ``--write`` wrote (:mod:`.write`), part of the report."""

    mode: str  # "output" or "in-place"
    iteration_dir: str
    written: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    linked: int = 0
    copied: int = 0
    run_config_args: list[str] = field(default_factory=list)
    integrity_updated: bool = False


@dataclass
class FixArgsReport:
    schema: str
    checkpoint: str
    era: str
    layout: str
    source: str | None
    findings: list[ArgFinding]
    inherited: list[InheritedArg]
    changes: list[ArgChange]
    written: WriteResult | None = None  # after --write
    notes: list[str] = field(default_factory=list)
    # after --write: the written checkpoint re-read and re-checked (None when nothing was written);
    # ``findings`` keep what was wrong before the fix
    remaining: list[ArgFinding] | None = None
    # before a write, with changes planned: the findings of the args as the changes leave them (None otherwise)
    would_remain: list[ArgFinding] | None = None
    # "run_config.yaml": no args saved, Megatron-Bridge's model section checked and changed in their place
    config_source: str = "args"

    @property
    def has_errors(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)


def saved_args(checkpoint: Checkpoint) -> argparse.Namespace:
    args = checkpoint.args
    if not isinstance(args, argparse.Namespace):
        where = checkpoint.common_source or "common state"
        raise CkptError(
            f"{checkpoint.iteration_dir}: {where} holds no argparse.Namespace 'args' to check "
            f"(and there is no {RUN_CONFIG} with a model section, as Megatron-Bridge saves its config)"
        )
    return args


def checked_config(checkpoint: Checkpoint) -> tuple[dict[str, Any], str]:
    """The saved config fix-args checks and changes, and where it lives: Megatron-LM's args (``"args"``), or
    Megatron-Bridge's ``run_config.yaml`` model section where no args are saved (:func:`args.saved_config`)."""
    config, where = checkpoint.saved_config()
    if where is None:
        saved_args(checkpoint)  # raises: neither is there
    return config, where or "args"


def diagnose(checkpoint: Checkpoint, source: Checkpoint | None = None) -> tuple[list[ArgFinding], list[InheritedArg]]:
    """Inconsistent args, and (with a source) the derived args that were carried over from it."""
    args, _ = checked_config(checkpoint)
    findings = check_args(args, infer_layout(checkpoint))
    inherited: list[InheritedArg] = []
    if source is not None:
        source_args, _ = checked_config(source)
        findings = compare_with_source(findings, source_args)
        wrong = {f.arg for f in findings}
        parallelism_differs = any(
            args.get(name) != source_args.get(name)
            for name in ("tensor_model_parallel_size", "expert_tensor_parallel_size", "pipeline_model_parallel_size")
        )
        if parallelism_differs:
            inherited = [
                InheritedArg(name, args[name], consistent=name not in wrong)
                for name in DERIVED_ARGS
                if name in args and name in source_args and args[name] == source_args[name]
            ]
    return findings, inherited


def coerce_value(name: str, text: str, current: Any, exists: bool) -> Any:
    """``--set NAME=VALUE``: VALUE converted to the type of the arg's saved value."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if isinstance(current, bool):
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise CkptError(f"--set {name}={text}: expected a boolean (true/false) like the saved {current!r}")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise CkptError(f"--set {name}={text}: expected an integer like the saved {current!r}") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise CkptError(f"--set {name}={text}: expected a number like the saved {current!r}") from None
    if isinstance(current, str):
        return text
    if exists and current is not None:
        raise CkptError(
            f"--set {name}: the saved value {current!r} is a {type(current).__name__}; "
            "only bool, int, float, str and None args can be set"
        )
    # a None or new arg: best guess from the text itself
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if lowered in ("true", "false"):
        return lowered == "true"
    return text


def parse_sets(sets: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in sets:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise CkptError(f"--set {item!r}: expected NAME=VALUE")
        pairs.append((name.strip(), value))
    return pairs


def plan_changes(
    checkpoint: Checkpoint, findings: list[ArgFinding], sets: list[str], apply_fixes: bool = True, force: bool = False
) -> list[ArgChange]:
    """The arg edits to write: each finding's correct value, then --set edits (which win)."""
    args, where = checked_config(checkpoint)
    planned: dict[str, ArgChange] = {}
    if apply_fixes:
        for finding in findings:
            if finding.correct is not None and finding.correct != finding.saved:
                planned[finding.arg] = ArgChange(finding.arg, finding.saved, finding.correct, "fix")
    for name, text in parse_sets(sets):
        exists = name in args
        if not exists and where == RUN_CONFIG:  # its lines are edited in place: there is none to set
            raise CkptError(f"--set {name}: {RUN_CONFIG}'s model section has no '{name}' (only existing lines change)")
        if not exists and not force:
            close = difflib.get_close_matches(name, list(args), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise CkptError(f"--set {name}: the saved args have no '{name}'{hint} (use --force to add it)")
        value = coerce_value(name, text, args.get(name), exists)
        planned[name] = ArgChange(name, args.get(name), value, "set")
    return [c for c in planned.values() if c.new != c.old or c.arg not in args]


def build_report(
    checkpoint: Checkpoint, source: Checkpoint | None, sets: list[str], force: bool, apply_fixes: bool = True
) -> FixArgsReport:
    findings, inherited = diagnose(checkpoint, source)
    changes = plan_changes(checkpoint, findings, sets, apply_fixes=apply_fixes, force=force)
    args, _ = checked_config(checkpoint)
    changed = {**args, **{change.arg: change.new for change in changes}}
    would_remain = check_args(changed, infer_layout(checkpoint)) if changes else None
    return FixArgsReport(
        schema=SCHEMA,
        checkpoint=str(checkpoint.iteration_dir),
        era=checkpoint.location.era,
        layout=infer_layout(checkpoint).summary(),
        source=None if source is None else str(source.iteration_dir),
        findings=findings,
        inherited=inherited,
        changes=changes,
        config_source=checked_config(checkpoint)[1],
        would_remain=would_remain,
    )


def common_with_args(common: dict, values: dict[str, Any]) -> dict:
    """A copy of a common state whose args (a copy too) carry ``values``; every other key and arg is kept as is.
    The one way fix-args and the key rewrites (``edit``, ``strip-frozen``: ops/rewrite/common_state.py) change
    saved args."""
    changed = dict(common)
    args = argparse.Namespace(**vars(common["args"]))
    for name, value in values.items():
        setattr(args, name, value)
    changed["args"] = args
    return changed


def fixed_common_state(checkpoint: Checkpoint, changes: list[ArgChange]) -> dict:
    """A copy of the common state whose args carry the changes; every other key and arg is kept as is."""
    saved_args(checkpoint)  # refuses a common state without an argparse.Namespace
    return common_with_args(checkpoint.common_state(), {change.arg: change.new for change in changes})
