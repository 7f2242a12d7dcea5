/* The loops of ckptdoctor.formats.dcp_index that build the index of a DCP .metadata (per chunk and per key), in C.
 *
 * Input: the objects the safe unpickler built (nothing here reads bytes). Each function does what its Python
 * reference in dcp_index.py does, step for step and in the same order, so that a malformed record raises the
 * same exception with the same message: the fast path handles the records DCP writes (an IndexRecord list
 * holding one state dict, exact ints, tuples of ints), and everything else goes through the same Python
 * helpers (fields, int64_dims, inside_path) or the generic object protocol the Python code would use.
 * tests/test_dcp_index_accel.py compares both on the fixtures, on hostile records and on mutants of both.
 *
 * setup(fields, int64_dims, inside_path, dtype_name, DcpChunk, StorageLocation)  once, at import (the records'
 *       types come from ckptdoctor.pickle._native's capsule, pickle/_records.h)
 * items(state_dict_metadata, shared, counted, item_class, consume, dtype_names) -> {key: item}, chunks unplaced
 * attach(storage_data, items, consume, shared) -> None: each chunk's StorageLocation set from storage_data
 *                                      (_dcp_attach.c)
 * tiles_once(shape, chunks) -> bool   True: the chunks are the cells of one grid over shape, each once (check's
 *                                      coverage rule answers None); False: the rule's Python mapping decides
 *                                      (_dcp_coverage.c)
 */
#include "_dcp_index.h"

PyTypeObject *dcp_chunk_type, *dcp_location_type;
PyObject *dcp_int64_dims_fn, *dcp_inside_path_fn, *dcp_empty_tuple;
const RecordsApi *dcp_records;
static PyObject *fields_fn, *dtype_name_fn;
static PyObject *s_offsets, *s_sizes, *s_get, *s_items, *s_what_offsets, *s_what_sizes, *s_what_shape, *s_chunks,
    *s_clear, *s_properties, *s_ckd_state, *s_dtype, *s_size, *s_bytes, *s_tensor;

int dcp_record_fields(PyObject *record, DcpFields *fields) {
    fields->dict = NULL;
    fields->record = NULL;
    if (PyObject_TypeCheck(record, *dcp_records->index_record)) {
        if (PyList_GET_SIZE(record) == 1 && PyDict_CheckExact(PyList_GET_ITEM(record, 0))) {
            fields->dict = PyList_GET_ITEM(record, 0);
            Py_INCREF(fields->dict);
            return 0;
        }
        if (dcp_records->is_compact(record)) {
            fields->record = record;
            return 0;
        }
    }
    fields->dict = PyObject_CallOneArg(fields_fn, record);
    return fields->dict == NULL ? -1 : 0;
}

void dcp_fields_clear(DcpFields *fields) {
    Py_CLEAR(fields->dict);
    fields->record = NULL;
}

/* fields[name] (new reference). */
PyObject *dcp_field(DcpFields *fields, PyObject *name) {
    if (fields->record != NULL) {
        PyObject *value = dcp_records->compact_value(fields->record, name);
        if (value == NULL) {
            PyErr_SetObject(PyExc_KeyError, name);
            return NULL;
        }
        Py_INCREF(value);
        return value;
    }
    if (PyDict_CheckExact(fields->dict)) {
        PyObject *value = PyDict_GetItemWithError(fields->dict, name);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, name);
        return NULL;
    }
    return PyObject_GetItem(fields->dict, name);
}

/* fields.get(name) (new reference). */
PyObject *dcp_field_or_none(DcpFields *fields, PyObject *name) {
    PyObject *value;
    if (fields->record != NULL) {
        value = dcp_records->compact_value(fields->record, name);
    } else if (PyDict_CheckExact(fields->dict)) {
        value = PyDict_GetItemWithError(fields->dict, name);
        if (value == NULL && PyErr_Occurred())
            return NULL;
    } else {
        return PyObject_CallMethodOneArg(fields->dict, s_get, name);
    }
    value = value != NULL ? value : Py_None;
    Py_INCREF(value);
    return value;
}

/* tuple(raw), as the one object cache holds for it (checked by int64_dims when first met; dcp_index._shared_dims). */
PyObject *dcp_shared_dims(PyObject *cache, PyObject *raw, PyObject *key, PyObject *what, int counts) {
    PyObject *dims = PySequence_Tuple(raw), *dims_key = NULL, *checked = NULL, *kept = NULL;
    if (dims == NULL)
        return NULL;
    /* keyed by dims_key (bytes): a tuple's own hash can be made to collide (see pickle/_records.c) */
    if ((dims_key = dcp_records->dims_key(dims)) == NULL && PyErr_Occurred())
        goto done;
    if (dims_key != NULL) {
        kept = PyDict_GetItemWithError(cache, dims_key);
        if (kept != NULL || PyErr_Occurred()) {
            Py_XINCREF(kept);
            goto done;
        }
    }
    checked = PyObject_CallFunctionObjArgs(dcp_int64_dims_fn, dims, key, what, counts ? Py_True : NULL, NULL);
    if (checked == NULL)
        goto done;
    kept = dims_key == NULL ? checked : PyDict_SetDefault(cache, dims_key, checked);
    Py_XINCREF(kept);
done:
    Py_DECREF(dims);
    Py_XDECREF(dims_key);
    Py_XDECREF(checked);
    return kept;
}

/* A 3-tuple of a NamedTuple class (DcpChunk, StorageLocation), one per chunk. Allocated at its exact size, as
 * an exact tuple is: tp_alloc (PyType_GenericAlloc) reserves one more item for any var-sized subclass, which
 * the NamedTuples (__slots__ = (), no __dict__ or __weakref__ after the items) never use. That is 16 bytes per
 * object, and a block of the 64-byte size class, where the records freed while the index is built were,
 * instead of the 80-byte one: the index reuses their memory rather than adding to it (a lower peak). */
PyObject *dcp_new_triple(PyTypeObject *type, PyObject *a, PyObject *b, PyObject *c) {
    PyTupleObject *triple = PyObject_GC_NewVar(PyTupleObject, type, 3);
    if (triple == NULL)
        return NULL;
    Py_INCREF(a);
    Py_INCREF(b);
    Py_INCREF(c);
    PyTuple_SET_ITEM(triple, 0, a);
    PyTuple_SET_ITEM(triple, 1, b);
    PyTuple_SET_ITEM(triple, 2, c);
    PyObject_GC_Track(triple);
    return (PyObject *)triple;
}

void dcp_trim_list(PyObject *list) {
    PyListObject *l = (PyListObject *)list;
    if (!PyList_CheckExact(list) || l->allocated <= Py_SIZE(l) || Py_SIZE(l) == 0)
        return;
    PyObject **items = PyMem_Realloc(l->ob_item, (size_t)Py_SIZE(l) * sizeof(PyObject *));
    if (items != NULL) {  /* else the list keeps its larger array, as it was */
        l->ob_item = items;
        l->allocated = Py_SIZE(l);
    }
}

/* A chunk record, or the ChunkDims made from one while the pickle was read (prebuilt_chunks in
 * pickle/_records.c), as a DcpChunk with checked, shared dims and no location yet. */
static PyObject *one_chunk(PyObject *chunk, PyObject *key, PyObject *shared, PyObject *counted) {
    DcpFields fields = {NULL, NULL};
    PyObject *raw = NULL, *offsets = NULL, *sizes = NULL, *result = NULL;
    int prebuilt = Py_IS_TYPE(chunk, *dcp_records->chunk_dims) && PyTuple_GET_SIZE(chunk) == 2;
    if (prebuilt)
        raw = Py_NewRef(PyTuple_GET_ITEM(chunk, 0));
    else if (dcp_record_fields(chunk, &fields) < 0 || (raw = dcp_field(&fields, s_offsets)) == NULL)
        goto done;
    if ((offsets = dcp_shared_dims(shared, raw, key, s_what_offsets, 0)) == NULL)
        goto done;
    Py_CLEAR(raw);
    raw = prebuilt ? Py_NewRef(PyTuple_GET_ITEM(chunk, 1)) : dcp_field(&fields, s_sizes);
    if (raw == NULL || (sizes = dcp_shared_dims(counted, raw, key, s_what_sizes, 1)) == NULL)
        goto done;
    result = dcp_new_triple(dcp_chunk_type, offsets, sizes, Py_None);  /* its location comes from attach() */
done:
    dcp_fields_clear(&fields);
    Py_XDECREF(raw);
    Py_XDECREF(offsets);
    Py_XDECREF(sizes);
    return result;
}

/* A key's chunk records as [DcpChunk] (dcp_index._chunks_py). */
static PyObject *chunk_list(PyObject *chunks_meta, PyObject *key, PyObject *shared, PyObject *counted) {
    PyObject *result = PyList_New(0), *iterator = NULL, *chunk;
    if (result == NULL || (iterator = PyObject_GetIter(chunks_meta)) == NULL)
        goto fail;
    while ((chunk = PyIter_Next(iterator)) != NULL) {
        PyObject *entry = one_chunk(chunk, key, shared, counted);
        Py_DECREF(chunk);
        if (entry == NULL)
            goto fail;
        int status = PyList_Append(result, entry);
        Py_DECREF(entry);
        if (status < 0)
            goto fail;
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(iterator);
    dcp_trim_list(result);  /* the index keeps it: no room for more (a list grown by append has room for 4) */
    return result;
fail:
    Py_XDECREF(iterator);
    Py_XDECREF(result);
    return NULL;
}

/* The dtype of a tensor record's properties (dcp_index._items_py: TensorProperties pickles its fields as a tuple
 * (dtype, layout, ...), kept as the "_ckd_state" field; else a "dtype" field), new reference. */
static PyObject *record_dtype(PyObject *properties) {
    if (properties == Py_None)
        Py_RETURN_NONE;  /* fields = {}: no state, no dtype */
    if (PyObject_TypeCheck(properties, *dcp_records->tuple_state_record) && PyList_GET_SIZE(properties) == 1 &&
        PyTuple_CheckExact(PyList_GET_ITEM(properties, 0))) {  /* fields would be {"_ckd_state": state} */
        PyObject *state = PyList_GET_ITEM(properties, 0), *dtype = Py_None;
        if (dcp_records->refuse_properties_state(state) < 0)  /* as index_record_fields checks it */
            return NULL;
        if (PyTuple_GET_SIZE(state) > 0)
            dtype = PyTuple_GET_ITEM(state, 0);
        Py_INCREF(dtype);
        return dtype;
    }
    DcpFields fields = {NULL, NULL};
    PyObject *state = NULL, *dtype = NULL;
    if (dcp_record_fields(properties, &fields) < 0 || (state = dcp_field_or_none(&fields, s_ckd_state)) == NULL)
        goto done;
    int nonempty = PyTuple_Check(state) ? PyObject_IsTrue(state) : 0;
    if (nonempty < 0)
        goto done;
    dtype = nonempty ? PySequence_GetItem(state, 0) : dcp_field_or_none(&fields, s_dtype);
done:
    dcp_fields_clear(&fields);
    Py_XDECREF(state);
    return dtype;
}

/* One state_dict_metadata entry as an item_class instance (the body of dcp_index._items_py's loop). */
static PyObject *one_item(PyObject *key, PyObject *item_meta, PyObject *shared, PyObject *counted,
                          PyObject *item_class, int consume, PyObject *dtype_names) {
    DcpFields fields = {NULL, NULL};
    PyObject *chunks_meta = NULL, *chunks = NULL, *dtype = NULL, *raw = NULL, *shape = NULL;
    PyObject *result = NULL, *name;
    if (dcp_record_fields(item_meta, &fields) < 0 || (chunks_meta = dcp_field_or_none(&fields, s_chunks)) == NULL)
        goto done;
    if (chunks_meta == Py_None) {  /* BytesStorageMetadata */
        PyObject *chunk = dcp_new_triple(dcp_chunk_type, dcp_empty_tuple, dcp_empty_tuple, Py_None);
        if (chunk == NULL || (chunks = PyList_New(1)) == NULL) {
            Py_XDECREF(chunk);
            goto done;
        }
        PyList_SET_ITEM(chunks, 0, chunk);
        PyObject *call[] = {key, s_bytes, Py_None, Py_None, chunks};
        result = PyObject_Vectorcall(item_class, call, 5, NULL);
        goto done;
    }
    if ((chunks = chunk_list(chunks_meta, key, shared, counted)) == NULL)
        goto done;
    if (consume) {
        PyObject *cleared = PyObject_CallMethodNoArgs(chunks_meta, s_clear);
        if (cleared == NULL)
            goto done;
        Py_DECREF(cleared);
    }
    PyObject *properties = dcp_field_or_none(&fields, s_properties);
    if (properties == NULL)
        goto done;
    dtype = record_dtype(properties);
    Py_DECREF(properties);
    if (dtype == NULL)
        goto done;
    name = PyDict_GetItemWithError(dtype_names, dtype);
    if (name == NULL) {
        if (PyErr_Occurred() || (name = PyObject_CallFunctionObjArgs(dtype_name_fn, dtype, key, NULL)) == NULL)
            goto done;
        int status = PyDict_SetItem(dtype_names, dtype, name);
        Py_DECREF(name);  /* dtype_names holds it */
        if (status < 0)
            goto done;
    }
    if ((raw = dcp_field(&fields, s_size)) == NULL || (shape = dcp_shared_dims(counted, raw, key, s_what_shape, 1)) == NULL)
        goto done;
    PyObject *call[] = {key, s_tensor, name, shape, chunks};
    result = PyObject_Vectorcall(item_class, call, 5, NULL);
done:
    dcp_fields_clear(&fields);
    Py_XDECREF(chunks_meta);
    Py_XDECREF(chunks);
    Py_XDECREF(dtype);
    Py_XDECREF(raw);
    Py_XDECREF(shape);
    return result;
}

static PyObject *items(PyObject *module, PyObject *args) {
    PyObject *state_dict_metadata, *shared, *counted, *item_class, *dtype_names;
    int consume;
    if (!PyArg_ParseTuple(args, "OO!O!OpO!:items", &state_dict_metadata, &PyDict_Type, &shared, &PyDict_Type,
                          &counted, &item_class, &consume, &PyDict_Type, &dtype_names))
        return NULL;
    PyObject *result = PyDict_New(), *pairs = NULL, *iterator = NULL, *pair;
    if (result == NULL || (pairs = PyObject_CallMethodNoArgs(state_dict_metadata, s_items)) == NULL ||
        (iterator = PyObject_GetIter(pairs)) == NULL)
        goto fail;
    while ((pair = PyIter_Next(iterator)) != NULL) {
        PyObject *entry = NULL;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)  /* never: items() gives pairs */
            PyErr_SetString(PyExc_TypeError, "state_dict_metadata yielded something other than a pair");
        else
            entry = one_item(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), shared, counted, item_class,
                             consume, dtype_names);
        int status = entry == NULL ? -1 : PyDict_SetItem(result, PyTuple_GET_ITEM(pair, 0), entry);
        if (status == 0 && consume && PyDict_CheckExact(state_dict_metadata))  /* its records go now (a value */
            status = PyDict_SetItem(state_dict_metadata, PyTuple_GET_ITEM(pair, 0), Py_None); /* set, no key added) */
        Py_XDECREF(entry);
        Py_DECREF(pair);
        if (status < 0)
            goto fail;
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(iterator);
    Py_DECREF(pairs);
    return result;
fail:
    Py_XDECREF(iterator);
    Py_XDECREF(pairs);
    Py_XDECREF(result);
    return NULL;
}

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *fields, *dims, *inside, *dtype_name, *chunk, *location;
    if (!PyArg_ParseTuple(args, "OOOOO!O!:setup", &fields, &dims, &inside, &dtype_name, &PyType_Type, &chunk,
                          &PyType_Type, &location))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)chunk, &PyTuple_Type) ||
        !PyType_IsSubtype((PyTypeObject *)location, &PyTuple_Type) ||
        ((PyTypeObject *)chunk)->tp_basicsize != PyTuple_Type.tp_basicsize ||
        ((PyTypeObject *)location)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "setup: two slot-less tuple subclasses expected");
        return NULL;
    }
    PyObject **slots[] = {&fields_fn, &dcp_int64_dims_fn, &dcp_inside_path_fn, &dtype_name_fn,
                          (PyObject **)&dcp_chunk_type, (PyObject **)&dcp_location_type};
    PyObject *values[] = {fields, dims, inside, dtype_name, chunk, location};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        Py_INCREF(values[i]);
        Py_XSETREF(*slots[i], values[i]);
    }
    Py_RETURN_NONE;
}

static PyObject *not_set_up(PyObject *module, PyObject *args) {
    PyErr_SetString(PyExc_RuntimeError, "ckptdoctor._dcp_index.setup() was not called");
    return NULL;
}

static PyObject *checked_attach(PyObject *module, PyObject *args) {
    return dcp_chunk_type == NULL || *dcp_records->index_record == NULL ? not_set_up(module, args)
                                                                         : dcp_attach(module, args);
}

static PyObject *checked_items(PyObject *module, PyObject *args) {
    return dcp_chunk_type == NULL || *dcp_records->index_record == NULL ? not_set_up(module, args)
                                                                         : items(module, args);
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, "Give the Python helpers and types the loops use (once, at import)."},
    {"attach", checked_attach, METH_VARARGS, "Set each chunk's StorageLocation from storage_data."},
    {"items", checked_items, METH_VARARGS, "state_dict_metadata -> {key: item_class(...)}."},
    {"tiles_once", dcp_tiles_once, METH_VARARGS, "Whether chunks are one grid's cells over shape, each once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor._dcp_index", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dcp_index(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_offsets, "offsets"}, {&s_sizes, "sizes"}, {&s_get, "get"}, {&s_items, "items"},
        {&s_what_offsets, "offsets"}, {&s_what_sizes, "sizes"}, {&s_what_shape, "global shape"}, {&s_chunks, "chunks"},
        {&s_clear, "clear"}, {&s_properties, "properties"}, {&s_ckd_state, "_ckd_state"}, {&s_dtype, "dtype"},
        {&s_size, "size"}, {&s_bytes, "bytes"}, {&s_tensor, "tensor"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    }
    if (dcp_empty_tuple == NULL && (dcp_empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    PyObject *records = PyImport_ImportModule("ckptdoctor.pickle._native"); /* (PyCapsule_Import of 3.11 does not) */
    Py_XDECREF(records);  /* sys.modules holds it */
    if (dcp_attach_init() < 0 || records == NULL || (dcp_records = PyCapsule_Import(RECORDS_API_NAME, 0)) == NULL)
        return NULL;  /* ImportError where the pickle engine's native module was not built: the Python loops run */
    return PyModule_Create(&module_def);
}
