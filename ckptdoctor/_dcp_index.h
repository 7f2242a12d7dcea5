/* ckptdoctor._dcp_index: one extension module from three sources.
 *   _dcp_index.c     the module, setup(), the record field readers and the loop over keys (items)
 *   _dcp_attach.c    the storage pass: storage_data entries set on the chunks they name (attach)
 * It reads the index records through the capsule of ckptdoctor.pickle._native (pickle/_records.h).
 *   _dcp_coverage.c  check's coverage test for chunks that are the cells of one grid (tiles_once)
 */
#ifndef CKPTDOCTOR_DCP_INDEX_H
#define CKPTDOCTOR_DCP_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include "pickle/_records.h"

/* type(value) is int and 0 <= value < 2**63: its value, else -1 (nothing raised: the caller decides). */
static inline int64_t dcp_int64_size(PyObject *value) {
    if (!PyLong_CheckExact(value))
        return -1;
    int overflow;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (number == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return overflow || number < 0 ? -1 : (int64_t)number;
}

/* _dcp_index.c: what the sources share (set by setup() and the module's init) */
typedef struct {           /* the fields of a record, as a view: its one state dict (what DCP writes), its compact */
    PyObject *dict;        /* values, or what fields(record) from Python gives for anything else; dict: owned, */
    PyObject *record;      /* or NULL for a compact record, whose values are read from record (borrowed) */
} DcpFields;
extern PyTypeObject *dcp_chunk_type, *dcp_location_type;           /* DcpChunk, StorageLocation */
extern const RecordsApi *dcp_records;                              /* the records' capsule (pickle/_records.h) */
extern PyObject *dcp_int64_dims_fn, *dcp_inside_path_fn, *dcp_empty_tuple; /* dcp_index.int64_dims, inside_path, () */
int dcp_record_fields(PyObject *record, DcpFields *fields);           /* 0, or -1 with an error */
void dcp_fields_clear(DcpFields *fields);
PyObject *dcp_field(DcpFields *fields, PyObject *name);               /* fields[name]: new reference */
PyObject *dcp_field_or_none(DcpFields *fields, PyObject *name);       /* fields.get(name): new reference */
PyObject *dcp_shared_dims(PyObject *cache, PyObject *raw, PyObject *key, PyObject *what, int counts);
PyObject *dcp_new_triple(PyTypeObject *type, PyObject *a, PyObject *b, PyObject *c); /* a DcpChunk/StorageLocation */
void dcp_trim_list(PyObject *list); /* an exact list's item array cut to its length (no error) */

/* _dcp_attach.c */
int dcp_attach_init(void);                              /* its interned names, at module init */
PyObject *dcp_attach(PyObject *module, PyObject *args); /* attach(storage_data, items, consume, shared) -> None */

/* _dcp_coverage.c */
PyObject *dcp_tiles_once(PyObject *module, PyObject *args); /* tiles_once(shape, chunks) -> bool */

#endif
