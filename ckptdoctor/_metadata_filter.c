/* ckptdoctor._metadata_filter: a .metadata with some keys left out, written from the source pickle's bytes.
 *
 * strip-frozen and edit (without renames) used to read the whole .metadata as objects, edit them and pickle them
 * again: at 200k keys ~470 MB for the records, the pickler's memo and its output. This filter never builds an
 * object. It walks the source pickle twice:
 *
 * 1. A stack simulation finds the containers a key is listed in (what ckptdoctor.formats.dcp_keys.edit_metadata
 *    edits): the Metadata object's state_dict_metadata, storage_data (keys: MetadataIndex objects, by their fqn),
 *    planner_data and mcore_data, and each SavePlan's items (WriteItem objects, by their index's fqn) and mcore_data
 *    under all_local_plans. Each item of those containers (a key and its value, or a list element) is the byte span
 *    from where its first object's construction begins to where the next one's begins (or the SETITEMS / APPENDS
 *    that takes them). An item whose key is not kept is removed, unless a memo entry written inside it is read from
 *    outside it by bytes that stay: then it is kept as garbage, built and popped (its objects are read later, so
 *    they must exist), but not put in its container. Kept storage items' _StorageInfo offsets are rewritten for a
 *    compacted copy (each data file's kept items back to back in (offset, length) order), and one item (the common
 *    state of core >= 0.19) can be pointed at a new file.
 * 2. The bytes are written again without the removed spans: memo writes renumbered (MEMOIZE counts entries), memo
 *    reads translated, frames rebuilt, the output streamed to a file descriptor in frames of 64 KiB.
 *
 * The source is read through a window of 8 MiB, front to back in each pass, and large tables live in maps of their
 * own (~10 bytes a memo entry, ~50 a key): the memory does not grow with the pickle's bytes. Each pass hashes every
 * byte of the file; where the two differ (the file changed), it declines.
 *
 * Anything this does not recognise for certain makes it decline ({"declined": why}): the caller then edits the
 * objects as before. It declines where a container is not built the plain way (an empty dict or list filled by batches on the
 * object's own construction), where an object of those classes is changed after it was made (a BUILD or item
 * assignment on a memo read), where a container appears twice or not at all, on opcodes with explicit text memo
 * indices, and on a storage item whose path, offset or length is not a plain value. The caller checks the counts it
 * returns (keys and storage items kept, and each data file's kept ranges) against its own index of the source.
 */
#include "_metadata_filter.h"

static PyObject *declined(const char *why) { return Py_BuildValue("{s:s}", "declined", why); }

/* The arguments into f: the kept keys, the repointed key. 0, or -1 with a Python error. */
static int filter_setup(Filter *f, int src_fd, PyObject *keep, PyObject *repoint, PyObject **key_bytes) {
    struct stat st;
    if (fstat(src_fd, &st) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    f->src.fd = src_fd;
    f->src.size = (Py_ssize_t)st.st_size;
    f->src.hash = 1469598103934665603ULL;
    PyObject *iter = PyObject_GetIter(keep), *item;
    if (iter == NULL) return -1;
    while ((item = PyIter_Next(iter)) != NULL) {
        int r = hashset_add_str(&f->keep, item);
        Py_DECREF(item);
        if (r < 0) break;
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) return -1;
    if (repoint == Py_None) return 0;
    PyObject *rkey, *rpath;
    long long rlength;
    if (!PyArg_ParseTuple(repoint, "UUL:repoint", &rkey, &rpath, &rlength)) return -1;
    *key_bytes = PyUnicode_AsEncodedString(rkey, "utf-8", "surrogatepass");
    f->repoint_path = PyUnicode_AsEncodedString(rpath, "utf-8", "surrogatepass");
    if (*key_bytes == NULL || f->repoint_path == NULL) return -1;
    f->repoint_key = (const unsigned char *)PyBytes_AS_STRING(*key_bytes);
    f->repoint_key_len = PyBytes_GET_SIZE(*key_bytes);
    f->repoint_length = rlength;
    return 0;
}

/* Pass 1 and what follows it: 1 to write, 0 declined (f->why), -1 with a Python error. */
static int plan(Filter *f, PyObject *expected, PyObject *sizes, int repointing) {
    int r = pass1(f);
    if (r <= 0) return r;
    if (f->n_meta != 1 || f->n_sdm != 1 || f->n_sd != 1)
        DECLINE(f, "not one Metadata object with one state_dict_metadata and one storage_data");
    if (repointing && f->n_repointed != 1) DECLINE(f, "the repointed key has not exactly one storage item");
    settle_liveness(f);
    qsort(f->edits, (size_t)f->n_edits, sizeof(Edit), cmp_edit);
    for (Py_ssize_t i = 1; i < f->n_edits; i++)
        if (f->edits[i].pos < f->edits[i - 1].end || f->edits[i].pos == f->edits[i - 1].pos) DECLINE(f, "edits overlap");
    return f->compact ? compact_layout(f, expected, sizes) : 1;
}

static PyObject *filter_metadata(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *keep, *expected, *repoint;
    int src_fd, out_fd;
    if (!PyArg_ParseTuple(args, "iOOOi:filter_metadata", &src_fd, &keep, &expected, &repoint, &out_fd)) return NULL;
    if (expected != Py_None && !PyDict_Check(expected)) {
        PyErr_SetString(PyExc_TypeError, "filter_metadata: expected must be a dict or None");
        return NULL;
    }
    Filter f;
    memset(&f, 0, sizeof(f));
    f.compact = expected != Py_None;
    PyObject *result = NULL, *sizes = PyDict_New(), *key_bytes = NULL;
    Py_ssize_t written = 0;
    uint64_t hash1, hash2;
    if (sizes == NULL || filter_setup(&f, src_fd, keep, repoint, &key_bytes) < 0) goto done;
    if (f.src.size >= (Py_ssize_t)UINT32_MAX) { /* positions are kept in 32 bits */
        result = declined("4 GiB or more");
        goto done;
    }
    int r = plan(&f, expected, sizes, repoint != Py_None);
    if (r < 0 || source_rewind(&f.src, &hash1) < 0) goto done;
    if (r == 0) {
        result = declined(f.why ? f.why : "declined");
        goto done;
    }
    if (out_fd >= 0) { /* else the counts only (a check of a pickle the filter wrote) */
        r = write_output(&f, out_fd, &written);
        if (r < 0 || source_rewind(&f.src, &hash2) < 0) goto done;
        if (r == 0 && hash1 != hash2) {
            f.why = "the file changed between the passes";
            r = 1;
        }
        if (r == 1) {
            result = declined(f.why);
            goto done;
        }
    }
    Py_ssize_t live = 0;
    for (Py_ssize_t i = 0; i < f.n_dropped; i++) live += f.dropped[i].live;
    result = Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:O}", "bytes", written, "keys_kept", f.sdm_kept,
                           "keys_dropped", f.sdm_dropped, "storage_kept", f.sd_kept, "storage_dropped", f.sd_dropped,
                           "other_dropped", f.other_dropped, "garbage_items", live, "repointed", f.n_repointed,
                           "file_sizes", sizes);
done:
    Py_XDECREF(sizes);
    Py_XDECREF(key_bytes);
    filter_clear(&f);
    return result;
}

static PyMethodDef methods[] = {
    {"filter_metadata", filter_metadata, METH_VARARGS,
     "filter_metadata(src_fd, keep, expected, repoint, out_fd): write the .metadata pickle read from src_fd to "
     "out_fd with only the keys in keep; expected: {file: int64 (offset, length) pairs} to compact storage offsets, "
     "or None; repoint: (key, path, length) or None; out_fd -1: the counts only, nothing written. Returns the counts, "
     "or {'declined': why} (what was written to out_fd, if anything, is not to be used)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptdoctor._metadata_filter", "A .metadata with keys left out, from its bytes.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__metadata_filter(void) { return PyModule_Create(&module_def); }
