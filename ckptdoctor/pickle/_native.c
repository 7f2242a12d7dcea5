/* The module ckptdoctor.pickle._native (see _native.h): its functions, each in the source of its part. */
#include "_native.h"

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
    PyModuleDef_HEAD_INIT, "ckptdoctor.pickle._native", "The pickle engine's native module (see _native.h).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (native_prune_ready() < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && native_records_ready(module) < 0) Py_CLEAR(module);
    return module;
}
