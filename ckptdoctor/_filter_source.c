/* The source .metadata through a window, for ckptdoctor._metadata_filter (see _metadata_filter.h). */
#include "_metadata_filter.h"

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
int source_rewind(Source *s, uint64_t *hash) {
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
int next_op(Filter *f, Py_ssize_t p, Py_ssize_t *end) {
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
Py_ssize_t dropped_of_entry(const Filter *f, Py_ssize_t idx) {
    Py_ssize_t lo = 0, hi = f->n_dropped;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (f->dropped[mid].memo0 <= idx) lo = mid + 1; else hi = mid;
    }
    return lo > 0 && idx < f->dropped[lo - 1].memo1 ? lo - 1 : -1;
}

