/* The resource pre-pass (_scan.c) of ckptdoctor.pickle._native: what it gives the module (_native.c). */
#ifndef CKPTDOCTOR_PICKLE_SCAN_H
#define CKPTDOCTOR_PICKLE_SCAN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

PyObject *native_scan(PyObject *module, PyObject *args); /* scan(data, max_depth, ...): see _scan.c */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
