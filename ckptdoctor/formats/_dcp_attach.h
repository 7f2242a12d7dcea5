/* The storage pass of the DCP index (_dcp_attach.c): what it gives the module (_dcp_index.c). */
#ifndef CKPTDOCTOR_DCP_ATTACH_H
#define CKPTDOCTOR_DCP_ATTACH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Shared by the sources of the module, not exported. */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

int dcp_attach_init(void);                              /* its interned names, at module init */
PyObject *dcp_attach(PyObject *module, PyObject *args); /* attach(storage_data, rows, consume, shared) */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
