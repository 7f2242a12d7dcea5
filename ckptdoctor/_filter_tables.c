/* Names, byte and hash sets, large tables, for ckptdoctor._metadata_filter (see _metadata_filter.h). */
#include "_metadata_filter.h"

/* Large tables live in their own anonymous maps: given back to the system when freed, whatever the allocator's
 * thresholds, so the memory of the rest of the run is not taken by what the filter used. NULL on failure. */
void *big_realloc(void *p, size_t old_bytes, size_t new_bytes) {
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

void big_free(void *p, size_t bytes) {
    if (p == NULL) return;
#if defined(__linux__)
    munmap(p, bytes);
#else
    (void)bytes;
    PyMem_RawFree(p);
#endif
}

/* Room for n + 1 items of size item in *arr (capacity *cap items, zero-filled); 0, or -1 with a Python error. */
int grow(void **arr, Py_ssize_t n, Py_ssize_t *cap, size_t item) {
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
/* Names */

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

int name_of(const unsigned char *s, Py_ssize_t n) {
    if (n < 3 || n > 60) return N_NONE;
    for (int i = 1; i < N_COUNT; i++)
        if ((Py_ssize_t)strlen(NAMES[i]) == n && memcmp(NAMES[i], s, (size_t)n) == 0) return i;
    return N_NONE;
}

int class_of(int module, int name) {
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
/* Byte and hash sets */

/* Python's own keyed hash of bytes (SipHash, a secret per process): strings from a stranger's pickle cannot be
 * made to collide in these tables. */
/* Python's own keyed hash of bytes (SipHash, a secret per process): strings from a stranger's pickle cannot be
 * made to collide in these tables. */
uint64_t hash_bytes(const unsigned char *s, Py_ssize_t n) { return (uint64_t)_Py_HashBytes(s, n); }

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
Py_ssize_t byteset_add(ByteSet *b, const unsigned char *s, Py_ssize_t n) {
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

static void hashset_clear(HashSet *h) {
    big_free(h->slots, (size_t)h->cap * sizeof(uint64_t));
    memset(h, 0, sizeof(*h));
}

int hashset_contains(const HashSet *h, uint64_t x) {
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
int hashset_add_str(HashSet *h, PyObject *str) {
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

void filter_clear(Filter *f) {
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

