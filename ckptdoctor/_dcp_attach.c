/* The storage pass of the DCP index, for ckptdoctor._dcp_index (see _dcp_index.h): attach(storage_data, items,
 * consume, shared) checks every storage_data entry (MetadataIndex -> _StorageInfo) and sets it as the location of
 * the chunks it names, step for step as dcp_index._attach_py (tests/test_dcp_index_accel.py compares both). The
 * chunks were made by items() with no location; no (key, offsets) map of every chunk is built. */
#include "_dcp_index.h"

static PyObject *s_fqn, *s_offset, *s_relative_path, *s_length, *s_what_offsets, *s_what_range, *s_kind, *s_bytes,
    *s_chunks, *s_popitem, *s_items;

int dcp_attach_init(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_fqn, "fqn"}, {&s_offset, "offset"}, {&s_relative_path, "relative_path"}, {&s_length, "length"},
        {&s_what_offsets, "offsets"}, {&s_what_range, "storage offset and length"}, {&s_kind, "kind"},
        {&s_bytes, "bytes"}, {&s_chunks, "chunks"}, {&s_popitem, "popitem"}, {&s_items, "items"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    return 0;
}

/* A key of more chunks than this gets a table from offsets to positions (a search of its list per storage entry
 * would cost n**2 for n chunks); below it, the search is cheaper. */
#define LINEAR_CHUNKS 32

/* Set chunks[i]'s location (the chunk was made by items(), held only by the list: its last item is set in place,
 * as a new tuple would only replace it), unless consume and a newer entry already set one. */
static int set_location(PyObject *chunks, Py_ssize_t i, PyObject **location, PyObject *path, PyObject *start,
                        PyObject *length, int consume) {
    PyObject *chunk = PyList_GET_ITEM(chunks, i);
    if (!Py_IS_TYPE(chunk, dcp_chunk_type) || PyTuple_GET_SIZE(chunk) != 3) {
        PyErr_SetString(PyExc_TypeError, "attach: an item's chunks are not the ones items() made");
        return -1;
    }
    if (consume && PyTuple_GET_ITEM(chunk, 2) != Py_None)
        return 0;  /* a newer entry of this key was kept */
    if (*location == NULL && (*location = dcp_new_triple(dcp_location_type, path, start, length)) == NULL)
        return -1;
    if (Py_REFCNT(chunk) == 1) {
        PyObject *old = PyTuple_GET_ITEM(chunk, 2);
        PyTuple_SET_ITEM(chunk, 2, Py_NewRef(*location));
        Py_DECREF(old);
        return 0;
    }
    PyObject *fresh = dcp_new_triple(dcp_chunk_type, PyTuple_GET_ITEM(chunk, 0), PyTuple_GET_ITEM(chunk, 1), *location);
    return fresh == NULL ? -1 : PyList_SetItem(chunks, i, fresh);
}

/* The positions (a list of ints, new reference) of the chunks of a key of more than LINEAR_CHUNKS chunks whose
 * offsets are offset, from a table built once per key in tables (keyed by dcp_dims_key: flood-proof); NULL with
 * an error, or an empty tuple. */
static PyObject *table_positions(PyObject *tables, PyObject *fqn, PyObject *chunks, PyObject *offset) {
    PyObject *table = PyDict_GetItemWithError(tables, fqn);
    if (table == NULL) {
        if (PyErr_Occurred() || (table = PyDict_New()) == NULL)
            return NULL;
        int status = PyDict_SetItem(tables, fqn, table);
        Py_DECREF(table);  /* tables holds it */
        if (status < 0)
            return NULL;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(chunks); i++) {
            PyObject *chunk = PyList_GET_ITEM(chunks, i);
            if (!PyTuple_Check(chunk) || PyTuple_GET_SIZE(chunk) != 3) {
                PyErr_SetString(PyExc_TypeError, "attach: an item's chunks are not the ones items() made");
                return NULL;
            }
            PyObject *offsets_key = dcp_records->dims_key(PyTuple_GET_ITEM(chunk, 0));
            if (offsets_key == NULL) {
                if (PyErr_Occurred())
                    return NULL;
                continue; /* never: items() checked every chunk's offsets */
            }
            PyObject *list = PyList_New(0), *position = PyLong_FromSsize_t(i);
            PyObject *kept = list == NULL ? NULL : PyDict_SetDefault(table, offsets_key, list);
            int ok = kept != NULL && position != NULL && PyList_Append(kept, position) == 0;
            Py_DECREF(offsets_key);
            Py_XDECREF(list);
            Py_XDECREF(position);
            if (!ok)
                return NULL;
        }
    }
    PyObject *offset_key = dcp_records->dims_key(offset);
    if (offset_key == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(dcp_empty_tuple);
    PyObject *positions = PyDict_GetItemWithError(table, offset_key);
    Py_DECREF(offset_key);
    if (positions == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(dcp_empty_tuple);
    return Py_NewRef(positions);
}

/* One storage_data entry: checked, then set as the location of the chunks it names (dcp_index._attach_py). */
static int attach_entry(PyObject *items, PyObject *tables, PyObject *shared, PyObject *index, PyObject *info,
                        int consume) {
    DcpFields index_fields = {NULL, NULL}, info_fields = {NULL, NULL};
    PyObject *fqn = NULL, *offset = NULL, *path = NULL, *kept_path = NULL;
    PyObject *start = NULL, *length = NULL, *location = NULL, *kind = NULL, *chunks = NULL, *positions = NULL;
    int result = -1;
    if (dcp_record_fields(index, &index_fields) < 0 || dcp_record_fields(info, &info_fields) < 0)
        goto done;
    if ((fqn = dcp_field(&index_fields, s_fqn)) == NULL || (offset = dcp_field_or_none(&index_fields, s_offset)) == NULL)
        goto done;
    if (offset != Py_None) {
        PyObject *dims = dcp_shared_dims(shared, offset, fqn, s_what_offsets, 0);
        Py_SETREF(offset, dims);
        if (offset == NULL)
            goto done;
    }
    PyObject *raw_path = dcp_field(&info_fields, s_relative_path);
    if (raw_path == NULL)
        goto done;
    path = PyObject_Str(raw_path);
    Py_DECREF(raw_path);
    if (path == NULL)
        goto done;
    kept_path = PyDict_GetItemWithError(shared, path);
    if (kept_path != NULL) {
        Py_INCREF(kept_path);
    } else {
        if (PyErr_Occurred())
            goto done;
        if ((kept_path = PyObject_CallFunctionObjArgs(dcp_inside_path_fn, path, fqn, NULL)) == NULL)
            goto done;
        if (PyDict_SetItem(shared, path, kept_path) < 0)
            goto done;
    }
    if ((start = dcp_field(&info_fields, s_offset)) == NULL || (length = dcp_field(&info_fields, s_length)) == NULL)
        goto done;
    if (dcp_int64_size(start) < 0 || dcp_int64_size(length) < 0) {
        PyObject *pair = PyTuple_Pack(2, start, length);
        if (pair == NULL)
            goto done;
        PyObject *checked = PyObject_CallFunctionObjArgs(dcp_int64_dims_fn, pair, fqn, s_what_range, NULL);
        Py_DECREF(pair);
        if (checked == NULL)
            goto done;
        Py_DECREF(checked);
    }
    PyObject *item = PyDict_GetItemWithError(items, fqn);  /* borrowed */
    if (item == NULL) {
        result = PyErr_Occurred() ? -1 : 0;  /* no chunk names this entry */
        goto done;
    }
    if ((kind = PyObject_GetAttr(item, s_kind)) == NULL)
        goto done;
    int is_bytes = PyObject_RichCompareBool(kind, s_bytes, Py_EQ);
    if (is_bytes < 0)
        goto done;
    if ((offset == Py_None) != is_bytes) {
        result = 0;
        goto done;
    }
    if ((chunks = PyObject_GetAttr(item, s_chunks)) == NULL)
        goto done;
    if (!PyList_Check(chunks)) {
        PyErr_SetString(PyExc_TypeError, "attach: an item's chunks are not a list");
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(chunks);
    if (offset == Py_None || n <= LINEAR_CHUNKS) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(chunks); i++) {
            if (offset != Py_None) {
                PyObject *chunk = PyList_GET_ITEM(chunks, i);
                if (!PyTuple_Check(chunk) || PyTuple_GET_SIZE(chunk) != 3) {
                    PyErr_SetString(PyExc_TypeError, "attach: an item's chunks are not the ones items() made");
                    goto done;
                }
                int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(chunk, 0), offset, Py_EQ);
                if (same < 0)
                    goto done;
                if (!same)
                    continue;
            }
            if (set_location(chunks, i, &location, kept_path, start, length, consume) < 0)
                goto done;
        }
    } else {
        if ((positions = table_positions(tables, fqn, chunks, offset)) == NULL)
            goto done;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(positions);
        for (Py_ssize_t j = 0; j < count; j++) {
            Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(positions, j));
            if (i < 0 || i >= PyList_GET_SIZE(chunks)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "attach: a chunk position out of range");
                goto done;
            }
            if (set_location(chunks, i, &location, kept_path, start, length, consume) < 0)
                goto done;
        }
    }
    result = 0;
done:
    dcp_fields_clear(&index_fields);
    dcp_fields_clear(&info_fields);
    Py_XDECREF(fqn);
    Py_XDECREF(offset);
    Py_XDECREF(path);
    Py_XDECREF(kept_path);
    Py_XDECREF(start);
    Py_XDECREF(length);
    Py_XDECREF(location);
    Py_XDECREF(kind);
    Py_XDECREF(chunks);
    Py_XDECREF(positions);
    return result;
}

static int attach_pair(PyObject *items, PyObject *tables, PyObject *shared, PyObject *pair, int consume) {
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {  /* never: popitem() and items() give pairs */
        PyErr_SetString(PyExc_TypeError, "storage_data yielded something other than a pair");
        return -1;
    }
    return attach_entry(items, tables, shared, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), consume);
}

/* attach(storage_data, items, consume, shared): see dcp_index._attach_py. */
PyObject *dcp_attach(PyObject *module, PyObject *args) {
    PyObject *storage_data, *items_map, *shared;
    int consume;
    if (!PyArg_ParseTuple(args, "OO!pO!:attach", &storage_data, &PyDict_Type, &items_map, &consume, &PyDict_Type,
                          &shared))
        return NULL;
    PyObject *tables = PyDict_New(), *iterator = NULL, *pair;
    if (tables == NULL)
        return NULL;
    if (consume) {  /* popitem() until empty: each record is freed once used */
        for (;;) {
            int left = PyObject_IsTrue(storage_data);
            if (left < 0)
                goto fail;
            if (!left)
                break;
            if ((pair = PyObject_CallMethodNoArgs(storage_data, s_popitem)) == NULL)
                goto fail;
            int status = attach_pair(items_map, tables, shared, pair, 1);
            Py_DECREF(pair);
            if (status < 0)
                goto fail;
        }
    } else {
        PyObject *pairs = PyObject_CallMethodNoArgs(storage_data, s_items);
        if (pairs == NULL)
            goto fail;
        iterator = PyObject_GetIter(pairs);
        Py_DECREF(pairs);
        if (iterator == NULL)
            goto fail;
        while ((pair = PyIter_Next(iterator)) != NULL) {
            int status = attach_pair(items_map, tables, shared, pair, 0);
            Py_DECREF(pair);
            if (status < 0)
                goto fail;
        }
        if (PyErr_Occurred())
            goto fail;
        Py_CLEAR(iterator);
    }
    Py_DECREF(tables);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(iterator);
    Py_DECREF(tables);
    return NULL;
}
