/* ckptdoctor.formats._dcp_index: the loops of formats/dcp_index.py that build the index of a DCP .metadata, in C,
 * one way (nothing of Python is given to it, it calls no Python code): it reads the records the safe unpickler
 * built (through the pickle engine's capsule, ../pickle/_records.h) and returns rows of plain values, which
 * dcp_index.py checks and makes into its types. It handles the records DCP writes and stops at anything else
 * (a record of another form, a value the index refuses): dcp_index.py's own loops go on from there, so the
 * results and errors are theirs by construction (tests/test_dcp_index_accel.py and fuzz/fuzz_native.py compare).
 *   _dcp_index.c     the module and the loop over keys (items): this file
 *   _dcp_attach.c    the storage pass (attach; _dcp_attach.h)
 *   _dcp_fields.c    reading the records' fields and dims, below both (_dcp_fields.h)
 *
 * The loop over the keys of a DCP .metadata (dcp_index._items_py):
 * items(state_dict_metadata, shared, counted, consume) -> (rows, stop, dtypes)
 *   rows: {key: (dtype, shape, chunks)} in the order of the keys, chunks a list of exact (offsets, sizes, None)
 *   tuples (shape None and one ((), (), None) chunk: a bytes item); dims shared and checked as _shared_dims does,
 *   the dtype as the record holds it. stop: None, or how many keys were done where a key is one C does not read
 *   (nothing of that key changed: dcp_index.py goes on from it). dtypes: (key, dtype) where a dtype object is
 *   first met, in order (dcp_index.py checks and names them).
 * attach(storage_data, rows, consume, shared) (_dcp_attach.c).
 */
#include "_dcp_attach.h"
#include "_dcp_fields.h"

static PyObject *s_offsets, *s_sizes, *s_chunks, *s_properties, *s_ckd_state, *s_dtype, *s_size, *empty_tuple;

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
    if ((empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL) || dcp_fields_init() < 0 ||
        dcp_attach_init() < 0)
        return NULL;
    return PyModule_Create(&module_def);
}
