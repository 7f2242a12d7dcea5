"""Paths into values read from a checkpoint (``optimizer.param_groups[0].lr``): look one up, list the leaves, and
compare two values field by field.

A decoded common state, rng state or ``_extra_state`` is a tree of dicts, lists, tuples, namespaces and inert
stand-ins. These walks step into dicts by key, lists and tuples by index, namespaces by attribute and stand-ins and
records by their recorded fields; nothing is called. Like :mod:`ckptdoctor.pickle.plain`'s walks, each visits at
most ``MAX_NODES`` nodes and ``MAX_DEPTH`` levels and says where it stopped, and equality of whole subtrees is a
fingerprint with one memo per walk (shared references digested once), so a small pickle whose expansion is huge
costs what its pickle costs.
"""

from __future__ import annotations

import argparse
import collections
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quoted
from typing import Any

from ckptdoctor.pickle.plain import ELIDED, MAX_DEPTH, MAX_NODES, digest_with_memo

Step = Any  # a dict key (any hashable), an index, or an attribute name
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SCALARS = (bool, int, float, str, type(None), bytes, bytearray, complex)
_SEQUENCES = (list, tuple, collections.deque)
ARGS_FIELD = "__args__"  # a stand-in's call arguments, where it also recorded a dict state


def _view(value: Any) -> str | None:
    return getattr(type(value), "__ckd_view__", None)


def children(value: Any) -> list[tuple[Step, Any]] | None:
    """The (step, child) pairs a walk goes into, or None for a leaf (a scalar, a tensor or dtype reference, a stand-in
    that recorded only call arguments: ``RerunMode('validate_results')``)."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, _SEQUENCES):
        return list(enumerate(value))
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return list(vars(value).items())
    view = _view(value)
    if view in ("stand-in", "record"):
        state = value.stand_in_state
        if not isinstance(state, dict):
            return None
        args = value.stand_in_args if view == "stand-in" else ()
        return ([(ARGS_FIELD, args)] if args else []) + list(state.items())
    return None


def kind_of(value: Any) -> str:
    """What a walk compares before stepping in: two values of different kinds are one change, not a field diff."""
    view = _view(value)
    if view in ("stand-in", "record"):
        module, name = type(value).__ckd_global__
        return f"{module}.{name}"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, _SEQUENCES):
        return "sequence"
    return type(value).__qualname__


def type_name(value: Any) -> str:
    """The readable name of a value's type: a stand-in's global (``megatron.core.enums.ModelType``), else the
    Python type's name."""
    view = _view(value)
    if view in ("stand-in", "record"):
        module, name = type(value).__ckd_global__
        return f"{module}.{name}"
    if view == "dtype":
        return "torch.dtype"
    return type(value).__name__


def join(prefix: str, step: Step) -> str:
    """``prefix`` and one step as a path: ``.name`` for identifiers, ``[3]`` for indexes and int keys,
    ``["a.b"]`` for other strings, ``[<repr>]`` for other keys."""
    if isinstance(step, str) and _IDENTIFIER.match(step):
        return f"{prefix}.{step}" if prefix else step
    if isinstance(step, int) and not isinstance(step, bool):
        return f"{prefix}[{step}]"
    if isinstance(step, str):
        return f"{prefix}[{_quoted(step)}]"
    text = repr(step) if isinstance(step, (*_SCALARS, tuple)) else f"<{type(step).__name__}>"
    return f"{prefix}[{text[:60]}]"


# --- lookup ------------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""\.?([^.\[\]]+)|\[(-?\d+)\]|\[("(?:[^"\\]|\\.)*"|'[^']*')\]""")


class PathError(LookupError):
    """A path that names nothing: ``at`` is the path that was found, ``step`` what was not found there, and
    ``choices`` the steps there are (as paths)."""

    def __init__(self, at: str, step: str, choices: list[str]) -> None:
        super().__init__(f"{at or 'the value'} has no {step}")
        self.at, self.step, self.choices = at, step, choices


def parse_path(text: str) -> list[tuple[str, str | int]]:
    """``a.b[0]["c.d"]`` -> [("name", "a"), ("name", "b"), ("index", 0), ("key", "c.d")]; raises ValueError."""
    tokens: list[tuple[str, str | int]] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise ValueError(f'bad path {text!r} at {text[pos:]!r} (names, [N] and ["key"])')
        name, index, quoted = match.groups()
        if name is not None:
            tokens.append(("name", name))
        elif index is not None:
            tokens.append(("index", int(index)))
        else:
            tokens.append(("key", quoted[1:-1].replace('\\"', '"').replace("\\\\", "\\")))
        pos = match.end()
    return tokens


def lookup(value: Any, text: str, prefix: str = "") -> tuple[Any, str]:
    """The value at path ``text`` under ``value`` and its path as :func:`join` writes it (after ``prefix``); raises
    :class:`PathError` (or ValueError for a path that does not parse). Names join with the next ones when a key
    holds a dot (``["a.b"]`` may be written ``a.b``)."""
    tokens = parse_path(text)
    path, i = prefix, 0
    while i < len(tokens):
        pairs = children(value)
        kind, token = tokens[i]
        if pairs is None:
            raise PathError(path, _token_text(kind, token), [])
        found = None
        if kind == "name":
            run = 1
            while i + run < len(tokens) and tokens[i + run][0] == "name":
                run += 1
            for width in range(run, 0, -1):  # the longest dotted name that is a key
                wanted = ".".join(str(t) for _, t in tokens[i : i + width])
                found = _find(pairs, wanted)
                if found is not None:
                    i += width
                    break
        else:
            found = _find(pairs, token)
            i += 1
        if found is None:
            raise PathError(path, _token_text(kind, token), [join("", s).lstrip(".") for s, _ in pairs[:200]])
        step, value = found
        path = join(path, step)
    return value, path


def _token_text(kind: str, token: str | int) -> str:
    return f"[{token}]" if kind == "index" else repr(token) if kind == "key" else str(token)


def _find(pairs: list[tuple[Step, Any]], wanted: str | int) -> tuple[Step, Any] | None:
    for step, child in pairs:
        if step == wanted and type(step) is type(wanted):
            return step, child
    for step, child in pairs:  # "0" names the int key 0, 0 the str key "0"
        if isinstance(step, (str, int)) and not isinstance(step, bool) and str(step) == str(wanted):
            return step, child
    return None


# --- leaves ------------------------------------------------------------------------------------------------------


def _packed(value: Any) -> bool:
    """A list or tuple of scalars: one leaf line (an rng state's 625 ints), not one line per item."""
    return isinstance(value, _SEQUENCES) and all(isinstance(v, _SCALARS) for v in value)


def leaves(
    value: Any, prefix: str = "", max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH
) -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf under ``value`` in order (lists of scalars are one leaf; an empty container is a
    leaf), at most ``max_nodes`` nodes and ``max_depth`` levels: where a walk stops, ``(path, ELIDED)``."""
    budget = [max_nodes]
    yield from _leaves(value, prefix, budget, max_depth)


def _leaves(value: Any, path: str, budget: list[int], depth: int) -> Iterator[tuple[str, Any]]:
    budget[0] -= 1
    if budget[0] < 0 or depth < 0:
        yield path, ELIDED
        return
    pairs = None if _packed(value) else children(value)
    if not pairs:
        yield path, value
        return
    for step, child in pairs:
        if budget[0] <= 0:
            yield path, ELIDED
            return
        yield from _leaves(child, join(path, step), budget, depth - 1)


# --- field-level diff --------------------------------------------------------------------------------------------


@dataclass
class FieldChange:
    """One differing field: its path, how it differs (``changed``, ``only_a``, ``only_b``) and both values (None on
    the side that lacks it)."""

    path: str
    change: str
    a: Any
    b: Any


@dataclass
class FieldDiff:
    """The differing fields of two values, in walk order; ``complete`` is False where the walk stopped at its node or
    depth limit (``changes`` are the ones found before)."""

    changes: list[FieldChange] = field(default_factory=list)
    complete: bool = True


def diff_fields(a: Any, b: Any, prefix: str = "", max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> FieldDiff:
    """The leaves where ``a`` and ``b`` differ: dicts by key, lists and tuples by index, namespaces, stand-ins and
    records by their recorded fields; values of different kinds, or leaves, are one change at their path. Equal
    subtrees are skipped whole (by fingerprint)."""
    out = FieldDiff()
    memo: dict[int, bytes] = {}

    def digest(value: Any) -> bytes | None:
        try:
            return digest_with_memo(value, memo)
        except RecursionError:
            return None

    budget = [max_nodes]
    _diff(a, b, prefix, out, budget, max_depth, digest)
    return out


def _diff(
    a: Any,
    b: Any,
    path: str,
    out: FieldDiff,
    budget: list[int],
    depth: int,
    digest: Callable[[Any], bytes | None],
) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        out.complete = False
        return
    if type(a) is type(b):
        da = digest(a)
        if da is not None and da == digest(b):
            return
    pairs_a = children(a) if kind_of(a) == kind_of(b) and depth > 0 else None
    pairs_b = children(b) if pairs_a is not None else None
    if pairs_a is None or pairs_b is None:
        if depth <= 0:
            out.complete = False
        out.changes.append(FieldChange(path, "changed", a, b))
        return
    if isinstance(a, _SEQUENCES):
        for i in range(max(len(pairs_a), len(pairs_b))):
            if budget[0] <= 0:
                out.complete = False
                return
            step_path = join(path, i)
            if i >= len(pairs_b):
                out.changes.append(FieldChange(step_path, "only_a", pairs_a[i][1], None))
            elif i >= len(pairs_a):
                out.changes.append(FieldChange(step_path, "only_b", None, pairs_b[i][1]))
            else:
                _diff(pairs_a[i][1], pairs_b[i][1], step_path, out, budget, depth - 1, digest)
        return
    map_b = dict(pairs_b)  # keys of a pickled dict are hashable (the unpickler built the dict)
    seen = set()
    for step, child in pairs_a:
        if budget[0] <= 0:
            out.complete = False
            return
        seen.add(step)
        if step in map_b:
            _diff(child, map_b[step], join(path, step), out, budget, depth - 1, digest)
        else:
            out.changes.append(FieldChange(join(path, step), "only_a", child, None))
    for step, child in pairs_b:
        if step not in seen:
            out.changes.append(FieldChange(join(path, step), "only_b", None, child))
