/* Shared strings, for the memo pruning of ckptdoctor._pickle_scan (see _pickle_prune.c).
 *
 * A DCP .metadata writes each key's name several times as its own string: as the key of state_dict_metadata and
 * again in the MetadataIndex of each of its storage entries (and in megatron-core's plans), ~100 bytes each time.
 * The pickler memoizes every string, but these are different objects in the saving process, so each is read
 * back as a new str. With sharing on (index-only reads), a string opcode (SHORT_BINUNICODE, BINUNICODE,
 * BINUNICODE8) whose bytes equal those of an earlier one that a MEMOIZE stored is read as a memo read (BINGET)
 * of that entry instead: the same str value, one object. Equal bytes decode to equal strings (or the first one
 * already failed and the load stopped there), the memo entry is never overwritten (the plan refuses out-of-order
 * memo writes), and a memo read is never longer than the opcode it replaces (strings of MIN_SHARED bytes or more).
 *
 * The table of distinct strings (offsets into the pickle, hashed with Python's keyed hash of bytes: a pickle
 * cannot make its strings collide) lives only while the plan is made; what stays is the list of replacements
 * (position -> memo entry, in pickle order), read once by the translation. */
#include "_pickle_strings.h"

#define MIN_SHARED 8             /* shorter strings are left alone (field names are already shared by the pickler) */
#define MAX_DISTINCT ((Py_ssize_t)1 << 20) /* the table stays under 64 MB (2^21 slots of 32 bytes) */

typedef struct StringSlot {
    Py_ssize_t offset; /* of the string's bytes in the pickle; -1: an empty slot */
    Py_ssize_t length;
    Py_ssize_t memo;   /* the memo entry its MEMOIZE made */
    Py_hash_t hash;
} Slot;

void strings_expect(StringShares *t, Py_ssize_t pickle_size) {
    /* a .metadata holds about one distinct long string (a key) per 300 bytes; the table is kept half empty */
    Py_ssize_t cap = 1 << 12;
    while (cap < pickle_size / 150 && cap < 2 * MAX_DISTINCT) cap *= 2;
    t->first_cap = cap;
}

static int grow_slots(StringShares *t) {
    Py_ssize_t cap = t->cap ? t->cap * 2 : t->first_cap > 0 ? t->first_cap : 1 << 12;
    Slot *slots = PyMem_Malloc((size_t)cap * sizeof(Slot)), *old = t->slots;
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < cap; i++) slots[i].offset = -1;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        if (old[i].offset < 0) continue;
        Py_ssize_t j = (Py_ssize_t)((size_t)old[i].hash & (size_t)(cap - 1));
        while (slots[j].offset >= 0) j = (j + 1) & (cap - 1);
        slots[j] = old[i];
    }
    PyMem_Free(old);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

static int add_share(StringShares *t, Py_ssize_t position, Py_ssize_t memo) {
    if (t->n == t->alloc) {
        Py_ssize_t alloc = t->alloc ? t->alloc * 2 : 1 << 10;
        StringShare *shares = PyMem_Realloc(t->shares, (size_t)alloc * sizeof(StringShare));
        if (shares == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->shares = shares;
        t->alloc = alloc;
    }
    t->shares[t->n].position = position;
    t->shares[t->n].memo = memo;
    t->n++;
    return 0;
}

int strings_note(StringShares *t, const unsigned char *buf, Py_ssize_t position, Py_ssize_t offset,
                 Py_ssize_t length, Py_ssize_t next_memo, int memoized, Py_ssize_t *shared_memo) {
    *shared_memo = -1;
    if (length < MIN_SHARED) return 0;
    if (t->cap == 0 && grow_slots(t) < 0) return -1;
    Py_hash_t hash = _Py_HashBytes(buf + offset, length);
    Py_ssize_t j = (Py_ssize_t)((size_t)hash & (size_t)(t->cap - 1));
    for (; t->slots[j].offset >= 0; j = (j + 1) & (t->cap - 1)) {
        Slot *slot = &t->slots[j];
        if (slot->hash == hash && slot->length == length && memcmp(buf + slot->offset, buf + offset, (size_t)length) == 0) {
            if (add_share(t, position, slot->memo) < 0) return -1;
            *shared_memo = slot->memo;
            return 0;
        }
    }
    if (!memoized || t->used >= MAX_DISTINCT) return 0;
    t->slots[j] = (Slot){offset, length, next_memo, hash};
    if (++t->used * 2 > t->cap && grow_slots(t) < 0) return -1;
    return 0;
}

void strings_end_plan(StringShares *t) {
    PyMem_Free(t->slots);
    t->slots = NULL;
    t->cap = t->used = 0;
    if (t->n < t->alloc && t->n > 0) { /* only the replacements stay, at their number */
        StringShare *shares = PyMem_Realloc(t->shares, (size_t)t->n * sizeof(StringShare));
        if (shares != NULL) {
            t->shares = shares;
            t->alloc = t->n;
        }
    }
}

void strings_clear(StringShares *t) {
    strings_end_plan(t);
    PyMem_Free(t->shares);
    t->shares = NULL;
    t->n = t->alloc = t->next = 0;
}
