/* Save plans left out of index-only reads, for the memo pruning of pickle._native (see _prune.c).
 *
 * megatron-core keeps every rank's SavePlan in .metadata (all_local_plans): a WriteItem, a TensorWriteData and a
 * MetadataIndex per chunk. An index-only read builds each plan part as the one DROPPED object (index_records.
 * DroppedRecord: its NEWOBJ gives DROPPED, its BUILD keeps nothing), but the pickle still builds their states, and
 * those read the chunk and properties records of state_dict_metadata through the memo: the memo then holds every
 * such record until the load returns. With drop_plans, the bytes after a plan part's NEWOBJ through its BUILD (its memo writes, its
 * state, the BUILD) are left out where that provably changes nothing but the memo:
 *  - the class pushed before is a plan class by its module and name (STACK_GLOBAL of two strings, a GLOBAL, or a
 *    memo read of an entry written just after one); that push, the EMPTY_TUPLE and the NEWOBJ stay, so the same
 *    find_class runs and the same DROPPED is built;
 *  - the recognizer simulates the left-out opcodes on a stack of kinds and accepts only opcodes that cannot fail
 *    there: ASCII strings, ints, None, bools, floats, bytes; memo reads of existing entries; containers made in the
 *    part and filled with hashable keys; tuples; STACK_GLOBAL or GLOBAL of the classes below (all allowlisted, so
 *    find_class only returns them) and their NEWOBJ / REDUCE / BUILD, each in a form that cannot raise in an
 *    index-only read (a plan part's or index record's BUILD only with a dict, a TensorProperties record's also with a tuple of five, as torch's needs); memo writes of the next entry above the fence. Nothing outside the part is changed (only
 *    objects made in the part are filled or built), no mark outlives it, and the part ends with the BUILD of the
 *    DROPPED object itself. Anything else, and any doubt, leaves the bytes as they are;
 *  - an entry written in a left-out region and read from code that stays makes the region live (translated as it
 *    is), and so, in turn, the regions a live region reads from (plans_settle).
 * The work is bounded: the recognizer looks at no more opcodes in all than the pickle has bytes (plus a margin).
 * So is the memory of the plan: a kind byte per memo entry, regions only for parts of 40 bytes or more (one record
 * each), and edges up to half the input's size, beyond which every region is kept. */
#include "_plans.h"

#include <string.h>

static const char *const NAMES[] = {
    "torch.distributed.checkpoint.planner",             /* 2 */
    "torch.distributed.checkpoint.metadata",            /* 3 */
    "torch",                                            /* 4 */
    "megatron.core.dist_checkpointing.strategies.torch", /* 5 */
    "SavePlan", "WriteItem", "TensorWriteData", "MCoreSavePlan", "WriteItemType", "MetadataIndex", "Size", /* 6.. */
    "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",                                  /* 13.. */
};
#define N_NAMES ((int)(sizeof(NAMES) / sizeof(NAMES[0])))
_Static_assert(sizeof(NAMES) / sizeof(NAMES[0]) + K_NAME_FIRST <= K_INT, "names are kinds below K_INT");

enum { ROLE_DROP, ROLE_DROP_OUTER, ROLE_ITEM_TYPE, ROLE_RECORD, ROLE_TUPLE_RECORD, ROLE_SIZE };

/* The classes (as safe_globals resolves them in index-only reads, see tests/test_plan_drops.py): the parts of
 * safe_globals.PLAN_PARTS build DROPPED; WriteItemType a torch_values.WriteItemTypeCode (REDUCE of 1..3 only:
 * it refuses other values); MetadataIndex, TensorProperties,
 * ChunkStorageMetadata and BytesStorageMetadata index records (index_records.index_record_class); torch.Size
 * safe_globals.index_size. MCoreSavePlan only as the part whose bytes are left out (its class push stays), never
 * inside one. */
static const struct {
    int module, name, role;
} CLASSES[] = {
    {2, 6, ROLE_DROP},  {2, 7, ROLE_DROP},   {2, 8, ROLE_DROP},   {5, 9, ROLE_DROP_OUTER},
    {2, 10, ROLE_ITEM_TYPE}, {3, 11, ROLE_RECORD}, {4, 12, ROLE_SIZE}, {3, 13, ROLE_TUPLE_RECORD},
    {3, 14, ROLE_RECORD},   {3, 15, ROLE_RECORD},
};
#define N_CLASSES ((int)(sizeof(CLASSES) / sizeof(CLASSES[0])))
_Static_assert(sizeof(CLASSES) / sizeof(CLASSES[0]) + K_CLASS_FIRST <= 256, "kinds are bytes");

#define MAX_STACK 4096 /* Python's picklers batch 1,000 list items or dict pairs per APPENDS or SETITEMS */
#define MAX_MARKS 64

static int is_name(int k) { return k >= K_NAME_FIRST && k < K_INT; } /* a str with the text of one of NAMES */
static int is_int(int k) { return k == K_INT || k == K_INT_ITEM_TYPE; } /* BININT1, BININT2, BININT: in int64 */
/* What torch.Size takes (a tuple of ints; the 1-tuple of an int 1..3 too): a Size's REDUCE argument only then */
static int is_int_tuple(int k) { return k == K_INT_TUPLE || k == K_ITEM_TYPE_ARGS || k == K_EMPTY_TUPLE; }
static int is_dict(int k) { return k == K_DICT; }
static int is_class(int k) { return k >= K_CLASS_FIRST; } /* only CLASSES' kinds are made */
static int role_of(int k) { return CLASSES[k - K_CLASS_FIRST].role; }

static Py_ssize_t name_length[N_NAMES]; /* strlen of each of NAMES, and a bit per length below 64 */
static uint64_t name_lengths;

static void names_init(void) {
    if (name_lengths != 0) return;
    for (int k = 0; k < N_NAMES; k++) {
        name_length[k] = (Py_ssize_t)strlen(NAMES[k]);
        name_lengths |= (uint64_t)1 << name_length[k]; /* every name is shorter than 64 */
    }
}

/* The kind of a string's bytes: one of NAMES or another str; with ascii, -1 where it is not ASCII (its decoding
 * could fail). Called for every string opcode of the pickle: a name is looked for only at a length one has. */
static int string_kind(const unsigned char *s, Py_ssize_t n, int ascii) {
    if (ascii)
        for (Py_ssize_t i = 0; i < n; i++)
            if (s[i] >= 0x80) return -1;
    if (n >= 64 || !((name_lengths >> n) & 1)) return K_STR;
    for (int k = 0; k < N_NAMES; k++)
        if (name_length[k] == n && memcmp(NAMES[k], s, (size_t)n) == 0) return K_NAME_FIRST + k;
    return K_STR;
}

static int class_kind(int module, int name) {
    for (int c = 0; c < N_CLASSES; c++)
        if (CLASSES[c].module == module && CLASSES[c].name == name) return K_CLASS_FIRST + c;
    return K_UNKNOWN;
}

/* A GLOBAL's class kind ("module\nname\n" at buf[p + 1:end]), K_UNKNOWN where it is not one of CLASSES. */
static int global_kind(const unsigned char *buf, Py_ssize_t p, Py_ssize_t end) {
    const unsigned char *s = buf + p + 1, *nl = memchr(s, '\n', (size_t)(end - p - 1));
    if (nl == NULL) return K_UNKNOWN;
    int module = string_kind(s, nl - s, 1), name = string_kind(nl + 1, buf + end - 1 - (nl + 1), 1);
    return is_name(module) && is_name(name) ? class_kind(module, name) : K_UNKNOWN;
}

/* The bytes of a string opcode's argument. */
static const unsigned char *string_bytes(const unsigned char *buf, Py_ssize_t p, Py_ssize_t end, Py_ssize_t *n) {
    Py_ssize_t head = 1 + (buf[p] == 0x8c ? 1 : buf[p] == 'X' ? 4 : 8);
    *n = end - p - head;
    return buf + p + head;
}

int plans_grow_kinds(PlanDrops *d, Py_ssize_t n) {
    if (n <= d->n_kinds) return 0;
    Py_ssize_t cap = d->n_kinds ? d->n_kinds : 1024;
    while (cap < n) cap *= 2;
    unsigned char *kinds = PyMem_Realloc(d->kinds, (size_t)cap);
    if (kinds == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(kinds + d->n_kinds, 0, (size_t)(cap - d->n_kinds));
    d->kinds = kinds;
    d->n_kinds = cap;
    return 0;
}

/* Simulate the part whose class the opcodes before q pushed (memo entries so far: memo). 1 with *out set, 0. */
static int recognize(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t q, Py_ssize_t memo,
                     PlanRegion *out) {
    unsigned char stack[MAX_STACK];
    Py_ssize_t marks[MAX_MARKS], n = 1, n_marks = 0, end;
    int newobj = 0; /* 0: before the EMPTY_TUPLE, 1: before the NEWOBJ, 2: after it, 3: in the part */
    stack[0] = K_CLASS_FIRST; /* the class (only its role matters: DROP) */
    while (q < size && d->budget-- > 0) {
        int kind = prune_op(buf, size, q, &end);
        unsigned char op = buf[q];
        Py_ssize_t lo = n_marks ? marks[n_marks - 1] : 0; /* items below lo are not to be popped */
        if (kind == OP_REFUSE || kind == OP_STOP) return 0;
        if (kind == OP_FRAME) {
            q = end;
            continue;
        }
        if (newobj == 2) { /* the part starts at its first opcode (past FRAMEs: the translation meets it there) */
            out->start = q;
            out->memo_start = memo;
            stack[0] = K_DROPPED;
            newobj = 3;
        }
        if (kind == OP_MEMOIZE || kind == OP_PUT) {
            if (n <= lo || (kind == OP_PUT && (end - q == 2 ? buf[q + 1] : read_u32(buf + q + 1)) != (uint64_t)memo))
                return 0;
            if (plans_grow_kinds(d, memo + 1) < 0) {
                PyErr_Clear();
                return 0;
            }
            d->kinds[memo++] = newobj < 3 ? (unsigned char)K_UNKNOWN : stack[n - 1];
            q = end;
            continue;
        }
        if (newobj < 2) { /* the class's memo writes (above), then EMPTY_TUPLE, NEWOBJ */
            if (op != (newobj == 0 ? ')' : 0x81)) return 0;
            newobj++;
            q = end;
            continue;
        }
        if (n >= MAX_STACK) return 0;
        int push = -1; /* the kind pushed after the pops below */
        switch (op) {
            case 'N': case 0x88: case 0x89: case 'G': case 'C': case 'B': case 0x8e:
                push = K_SCALAR;
                break;
            case 'K': case 'M': case 'J':
                push = op == 'K' && buf[q + 1] >= 1 && buf[q + 1] <= 3 ? K_INT_ITEM_TYPE : K_INT;
                break;
            case 0x8c: case 'X': case 0x8d: {
                Py_ssize_t length;
                const unsigned char *s = string_bytes(buf, q, end, &length);
                if ((push = string_kind(s, length, 1)) < 0) return 0; /* not ASCII: its decoding could fail */
                break;
            }
            case 'h': case 'j': {
                uint64_t idx = end - q == 2 ? buf[q + 1] : read_u32(buf + q + 1);
                if (idx >= (uint64_t)memo) return 0;
                push = plan_read_kind(d, (Py_ssize_t)idx);
                break;
            }
            case ']': push = K_LIST; break;
            case '}': push = K_DICT; break;
            case ')': push = K_EMPTY_TUPLE; break;
            case '(':
                if (n_marks >= MAX_MARKS) return 0;
                marks[n_marks++] = n;
                break;
            case 0x85: case 0x86: case 0x87: { /* TUPLE1..3 */
                Py_ssize_t k = op - 0x84;
                if (n - k < (lo > 1 ? lo : 1)) return 0;
                int ints = 1;
                for (Py_ssize_t i = n - k; i < n; i++) ints &= is_int(stack[i]);
                push = k == 1 && is_int_tuple(stack[n - 1])        ? K_SIZE_ARGS
                       : k == 1 && stack[n - 1] == K_INT_ITEM_TYPE ? K_ITEM_TYPE_ARGS
                       : ints                                      ? K_INT_TUPLE
                                                                   : K_TUPLE;
                n -= k;
                break;
            }
            case 't': case 'l': case 'd': case 'e': case 'u': { /* to the mark */
                if (n_marks == 0) return 0;
                Py_ssize_t x = marks[--n_marks], fence = n_marks ? marks[n_marks - 1] : 0;
                if (op == 'd' || op == 'u') {
                    if ((n - x) % 2 != 0) return 0;
                    for (Py_ssize_t i = x; i < n; i += 2)
                        if (!plan_kind_is_hashable(stack[i])) return 0;
                }
                if (op == 'e' || op == 'u') { /* into the list or dict below the mark, made in the part */
                    if (x - 1 < (fence > 1 ? fence : 1)) return 0;
                    if (op == 'e' ? stack[x - 1] != K_LIST : !is_dict(stack[x - 1])) return 0;
                } else {
                    int ints = 1;
                    for (Py_ssize_t i = x; i < n; i++) ints &= is_int(stack[i]);
                    push = op == 't' ? (n == x ? K_EMPTY_TUPLE : n - x == 5 ? K_TUPLE5 : ints ? K_INT_TUPLE : K_TUPLE)
                           : op == 'l' ? K_LIST
                                       : K_DICT;
                }
                n = x;
                break;
            }
            case 'a': /* APPEND */
                if (n - 2 < (lo > 1 ? lo : 1) || stack[n - 2] != K_LIST) return 0;
                n -= 1;
                break;
            case 's': /* SETITEM */
                if (n - 3 < (lo > 1 ? lo : 1) || !is_dict(stack[n - 3]) || !plan_kind_is_hashable(stack[n - 2]))
                    return 0;
                n -= 2;
                break;
            case 0x93: { /* STACK_GLOBAL of two names */
                if (n - 2 < (lo > 1 ? lo : 1)) return 0;
                int module = stack[n - 2], name = stack[n - 1];
                push = is_name(module) && is_name(name) ? class_kind(module, name) : K_UNKNOWN;
                if (push == K_UNKNOWN || role_of(push) == ROLE_DROP_OUTER) return 0;
                n -= 2;
                break;
            }
            case 'c':
                push = global_kind(buf, q, end);
                if (push == K_UNKNOWN || role_of(push) == ROLE_DROP_OUTER) return 0;
                break;
            case 0x81: case 'R': { /* NEWOBJ, REDUCE: a class of CLASSES and its argument tuple */
                if (n - 2 < (lo > 1 ? lo : 1) || !is_class(stack[n - 2]) || !plan_kind_is_tuple(stack[n - 1])) return 0;
                int role = role_of(stack[n - 2]), args = stack[n - 1];
                if (role == ROLE_DROP) push = K_DROPPED;
                else if (role == ROLE_ITEM_TYPE && op == 'R' && args == K_ITEM_TYPE_ARGS) push = K_OBJECT;
                else if (role == ROLE_RECORD && op == 0x81 && args == K_EMPTY_TUPLE) push = K_RECORD;
                else if (role == ROLE_TUPLE_RECORD && op == 0x81 && args == K_EMPTY_TUPLE) push = K_TUPLE_RECORD;
                else if (role == ROLE_SIZE && op == 'R' && args == K_SIZE_ARGS) push = K_TUPLE;
                else return 0;
                n -= 2;
                break;
            }
            case 'b': { /* BUILD of an object made in the part, with a state it cannot refuse */
                if (n - 2 < lo) return 0;
                int target = stack[n - 2], state = stack[n - 1];
                if (target != K_DROPPED && target != K_RECORD && target != K_TUPLE_RECORD) return 0;
                /* DROPPED and the index records refuse a state the real class's BUILD would (index_records.
                 * DroppedRecord, compact_setstate in _records.c): only a dict is left out unread (a tuple of five too
                 * for TensorProperties, whose class unpacks one), and not with a dict the part did not make. */
                if ((target == K_DROPPED || target == K_RECORD) && !is_dict(state)) return 0;
                if (target == K_TUPLE_RECORD && !is_dict(state) && state != K_TUPLE5) return 0;
                if ((target == K_RECORD || target == K_TUPLE_RECORD) && state == K_OTHER)
                    return 0;
                n -= 1;
                if (n == 1 && n_marks == 0) { /* the part's own BUILD: the region ends here */
                    out->end = end;
                    out->memo_end = memo;
                    out->live = 0;
                    return 1;
                }
                break;
            }
            default:
                return 0;
        }
        if (push >= 0) stack[n++] = (unsigned char)push;
        q = end;
    }
    return 0;
}

static int contains(const unsigned char *buf, Py_ssize_t size, const char *needle) {
    Py_ssize_t n = (Py_ssize_t)strlen(needle);
    for (const unsigned char *at = buf; size - (at - buf) >= n;) {
        at = memchr(at, needle[0], (size_t)(size - (at - buf) - n + 1));
        if (at == NULL) return 0;
        if (memcmp(at, needle, (size_t)n) == 0) return 1;
        at++;
    }
    return 0;
}

int plans_start(PlanDrops *d, const unsigned char *buf, Py_ssize_t size) {
    /* a plan part's class is pushed by its name's string: without one, nothing to look for (PyTorch's own saves) */
    if (!contains(buf, size, "SavePlan") && !contains(buf, size, "WriteItem") &&
        !contains(buf, size, "TensorWriteData"))
        return 0;
    names_init();
    d->budget = size + 4096;
    d->max_edges = size / 32 + 4096; /* 16 bytes each: half the input's size at most */
    return 1;
}

static int add_region(PlanDrops *d, const PlanRegion *r) {
    if (d->n == d->cap) {
        Py_ssize_t cap = d->cap ? d->cap * 2 : 64;
        PlanRegion *regions = PyMem_Realloc(d->regions, (size_t)cap * sizeof(PlanRegion));
        if (regions == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        d->regions = regions;
        d->cap = cap;
    }
    d->regions[d->n++] = *r;
    return 0;
}

int plans_op_named(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t end,
                   Py_ssize_t memo) {
    unsigned char op = buf[p];
    int top = K_UNKNOWN;
    if (op == 0x8c || op == 'X' || op == 0x8d) { /* a pure push: the top becomes the second */
        Py_ssize_t length;
        const unsigned char *s = string_bytes(buf, p, end, &length);
        d->second = d->top;
        d->top = string_kind(s, length, 0); /* decoded by the unpickler, or the load fails there */
        return 0;
    }
    if (op == 'c') {
        top = global_kind(buf, p, end);
    } else if (op == 0x93 && is_name(d->second) && is_name(d->top)) {
        top = class_kind(d->second, d->top); /* the two strings the last two opcodes pushed */
    }
    d->second = K_UNKNOWN;
    d->top = top;
    return plans_after_push(d, buf, size, end, memo);
}

int plans_after_push(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t end, Py_ssize_t memo) {
    int top = d->top;
    if (is_class(top) && (role_of(top) == ROLE_DROP || role_of(top) == ROLE_DROP_OUTER) && d->budget > 0) {
        PlanRegion region;
        /* a part shorter than its record is not worth one: regions stay fewer than the input has bytes / 40 */
        if (recognize(d, buf, size, end, memo, &region) && region.end - region.start >= (Py_ssize_t)sizeof region &&
            add_region(d, &region) < 0)
            return -1;
    }
    return 0;
}

/* The region whose memo entries include idx, or -1 (binary search: their entries follow pickle order). */
static Py_ssize_t writer_region(const PlanDrops *d, Py_ssize_t idx) {
    Py_ssize_t lo = 0, hi = d->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (d->regions[mid].memo_end <= idx) lo = mid + 1;
        else hi = mid;
    }
    return lo < d->n && d->regions[lo].memo_start <= idx ? lo : -1;
}

int plans_read_in_regions(PlanDrops *d, Py_ssize_t idx, Py_ssize_t reader) {
    Py_ssize_t writer = d->n ? writer_region(d, idx) : -1;
    if (writer < 0 || writer == reader) return 0;
    if (reader < 0) {
        d->regions[writer].live = 1;
        return 0;
    }
    Py_ssize_t *last = d->n_edges ? d->edges + 2 * (d->n_edges - 1) : NULL;
    if (d->all_live || (last != NULL && last[0] == reader && last[1] == writer)) return 0;
    if (d->n_edges >= d->max_edges) { /* a pickle of parts reading each other without end: keep them all */
        d->all_live = 1;
        return 0;
    }
    if (d->n_edges == d->cap_edges) {
        Py_ssize_t cap = d->cap_edges ? d->cap_edges * 2 : 256;
        Py_ssize_t *edges = PyMem_Realloc(d->edges, (size_t)cap * 2 * sizeof(Py_ssize_t));
        if (edges == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        d->edges = edges;
        d->cap_edges = cap;
    }
    d->edges[2 * d->n_edges] = reader;
    d->edges[2 * d->n_edges + 1] = writer;
    d->n_edges++;
    return 0;
}

void plans_settle(PlanDrops *d) {
    /* edges were recorded in pickle order of their readers, and a writer comes before its reader: walking them
     * backwards, a region's liveness is final before its own edges are met */
    for (Py_ssize_t e = d->n_edges - 1; e >= 0; e--)
        if (d->regions[d->edges[2 * e]].live) d->regions[d->edges[2 * e + 1]].live = 1;
    if (d->all_live)
        for (Py_ssize_t i = 0; i < d->n; i++) d->regions[i].live = 1;
}

int plans_any_dropped(const PlanDrops *d) {
    for (Py_ssize_t i = 0; i < d->n; i++)
        if (!d->regions[i].live) return 1;
    return 0;
}


void plans_end_plan(PlanDrops *d) {
    PyMem_Free(d->kinds);
    PyMem_Free(d->edges);
    d->kinds = NULL;
    d->edges = NULL;
    d->n_kinds = d->n_edges = d->cap_edges = 0;
}

void plans_clear(PlanDrops *d) {
    plans_end_plan(d);
    PyMem_Free(d->regions);
    d->regions = NULL;
    d->n = d->cap = 0;
}
