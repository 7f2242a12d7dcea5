/* Reading the index records of a DCP .metadata, for the DCP index's C (_dcp_index.c, _dcp_attach.c): their fields,
 * through the pickle engine's capsule (../pickle/_records.h), and their dims as _shared_dims shares and checks them.
 * The lowest part of ckptdoctor.formats._dcp_index: it runs no Python code. */
#ifndef CKPTDOCTOR_DCP_FIELDS_H
#define CKPTDOCTOR_DCP_FIELDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include "../pickle/_records.h"

/* Shared by the sources of the module, not exported. */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

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

extern const RecordsApi *dcp_records; /* the records' capsule (set by dcp_fields_init) */
typedef struct { /* the fields of a record: its state dict (borrowed), or the compact record itself */
    PyObject *dict, *record;
} DcpFields;
int dcp_record_fields(PyObject *record, DcpFields *fields);  /* 0, or DCP_STOP: a record C does not read */
PyObject *dcp_field(DcpFields *fields, PyObject *name);    /* borrowed; NULL without an error: none */
PyObject *dcp_dims_key(PyObject *dims);                    /* dcp_index.dims_key: bytes, NULL (no error): none */
PyObject *dcp_shared_dims(PyObject *cache, PyObject *raw, int counts); /* dcp_index._shared_dims; NULL: stop */
PyObject *dcp_triple(PyObject *a, PyObject *b, PyObject *c); /* a new exact tuple */

int dcp_fields_init(void); /* at module init: the records' capsule (ImportError where pickle._native was not built) */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
