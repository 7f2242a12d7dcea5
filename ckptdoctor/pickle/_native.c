/* ckptdoctor.pickle._native: the pickle engine's native module (optional; ckptdoctor/pickle/ has the Python twin of
 * each part, which stays the reference: tests/test_pickle_scan_accel.py, test_memo_prune.py, test_plan_drops.py,
 * test_dcp_index_accel.py and fuzz/fuzz_native.py compare them).
 *   _native.c   the module (this file: its functions, each in the source of its part, which declares it in
 *               its header: _scan.h, _prune.h, _records.h)
 *   _scan.c     the resource pre-pass (scan; scanner.py)
 *   _prune.c    memo pruning (pruned_reader; unpickler.py)
 *   _plans.c    megatron-core's save plans left out of index-only reads (their drop_plans option)
 *   _records.c  index records: their BUILD (records_setup gives compact_setstate), what it refuses as torch
 *               does, torch.Size (index_size, faithful_size; index_records.py, policy.py); _records.h: the
 *               capsule through which the DCP index's C (ckptdoctor.formats._dcp_index) reads the records
 *   _opcode_read.h  reading one opcode (its arguments, its class and end), below every part; _opcodes.h, the
 *               opcodes, generated from pickletools by scripts/gen_opcodes.py
 */
#include "_prune.h"
#include "_records.h"
#include "_scan.h"

static PyMethodDef methods[] = {
    {"scan", native_scan, METH_VARARGS,
     "scan(data, max_depth, max_string, max_int, max_hashed_keys, safe_hash): the pre-pass of scanner.py; None, "
     "(kind, message) or -1 (the Python walk decides)."},
    {"pruned_reader", native_pruned_reader, METH_VARARGS,
     "pruned_reader(data, release=False, drop_plans=False): the pickle without its unread memo entries as a file to "
     "read from (read, readline), or None where it is left alone (see _prune.c)."},
    {"records_setup", native_records_setup, METH_VARARGS,
     "records_setup(CompactKeys, IndexRecord, IndexTupleStateRecord, Record): the __setstate__ of index records "
     "(an instancemethod; see _records.c)."},
    {"index_size", (PyCFunction)(void (*)(void))native_index_size, METH_FASTCALL,
     "What torch.Size builds in an index-only read: ().__add__(dims), one object per equal tuple of ints."},
    {"faithful_size", (PyCFunction)(void (*)(void))native_faithful_size, METH_FASTCALL,
     "What torch.Size builds in a faithful read: cls(dims), one object per equal tuple of ints."},
    {"forget_index_sizes", native_forget_index_sizes, METH_NOARGS, "Empty the tables of shared tuples (around a load)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor.pickle._native", "The pickle engine's native module (see _native.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (native_prune_ready() < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && native_records_ready(module) < 0) Py_CLEAR(module);
    return module;
}
