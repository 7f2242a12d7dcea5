/* Reading the index records of a DCP .metadata (see _dcp_fields.h). */
#include "_dcp_fields.h"

const RecordsApi *dcp_records;
static PyObject *no_fields; /* an empty dict (never changed): the fields of a record with no BUILD */

/* The records' module (which gives the native module their types) and the native module itself (which
 * PyCapsule_Import of 3.11 does not import): ImportError where it was not built, and the Python loops run. */
int dcp_fields_init(void) {
    if (no_fields == NULL && (no_fields = PyDict_New()) == NULL)
        return -1;
    PyObject *records = PyImport_ImportModule("ckptdoctor.pickle.index_records");
    PyObject *native = records == NULL ? NULL : PyImport_ImportModule("ckptdoctor.pickle._native");
    Py_XDECREF(records); /* sys.modules holds them */
    Py_XDECREF(native);
    return native == NULL || (dcp_records = PyCapsule_Import(RECORDS_API_NAME, 0)) == NULL ? -1 : 0;
}

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
