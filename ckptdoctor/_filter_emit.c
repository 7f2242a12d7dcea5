/* Between the passes and pass 2 of ckptdoctor._metadata_filter (see _metadata_filter.c). */
#include "_metadata_filter.h"

void settle_liveness(Filter *f) {
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

int cmp_edit(const void *a, const void *b) {
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
int compact_layout(Filter *f, PyObject *expected, PyObject *sizes) {
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


/* Pass 2 into fd, through its buffers; 0 written (*written: bytes), 1 declined (f->why), -1 with a Python error. */
int write_output(Filter *f, int fd, Py_ssize_t *written) {
    Out o;
    memset(&o, 0, sizeof(o));
    o.fd = fd;
    o.framed = f->proto >= 4;
    o.out_cap = 1 << 20;
    o.frame = PyMem_Malloc(FRAME_TARGET);
    o.out = PyMem_Malloc((size_t)o.out_cap);
    int r = -1;
    if (o.frame == NULL || o.out == NULL)
        PyErr_NoMemory();
    else
        r = pass2(f, &o);
    *written = o.written;
    PyMem_Free(o.frame);
    PyMem_Free(o.out);
    return r;
}
