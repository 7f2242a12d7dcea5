"""A pre-pass over a pickle's opcodes that enforces ckptdoctor's resource and shape limits.

The C unpickler is fast but offers no hook per opcode, and a few MB of hostile input can make it (or code that
touches its result) crash or balloon: a million-deep nested tuple used as a dict key overflows the C stack
when it is hashed (SIGSEGV), a ``LONG_BINPUT`` of index 2**31 allocates a memo of gigabytes, a ``BUILD`` on a
class object changes that class for every later read. This scanner walks the opcode stream once, tracking for
each stack item only whether it is a global (a class or function) and how deeply tuples nest in it, and
refuses what the limits forbid *before* the real unpickler runs. Names of globals are checked by the
unpickler itself (``safe_globals.resolve_global``), which sees every GLOBAL and STACK_GLOBAL.

Tuples are the only containers whose hash recurses in C without a recursion check; every other path that
could build deep nesting (``builtins.tuple``, ``copyreg._reconstructor`` with a tuple base, ...) is off the
allowlist, so the tuple depth tracked here bounds the C recursion of any hash or comparison of the result.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from typing import Any

from ckptdoctor.errors import PickleLimitError
from ckptdoctor.pickle_limits import PickleLimits, current_limits

__all__ = ["scan"]


# opcode -> kind; the kinds are grouped by what the scanner does with the stack.
_PUSH, _PUSH_NL, _PUSH_N, _PUSH_LEN, _MARK, _STOP, _POP, _POP_MARK, _DUP = range(1, 10)
_TUPLE_MARK, _TUPLE3, _CONTAINER_MARK, _APPEND1, _ITEMS_MARK, _SETITEM = range(10, 16)
_BUILD, _REDUCE, _NEWOBJ_EX, _GLOBAL, _STACK_GLOBAL, _GET, _PUT, _MEMOIZE, _FRAME, _PROTO = range(16, 26)
_PERSID, _BINPERSID, _OBJ_MARK, _INST, _BINGET, _LONG_BINGET = range(26, 32)
_PUSH_NUMBER, _PUSH_NL_NUMBER, _PUSH_LEN_NUMBER, _SETITEMS, _ADDITEMS, _TUPLE1, _TUPLE2, _EMPTY_TUPLE = range(32, 40)
_PUSH_BYTE_NUMBER = 40

_KIND = bytearray(256)  # 0: not an opcode we accept
_ARG = [0] * 256  # fixed argument width (bytes), or width of the length prefix for _PUSH_LEN
for _op, _kind, _arg in (
    (b"N", _PUSH, 0),
    (b"\x88", _PUSH, 0),
    (b"\x89", _PUSH, 0),
    (b"K", _PUSH_BYTE_NUMBER, 1),
    (b"M", _PUSH_NUMBER, 2),
    (b"J", _PUSH_NUMBER, 4),
    (b"G", _PUSH_NUMBER, 8),
    (b"]", _PUSH, 0),
    (b"}", _PUSH, 0),
    (b"\x8f", _PUSH, 0),
    (b"I", _PUSH_NL_NUMBER, 0),
    (b"L", _PUSH_NL_NUMBER, 0),
    (b"F", _PUSH_NL_NUMBER, 0),
    (b"S", _PUSH_NL, 0),
    (b"V", _PUSH_NL, 0),
    (b"\x8a", _PUSH_LEN_NUMBER, 1),
    (b"\x8b", _PUSH_LEN_NUMBER, 4),
    (b"U", _PUSH_LEN, 1),
    (b"T", _PUSH_LEN, 4),
    (b"C", _PUSH_LEN, 1),
    (b"B", _PUSH_LEN, 4),
    (b"\x8e", _PUSH_LEN, 8),
    (b"\x8c", _PUSH_LEN, 1),
    (b"X", _PUSH_LEN, 4),
    (b"\x8d", _PUSH_LEN, 8),
    (b"\x96", _PUSH_LEN, 8),
    (b"(", _MARK, 0),
    (b".", _STOP, 0),
    (b"0", _POP, 0),
    (b"1", _POP_MARK, 0),
    (b"2", _DUP, 0),
    (b"t", _TUPLE_MARK, 0),
    (b")", _EMPTY_TUPLE, 0),
    (b"\x85", _TUPLE1, 0),
    (b"\x86", _TUPLE2, 0),
    (b"\x87", _TUPLE3, 0),
    (b"l", _CONTAINER_MARK, 0),
    (b"d", _CONTAINER_MARK, 0),
    (b"\x91", _ADDITEMS, 0),
    (b"a", _APPEND1, 0),
    (b"e", _ITEMS_MARK, 0),
    (b"u", _SETITEMS, 0),
    (b"\x90", _ADDITEMS, 0),
    (b"s", _SETITEM, 0),
    (b"b", _BUILD, 0),
    (b"R", _REDUCE, 0),
    (b"\x81", _REDUCE, 0),
    (b"\x92", _NEWOBJ_EX, 0),
    (b"c", _GLOBAL, 0),
    (b"\x93", _STACK_GLOBAL, 0),
    (b"h", _BINGET, 1),
    (b"j", _LONG_BINGET, 4),
    (b"g", _GET, -1),
    (b"q", _PUT, 1),
    (b"r", _PUT, 4),
    (b"p", _PUT, -1),
    (b"\x94", _MEMOIZE, 0),
    (b"\x95", _FRAME, 8),
    (b"\x80", _PROTO, 1),
    (b"P", _PERSID, 0),
    (b"Q", _BINPERSID, 0),
    (b"o", _OBJ_MARK, 0),
    (b"i", _INST, 0),
):
    _KIND[_op[0]] = _kind
    _ARG[_op[0]] = _arg
_KINDS = tuple(_KIND)  # a tuple: CPython indexes it faster than bytes

# Valid opcodes never accepted: the copyreg extension registry and protocol 5 out-of-band buffers.
_REFUSED_OPCODES = {0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}

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
    data: bytes | bytearray | memoryview,
    limits: PickleLimits | None = None,
    safe_hash: Callable[[str, str], bool] | None = None,
) -> None:
    """Raise :class:`PickleLimitError` if ``data`` breaks a limit or uses an opcode we never accept.

    Stack items are ints: 0 for an ordinary object, ``_GLOBAL_REF`` for a global, ``_NUMBER`` for an int or
    float, n >= 1 for a tuple whose tuples nest n deep (or an object built from such a tuple: ``torch.Size``
    is one). Protocol 5 out-of-band buffers and the copyreg extension registry are refused.

    ``safe_hash(module, name)`` says that objects built by that global cannot flood a dict (see
    ``_GLOBAL_SAFE_HASH``): they are not counted as hashed keys (DCP's ``storage_data`` has one
    ``MetadataIndex`` key per chunk, hundreds of thousands in a large checkpoint). Without it every object built
    from a tuple is counted, as a tuple would be.
    """
    limits = limits or current_limits()
    limits.check_size(len(data))
    buf = bytes(data) if not isinstance(data, bytes) else data
    size = len(buf)
    kinds = _KINDS
    arg_width = _ARG
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
            if kind == _MEMOIZE:
                memo_append(stack[-1])
            elif kind == _BINGET:
                push(memo[next_byte()])
            elif kind == _REDUCE:  # REDUCE and NEWOBJ: callable/class, argument tuple -> object
                args = pop()
                stack[-1] = args if args > 0 and stack[-1] != _GLOBAL_SAFE_HASH else 0
            elif kind == _LONG_BINGET:
                pos = size - remaining()
                push(memo[unpack_from("<I", buf, pos)[0]])
                seek(pos + 4)
            elif kind == _PUSH_BYTE_NUMBER:
                next_byte()
                push(_NUMBER)
            elif kind == _PUSH:
                push(0)
            elif kind == _MARK:
                marks.append(len(stack))
            elif kind == _EMPTY_TUPLE:
                push(1)
            elif kind == _BUILD:
                pop()
                if stack[-1] == _GLOBAL_REF or stack[-1] == _GLOBAL_SAFE_HASH:
                    raise fail("BUILD on a class or function (would change it for every later read)")
            elif kind == _TUPLE1:
                depth = stack[-1]
                depth = depth + 1 if depth > 0 else 1
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                stack[-1] = depth
            elif kind == _TUPLE2:
                depth = pop()
                other = stack[-1]
                if other > depth:
                    depth = other
                depth = depth + 1 if depth > 0 else 1
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                stack[-1] = depth
            elif kind == _PUSH_NUMBER:
                pos = size - remaining() + arg_width[op]
                if pos > size:
                    raise corrupt("truncated")
                seek(pos)
                push(_NUMBER)
            elif kind == _GET:  # protocol 0 GET (BINGET and LONG_BINGET have their own kinds)
                idx, pos = _memo_index(buf, size - remaining(), arg_width[op])
                seek(pos)
                push(memo[idx])
            elif kind in (_SETITEMS, _ADDITEMS):
                mark = marks.pop()
                keys = stack[mark::2] if kind == _SETITEMS else stack[mark:]
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
            elif kind == _TUPLE3:
                items = stack[-3:]
                del stack[-3:]
                if len(items) != 3:
                    raise corrupt("stack underflow")
                depth = 1 + max(0, *items)
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                push(depth)
            elif kind in (_ITEMS_MARK, _SETITEM, _APPEND1):
                if kind == _ITEMS_MARK:
                    del stack[marks.pop() :]
                else:
                    if kind == _SETITEM and (stack[-2] == _NUMBER or stack[-2] > 0):
                        hashed_keys_left -= 1
                        if hashed_keys_left < 0:
                            raise fail(f"more than {limits.max_hashed_keys} int, float or tuple keys (hash flooding)")
                    del stack[-2 if kind == _SETITEM else -1 :]
                if stack[-1] == _GLOBAL_REF or stack[-1] == _GLOBAL_SAFE_HASH:
                    raise fail("item assignment on a class or function")
            elif kind in (_PUSH_LEN, _PUSH_LEN_NUMBER):
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
                if kind == _PUSH_LEN_NUMBER:
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
            elif kind == _TUPLE_MARK:
                mark = marks.pop()
                items = stack[mark:]
                del stack[mark:]
                depth = 1 + max(0, *items) if items else 1
                if depth > max_depth:
                    raise fail(f"tuples nest deeper than {max_depth}")
                push(depth)
            elif kind == _PUT:
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
            elif kind == _CONTAINER_MARK:  # LIST, DICT from the items since the mark
                mark = marks.pop()
                if op == 0x64:  # DICT: every other item is a key
                    for key in stack[mark::2]:
                        if key == _NUMBER or key > 0:
                            hashed_keys_left -= 1
                    if hashed_keys_left < 0:
                        raise fail(f"more than {limits.max_hashed_keys} int, float or tuple keys (hash flooding)")
                del stack[mark:]
                push(0)
            elif kind == _STACK_GLOBAL:
                module_item, name_item = stack[-2:]  # fewer than two: ValueError, a malformed pickle
                del stack[-2:]
                if module_item <= _STRING and name_item <= _STRING:
                    push(global_item(strings[_STRING - module_item], strings[_STRING - name_item]))
                else:
                    push(_GLOBAL_REF)
            elif kind == _GLOBAL:
                pos = size - remaining()
                module_end = buf.index(b"\n", pos)
                name_end = buf.index(b"\n", module_end + 1)
                push(global_item(buf[pos:module_end], buf[module_end + 1 : name_end]))
                seek(name_end + 1)
            elif kind in (_PUSH_NL, _PUSH_NL_NUMBER):
                pos = size - remaining()
                end = buf.index(b"\n", pos)
                if end - pos > max_string:
                    raise fail(f"a string of {end - pos} bytes exceeds the limit of {max_string}")
                if kind == _PUSH_NL_NUMBER and end - pos > 3 * max_int:  # INT / LONG / FLOAT as text
                    raise fail(f"a number of {end - pos} characters exceeds the limit of {3 * max_int}")
                seek(end + 1)
                push(_NUMBER if kind == _PUSH_NL_NUMBER else 0)
            elif kind == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    pop()
            elif kind == _POP_MARK:
                del stack[marks.pop() :]
            elif kind == _DUP:
                push(stack[-1])
            elif kind == _NEWOBJ_EX:  # class, args, kwargs -> object (a torch.Size keeps its args' depth)
                args = stack[-2]
                del stack[-2:]
                stack[-1] = args if args > 0 and stack[-1] != _GLOBAL_SAFE_HASH else 0
            elif kind == _FRAME:
                seek(size - remaining() + 8)
            elif kind == _PROTO:
                next_byte()
            elif kind == _BINPERSID:
                stack[-1] = 0
            elif kind == _PERSID:
                seek(buf.index(b"\n", size - remaining()) + 1)
                push(0)
            elif kind == _OBJ_MARK:
                del stack[marks.pop() :]
                push(0)
            elif kind == _INST:
                seek(buf.index(b"\n", buf.index(b"\n", size - remaining()) + 1) + 1)
                del stack[marks.pop() :]
                push(0)
            elif kind == _STOP:
                return
            elif op in _REFUSED_OPCODES:
                raise fail(f"opcode {_REFUSED_OPCODES[op]} is not accepted")
            else:
                raise corrupt(f"invalid opcode {bytes([op])!r}")
    except (PickleLimitError, pickle.UnpicklingError):
        raise
    except (IndexError, KeyError, ValueError, struct.error, StopIteration):
        raise corrupt("malformed pickle") from None
    raise corrupt("malformed pickle: no STOP")  # the bytes ended (or an argument ran past them) first
