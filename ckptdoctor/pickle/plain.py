"""Bounded views of values read from a checkpoint: JSON-able form, short text, and equality.

A pickle of a few hundred bytes can hold a graph whose expansion has 10**40 nodes (a list of ten references
to a list of ten references to ...), or nest a million levels deep. Everything that walks a value read from
a checkpoint (rendering, comparing) goes through here: each walk visits at most ``MAX_NODES`` nodes and
``MAX_DEPTH`` levels and says where it stopped, and equality follows shared references once (linear in the
pickle, not in the expansion).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import hashlib
import io
import math
import pathlib
import types
import uuid
from collections.abc import Iterator
from json.encoder import encode_basestring_ascii as _quoted
from typing import Any

# Types whose repr is short and cannot recurse into pickled data (and the classes that declare the view "repr" or
# "dtype", below).
_SAFE_REPR = (
    datetime.date,
    datetime.time,
    datetime.timedelta,
    datetime.timezone,
    uuid.UUID,
    pathlib.PurePath,
    io.BytesIO,
    complex,
)

MAX_NODES = 10_000
MAX_DEPTH = 32
ELIDED = "..."
_SCALARS = (bool, int, float, str, type(None))
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _view(value: Any) -> str | None:
    """How the walks show an object of ckptdoctor's own pickle classes, as its class declares it (``__ckd_view__``):
    ``"stand-in"`` (:class:`~ckptdoctor.pickle.stand_ins.StandIn`: its global's name, args and state), ``"record"``
    (:class:`~ckptdoctor.pickle.stand_ins.Record`: its global's name and fields), ``"repr"`` (a short repr of its
    own: ``TensorRef``, ``StorageTypeRef``) and ``"dtype"`` (``DtypeRef``: its repr, its str in JSON). Those classes
    sit above this module: their ``__repr__``, ``__eq__`` and ``__hash__`` are these walks."""
    return getattr(type(value), "__ckd_view__", None)


def to_plain(value: Any, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> Any:
    """Plain JSON values: dataclasses become dicts, stand-ins and dtypes their readable form; a walk past
    ``max_nodes`` nodes or ``max_depth`` levels shows ``"..."`` where it stopped.

    Dataclasses are ckptdoctor's own (reports and their rows: the unpickler never builds one), as many as the
    checkpoint has keys: they cost nothing, and each of their fields is walked with a budget of its own. So a report
    lists every one of 200k keys, and a value read from the checkpoint in one field is bounded there without
    starving the fields after it."""
    budget = [max_nodes, max_nodes]  # left, and what each dataclass field starts with
    return _plain(value, budget, max_depth)


OMIT_NONE = {"omit_none": True}  # dataclasses.field(metadata=OMIT_NONE): left out of the JSON while it is None


_FIELD_NAMES: dict[type, tuple[tuple[str, bool], ...]] = {}  # dataclass -> (name, omit when None) per field


def _fields(value: Any) -> list[tuple[str, Any]]:
    """A dataclass's (name, value) pairs as JSON shows them (fields marked :data:`OMIT_NONE` only when set)."""
    names = _FIELD_NAMES.get(type(value))
    if names is None:  # once per class: a report has 200k rows of one class
        names = tuple((f.name, bool(f.metadata.get("omit_none"))) for f in dataclasses.fields(value))
        _FIELD_NAMES[type(value)] = names
    pairs = []
    for name, omit_none in names:
        v = getattr(value, name)
        if v is None and omit_none:
            continue
        pairs.append((name, v))
    return pairs


def _plain(value: Any, budget: list[int], depth: int) -> Any:
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            # JSON has no NaN or Infinity (json.dumps writes them, strict parsers refuse the document): the
            # names json.dumps would have written, as strings
            return _NON_FINITE[repr(value)]
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if depth <= 0:
            return ELIDED
        return {name: _plain(v, [budget[1], budget[1]], depth - 1) for name, v in _fields(value)}
    budget[0] -= 1
    if budget[0] < 0 or depth <= 0:
        return ELIDED
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if budget[0] <= 0:
                out[ELIDED] = f"{len(value) - len(out)} more"
                break
            out[str(_plain(k, budget, depth - 1))] = _plain(v, budget, depth - 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        items: list[Any] = []
        for v in value:
            if budget[0] <= 0:
                items.append(f"{ELIDED} {len(value) - len(items)} more")
                break
            items.append(_plain(v, budget, depth - 1))
        return items
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, enum.Enum) or _view(value) == "dtype":
        return str(value)
    return short_repr(value)


def iter_json(value: Any, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> Iterator[str]:
    """``json.dumps(to_plain(value), indent=2)``, in pieces, without the plain tree: a report of 200k rows is
    written as it is walked (the tree of its rows was ~4x the size of the text)."""
    yield from _json(value, [max_nodes, max_nodes], max_depth, 0)


def _dumped(plain: Any, level: int) -> str:
    """``json.dumps(plain, indent=2)`` nested at ``level``. Not json.dumps itself: with an indent it makes a new
    encoder whose closures reference each other, garbage that stays when the CLI has paused the cyclic GC (once a
    row of a 200k-key report, that was GBs)."""
    if plain is None:
        return "null"
    if plain is True:
        return "true"
    if plain is False:
        return "false"
    if isinstance(plain, str):
        return _quoted(plain)
    if isinstance(plain, (int, float)):
        return repr(plain) if isinstance(plain, float) else int.__repr__(plain)
    pad, inner = "\n" + "  " * level, "\n" + "  " * (level + 1)
    if isinstance(plain, dict):
        if not plain:
            return "{}"
        items = (f"{inner}{_quoted(k)}: {_dumped(v, level + 1)}" for k, v in plain.items())
        return "{" + ",".join(items) + pad + "}"
    if not plain:
        return "[]"
    return "[" + ",".join(f"{inner}{_dumped(v, level + 1)}" for v in plain) + pad + "]"


def _json(value: Any, budget: list[int], depth: int, level: int) -> Iterator[str]:
    """The pieces of one value at nesting ``level``, with :func:`_plain`'s budget and depth, item by item."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if depth <= 0:
            yield _dumped(ELIDED, level)
            return
        pairs = _fields(value)
        if all(isinstance(v, _SCALARS) for _, v in pairs):  # a row of a report: one piece, not one per field
            yield _dumped({name: _plain(v, budget, depth - 1) for name, v in pairs}, level)
            return
        yield from _json_items(((name, v, [budget[1], budget[1]]) for name, v in pairs), len(pairs), depth, level)
        return
    if not isinstance(value, (list, tuple, set, frozenset, collections.deque)):  # dicts whole: keys can collide
        yield _dumped(_plain(value, budget, depth), level)
        return
    budget[0] -= 1
    if budget[0] < 0 or depth <= 0:
        yield _dumped(ELIDED, level)
        return
    pad, inner = "  " * level, "  " * (level + 1)
    if not value:
        yield "[]"
        return
    yield "["
    count = 0
    for v in value:
        yield ("\n" if count == 0 else ",\n") + inner
        if budget[0] <= 0:
            yield _dumped(f"{ELIDED} {len(value) - count} more", level + 1)
            count += 1
            break
        yield from _json(v, budget, depth - 1, level + 1)
        count += 1
    yield "\n" + pad + "]"


def _json_items(pairs: Iterator[tuple[str, Any, list[int]]], n: int, depth: int, level: int) -> Iterator[str]:
    """A dataclass's fields, each with a budget of its own (see :func:`to_plain`)."""
    pad, inner = "  " * level, "  " * (level + 1)
    if n == 0:
        yield "{}"
        return
    yield "{"
    for i, (name, v, budget) in enumerate(pairs):
        yield ("\n" if i == 0 else ",\n") + inner + _quoted(name) + ": "
        yield from _json(v, budget, depth - 1, level + 1)
    yield "\n" + pad + "}"


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr`` that never expands more than a few levels or ``limit`` characters (objects from a pickle
    can hold shared references whose full ``repr`` is exponentially long)."""
    view = _view(value)
    if view in ("stand-in", "record") or isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        if view == "stand-in":
            name, args = type(value).__ckd_global__[1], list(value.stand_in_args[:8])
            state = value.stand_in_state
            parts = [_brief(a) for a in args] + ([] if state is None else [f"state={_brief(state)}"])
        else:
            name = type(value).__ckd_global__[1] if view == "record" else type(value).__name__
            fields = value.stand_in_state if view == "record" else vars(value)
            parts = [f"{k}={_brief(v)}" for k, v in list(fields.items())[:16]]
        text = f"{name}({', '.join(parts)})"
    elif view in ("repr", "dtype") or isinstance(value, _SAFE_REPR):
        text = repr(value)
    else:
        text = _brief(value)
    return text if len(text) <= limit else text[: limit - len(ELIDED)] + ELIDED


def _brief(value: Any) -> str:
    """A short, bounded text of a value nested in another one."""
    view = _view(value)
    if view in ("stand-in", "record") or isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        name = type(value).__ckd_global__[1] if view in ("stand-in", "record") else type(value).__name__
        return f"{name}(...)"
    if view in ("repr", "dtype") or isinstance(value, (*_SAFE_REPR, *_SCALARS)):
        text = repr(value)
    elif isinstance(value, (dict, list, tuple, set, frozenset, collections.deque, bytes, bytearray, enum.Enum)):
        plain = to_plain(value, max_nodes=50, max_depth=3)
        text = plain if isinstance(plain, str) else repr(plain)
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + ELIDED


def fingerprint(value: Any) -> bytes:
    """A digest of a value's structure and contents; equal values (by ``same_value``) share it. Shared
    references are digested once, so a small pickle with an exponential expansion costs linear time."""
    return _digest(value, {}, MAX_DEPTH * 8)


def digest_with_memo(value: Any, memo: dict[int, bytes]) -> bytes:
    """:func:`fingerprint` with a memo the caller keeps across calls, for a walk that digests the subtrees of one
    tree (each shared node once in all); the tree must stay alive while the memo is used (it is keyed by ``id``)."""
    return _digest(value, memo, MAX_DEPTH * 8)


def _digest(value: Any, memo: dict[int, bytes], depth: int) -> bytes:
    if isinstance(value, _SCALARS):
        return hashlib.blake2b(f"{type(value).__name__}:{value!r}".encode(), digest_size=16).digest()
    key = id(value)
    known = memo.get(key)
    if known is not None:
        return known
    if depth <= 0:
        raise RecursionError("value nests too deeply to compare")
    h = hashlib.blake2b(digest_size=16)
    h.update(type(value).__qualname__.encode())
    if isinstance(value, dict):
        for part in sorted(_digest(k, memo, depth - 1) + _digest(v, memo, depth - 1) for k, v in value.items()):
            h.update(part)
    elif isinstance(value, (list, tuple)):
        for v in value:
            h.update(_digest(v, memo, depth - 1))
    elif isinstance(value, (set, frozenset)):
        for part in sorted(_digest(v, memo, depth - 1) for v in value):
            h.update(part)
    elif isinstance(value, (bytes, bytearray)):
        h.update(bytes(value))
    elif _view(value) == "stand-in":
        h.update(type(value).qualified_name().encode())
        h.update(_digest(value.stand_in_args, memo, depth - 1))
        h.update(_fresh_digest(value.stand_in_state, memo, depth - 1))
    elif (content := getattr(type(value), "__ckd_content__", None)) is not None:
        h.update(content(value))  # a class above this module says what its equal objects share (TensorRef)
    elif isinstance(value, argparse.Namespace) or (hasattr(value, "__dict__") and not isinstance(value, type)):
        h.update(_fresh_digest(dict(vars(value)), memo, depth - 1))
    else:
        h.update(repr(value).encode())
    memo[key] = digest = h.digest()
    return digest


def _fresh_digest(value: Any, memo: dict[int, bytes], depth: int) -> bytes:
    """:func:`_digest` of a dict made for this digest only (a record's attributes), the same digest but not memoized
    by its id: once it is freed, a later such dict may get the same id, and its memoized digest would be this one's
    (the fingerprints of equal objects differed from one call to the next, 6 times in 20 on a fixture's .metadata)."""
    if type(value) is not dict:
        return _digest(value, memo, depth)
    if depth <= 0:
        raise RecursionError("value nests too deeply to compare")
    h = hashlib.blake2b(digest_size=16)
    h.update(b"dict")
    for part in sorted(_digest(k, memo, depth - 1) + _digest(v, memo, depth - 1) for k, v in value.items()):
        h.update(part)
    return h.digest()


def same_value(a: Any, b: Any) -> bool:
    """Equality that never raises, never expands shared references, and tells 1 from 1.0 from True."""
    if type(a) is not type(b):
        return False
    if isinstance(a, _SCALARS):
        return bool(a == b)
    try:
        return fingerprint(a) == fingerprint(b)
    except RecursionError:
        return False
