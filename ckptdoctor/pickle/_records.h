/* The index records (_records.c) of ckptdoctor.pickle._native: the functions they give the module (_native.c), and
 * what they give the DCP index's C (ckptdoctor.formats._dcp_index), C to C and one way: the capsule
 * ckptdoctor.pickle._native.records_api holds a RecordsApi. Its functions run no Python code. */
#ifndef CKPTDOCTOR_PICKLE_RECORDS_H
#define CKPTDOCTOR_PICKLE_RECORDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define RECORDS_API_NAME "ckptdoctor.pickle._native.records_api"

typedef struct {
    PyTypeObject **index_record, **tuple_state_record, **record; /* index_records' types and stand_ins.Record
                                                                 (NULL: not set up) */
    int (*is_compact)(PyObject *record);                       /* [CompactKeys(names), values...] */
    PyObject *(*compact_value)(PyObject *record, PyObject *name); /* borrowed; NULL (no error): none */
    int (*refuse_properties_state)(PyObject *state); /* -1 with torch's error for a TensorProperties tuple state */
} RecordsApi;

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

PyObject *native_records_setup(PyObject *module, PyObject *args); /* records_setup(CompactKeys, ...) */
PyObject *native_index_size(PyObject *module, PyObject *const *args, Py_ssize_t nargs);    /* index_size(dims) */
PyObject *native_faithful_size(PyObject *module, PyObject *const *args, Py_ssize_t nargs); /* (cls, dims) */
PyObject *native_forget_index_sizes(PyObject *module, PyObject *ignored);                 /* forget_index_sizes() */
int native_records_ready(PyObject *module); /* its names and the records_api capsule */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
