/* check's coverage test for chunks that are the cells of one grid, for ckptdoctor.formats._dcp_index (see _dcp_index.h). */
#include "_dcp_index.h"

#include <stdint.h>
#include <stdlib.h>

#define MAX_TILE_DIMS 64

static int compare_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Index of value in sorted[0, n), or -1. */
static Py_ssize_t find_u64(const uint64_t *sorted, Py_ssize_t n, uint64_t value) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && sorted[lo] == value ? lo : -1;
}

/* 1: every chunk has the shape's dims, sizes > 0, lies inside the shape, spans exactly one cell of the grid cut
 * at every chunk boundary, no two share a cell, and there are as many chunks as cells (so they tile the shape
 * once); 0: anything else, including what is not a tuple of int64 sizes (the Python rule decides those). */
static int grid_tiled_once(PyObject *shape, PyObject *chunks) {
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape), n = PyList_GET_SIZE(chunks);
    if (ndim == 0 || ndim > MAX_TILE_DIMS || n == 0 || n > PY_SSIZE_T_MAX / (2 * ndim) - 2)
        return 0;
    uint64_t dims[MAX_TILE_DIMS];
    for (Py_ssize_t a = 0; a < ndim; a++) {
        int64_t d = dcp_int64_size(PyTuple_GET_ITEM(shape, a));
        if (d < 0)
            return 0;
        dims[a] = (uint64_t)d;
    }
    /* starts[c * ndim + a], ends likewise; then per axis the cut points: 0, the dim, every start and end */
    uint64_t *starts = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n * ndim));
    uint64_t *ends = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n * ndim));
    uint64_t *cuts = PyMem_Malloc(sizeof(uint64_t) * (size_t)(2 * n + 2));
    unsigned char *seen = PyMem_Calloc((size_t)n / 8 + 1, 1);
    Py_ssize_t *cell = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    int tiled = 0;
    if (starts == NULL || ends == NULL || cuts == NULL || seen == NULL || cell == NULL)
        goto done;  /* no memory: the Python rule decides (and reports it if it must) */
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *chunk = PyList_GET_ITEM(chunks, c);
        if (!PyTuple_Check(chunk) || PyTuple_GET_SIZE(chunk) < 2)
            goto done;
        PyObject *offsets = PyTuple_GET_ITEM(chunk, 0), *sizes = PyTuple_GET_ITEM(chunk, 1);
        if (!PyTuple_Check(offsets) || !PyTuple_Check(sizes) || PyTuple_GET_SIZE(offsets) != ndim ||
            PyTuple_GET_SIZE(sizes) != ndim)
            goto done;
        for (Py_ssize_t a = 0; a < ndim; a++) {
            int64_t o = dcp_int64_size(PyTuple_GET_ITEM(offsets, a)), z = dcp_int64_size(PyTuple_GET_ITEM(sizes, a));
            /* both < 2**63, so o + z fits in uint64 */
            if (o < 0 || z <= 0 || (uint64_t)o + (uint64_t)z > dims[a])
                goto done;
            starts[c * ndim + a] = (uint64_t)o;
            ends[c * ndim + a] = (uint64_t)o + (uint64_t)z;
        }
    }
    Py_ssize_t cells = 1;
    for (Py_ssize_t a = 0; a < ndim; a++) {
        Py_ssize_t m = 0;
        cuts[m++] = 0;
        cuts[m++] = dims[a];
        for (Py_ssize_t c = 0; c < n; c++) {
            cuts[m++] = starts[c * ndim + a];
            cuts[m++] = ends[c * ndim + a];
        }
        qsort(cuts, (size_t)m, sizeof(uint64_t), compare_u64);
        Py_ssize_t unique = 0;
        for (Py_ssize_t i = 0; i < m; i++)
            if (unique == 0 || cuts[unique - 1] != cuts[i])
                cuts[unique++] = cuts[i];
        Py_ssize_t spans = unique - 1;
        if (spans < 1 || cells > n / spans)  /* more cells than chunks: not a tiling of one chunk per cell */
            goto done;
        cells *= spans;
        for (Py_ssize_t c = 0; c < n; c++) {
            Py_ssize_t i = find_u64(cuts, unique, starts[c * ndim + a]);
            if (i < 0 || i + 1 >= unique || cuts[i + 1] != ends[c * ndim + a])
                goto done;  /* spans more than one cell: the Python mapping decides */
            cell[c] = cell[c] * spans + i;
        }
    }
    if (cells != n)
        goto done;
    for (Py_ssize_t c = 0; c < n; c++) {
        if (seen[cell[c] / 8] & (1u << (cell[c] % 8)))
            goto done;
        seen[cell[c] / 8] |= (unsigned char)(1u << (cell[c] % 8));
    }
    tiled = 1;
done:
    PyMem_Free(starts);
    PyMem_Free(ends);
    PyMem_Free(cuts);
    PyMem_Free(seen);
    PyMem_Free(cell);
    return tiled;
}

PyObject *dcp_tiles_once(PyObject *module, PyObject *args) {
    PyObject *shape, *chunks;
    if (!PyArg_ParseTuple(args, "O!O!:tiles_once", &PyTuple_Type, &shape, &PyList_Type, &chunks))
        return NULL;
    return PyBool_FromLong(grid_tiled_once(shape, chunks));
}
