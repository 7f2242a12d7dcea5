/* Save plans dropped from index-only reads, for the memo pruning (see _plans.c). */
#ifndef CKPTDOCTOR_PICKLE_PLANS_H
#define CKPTDOCTOR_PICKLE_PLANS_H

#include "_opcode_read.h"

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* What a memo entry or a simulated stack item holds (see _plans.c). Names are strings with the text of one
 * of its NAMES. */
enum {
    K_UNKNOWN = 0,
    K_STR = 1,
    K_NAME_FIRST = 2, /* 2..31: NAMES[k - 2] */
    K_INT = 32,
    K_SCALAR,        /* None, a bool, a float or bytes: hashable, immutable */
    K_TUPLE,
    K_TUPLE5,        /* a tuple of five items (a TensorProperties state, see K_TUPLE_RECORD's BUILD) */
    K_INT_ITEM_TYPE, /* an int of 1..3 (BININT1): a WriteItemType value */
    K_INT_TUPLE,     /* a tuple of 1 to 4 ints (what torch.Size takes; five items are K_TUPLE5) */
    K_ITEM_TYPE_ARGS, /* a 1-tuple of such an int: WriteItemType's REDUCE arguments */
    K_EMPTY_TUPLE,
    K_SIZE_ARGS,     /* a 1-tuple of a tuple (torch.Size's REDUCE arguments) */
    K_LIST,          /* made in the part (only those are filled) */
    K_DICT,
    K_DROPPED,
    K_OBJECT,        /* a WriteItemType value made in the part (never BUILT there) */
    K_RECORD,        /* an index record made in the part, whose state must be a dict (as torch's BUILD needs) */
    K_TUPLE_RECORD,  /* a TensorProperties index record made in the part (a 5-tuple state too: its __setstate__) */
    K_OTHER,         /* something the part must not change */
    K_CLASS_FIRST = 64, /* 64..: CLASSES[k - 64] */
};

typedef struct {
    Py_ssize_t start, end;           /* the bytes left out: after a plan part's NEWOBJ, through its BUILD */
    Py_ssize_t memo_start, memo_end; /* the memo entries written there (original numbering) */
    int live;                        /* read from code that stays: translated as it is */
} PlanRegion;

typedef struct {
    unsigned char *kinds;   /* what each memo entry holds, as far as the plan knows (K_* above) */
    Py_ssize_t n_kinds;
    PlanRegion *regions;    /* in pickle order; they neither nest nor overlap */
    Py_ssize_t n, cap;
    Py_ssize_t *edges;      /* pairs (reader region, writer region): a region reading an entry another one wrote */
    Py_ssize_t n_edges, cap_edges;
    Py_ssize_t max_edges;   /* beyond: every region is kept (all_live), so the plan's memory stays under the input's */
    int all_live;
    Py_ssize_t budget;      /* opcodes the recognizer may still look at (linear in the pickle's size) */
    int top, second;        /* kinds of the two objects the last opcodes pushed, where known */
    Py_ssize_t cursor;      /* translation: the first region not yet passed */
} PlanDrops;

/* Before the plan of buf: 0 where it names no plan class (nothing to leave out), else 1; the recognizer may look
 * at about as many opcodes in all as the pickle has bytes. */
int plans_start(PlanDrops *d, const unsigned char *buf, Py_ssize_t size);
/* The region that holds position p during the plan (the last one recorded), or -1. */
static inline Py_ssize_t plans_region_at(const PlanDrops *d, Py_ssize_t p) {
    if (d->n == 0) return -1;
    const PlanRegion *r = &d->regions[d->n - 1];
    return p >= r->start && p < r->end ? d->n - 1 : -1;
}
int plans_grow_kinds(PlanDrops *d, Py_ssize_t n);
/* plans_op for string opcodes, GLOBAL and STACK_GLOBAL; plans_after_push once the top is known (a class of a plan
 * part: the recognizer runs from end). 0, or -1 with a Python error. */
int plans_op_named(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t end,
                   Py_ssize_t memo);
int plans_after_push(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t end, Py_ssize_t memo);

static inline int plan_kind_is_str(int k) { return k >= K_STR && k < K_INT; }
static inline int plan_kind_is_tuple(int k) {
    return k == K_TUPLE || k == K_TUPLE5 || k == K_INT_TUPLE || k == K_EMPTY_TUPLE || k == K_SIZE_ARGS ||
           k == K_ITEM_TYPE_ARGS;
}
static inline int plan_kind_is_hashable(int k) {
    return plan_kind_is_str(k) || k == K_INT || k == K_INT_ITEM_TYPE || k == K_SCALAR;
}

/* What a memo read of idx pushes, as a part may use it: objects that could be changed are K_OTHER. */
static inline int plan_read_kind(const PlanDrops *d, Py_ssize_t idx) {
    int k = idx < d->n_kinds ? d->kinds[idx] : K_UNKNOWN;
    return plan_kind_is_hashable(k) || plan_kind_is_tuple(k) || k >= K_CLASS_FIRST || k == K_DROPPED ? k : K_OTHER;
}

/* After the plan's opcode at [p, end) outside every region (memo entries written so far: memo; pushed: the opcode
 * before a memo write pushed an object): keeps track of what the top two stack items hold where it matters (strings
 * and classes: the linear pass knows nothing else) and, after a plan class is pushed, records the region of its
 * part if the recognizer can prove that leaving it out changes nothing but the memo. Inline: nearly every opcode
 * of the pickle comes here. 0, or -1 with a Python error. */
static inline int plans_op(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t end,
                           Py_ssize_t memo, int pushed) {
    switch (buf[p]) {
        case 0x94: case 'q': case 'r': /* memo writes: of what the top holds */
            if (memo >= d->n_kinds && plans_grow_kinds(d, memo + 1) < 0) return -1;
            d->kinds[memo] = pushed ? (unsigned char)d->top : K_UNKNOWN;
            return 0;
        case 'h': case 'j': /* a pure push */
            d->second = d->top;
            d->top = plan_read_kind(d, end - p == 2 ? buf[p + 1] : (Py_ssize_t)read_u32(buf + p + 1));
            return d->top >= K_CLASS_FIRST ? plans_after_push(d, buf, size, end, memo) : 0;
        case 0x8c: case 'X': case 0x8d: case 'c': case 0x93:
            return plans_op_named(d, buf, size, p, end, memo);
        default:
            d->top = d->second = K_UNKNOWN;
            return 0;
    }
}
/* A memo read of entry idx at a position in region reader (-1: outside all): a region of the writer is made live
 * (reader -1) or an edge recorded. 0, or -1 with a Python error. Most reads are of entries written before the
 * first region (the records of state_dict_metadata): those return at once. */
int plans_read_in_regions(PlanDrops *d, Py_ssize_t idx, Py_ssize_t reader);
static inline int plans_read(PlanDrops *d, Py_ssize_t idx, Py_ssize_t reader) {
    return d->n == 0 || idx < d->regions[0].memo_start ? 0 : plans_read_in_regions(d, idx, reader);
}
/* After the plan: regions read (through others) from code that stays become live. */
void plans_settle(PlanDrops *d);
/* Translation, which meets positions in order: the region left out (not live) that starts at p, or NULL. */
static inline const PlanRegion *plans_left_out_at(PlanDrops *d, Py_ssize_t p) {
    while (d->cursor < d->n && d->regions[d->cursor].start < p) d->cursor++;
    const PlanRegion *r = d->cursor < d->n ? &d->regions[d->cursor] : NULL;
    return r != NULL && r->start == p && !r->live ? r : NULL;
}
int plans_any_dropped(const PlanDrops *d);
void plans_end_plan(PlanDrops *d); /* what only the plan needs goes */
void plans_clear(PlanDrops *d);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
