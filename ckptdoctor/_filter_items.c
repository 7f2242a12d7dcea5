/* Pass 1 of ckptdoctor._metadata_filter: the items of the containers it edits, the storage edits, the fields of
 * state dicts (see _metadata_filter.c). 1 to go on, 0 to decline (f->why), -1 with a Python error. */
#include "_metadata_filter.h"

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
            if (f->n_edges >= MAX_EDGES) {
                f->why = "more reads between items left out than the filter takes";
                r = 0;
                break;
            }
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
int assign_items(Filter *f, Py_ssize_t target, Py_ssize_t first, int w, Py_ssize_t op, int single,
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

