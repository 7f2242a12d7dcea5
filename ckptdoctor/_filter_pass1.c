/* Pass 1 of ckptdoctor._metadata_filter: the stack simulation (see _metadata_filter.c). Each function returns 1 to go
 * on, 0 to decline (f->why), -1 with a Python error. */
#include "_metadata_filter.h"

static int push(Filter *f, const Slot *s) {
    if (f->height >= MAX_STACK) DECLINE(f, "a stack deeper than the filter takes");
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

/* Slots the opcode takes off the stack (the top n): none may be a container the filter edits or a state dict. */
int take(Filter *f, Py_ssize_t n) {
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

/* The slots above the innermost mark and the mark itself taken off, and s (an object made of them, starting
 * where the mark was) pushed in their place. */
static int collapse_mark(Filter *f, Slot *s) {
    Py_ssize_t mh = mark_height(f), pos, memo0;
    int candidate;
    if (mh < 0) DECLINE(f, "no mark");
    int r = take(f, f->height - mh);
    if (r > 0) r = take_mark(f, &mh, &pos, &memo0, &candidate);
    if (r > 0 && candidate) DECLINE(f, "a batch taken otherwise");
    if (r <= 0) return r;
    s->start = pos;
    s->memo0 = memo0;
    return push(f, s);
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

int pass1(Filter *f) {
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
            case 't': case 'l': case 'd': case 0x91: case 'o': /* from the slots above the mark */
                mh = mark_height(f);
                if (op == 'o' && mh >= 0 &&
                    (mh >= f->height || (f->stack[mh].kind == S_CLASS && our_class(f->stack[mh].cls))))
                    DECLINE(f, "OBJ of a class the filter reads");
                r = collapse_mark(f, &s);
                break;
            case 'i': { /* INST module\nname\n, arguments above the mark */
                const unsigned char *a = buf + p + 1, *nl = memchr(a, '\n', (size_t)(end - p - 1));
                if (our_class(class_of(name_of(a, nl - a), name_of(nl + 1, buf + end - 1 - (nl + 1)))))
                    DECLINE(f, "INST of a class the filter reads");
                r = collapse_mark(f, &s);
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

