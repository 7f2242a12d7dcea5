/* Save plans dropped from index-only reads, for the memo pruning (see _pickle_plans.c). */
#ifndef CKPTDOCTOR_PICKLE_PLANS_H
#define CKPTDOCTOR_PICKLE_PLANS_H

#include "_pickle_scan.h"

/* The opcode classes of the memo pruning (prune_op in _pickle_prune.c). */
enum { OP_PLAIN, OP_PUSHES, OP_MEMOIZE, OP_PUT, OP_GET, OP_FRAME, OP_STOP, OP_REFUSE };

/* The class of the opcode at buf[p] and where it ends (past its argument); OP_REFUSE for what pruning leaves alone. */
int prune_op(const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t *end);

typedef struct {
    Py_ssize_t start, end;           /* the bytes left out: after a plan part's NEWOBJ, through its BUILD */
    Py_ssize_t memo_start, memo_end; /* the memo entries written there (original numbering) */
    int live;                        /* read from code that stays: translated as it is */
} PlanRegion;

typedef struct {
    int on;                 /* drop_plans was asked for */
    unsigned char *kinds;   /* what each memo entry holds, as far as the plan knows (KIND_* in _pickle_plans.c) */
    Py_ssize_t n_kinds;
    PlanRegion *regions;    /* in pickle order; they neither nest nor overlap */
    Py_ssize_t n, cap;
    Py_ssize_t *edges;      /* pairs (reader region, writer region): a region reading an entry another one wrote */
    Py_ssize_t n_edges, cap_edges;
    Py_ssize_t budget;      /* opcodes the recognizer may still look at (linear in the pickle's size) */
    int top, second;        /* kinds of the two objects the last opcodes pushed, where known */
    Py_ssize_t cursor;      /* translation: the first region not yet passed */
} PlanDrops;

/* The region that holds position p during the plan (the last one recorded), or -1. */
Py_ssize_t plans_region_at(const PlanDrops *d, Py_ssize_t p);
/* After the plan's opcode at [p, end) outside every region (of class kind; memo entries written so far: memo):
 * keeps track of what the stack's top holds and, after a plan class is pushed, records the region of its part
 * if the recognizer can prove that leaving it out changes nothing but the memo. 0, or -1 with a Python error. */
int plans_op(PlanDrops *d, const unsigned char *buf, Py_ssize_t size, Py_ssize_t p, Py_ssize_t end, int kind,
             Py_ssize_t memo, int pushed);
/* A memo read of entry idx at a position in region reader (-1: outside all): a region of the writer is made live
 * (reader -1) or an edge recorded. 0, or -1 with a Python error. */
int plans_read(PlanDrops *d, Py_ssize_t idx, Py_ssize_t reader);
/* After the plan: regions read (through others) from code that stays become live. */
void plans_settle(PlanDrops *d);
/* Translation, which meets positions in order: the region left out (not live) that starts at p, or NULL. */
const PlanRegion *plans_left_out_at(PlanDrops *d, Py_ssize_t p);
int plans_any_dropped(const PlanDrops *d);
void plans_end_plan(PlanDrops *d); /* what only the plan needs goes */
void plans_clear(PlanDrops *d);

#endif
