"""Defaults from ``[tool.ckptdoctor]`` in the nearest ``pyproject.toml`` above the working directory.

Lets a repository pin its ``check`` policy (``select``, ``ignore``, ...) once, for the CLI and the
pre-commit hook alike. Command-line options override it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# key -> expected type; both ``all-iterations`` and ``all_iterations`` spellings are accepted.
CHECK_KEYS: dict[str, type | tuple[type, ...]] = {
    "select": list, "ignore": list, "deep": bool, "all-iterations": bool, "verify-integrity": bool, "format": str,
}


def find_pyproject(start: Path) -> Path | None:
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_tool_config(start: Path | None = None) -> tuple[dict[str, Any], Path | None]:
    """The ``[tool.ckptdoctor]`` table of the nearest pyproject.toml (empty if none), and that file."""
    path = find_pyproject((start or Path.cwd()).resolve())
    if path is None:
        return {}, None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise CkptError(f"{path}: not valid TOML ({exc})") from None
    table = data.get("tool", {}).get("ckptdoctor", {})
    if not isinstance(table, dict):
        raise CkptError(f"{path}: [tool.ckptdoctor] is not a table")
    return table, path


def check_defaults(table: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The ``check`` settings of a ``[tool.ckptdoctor]`` table, type-checked; other keys are left alone
    (other commands may read them)."""
    out: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        if key not in CHECK_KEYS:
            continue
        expected = CHECK_KEYS[key]
        if isinstance(value, str) and expected is list:
            value = [value]
        if not isinstance(value, expected) or (
                expected is list and not all(isinstance(v, str) for v in value)):  # type: ignore[attr-defined]
            kind = "a list of rule codes" if expected is list else expected.__name__  # type: ignore[union-attr]
            raise CkptError(f"{path}: [tool.ckptdoctor] {raw_key} must be {kind}, got {value!r}")
        out[key] = value
    return out
