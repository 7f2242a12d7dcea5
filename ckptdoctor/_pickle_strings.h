/* Shared strings for the memo pruning (see _pickle_strings.c). */
#ifndef CKPTDOCTOR_PICKLE_STRINGS_H
#define CKPTDOCTOR_PICKLE_STRINGS_H

#include "_pickle_scan.h"

typedef struct {
    Py_ssize_t position; /* of a string opcode read as a memo read instead */
    Py_ssize_t memo;     /* the memo entry (original numbering) holding an equal string */
} StringShare;

typedef struct {
    struct StringSlot *slots; /* the table of distinct strings, while the plan is made */
    Py_ssize_t cap, used;
    Py_ssize_t first_cap;     /* the table's first size (strings_expect), so that it is seldom grown */
    StringShare *shares; /* the replacements, in pickle order */
    Py_ssize_t n, alloc;
    Py_ssize_t next;     /* the next replacement the translation meets */
} StringShares;

/* The string opcode at position, whose bytes are buf[offset:offset + length]: if an earlier string with those bytes
 * was memoized, a replacement is recorded and *shared_memo is its entry; else, if memoized (a MEMOIZE follows, making
 * entry next_memo), it is remembered. *shared_memo is -1 where nothing is shared. 0, or -1 with a Python error set. */
int strings_note(StringShares *t, const unsigned char *buf, Py_ssize_t position, Py_ssize_t offset,
                 Py_ssize_t length, Py_ssize_t next_memo, int memoized, Py_ssize_t *shared_memo);
void strings_expect(StringShares *t, Py_ssize_t pickle_size); /* size the table for a pickle of that many bytes */
void strings_end_plan(StringShares *t); /* the table goes; the replacements stay */
void strings_clear(StringShares *t);

#endif
