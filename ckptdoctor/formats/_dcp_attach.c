/* The storage pass of the DCP index (dcp_index._attach_py), in C, one way (see _dcp_index.c):
 * attach(storage_data, rows, consume, shared) checks each storage_data entry (MetadataIndex -> _StorageInfo) and
 * sets (path, offset, length) as the location of the row chunks it names (the chunks items() made: exact tuples
 * only the rows hold, set in place). Returns None, or where it stopped at an entry C does not read: the number
 * of entries done, and with consume the entry popped (dcp_index.py goes on from there). */
#include "_dcp_attach.h"
#include "_dcp_fields.h"

static PyObject *s_fqn, *s_offset, *s_relative_path, *s_length;

int dcp_attach_init(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {{&s_fqn, "fqn"}, {&s_offset, "offset"}, {&s_relative_path, "relative_path"}, {&s_length, "length"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    return 0;
}

/* dcp_index.inside_path passes: a relative name of no empty, "." or ".." part, no backslash or NUL. */
static int inside(PyObject *path) {
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(path, &n);
    if (text == NULL) {
        PyErr_Clear();  /* a lone surrogate: Python decides */
        return 0;
    }
    if (n == 0 || text[0] == '/' || strchr(text, '\\') != NULL || (Py_ssize_t)strlen(text) != n)
        return 0;
    for (Py_ssize_t start = 0; start <= n;) {
        const char *slash = memchr(text + start, '/', (size_t)(n - start));
        Py_ssize_t end = slash == NULL ? n : slash - text, length = end - start;
        if (length == 0 || (length == 1 && text[start] == '.') || (length == 2 && text[start] == '.' && text[start + 1] == '.'))
            return 0;
        start = end + 1;
    }
    return 1;
}

/* Set chunks[i]'s location (an exact tuple only the list holds: its item set in place), unless consume and a newer
 * entry set one. 0, DCP_STOP (a chunk C did not make), -1 with an error. */
static int set_location(PyObject *chunks, Py_ssize_t i, PyObject **location, PyObject *path, PyObject *start,
                        PyObject *length, int consume) {
    PyObject *chunk = PyList_GET_ITEM(chunks, i);
    if (!PyTuple_CheckExact(chunk) || PyTuple_GET_SIZE(chunk) != 3 || Py_REFCNT(chunk) != 1)
        return DCP_STOP;
    if (consume && PyTuple_GET_ITEM(chunk, 2) != Py_None)
        return 0;  /* a newer entry of this key was kept */
    if (*location == NULL && (*location = dcp_triple(path, start, length)) == NULL)
        return -1;
    Py_SETREF(((PyTupleObject *)chunk)->ob_item[2], Py_NewRef(*location));
    return 0;
}

/* A key of more chunks than this gets a table from offsets to positions (a search of its list per storage entry
 * would cost n**2 for n chunks); below it, the search is cheaper. */
#define LINEAR_CHUNKS 32

/* The positions of the chunks of offset (a list, new reference), from a table built once per key in tables
 * (keyed by dcp_dims_key, as _attach_py's). */
static PyObject *table_positions(PyObject *tables, PyObject *fqn, PyObject *chunks, PyObject *offset) {
    PyObject *table = PyDict_GetItemWithError(tables, fqn);
    if (table == NULL) {
        if (PyErr_Occurred() || (table = PyDict_New()) == NULL)
            return NULL;
        int status = PyDict_SetItem(tables, fqn, table);
        Py_DECREF(table); /* tables holds it */
        for (Py_ssize_t i = 0; status == 0 && i < PyList_GET_SIZE(chunks); i++) {
            PyObject *key = dcp_dims_key(PyTuple_GET_ITEM(PyList_GET_ITEM(chunks, i), 0)); /* checked: never NULL */
            PyObject *list = key == NULL ? NULL : PyList_New(0), *position = PyLong_FromSsize_t(i);
            PyObject *kept = list == NULL ? NULL : PyDict_SetDefault(table, key, list);
            status = kept != NULL && position != NULL ? PyList_Append(kept, position) : -1;
            Py_XDECREF(key);
            Py_XDECREF(list);
            Py_XDECREF(position);
        }
        if (status < 0)
            return NULL;
    }
    PyObject *key = dcp_dims_key(offset), *positions = key == NULL ? NULL : PyDict_GetItemWithError(table, key);
    Py_XDECREF(key);
    return positions != NULL || PyErr_Occurred() ? Py_XNewRef(positions) : PyList_New(0);
}

/* One storage_data entry: checked, then set as the location of the chunks it names. 0, DCP_STOP, -1. */
static int attach_entry(PyObject *rows, PyObject *tables, PyObject *shared, PyObject *index, PyObject *info,
                        int consume) {
    DcpFields index_fields, info_fields;
    if (dcp_record_fields(index, &index_fields) < 0 || dcp_record_fields(info, &info_fields) < 0)
        return DCP_STOP;
    PyObject *fqn = dcp_field(&index_fields, s_fqn), *raw_offset = dcp_field(&index_fields, s_offset);
    PyObject *path = dcp_field(&info_fields, s_relative_path), *start = dcp_field(&info_fields, s_offset);
    PyObject *length = dcp_field(&info_fields, s_length), *offset = NULL, *location = NULL, *positions = NULL;
    if (fqn == NULL || !PyUnicode_CheckExact(fqn) || path == NULL || !PyUnicode_CheckExact(path) ||
        start == NULL || length == NULL || dcp_int64_size(start) < 0 || dcp_int64_size(length) < 0)
        return DCP_STOP;
    if (raw_offset != NULL && raw_offset != Py_None && (offset = dcp_shared_dims(shared, raw_offset, 0)) == NULL)
        return PyErr_Occurred() ? -1 : DCP_STOP;
    int result = DCP_STOP;
    PyObject *kept_path = PyDict_GetItemWithError(shared, path), *row, *chunks;
    if (kept_path == NULL) {
        if (PyErr_Occurred() || !inside(path) || PyDict_SetItem(shared, path, path) < 0)
            goto done;
        kept_path = path;
    }
    result = 0;
    row = PyDict_GetItemWithError(rows, fqn);
    if (row == NULL || (offset == NULL) != (PyTuple_GET_ITEM(row, 1) == Py_None))
        goto done;  /* no chunk names this entry */
    chunks = PyTuple_GET_ITEM(row, 2);
    Py_ssize_t n = PyList_GET_SIZE(chunks);
    if (offset != NULL && n > LINEAR_CHUNKS) {
        if ((positions = table_positions(tables, fqn, chunks, offset)) == NULL) {
            result = -1;
            goto done;
        }
        n = PyList_GET_SIZE(positions);
    }
    for (Py_ssize_t j = 0; j < n && result == 0; j++) {
        Py_ssize_t i = positions == NULL ? j : PyLong_AsSsize_t(PyList_GET_ITEM(positions, j));
        PyObject *chunk = PyList_GET_ITEM(chunks, i);
        /* the chunk's offsets and offset: equal exact tuples of int64 ints where they are the same object */
        if (positions != NULL || offset == NULL || PyTuple_GET_ITEM(chunk, 0) == offset)
            result = set_location(chunks, i, &location, kept_path, start, length, consume);
    }
done:
    Py_XDECREF(offset);
    Py_XDECREF(location);
    Py_XDECREF(positions);
    return result;
}

PyObject *dcp_attach(PyObject *module, PyObject *args) {
    PyObject *storage_data, *rows, *shared, *index, *info;
    int consume;
    if (!PyArg_ParseTuple(args, "O!O!pO!:attach", &PyDict_Type, &storage_data, &PyDict_Type, &rows, &consume,
                          &PyDict_Type, &shared))
        return NULL;
    PyObject *tables = PyDict_New(), *result = NULL;
    Py_ssize_t position = 0, done = 0;
    if (tables == NULL)
        return NULL;
    if (!PyDict_CheckExact(storage_data)) {
        result = Py_BuildValue("(nO)", done, Py_None);
    } else if (consume) { /* popitem() until empty: each record is freed once used */
        PyObject *popitem = PyUnicode_InternFromString("popitem"), *pair = NULL;
        while (popitem != NULL && PyDict_GET_SIZE(storage_data) > 0) {
            if ((pair = PyObject_CallMethodNoArgs(storage_data, popitem)) == NULL)
                break;
            int status = attach_entry(rows, tables, shared, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), 1);
            if (status == DCP_STOP)
                result = Py_BuildValue("(nO)", done, pair);
            Py_CLEAR(pair);
            if (status != 0)
                break;
            done++;
        }
        if (result == NULL && !PyErr_Occurred())
            result = Py_NewRef(Py_None);
        Py_XDECREF(popitem);
    } else {
        int status = 0;
        while (status == 0 && PyDict_Next(storage_data, &position, &index, &info)) {
            Py_INCREF(index);
            Py_INCREF(info);
            if ((status = attach_entry(rows, tables, shared, index, info, 0)) == 0)
                done++;
            Py_DECREF(index);
            Py_DECREF(info);
        }
        result = status == DCP_STOP ? Py_BuildValue("(nO)", done, Py_None) : status == 0 ? Py_NewRef(Py_None) : NULL;
    }
    Py_DECREF(tables);
    return result;
}
