/* The loops of ckptdoctor.formats.dcp_index that build the index of a DCP .metadata (per chunk and per key), in C.
 *
 * Input: the objects the safe unpickler built (nothing here reads bytes). Each function does what its Python
 * reference in dcp_index.py does, step for step and in the same order, so that a malformed record raises the
 * same exception with the same message: the fast path handles the records DCP writes (an IndexRecord list
 * holding one state dict, exact ints, tuples of ints), and everything else goes through the same Python
 * helpers (fields, int64_dims, inside_path) or the generic object protocol the Python code would use.
 * tests/test_dcp_index_accel.py compares both on the fixtures, on hostile records and on mutants of both.
 *
 * setup(IndexRecord, IndexTupleStateRecord, fields, int64_dims, inside_path, dtype_name, DcpChunk,
 *       StorageLocation)  once, at import
 * items(state_dict_metadata, shared, counted, item_class, consume, dtype_names) -> {key: item}, chunks unplaced
 * attach(storage_data, items, consume, shared) -> None: each chunk's StorageLocation set from storage_data
 * compact_setstate(CompactKeys) -> the __setstate__ of index records (_dcp_compact.c)
 * tiles_once(shape, chunks) -> bool   True: the chunks are the cells of one grid over shape, each once (check's
 *                                      coverage rule answers None); False: the rule's Python mapping decides
 *                                      (_dcp_coverage.c)
 */
#include "_dcp_index.h"

static PyTypeObject *index_record_type, *tuple_state_record_type, *chunk_type, *location_type;
static PyObject *fields_fn, *int64_dims_fn, *inside_path_fn, *dtype_name_fn, *empty_tuple;
static PyObject *s_fqn, *s_offset, *s_relative_path, *s_length, *s_offsets, *s_sizes, *s_get, *s_popitem,
    *s_items, *s_what_offsets, *s_what_sizes, *s_what_range, *s_what_shape, *s_chunks, *s_clear, *s_properties,
    *s_ckd_state, *s_dtype, *s_size, *s_bytes, *s_tensor, *s_kind;

/* The fields of a record, as a view: its one state dict (what DCP writes), its compact values, or what
 * fields(record) from Python gives for anything else. */
typedef struct {
    PyObject *dict;    /* owned, or NULL for a compact record */
    PyObject *record;  /* borrowed: the compact record */
} Fields;

static int record_fields(PyObject *record, Fields *fields) {
    fields->dict = NULL;
    fields->record = NULL;
    if (PyObject_TypeCheck(record, index_record_type)) {
        if (PyList_GET_SIZE(record) == 1 && PyDict_CheckExact(PyList_GET_ITEM(record, 0))) {
            fields->dict = PyList_GET_ITEM(record, 0);
            Py_INCREF(fields->dict);
            return 0;
        }
        if (dcp_is_compact(record)) {
            fields->record = record;
            return 0;
        }
    }
    fields->dict = PyObject_CallOneArg(fields_fn, record);
    return fields->dict == NULL ? -1 : 0;
}

static void fields_clear(Fields *fields) {
    Py_CLEAR(fields->dict);
    fields->record = NULL;
}

/* fields[name] (new reference). */
static PyObject *field(Fields *fields, PyObject *name) {
    if (fields->record != NULL) {
        PyObject *value = dcp_compact_value(fields->record, name);
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
static PyObject *field_or_none(Fields *fields, PyObject *name) {
    PyObject *value;
    if (fields->record != NULL) {
        value = dcp_compact_value(fields->record, name);
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

/* tuple(raw), as the one object cache holds for it (checked by int64_dims when first met). */
static PyObject *shared_dims(PyObject *cache, PyObject *raw, PyObject *key, PyObject *what, int counts) {
    PyObject *dims = PySequence_Tuple(raw);
    if (dims == NULL)
        return NULL;
    PyObject *known = PyDict_GetItemWithError(cache, dims);
    if (known != NULL) {
        Py_INCREF(known);
        Py_DECREF(dims);
        return known;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(dims);
        return NULL;
    }
    PyObject *checked = PyObject_CallFunctionObjArgs(int64_dims_fn, dims, key, what, counts ? Py_True : NULL, NULL);
    if (checked == NULL) {
        Py_DECREF(dims);
        return NULL;
    }
    PyObject *kept = PyDict_SetDefault(cache, dims, checked);
    Py_XINCREF(kept);
    Py_DECREF(dims);
    Py_DECREF(checked);
    return kept;
}

/* A 3-tuple of a NamedTuple class (DcpChunk, StorageLocation), one per chunk. Allocated at its exact size, as
 * an exact tuple is: tp_alloc (PyType_GenericAlloc) reserves one more item for any var-sized subclass, which
 * the NamedTuples (__slots__ = (), no __dict__ or __weakref__ after the items) never use. That is 16 bytes per
 * object, and a block of the 64-byte size class, where the records freed while the index is built were,
 * instead of the 80-byte one: the index reuses their memory rather than adding to it (a lower peak). */
static PyObject *new_triple(PyTypeObject *type, PyObject *a, PyObject *b, PyObject *c) {
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

#define LINEAR_CHUNKS 32 /* dcp_index.LINEAR_CHUNKS: more chunks than this, a table from offsets to positions */

/* Set chunks[i]'s location (the chunk was made by items(), held only by the list: its last item is set in place,
 * as a new tuple would only replace it), unless consume and a newer entry already set one. */
static int set_location(PyObject *chunks, Py_ssize_t i, PyObject **location, PyObject *path, PyObject *start,
                        PyObject *length, int consume) {
    PyObject *chunk = PyList_GET_ITEM(chunks, i);
    if (!Py_IS_TYPE(chunk, chunk_type) || PyTuple_GET_SIZE(chunk) != 3) {
        PyErr_SetString(PyExc_TypeError, "attach: an item's chunks are not the ones items() made");
        return -1;
    }
    if (consume && PyTuple_GET_ITEM(chunk, 2) != Py_None)
        return 0;  /* a newer entry of this key was kept */
    if (*location == NULL && (*location = new_triple(location_type, path, start, length)) == NULL)
        return -1;
    if (Py_REFCNT(chunk) == 1) {
        PyObject *old = PyTuple_GET_ITEM(chunk, 2);
        PyTuple_SET_ITEM(chunk, 2, Py_NewRef(*location));
        Py_DECREF(old);
        return 0;
    }
    PyObject *fresh = new_triple(chunk_type, PyTuple_GET_ITEM(chunk, 0), PyTuple_GET_ITEM(chunk, 1), *location);
    return fresh == NULL ? -1 : PyList_SetItem(chunks, i, fresh);
}

/* The positions (a list of ints, new reference) of the chunks of a key of more than LINEAR_CHUNKS chunks whose
 * offsets are offset, from a table built once per key in tables; NULL with an error, or an empty tuple. */
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
            PyObject *list = PyList_New(0), *position = PyLong_FromSsize_t(i);
            PyObject *kept = list == NULL ? NULL : PyDict_SetDefault(table, PyTuple_GET_ITEM(chunk, 0), list);
            int ok = kept != NULL && position != NULL && PyList_Append(kept, position) == 0;
            Py_XDECREF(list);
            Py_XDECREF(position);
            if (!ok)
                return NULL;
        }
    }
    PyObject *positions = PyDict_GetItemWithError(table, offset);
    if (positions == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(empty_tuple);
    return Py_NewRef(positions);
}

/* One storage_data entry: checked, then set as the location of the chunks it names (dcp_index._attach_py). */
static int attach_entry(PyObject *items, PyObject *tables, PyObject *shared, PyObject *index, PyObject *info,
                        int consume) {
    Fields index_fields = {NULL, NULL}, info_fields = {NULL, NULL};
    PyObject *fqn = NULL, *offset = NULL, *path = NULL, *kept_path = NULL;
    PyObject *start = NULL, *length = NULL, *location = NULL, *kind = NULL, *chunks = NULL, *positions = NULL;
    int result = -1;
    if (record_fields(index, &index_fields) < 0 || record_fields(info, &info_fields) < 0)
        goto done;
    if ((fqn = field(&index_fields, s_fqn)) == NULL || (offset = field_or_none(&index_fields, s_offset)) == NULL)
        goto done;
    if (offset != Py_None) {
        PyObject *dims = shared_dims(shared, offset, fqn, s_what_offsets, 0);
        Py_SETREF(offset, dims);
        if (offset == NULL)
            goto done;
    }
    PyObject *raw_path = field(&info_fields, s_relative_path);
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
        if ((kept_path = PyObject_CallFunctionObjArgs(inside_path_fn, path, fqn, NULL)) == NULL)
            goto done;
        if (PyDict_SetItem(shared, path, kept_path) < 0)
            goto done;
    }
    if ((start = field(&info_fields, s_offset)) == NULL || (length = field(&info_fields, s_length)) == NULL)
        goto done;
    if (dcp_int64_size(start) < 0 || dcp_int64_size(length) < 0) {
        PyObject *pair = PyTuple_Pack(2, start, length);
        if (pair == NULL)
            goto done;
        PyObject *checked = PyObject_CallFunctionObjArgs(int64_dims_fn, pair, fqn, s_what_range, NULL);
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
    fields_clear(&index_fields);
    fields_clear(&info_fields);
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
static PyObject *attach(PyObject *module, PyObject *args) {
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

static PyObject *one_chunk(PyObject *chunk, PyObject *key, PyObject *shared, PyObject *counted) {
    Fields fields = {NULL, NULL};
    PyObject *raw = NULL, *offsets = NULL, *sizes = NULL, *result = NULL;
    if (record_fields(chunk, &fields) < 0 || (raw = field(&fields, s_offsets)) == NULL)
        goto done;
    if ((offsets = shared_dims(shared, raw, key, s_what_offsets, 0)) == NULL)
        goto done;
    Py_CLEAR(raw);
    if ((raw = field(&fields, s_sizes)) == NULL || (sizes = shared_dims(counted, raw, key, s_what_sizes, 1)) == NULL)
        goto done;
    result = new_triple(chunk_type, offsets, sizes, Py_None);  /* its location comes from attach() */
done:
    fields_clear(&fields);
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
    if (PyObject_TypeCheck(properties, tuple_state_record_type) && PyList_GET_SIZE(properties) == 1 &&
        PyTuple_CheckExact(PyList_GET_ITEM(properties, 0))) {  /* fields would be {"_ckd_state": state} */
        PyObject *state = PyList_GET_ITEM(properties, 0), *dtype = Py_None;
        if (PyTuple_GET_SIZE(state) > 0)
            dtype = PyTuple_GET_ITEM(state, 0);
        Py_INCREF(dtype);
        return dtype;
    }
    Fields fields = {NULL, NULL};
    PyObject *state = NULL, *dtype = NULL;
    if (record_fields(properties, &fields) < 0 || (state = field_or_none(&fields, s_ckd_state)) == NULL)
        goto done;
    int nonempty = PyTuple_Check(state) ? PyObject_IsTrue(state) : 0;
    if (nonempty < 0)
        goto done;
    dtype = nonempty ? PySequence_GetItem(state, 0) : field_or_none(&fields, s_dtype);
done:
    fields_clear(&fields);
    Py_XDECREF(state);
    return dtype;
}

/* One state_dict_metadata entry as an item_class instance (the body of dcp_index._items_py's loop). */
static PyObject *one_item(PyObject *key, PyObject *item_meta, PyObject *shared, PyObject *counted,
                          PyObject *item_class, int consume, PyObject *dtype_names) {
    Fields fields = {NULL, NULL};
    PyObject *chunks_meta = NULL, *chunks = NULL, *dtype = NULL, *raw = NULL, *shape = NULL;
    PyObject *result = NULL, *name;
    if (record_fields(item_meta, &fields) < 0 || (chunks_meta = field_or_none(&fields, s_chunks)) == NULL)
        goto done;
    if (chunks_meta == Py_None) {  /* BytesStorageMetadata */
        PyObject *chunk = new_triple(chunk_type, empty_tuple, empty_tuple, Py_None);
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
    PyObject *properties = field_or_none(&fields, s_properties);
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
    if ((raw = field(&fields, s_size)) == NULL || (shape = shared_dims(counted, raw, key, s_what_shape, 1)) == NULL)
        goto done;
    PyObject *call[] = {key, s_tensor, name, shape, chunks};
    result = PyObject_Vectorcall(item_class, call, 5, NULL);
done:
    fields_clear(&fields);
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
    PyObject *record, *tuple_record, *fields, *dims, *inside, *dtype_name, *chunk, *location;
    if (!PyArg_ParseTuple(args, "O!O!OOOOO!O!:setup", &PyType_Type, &record, &PyType_Type, &tuple_record, &fields,
                          &dims, &inside, &dtype_name, &PyType_Type, &chunk, &PyType_Type, &location))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)record, &PyList_Type) ||
        !PyType_IsSubtype((PyTypeObject *)tuple_record, (PyTypeObject *)record) ||
        !PyType_IsSubtype((PyTypeObject *)chunk, &PyTuple_Type) ||
        !PyType_IsSubtype((PyTypeObject *)location, &PyTuple_Type) ||
        ((PyTypeObject *)chunk)->tp_basicsize != PyTuple_Type.tp_basicsize ||
        ((PyTypeObject *)location)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "setup: two list subclasses and two slot-less tuple subclasses expected");
        return NULL;
    }
    PyObject **slots[] = {(PyObject **)&index_record_type, (PyObject **)&tuple_state_record_type, &fields_fn,
                          &int64_dims_fn, &inside_path_fn, &dtype_name_fn, (PyObject **)&chunk_type,
                          (PyObject **)&location_type};
    PyObject *values[] = {record, tuple_record, fields, dims, inside, dtype_name, chunk, location};
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
    return index_record_type == NULL ? not_set_up(module, args) : attach(module, args);
}

static PyObject *checked_items(PyObject *module, PyObject *args) {
    return index_record_type == NULL ? not_set_up(module, args) : items(module, args);
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, "Give the Python helpers and types the loops use (once, at import)."},
    {"attach", checked_attach, METH_VARARGS, "Set each chunk's StorageLocation from storage_data."},
    {"items", checked_items, METH_VARARGS, "state_dict_metadata -> {key: item_class(...)}."},
    {"compact_setstate", dcp_make_compact_setstate, METH_O, "The __setstate__ of index records (an instancemethod)."},
    {"tiles_once", dcp_tiles_once, METH_VARARGS, "Whether chunks are one grid's cells over shape, each once."},
    {"index_size", (PyCFunction)(void (*)(void))dcp_index_size, METH_FASTCALL,
     "What torch.Size builds in an index-only read: ().__add__(dims), one object per equal tuple of ints."},
    {"forget_index_sizes", dcp_forget_index_sizes, METH_NOARGS, "Empty index_size's table (after a load)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor._dcp_index", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dcp_index(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_fqn, "fqn"}, {&s_offset, "offset"}, {&s_relative_path, "relative_path"}, {&s_length, "length"},
        {&s_offsets, "offsets"}, {&s_sizes, "sizes"}, {&s_get, "get"}, {&s_popitem, "popitem"},
        {&s_items, "items"}, {&s_what_offsets, "offsets"}, {&s_what_sizes, "sizes"},
        {&s_what_range, "storage offset and length"}, {&s_what_shape, "global shape"}, {&s_chunks, "chunks"},
        {&s_clear, "clear"}, {&s_properties, "properties"}, {&s_ckd_state, "_ckd_state"}, {&s_dtype, "dtype"},
        {&s_size, "size"}, {&s_bytes, "bytes"}, {&s_tensor, "tensor"}, {&s_kind, "kind"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    }
    if (empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
