"""The pickle opcodes :mod:`ckptdoctor.pickle.scanner` accepts: each opcode's kind (what the scanner does with the
stack) and the width of its argument. ``_scan.c`` switches on the same opcodes."""

from __future__ import annotations

# opcode -> kind; the kinds are grouped by what the scanner does with the stack.
PUSH, PUSH_NL, PUSH_LEN, MARK, STOP, POP, POP_MARK, DUP = range(1, 9)  # distinct, non-zero: 0 is refused
TUPLE_MARK, TUPLE3, CONTAINER_MARK, APPEND1, ITEMS_MARK, SETITEM = range(10, 16)
BUILD, REDUCE, NEWOBJ_EX, GLOBAL, STACK_GLOBAL, GET, PUT, MEMOIZE, FRAME, PROTO = range(16, 26)
PERSID, BINPERSID, OBJ_MARK, INST, BINGET, LONG_BINGET = range(26, 32)
PUSH_NUMBER, PUSH_NL_NUMBER, PUSH_LEN_NUMBER, SETITEMS, ADDITEMS, TUPLE1, TUPLE2, EMPTY_TUPLE = range(32, 40)
PUSH_BYTE_NUMBER = 40

_KIND_TABLE = bytearray(256)  # 0: not an opcode we accept
ARG_WIDTH = [0] * 256  # fixed argument width (bytes), or width of the length prefix for PUSH_LEN
for _op, _kind, _arg in (
    (b"N", PUSH, 0),
    (b"\x88", PUSH, 0),
    (b"\x89", PUSH, 0),
    (b"K", PUSH_BYTE_NUMBER, 1),
    (b"M", PUSH_NUMBER, 2),
    (b"J", PUSH_NUMBER, 4),
    (b"G", PUSH_NUMBER, 8),
    (b"]", PUSH, 0),
    (b"}", PUSH, 0),
    (b"\x8f", PUSH, 0),
    (b"I", PUSH_NL_NUMBER, 0),
    (b"L", PUSH_NL_NUMBER, 0),
    (b"F", PUSH_NL_NUMBER, 0),
    (b"S", PUSH_NL, 0),
    (b"V", PUSH_NL, 0),
    (b"\x8a", PUSH_LEN_NUMBER, 1),
    (b"\x8b", PUSH_LEN_NUMBER, 4),
    (b"U", PUSH_LEN, 1),
    (b"T", PUSH_LEN, 4),
    (b"C", PUSH_LEN, 1),
    (b"B", PUSH_LEN, 4),
    (b"\x8e", PUSH_LEN, 8),
    (b"\x8c", PUSH_LEN, 1),
    (b"X", PUSH_LEN, 4),
    (b"\x8d", PUSH_LEN, 8),
    (b"\x96", PUSH_LEN, 8),
    (b"(", MARK, 0),
    (b".", STOP, 0),
    (b"0", POP, 0),
    (b"1", POP_MARK, 0),
    (b"2", DUP, 0),
    (b"t", TUPLE_MARK, 0),
    (b")", EMPTY_TUPLE, 0),
    (b"\x85", TUPLE1, 0),
    (b"\x86", TUPLE2, 0),
    (b"\x87", TUPLE3, 0),
    (b"l", CONTAINER_MARK, 0),
    (b"d", CONTAINER_MARK, 0),
    (b"\x91", ADDITEMS, 0),
    (b"a", APPEND1, 0),
    (b"e", ITEMS_MARK, 0),
    (b"u", SETITEMS, 0),
    (b"\x90", ADDITEMS, 0),
    (b"s", SETITEM, 0),
    (b"b", BUILD, 0),
    (b"R", REDUCE, 0),
    (b"\x81", REDUCE, 0),
    (b"\x92", NEWOBJ_EX, 0),
    (b"c", GLOBAL, 0),
    (b"\x93", STACK_GLOBAL, 0),
    (b"h", BINGET, 1),
    (b"j", LONG_BINGET, 4),
    (b"g", GET, -1),
    (b"q", PUT, 1),
    (b"r", PUT, 4),
    (b"p", PUT, -1),
    (b"\x94", MEMOIZE, 0),
    (b"\x95", FRAME, 8),
    (b"\x80", PROTO, 1),
    (b"P", PERSID, 0),
    (b"Q", BINPERSID, 0),
    (b"o", OBJ_MARK, 0),
    (b"i", INST, 0),
):
    _KIND_TABLE[_op[0]] = _kind
    ARG_WIDTH[_op[0]] = _arg
KINDS = tuple(_KIND_TABLE)  # a tuple: CPython indexes it faster than bytes

# Valid opcodes never accepted: the copyreg extension registry and protocol 5 out-of-band buffers.
REFUSED_OPCODES = {0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}
