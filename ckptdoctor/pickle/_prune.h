/* The memo pruning (_prune.c) of ckptdoctor.pickle._native: what it gives the module (_native.c). */
#ifndef CKPTDOCTOR_PICKLE_PRUNE_H
#define CKPTDOCTOR_PICKLE_PRUNE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

PyObject *native_pruned_reader(PyObject *module, PyObject *args); /* pruned_reader(data, release, drop_plans) */
int native_prune_ready(void);                                    /* PyType_Ready of the reader type */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
