/* ckptdoctor._metadata_filter (see _metadata_filter.c): the tables, the simulation's state and the functions the
 * sources share.
 *   _metadata_filter.c  the module: arguments, the two passes in order, the counts returned
 *   _filter_tables.c    names and classes it recognises, byte and hash sets, large tables in their own maps
 *   _filter_source.c    the source read through a window, opcode by opcode
 *   _filter_pass1.c     pass 1: the stack simulation
 *   _filter_items.c     pass 1: the items of the containers edited, storage edits, fields of state dicts
 *   _filter_emit.c      between the passes (liveness, compacted layout) and pass 2 (the bytes written)
 */
#ifndef CKPTDOCTOR_METADATA_FILTER_H
#define CKPTDOCTOR_METADATA_FILTER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "_pickle_plans.h" /* prune_op: an opcode's class and end */

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* Names: the module, class and field names the filter recognises (strings compared by content). */
enum {
    N_NONE = 0,
    N_MOD_METADATA,
    N_MOD_FILESYSTEM,
    N_MOD_PLANNER,
    N_MOD_MCORE,
    N_METADATA,
    N_MCORE_METADATA,
    N_METADATA_INDEX,
    N_STORAGE_INFO,
    N_SAVE_PLAN,
    N_MCORE_SAVE_PLAN,
    N_WRITE_ITEM,
    N_F_SDM,
    N_F_PLANNER_DATA,
    N_F_STORAGE_DATA,
    N_F_MCORE_DATA,
    N_F_ALL_LOCAL_PLANS,
    N_F_ITEMS,
    N_F_INDEX,
    N_F_FQN,
    N_F_RELATIVE_PATH,
    N_F_OFFSET,
    N_F_LENGTH,
    N_COUNT
};


/* Classes (module name, class name) */
enum { C_NONE = 0, C_METADATA, C_MINDEX, C_SINFO, C_PLAN, C_WITEM, C_OTHER };

/* A set of byte strings (the data file names), open addressing; ids in insertion order from 1. */
typedef struct {
    char *arena;
    Py_ssize_t arena_used, arena_cap;
    Py_ssize_t *slots; /* offset into arena + 1 of an entry (length-prefixed), 0 empty */
    uint64_t *hashes;
    Py_ssize_t n, cap;
} ByteSet;

/* The kept keys as their hashes only (8 bytes a key, not the key): a string of the pickle not kept whose hash is a
 * kept key's (a chance of 2**-64 per pair, under a secret key) is counted as kept, and then the counts the caller
 * checks (keys and storage items kept, from its index) differ: nothing is written. */
typedef struct {
    uint64_t *slots; /* hash | 1 (0: empty) */
    Py_ssize_t n, cap;
} HashSet;


/* What the simulation knows of a memo entry (memo_info) or a stack item (Slot.info). */

/* Bounds on what a pickle may make the filter hold (a stranger's pickle of a few MB could otherwise ask for GBs):
 * Python's pickler never stacks more than a batch of 1,000 items per level of nesting, and items left out read
 * one another's memo entries a few times each. Beyond them the filter declines (the object rewrite, with its own
 * limits, takes over). */
#define MAX_STACK (1 << 16)
#define MAX_EDGES (1 << 24)

#define M_NAME_MASK 0x1fu /* a string's N_* name, a class's C_* */
#define M_STR (1u << 5)
#define M_CLASS (1u << 6)
#define M_KEPT (1u << 7)    /* a string in the kept keys; a MetadataIndex or WriteItem naming one */
#define M_DROP (1u << 8)    /* a string not in the kept keys; ... naming one */
#define M_REPOINT (1u << 9) /* the key whose storage is pointed at a new file; ... naming it */
#define M_MINDEX (1u << 10) /* a MetadataIndex object (built) */
#define M_GUARDED (1u << 11) /* a container or object the filter edits: never changed through a memo read */
#define M_FILE_SHIFT 12      /* a string naming a data file (*.distcp): its id in the file set, + 1 */
#define M_FILE_MAX ((1u << 20) - 1)
#define M_KEY_BITS (M_KEPT | M_DROP | M_REPOINT)

enum { S_OTHER = 0, S_STR, S_INT, S_NONE, S_CLASS, S_OBJ, S_DICT, S_LIST };
enum { R_NONE = 0, R_STATE, R_SDM, R_SD, R_PD, R_MCORE, R_PLANS, R_PLAN_ITEMS };

typedef struct {
    Py_ssize_t start, end, memo_end; /* a plain value's opcode; the end of a memo write of it (0: none) */
} Span;

typedef struct {
    Py_ssize_t start;  /* where the construction of this object began */
    Py_ssize_t memo0;  /* memo entries written before then */
    Py_ssize_t end;    /* the end of the opcode that pushed it */
    Py_ssize_t memo_end; /* the end of the last memo write of it, 0 */
    Py_ssize_t memo;   /* the memo entry written for it, -1 */
    int64_t ival;      /* S_INT that fits */
    uint32_t info;     /* M_* */
    uint8_t kind, cls, role, fresh, state_of, int_ok, have; /* have: storage fields seen (1 path, 2 offset, 4 length) */
    int32_t file;      /* a _StorageInfo (or its state): its path's file id + 1 */
    int64_t offset, length;
    Span path_span, offset_span, length_span;
} Slot;

typedef struct {
    Py_ssize_t height, pos, memo0; /* stack height at the MARK, its position, memo entries written before it */
    int candidate;                 /* a batch into one of the containers the filter edits */
} Mark;

/* Positions and memo entries of these tables fit 32 bits (the filter declines a pickle of 4 GiB or more). */
typedef struct {
    uint32_t start, end, single;   /* the item's bytes; the SETITEM / APPEND taking it alone (UINT32_MAX: in a batch) */
    uint32_t memo0, memo1;         /* memo entries written inside */
    uint8_t pops, live;            /* objects it pushes; kept as garbage (built and popped) */
} Dropped;

typedef struct {
    Py_ssize_t pos, entry, item; /* a read at pos of a memo entry written in the open batch (item -1), or of item */
} PendingRead;

enum { E_INT, E_INT_AFTER, E_STR, E_STR_AFTER };

typedef struct {
    uint32_t pos, end; /* the value's opcode [pos, end) (E_INT, E_STR), or where to insert (the *_AFTER kinds) */
    int32_t kept;      /* the kept storage item whose new offset it writes (-1: the repointed item's new values) */
    uint8_t kind;
    uint8_t field;     /* of the repointed item: 1 path, 2 offset, 4 length */
} Edit;

typedef struct {
    int64_t offset, length; /* offset: the source's, then (compact_layout) the new one */
    int32_t file;
} KeptStorage;

/* The source pickle, read through a window (both passes read it front to back, each byte once): the memory of the
 * filter does not grow with the pickle. Each pass hashes every byte of the file in order; the passes must agree. */
typedef struct {
    int fd;
    Py_ssize_t size;          /* of the file */
    unsigned char *win;
    Py_ssize_t win_cap, win_start, win_len;
    uint64_t hash;
} Source;

typedef struct {
    Source src;
    const unsigned char *base; /* base[p] is the byte at p of the opcode being looked at (in the window) */
    Py_ssize_t size;           /* the pickle's end (past its STOP) */
    HashSet keep;
    ByteSet files;
    const unsigned char *repoint_key; /* UTF-8 of the repointed key (NULL: none) */
    Py_ssize_t repoint_key_len;
    PyObject *repoint_path;           /* bytes */
    int64_t repoint_length;
    int compact;
    /* pass 1 */
    uint32_t *memo_info; /* per memo entry: what it holds (M_*); in pass 2, its new number */
    Py_ssize_t memo_cap, n_memo; /* n_memo: the memo writes pass 1 met */
    Slot *stack;
    Py_ssize_t height, stack_cap;
    Mark *marks;
    Py_ssize_t n_marks, marks_cap;
    Py_ssize_t cand_mark; /* the index in marks of the open candidate batch, -1 */
    Dropped *dropped;
    Py_ssize_t n_dropped, dropped_cap;
    PendingRead *pending;
    Py_ssize_t n_pending, pending_cap;
    Py_ssize_t *edges; /* pairs (reader, writer) of dropped items */
    Py_ssize_t n_edges, edges_cap;
    Edit *edits;
    Py_ssize_t n_edits, edits_cap;
    KeptStorage *kept;
    Py_ssize_t n_kept, kept_cap;
    int proto;
    Py_ssize_t n_meta, n_sdm, n_sd, n_repointed;
    Py_ssize_t sdm_kept, sdm_dropped, sd_kept, sd_dropped, other_dropped;
    const char *why; /* why it declines */
} Filter;

#define GROW(arr, n, cap)                                                  \
    do {                                                                   \
        if (grow((void **)&(arr), (n), &(cap), sizeof(*(arr))) < 0) return -1; \
    } while (0)

/* 0: declined (f->why says why) */
#define DECLINE(f, reason) \
    do {                   \
        (f)->why = reason; \
        return 0;          \
    } while (0)


static inline int64_t read_i32(const unsigned char *b) { return (int64_t)(int32_t)read_u32(b); }
static inline int is_filtered_role(int role) {
    return role == R_SDM || role == R_SD || role == R_PD || role == R_MCORE || role == R_PLAN_ITEMS;
}
static inline int our_class(int cls) { return cls != C_NONE && cls != C_OTHER; }
/* The height of the innermost mark (-1 with no mark). */
static inline Py_ssize_t mark_height(const Filter *f) { return f->n_marks ? f->marks[f->n_marks - 1].height : -1; }

/* _filter_tables.c */
void *big_realloc(void *p, size_t old_bytes, size_t new_bytes);
void big_free(void *p, size_t bytes);
int grow(void **arr, Py_ssize_t n, Py_ssize_t *cap, size_t item);
int name_of(const unsigned char *s, Py_ssize_t n);
int class_of(int module, int name);
uint64_t hash_bytes(const unsigned char *s, Py_ssize_t n);
Py_ssize_t byteset_add(ByteSet *b, const unsigned char *s, Py_ssize_t n);
int hashset_contains(const HashSet *h, uint64_t x);
int hashset_add_str(HashSet *h, PyObject *str);
void filter_clear(Filter *f);
/* _filter_source.c */
int source_rewind(Source *s, uint64_t *hash);
int next_op(Filter *f, Py_ssize_t p, Py_ssize_t *end);
Py_ssize_t dropped_of_entry(const Filter *f, Py_ssize_t idx);
/* _filter_pass1.c */
int pass1(Filter *f);
int take(Filter *f, Py_ssize_t n);
/* _filter_items.c */
int assign_items(Filter *f, Py_ssize_t target, Py_ssize_t first, int w, Py_ssize_t op, int single,
                 Py_ssize_t memo_now);
/* _filter_emit.c */
void settle_liveness(Filter *f);
int cmp_edit(const void *a, const void *b);
int compact_layout(Filter *f, PyObject *expected, PyObject *sizes);
int write_output(Filter *f, int fd, Py_ssize_t *written);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
