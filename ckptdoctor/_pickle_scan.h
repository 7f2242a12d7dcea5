/* ckptdoctor._pickle_scan: one extension module from five sources.
 *   _pickle_scan.c     the module and the pickle pre-pass (scan)
 *   _pickle_prune.c    memo pruning (prune_memo)
 *   _pickle_reader.c   the pruned pickle as a file to read (pruned_reader)
 *   _pickle_strings.c  equal strings read as one (the share_strings option of both)
 *   _pickle_plans.c    save plans left out of index-only reads (the drop_plans option of both)
 */
#ifndef CKPTDOCTOR_PICKLE_SCAN_H
#define CKPTDOCTOR_PICKLE_SCAN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Little-endian fixed-width arguments of pickle opcodes. */
static inline uint32_t read_u32(const unsigned char *b) {
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}

static inline uint64_t read_u64(const unsigned char *b) {
    return (uint64_t)read_u32(b) | ((uint64_t)read_u32(b + 4) << 32);
}

/* _pickle_prune.c, _pickle_reader.c */
PyObject *pickle_prune_memo(PyObject *module, PyObject *args);    /* prune_memo(data, share, drop) -> bytes, None */
PyObject *pickle_pruned_reader(PyObject *module, PyObject *args); /* pruned_reader(data, release, share, drop) */
int pickle_prune_ready(void);                                    /* PyType_Ready of the reader type */

#endif
