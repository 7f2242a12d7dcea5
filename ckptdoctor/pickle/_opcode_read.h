/* Reading one pickle opcode, for every part of ckptdoctor.pickle._native (the lowest of its headers: it includes
 * only the generated opcode table, _opcodes.h): the little-endian fixed-width arguments (read_u32, read_u64) and,
 * for the memo pruning and the save plans, an opcode's class and where it ends (prune_op). */
#ifndef CKPTDOCTOR_PICKLE_OPCODE_READ_H
#define CKPTDOCTOR_PICKLE_OPCODE_READ_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Shared by the sources of the module, not exported (called directly, not through the PLT). */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* Little-endian fixed-width arguments of pickle opcodes. */
static inline uint32_t read_u32(const unsigned char *b) {
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}

static inline uint64_t read_u64(const unsigned char *b) {
    return (uint64_t)read_u32(b) | ((uint64_t)read_u32(b + 4) << 32);
}

#include "_opcodes.h"

/* The opcode classes of the memo pruning (prune_op, below). */
enum { OP_PLAIN, OP_PUSHES, OP_MEMOIZE, OP_PUT, OP_GET, OP_FRAME, OP_STOP, OP_REFUSE };

/* The class of the opcode at buf[p] and where it ends (past its argument, as PK_ARG says), as the unpickler reads
 * it; OP_REFUSE for what pruning leaves alone (memo writes with indices, text reads, invalid opcodes, damaged
 * arguments). Every other opcode pushes an object (OP_PUSHES) but MARK, POP, POP_MARK, PROTO and the item
 * assignments (OP_PLAIN: no MEMOIZE is dropped after them). */
static inline int prune_op(const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t *end) {
    *end = size; /* where an opcode pruning refuses ends, for a caller that walks on: nowhere */
    unsigned char op = buf[p++];
    int arg = PK_ARG[op], kind = OP_PUSHES;
    switch (op) {
        case PK_MEMOIZE: kind = OP_MEMOIZE; break;
        case PK_BINGET: case PK_LONG_BINGET: kind = OP_GET; break;
        case PK_BINPUT: case PK_LONG_BINPUT: kind = OP_PUT; break;
        case PK_FRAME: kind = OP_FRAME; break;
        case PK_STOP: kind = OP_STOP; break;
        case PK_PROTO: case PK_MARK: case PK_POP: case PK_POP_MARK: case PK_SETITEM: case PK_SETITEMS:
        case PK_APPEND: case PK_APPENDS: case PK_ADDITEMS:
            kind = OP_PLAIN;
            break;
        case PK_PUT: case PK_GET: case PK_EXT1: case PK_EXT2: case PK_EXT4: case PK_NEXT_BUFFER: case PK_READONLY_BUFFER:
            return OP_REFUSE;
        default:
            if (arg == PK_ARG_INVALID) return OP_REFUSE;
    }
    if (arg >= 0) {
        if (arg > size - p) return OP_REFUSE;
        p += arg;
    } else if (arg <= PK_ARG_LEN1) { /* a length prefix and that many bytes */
        Py_ssize_t w = arg == PK_ARG_LEN1 ? 1 : arg == PK_ARG_LEN8 ? 8 : 4;
        if (w > size - p) return OP_REFUSE;
        uint64_t length = w == 1 ? buf[p] : w == 4 ? read_u32(buf + p) : read_u64(buf + p);
        if (arg == PK_ARG_LEN4S && length > INT32_MAX) return OP_REFUSE; /* signed: a negative length is an error */
        p += w;
        if (length > (uint64_t)(size - p)) return OP_REFUSE;
        p += (Py_ssize_t)length;
    } else { /* text arguments, each ending at a newline */
        for (int lines = arg == PK_ARG_LINE ? 1 : 2; lines > 0; lines--) {
            const unsigned char *nl = p < size ? memchr(buf + p, '\n', (size_t)(size - p)) : NULL;
            if (nl == NULL) return OP_REFUSE;
            p = (Py_ssize_t)(nl - buf) + 1;
        }
    }
    *end = p;
    return kind;
}

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
