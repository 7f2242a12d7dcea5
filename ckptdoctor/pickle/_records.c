/* Index records (index_records.py) and torch.Size (policy.py) in the native module (see _native.c): the BUILD of
 * index-only records (compact_setstate), what it refuses as torch refuses it, and the sizes shared within a load. */
#include "_records.h"

/* index_records' types, given once by records_setup: CompactKeys (the field names of a compact record),
 * IndexRecord, IndexTupleStateRecord and stand_ins.Record (a faithful read's records, for the DCP index's C) */
static PyTypeObject *compact_keys_type, *index_record_type, *tuple_state_record_type, *record_type;
static PyObject *compact_keys_interned; /* tuple of names -> CompactKeys, one per distinct set of fields */

/*
 * An index-only record (index_records.IndexRecord, a list) whose one BUILD gave an exact dict of str keys holds
 * [CompactKeys(names), value, ...] instead of [state]: the state dict (~200 B) is not kept, which is most of the
 * memory of reading .metadata (three records per chunk). compact_setstate is those records' __setstate__; any
 * other state (not a dict, other keys, a second BUILD) is appended as before, after turning a compact record
 * back into [dict]. index_records.index_record_fields reads both forms. */

/* -1 with pickle.UnpicklingError(message) set. */
static int unpickling_error(const char *message) {
    static PyObject *error;
    if (error == NULL) {
        PyObject *pickle = PyImport_ImportModule("pickle");
        error = pickle == NULL ? NULL : PyObject_GetAttrString(pickle, "UnpicklingError");
        Py_XDECREF(pickle);
        if (error == NULL)
            return -1;
    }
    PyErr_SetString(error, message);
    return -1;
}

/* -1 with pickle.UnpicklingError set where the C unpickler's BUILD refuses state for an object without
 * __setstate__ (a DCP dataclass), as stand_ins.build_state says: a state that is not a dict (or None), or a
 * (state, slot state) pair whose state is not a dict (or None) or whose slot state is not a dict. Checked at each
 * BUILD of a record whose state must be a dict, so a record the index never reads (one inside a kept save plan
 * part) is refused as torch refuses it. */
static int refuse_build_state(PyObject *state) {
    PyObject *slots = NULL;
    if (PyTuple_Check(state) && PyTuple_GET_SIZE(state) == 2) {
        slots = PyTuple_GET_ITEM(state, 1);
        state = PyTuple_GET_ITEM(state, 0);
    }
    if (state != Py_None && !PyDict_Check(state))
        return unpickling_error("state is not a dictionary");
    if (slots != NULL && !PyDict_Check(slots))
        return unpickling_error("slot state is not a dictionary");
    return 0;
}

/* A TensorProperties state other than a dict, as stand_ins.check_properties_state checks it (the same message):
 * five values (a tuple or a list), as torch's __setstate__ unpacks them. */
static int refuse_properties_state(PyObject *state) {
    if (!(PyTuple_Check(state) || PyList_Check(state)) || PySequence_Fast_GET_SIZE(state) != 5)
        return unpickling_error(
            "TensorProperties state is not 5 values (dtype, layout, requires_grad, memory format, pin_memory)");
    return 0;
}

/* -1 with torch.Size's own error where it refuses dims (torch_stand_ins.check_size_items, the same messages): an
 * item that is not an int (bools are), or one outside int64. */
static int refuse_size_items(PyObject *dims) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dims); i++) {
        PyObject *item = PyTuple_GET_ITEM(dims, i);
        if (!PyLong_Check(item)) {
            PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(item), "__name__");
            if (name != NULL)
                PyErr_Format(PyExc_TypeError, "torch.Size() takes an iterable of 'int' (item %zd is '%U')", i, name);
            Py_XDECREF(name);
            return -1;
        }
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) { /* torch: "Overflow when unpacking long long" */
            PyObject *bits = PyObject_CallMethod(item, "bit_length", NULL);
            if (bits != NULL)
                PyErr_Format(PyExc_ValueError, "torch.Size item %zd is an int of %S bits, not an int64", i, bits);
            Py_XDECREF(bits);
            return -1;
        }
        if (value == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

#define MAX_COMPACT_FIELDS 16
#define MAX_COMPACT_KEY_SETS 4096

static int is_compact(PyObject *record) {
    if (compact_keys_type == NULL || !PyList_Check(record) || PyList_GET_SIZE(record) < 1)
        return 0;
    PyObject *keys = PyList_GET_ITEM(record, 0);
    return Py_IS_TYPE(keys, compact_keys_type) && PyList_GET_SIZE(record) == 1 + PyTuple_GET_SIZE(keys);
}

/* The one CompactKeys for the keys of state (new reference), NULL without an error where it does not apply. */
static PyObject *compact_keys(PyObject *state) {
    Py_ssize_t n = PyDict_GET_SIZE(state), i = 0, position = 0;
    if (n > MAX_COMPACT_FIELDS)
        return NULL;
    PyObject *names = PyTuple_New(n), *key, *value;
    if (names == NULL)
        return NULL;
    while (PyDict_Next(state, &position, &key, &value)) {
        if (!PyUnicode_CheckExact(key) || i >= n) {
            Py_DECREF(names);
            return NULL;
        }
        Py_INCREF(key);
        PyTuple_SET_ITEM(names, i++, key);
    }
    PyObject *keys = PyDict_GetItemWithError(compact_keys_interned, names);  /* exact str keys: no Python code */
    if (keys != NULL) {
        Py_INCREF(keys);
    } else if (!PyErr_Occurred() && PyDict_GET_SIZE(compact_keys_interned) < MAX_COMPACT_KEY_SETS &&
               (keys = compact_keys_type->tp_alloc(compact_keys_type, n)) != NULL) {
        for (Py_ssize_t j = 0; j < n; j++) {
            Py_INCREF(PyTuple_GET_ITEM(names, j));
            PyTuple_SET_ITEM(keys, j, PyTuple_GET_ITEM(names, j));
        }
        if (PyDict_SetItem(compact_keys_interned, names, keys) < 0)
            Py_CLEAR(keys);
    }
    Py_DECREF(names);
    return keys;
}

/* A compact record's fields as the dict its state was (new reference). */
static PyObject *compact_dict(PyObject *record) {
    PyObject *keys = PyList_GET_ITEM(record, 0), *fields = PyDict_New();
    for (Py_ssize_t i = 0; fields != NULL && i < PyTuple_GET_SIZE(keys); i++)
        if (PyDict_SetItem(fields, PyTuple_GET_ITEM(keys, i), PyList_GET_ITEM(record, i + 1)) < 0)
            Py_CLEAR(fields);
    return fields;
}

static PyObject *shared_state(PyObject *state); /* below, beside index_size */

/* __setstate__ of index records (bound through an instancemethod: args are the record and the state). */
static PyObject *compact_setstate(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "__setstate__ of an index record takes one state");
        return NULL;
    }
    PyObject *record = args[0], *state = args[1];
    if (tuple_state_record_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "records_setup did not finish");
        return NULL;
    }
    /* a TensorProperties record (IndexTupleStateRecord) takes a tuple state too: torch's class has a __setstate__ */
    int properties = PyObject_TypeCheck(record, tuple_state_record_type);
    if (properties ? !PyDict_Check(state) && refuse_properties_state(state) < 0 : refuse_build_state(state) < 0)
        return NULL;
    if (PyList_GET_SIZE(record) == 0 && PyDict_CheckExact(state)) {
        PyObject *keys = compact_keys(state);
        if (keys == NULL && PyErr_Occurred())
            return NULL;
        if (keys != NULL) {
            /* The items are set in place at their exact number: a list grown by a slice assignment reserves
             * twice the room (8 slots for 4 items), 32 bytes more per record, three records per chunk. The
             * record is empty here, so its old item array (if any) holds nothing. */
            Py_ssize_t n = 1 + PyTuple_GET_SIZE(keys);
            PyObject **items = PyMem_New(PyObject *, (size_t)n);
            if (items == NULL) {
                Py_DECREF(keys);
                return PyErr_NoMemory();
            }
            items[0] = keys;  /* the names in the dict's order, so the values follow it */
            Py_ssize_t position = 0, i = 1;
            PyObject *key, *value;
            while (i < n && PyDict_Next(state, &position, &key, &value)) {
                Py_INCREF(value);
                items[i++] = value;
            }
            PyListObject *list = (PyListObject *)record;
            PyMem_Free(list->ob_item);
            list->ob_item = items;
            list->allocated = n;
            Py_SET_SIZE(list, i);  /* i == n: the dict has the n - 1 values its names were read from */
            Py_RETURN_NONE;
        }
    }
    if (is_compact(record)) {  /* a second BUILD: back to the states in order, the first as its dict */
        PyObject *first = compact_dict(record);
        if (first == NULL)
            return NULL;
        PyObject *contents = PyList_New(1);
        if (contents == NULL) {
            Py_DECREF(first);
            return NULL;
        }
        PyList_SET_ITEM(contents, 0, first);
        int status = PyList_SetSlice(record, 0, PyList_GET_SIZE(record), contents);
        Py_DECREF(contents);
        if (status < 0)
            return NULL;
    }
    PyObject *kept = PyList_GET_SIZE(record) == 0 ? shared_state(state) : Py_NewRef(state);
    if (kept == NULL)
        return NULL;
    int status = PyList_Append(record, kept);
    Py_DECREF(kept);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef compact_setstate_def = {"__setstate__", (PyCFunction)(void (*)(void))compact_setstate,
                                           METH_FASTCALL, "BUILD of an index record (see _records.c)."};

static PyTypeObject *slotless_subtype(PyObject *type, PyTypeObject *base) {
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, base) ||
        ((PyTypeObject *)type)->tp_basicsize != base->tp_basicsize) {
        PyErr_Format(PyExc_TypeError, "records_setup: a slot-less %s subclass expected", base->tp_name);
        return NULL;
    }
    return (PyTypeObject *)Py_NewRef(type);
}

/* records_setup(CompactKeys, IndexRecord, IndexTupleStateRecord, Record) -> the __setstate__ of index record
 * classes (an instancemethod); once, by index_records. */
PyObject *native_records_setup(PyObject *module, PyObject *args) {
    PyObject *keys, *record, *tuple_state, *faithful;
    if (!PyArg_ParseTuple(args, "OOOO!:records_setup", &keys, &record, &tuple_state, &PyType_Type, &faithful))
        return NULL;
    Py_CLEAR(compact_keys_type);  /* a second call (a reload of index_records) replaces the types */
    Py_CLEAR(index_record_type);
    Py_CLEAR(tuple_state_record_type);
    Py_XSETREF(record_type, (PyTypeObject *)Py_NewRef(faithful));
    Py_XSETREF(compact_keys_interned, PyDict_New());
    if (compact_keys_interned == NULL ||
        (compact_keys_type = slotless_subtype(keys, &PyTuple_Type)) == NULL ||
        (index_record_type = slotless_subtype(record, &PyList_Type)) == NULL ||
        (tuple_state_record_type = slotless_subtype(tuple_state, index_record_type)) == NULL)
        return NULL;
    PyObject *function = PyCFunction_New(&compact_setstate_def, NULL);
    if (function == NULL)
        return NULL;
    PyObject *method = PyInstanceMethod_New(function);
    Py_DECREF(function);
    return method;
}

/* Where a compact record holds the value of name (its index in the record), or -1. Its names are exact str. */
static Py_ssize_t compact_slot(PyObject *record, PyObject *name) {
    PyObject *keys = PyList_GET_ITEM(record, 0);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (key == name || (PyUnicode_CheckExact(name) && PyUnicode_Compare(key, name) == 0))
            return i + 1;
    }
    return -1;
}

/* A compact record's value of name, borrowed; NULL (no error) where it has none. */
static PyObject *compact_value(PyObject *record, PyObject *name) {
    Py_ssize_t slot = compact_slot(record, name);
    return slot < 0 ? NULL : PyList_GET_ITEM(record, slot);
}

/*
 * torch.Size in an index-only read (safe_globals.index_only): the argument tuple, as ().__add__ gives it, but
 * one object for equal tuples of ints within a load. A .metadata pickles a Size per shape, chunk offsets, chunk
 * sizes and storage index (four per chunk), each with its own ints, while a checkpoint has few distinct ones
 * (layers repeat shapes, ranks repeat offsets): the records then hold shared tuples while the load lasts. Only
 * tuples of exact int64 ints are looked up (by a key whose hash a pickle cannot aim at, see tuple_key); anything
 * else, and every call of another form, is what ().__add__ makes of it (the same result or the same error). The table holds at most
 * MAX_SIZES_SEEN tuples and is emptied by forget_index_sizes() before and after each load (SafeUnpickler.load).
 */
#define MAX_SIZES_SEEN ((Py_ssize_t)1 << 20)
#define MAX_SIZE_DIMS 64

static PyObject *size_add;   /* ().__add__ */
static PyObject *tuples_seen; /* tuple_key -> the one tuple of this load (sizes and tuple states) */

/* The key of a tuple in a table of this extension (new reference), or NULL without an error where it has none:
 * bytes, whose hash is keyed per process (SipHash), where a tuple's own hash is not: tuples of ints can be made to
 * collide at will, and a pickle of 40,000 such offsets took a minute to index (hash flooding). Each item is 8
 * bytes: an exact int of int64 as itself; with by_identity, anything else as its address (tag 1; the table holds
 * the tuple, so the object stays alive and its address unique). */
static PyObject *tuple_key(PyObject *t, int by_identity) {
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    PyObject *key = PyBytes_FromStringAndSize(NULL, n * 9);
    if (key == NULL)
        return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(key);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        int64_t value;
        unsigned char tag = 0;
        if (PyLong_CheckExact(item)) {
            int overflow;
            long long number = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || (number == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                Py_DECREF(key);
                return NULL;
            }
            value = (int64_t)number;
        } else if (by_identity) {
            value = (int64_t)(uintptr_t)item;
            tag = 1;
        } else {
            Py_DECREF(key);
            return NULL;
        }
        out[9 * i] = tag;
        memcpy(out + 9 * i + 1, &value, 8);
    }
    return key;
}

/* The tuple of this load equal to exact tuple t (items compared as tuple_key says), t itself the first time or
 * where it has no key: new reference. */
static PyObject *the_equal_one(PyObject *t, int by_identity) {
    if (tuples_seen == NULL && (tuples_seen = PyDict_New()) == NULL)
        return NULL;
    PyObject *key = tuple_key(t, by_identity);
    if (key == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(t);
    PyObject *known = PyDict_GetItemWithError(tuples_seen, key);
    if (known != NULL || PyErr_Occurred()) {
        Py_DECREF(key);
        return known == NULL ? NULL : Py_NewRef(known);
    }
    int status = PyDict_GET_SIZE(tuples_seen) < MAX_SIZES_SEEN ? PyDict_SetItem(tuples_seen, key, t) : 0;
    Py_DECREF(key);
    return status < 0 ? NULL : Py_NewRef(t);
}

PyObject *native_index_size(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (size_add == NULL) {
        PyObject *empty = PyTuple_New(0);
        if (empty == NULL || (size_add = PyObject_GetAttrString(empty, "__add__")) == NULL) {
            Py_XDECREF(empty);
            return NULL;
        }
        Py_DECREF(empty);
    }
    if (nargs == 1 && PyTuple_Check(args[0]) && refuse_size_items(args[0]) < 0)
        return NULL;
    if (nargs != 1 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) > MAX_SIZE_DIMS)
        return PyObject_Vectorcall(size_add, args, (size_t)nargs, NULL);
    return the_equal_one(args[0], 0); /* a tuple of bools is kept as it is */
}

/* torch.Size in a faithful read (a rewrite's .metadata; safe_globals.faithful): cls(dims), but one object for
 * equal tuples of int64 ints within a load, from its own table (sizes_seen: keyed as tuples_seen is, holding cls
 * objects, not tuples). Sizes are immutable, so records that share one pickle back to the same torch.Size values;
 * the pickler then writes each distinct size once and a memo read for the others (four sizes per chunk, few
 * distinct ones: less memory while the records are held, fewer objects for the pickler's memo, a smaller
 * .metadata). Anything else (another form of call, more than MAX_SIZE_DIMS dims, an item that is not an exact
 * int64 int) is cls(*args) as it is, unshared. Emptied with the other tables by forget_index_sizes(). */
static PyObject *sizes_seen; /* tuple_key -> the one cls(dims) of this load */

PyObject *native_faithful_size(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "faithful_size(cls, *args) needs the class");
        return NULL;
    }
    PyObject *cls = args[0];
    if (nargs != 2 || !PyTuple_CheckExact(args[1]) || PyTuple_GET_SIZE(args[1]) > MAX_SIZE_DIMS)
        return PyObject_Vectorcall(cls, args + 1, (size_t)(nargs - 1), NULL);
    PyObject *key = tuple_key(args[1], 0);
    if (key == NULL)
        return PyErr_Occurred() ? NULL : PyObject_Vectorcall(cls, args + 1, 1, NULL);
    if (sizes_seen == NULL && (sizes_seen = PyDict_New()) == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *known = PyDict_GetItemWithError(sizes_seen, key);
    if (known != NULL && Py_TYPE(known) == (PyTypeObject *)cls) {
        Py_DECREF(key);
        return Py_NewRef(known);
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *made = PyObject_Vectorcall(cls, args + 1, 1, NULL);
    if (made != NULL && known == NULL && PyDict_GET_SIZE(sizes_seen) < MAX_SIZES_SEEN &&
        PyDict_SetItem(sizes_seen, key, made) < 0)
        Py_CLEAR(made);
    Py_DECREF(key);
    return made;
}

/* A first BUILD's tuple state (TensorProperties pickles (dtype, layout, requires_grad, memory_format,
 * pin_memory), one per key, nearly all equal): the one already seen in this load with the same ints and the same
 * other objects, from the same table as the sizes (equal tuples are interchangeable in a read-only index). Only
 * tuples of at most MAX_STATE_ITEMS items are looked up. New reference. */
#define MAX_STATE_ITEMS 16

static PyObject *shared_state(PyObject *state) {
    if (!PyTuple_CheckExact(state) || PyTuple_GET_SIZE(state) > MAX_STATE_ITEMS)
        return Py_NewRef(state);
    return the_equal_one(state, 1); /* ints by value, other items by identity: no object's hash or == runs */
}

PyObject *native_forget_index_sizes(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    Py_CLEAR(tuples_seen);
    Py_CLEAR(sizes_seen);
    Py_RETURN_NONE;
}

/* What the DCP index's C reads of the records (see _records.h). */
static const RecordsApi records_api = {&index_record_type, &tuple_state_record_type, &record_type,
                                       is_compact, compact_value, refuse_properties_state};

int native_records_ready(PyObject *module) {
    PyObject *capsule = PyCapsule_New((void *)&records_api, RECORDS_API_NAME, NULL);
    return capsule == NULL ? -1 : PyModule_AddObject(module, "records_api", capsule) < 0 ? (Py_DECREF(capsule), -1) : 0;
}
