/* The loop over the keys of a DCP .metadata (dcp_index._items_py), in C, one way (see _dcp_index.h).
 *
 * items(state_dict_metadata, shared, counted, consume) -> (rows, stop, dtypes)
 *   rows: {key: (dtype, shape, chunks)} in the order of the keys, chunks a list of exact (offsets, sizes, None)
 *   tuples (shape None and one ((), (), None) chunk: a bytes item); dims shared and checked as _shared_dims does,
 *   the dtype as the record holds it. stop: None, or how many keys were done where a key is one C does not read
 *   (nothing of that key changed: dcp_index.py goes on from it). dtypes: (key, dtype) where a dtype object is
 *   first met, in order (dcp_index.py checks and names them).
 * attach(storage_data, rows, consume, shared) (_dcp_attach.c).
 */
#include "_dcp_index.h"

const RecordsApi *dcp_records;
static PyObject *s_offsets, *s_sizes, *s_chunks, *s_properties, *s_ckd_state, *s_dtype, *s_size, *empty_tuple;
static PyObject *no_fields; /* an empty dict (never changed): the fields of a record with no BUILD */

/* The fields of an index record (one state dict, or compact) or of a faithful read's Record (its __dict__). */
int dcp_record_fields(PyObject *record, DcpFields *fields) {
    fields->dict = fields->record = NULL;
    if (PyObject_TypeCheck(record, *dcp_records->index_record)) {
        if (PyList_GET_SIZE(record) == 0)
            fields->dict = no_fields;
        else if (PyList_GET_SIZE(record) == 1 && PyDict_CheckExact(PyList_GET_ITEM(record, 0)))
            fields->dict = PyList_GET_ITEM(record, 0);
        else if (dcp_records->is_compact(record))
            fields->record = record;
        return fields->dict == NULL && fields->record == NULL ? DCP_STOP : 0;
    }
    PyObject *dict = PyObject_TypeCheck(record, *dcp_records->record) ? PyObject_GenericGetDict(record, NULL) : NULL;
    PyErr_Clear();
    Py_XDECREF(dict);  /* the record holds it */
    fields->dict = dict != NULL && PyDict_CheckExact(dict) ? dict : NULL;
    return fields->dict == NULL ? DCP_STOP : 0;
}

/* fields.get(name), borrowed (the names are exact str, the dicts exact: no Python code runs). */
PyObject *dcp_field(DcpFields *fields, PyObject *name) {
    if (fields->record != NULL)
        return dcp_records->compact_value(fields->record, name);
    PyObject *value = PyDict_GetItemWithError(fields->dict, name);
    PyErr_Clear();
    return value;
}

/* dcp_index.dims_key: the little-endian int64s of a tuple of exact ints in int64, else NULL (no error). */
PyObject *dcp_dims_key(PyObject *dims) {
    Py_ssize_t n = PyTuple_GET_SIZE(dims);
    PyObject *key = PyBytes_FromStringAndSize(NULL, n * 8);
    for (Py_ssize_t i = 0; key != NULL && i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(dims, i);
        int overflow = 1;
        long long value = PyLong_CheckExact(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
        if (overflow || (value == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_CLEAR(key);
            break;
        }
        for (int b = 0; b < 8; b++)
            PyBytes_AS_STRING(key)[8 * i + b] = (char)(((unsigned long long)value >> (8 * b)) & 0xff);
    }
    return key;
}

/* dcp_index._shared_dims(cache, tuple(raw), ...) where it passes (new reference); NULL without an error: stop
 * (raw not a tuple C copies without Python code, or dims int64_dims refuses). */
PyObject *dcp_shared_dims(PyObject *cache, PyObject *raw, int counts) {
    if (!PyTuple_Check(raw) || Py_TYPE(raw)->tp_iter != PyTuple_Type.tp_iter)
        return NULL;
    PyObject *dims = PyTuple_CheckExact(raw) ? Py_NewRef(raw) : PyTuple_GetSlice(raw, 0, PyTuple_GET_SIZE(raw));
    PyObject *key = dims == NULL ? NULL : dcp_dims_key(dims), *kept = NULL;
    if (key == NULL)
        goto done;
    if ((kept = PyDict_GetItemWithError(cache, key)) != NULL) {
        Py_INCREF(kept);
        goto done;
    }
    uint64_t count = 1; /* int64_dims: each in [0, 2**63), and with counts their product too */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dims); i++) {
        int64_t dim = dcp_int64_size(PyTuple_GET_ITEM(dims, i));
        if (dim < 0 || (counts && count != 0 && (dim != 0 && count > (UINT64_C(1) << 63) / (uint64_t)dim)))
            goto done;  /* (a product past 2**63 with a zero dim after it is 0: the overflow test is exact) */
        count *= (uint64_t)dim;
    }
    if (counts && count >= (UINT64_C(1) << 63))
        goto done;
    kept = PyDict_SetDefault(cache, key, dims);
    Py_XINCREF(kept);
done:
    Py_XDECREF(dims);
    Py_XDECREF(key);
    return kept;
}

PyObject *dcp_triple(PyObject *a, PyObject *b, PyObject *c) {
    return PyTuple_Pack(3, a, b, c);
}

/* A key's chunks as a list of (offsets, sizes, None) (dcp_index._chunks_py); NULL without an error: stop. */
static PyObject *chunk_list(PyObject *chunks_meta, PyObject *shared, PyObject *counted) {
    if (!PyList_CheckExact(chunks_meta))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(chunks_meta);
    PyObject *result = PyList_New(n);  /* at its length: the index keeps it */
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *chunk = PyList_GET_ITEM(chunks_meta, i), *raw_offsets, *raw_sizes, *offsets = NULL, *sizes = NULL;
        DcpFields fields;
        if (dcp_record_fields(chunk, &fields) < 0 || (raw_offsets = dcp_field(&fields, s_offsets)) == NULL ||
                   (raw_sizes = dcp_field(&fields, s_sizes)) == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyObject *made = NULL;
        if ((offsets = dcp_shared_dims(shared, raw_offsets, 0)) != NULL &&
            (sizes = dcp_shared_dims(counted, raw_sizes, 1)) != NULL)
            made = dcp_triple(offsets, sizes, Py_None);
        Py_XDECREF(offsets);
        Py_XDECREF(sizes);
        if (made == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, made);
    }
    return result;
}

/* The dtype of a tensor record's properties as dcp_index._items_py reads it (borrowed); NULL: stop. */
static PyObject *record_dtype(PyObject *properties) {
    if (properties == NULL || properties == Py_None)
        return Py_None;
    if (PyObject_TypeCheck(properties, *dcp_records->tuple_state_record) && PyList_GET_SIZE(properties) == 1 &&
        PyTuple_CheckExact(PyList_GET_ITEM(properties, 0))) {  /* TensorProperties' (dtype, layout, ...) */
        PyObject *state = PyList_GET_ITEM(properties, 0);
        if (dcp_records->refuse_properties_state(state) < 0) {
            PyErr_Clear();  /* dcp_index.py refuses it */
            return NULL;
        }
        return PyTuple_GET_ITEM(state, 0);
    }
    DcpFields fields;
    if (dcp_record_fields(properties, &fields) < 0)
        return NULL;
    PyObject *state = dcp_field(&fields, s_ckd_state), *dtype;
    if (state != NULL && PyTuple_CheckExact(state) && PyTuple_GET_SIZE(state) > 0)
        return PyTuple_GET_ITEM(state, 0);
    if (state != NULL && state != Py_None && !PyTuple_CheckExact(state))
        return NULL;  /* (a tuple subclass's truth is its own) */
    dtype = dcp_field(&fields, s_dtype);
    return dtype == NULL ? Py_None : dtype;
}

/* One state_dict_metadata entry as its row (new reference); NULL without an error: stop. */
static PyObject *one_row(PyObject *item_meta, PyObject *shared, PyObject *counted, int consume) {
    DcpFields fields;
    if (dcp_record_fields(item_meta, &fields) < 0)
        return NULL;
    PyObject *chunks_meta = dcp_field(&fields, s_chunks);
    if (chunks_meta == NULL || chunks_meta == Py_None) { /* BytesStorageMetadata */
        PyObject *chunk = dcp_triple(empty_tuple, empty_tuple, Py_None), *chunks = chunk == NULL ? NULL : PyList_New(1);
        if (chunks == NULL) {
            Py_XDECREF(chunk);
            return NULL;
        }
        PyList_SET_ITEM(chunks, 0, chunk);
        PyObject *row = dcp_triple(Py_None, Py_None, chunks);
        Py_DECREF(chunks);
        return row;
    }
    Py_INCREF(chunks_meta);  /* the fields may hold the only reference */
    PyObject *chunks = chunk_list(chunks_meta, shared, counted), *shape = NULL, *row = NULL;
    PyObject *dtype = chunks == NULL ? NULL : record_dtype(dcp_field(&fields, s_properties));
    PyObject *raw_shape = dtype == NULL ? NULL : dcp_field(&fields, s_size);
    if (raw_shape != NULL && (shape = dcp_shared_dims(counted, raw_shape, 1)) != NULL &&
        (row = dcp_triple(dtype, shape, chunks)) != NULL && consume &&
        PyList_SetSlice(chunks_meta, 0, PyList_GET_SIZE(chunks_meta), NULL) < 0)
        Py_CLEAR(row);
    Py_DECREF(chunks_meta);
    Py_XDECREF(chunks);
    Py_XDECREF(shape);
    return row;
}

static PyObject *items(PyObject *module, PyObject *args) {
    PyObject *state_dict_metadata, *shared, *counted, *key, *item_meta;
    int consume;
    if (!PyArg_ParseTuple(args, "OO!O!p:items", &state_dict_metadata, &PyDict_Type, &shared, &PyDict_Type, &counted,
                          &consume))
        return NULL;
    PyObject *rows = PyDict_New(), *dtypes = PyList_New(0), *seen = PyDict_New(); /* seen: dtype addresses */
    if (dtypes == NULL || seen == NULL)
        Py_CLEAR(rows);
    Py_ssize_t position = 0, done = 0;
    int stopped = !PyDict_CheckExact(state_dict_metadata);
    while (rows != NULL && !stopped && PyDict_Next(state_dict_metadata, &position, &key, &item_meta)) {
        PyObject *row = PyUnicode_CheckExact(key) ? one_row(item_meta, shared, counted, consume) : NULL;
        if (row == NULL) {
            if (PyErr_Occurred())
                Py_CLEAR(rows);
            stopped = 1;
            break;
        }
        /* consume: the key's records go now (its value set to None: no key added, the iteration goes on) */
        PyObject *dtype = PyTuple_GET_ITEM(row, 0), *address = PyLong_FromVoidPtr(dtype), *pair = NULL;
        int status = address == NULL ? -1 : PyDict_Contains(seen, address);
        if (status == 0 && ((pair = PyTuple_Pack(2, key, dtype)) == NULL || PyList_Append(dtypes, pair) < 0 ||
                            PyDict_SetItem(seen, address, dtype) < 0))  /* (seen holds dtype: its address stays) */
            status = -1;
        Py_XDECREF(address);
        Py_XDECREF(pair);
        if (status < 0 || PyDict_SetItem(rows, key, row) < 0 ||
            (consume && PyDict_SetItem(state_dict_metadata, key, Py_None) < 0))
            Py_CLEAR(rows);
        Py_DECREF(row);
        done++;
    }
    PyObject *stop = rows == NULL ? NULL : stopped ? PyLong_FromSsize_t(done) : Py_NewRef(Py_None);
    PyObject *result = stop == NULL ? NULL : PyTuple_Pack(3, rows, stop, dtypes);
    Py_XDECREF(rows);
    Py_XDECREF(dtypes);
    Py_XDECREF(seen);
    Py_XDECREF(stop);
    return result;
}

static PyMethodDef methods[] = {
    {"items", items, METH_VARARGS, "state_dict_metadata -> (rows, stop, dtypes): see _dcp_index.c."},
    {"attach", dcp_attach, METH_VARARGS, "Set the rows' chunk locations from storage_data; None, or where it stopped."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor.formats._dcp_index", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dcp_index(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_offsets, "offsets"}, {&s_sizes, "sizes"}, {&s_chunks, "chunks"}, {&s_properties, "properties"},
        {&s_ckd_state, "_ckd_state"}, {&s_dtype, "dtype"}, {&s_size, "size"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    if ((empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL) ||
        (no_fields == NULL && (no_fields = PyDict_New()) == NULL))
        return NULL;
    /* the records' module (which gives the native module their types) and the native module itself (which
     * PyCapsule_Import of 3.11 does not import): ImportError where it was not built, and the Python loops run */
    PyObject *records = PyImport_ImportModule("ckptdoctor.pickle.index_records");
    PyObject *native = records == NULL ? NULL : PyImport_ImportModule("ckptdoctor.pickle._native");
    Py_XDECREF(records);  /* sys.modules holds them */
    Py_XDECREF(native);
    if (dcp_attach_init() < 0 || native == NULL || (dcp_records = PyCapsule_Import(RECORDS_API_NAME, 0)) == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
