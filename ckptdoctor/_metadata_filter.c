/* ckptdoctor._metadata_filter: a .metadata with some keys left out, written from the source pickle's bytes.
 *
 * strip-frozen and edit (without renames) used to read the whole .metadata as objects, edit them and pickle them
 * again: at 200k keys ~470 MB for the records, the pickler's memo and its output. This filter never builds an
 * object. It walks the source pickle twice:
 *
 * 1. A stack simulation finds the containers a key is listed in (what ckptdoctor.formats.dcp_keys.edit_metadata
 *    edits): the Metadata object's state_dict_metadata, storage_data (keys: MetadataIndex objects, by their fqn),
 *    planner_data and mcore_data, and each SavePlan's items (WriteItem objects, by their index's fqn) and mcore_data
 *    under all_local_plans. Each item of those containers (a key and its value, or a list element) is the byte span
 *    from where its first object's construction begins to where the next one's begins (or the SETITEMS / APPENDS
 *    that takes them). An item whose key is not kept is removed, unless a memo entry written inside it is read from
 *    outside it by bytes that stay: then it is kept as garbage, built and popped (its objects are read later, so
 *    they must exist), but not put in its container. Kept storage items' _StorageInfo offsets are rewritten for a
 *    compacted copy (each data file's kept items back to back in source order), and one item (the common state of
 *    core >= 0.19) can be pointed at a new file.
 * 2. The bytes are written again without the removed spans: memo writes renumbered (MEMOIZE counts entries), memo
 *    reads translated, frames rebuilt, the output streamed to a file descriptor in frames of 64 KiB.
 *
 * Anything this does not recognise for certain makes it decline (None): the caller then edits the objects as
 * before. It declines where a container is not built the plain way (an empty dict or list filled by batches on the
 * object's own construction), where an object of those classes is changed after it was made (a BUILD or item
 * assignment on a memo read), where a container appears twice or not at all, on opcodes with explicit text memo
 * indices, and on a storage item whose path, offset or length is not a plain value. The caller checks the counts it
 * returns (keys and storage items kept, and each data file's kept ranges) against its own index of the source.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "_pickle_plans.h"

/* Large tables live in their own anonymous maps: given back to the system when freed, whatever the allocator's
 * thresholds, so the memory of the rest of the run is not taken by what the filter used. NULL on failure. */
static void *big_realloc(void *p, size_t old_bytes, size_t new_bytes) {
#if defined(__linux__)
    void *q = p == NULL ? mmap(NULL, new_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                        : mremap(p, old_bytes, new_bytes, MREMAP_MAYMOVE);
    return q == MAP_FAILED ? NULL : q;
#else
    void *q = PyMem_RawRealloc(p, new_bytes);
    if (q != NULL && new_bytes > old_bytes) memset((char *)q + old_bytes, 0, new_bytes - old_bytes);
    return q;
#endif
}

static void big_free(void *p, size_t bytes) {
    if (p == NULL) return;
#if defined(__linux__)
    munmap(p, bytes);
#else
    (void)bytes;
    PyMem_RawFree(p);
#endif
}

/* Room for n + 1 items of size item in *arr (capacity *cap items, zero-filled); 0, or -1 with a Python error. */
static int grow(void **arr, Py_ssize_t n, Py_ssize_t *cap, size_t item) {
    if (n < *cap) return 0;
    Py_ssize_t new_cap = *cap ? *cap * 2 : 1024;
    void *grown = big_realloc(*arr, (size_t)*cap * item, (size_t)new_cap * item);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = grown;
    *cap = new_cap;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------- */
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

static const char *const NAMES[N_COUNT] = {
    "",
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "megatron.core.dist_checkpointing.strategies.torch",
    "Metadata",
    "MCoreMetadata",
    "MetadataIndex",
    "_StorageInfo",
    "SavePlan",
    "MCoreSavePlan",
    "WriteItem",
    "state_dict_metadata",
    "planner_data",
    "storage_data",
    "mcore_data",
    "all_local_plans",
    "items",
    "index",
    "fqn",
    "relative_path",
    "offset",
    "length",
};

static int name_of(const unsigned char *s, Py_ssize_t n) {
    if (n < 3 || n > 60) return N_NONE;
    for (int i = 1; i < N_COUNT; i++)
        if ((Py_ssize_t)strlen(NAMES[i]) == n && memcmp(NAMES[i], s, (size_t)n) == 0) return i;
    return N_NONE;
}

/* Classes (module name, class name) */
enum { C_NONE = 0, C_METADATA, C_MINDEX, C_SINFO, C_PLAN, C_WITEM, C_OTHER };

static int class_of(int module, int name) {
    if (module == N_MOD_METADATA && name == N_METADATA) return C_METADATA;
    if (module == N_MOD_MCORE && name == N_MCORE_METADATA) return C_METADATA;
    if (module == N_MOD_METADATA && name == N_METADATA_INDEX) return C_MINDEX;
    if (module == N_MOD_FILESYSTEM && name == N_STORAGE_INFO) return C_SINFO;
    if (module == N_MOD_PLANNER && name == N_SAVE_PLAN) return C_PLAN;
    if (module == N_MOD_MCORE && name == N_MCORE_SAVE_PLAN) return C_PLAN;
    if (module == N_MOD_PLANNER && name == N_WRITE_ITEM) return C_WITEM;
    return C_OTHER;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* A set of byte strings (the kept keys, the data file names), open addressing. */

typedef struct {
    char *arena;
    Py_ssize_t arena_used, arena_cap;
    Py_ssize_t *slots; /* offset into arena + 1 of an entry (length-prefixed), 0 empty */
    uint64_t *hashes;
    Py_ssize_t n, cap;
} ByteSet;

/* Python's own keyed hash of bytes (SipHash, a secret per process): strings from a stranger's pickle cannot be
 * made to collide in these tables. */
static uint64_t hash_bytes(const unsigned char *s, Py_ssize_t n) { return (uint64_t)_Py_HashBytes(s, n); }

static void byteset_clear(ByteSet *b) {
    big_free(b->arena, (size_t)b->arena_cap);
    big_free(b->slots, (size_t)b->cap * sizeof(Py_ssize_t));
    big_free(b->hashes, (size_t)b->cap * sizeof(uint64_t));
    memset(b, 0, sizeof(*b));
}

/* The id (1-based, in insertion order) of s in b, 0 when absent. */
static Py_ssize_t byteset_find(const ByteSet *b, const unsigned char *s, Py_ssize_t n, uint64_t h) {
    if (b->cap == 0) return 0;
    for (Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)(b->cap - 1));; i = (i + 1) & (b->cap - 1)) {
        Py_ssize_t at = b->slots[i];
        if (at == 0) return 0;
        if (b->hashes[i] == h) {
            const char *e = b->arena + at - 1;
            Py_ssize_t len;
            memcpy(&len, e, sizeof(len));
            if (len == n && memcmp(e + sizeof(len) + sizeof(Py_ssize_t), s, (size_t)n) == 0) {
                Py_ssize_t id;
                memcpy(&id, e + sizeof(len), sizeof(id));
                return id;
            }
        }
    }
}

static int byteset_grow(ByteSet *b) {
    Py_ssize_t cap = b->cap ? b->cap * 2 : 1024;
    Py_ssize_t *slots = big_realloc(NULL, 0, (size_t)cap * sizeof(Py_ssize_t));
    uint64_t *hashes = big_realloc(NULL, 0, (size_t)cap * sizeof(uint64_t));
    if (slots == NULL || hashes == NULL) {
        big_free(slots, (size_t)cap * sizeof(Py_ssize_t));
        big_free(hashes, (size_t)cap * sizeof(uint64_t));
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < b->cap; i++) {
        if (b->slots[i] == 0) continue;
        Py_ssize_t j = (Py_ssize_t)(b->hashes[i] & (uint64_t)(cap - 1));
        while (slots[j] != 0) j = (j + 1) & (cap - 1);
        slots[j] = b->slots[i];
        hashes[j] = b->hashes[i];
    }
    big_free(b->slots, (size_t)b->cap * sizeof(Py_ssize_t));
    big_free(b->hashes, (size_t)b->cap * sizeof(uint64_t));
    b->slots = slots;
    b->hashes = hashes;
    b->cap = cap;
    return 0;
}

/* Adds s (if new); its id, or -1 with a Python error. */
static Py_ssize_t byteset_add(ByteSet *b, const unsigned char *s, Py_ssize_t n) {
    uint64_t h = hash_bytes(s, n);
    Py_ssize_t id = byteset_find(b, s, n, h);
    if (id) return id;
    if ((b->n + 1) * 2 > b->cap && byteset_grow(b) < 0) return -1;
    Py_ssize_t need = (Py_ssize_t)(2 * sizeof(Py_ssize_t)) + n;
    if (b->arena_used + need > b->arena_cap) {
        Py_ssize_t cap = b->arena_cap ? b->arena_cap : 1 << 16;
        while (cap < b->arena_used + need) cap *= 2;
        char *arena = big_realloc(b->arena, (size_t)b->arena_cap, (size_t)cap);
        if (arena == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->arena = arena;
        b->arena_cap = cap;
    }
    char *e = b->arena + b->arena_used;
    id = b->n + 1;
    memcpy(e, &n, sizeof(n));
    memcpy(e + sizeof(n), &id, sizeof(id));
    memcpy(e + 2 * sizeof(Py_ssize_t), s, (size_t)n);
    Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)(b->cap - 1));
    while (b->slots[i] != 0) i = (i + 1) & (b->cap - 1);
    b->slots[i] = b->arena_used + 1;
    b->hashes[i] = h;
    b->arena_used += need;
    b->n++;
    return id;
}

/* The kept keys as their hashes only (8 bytes a key, not the key): a string of the pickle not kept whose hash is a
 * kept key's (a chance of 2**-64 per pair, under a secret key) is counted as kept, and then the counts the caller
 * checks (keys and storage items kept, from its index) differ: nothing is written. */
typedef struct {
    uint64_t *slots; /* hash | 1 (0: empty) */
    Py_ssize_t n, cap;
} HashSet;

static void hashset_clear(HashSet *h) {
    big_free(h->slots, (size_t)h->cap * sizeof(uint64_t));
    memset(h, 0, sizeof(*h));
}

static int hashset_contains(const HashSet *h, uint64_t x) {
    if (h->cap == 0) return 0;
    x |= 1;
    for (Py_ssize_t i = (Py_ssize_t)((x >> 1) & (uint64_t)(h->cap - 1));; i = (i + 1) & (h->cap - 1)) {
        if (h->slots[i] == x) return 1;
        if (h->slots[i] == 0) return 0;
    }
}

static int hashset_add(HashSet *h, uint64_t x) {
    x |= 1;
    if ((h->n + 1) * 2 > h->cap) {
        Py_ssize_t cap = h->cap ? h->cap * 2 : 1024;
        uint64_t *slots = big_realloc(NULL, 0, (size_t)cap * sizeof(uint64_t));
        if (slots == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < h->cap; i++) {
            if (h->slots[i] == 0) continue;
            Py_ssize_t j = (Py_ssize_t)((h->slots[i] >> 1) & (uint64_t)(cap - 1));
            while (slots[j] != 0) j = (j + 1) & (cap - 1);
            slots[j] = h->slots[i];
        }
        big_free(h->slots, (size_t)h->cap * sizeof(uint64_t));
        h->slots = slots;
        h->cap = cap;
    }
    Py_ssize_t i = (Py_ssize_t)((x >> 1) & (uint64_t)(h->cap - 1));
    while (h->slots[i] != 0 && h->slots[i] != x) i = (i + 1) & (h->cap - 1);
    if (h->slots[i] == 0) {
        h->slots[i] = x;
        h->n++;
    }
    return 0;
}

/* The UTF-8 bytes of a str as pickle writes them (surrogates passed through), added to b. */
static int hashset_add_str(HashSet *h, PyObject *str) {
    if (!PyUnicode_Check(str)) {
        PyErr_SetString(PyExc_TypeError, "filter_metadata: keys must be str");
        return -1;
    }
    PyObject *encoded = PyUnicode_AsEncodedString(str, "utf-8", "surrogatepass");
    if (encoded == NULL) return -1;
    int r = hashset_add(h, hash_bytes((const unsigned char *)PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded)));
    Py_DECREF(encoded);
    return r;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* What the simulation knows of a memo entry (memo_info) or a stack item (Slot.info). */

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

static void filter_clear(Filter *f) {
    hashset_clear(&f->keep);
    byteset_clear(&f->files);
    Py_CLEAR(f->repoint_path);
    big_free(f->src.win, (size_t)f->src.win_cap);
    big_free(f->memo_info, (size_t)f->memo_cap * sizeof(uint32_t));
    big_free(f->stack, (size_t)f->stack_cap * sizeof(Slot));
    big_free(f->marks, (size_t)f->marks_cap * sizeof(Mark));
    big_free(f->dropped, (size_t)f->dropped_cap * sizeof(Dropped));
    big_free(f->pending, (size_t)f->pending_cap * sizeof(PendingRead));
    big_free(f->edges, (size_t)f->edges_cap * sizeof(Py_ssize_t));
    big_free(f->edits, (size_t)f->edits_cap * sizeof(Edit));
    big_free(f->kept, (size_t)f->kept_cap * sizeof(KeptStorage));
    memset(f, 0, sizeof(*f));
}

/* 0: declined (f->why says why) */
#define DECLINE(f, reason) \
    do {                   \
        (f)->why = reason; \
        return 0;          \
    } while (0)

static inline int64_t read_i32(const unsigned char *b) { return (int64_t)(int32_t)read_u32(b); }

/* ---------------------------------------------------------------------------------------------------------------- */
/* The source, through its window. */

#define WINDOW (8 << 20)

static void hash_bytes_into(uint64_t *h, const unsigned char *b, Py_ssize_t n) {
    uint64_t x = *h;
    for (Py_ssize_t i = 0; i < n; i++) x = (x ^ b[i]) * 1099511628211ULL;
    *h = x;
}

/* Read [from, to) of the file into the window at offset at (hashed); 0, or -1 with a Python error. */
static int source_read(Source *s, Py_ssize_t at, Py_ssize_t from, Py_ssize_t to) {
    while (from < to) {
        ssize_t n = pread(s->fd, s->win + at, (size_t)(to - from), (off_t)from);
        if (n < 0 && errno == EINTR) {
            if (PyErr_CheckSignals() < 0) return -1;
            continue;
        }
        if (n < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (n == 0) {
            PyErr_SetString(PyExc_ValueError, "the file shrank while it was read");
            return -1;
        }
        hash_bytes_into(&s->hash, s->win + at, n);
        at += n;
        from += n;
    }
    return 0;
}

/* A pointer base with base[p .. p + need) in the window (need clipped at the end of the file); the window moves
 * forward only, every byte passed is read (and hashed) once. NULL with a Python error. */
static const unsigned char *source_at(Source *s, Py_ssize_t p, Py_ssize_t need) {
    Py_ssize_t want = p + need > s->size ? s->size : p + need, old_end = s->win_start + s->win_len;
    if (p >= s->win_start && want <= old_end) return s->win - s->win_start;
    Py_ssize_t len = want - p > WINDOW ? want - p : WINDOW;
    if (len > s->size - p) len = s->size - p;
    if (len > s->win_cap) {
        size_t cap = (size_t)len + 4096;
        unsigned char *win = big_realloc(s->win, (size_t)s->win_cap, cap);
        if (win == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        s->win = win;
        s->win_cap = (Py_ssize_t)cap;
    }
    while (old_end < p) { /* a span skipped whole: read for the hash only */
        Py_ssize_t chunk = p - old_end < s->win_cap ? p - old_end : s->win_cap;
        if (source_read(s, 0, old_end, old_end + chunk) < 0) return NULL;
        old_end += chunk;
        s->win_start = old_end;
        s->win_len = 0;
    }
    Py_ssize_t kept = old_end > p ? old_end - p : 0;
    if (kept) memmove(s->win, s->win + (p - s->win_start), (size_t)kept);
    if (source_read(s, kept, p + kept, p + len) < 0) return NULL;
    s->win_start = p;
    s->win_len = len;
    return s->win - p;
}

/* Back to the start for the next pass; the hash of the pass that ended (the rest of the file read to its end). */
static int source_rewind(Source *s, uint64_t *hash) {
    if (source_at(s, s->size, 0) == NULL) return -1;
    struct stat st;
    if (fstat(s->fd, &st) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if ((Py_ssize_t)st.st_size != s->size) {
        PyErr_SetString(PyExc_ValueError, "the file changed size while it was read");
        return -1;
    }
    *hash = s->hash;
    s->hash = 1469598103934665603ULL;
    s->win_start = s->win_len = 0;
    return 0;
}

/* The opcode at p (see prune_op) with the window over it; f->base set. -2 with a Python error. */
static int next_op(Filter *f, Py_ssize_t p, Py_ssize_t *end) {
    for (Py_ssize_t need = 1 << 16;; need *= 4) {
        const unsigned char *base = source_at(&f->src, p, need);
        if (base == NULL) return -2;
        Py_ssize_t avail = f->src.win_start + f->src.win_len;
        int kind = prune_op(base, avail, p, end);
        f->base = base;
        if (kind != OP_REFUSE || avail >= f->src.size) return kind; /* else it may run past the window */
    }
}

/* The item left out whose memo entries include idx, or -1 (dropped items are in memo order). */
static Py_ssize_t dropped_of_entry(const Filter *f, Py_ssize_t idx) {
    Py_ssize_t lo = 0, hi = f->n_dropped;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (f->dropped[mid].memo0 <= idx) lo = mid + 1; else hi = mid;
    }
    return lo > 0 && idx < f->dropped[lo - 1].memo1 ? lo - 1 : -1;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* Pass 1: the simulation. Each function returns 1 to go on, 0 to decline (f->why), -1 with a Python error. */

static int is_filtered_role(int role) {
    return role == R_SDM || role == R_SD || role == R_PD || role == R_MCORE || role == R_PLAN_ITEMS;
}

static int our_class(int cls) { return cls != C_NONE && cls != C_OTHER; }

static int push(Filter *f, const Slot *s) {
    GROW(f->stack, f->height, f->stack_cap);
    f->stack[f->height++] = *s;
    return 1;
}

static Slot new_slot(int kind, Py_ssize_t start, Py_ssize_t end, Py_ssize_t memo0) {
    Slot s;
    memset(&s, 0, sizeof(s));
    s.kind = (uint8_t)kind;
    s.start = start;
    s.end = end;
    s.memo0 = memo0;
    s.memo = -1;
    s.fresh = 1;
    return s;
}

/* The height of the innermost mark (0 with no mark: nothing below it is protected). */
static Py_ssize_t mark_height(const Filter *f) { return f->n_marks ? f->marks[f->n_marks - 1].height : -1; }

/* Slots the opcode takes off the stack (the top n): none may be a container the filter edits or a state dict. */
static int take(Filter *f, Py_ssize_t n) {
    if (n > f->height || (f->n_marks && f->height - n < mark_height(f))) DECLINE(f, "stack underflow");
    for (Py_ssize_t i = f->height - n; i < f->height; i++)
        if (f->stack[i].role != R_NONE) DECLINE(f, "a container the filter edits is used otherwise");
    f->height -= n;
    return 1;
}

/* The innermost mark taken off (with the slots above it, which the caller has looked at). */
static int take_mark(Filter *f, Py_ssize_t *height, Py_ssize_t *pos, Py_ssize_t *memo0, int *candidate) {
    if (f->n_marks == 0) DECLINE(f, "no mark");
    Mark *m = &f->marks[--f->n_marks];
    *height = m->height;
    *pos = m->pos;
    *memo0 = m->memo0;
    *candidate = m->candidate;
    if (m->candidate) f->cand_mark = -1;
    return 1;
}

/* A string opcode at p: its info (name, kept or not, the repointed key, a data file). */
static int string_info(Filter *f, Py_ssize_t p, uint32_t *info) {
    const unsigned char *buf = f->base;
    unsigned char op = buf[p];
    Py_ssize_t width = op == 0x8c ? 1 : op == 'X' ? 4 : 8;
    const unsigned char *s = buf + p + 1 + width;
    Py_ssize_t n = op == 0x8c ? buf[p + 1] : op == 'X' ? (Py_ssize_t)read_u32(buf + p + 1)
                                                      : (Py_ssize_t)read_u64(buf + p + 1);
    uint32_t bits = M_STR | (uint32_t)name_of(s, n);
    bits |= hashset_contains(&f->keep, hash_bytes(s, n)) ? M_KEPT : M_DROP;
    if (f->repoint_key != NULL && n == f->repoint_key_len && memcmp(s, f->repoint_key, (size_t)n) == 0)
        bits |= M_REPOINT;
    if (n > 7 && memcmp(s + n - 7, ".distcp", 7) == 0) {
        Py_ssize_t id = byteset_add(&f->files, s, n);
        if (id < 0) return -1;
        if ((uint64_t)id > M_FILE_MAX) DECLINE(f, "too many data files");
        bits |= (uint32_t)id << M_FILE_SHIFT;
    }
    *info = bits;
    return 1;
}

/* The role a fresh dict or list pushed at index i takes from what is below it (see the file's comment). */
static int role_at_push(Filter *f, Py_ssize_t i, int kind, uint8_t *state_of) {
    Py_ssize_t mh = mark_height(f);
    *state_of = C_NONE;
    if (kind == S_DICT && i >= 1 && mh < i) {
        const Slot *below = &f->stack[i - 1];
        if (below->kind == S_OBJ && below->fresh && our_class(below->cls)) {
            *state_of = below->cls;
            return R_STATE;
        }
    }
    const Slot *parent = NULL;
    if (mh >= 1 && mh <= i - 1 && (i - mh) % 2 == 1)
        parent = &f->stack[mh - 1]; /* a value in a batch: the key below it, the mark below that */
    else if (i >= 2 && mh <= i - 2)
        parent = &f->stack[i - 2]; /* a value of a single SETITEM */
    if (parent == NULL || parent->kind != S_DICT || parent->role != R_STATE) return R_NONE;
    const Slot *key = &f->stack[i - 1];
    if (key->kind != S_STR) return R_NONE;
    int name = (int)(key->info & M_NAME_MASK);
    if (parent->state_of == C_METADATA) {
        if (kind == S_DICT && name == N_F_SDM) return R_SDM;
        if (kind == S_DICT && name == N_F_STORAGE_DATA) return R_SD;
        if (kind == S_DICT && name == N_F_PLANNER_DATA) return R_PD;
        if (kind == S_DICT && name == N_F_MCORE_DATA) return R_MCORE;
        if (kind == S_LIST && name == N_F_ALL_LOCAL_PLANS) return R_PLANS;
    } else if (parent->state_of == C_PLAN) {
        if (kind == S_LIST && name == N_F_ITEMS) return R_PLAN_ITEMS;
        if (kind == S_DICT && name == N_F_MCORE_DATA) return R_MCORE;
    }
    return R_NONE;
}

static int add_edit(Filter *f, int kind, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t kept, int field) {
    GROW(f->edits, f->n_edits, f->edits_cap);
    Edit *e = &f->edits[f->n_edits++];
    e->kind = (uint8_t)kind;
    e->pos = (uint32_t)pos;
    e->end = (uint32_t)end;
    e->kept = (int32_t)kept;
    e->field = (uint8_t)field;
    return 1;
}

/* An edit of a plain value: in place, or (where the value was also written to the memo, whose readers must get
 * the old one) popped after its memo write and the new one pushed. kept: the kept storage item whose new offset
 * it writes, or -1 and field: which of the repointed item's values. */
static int edit_value(Filter *f, const Span *span, int is_str, Py_ssize_t kept, int field) {
    if (span->memo_end)
        return add_edit(f, is_str ? E_STR_AFTER : E_INT_AFTER, span->memo_end, span->memo_end, kept, field);
    return add_edit(f, is_str ? E_STR : E_INT, span->start, span->end, kept, field);
}

/* The fields of a MetadataIndex, _StorageInfo or WriteItem state dict from one key and value. */
static int state_field(Filter *f, Slot *state, const Slot *key, const Slot *value) {
    if (key->kind != S_STR) return 1; /* not a field the filter reads (the class's own BUILD would tell) */
    int name = (int)(key->info & M_NAME_MASK);
    Span span = {value->start, value->end, value->memo_end};
    switch (state->state_of) {
        case C_MINDEX:
            if (name != N_F_FQN) return 1;
            if (value->kind != S_STR || (state->info & M_KEY_BITS)) DECLINE(f, "a MetadataIndex fqn is not a string");
            state->info |= value->info & M_KEY_BITS;
            return 1;
        case C_WITEM:
            if (name != N_F_INDEX) return 1;
            if (!(value->info & M_MINDEX) || (state->info & M_KEY_BITS)) DECLINE(f, "a WriteItem index is not known");
            state->info |= value->info & M_KEY_BITS;
            return 1;
        case C_SINFO:
            if (name == N_F_RELATIVE_PATH) {
                if (state->have & 1) DECLINE(f, "a storage field twice");
                state->have |= 1;
                state->file = value->kind == S_STR ? (int32_t)(value->info >> M_FILE_SHIFT) : 0;
                state->path_span = span;
            } else if (name == N_F_OFFSET || name == N_F_LENGTH) {
                int bit = name == N_F_OFFSET ? 2 : 4;
                if (state->have & bit) DECLINE(f, "a storage field twice");
                if (value->kind != S_INT || !value->int_ok || !value->fresh || value->ival < 0) {
                    state->have |= 8; /* not a plain int: never edited */
                    return 1;
                }
                state->have |= (uint8_t)bit;
                if (name == N_F_OFFSET) {
                    state->offset = value->ival;
                    state->offset_span = span;
                } else {
                    state->length = value->ival;
                    state->length_span = span;
                }
            }
            return 1;
        default:
            return 1;
    }
}

/* The value of one attribute of the Metadata object or a SavePlan: a container the filter edits must be the one
 * made for it (or None where the attribute may be None). */
static int attribute_value(Filter *f, const Slot *state, const Slot *key, const Slot *value) {
    if (key->kind != S_STR) DECLINE(f, "an attribute name is not a string");
    int name = (int)(key->info & M_NAME_MASK), want = R_NONE, may_be_none = 1;
    if (state->state_of == C_METADATA) {
        want = name == N_F_SDM ? R_SDM : name == N_F_STORAGE_DATA ? R_SD : name == N_F_PLANNER_DATA ? R_PD
             : name == N_F_MCORE_DATA ? R_MCORE : name == N_F_ALL_LOCAL_PLANS ? R_PLANS : R_NONE;
        may_be_none = want != R_SDM && want != R_SD;
    } else {
        want = name == N_F_ITEMS ? R_PLAN_ITEMS : name == N_F_MCORE_DATA ? R_MCORE : R_NONE;
    }
    if (want == R_NONE) {
        if (value->role != R_NONE) DECLINE(f, "a container the filter edits is used otherwise");
        return 1;
    }
    if (value->kind == S_NONE && may_be_none) return 1;
    if (value->role != want || !value->fresh) DECLINE(f, "a container the filter edits is not a plain one");
    if (want == R_SDM) f->n_sdm++;
    if (want == R_SD) f->n_sd++;
    return 1;
}

/* Whether the item whose first slot is s is kept: 1 kept, 0 left out; -2 to decline. */
static int item_kept(int role, const Slot *s) {
    uint32_t bits = s->info & (M_KEPT | M_DROP);
    switch (role) {
        case R_SDM: case R_PD: case R_MCORE:
            if (s->kind != S_STR || !bits) return -2;
            return (bits & M_KEPT) != 0;
        case R_SD:
            if (!(s->info & M_MINDEX) || !bits) return -2;
            return (bits & M_KEPT) != 0;
        case R_PLAN_ITEMS:
            if (s->kind != S_OBJ || s->cls != C_WITEM || !s->fresh || !bits) return -2;
            return (bits & M_KEPT) != 0;
        default:
            return -2;
    }
}

/* A kept storage item's value: its new place (compacted, or the repointed key's new file) as edits. */
static int storage_edits(Filter *f, const Slot *key, const Slot *value) {
    int repoint = (key->info & M_REPOINT) != 0;
    if (!repoint && !f->compact) return 1;
    if (value->kind != S_OBJ || value->cls != C_SINFO || !value->fresh || value->have != 7)
        DECLINE(f, "a kept storage item is not a plain _StorageInfo");
    if (repoint) {
        f->n_repointed++;
        if (edit_value(f, &value->path_span, 1, -1, 1) <= 0 || edit_value(f, &value->offset_span, 0, -1, 2) <= 0 ||
            edit_value(f, &value->length_span, 0, -1, 4) <= 0)
            return PyErr_Occurred() ? -1 : 0;
        return 1;
    }
    if (value->file <= 0) DECLINE(f, "a kept storage item's file is not a .distcp name");
    GROW(f->kept, f->n_kept, f->kept_cap);
    KeptStorage *k = &f->kept[f->n_kept++];
    k->file = value->file;
    k->offset = value->offset;
    k->length = value->length;
    return edit_value(f, &value->offset_span, 0, f->n_kept - 1, 0);
}

/* The items of one batch (or one SETITEM / APPEND) into a container the filter edits: slots [first, height)
 * of the stack, w per item; the opcode taking them at op; memo entries written so far: memo_now. */
static int filter_items(Filter *f, int role, Py_ssize_t first, int w, Py_ssize_t op, int single, Py_ssize_t memo_now) {
    Py_ssize_t n = (f->height - first) / w;
    if ((f->height - first) % w) DECLINE(f, "an odd number of items");
    Py_ssize_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t)); /* item -> dropped id, -1 kept */
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int r = 1;
    for (Py_ssize_t i = 0; i < n && r > 0; i++) {
        Py_ssize_t j = first + i * w, next = j + w;
        const Slot *s = &f->stack[j];
        int kept = item_kept(role, s);
        if (kept == -2) {
            f->why = "an item of a container the filter edits names no known key";
            r = 0;
            break;
        }
        if (role == R_SDM) kept ? f->sdm_kept++ : f->sdm_dropped++;
        if (role == R_SD) kept ? f->sd_kept++ : f->sd_dropped++;
        if (!kept && role != R_SDM && role != R_SD) f->other_dropped++;
        ids[i] = -1;
        if (kept) {
            if (role == R_SD) r = storage_edits(f, s, &f->stack[j + 1]);
            continue;
        }
        if (grow((void **)&f->dropped, f->n_dropped, &f->dropped_cap, sizeof(Dropped)) < 0) {
            r = -1;
            break;
        }
        Dropped *d = &f->dropped[f->n_dropped];
        d->start = s->start;
        d->end = next < f->height ? f->stack[next].start : op;
        d->single = single ? (uint32_t)op : UINT32_MAX;
        d->memo0 = s->memo0;
        d->memo1 = next < f->height ? f->stack[next].memo0 : memo_now;
        d->pops = (uint8_t)w;
        d->live = 0;
        ids[i] = f->n_dropped++;
    }
    /* reads made inside the batch: of entries of its own items, or of items left out before */
    for (Py_ssize_t q = 0; r > 0 && q < f->n_pending; q++) {
        const PendingRead *pr = &f->pending[q];
        Py_ssize_t lo = 0, hi = n; /* the reader: the last item starting at or before pos */
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (f->stack[first + mid * w].start <= pr->pos) lo = mid + 1; else hi = mid;
        }
        Py_ssize_t reader = lo - 1, reader_id = reader >= 0 ? ids[reader] : -1, writer_id = pr->item;
        if (writer_id < 0) { /* an entry written in this batch: by the last item whose memo range starts at or before */
            lo = 0, hi = n;
            while (lo < hi) {
                Py_ssize_t mid = (lo + hi) / 2;
                if (f->stack[first + mid * w].memo0 <= pr->entry) lo = mid + 1; else hi = mid;
            }
            if (lo - 1 == reader || lo - 1 < 0) continue;
            writer_id = ids[lo - 1];
        }
        if (writer_id < 0) continue; /* kept: its entries stay */
        if (reader_id < 0) {
            f->dropped[writer_id].live = 1;
        } else {
            if (grow((void **)&f->edges, f->n_edges + 1, &f->edges_cap, sizeof(Py_ssize_t)) < 0) {
                r = -1;
                break;
            }
            f->edges[f->n_edges++] = reader_id;
            f->edges[f->n_edges++] = writer_id;
        }
    }
    f->n_pending = 0;
    PyMem_Free(ids);
    return r;
}

/* An item assignment (SETITEMS, SETITEM, APPENDS, APPEND, ADDITEMS) of the slots [first, height) into the slot at
 * target; the slots are then taken off. */
static int assign_items(Filter *f, Py_ssize_t target, Py_ssize_t first, int w, Py_ssize_t op, int single,
                        Py_ssize_t memo_now) {
    if (target < 0) DECLINE(f, "an item assignment without a container");
    Slot *t = &f->stack[target];
    if (!t->fresh && (t->info & M_GUARDED)) DECLINE(f, "a container the filter edits is changed through a memo read");
    int r = 1;
    if (is_filtered_role(t->role)) {
        r = filter_items(f, t->role, first, w, op, single, memo_now);
    } else if (t->role == R_STATE && w == 2) {
        for (Py_ssize_t j = first; r > 0 && j + 1 < f->height; j += 2) {
            const Slot *key = &f->stack[j], *value = &f->stack[j + 1];
            if (key->role != R_NONE) DECLINE(f, "a container the filter edits is used otherwise");
            if (t->state_of == C_METADATA || t->state_of == C_PLAN)
                r = attribute_value(f, t, key, value);
            else if (value->role != R_NONE)
                DECLINE(f, "a container the filter edits is used otherwise");
            else
                r = state_field(f, t, key, value);
        }
        if (r > 0) f->height = first;
        return r;
    }
    if (r <= 0) return r;
    return take(f, f->height - first);
}

/* BUILD: the state (top) applied to the object below it. */
static int build(Filter *f) {
    if (f->height < 2 || f->height - 1 <= mark_height(f)) DECLINE(f, "BUILD without an object");
    Slot *state = &f->stack[f->height - 1], *target = &f->stack[f->height - 2];
    if (!target->fresh) DECLINE(f, "an object is changed through a memo read");
    if (state->role == R_STATE && state->state_of != target->cls) DECLINE(f, "a state dict built onto another object");
    if (target->kind == S_OBJ && our_class(target->cls)) {
        if (state->role != R_STATE || (target->info & (M_KEY_BITS | M_MINDEX)) || target->have)
            DECLINE(f, "an object the filter reads is not built from one plain state dict");
        if (target->cls == C_METADATA) f->n_meta++;
        if (target->cls == C_MINDEX) target->info |= M_MINDEX;
        if (target->cls == C_MINDEX || target->cls == C_WITEM) target->info |= state->info & M_KEY_BITS;
        if (target->cls == C_SINFO) {
            target->have = state->have;
            target->file = state->file;
            target->offset = state->offset;
            target->length = state->length;
            target->path_span = state->path_span;
            target->offset_span = state->offset_span;
            target->length_span = state->length_span;
        }
        if (target->memo >= 0) f->memo_info[target->memo] |= target->info & (M_MINDEX | M_KEY_BITS);
    } else if (state->role != R_NONE) {
        DECLINE(f, "a container the filter edits is used otherwise");
    }
    f->height--;
    return 1;
}

/* A memo read of idx at p: what the entry holds, and whether an item left out must stay as garbage. */
static int memo_read(Filter *f, Py_ssize_t idx, Py_ssize_t p, Py_ssize_t end, Py_ssize_t memo) {
    if (idx >= memo) DECLINE(f, "a memo read of an entry not written");
    uint32_t info = f->memo_info[idx];
    Slot s = new_slot(S_OTHER, p, end, memo);
    s.fresh = 0;
    s.info = info;
    if (info & M_STR) s.kind = S_STR;
    else if (info & M_CLASS) s.kind = S_CLASS, s.cls = (uint8_t)(info & M_NAME_MASK);
    else if (info & M_MINDEX) s.kind = S_OBJ, s.cls = C_MINDEX;
    Py_ssize_t item = f->n_dropped ? dropped_of_entry(f, idx) : -1;
    int in_batch = f->cand_mark >= 0;
    if (item >= 0 || (in_batch && idx >= f->marks[f->cand_mark].memo0)) {
        if (in_batch) {
            GROW(f->pending, f->n_pending, f->pending_cap);
            PendingRead *pr = &f->pending[f->n_pending++];
            pr->pos = p;
            pr->entry = idx;
            pr->item = item;
        } else {
            f->dropped[item].live = 1;
        }
    }
    return push(f, &s);
}

static int pass1(Filter *f) {
    Py_ssize_t p = 0, memo = 0;
    f->cand_mark = -1;
    while (p < f->src.size) {
        Py_ssize_t end;
        int kind = next_op(f, p, &end);
        if (kind == -2) return -1;
        if (kind == OP_REFUSE) DECLINE(f, "an opcode the filter does not take");
        const unsigned char *buf = f->base;
        unsigned char op = buf[p];
        if (p == 0 && op != 0x80) DECLINE(f, "not a protocol 2+ pickle"); /* no PROTO: protocol 0 or 1 */
        Slot s = new_slot(S_OTHER, p, end, memo);
        int r = 1;
        Py_ssize_t mh, mpos, mmemo;
        int cand;
        switch (op) {
            case 0x80: /* PROTO */
                if (p != 0 || buf[p + 1] < 2) DECLINE(f, "not a protocol 2+ pickle");
                f->proto = buf[p + 1];
                break;
            case 0x95: /* FRAME */
                break;
            case '.':
                if (f->height != 1 || f->n_marks) DECLINE(f, "STOP with more than one object");
                f->size = end; /* bytes after the STOP are not copied */
                f->n_memo = memo;
                return 1;
            case '(': { /* MARK: a batch into a container the filter edits, when right above one */
                GROW(f->marks, f->n_marks, f->marks_cap);
                Mark *m = &f->marks[f->n_marks];
                m->height = f->height;
                m->pos = p;
                m->memo0 = memo;
                m->candidate = f->height > 0 && f->stack[f->height - 1].fresh &&
                               is_filtered_role(f->stack[f->height - 1].role) && mark_height(f) < f->height;
                if (m->candidate) {
                    if (f->cand_mark >= 0) DECLINE(f, "nested batches");
                    f->cand_mark = f->n_marks;
                }
                f->n_marks++;
                break;
            }
            case '0': r = take(f, 1); break;
            case '1':
                r = take(f, f->height - mark_height(f));
                if (r > 0) r = take_mark(f, &mh, &mpos, &mmemo, &cand);
                if (r > 0 && cand) DECLINE(f, "a batch popped");
                break;
            case '2':
                if (f->height == 0 || f->height <= mark_height(f)) DECLINE(f, "DUP without an object");
                s = f->stack[f->height - 1];
                if (s.role != R_NONE) DECLINE(f, "a container the filter edits is used otherwise");
                s.fresh = 0;
                s.start = p;
                s.end = end;
                s.memo0 = memo;
                s.memo = -1;
                s.memo_end = 0;
                r = push(f, &s);
                break;
            case 'N': s.kind = S_NONE; r = push(f, &s); break;
            case 'K': s.kind = S_INT, s.int_ok = 1, s.ival = buf[p + 1]; r = push(f, &s); break;
            case 'M': s.kind = S_INT, s.int_ok = 1, s.ival = buf[p + 1] | (buf[p + 2] << 8); r = push(f, &s); break;
            case 'J': s.kind = S_INT, s.int_ok = 1, s.ival = read_i32(buf + p + 1); r = push(f, &s); break;
            case 0x8a: { /* LONG1 */
                Py_ssize_t n = buf[p + 1];
                s.kind = S_INT;
                if (n <= 8) {
                    uint64_t v = 0;
                    for (Py_ssize_t i = 0; i < n; i++) v |= (uint64_t)buf[p + 2 + i] << (8 * i);
                    if (n > 0 && n < 8 && (buf[p + 1 + n] & 0x80)) v |= ~(uint64_t)0 << (8 * n);
                    s.ival = (int64_t)v;
                    s.int_ok = 1;
                }
                r = push(f, &s);
                break;
            }
            case 0x8c: case 'X': case 0x8d:
                s.kind = S_STR;
                r = string_info(f, p, &s.info);
                if (r > 0) r = push(f, &s);
                break;
            case '}': case ']': {
                s.kind = op == '}' ? S_DICT : S_LIST;
                s.role = (uint8_t)role_at_push(f, f->height, s.kind, &s.state_of);
                if (s.role == R_SDM || s.role == R_SD) s.info |= M_GUARDED;
                r = push(f, &s);
                break;
            }
            case 'c': { /* GLOBAL module\nname\n */
                const unsigned char *a = buf + p + 1, *nl = memchr(a, '\n', (size_t)(end - p - 1));
                s.kind = S_CLASS;
                s.cls = (uint8_t)class_of(name_of(a, nl - a), name_of(nl + 1, buf + end - 1 - (nl + 1)));
                s.info = M_CLASS | s.cls;
                r = push(f, &s);
                break;
            }
            case 0x93: { /* STACK_GLOBAL */
                if (f->height < 2 || f->height - 2 < mark_height(f)) DECLINE(f, "stack underflow");
                const Slot *module = &f->stack[f->height - 2], *name = &f->stack[f->height - 1];
                int cls = module->kind == S_STR && name->kind == S_STR
                              ? class_of((int)(module->info & M_NAME_MASK), (int)(name->info & M_NAME_MASK))
                              : C_OTHER;
                s.start = module->start;
                s.memo0 = module->memo0;
                r = take(f, 2);
                s.kind = S_CLASS;
                s.cls = (uint8_t)cls;
                s.info = M_CLASS | (uint32_t)cls;
                if (r > 0) r = push(f, &s);
                break;
            }
            case 'h': case 'j': {
                Py_ssize_t idx = op == 'h' ? buf[p + 1] : (Py_ssize_t)read_u32(buf + p + 1);
                r = memo_read(f, idx, p, end, memo);
                break;
            }
            case 0x94: case 'q': case 'r': {
                if (op != 0x94 && (op == 'q' ? buf[p + 1] : (Py_ssize_t)read_u32(buf + p + 1)) != memo)
                    DECLINE(f, "a memo write out of sequence");
                if (f->height == 0 || f->height <= mark_height(f)) DECLINE(f, "a memo write of nothing");
                if (memo >= (Py_ssize_t)UINT32_MAX - 1) DECLINE(f, "too many memo entries");
                GROW(f->memo_info, memo, f->memo_cap);
                Slot *top = &f->stack[f->height - 1];
                uint32_t info = top->info;
                if (top->role != R_NONE || (top->kind == S_OBJ && our_class(top->cls))) info |= M_GUARDED;
                f->memo_info[memo] = info;
                if (top->memo < 0) top->memo = memo;
                top->memo_end = end;
                memo++;
                break;
            }
            case 't': case 'l': case 'd': case 0x91: case 'o': { /* from the slots above the mark */
                mh = mark_height(f);
                if (mh < 0) DECLINE(f, "no mark");
                if (op == 'o' && (mh >= f->height || (f->stack[mh].kind == S_CLASS && our_class(f->stack[mh].cls))))
                    DECLINE(f, "OBJ of a class the filter reads");
                r = take(f, f->height - mh);
                if (r > 0) r = take_mark(f, &mh, &mpos, &mmemo, &cand);
                if (r > 0 && cand) DECLINE(f, "a batch taken otherwise");
                s.start = mpos;
                s.memo0 = mmemo;
                if (r > 0) r = push(f, &s);
                break;
            }
            case 'i': { /* INST module\nname\n, arguments above the mark */
                const unsigned char *a = buf + p + 1, *nl = memchr(a, '\n', (size_t)(end - p - 1));
                if (our_class(class_of(name_of(a, nl - a), name_of(nl + 1, buf + end - 1 - (nl + 1)))))
                    DECLINE(f, "INST of a class the filter reads");
                mh = mark_height(f);
                if (mh < 0) DECLINE(f, "no mark");
                r = take(f, f->height - mh);
                if (r > 0) r = take_mark(f, &mh, &mpos, &mmemo, &cand);
                if (r > 0 && cand) DECLINE(f, "a batch taken otherwise");
                s.start = mpos;
                s.memo0 = mmemo;
                if (r > 0) r = push(f, &s);
                break;
            }
            case 0x85: case 0x86: case 0x87: case 'R': case 0x81: case 0x92: case 'Q': {
                Py_ssize_t n = op == 0x85 || op == 'Q' ? 1 : op == 0x86 || op == 'R' || op == 0x81 ? 2 : 3;
                if (f->height < n || f->height - n < mark_height(f)) DECLINE(f, "stack underflow");
                const Slot *lowest = &f->stack[f->height - n];
                s.start = lowest->start;
                s.memo0 = lowest->memo0;
                if (op == 'R' || op == 0x92) {
                    if (lowest->kind == S_CLASS && our_class(lowest->cls)) DECLINE(f, "a class the filter reads called");
                } else if (op == 0x81 && lowest->kind == S_CLASS) {
                    s.kind = S_OBJ;
                    s.cls = lowest->cls;
                }
                r = take(f, n);
                if (r > 0) r = push(f, &s);
                break;
            }
            case 'a': /* APPEND */
                if (f->height < 2 || f->height - 2 < mark_height(f)) DECLINE(f, "stack underflow");
                r = assign_items(f, f->height - 2, f->height - 1, 1, p, 1, memo);
                break;
            case 's': /* SETITEM */
                if (f->height < 3 || f->height - 3 < mark_height(f)) DECLINE(f, "stack underflow");
                r = assign_items(f, f->height - 3, f->height - 2, 2, p, 1, memo);
                break;
            case 'e': case 'u': case 0x90: { /* APPENDS, SETITEMS, ADDITEMS */
                mh = mark_height(f);
                if (mh < 1) DECLINE(f, "a batch without a container");
                int batch_candidate = f->marks[f->n_marks - 1].candidate;
                if (op == 0x90 && batch_candidate) DECLINE(f, "ADDITEMS into a container the filter edits");
                r = assign_items(f, mh - 1, mh, op == 'u' ? 2 : 1, p, 0, memo);
                if (r > 0) r = take_mark(f, &mh, &mpos, &mmemo, &cand);
                break;
            }
            case 'b': r = build(f); break;
            default: /* every other opcode prune_op takes pushes one object */
                r = push(f, &s);
                break;
        }
        if (r <= 0) return r;
        p = end;
    }
    DECLINE(f, "no STOP");
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* Between the passes: which items stay as garbage, the compacted layout and its check against the caller's. */

static void settle_liveness(Filter *f) {
    /* edges (reader, writer), appended in reader order, writers before their readers: one backward sweep */
    for (Py_ssize_t e = f->n_edges - 2; e >= 0; e -= 2)
        if (f->dropped[f->edges[e]].live) f->dropped[f->edges[e + 1]].live = 1;
}

static int cmp_kept(const void *a, const void *b) {
    const KeptStorage *x = *(const KeptStorage *const *)a, *y = *(const KeptStorage *const *)b;
    if (x->file != y->file) return x->file < y->file ? -1 : 1;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->length != y->length) return x->length < y->length ? -1 : 1;
    return x < y ? -1 : x > y ? 1 : 0;
}

static int cmp_edit(const void *a, const void *b) {
    const Edit *x = a, *y = b;
    return x->pos < y->pos ? -1 : x->pos > y->pos ? 1 : 0;
}

/* The name of a file id, as a str (new reference). */
static PyObject *file_name(const Filter *f, int32_t id) {
    for (Py_ssize_t i = 0; i < f->files.cap; i++) {
        Py_ssize_t at = f->files.slots[i];
        if (at == 0) continue;
        const char *e = f->files.arena + at - 1;
        Py_ssize_t len, eid;
        memcpy(&len, e, sizeof(len));
        memcpy(&eid, e + sizeof(len), sizeof(eid));
        if (eid == id) return PyUnicode_DecodeUTF8(e + 2 * sizeof(Py_ssize_t), len, "surrogatepass");
    }
    return PyUnicode_FromString("");
}

/* Each data file's kept items back to back, in (offset, length) order; checked against expected: {file name:
 * bytes of the kept (offset, length) pairs, int64 native, in that order}. 1, 0 (declined), -1. */
static int compact_layout(Filter *f, PyObject *expected, PyObject *sizes) {
    KeptStorage **order = PyMem_Malloc((size_t)(f->n_kept ? f->n_kept : 1) * sizeof(KeptStorage *));
    if (order == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < f->n_kept; i++) order[i] = &f->kept[i];
    qsort(order, (size_t)f->n_kept, sizeof(KeptStorage *), cmp_kept);
    int r = 1;
    Py_ssize_t files_seen = 0;
    for (Py_ssize_t i = 0; i < f->n_kept && r > 0;) {
        int32_t file = order[i]->file;
        Py_ssize_t j = i;
        int64_t position = 0;
        PyObject *name = file_name(f, file);
        PyObject *want = name != NULL ? PyDict_GetItemWithError(expected, name) : NULL;
        if (want == NULL || !PyBytes_Check(want)) {
            if (!PyErr_Occurred()) {
                f->why = "a data file's kept items differ from the plan";
                r = 0;
            } else {
                r = -1;
            }
            Py_XDECREF(name);
            break;
        }
        const int64_t *pairs = (const int64_t *)PyBytes_AS_STRING(want);
        Py_ssize_t n_pairs = PyBytes_GET_SIZE(want) / (Py_ssize_t)(2 * sizeof(int64_t));
        for (; j < f->n_kept && order[j]->file == file; j++) {
            Py_ssize_t k = j - i;
            if (k >= n_pairs || pairs[2 * k] != order[j]->offset || pairs[2 * k + 1] != order[j]->length) {
                f->why = "a data file's kept items differ from the plan";
                r = 0;
                break;
            }
            order[j]->offset = position; /* compared above: from here on the new offset */
            position += order[j]->length;
        }
        if (r > 0 && j - i != n_pairs) {
            f->why = "a data file's kept items differ from the plan";
            r = 0;
        }
        if (r > 0) {
            PyObject *size = PyLong_FromLongLong(position);
            if (size == NULL || PyDict_SetItem(sizes, name, size) < 0) r = -1;
            Py_XDECREF(size);
        }
        Py_DECREF(name);
        files_seen++;
        i = j;
    }
    if (r > 0 && files_seen != PyDict_GET_SIZE(expected)) {
        f->why = "a data file's kept items differ from the plan";
        r = 0;
    }
    PyMem_Free(order);
    return r;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* Pass 2: the bytes written again. */

#define FRAME_TARGET (64 * 1024)

typedef struct {
    int fd;
    int framed;
    unsigned char *frame; /* the open frame's bytes */
    Py_ssize_t frame_len;
    unsigned char *out;   /* bytes ready for the file */
    Py_ssize_t out_len, out_cap;
    Py_ssize_t written;
} Out;

static int out_flush(Out *o) {
    Py_ssize_t done = 0;
    while (done < o->out_len) {
        ssize_t n = write(o->fd, o->out + done, (size_t)(o->out_len - done));
        if (n < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) return -1;
                continue;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        done += n;
    }
    o->written += o->out_len;
    o->out_len = 0;
    return 0;
}

static int out_raw(Out *o, const unsigned char *b, Py_ssize_t n) {
    if (o->out_len + n > o->out_cap) {
        if (out_flush(o) < 0) return -1;
        if (n > o->out_cap) { /* a large opcode: straight to the file */
            unsigned char *keep = o->out;
            o->out = (unsigned char *)b;
            o->out_len = n;
            int r = out_flush(o);
            o->out = keep;
            return r;
        }
    }
    memcpy(o->out + o->out_len, b, (size_t)n);
    o->out_len += n;
    return 0;
}

static int frame_commit(Out *o) {
    if (o->frame_len == 0) return 0;
    unsigned char header[9] = {0x95};
    for (int i = 0; i < 8; i++) header[1 + i] = (unsigned char)((uint64_t)o->frame_len >> (8 * i));
    if (out_raw(o, header, 9) < 0 || out_raw(o, o->frame, o->frame_len) < 0) return -1;
    o->frame_len = 0;
    return 0;
}

/* One opcode's bytes (never split across frames). */
static int emit(Out *o, const unsigned char *b, Py_ssize_t n) {
    if (!o->framed) return out_raw(o, b, n);
    if (o->frame_len > 0 && o->frame_len + n > FRAME_TARGET && frame_commit(o) < 0) return -1;
    if (n > FRAME_TARGET) return out_raw(o, b, n); /* as Python's pickler writes a large object: outside frames */
    memcpy(o->frame + o->frame_len, b, (size_t)n);
    o->frame_len += n;
    return 0;
}

static Py_ssize_t int_opcode(int64_t v, unsigned char *o) {
    if (v >= 0 && v < 256) {
        o[0] = 'K';
        o[1] = (unsigned char)v;
        return 2;
    }
    if (v >= 0 && v < 65536) {
        o[0] = 'M';
        o[1] = (unsigned char)(v & 255);
        o[2] = (unsigned char)(v >> 8);
        return 3;
    }
    if (v >= INT32_MIN && v <= INT32_MAX) {
        uint32_t u = (uint32_t)(int32_t)v;
        o[0] = 'J';
        for (int i = 0; i < 4; i++) o[1 + i] = (unsigned char)(u >> (8 * i));
        return 5;
    }
    uint64_t u = (uint64_t)v;
    unsigned char bytes[8];
    for (int i = 0; i < 8; i++) bytes[i] = (unsigned char)(u >> (8 * i));
    int n = 8;
    while (n > 1 && ((bytes[n - 1] == 0 && !(bytes[n - 2] & 0x80)) || (bytes[n - 1] == 0xff && (bytes[n - 2] & 0x80))))
        n--;
    o[0] = 0x8a;
    o[1] = (unsigned char)n;
    memcpy(o + 2, bytes, (size_t)n);
    return 2 + n;
}

static int emit_memo_op(Out *o, unsigned char small, unsigned char large, uint32_t idx) {
    unsigned char b[5];
    if (idx < 256) {
        b[0] = small;
        b[1] = (unsigned char)idx;
        return emit(o, b, 2);
    }
    b[0] = large;
    for (int i = 0; i < 4; i++) b[1 + i] = (unsigned char)(idx >> (8 * i));
    return emit(o, b, 5);
}

/* An edit's new value (after a POP of the old one for the *_AFTER kinds). */
static int emit_edit(Filter *f, Out *o, const Edit *e) {
    unsigned char b[16];
    Py_ssize_t n = 0;
    if (e->kind == E_INT_AFTER || e->kind == E_STR_AFTER) b[n++] = '0';
    if (e->kind == E_STR || e->kind == E_STR_AFTER) {
        Py_ssize_t len = PyBytes_GET_SIZE(f->repoint_path);
        if (n && emit(o, b, n) < 0) return -1;
        n = 0;
        unsigned char *s = PyMem_Malloc((size_t)len + 5);
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s[0] = 'X';
        for (int i = 0; i < 4; i++) s[1 + i] = (unsigned char)((uint32_t)len >> (8 * i));
        memcpy(s + 5, PyBytes_AS_STRING(f->repoint_path), (size_t)len);
        int r = emit(o, s, len + 5);
        PyMem_Free(s);
        return r;
    }
    int64_t value = e->kept >= 0 ? f->kept[e->kept].offset : e->field == 4 ? f->repoint_length : 0;
    n += int_opcode(value, b + n);
    return emit(o, b, n);
}

/* 0 written; 1 declined (f->why: what pass 1 found is not there: the file changed); -1 with a Python error. */
static int pass2(Filter *f, Out *o) {
    uint32_t *map = f->memo_info; /* reused: old memo entry -> new one */
    Py_ssize_t p = 0, old = 0, di = 0, ei = 0, pops_at = -1, skip_single = -1;
    uint32_t fresh_memo = 0;
    int pops = 0;
    while (p < f->size) {
        if (p == pops_at) { /* the end of an item kept as garbage: its objects popped, not assigned */
            unsigned char pop[2] = {'0', '0'};
            if (emit(o, pop, pops) < 0) return -1;
            pops_at = -1;
            if (skip_single >= 0) {
                p = skip_single + 1;
                skip_single = -1;
                continue;
            }
        }
        if (di < f->n_dropped && f->dropped[di].start == p) {
            const Dropped *d = &f->dropped[di++];
            if (!d->live) {
                if (old != d->memo0 || d->memo1 > f->n_memo) {
                    f->why = "the second pass met other memo writes than the first";
                    return 1;
                }
                for (Py_ssize_t e = d->memo0; e < d->memo1; e++) map[e] = UINT32_MAX;
                old = d->memo1;
                p = d->single != UINT32_MAX ? (Py_ssize_t)d->single + 1 : (Py_ssize_t)d->end;
                continue;
            }
            pops_at = d->end;
            pops = d->pops;
            skip_single = d->single != UINT32_MAX ? (Py_ssize_t)d->single : -1;
        }
        if (ei < f->n_edits && f->edits[ei].pos == p) {
            const Edit *e = &f->edits[ei++];
            if (emit_edit(f, o, e) < 0) return -1;
            if (e->kind == E_INT || e->kind == E_STR) {
                p = e->end;
                continue;
            }
        }
        Py_ssize_t end;
        int kind = next_op(f, p, &end);
        if (kind == -2) return -1;
        const unsigned char *buf = f->base;
        unsigned char op = buf[p];
        if (kind == OP_REFUSE) {
            f->why = "the second pass met an opcode the first did not";
            return 1;
        }
        if (op == 0x95) { /* FRAME: rebuilt */
        } else if (op == 0x94 || op == 'q' || op == 'r') {
            if (old >= f->n_memo) {
                f->why = "the second pass met more memo writes than the first";
                return 1;
            }
            map[old++] = fresh_memo;
            if (op == 0x94) {
                if (emit(o, &op, 1) < 0) return -1;
            } else if (emit_memo_op(o, 'q', 'r', fresh_memo) < 0) {
                return -1;
            }
            fresh_memo++;
        } else if (op == 'h' || op == 'j') {
            Py_ssize_t idx = op == 'h' ? buf[p + 1] : (Py_ssize_t)read_u32(buf + p + 1);
            if (idx >= old || map[idx] == UINT32_MAX) {
                f->why = "the second pass met a read of an entry left out";
                return 1;
            }
            if (emit_memo_op(o, 'h', 'j', map[idx]) < 0) return -1;
        } else if (op == 0x80) {
            if (out_raw(o, buf + p, end - p) < 0) return -1; /* PROTO: before the first frame */
        } else if (emit(o, buf + p, end - p) < 0) {
            return -1;
        }
        p = end;
    }
    if (frame_commit(o) < 0 || out_flush(o) < 0) return -1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------- */

static PyObject *declined(const char *why) { return Py_BuildValue("{s:s}", "declined", why); }

/* The arguments into f: the kept keys, the repointed key. 0, or -1 with a Python error. */
static int filter_setup(Filter *f, int src_fd, PyObject *keep, PyObject *repoint, PyObject **key_bytes) {
    struct stat st;
    if (fstat(src_fd, &st) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    f->src.fd = src_fd;
    f->src.size = (Py_ssize_t)st.st_size;
    f->src.hash = 1469598103934665603ULL;
    PyObject *iter = PyObject_GetIter(keep), *item;
    if (iter == NULL) return -1;
    while ((item = PyIter_Next(iter)) != NULL) {
        int r = hashset_add_str(&f->keep, item);
        Py_DECREF(item);
        if (r < 0) break;
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) return -1;
    if (repoint == Py_None) return 0;
    PyObject *rkey, *rpath;
    long long rlength;
    if (!PyArg_ParseTuple(repoint, "UUL:repoint", &rkey, &rpath, &rlength)) return -1;
    *key_bytes = PyUnicode_AsEncodedString(rkey, "utf-8", "surrogatepass");
    f->repoint_path = PyUnicode_AsEncodedString(rpath, "utf-8", "surrogatepass");
    if (*key_bytes == NULL || f->repoint_path == NULL) return -1;
    f->repoint_key = (const unsigned char *)PyBytes_AS_STRING(*key_bytes);
    f->repoint_key_len = PyBytes_GET_SIZE(*key_bytes);
    f->repoint_length = rlength;
    return 0;
}

/* Pass 1 and what follows it: 1 to write, 0 declined (f->why), -1 with a Python error. */
static int plan(Filter *f, PyObject *expected, PyObject *sizes, int repointing) {
    int r = pass1(f);
    if (r <= 0) return r;
    if (f->n_meta != 1 || f->n_sdm != 1 || f->n_sd != 1)
        DECLINE(f, "not one Metadata object with one state_dict_metadata and one storage_data");
    if (repointing && f->n_repointed != 1) DECLINE(f, "the repointed key has not exactly one storage item");
    settle_liveness(f);
    qsort(f->edits, (size_t)f->n_edits, sizeof(Edit), cmp_edit);
    for (Py_ssize_t i = 1; i < f->n_edits; i++)
        if (f->edits[i].pos < f->edits[i - 1].end || f->edits[i].pos == f->edits[i - 1].pos) DECLINE(f, "edits overlap");
    return f->compact ? compact_layout(f, expected, sizes) : 1;
}

static PyObject *filter_metadata(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *keep, *expected, *repoint;
    int src_fd, out_fd;
    if (!PyArg_ParseTuple(args, "iOOOi:filter_metadata", &src_fd, &keep, &expected, &repoint, &out_fd)) return NULL;
    if (expected != Py_None && !PyDict_Check(expected)) {
        PyErr_SetString(PyExc_TypeError, "filter_metadata: expected must be a dict or None");
        return NULL;
    }
    Filter f;
    memset(&f, 0, sizeof(f));
    f.compact = expected != Py_None;
    PyObject *result = NULL, *sizes = PyDict_New(), *key_bytes = NULL;
    Out o;
    memset(&o, 0, sizeof(o));
    uint64_t hash1, hash2;
    if (sizes == NULL || filter_setup(&f, src_fd, keep, repoint, &key_bytes) < 0) goto done;
    if (f.src.size >= (Py_ssize_t)UINT32_MAX) { /* positions are kept in 32 bits */
        result = declined("4 GiB or more");
        goto done;
    }
    int r = plan(&f, expected, sizes, repoint != Py_None);
    if (r < 0 || source_rewind(&f.src, &hash1) < 0) goto done;
    if (r == 0) {
        result = declined(f.why ? f.why : "declined");
        goto done;
    }
    if (out_fd < 0) /* counts only (a check of a pickle the filter wrote) */
        goto counts;
    o.fd = out_fd;
    o.framed = f.proto >= 4;
    o.out_cap = 1 << 20;
    o.frame = PyMem_Malloc(FRAME_TARGET);
    o.out = PyMem_Malloc((size_t)o.out_cap);
    if (o.frame == NULL || o.out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    r = pass2(&f, &o);
    if (r < 0 || source_rewind(&f.src, &hash2) < 0) goto done;
    if (r == 0 && hash1 != hash2) {
        f.why = "the file changed between the passes";
        r = 1;
    }
    if (r == 1) {
        result = declined(f.why);
        goto done;
    }
counts:;
    Py_ssize_t live = 0;
    for (Py_ssize_t i = 0; i < f.n_dropped; i++) live += f.dropped[i].live;
    result = Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:O}", "bytes", o.written, "keys_kept", f.sdm_kept,
                           "keys_dropped", f.sdm_dropped, "storage_kept", f.sd_kept, "storage_dropped", f.sd_dropped,
                           "other_dropped", f.other_dropped, "garbage_items", live, "repointed", f.n_repointed,
                           "file_sizes", sizes);
done:
    PyMem_Free(o.frame);
    PyMem_Free(o.out);
    Py_XDECREF(sizes);
    Py_XDECREF(key_bytes);
    filter_clear(&f);
    return result;
}

static PyMethodDef methods[] = {
    {"filter_metadata", filter_metadata, METH_VARARGS,
     "filter_metadata(src_fd, keep, expected, repoint, out_fd): write the .metadata pickle read from src_fd to "
     "out_fd with only the keys in keep; expected: {file: int64 (offset, length) pairs} to compact storage offsets, "
     "or None; repoint: (key, path, length) or None; out_fd -1: the counts only, nothing written. Returns the counts, "
     "or {'declined': why} (what was written to out_fd, if anything, is not to be used)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor._metadata_filter", "A .metadata with keys left out, from its bytes.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__metadata_filter(void) { return PyModule_Create(&module_def); }
