#include "_opcode_read.h"
#include "_plans.h"
#include "_prune.h"

#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#endif

/* Memo pruning, for ckptdoctor.pickle._native (see _native.c): pruned_reader.
 *
 * pruned_reader(data) gives, as a file to read, the pickle with the memo writes (MEMOIZE, BINPUT, LONG_BINPUT) whose entry is never
 * read dropped and the others and the reads (BINGET, LONG_BINGET) renumbered, or None where it leaves the bytes
 * as they are. The C unpickler keeps every
 * memoized object alive until load() returns (DCP's pickler memoizes every dict, tuple and string: ~15 entries
 * per chunk of a .metadata, of which a few hundred are ever read), so the pruned pickle builds the same objects
 * in less memory: those that the result does not hold are freed as the load goes.
 *
 * The pruned pickle performs the same operations on the same objects in the same order as the original, so it
 * builds the same object graph or fails at the same operation, with the same exception. It is made only where
 * that is certain; otherwise the answer is None:
 * - the memo is written by MEMOIZE (which numbers entries by count) and by BINPUT / LONG_BINPUT of the index
 *   MEMOIZE would use (as Python's picklers write them: the protocol 2 pickles torch.save and ckptdoctor write),
 *   never by the text PUT, never out of sequence; no text GET; every read names an entry already made;
 * - a memo write is dropped only when the opcode before it (past FRAMEs and other MEMOIZEs) pushes an object:
 *   there it cannot fail (a memo write on an empty stack or at a MARK is an error the pruned pickle must keep);
 * - every opcode, its argument included, lies within one frame or outside all frames, frames do not nest or
 *   run past the data, and the pickle ends at a STOP (outside a frame or at the end of its frame): the C
 *   unpickler reads a frame into its buffer and an opcode that straddles a frame's end would be read otherwise.
 *   Frames keep their place, their lengths are those of what they keep. Bytes after the STOP are not copied
 *   (only for a caller that reads one pickle and not where it ends).
 * The output is never longer than the input: a read (a BINPUT) of rank r < 256 is a BINGET (a BINPUT), else a
 * LONG_BINGET (a LONG_BINPUT); a MEMOIZE stays a MEMOIZE.
 *
 * One option, for index-only reads only (their results are read, never written back): drop_plans leaves out the
 * states of megatron-core's save plan parts, which an index-only read builds as DROPPED, where that provably
 * changes nothing but the memo (_plans.c).
 * With drop_plans the pruned pickle builds the same objects except what only those states held, or fails at the
 * same operation. */


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

static int bitmap_set(Bitmap *b, Py_ssize_t i) {
    Py_ssize_t word = i >> 6;
    if (word >= b->n_words) {
        Py_ssize_t n = b->n_words ? b->n_words : 64;
        while (n <= word) n *= 2;
        uint64_t *bits = PyMem_Realloc(b->bits, (size_t)n * sizeof(uint64_t));
        if (bits == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(bits + b->n_words, 0, (size_t)(n - b->n_words) * sizeof(uint64_t));
        b->bits = bits;
        b->n_words = n;
    }
    b->bits[word] |= (uint64_t)1 << (i & 63);
    return 0;
}

static unsigned popcount64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (unsigned)((x * 0x0101010101010101ULL) >> 56);
}

static int bit_is_set(const Bitmap *b, Py_ssize_t i) {
    Py_ssize_t word = i >> 6;
    return word < b->n_words && ((b->bits[word] >> (i & 63)) & 1);
}

/* The first pass: which entries to keep (into kept) and where the pickle ends (*stop_end); 1 to prune,
 * 0 to leave the bytes alone, -1 with a Python error set. With plans (drop_plans), opcodes in a region of a plan
 * part (see _plans.c) keep no entries here: keep_live_regions does it for the
 * regions that stay. */
static int prune_plan(const unsigned char *buf, Py_ssize_t size, Bitmap *kept, Py_ssize_t *n_memo,
                                  Py_ssize_t *stop_end, PlanDrops *plans) {
    Py_ssize_t p = 0, frame_end = -1, memo = 0;
    int pushed = 0; /* the last opcode (FRAMEs and MEMOIZEs aside) leaves an object on the stack */
    while (p < size) {
        Py_ssize_t end;
        int kind = prune_op(buf, size, p, &end);
        if (kind == OP_REFUSE) return 0;
        if (frame_end >= 0 && end > frame_end) return 0; /* straddles the end of its frame */
        Py_ssize_t region = plans != NULL ? plans_region_at(plans, p) : -1;
        switch (kind) {
            case OP_PUT: /* BINPUT, LONG_BINPUT: only of the next index (a MEMOIZE) */
                if ((end - p == 2 ? buf[p + 1] : read_u32(buf + p + 1)) != (uint64_t)memo) return 0;
                /* fall through */
            case OP_MEMOIZE:
                if (region < 0) {
                    if (!pushed && bitmap_set(kept, memo) < 0) return -1;
                    if (plans != NULL && plans_op(plans, buf, size, p, end, memo, pushed) < 0) return -1;
                }
                memo++;
                break;
            case OP_GET: {
                uint64_t idx = end - p == 2 ? buf[p + 1] : read_u32(buf + p + 1);
                if (idx >= (uint64_t)memo) return 0; /* a read of an entry not yet made: an error, left alone */
                if (plans != NULL && plans_read(plans, (Py_ssize_t)idx, region) < 0) return -1;
                if (region < 0) {
                    if (bitmap_set(kept, (Py_ssize_t)idx) < 0) return -1;
                    if (plans != NULL && plans_op(plans, buf, size, p, end, memo, 1) < 0) return -1;
                }
                pushed = 1;
                break;
            }
            case OP_FRAME: {
                if (frame_end >= 0) return 0;
                uint64_t length = read_u64(buf + p + 1);
                if (length > (uint64_t)(size - end)) return 0;
                frame_end = end + (Py_ssize_t)length;
                break;
            }
            case OP_STOP:
                if (frame_end >= 0 && end != frame_end) return 0;
                *n_memo = memo;
                *stop_end = end;
                return 1;
            default:
                pushed = kind == OP_PUSHES;
                if (region < 0 && plans != NULL && plans_op(plans, buf, size, p, end, memo, pushed) < 0) return -1;
        }
        p = end;
        if (p == frame_end) frame_end = -1;
    }
    return 0; /* no STOP */
}

/* The regions that stay (read from code that stays, see plans_settle) keep what prune_plan would have kept in
 * them: every entry they read, and their memo writes that do not follow a push. 0, or -1 with a Python error. */
static int keep_live_regions(const unsigned char *buf, Py_ssize_t size, const PlanDrops *plans, Bitmap *kept) {
    for (Py_ssize_t r = 0; r < plans->n; r++) {
        const PlanRegion *region = &plans->regions[r];
        if (!region->live) continue;
        Py_ssize_t p = region->start, memo = region->memo_start, end;
        int pushed = 1; /* a region starts after a NEWOBJ */
        while (p < region->end) {
            int kind = prune_op(buf, size, p, &end);
            if (kind == OP_MEMOIZE || kind == OP_PUT) {
                if (!pushed && bitmap_set(kept, memo) < 0) return -1;
                memo++;
            } else if (kind == OP_GET) {
                if (bitmap_set(kept, end - p == 2 ? buf[p + 1] : (Py_ssize_t)read_u32(buf + p + 1)) < 0) return -1;
                pushed = 1;
            } else if (kind != OP_FRAME) {
                pushed = kind == OP_PUSHES;
            }
            p = end;
        }
    }
    return 0;
}


static void pruner_clear(Pruner *s) {
    plans_clear(&s->plans);
    PyMem_Free(s->kept.bits);
    PyMem_Free(s->rank);
    s->kept.bits = NULL;
    s->rank = NULL;
    if (s->view.obj != NULL) PyBuffer_Release(&s->view);
}

static int pruner_init(Pruner *s, PyObject *data, int drop_plans) {
    memset(s, 0, sizeof *s);
    if (PyObject_GetBuffer(data, &s->view, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t n_memo = 0;
    drop_plans = drop_plans && plans_start(&s->plans, s->view.buf, s->view.len);
    int plan = prune_plan(s->view.buf, s->view.len, &s->kept, &n_memo, &s->stop_end, drop_plans ? &s->plans : NULL);
    if (plan > 0) {
        plans_settle(&s->plans);
        if (keep_live_regions(s->view.buf, s->view.len, &s->plans, &s->kept) < 0) plan = -1;
    }
    plans_end_plan(&s->plans);
    if (plan > 0) {
        Py_ssize_t n_words = (n_memo + 63) >> 6, n_kept = 0;
        s->rank = PyMem_Malloc((size_t)(n_words ? n_words : 1) * sizeof(uint32_t));
        if (s->rank == NULL) {
            PyErr_NoMemory();
            plan = -1;
        } else {
            for (Py_ssize_t w = 0; w < n_words; w++) {
                s->rank[w] = (uint32_t)n_kept;
                n_kept += w < s->kept.n_words ? popcount64(s->kept.bits[w]) : 0;
            }
            if (n_kept == n_memo && !plans_any_dropped(&s->plans))
                plan = 0; /* nothing to drop */
        }
    }
    if (plan <= 0) pruner_clear(s);
    return plan;
}

/* The input bytes of the next unit: an opcode outside frames, or a whole frame (prune_plan checked both). */
static Py_ssize_t unit_length(const Pruner *s) {
    const unsigned char *buf = s->view.buf;
    Py_ssize_t end;
    int kind = prune_op(buf, s->view.len, s->p, &end);
    return kind == OP_FRAME ? end - s->p + (Py_ssize_t)read_u64(buf + s->p + 1) : end - s->p;
}

/* Translate the opcode at s->p into o; the bytes written (at most its input length). */
static Py_ssize_t emit_op(Pruner *s, unsigned char *o) {
    const unsigned char *buf = s->view.buf;
    Py_ssize_t p = s->p, end, q = 0, idx;
    const PlanRegion *left_out = s->plans.n > 0 ? plans_left_out_at(&s->plans, p) : NULL;
    if (left_out != NULL) { /* a plan part left out, not read again (its pages may be given back): past it */
        s->p = left_out->end;
        s->memo += left_out->memo_end - left_out->memo_start;
        return 0;
    }
    int kind = prune_op(buf, s->view.len, p, &end);
    s->p = end;
    if (kind != OP_MEMOIZE && kind != OP_PUT && kind != OP_GET) {
        memcpy(o, buf + p, (size_t)(end - p));
        return end - p;
    }
    idx = kind == OP_MEMOIZE ? s->memo : end - p == 2 ? buf[p + 1] : (Py_ssize_t)read_u32(buf + p + 1);
    if (kind != OP_GET) s->memo++;
    if (!bit_is_set(&s->kept, idx)) return 0; /* a memo write never read: dropped */
    uint64_t below = s->kept.bits[idx >> 6] & ((((uint64_t)1) << (idx & 63)) - 1);
    uint32_t r = s->rank[idx >> 6] + popcount64(below);
    if (kind == OP_MEMOIZE) {
        o[q++] = 0x94;
    } else if (r < 256) {
        o[q++] = kind == OP_GET ? 'h' : 'q';
        o[q++] = (unsigned char)r;
    } else {
        o[q++] = kind == OP_GET ? 'j' : 'r';
        for (int i = 0; i < 4; i++) o[q++] = (unsigned char)(r >> (8 * i));
    }
    return q;
}

/* Translate the next unit (unit_length input bytes) into o; the bytes written. A frame keeps its place and
 * gets the length of what it keeps. A plan part left out may end in a later frame: the translation goes on from
 * its end, outside frames up to the next FRAME (every opcode is still within one frame or outside all). */
static Py_ssize_t emit_unit(Pruner *s, unsigned char *o) {
    const unsigned char *buf = s->view.buf;
    if (buf[s->p] != 0x95) return emit_op(s, o);
    Py_ssize_t frame_end = s->p + 9 + (Py_ssize_t)read_u64(buf + s->p + 1), q = 9;
    o[0] = 0x95;
    s->p += 9;
    while (s->p < frame_end) q += emit_op(s, o + q);
    uint64_t length = (uint64_t)(q - 9);
    for (int i = 0; i < 8; i++) o[1 + i] = (unsigned char)(length >> (8 * i));
    return q;
}

/* PrunedReader(data): a file the unpickler reads the pruned pickle from (read, readline), translated a frame
 * at a time as it is read, without a second copy of the pickle. */
typedef struct {
    PyObject_HEAD
    Pruner s;
    unsigned char *out; /* translated bytes not yet read: out[pos:len] */
    Py_ssize_t pos, len, cap;
    int release;          /* give the pages of the input already translated back to the system (see release_read) */
    Py_ssize_t released;  /* input bytes [0, released) given back */
} PrunedReader;

static PyTypeObject PrunedReaderType;

static void reader_dealloc(PrunedReader *self) {
    pruner_clear(&self->s);
    PyMem_Free(self->out);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Where the caller asked for it (release: data is an anonymous private mapping of its own, read by nothing
 * else), the whole pages of input below the translation point go back to the system (MADV_DONTNEED): only
 * prune_plan and emit_unit read the input, each strictly forwards, and the output is a copy. A large .metadata
 * is then not held whole while the unpickler builds its objects (138 MB at 10^6 chunks). Every 4 MiB. */
#define RELEASE_STEP ((Py_ssize_t)4 << 20)

static void release_read(PrunedReader *self) {
#if defined(MADV_DONTNEED)
    if (!self->release || self->s.p - self->released < RELEASE_STEP) return;
    long page_size = sysconf(_SC_PAGESIZE);
    if (page_size <= 0) return;
    uintptr_t base = (uintptr_t)self->s.view.buf, page = (uintptr_t)page_size;
    uintptr_t start = (base + (uintptr_t)self->released + page - 1) & ~(page - 1);
    uintptr_t end = (base + (uintptr_t)self->s.p) & ~(page - 1);
    if (end > start) madvise((void *)start, (size_t)(end - start), MADV_DONTNEED); /* advice: a failure is harmless */
    self->released = self->s.p;
#else
    (void)self;
#endif
}

/* Translate one more unit into the buffer; 0, or -1 with a Python error set. */
static int reader_fill(PrunedReader *self) {
    Py_ssize_t pending = self->len - self->pos, need = pending + unit_length(&self->s);
    if (self->pos > 0) {
        memmove(self->out, self->out + self->pos, (size_t)pending);
        self->pos = 0;
        self->len = pending;
    }
    if (need > self->cap) {
        Py_ssize_t cap = self->cap ? self->cap : 1 << 16;
        while (cap < need) cap *= 2;
        unsigned char *out = PyMem_Realloc(self->out, (size_t)cap);
        if (out == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->out = out;
        self->cap = cap;
    }
    self->len += emit_unit(&self->s, self->out + self->len);
    release_read(self);
    return 0;
}

static PyObject *reader_take(PrunedReader *self, Py_ssize_t n) {
    PyObject *out = PyBytes_FromStringAndSize((const char *)self->out + self->pos, n);
    if (out != NULL) self->pos += n;
    return out;
}

static PyObject *reader_read(PrunedReader *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n = -1;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "read() takes at most one argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        n = PyNumber_AsSsize_t(args[0], PyExc_OverflowError);
        if (n == -1 && PyErr_Occurred()) return NULL;
    }
    while ((n < 0 || self->len - self->pos < n) && self->s.p < self->s.stop_end)
        if (reader_fill(self) < 0) return NULL;
    Py_ssize_t available = self->len - self->pos;
    return reader_take(self, n < 0 || n > available ? available : n);
}

static PyObject *reader_readline(PrunedReader *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t scanned = 0;
    for (;;) {
        Py_ssize_t available = self->len - self->pos;
        const unsigned char *nl = available > scanned
                                      ? memchr(self->out + self->pos + scanned, '\n', (size_t)(available - scanned))
                                      : NULL;
        if (nl != NULL) return reader_take(self, (Py_ssize_t)(nl - (self->out + self->pos)) + 1);
        if (self->s.p >= self->s.stop_end) return reader_take(self, available);
        scanned = available;
        if (reader_fill(self) < 0) return NULL;
    }
}

static PyMethodDef reader_methods[] = {
    {"read", (PyCFunction)(void (*)(void))reader_read, METH_FASTCALL, "read(n=-1): up to n bytes (all: -1)."},
    {"readline", (PyCFunction)reader_readline, METH_NOARGS, "readline(): up to and with the next newline."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PrunedReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0) /* the comma is in the macro */
    .tp_name = "ckptdoctor.pickle._native.PrunedReader",
    .tp_basicsize = sizeof(PrunedReader),
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The pruned pickle as a file to read (see pruned_reader).",
    .tp_methods = reader_methods,
};

PyObject *native_pruned_reader(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *arg;
    int release = 0, drop_plans = 0;
    if (!PyArg_ParseTuple(args, "O|pp:pruned_reader", &arg, &release, &drop_plans)) return NULL;
    PrunedReader *self = PyObject_New(PrunedReader, &PrunedReaderType);
    if (self == NULL) return NULL;
    self->out = NULL;
    self->pos = self->len = self->cap = 0;
    self->release = release;
    self->released = 0;
    int plan = pruner_init(&self->s, arg, drop_plans);
    if (plan <= 0) {
        Py_DECREF(self);
        if (plan < 0) return NULL;
        Py_RETURN_NONE;
    }
    return (PyObject *)self;
}

int native_prune_ready(void) { return PyType_Ready(&PrunedReaderType); }
