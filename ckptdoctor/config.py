"""Defaults from ``[tool.ckptdoctor]`` in the nearest ``pyproject.toml`` above the working directory.

Lets a repository pin its ``check`` policy (``select``, ``ignore``, ...) once, for the CLI and the
pre-commit hook alike. Command-line options override it.

Settings never come from inside a checkpoint: a ``pyproject.toml`` in a save dir or an iteration dir, or anywhere
below one, is passed over (a downloaded checkpoint must not configure the tool that checks it; ``cd model &&
ckptdoctor check .`` reads the repository's config above it, if any). No config can deselect the safety rules
either (:func:`ckptdoctor.rules.registry.validate_selectors`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.locate import (
    BRIDGE_TRACKER_NAME,
    NEMO_WEIGHTS_DIR,
    TRACKER_NAME,
    is_iteration_dir_name,
    looks_like_iteration_dir,
)
from ckptdoctor.storage.files import read_small_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# key -> expected type; both ``all-iterations`` and ``all_iterations`` spellings are accepted.
CHECK_KEYS: dict[str, type | tuple[type, ...]] = {
    "select": list,
    "ignore": list,
    "deep": bool,
    "health": bool,
    "all-iterations": bool,
    "verify-integrity": bool,
    "format": str,
    "recursive": bool,
    "per-path-ignores": dict,
    "te-version": str,  # MAJOR.MINOR of the loading run's Transformer Engine (CKD230)
}
# sub-tables other commands read ([tool.ckptdoctor.diff]) and check's health rules' settings
# ([tool.ckptdoctor.health-rules]: not ``health``, which is the --health default); any other key is an error
OTHER_TABLES = ("diff", "health-rules")


def find_pyproject(start: Path, passed_over: list[Path] | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` at or above ``start`` that is not in or below a checkpoint dir (those are
    appended to ``passed_over``)."""
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            if _in_checkpoint(directory):
                if passed_over is not None:
                    passed_over.append(candidate)
                continue
            return candidate
    return None


def _in_checkpoint(directory: Path) -> bool:
    """``directory`` is a save dir, an iteration dir (NeMo 2's checkpoint dir included), or lies below one."""
    for d in (directory, *directory.parents):
        try:
            if looks_like_iteration_dir(d) or looks_like_iteration_dir(d / NEMO_WEIGHTS_DIR):
                return True
            if (d / TRACKER_NAME).exists() or (d / BRIDGE_TRACKER_NAME).exists():
                return True
            if d != d.parent and any(
                looks_like_iteration_dir(d / name) for name in _iteration_names(d)
            ):  # a save dir whose tracker is missing
                return True
        except OSError:
            continue
    return False


def _iteration_names(directory: Path) -> list[str]:
    """The names of iteration dirs (``iter_*``, ``step-N``, ``release``) in ``directory``."""
    try:
        return [e.name for e in os.scandir(directory) if is_iteration_dir_name(e.name)]
    except OSError:
        return []


MAX_CONFIG_BYTES = 4 << 20  # a pyproject.toml is a few KB


def load_tool_config(
    start: Path | None = None, passed_over: list[Path] | None = None
) -> tuple[dict[str, Any], Path | None]:
    """The ``[tool.ckptdoctor]`` table of the nearest pyproject.toml outside any checkpoint dir (empty if none), and
    that file; the files passed over (in or below a checkpoint dir) are appended to ``passed_over``."""
    path = find_pyproject((start or Path.cwd()).resolve(), passed_over)
    if path is None:
        return {}, None
    raw = read_small_file(path, MAX_CONFIG_BYTES)  # a FIFO is an error, never a hang (check is a pre-commit hook)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CkptError(f"{path}: not valid TOML (not UTF-8: {exc.reason})") from None
    except RecursionError:
        raise CkptError(f"{path}: not valid TOML (nested too deeply)") from None
    except ValueError as exc:  # TOMLDecodeError, and an int of more than 4,300 digits
        raise CkptError(f"{path}: not valid TOML ({str(exc).split(';')[0]})") from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):  # `tool = 3`: was an internal error
        raise CkptError(f"{path}: `tool` is not a table (pyproject.toml keeps the tools' settings in [tool.NAME])")
    table = tool.get("ckptdoctor", {})
    if not isinstance(table, dict):
        raise CkptError(f"{path}: [tool.ckptdoctor] is not a table")
    return table, path


def check_defaults(table: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The ``check`` settings of a ``[tool.ckptdoctor]`` table, type-checked; an unknown key is an error naming
    the file and the closest known key (the sub-tables of other commands, OTHER_TABLES, are left alone)."""
    import difflib

    _refuse_two_spellings(table, f"{path}: [tool.ckptdoctor]")
    out: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        if key in OTHER_TABLES:
            continue
        if key not in CHECK_KEYS:
            known = [*CHECK_KEYS, *OTHER_TABLES]
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise CkptError(f"{path}: [tool.ckptdoctor] unknown key {raw_key!r} ({hint}known: {', '.join(known)})")
        expected = CHECK_KEYS[key]
        if isinstance(value, str) and expected is list:
            value = [value]
        if key == "per-path-ignores":
            value = _per_path_ignores(value, path)
        elif not isinstance(value, expected) or (expected is list and not all(isinstance(v, str) for v in value)):  # type: ignore[attr-defined]
            kind = "a list of rule codes" if expected is list else expected.__name__  # type: ignore[union-attr]
            raise CkptError(f"{path}: [tool.ckptdoctor] {raw_key} must be {kind}, got {value!r}")
        out[key] = value
    return out


def _per_path_ignores(value: Any, path: Path | None) -> dict[str, list[str]]:
    """``{"glob": ["CODE", ...]}`` (a single code may be a string), type-checked."""
    out: dict[str, list[str]] = {}
    if isinstance(value, dict):
        for glob, codes in value.items():
            if isinstance(codes, str):
                codes = [codes]
            if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
                break
            out[glob] = codes
        else:
            return out
    raise CkptError(f"{path}: [tool.ckptdoctor] per-path-ignores must be a table of glob = [rule codes], got {value!r}")


def _sub_table(
    table: dict[str, Any], name: str, keys: dict[str, type], path: Path | None, check: Callable[[str, Any, str], Any]
) -> dict[str, Any]:
    """The ``[tool.ckptdoctor.<name>]`` table (``name`` also spelt with ``_``) with its keys in ``-`` spelling, each
    value through ``check(key as written, value, where)``; unknown keys are refused (a misspelled key would
    silently change nothing). A string where ``keys`` says list is a list of one."""
    raw_table = table.get(name, table.get(name.replace("-", "_"), {}))
    if not isinstance(raw_table, dict):
        raise CkptError(f"{path}: [tool.ckptdoctor] {name} must be a table ([tool.ckptdoctor.{name}])")
    where = f"{path}: [tool.ckptdoctor.{name}]"
    _refuse_two_spellings(raw_table, where)
    out: dict[str, Any] = {}
    for raw_key, value in raw_table.items():
        key = raw_key.replace("_", "-")
        if key not in keys:
            raise CkptError(f"{where} unknown key {raw_key!r} (known: {', '.join(keys)})")
        if isinstance(value, str) and keys[key] is list:
            value = [value]
        out[key] = check(raw_key, value, where)
    return out


def _refuse_two_spellings(table: dict[str, Any], where: str) -> None:
    """A key written both ways (``all-iterations`` and ``all_iterations``): one of them silently won."""
    seen: dict[str, str] = {}
    for raw_key in table:
        key = raw_key.replace("_", "-")
        if key in seen:
            raise CkptError(f"{where} sets {seen[key]!r} and {raw_key!r}: one key, spelt two ways; keep one")
        seen[key] = raw_key


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


DIFF_KEYS: dict[str, type] = {"ignore-args": list, "ignore-layout": bool}


def diff_defaults(table: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The ``[tool.ckptdoctor.diff]`` table, type-checked: ``ignore-args`` (arg-name regexes, full match) and
    ``ignore-layout``. Unknown keys are refused."""

    def check(raw_key: str, value: Any, where: str) -> Any:
        expected = DIFF_KEYS[raw_key.replace("_", "-")]
        if (expected is list and not _strings(value)) or not isinstance(value, expected):
            kind = "a list of regexes" if expected is list else expected.__name__
            raise CkptError(f"{where} {raw_key} must be {kind}, got {value!r}")
        return value

    return _sub_table(table, "diff", DIFF_KEYS, path, check)


# [tool.ckptdoctor.health-rules]: key -> expected type (floats also accept integers)
HEALTH_RULES_KEYS: dict[str, type] = {"ignore-keys": list, "init-std-tolerance": float, "init-mean-tolerance": float}


def health_rules_defaults(table: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The ``[tool.ckptdoctor.health-rules]`` table, type-checked: ``ignore-keys`` (fnmatch globs of checkpoint
    keys the CKD5xx rules leave out) and the non-negative tolerances of CKD505's test for weights at their init.
    Unknown keys are refused."""

    def check(raw_key: str, value: Any, where: str) -> Any:
        if HEALTH_RULES_KEYS[raw_key.replace("_", "-")] is list:
            if not _strings(value):
                raise CkptError(f"{where} {raw_key} must be a list of key globs, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise CkptError(f"{where} {raw_key} must be a non-negative number, got {value!r}")
        return float(value)

    return _sub_table(table, "health-rules", HEALTH_RULES_KEYS, path, check)
