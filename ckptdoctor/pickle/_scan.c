/* The pickle pre-pass of ckptdoctor.pickle.scanner, in C: the same walk over the opcodes, the same stack of ints,
 * the same limits and the same messages, at ~2 ns per opcode instead of ~115 ns in Python.
 *
 * ckptdoctor.pickle.scanner.scan calls this first and the Python scanner (the reference) only where this one
 * answers FALLBACK: for the protocol 0 memo opcodes (GET 'g', PUT 'p', text memo indices parsed by int()),
 * whose number syntax is Python's. Every other opcode is handled here exactly as the Python scanner handles
 * it, down to the byte position in a message; tests/test_pickle_scan_accel.py compares the two verdicts on
 * the fixtures' pickles, the hostile corpus and mutations of both.
 *
 * scan(data: bytes, max_depth, max_string, max_int, max_hashed_keys, safe_hash) returns
 *   None             the pickle passes (it reached STOP),
 *   (1, message)     a limit: the caller raises PickleLimitError(message),
 *   (2, message)     damage: the caller raises pickle.UnpicklingError(message),
 *   -1               FALLBACK: the caller runs the Python scanner on the same bytes.
 * The input is read only within [0, size); every array grows by doubling and is freed on every exit.
 */
#include "_opcode_read.h"
#include "_scan.h"

#include <string.h>

/* Stack item codes, as in scanner.py. */
#define GLOBAL_REF (-1)
#define NUMBER (-2)
#define GLOBAL_SAFE_HASH (-3)
#define STRING_BASE (-1000)
#define MAX_REMEMBERED_STRING 256
#define MAX_STRINGS 1000000000 /* string codes stay within int32; beyond: FALLBACK */

enum { LIMIT = 1, CORRUPT = 2, FALLBACK = 3, ACCEPT = 4, PYERROR = 5 };

typedef struct {
    int32_t *items;
    Py_ssize_t len, cap;
} IntArray;

typedef struct {
    Py_ssize_t start, len;
} StringRef;

typedef struct {
    const unsigned char *buf;
    Py_ssize_t size, p; /* p: the next unread byte (the Python scanner's size - remaining()) */
    IntArray stack, marks, memo;
    StringRef *strings;
    Py_ssize_t n_strings, cap_strings;
    PyObject *safe_hash;
    char message[512];
} Scan;

static int grow(IntArray *a) {
    Py_ssize_t cap = a->cap ? a->cap * 2 : 256;
    int32_t *items = PyMem_Realloc(a->items, (size_t)cap * sizeof(int32_t));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    a->items = items;
    a->cap = cap;
    return 0;
}

#define PUSH(a, v)                                                    \
    do {                                                              \
        int32_t pushed_ = (v); /* read before the array may move */  \
        if ((a).len == (a).cap && grow(&(a)) < 0) return PYERROR;     \
        (a).items[(a).len++] = pushed_;                               \
    } while (0)

/* An IndexError / ValueError / StopIteration of the Python scanner: "malformed pickle at byte p". */
#define MALFORMED() return malformed(s)
#define NEED(n)                        \
    do {                                \
        if (s->stack.len < (n)) MALFORMED(); \
    } while (0)

static int malformed(Scan *s) {
    snprintf(s->message, sizeof s->message, "malformed pickle at byte %zd", s->p);
    return CORRUPT;
}

static int fail(Scan *s, const char *what) {
    snprintf(s->message, sizeof s->message, "%s at byte %zd", what, s->p);
    return LIMIT;
}

static int corrupt(Scan *s, const char *what) {
    snprintf(s->message, sizeof s->message, "%s at byte %zd", what, s->p);
    return CORRUPT;
}

static int depth_fail(Scan *s, long max_depth) {
    char what[96];
    snprintf(what, sizeof what, "tuples nest deeper than %ld", max_depth);
    return fail(s, what);
}

static int flood_fail(Scan *s, long long max_keys) {
    char what[128];
    snprintf(what, sizeof what, "more than %lld int, float or tuple keys (hash flooding)", max_keys);
    return fail(s, what);
}

static inline int is_global(int32_t item) { return item == GLOBAL_REF || item == GLOBAL_SAFE_HASH; }
static inline int is_hashed_key(int32_t item) { return item == NUMBER || item > 0; }

static Py_ssize_t find_newline(Scan *s, Py_ssize_t from) {
    if (from >= s->size) return -1;
    const unsigned char *hit = memchr(s->buf + from, '\n', (size_t)(s->size - from));
    return hit == NULL ? -1 : (Py_ssize_t)(hit - s->buf);
}

/* What a global makes on the stack: GLOBAL_SAFE_HASH when safe_hash(module, name) is true, else GLOBAL_REF.
 * Returns 0, or -1 with a Python error set, or -2 for a KeyError / IndexError / StopIteration from the
 * callback (the Python scanner reports those as a malformed pickle). */
static int global_item(Scan *s, Py_ssize_t m0, Py_ssize_t m_len, Py_ssize_t n0, Py_ssize_t n_len, int32_t *out) {
    *out = GLOBAL_REF;
    if (s->safe_hash == Py_None) return 0;
    PyObject *module = PyUnicode_DecodeUTF8((const char *)s->buf + m0, m_len, "strict");
    PyObject *name = module ? PyUnicode_DecodeUTF8((const char *)s->buf + n0, n_len, "strict") : NULL;
    PyObject *result = name ? PyObject_CallFunctionObjArgs(s->safe_hash, module, name, NULL) : NULL;
    Py_XDECREF(module);
    Py_XDECREF(name);
    if (result == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) { /* UnicodeDecodeError is one: the unpickler refuses */
            PyErr_Clear();
            return 0;
        }
        if (PyErr_ExceptionMatches(PyExc_IndexError) || PyErr_ExceptionMatches(PyExc_KeyError) ||
            PyErr_ExceptionMatches(PyExc_StopIteration)) {
            PyErr_Clear();
            return -2;
        }
        return -1;
    }
    int safe = PyObject_IsTrue(result);
    Py_DECREF(result);
    if (safe < 0) return -1;
    *out = safe ? GLOBAL_SAFE_HASH : GLOBAL_REF;
    return 0;
}

/* max(0, *items) + 1 over stack[from:], and drop them (TUPLE, TUPLE3). */
static int32_t tuple_depth(Scan *s, Py_ssize_t from) {
    int32_t deepest = 0;
    for (Py_ssize_t i = from; i < s->stack.len; i++)
        if (s->stack.items[i] > deepest) deepest = s->stack.items[i];
    s->stack.len = from;
    return deepest + 1;
}

static int run(Scan *s, long max_depth, unsigned long long max_string, unsigned long long max_int,
               long long max_hashed_keys) {
    const unsigned char *buf = s->buf;
    const Py_ssize_t size = s->size;
    long long keys_left = max_hashed_keys;
    IntArray *stack = &s->stack;

    while (s->p < size) {
        unsigned char op = buf[s->p++];
        switch (op) {
            case PK_MEMOIZE:
                NEED(1);
                PUSH(s->memo, stack->items[stack->len - 1]);
                break;
            case PK_BINGET: {
                if (s->p >= size) {
                    s->p = size;
                    MALFORMED();
                }
                Py_ssize_t idx = buf[s->p++];
                if (idx >= s->memo.len) MALFORMED();
                PUSH(*stack, s->memo.items[idx]);
                break;
            }
            case PK_LONG_BINGET: {
                if (s->p + 4 > size) MALFORMED();
                uint32_t idx = read_u32(buf + s->p);
                if ((Py_ssize_t)idx >= s->memo.len) MALFORMED();
                PUSH(*stack, s->memo.items[idx]);
                s->p += 4;
                break;
            }
            case PK_REDUCE:
            case PK_NEWOBJ: {
                NEED(2);
                int32_t args = stack->items[--stack->len];
                int32_t *top = &stack->items[stack->len - 1];
                *top = (args > 0 && *top != GLOBAL_SAFE_HASH) ? args : 0;
                break;
            }
            case PK_BININT1:
                if (s->p >= size) {
                    s->p = size;
                    MALFORMED();
                }
                s->p++;
                PUSH(*stack, NUMBER);
                break;
            case PK_NONE:
            case PK_NEWTRUE:
            case PK_NEWFALSE:
            case PK_EMPTY_LIST:
            case PK_EMPTY_DICT:
            case PK_EMPTY_SET:
                PUSH(*stack, 0);
                break;
            case PK_MARK:
                PUSH(s->marks, (int32_t)stack->len);
                break;
            case PK_EMPTY_TUPLE:
                PUSH(*stack, 1);
                break;
            case PK_BUILD:
                NEED(2);
                stack->len--;
                if (is_global(stack->items[stack->len - 1]))
                    return fail(s, "BUILD on a class or function (would change it for every later read)");
                break;
            case PK_TUPLE1: {
                NEED(1);
                int32_t *top = &stack->items[stack->len - 1];
                int32_t depth = *top > 0 ? *top + 1 : 1;
                if (depth > max_depth) return depth_fail(s, max_depth);
                *top = depth;
                break;
            }
            case PK_TUPLE2: {
                NEED(2);
                int32_t depth = stack->items[--stack->len];
                int32_t other = stack->items[stack->len - 1];
                if (other > depth) depth = other;
                depth = depth > 0 ? depth + 1 : 1;
                if (depth > max_depth) return depth_fail(s, max_depth);
                stack->items[stack->len - 1] = depth;
                break;
            }
            case PK_BININT2:
            case PK_BININT:
            case PK_BINFLOAT: {
                Py_ssize_t width = PK_ARG[op];
                if (s->p + width > size) return corrupt(s, "truncated");
                s->p += width;
                PUSH(*stack, NUMBER);
                break;
            }
            case PK_SETITEMS:
            case PK_ADDITEMS:
            case PK_FROZENSET: {
                if (s->marks.len == 0) MALFORMED();
                Py_ssize_t mark = s->marks.items[--s->marks.len];
                if (mark > stack->len) mark = stack->len;
                Py_ssize_t step = op == 'u' ? 2 : 1;
                long long hashed = 0;
                for (Py_ssize_t i = mark; i < stack->len; i += step)
                    if (is_hashed_key(stack->items[i])) hashed++;
                stack->len = mark;
                if (op != 0x91) {
                    NEED(1);
                    if (is_global(stack->items[stack->len - 1]))
                        return fail(s, "item assignment on a class or function");
                }
                keys_left -= hashed;
                if (keys_left < 0) return flood_fail(s, max_hashed_keys);
                if (op == 0x91) PUSH(*stack, 0);
                break;
            }
            case PK_TUPLE3: {
                if (stack->len < 3) {
                    stack->len = 0;
                    return corrupt(s, "stack underflow");
                }
                int32_t depth = tuple_depth(s, stack->len - 3);
                if (depth > max_depth) return depth_fail(s, max_depth);
                PUSH(*stack, depth);
                break;
            }
            case PK_APPENDS:
                if (s->marks.len == 0) MALFORMED();
                {
                    Py_ssize_t mark = s->marks.items[--s->marks.len];
                    if (mark < stack->len) stack->len = mark;
                }
                NEED(1);
                if (is_global(stack->items[stack->len - 1])) return fail(s, "item assignment on a class or function");
                break;
            case PK_SETITEM:
                NEED(2);
                if (is_hashed_key(stack->items[stack->len - 2])) {
                    keys_left--;
                    if (keys_left < 0) return flood_fail(s, max_hashed_keys);
                }
                stack->len -= 2;
                NEED(1);
                if (is_global(stack->items[stack->len - 1])) return fail(s, "item assignment on a class or function");
                break;
            case PK_APPEND:
                if (stack->len > 0) stack->len--;
                NEED(1);
                if (is_global(stack->items[stack->len - 1])) return fail(s, "item assignment on a class or function");
                break;
            case PK_SHORT_BINSTRING:
            case PK_SHORT_BINBYTES:
            case PK_SHORT_BINUNICODE:
            case PK_LONG1:
            case PK_BINSTRING:
            case PK_BINBYTES:
            case PK_BINUNICODE:
            case PK_LONG4:
            case PK_BINBYTES8:
            case PK_BINUNICODE8:
            case PK_BYTEARRAY8: {
                Py_ssize_t width = PK_ARG[op] == PK_ARG_LEN1 ? 1 : PK_ARG[op] == PK_ARG_LEN8 ? 8 : 4;
                if (s->p + width > size) MALFORMED();
                uint64_t length = width == 1   ? buf[s->p]
                                  : width == 4 ? read_u32(buf + s->p)
                                               : read_u64(buf + s->p);
                Py_ssize_t start = s->p + width;
                if (length > (uint64_t)(size - start)) return corrupt(s, "truncated");
                if (length > max_string) {
                    char what[128];
                    snprintf(what, sizeof what, "a string of %llu bytes exceeds the limit of %llu",
                             (unsigned long long)length, max_string);
                    return fail(s, what);
                }
                s->p = start + (Py_ssize_t)length;
                if (op == 0x8a || op == 0x8b) {
                    if (length > max_int) {
                        char what[128];
                        snprintf(what, sizeof what, "an integer of %llu bytes exceeds the limit of %llu",
                                 (unsigned long long)length, max_int);
                        return fail(s, what);
                    }
                    PUSH(*stack, NUMBER);
                } else if ((op == 0x8c || op == 'X') && length <= MAX_REMEMBERED_STRING) {
                    if (s->n_strings >= MAX_STRINGS) return FALLBACK;
                    if (s->n_strings == s->cap_strings) {
                        Py_ssize_t cap = s->cap_strings ? s->cap_strings * 2 : 256;
                        StringRef *strings = PyMem_Realloc(s->strings, (size_t)cap * sizeof(StringRef));
                        if (strings == NULL) {
                            PyErr_NoMemory();
                            return PYERROR;
                        }
                        s->strings = strings;
                        s->cap_strings = cap;
                    }
                    s->strings[s->n_strings].start = start;
                    s->strings[s->n_strings].len = (Py_ssize_t)length;
                    PUSH(*stack, (int32_t)(STRING_BASE - s->n_strings));
                    s->n_strings++;
                } else {
                    PUSH(*stack, 0);
                }
                break;
            }
            case PK_TUPLE: {
                if (s->marks.len == 0) MALFORMED();
                Py_ssize_t mark = s->marks.items[--s->marks.len];
                if (mark > stack->len) mark = stack->len;
                int32_t depth = tuple_depth(s, mark);
                if (depth > max_depth) return depth_fail(s, max_depth);
                PUSH(*stack, depth);
                break;
            }
            case PK_BINPUT:
            case PK_LONG_BINPUT: {
                Py_ssize_t width = PK_ARG[op];
                if (s->p + width > size) MALFORMED();
                uint64_t idx = width == 1 ? buf[s->p] : read_u32(buf + s->p);
                s->p += width;
                if (idx == (uint64_t)s->memo.len) {
                    NEED(1);
                    PUSH(s->memo, stack->items[stack->len - 1]);
                } else if (idx < (uint64_t)s->memo.len) {
                    NEED(1);
                    s->memo.items[idx] = stack->items[stack->len - 1];
                } else {
                    char what[96];
                    snprintf(what, sizeof what, "memo index %llu out of sequence", (unsigned long long)idx);
                    return idx > (uint64_t)s->memo.len + (1u << 20) ? fail(s, what) : corrupt(s, what);
                }
                break;
            }
            case PK_LIST:
            case PK_DICT: {
                if (s->marks.len == 0) MALFORMED();
                Py_ssize_t mark = s->marks.items[--s->marks.len];
                if (mark > stack->len) mark = stack->len;
                if (op == 'd') {
                    long long hashed = 0;
                    for (Py_ssize_t i = mark; i < stack->len; i += 2)
                        if (is_hashed_key(stack->items[i])) hashed++;
                    keys_left -= hashed;
                    if (keys_left < 0) return flood_fail(s, max_hashed_keys);
                }
                stack->len = mark;
                PUSH(*stack, 0);
                break;
            }
            case PK_STACK_GLOBAL: {
                NEED(2);
                int32_t module_item = stack->items[stack->len - 2], name_item = stack->items[stack->len - 1];
                stack->len -= 2;
                int32_t item = GLOBAL_REF;
                if (module_item <= STRING_BASE && name_item <= STRING_BASE) {
                    StringRef m = s->strings[STRING_BASE - module_item], n = s->strings[STRING_BASE - name_item];
                    int rc = global_item(s, m.start, m.len, n.start, n.len, &item);
                    if (rc == -1) return PYERROR;
                    if (rc == -2) MALFORMED();
                }
                PUSH(*stack, item);
                break;
            }
            case PK_GLOBAL: {
                Py_ssize_t module_end = find_newline(s, s->p);
                if (module_end < 0) MALFORMED();
                Py_ssize_t name_end = find_newline(s, module_end + 1);
                if (name_end < 0) MALFORMED();
                int32_t item = GLOBAL_REF;
                int rc = global_item(s, s->p, module_end - s->p, module_end + 1, name_end - module_end - 1, &item);
                if (rc == -1) return PYERROR;
                if (rc == -2) MALFORMED();
                PUSH(*stack, item);
                s->p = name_end + 1;
                break;
            }
            case PK_STRING:
            case PK_UNICODE:
            case PK_INT:
            case PK_LONG:
            case PK_FLOAT: {
                Py_ssize_t end = find_newline(s, s->p);
                if (end < 0) MALFORMED();
                unsigned long long n = (unsigned long long)(end - s->p);
                int number = op == 'I' || op == 'L' || op == 'F';
                char what[128];
                if (n > max_string) {
                    snprintf(what, sizeof what, "a string of %llu bytes exceeds the limit of %llu", n, max_string);
                    return fail(s, what);
                }
                if (number && n > 3 * max_int) {
                    snprintf(what, sizeof what, "a number of %llu characters exceeds the limit of %llu", n, 3 * max_int);
                    return fail(s, what);
                }
                s->p = end + 1;
                PUSH(*stack, number ? NUMBER : 0);
                break;
            }
            case PK_POP:
                if (s->marks.len > 0 && s->marks.items[s->marks.len - 1] == stack->len)
                    s->marks.len--;
                else {
                    NEED(1);
                    stack->len--;
                }
                break;
            case PK_POP_MARK:
                if (s->marks.len == 0) MALFORMED();
                {
                    Py_ssize_t mark = s->marks.items[--s->marks.len];
                    if (mark < stack->len) stack->len = mark;
                }
                break;
            case PK_DUP:
                NEED(1);
                PUSH(*stack, stack->items[stack->len - 1]);
                break;
            case PK_NEWOBJ_EX: {
                NEED(2);
                int32_t args = stack->items[stack->len - 2];
                stack->len -= 2;
                NEED(1);
                int32_t *top = &stack->items[stack->len - 1];
                *top = (args > 0 && *top != GLOBAL_SAFE_HASH) ? args : 0;
                break;
            }
            case PK_FRAME:
                s->p = s->p + 8 > size ? size : s->p + 8;
                break;
            case PK_PROTO:
                if (s->p >= size) {
                    s->p = size;
                    MALFORMED();
                }
                s->p++;
                break;
            case PK_BINPERSID:
                NEED(1);
                stack->items[stack->len - 1] = 0;
                break;
            case PK_PERSID: {
                Py_ssize_t end = find_newline(s, s->p);
                if (end < 0) MALFORMED();
                s->p = end + 1;
                PUSH(*stack, 0);
                break;
            }
            case PK_OBJ:
                if (s->marks.len == 0) MALFORMED();
                {
                    Py_ssize_t mark = s->marks.items[--s->marks.len];
                    if (mark < stack->len) stack->len = mark;
                }
                PUSH(*stack, 0);
                break;
            case PK_INST: {
                Py_ssize_t module_end = find_newline(s, s->p);
                if (module_end < 0) MALFORMED();
                Py_ssize_t name_end = find_newline(s, module_end + 1);
                if (name_end < 0) MALFORMED();
                s->p = name_end + 1;
                if (s->marks.len == 0) MALFORMED();
                Py_ssize_t mark = s->marks.items[--s->marks.len];
                if (mark < stack->len) stack->len = mark;
                PUSH(*stack, 0);
                break;
            }
            case PK_STOP:
                return ACCEPT;
            case PK_GET: /* memo index as text, parsed by Python's int() */
            case PK_PUT:
                return FALLBACK;
            case PK_EXT1:
            case PK_EXT2:
            case PK_EXT4:
            case PK_NEXT_BUFFER:
            case PK_READONLY_BUFFER: {
                const char *name = op == PK_EXT1   ? "EXT1"
                                   : op == PK_EXT2 ? "EXT2"
                                   : op == PK_EXT4 ? "EXT4"
                                   : op == PK_NEXT_BUFFER ? "NEXT_BUFFER"
                                                          : "READONLY_BUFFER";
                char what[64];
                snprintf(what, sizeof what, "opcode %s is not accepted", name);
                return fail(s, what);
            }
            default: /* an invalid opcode: scan() writes the message (Python's repr of the byte) */
                return -(int)op - 1;
        }
    }
    return corrupt(s, "malformed pickle: no STOP"); /* the bytes ended (or an argument ran past them) first */
}

PyObject *native_scan(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer view;
    long long max_depth, max_string, max_int, max_hashed_keys;
    PyObject *safe_hash;
    /* "L": an OverflowError beyond int64, which the caller answers with the Python walk. */
    if (!PyArg_ParseTuple(args, "y*LLLLO:scan", &view, &max_depth, &max_string, &max_int, &max_hashed_keys,
                          &safe_hash))
        return NULL;
    /* Outside the ranges this code computes in (int32 stack items and marks), the Python walk decides. */
    if (view.len > INT32_MAX || max_depth < 0 || max_depth > (1LL << 30) || max_string < 0 || max_int < 0 ||
        max_int > (1LL << 60) || max_hashed_keys < 0) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(-1);
    }
    Scan s;
    memset(&s, 0, sizeof s);
    s.buf = view.buf;
    s.size = view.len;
    s.safe_hash = safe_hash;
    int rc = run(&s, (long)max_depth, (unsigned long long)max_string, (unsigned long long)max_int, max_hashed_keys);
    Py_ssize_t position = s.p;
    PyMem_Free(s.stack.items);
    PyMem_Free(s.marks.items);
    PyMem_Free(s.memo.items);
    PyMem_Free(s.strings);
    PyBuffer_Release(&view);
    switch (rc) {
        case ACCEPT:
            Py_RETURN_NONE;
        case FALLBACK:
            return PyLong_FromLong(-1);
        case PYERROR:
            return NULL;
        case LIMIT:
        case CORRUPT:
            return Py_BuildValue("(is)", rc, s.message);
        default: { /* an invalid opcode: -(op) - 1 */
            unsigned char op = (unsigned char)(-rc - 1);
            PyObject *byte = PyBytes_FromStringAndSize((const char *)&op, 1);
            if (byte == NULL) return NULL;
            PyObject *message = PyUnicode_FromFormat("invalid opcode %R at byte %zd", byte, position);
            Py_DECREF(byte);
            if (message == NULL) return NULL;
            return Py_BuildValue("(iN)", CORRUPT, message);
        }
    }
}
