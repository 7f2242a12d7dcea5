/* ckptdoctor.pickle._native: the pickle engine's native module (optional; ckptdoctor/pickle/ has the Python twin of
 * each part, which stays the reference: tests/test_pickle_scan_accel.py, test_memo_prune.py, test_plan_drops.py,
 * test_dcp_index_accel.py and fuzz/fuzz_native.py compare them).
 *   _native.c   the module
 *   _scan.c     the resource pre-pass (scan; scanner.py)
 *   _prune.c    memo pruning (prune_memo, pruned_reader; unpickler.py)
 *   _plans.c    megatron-core's save plans left out of index-only reads (their drop_plans option)
 *   _records.c  index records: their BUILD (compact_setstate) and torch.Size (index_size, faithful_size;
 *               index_records.py, policy.py)
 *   _opcodes.h  the opcodes, generated from pickletools by scripts/gen_opcodes.py
 */
#ifndef CKPTDOCTOR_PICKLE_NATIVE_H
#define CKPTDOCTOR_PICKLE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Functions shared by the sources of the module, not exported (called directly, not through the PLT). */
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

/* The opcode classes of the memo pruning (prune_op, below). */
enum { OP_PLAIN, OP_PUSHES, OP_MEMOIZE, OP_PUT, OP_GET, OP_FRAME, OP_STOP, OP_REFUSE };

/* The class of the opcode at buf[p] and where it ends (past its argument), as the unpickler reads it; OP_REFUSE
 * for what pruning leaves alone (memo writes with indices, text reads, invalid opcodes, damaged arguments). */
static inline int prune_op(const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t *end) {
    *end = size; /* where an opcode pruning refuses ends, for a caller that walks on: nowhere */
    unsigned char op = buf[p++];
    Py_ssize_t width = 0; /* a fixed argument */
    int lenw = 0;         /* the width of a length prefix */
    int lines = 0;        /* text arguments, each ending at a newline */
    int kind = OP_PUSHES;
    switch (op) {
        case 0x94: kind = OP_MEMOIZE; break;
        case 'h': kind = OP_GET; width = 1; break;
        case 'j': kind = OP_GET; width = 4; break;
        case 'q': kind = OP_PUT; width = 1; break;
        case 'r': kind = OP_PUT; width = 4; break;
        case 0x95: kind = OP_FRAME; width = 8; break;
        case '.': kind = OP_STOP; break;
        case 0x80: kind = OP_PLAIN; width = 1; break; /* PROTO */
        case '(': case '0': case '1': case 's': case 'u': case 'a': case 'e': case 0x90:
            kind = OP_PLAIN; /* MARK, POP, POP_MARK, and the item assignments: no MEMOIZE is dropped after them */
            break;
        case 'N': case 0x88: case 0x89: case ']': case '}': case 0x8f: case ')': case 0x85: case 0x86: case 0x87:
        case 't': case 'l': case 'd': case 0x91: case 'b': case 'R': case 0x81: case 0x92: case 0x93: case '2':
        case 'Q': case 'o':
            break;
        case 'K': width = 1; break;
        case 'M': width = 2; break;
        case 'J': width = 4; break;
        case 'G': width = 8; break;
        case 'U': case 'C': case 0x8c: case 0x8a: lenw = 1; break;
        case 'B': case 'X': lenw = 4; break;
        case 'T': case 0x8b: lenw = -4; break; /* signed: a negative length is an error */
        case 0x8e: case 0x8d: case 0x96: lenw = 8; break;
        case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': lines = 1; break;
        case 'c': case 'i': lines = 2; break;
        default: return OP_REFUSE; /* the text PUT and GET, EXT*, buffers, invalid opcodes */
    }
    if (lenw != 0) {
        Py_ssize_t w = lenw < 0 ? -lenw : lenw;
        if (w > size - p) return OP_REFUSE;
        uint64_t length = w == 1 ? buf[p] : w == 4 ? read_u32(buf + p) : read_u64(buf + p);
        if (lenw < 0 && length > INT32_MAX) return OP_REFUSE;
        p += w;
        if (length > (uint64_t)(size - p)) return OP_REFUSE;
        p += (Py_ssize_t)length;
    } else if (width > size - p) {
        return OP_REFUSE;
    } else {
        p += width;
    }
    for (; lines > 0; lines--) {
        const unsigned char *nl = p < size ? memchr(buf + p, '\n', (size_t)(size - p)) : NULL;
        if (nl == NULL) return OP_REFUSE;
        p = (Py_ssize_t)(nl - buf) + 1;
    }
    *end = p;
    return kind;
}


/* _scan.c */
PyObject *native_scan(PyObject *module, PyObject *args);
/* _prune.c */
PyObject *native_prune_memo(PyObject *module, PyObject *args);    /* prune_memo(data, drop_plans) -> bytes, None */
PyObject *native_pruned_reader(PyObject *module, PyObject *args); /* pruned_reader(data, release, drop_plans) */
int native_prune_ready(void);                                    /* PyType_Ready of the reader type */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
