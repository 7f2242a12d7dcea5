/* Memo pruning (see _pickle_prune.c): the plan and the translation, shared with the reader (_pickle_reader.c). */
#ifndef CKPTDOCTOR_PICKLE_PRUNE_H
#define CKPTDOCTOR_PICKLE_PRUNE_H

#include "_pickle_plans.h"

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

typedef struct {
    uint64_t *bits; /* memo entries kept: read somewhere, or a MEMOIZE that is not safe to drop */
    Py_ssize_t n_words;
} Bitmap;

/* A pickle being pruned: the plan of prune_plan, and how far the translation got. */
typedef struct {
    Py_buffer view; /* the original pickle */
    Bitmap kept;
    uint32_t *rank; /* kept entries below each word of the bitmap */
    Py_ssize_t stop_end, p, memo; /* the end of the pickle (past its STOP); the next opcode; memo writes so far */
    PlanDrops plans;              /* plan parts left out (drop_plans; see _pickle_plans.c) */
} Pruner;

void pruner_clear(Pruner *s);
/* Plan the pruning of data into s: 1 to prune, 0 to leave it alone (s cleared), -1 with a Python error set. */
int pruner_init(Pruner *s, PyObject *data, int drop_plans);
/* The input bytes of the next unit (an opcode outside frames, or a whole frame), and its translation into o (the
 * bytes written, never more than the unit's input bytes). */
Py_ssize_t unit_length(const Pruner *s);
Py_ssize_t emit_unit(Pruner *s, unsigned char *o);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
