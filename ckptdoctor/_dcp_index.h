/* ckptdoctor._dcp_index: one extension module from three sources.
 *   _dcp_index.c     the module, setup() and the index loops (locations, items)
 *   _dcp_compact.c   compact index records: the __setstate__ of index-only DCP records and reading them
 *   _dcp_coverage.c  check's coverage test for chunks that are the cells of one grid (tiles_once)
 */
#ifndef CKPTDOCTOR_DCP_INDEX_H
#define CKPTDOCTOR_DCP_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* _dcp_compact.c */
int dcp_is_compact(PyObject *record);                                   /* [CompactKeys(names), values...] */
PyObject *dcp_compact_value(PyObject *record, PyObject *name);          /* borrowed; NULL (no error): none */
PyObject *dcp_make_compact_setstate(PyObject *module, PyObject *keys_type); /* compact_setstate(CompactKeys) */

/* _dcp_coverage.c */
PyObject *dcp_tiles_once(PyObject *module, PyObject *args); /* tiles_once(shape, chunks) -> bool */

#endif
