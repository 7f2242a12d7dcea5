"""Terminal-safe text: what a checkpoint holds must never reach the user's terminal as control sequences.

Arg values, key names, file names and error messages quoting them come from files anyone can write. Printed
raw, an ANSI escape (``\\x1b[2J``, ``\\x1b]0;...\\x07``) rewrites the terminal and a newline forges output
lines. Every text renderer and the CLI's error line go through this module (JSON output needs nothing:
``json.dumps`` already escapes control characters).

* :func:`escape` turns one value into a single printable line: C0/C1 controls, DEL, line/paragraph
  separators, bidi overrides and lone surrogates become ``\\n``, ``\\t``, ``\\r``, ``\\x1b``, ``\\u202e`` style escapes.
* :func:`escape_values` applies it to every string inside a report (dataclasses, dicts, lists), so the
  renderers keep their layout while values cannot break out of it.
* :func:`escape_output` is the last pass over a rendered text: the lines the renderer made stay lines,
  anything else that could drive a terminal is escaped.
* :func:`text_safe` wraps a renderer with both.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import operator
import re
from collections.abc import Callable
from typing import Any, TypeVar

# C0 controls, DEL, C1 controls (0x9b is a one-byte CSI on some terminals), line and paragraph separators,
# bidi embeddings/overrides/isolates (they reorder what is shown, "Trojan Source"), and lone surrogates (a
# pickle's strings may hold them; no output encoding can write them: UnicodeEncodeError).
_OTHER = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_RE = re.compile(f"[\x00-\x1f{_OTHER}]")
_UNSAFE_BUT_NEWLINE_RE = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHER}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

F = TypeVar("F", bound=Callable[..., str])


def _replace(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every control character escaped: one printable line, safe on any terminal."""
    if text.isprintable() or _UNSAFE_RE.search(text) is None:  # the common case costs one scan
        return text
    return _UNSAFE_RE.sub(_replace, text)


def escape_output(text: str) -> str:
    """A rendered text with its own line breaks kept and every other control character escaped."""
    if _UNSAFE_BUT_NEWLINE_RE.search(text) is None:
        return text
    return _UNSAFE_BUT_NEWLINE_RE.sub(_replace, text)


def escape_values(value: Any, _memo: dict[int, Any] | None = None) -> Any:
    """``value`` with every string in it (dict keys too) passed through :func:`escape`.

    Each container is visited once (``_memo``, by identity): a report can hold values read from a
    checkpoint, whose shared references would otherwise expand exponentially.

    Containers and dataclasses are copied only where something was escaped (a clean report comes back as
    the same object); dataclasses keep their class, so a renderer's attribute access and properties still
    work. Objects of other classes are left as they are (:func:`escape_output` catches their rendering).
    """
    cls = type(value)
    if cls is str:
        return escape(value) if not value.isprintable() else value
    if cls in _ATOMS:
        return value
    if isinstance(value, str):
        return escape(value)
    if _memo is None:
        _memo = {}
    key = id(value)
    if key in _memo:
        return _memo[key]
    _memo[key] = value  # a reference cycle sees the original; rendering is bounded elsewhere
    _memo[key] = result = _escape_container(value, _memo)
    return result


def _escape_container(value: Any, memo: dict[int, Any]) -> Any:
    cls = type(value)
    if isinstance(value, dict):
        items = [(escape_values(k, memo), escape_values(v, memo)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items())):
            return value
        return dict(items)
    if isinstance(value, (list, tuple, set, frozenset)):
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple) and len(value) > 64 and _clean_rows(value):
            return value
        new = [escape_values(v, memo) for v in value]
        if all(a is b for a, b in zip(new, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)._make(new)  # type: ignore[attr-defined]  # a namedtuple
        return type(value)(new) if isinstance(value, (tuple, set, frozenset)) else new
    names = _field_names(cls)  # type: ignore[arg-type]  # a class is hashable
    if names:
        changed = {}
        for name in names:
            old = getattr(value, name)
            new = escape_values(old, memo)
            if new is not old:
                changed[name] = new
        if not changed:
            return value
        clone = copy.copy(value)
        for name, new in changed.items():
            object.__setattr__(clone, name, new)  # frozen dataclasses too
        return clone
    return value


_ATOMS = frozenset({int, float, bool, type(None), bytes, bytearray})
_ROW_FIELD_TYPES = _ATOMS | {str}
_ROW_SEQUENCES = frozenset({list, tuple})  # exactly these (a namedtuple is a class of its own)


def _clean_rows(rows: list | tuple) -> bool:
    """True where ``rows`` are dataclasses of one class whose fields are all atoms, strings with nothing to escape,
    or lists or tuples of those (a shape): the rows of a large report (a plan's 200k key decisions, ``check
    --health``'s keys), checked a field at a time in a few passes at C speed instead of a visit per value (a second
    of a 200k-key ``strip-frozen``). Anything else (a deeper container, another class) takes the general path."""
    cls = type(rows[0])
    names = _field_names(cls)  # type: ignore[arg-type]  # a class is hashable
    if not names or set(map(type, rows)) != {cls}:
        return False
    getter = operator.attrgetter(*names) if len(names) > 1 else (lambda row: (getattr(row, names[0]),))
    text: list[str] = []
    if not all(_clean_column(column, text, nested=True) for column in zip(*map(getter, rows))):
        return False
    joined = "".join(text)
    return joined.isprintable() or _UNSAFE_RE.search(joined) is None


def _clean_column(values: tuple | list, text: list[str], nested: bool) -> bool:
    """True where ``values`` (one field of every row) are atoms, strings, or (``nested``) lists or tuples of those;
    their strings are added to ``text``, to be checked at once."""
    types = set(map(type, values))
    if types <= _ATOMS:
        return True
    if types == {str}:
        text.append("".join(values))
        return True
    if not types <= _ROW_FIELD_TYPES:
        if not nested or not types <= _ROW_FIELD_TYPES | _ROW_SEQUENCES:
            return False
        sequences = [v for v in values if type(v) in _ROW_SEQUENCES]
        if not _clean_column(list(itertools.chain.from_iterable(sequences)), text, nested=False):
            return False
    if str in types:
        text.extend([v for v in values if type(v) is str])
    return True


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names (empty for any other class)."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


def text_safe(render: F) -> F:
    """Wrap a text renderer: its report's strings are escaped first, its output checked last."""

    @functools.wraps(render)
    def wrapper(report: Any, *args: Any, **kwargs: Any) -> str:
        return escape_output(render(escape_values(report), *args, **kwargs))

    return wrapper  # type: ignore[return-value]
