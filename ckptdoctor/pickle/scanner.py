"""A pre-pass over a pickle's opcodes that enforces ckptdoctor's resource and shape limits.

The C unpickler is fast but offers no hook per opcode, and a few MB of hostile input can make it (or code that
touches its result) crash or balloon: a million-deep nested tuple used as a dict key overflows the C stack
when it is hashed (SIGSEGV), a ``LONG_BINPUT`` of index 2**31 allocates a memo of gigabytes, a ``BUILD`` on a
class object changes that class for every later read. This scanner walks the opcode stream once, tracking for
each stack item only whether it is a global (a class or function) and how deeply tuples nest in it, and
refuses what the limits forbid *before* the real unpickler runs. Names of globals are checked by the
unpickler itself (``policy.resolve_global``), which sees every GLOBAL and STACK_GLOBAL.

Tuples are the only containers whose hash recurses in C without a recursion check; every other path that
could build deep nesting (``builtins.tuple``, ``copyreg._reconstructor`` with a tuple base, ...) is off the
allowlist, so the tuple depth tracked here bounds the C recursion of any hash or comparison of the result.
"""

from __future__ import annotations

import mmap
import pickle
import re
import struct
from collections.abc import Callable
from typing import Any

from ckptdoctor.errors import PickleLimitError
from ckptdoctor.pickle.limits import PickleLimits, current_limits
from ckptdoctor.pickle.opcodes import (
    ADDITEMS,
    APPEND1,
    ARG_WIDTH,
    BINGET,
    BINPERSID,
    BUILD,
    CONTAINER_MARK,
    DUP,
    EMPTY_TUPLE,
    FRAME,
    GET,
    GLOBAL,
    INST,
    ITEMS_MARK,
    KINDS,
    LONG_BINGET,
    MARK,
    MEMOIZE,
    NEWOBJ_EX,
    OBJ_MARK,
    PERSID,
    POP,
    POP_MARK,
    PROTO,
    PUSH,
    PUSH_BYTE_NUMBER,
    PUSH_LEN,
    PUSH_LEN_NUMBER,
    PUSH_NL,
    PUSH_NL_NUMBER,
    PUSH_NUMBER,
    PUT,
    REDUCE,
    REFUSED_OPCODES,
    SETITEM,
    SETITEMS,
    STACK_GLOBAL,
    STOP,
    TUPLE1,
    TUPLE2,
    TUPLE3,
    TUPLE_MARK,
)

__all__ = ["scan", "scan_python"]

_scan_c: Callable[..., None | int | tuple[int, str]] | None
try:  # the same walk in C, built at install where a C compiler was found (optional: see pyproject.toml)
    from ckptdoctor.pickle._native import scan as _scan_c
except ImportError:
    _scan_c = None
_FALLBACK = -1  # the C walk's answer for a pickle it leaves to the Python walk


_GLOBAL_REF = -1  # a stack item that is a global (class or function) from GLOBAL / STACK_GLOBAL
_NUMBER = -2  # an int or a float: a hash any process computes alike (tuples, n >= 1, too)
# A global whose objects can be dict keys without hash flooding: their hash is the identity, a keyed digest
# (stand-ins) or a randomized str hash, or they are unhashable. What it builds is an ordinary object (0).
_GLOBAL_SAFE_HASH = -3
# Stack items <= _STRING are short strings the scanner remembers (index _STRING - item into a table), so that
# STACK_GLOBAL knows which global it makes; everywhere else they count as ordinary objects (all tests are
# ``> 0`` or equality with the codes above).
_STRING = -1000
_MAX_REMEMBERED_STRING = 256  # module and class names; longer strings are not names


def _memo_index(buf: bytes, pos: int, width: int) -> tuple[int, int]:
    """The memo index of a GET/PUT opcode (1 or 4 bytes, or a protocol 0 decimal line) and the next position."""
    if width == 1:
        return buf[pos], pos + 1
    if width == 4:
        return struct.unpack_from("<I", buf, pos)[0], pos + 4
    end = buf.index(b"\n", pos)
    idx = int(buf[pos:end])
    if idx < 0:
        raise ValueError("negative memo index")
    return idx, end + 1


def scan(
    data: bytes | bytearray | memoryview | mmap.mmap,
    limits: PickleLimits | None = None,
    safe_hash: Callable[[str, str], bool] | None = None,
) -> None:
    """Raise :class:`PickleLimitError` if ``data`` breaks a limit or uses an opcode we never accept, and
    :class:`pickle.UnpicklingError` where it is damaged before those limits are reached.

    Stack items are ints: 0 for an ordinary object, ``_GLOBAL_REF`` for a global, ``_NUMBER`` for an int or
    float, n >= 1 for a tuple whose tuples nest n deep (or an object built from such a tuple: ``torch.Size``
    is one). Protocol 5 out-of-band buffers and the copyreg extension registry are refused.

    ``safe_hash(module, name)`` says that objects built by that global cannot flood a dict (see
    ``_GLOBAL_SAFE_HASH``): they are not counted as hashed keys (DCP's ``storage_data`` has one
    ``MetadataIndex`` key per chunk, hundreds of thousands in a large checkpoint). Without it every object built
    from a tuple is counted, as a tuple would be.

    The walk runs in C where the extension was built (``ckptdoctor/pickle/_scan.c``: the same walk, ~50x
    faster), else in Python (:func:`scan_python`, the reference); the C walk hands a pickle to the Python one
    where it meets a protocol 0 memo opcode, whose index is parsed by Python's ``int()``.
    """
    limits = limits or current_limits()
    limits.check_size(len(data))
    # an anonymous map (a large .metadata, see files.read_releasable) is scanned in place: no second copy
    buf = data if isinstance(data, (bytes, mmap.mmap)) else bytes(data)
    try:
        _scan(buf, limits, safe_hash)
    except PickleLimitError as exc:
        raise _naming_the_global(exc, buf) from None


_MUTATION = re.compile(r"(BUILD|item assignment) on a class or function.* at byte (\d+)\Z")
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_GET_OPS, _PUT_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"}), frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _naming_the_global(error: PickleLimitError, buf: bytes | mmap.mmap) -> PickleLimitError:
    """A refused BUILD or item assignment on a class or function, its message naming that global: the walk above
    knows only that a stack item is a global. Only on this refusal, the opcodes up to it are walked again with
    pickletools (names of globals and strings kept, any other object None) to find which one."""
    match = _MUTATION.search(str(error))
    if match is None:
        return error
    name = _mutated_global(bytes(buf[: int(match.group(2)) + 9]), int(match.group(2)) - 1)
    if name is None:
        return error
    named = PickleLimitError(f"{error}: the global {name}")
    named.global_name = name
    return named


class _Global(str):
    """A global's ``module.name`` on the naming walk's stack (strings are plain ``str``)."""


def _mutated_global(buf: bytes, position: int) -> str | None:
    import pickletools

    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, pos in pickletools.genops(buf):
            name = op.name
            if pos is not None and pos >= position:
                if name == "BUILD":
                    target = stack[-2]
                elif name in ("SETITEM", "APPEND"):
                    target = stack[-3 if name == "SETITEM" else -2]
                else:  # SETITEMS, APPENDS, ADDITEMS: the object below the mark
                    target = stack[marks[-1] - 1]
                return str(target) if isinstance(target, _Global) else None
            if name == "GLOBAL":
                stack.append(_Global(str(arg).replace(" ", ".")))
            elif name == "STACK_GLOBAL":
                module, item = stack[-2:]
                del stack[-2:]
                stack.append(_Global(f"{module}.{item}") if isinstance(module, str) and isinstance(item, str) else None)
            elif name in _STRING_OPS:
                stack.append(str(arg))
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in _PUT_OPS:
                memo[arg] = stack[-1]
            elif name in _GET_OPS:
                stack.append(memo.get(arg))
            elif name == "MARK":
                marks.append(len(stack))
            elif pickletools.markobject in op.stack_before:
                below = op.stack_before.index(pickletools.markobject)
                del stack[marks.pop() - below :]
                stack.extend([None] * len(op.stack_after))
            else:
                del stack[len(stack) - len(op.stack_before) :]
                stack.extend([None] * len(op.stack_after))
    except Exception:  # noqa: BLE001 - a damaged pickle: the refusal stands without the name
        return None
    return None


def _scan(buf: bytes | mmap.mmap, limits: PickleLimits, safe_hash: Callable[[str, str], bool] | None) -> None:
    if _scan_c is not None:
        try:
            verdict = _scan_c(
                buf,
                limits.max_tuple_depth,
                limits.max_string,
                limits.max_int_bytes,
                limits.max_hashed_keys,
                safe_hash,
            )
        except OverflowError:  # a limit beyond int64: only the Python walk computes with it
            verdict = _FALLBACK
        if verdict is None:
            return
        if isinstance(verdict, tuple):
            kind, message = verdict
            raise PickleLimitError(message) if kind == 1 else pickle.UnpicklingError(message)
    scan_python(buf if isinstance(buf, bytes) else bytes(buf), limits, safe_hash)


def scan_python(buf: bytes, limits: PickleLimits, safe_hash: Callable[[str, str], bool] | None = None) -> None:
    """:func:`scan`'s walk in Python (the reference the C walk is tested against)."""
    size = len(buf)
    kinds = KINDS
    arg_width = ARG_WIDTH
    max_depth = limits.max_tuple_depth
    max_string = limits.max_string
    max_int = limits.max_int_bytes
    hashed_keys_left = limits.max_hashed_keys
    stack: list[int] = []
    marks: list[int] = []
    memo: list[int] = []
    strings: list[bytes] = []  # remembered short strings, by _STRING - item
    string_codes: dict[bytes, int] = {}
    push, pop, memo_append = stack.append, stack.pop, memo.append
    unpack_from = struct.unpack_from
    # The opcodes come from an iterator over the bytes (the cheapest way CPython steps through bytes: 1.3x
    # faster than indexing, measured on a 20k-key .metadata); an argument is taken with next() (one byte) or by
    # seeking the iterator past it (bytes_iterator's __setstate__). Its position is size - remaining().
    opcodes: Any = iter(buf)  # typeshed's Iterator has neither __length_hint__ nor __setstate__
    next_byte = opcodes.__next__
    remaining = opcodes.__length_hint__
    seek = opcodes.__setstate__

    def global_item(module: bytes, name: bytes) -> int:
        if safe_hash is None:
            return _GLOBAL_REF
        try:
            safe = safe_hash(module.decode("utf-8"), name.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return _GLOBAL_REF  # the unpickler refuses the name itself
        return _GLOBAL_SAFE_HASH if safe else _GLOBAL_REF

    def fail(what: str) -> PickleLimitError:
        return PickleLimitError(f"{what} at byte {size - remaining()}")

    def corrupt(what: str) -> pickle.UnpicklingError:
        # Damage, not a policy: callers report it like any other corrupt pickle.
        return pickle.UnpicklingError(f"{what} at byte {size - remaining()}")

    try:
        for op in opcodes:
            kind = kinds[op]
            # The most frequent opcodes of a DCP .metadata come first (2M opcodes at 20k keys).
            if kind == MEMOIZE:
                memo_append(stack[-1])
            elif kind == BINGET:
                push(memo[next_byte()])
            elif kind == REDUCE:  # REDUCE and NEWOBJ: callable/class, argument tuple -> object
                args = pop()
                stack[-1] = args if args > 0 and stack[-1] != _GLOBAL_SAFE_HASH else 0
            elif kind == LONG_BINGET:
                pos = size - remaining()
                push(memo[unpack_from("<I", buf, pos)[0]])
                seek(pos + 4)
            elif kind == PUSH_BYTE_NUMBER:
                next_byte()
                push(_NUMBER)
            elif kind == PUSH:
                push(0)
            elif kind == MARK:
                marks.append(len(stack))
            elif kind == EMPTY_TUPLE:
                push(1)
            elif kind == BUILD:
                pop()
                if stack[-1] == _GLOBAL_REF or stack[-1] == _GLOBAL_SAFE_HASH:
                    raise fail("BUILD on a class or function (would change it for every later read)")
            elif kind == TUPLE1:
                depth = stack[-1]
                depth = depth + 1 if depth > 0 else 1
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                stack[-1] = depth
            elif kind == TUPLE2:
                depth = pop()
                other = stack[-1]
                if other > depth:
                    depth = other
                depth = depth + 1 if depth > 0 else 1
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                stack[-1] = depth
            elif kind == PUSH_NUMBER:
                pos = size - remaining() + arg_width[op]
                if pos > size:
                    raise corrupt("truncated")
                seek(pos)
                push(_NUMBER)
            elif kind == GET:  # protocol 0 GET (BINGET and LONG_BINGET have their own kinds)
                idx, pos = _memo_index(buf, size - remaining(), arg_width[op])
                seek(pos)
                push(memo[idx])
            elif kind in (SETITEMS, ADDITEMS):
                mark = marks.pop()
                keys = stack[mark::2] if kind == SETITEMS else stack[mark:]
                del stack[mark:]
                if op != 0x91 and (stack[-1] == _GLOBAL_REF or stack[-1] == _GLOBAL_SAFE_HASH):
                    raise fail("item assignment on a class or function")
                for key in keys:
                    if key == _NUMBER or key > 0:
                        hashed_keys_left -= 1
                if hashed_keys_left < 0:
                    raise fail(f"more than {limits.max_hashed_keys} int, float or tuple keys (hash flooding)")
                if op == 0x91:  # FROZENSET builds a new object from the items
                    push(0)
            elif kind == TUPLE3:
                items = stack[-3:]
                del stack[-3:]
                if len(items) != 3:
                    raise corrupt("stack underflow")
                depth = 1 + max(0, *items)
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                push(depth)
            elif kind in (ITEMS_MARK, SETITEM, APPEND1):
                if kind == ITEMS_MARK:
                    del stack[marks.pop() :]
                else:
                    if kind == SETITEM and (stack[-2] == _NUMBER or stack[-2] > 0):
                        hashed_keys_left -= 1
                        if hashed_keys_left < 0:
                            raise fail(f"more than {limits.max_hashed_keys} int, float or tuple keys (hash flooding)")
                    del stack[-2 if kind == SETITEM else -1 :]
                if stack[-1] == _GLOBAL_REF or stack[-1] == _GLOBAL_SAFE_HASH:
                    raise fail("item assignment on a class or function")
            elif kind in (PUSH_LEN, PUSH_LEN_NUMBER):
                pos = size - remaining()
                width = arg_width[op]
                if width == 1:
                    length = buf[pos]
                elif width == 4:
                    length = unpack_from("<I", buf, pos)[0]
                else:
                    length = unpack_from("<Q", buf, pos)[0]
                start = pos + width
                pos = start + length
                if pos > size:  # a length past the end is damage, not a giant
                    raise corrupt("truncated")
                if length > max_string:
                    raise fail(f"a string of {length} bytes exceeds the limit of {max_string}")
                seek(pos)
                if kind == PUSH_LEN_NUMBER:
                    if length > max_int:
                        raise fail(f"an integer of {length} bytes exceeds the limit of {max_int}")
                    push(_NUMBER)
                elif (op == 0x8C or op == 0x58) and length <= _MAX_REMEMBERED_STRING:  # (SHORT_)BINUNICODE
                    text = buf[start:pos]
                    code = string_codes.get(text)
                    if code is None:
                        code = string_codes[text] = _STRING - len(strings)
                        strings.append(text)
                    push(code)
                else:
                    push(0)
            elif kind == TUPLE_MARK:
                mark = marks.pop()
                items = stack[mark:]
                del stack[mark:]
                depth = 1 + max(0, *items) if items else 1
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                push(depth)
            elif kind == PUT:
                idx, pos = _memo_index(buf, size - remaining(), arg_width[op])
                seek(pos)
                if idx == len(memo):  # Python's picklers number memo slots 0, 1, 2, ...
                    memo_append(stack[-1])
                elif idx < len(memo):
                    memo[idx] = stack[-1]
                elif idx > len(memo) + (1 << 20):  # would make the unpickler allocate a memo of that size
                    raise fail(f"memo index {idx} out of sequence")
                else:
                    raise corrupt(f"memo index {idx} out of sequence")
            elif kind == CONTAINER_MARK:  # LIST, DICT from the items since the mark
                mark = marks.pop()
                if op == 0x64:  # DICT: every other item is a key
                    for key in stack[mark::2]:
                        if key == _NUMBER or key > 0:
                            hashed_keys_left -= 1
                    if hashed_keys_left < 0:
                        raise fail(f"more than {limits.max_hashed_keys} int, float or tuple keys (hash flooding)")
                del stack[mark:]
                push(0)
            elif kind == STACK_GLOBAL:
                module_item, name_item = stack[-2:]  # fewer than two: ValueError, a malformed pickle
                del stack[-2:]
                if module_item <= _STRING and name_item <= _STRING:
                    push(global_item(strings[_STRING - module_item], strings[_STRING - name_item]))
                else:
                    push(_GLOBAL_REF)
            elif kind == GLOBAL:
                pos = size - remaining()
                module_end = buf.index(b"\n", pos)
                name_end = buf.index(b"\n", module_end + 1)
                push(global_item(buf[pos:module_end], buf[module_end + 1 : name_end]))
                seek(name_end + 1)
            elif kind in (PUSH_NL, PUSH_NL_NUMBER):
                pos = size - remaining()
                end = buf.index(b"\n", pos)
                if end - pos > max_string:
                    raise fail(f"a string of {end - pos} bytes exceeds the limit of {max_string}")
                if kind == PUSH_NL_NUMBER and end - pos > 3 * max_int:  # INT / LONG / FLOAT as text
                    raise fail(f"a number of {end - pos} characters exceeds the limit of {3 * max_int}")
                seek(end + 1)
                push(_NUMBER if kind == PUSH_NL_NUMBER else 0)
            elif kind == POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    pop()
            elif kind == POP_MARK:
                del stack[marks.pop() :]
            elif kind == DUP:
                push(stack[-1])
            elif kind == NEWOBJ_EX:  # class, args, kwargs -> object (a torch.Size keeps its args' depth)
                args = stack[-2]
                del stack[-2:]
                stack[-1] = args if args > 0 and stack[-1] != _GLOBAL_SAFE_HASH else 0
            elif kind == FRAME:
                seek(size - remaining() + 8)
            elif kind == PROTO:
                next_byte()
            elif kind == BINPERSID:
                stack[-1] = 0
            elif kind == PERSID:
                seek(buf.index(b"\n", size - remaining()) + 1)
                push(0)
            elif kind == OBJ_MARK:
                del stack[marks.pop() :]
                push(0)
            elif kind == INST:
                seek(buf.index(b"\n", buf.index(b"\n", size - remaining()) + 1) + 1)
                del stack[marks.pop() :]
                push(0)
            elif kind == STOP:
                return
            elif op in REFUSED_OPCODES:
                raise fail(f"opcode {REFUSED_OPCODES[op]} is not accepted")
            else:
                raise corrupt(f"invalid opcode {bytes([op])!r}")
    except (PickleLimitError, pickle.UnpicklingError):
        raise
    except (IndexError, KeyError, ValueError, struct.error, StopIteration):
        raise corrupt("malformed pickle") from None
    raise corrupt("malformed pickle: no STOP")  # the bytes ended (or an argument ran past them) first
