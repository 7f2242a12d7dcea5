/* ckptdoctor.formats._dcp_index: the loops of formats/dcp_index.py that build the index of a DCP .metadata, in C,
 * one way (nothing of Python is given to it, it calls no Python code): it reads the records the safe unpickler
 * built (through the pickle engine's capsule, ../pickle/_records.h) and returns rows of plain values, which
 * dcp_index.py checks and makes into its types. It handles the records DCP writes and stops at anything else
 * (a record of another form, a value the index refuses): dcp_index.py's own loops go on from there, so the
 * results and errors are theirs by construction (tests/test_dcp_index_accel.py and fuzz/fuzz_native.py compare).
 *   _dcp_index.c     the module, the record readers, the loop over keys (items)
 *   _dcp_attach.c    the storage pass (attach)
 */
#ifndef CKPTDOCTOR_DCP_INDEX_H
#define CKPTDOCTOR_DCP_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include "../pickle/_records.h"

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

/* A stop: what the C leaves to dcp_index.py (NULL or -2 without an error; NULL or -1 with one is an error). */
#define DCP_STOP (-2)

/* _dcp_index.c */
extern const RecordsApi *dcp_records; /* the records' capsule */
typedef struct { /* the fields of a record: its state dict (borrowed), or the compact record itself */
    PyObject *dict, *record;
} DcpFields;
int dcp_record_fields(PyObject *record, DcpFields *fields);  /* 0, or DCP_STOP: a record C does not read */
PyObject *dcp_field(DcpFields *fields, PyObject *name);    /* borrowed; NULL without an error: none */
PyObject *dcp_dims_key(PyObject *dims);                    /* dcp_index.dims_key: bytes, NULL (no error): none */
PyObject *dcp_shared_dims(PyObject *cache, PyObject *raw, int counts); /* dcp_index._shared_dims; NULL: stop */
PyObject *dcp_triple(PyObject *a, PyObject *b, PyObject *c); /* a new exact tuple */

/* _dcp_attach.c */
int dcp_attach_init(void);                              /* its interned names, at module init */
PyObject *dcp_attach(PyObject *module, PyObject *args); /* attach(storage_data, rows, consume, shared) */

#endif
