/* The pruned pickle as a file to read, for ckptdoctor._pickle_scan (see _pickle_prune.c). */
#include "_pickle_prune.h"

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#endif

/* PrunedReader(data): a file the unpickler reads the pruned pickle from (read, readline), translated a frame
 * at a time as it is read: the same bytes as prune_memo(data), without a second copy of the pickle. */
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

/* With release, the whole pages of the plan parts left out go back to the system as soon as the plan is made:
 * the translation jumps over them (emit_op) and nothing else reads them again. */
static void release_left_out(PrunedReader *self) {
#if defined(MADV_DONTNEED)
    long page_size = sysconf(_SC_PAGESIZE);
    if (!self->release || page_size <= 0) return;
    uintptr_t base = (uintptr_t)self->s.view.buf, page = (uintptr_t)page_size;
    for (Py_ssize_t i = 0; i < self->s.plans.n; i++) {
        const PlanRegion *r = &self->s.plans.regions[i];
        if (r->live) continue;
        uintptr_t start = (base + (uintptr_t)r->start + page - 1) & ~(page - 1);
        uintptr_t end = (base + (uintptr_t)r->end) & ~(page - 1);
        if (end > start) madvise((void *)start, (size_t)(end - start), MADV_DONTNEED); /* advice: harmless if refused */
    }
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
    .tp_name = "ckptdoctor._pickle_scan.PrunedReader",
    .tp_basicsize = sizeof(PrunedReader),
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The pruned pickle as a file to read (see pruned_reader).",
    .tp_methods = reader_methods,
};

PyObject *pickle_pruned_reader(PyObject *Py_UNUSED(module), PyObject *args) {
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
    release_left_out(self);
    return (PyObject *)self;
}

int pickle_prune_ready(void) { return PyType_Ready(&PrunedReaderType); }
