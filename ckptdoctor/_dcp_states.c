/* The BUILD states torch's loader refuses, for ckptdoctor._dcp_index (see _dcp_index.h): what the C unpickler's
 * load_build refuses for a DCP dataclass (no __setstate__), what TensorProperties.__setstate__ cannot unpack, and
 * the dims torch.Size refuses. The same checks and messages as stand_ins.build_state, stand_ins.check_properties_state
 * and torch_stand_ins.check_size_items, for the index records' __setstate__ (compact_setstate in _dcp_compact.c),
 * the index loop (_dcp_index.c) and index_size (_dcp_compact.c). */
#include "_dcp_index.h"

/* -1 with pickle.UnpicklingError(message) set. */
static int unpickling_error(const char *message) {
    static PyObject *error;
    if (error == NULL) {
        PyObject *pickle = PyImport_ImportModule("pickle");
        error = pickle == NULL ? NULL : PyObject_GetAttrString(pickle, "UnpicklingError");
        Py_XDECREF(pickle);
        if (error == NULL)
            return -1;
    }
    PyErr_SetString(error, message);
    return -1;
}

/* -1 with pickle.UnpicklingError set where the C unpickler's BUILD refuses state for an object without
 * __setstate__ (a DCP dataclass), as stand_ins.build_state says: a state that is not a dict (or None), or a
 * (state, slot state) pair whose state is not a dict (or None) or whose slot state is not a dict. Checked at each
 * BUILD of a record whose state must be a dict, so a record the index never reads (one inside a kept save plan
 * part) is refused as torch refuses it. */
int dcp_refuse_build_state(PyObject *state) {
    PyObject *slots = NULL;
    if (PyTuple_Check(state) && PyTuple_GET_SIZE(state) == 2) {
        slots = PyTuple_GET_ITEM(state, 1);
        state = PyTuple_GET_ITEM(state, 0);
    }
    if (state != Py_None && !PyDict_Check(state))
        return unpickling_error("state is not a dictionary");
    if (slots != NULL && !PyDict_Check(slots))
        return unpickling_error("slot state is not a dictionary");
    return 0;
}

/* A TensorProperties state other than a dict, as stand_ins.check_properties_state checks it (the same message):
 * five values (a tuple or a list), as torch's __setstate__ unpacks them. */
int dcp_refuse_properties_state(PyObject *state) {
    if (!(PyTuple_Check(state) || PyList_Check(state)) || PySequence_Fast_GET_SIZE(state) != 5)
        return unpickling_error(
            "TensorProperties state is not 5 values (dtype, layout, requires_grad, memory format, pin_memory)");
    return 0;
}

/* -1 with torch.Size's own error where it refuses dims (torch_stand_ins.check_size_items, the same messages): an
 * item that is not an int (bools are), or one outside int64. */
int dcp_refuse_size_items(PyObject *dims) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dims); i++) {
        PyObject *item = PyTuple_GET_ITEM(dims, i);
        if (!PyLong_Check(item)) {
            PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(item), "__name__");
            if (name != NULL)
                PyErr_Format(PyExc_TypeError, "torch.Size() takes an iterable of 'int' (item %zd is '%U')", i, name);
            Py_XDECREF(name);
            return -1;
        }
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) { /* torch: "Overflow when unpacking long long" */
            PyObject *bits = PyObject_CallMethod(item, "bit_length", NULL);
            if (bits != NULL)
                PyErr_Format(PyExc_ValueError, "torch.Size item %zd is an int of %S bits, not an int64", i, bits);
            Py_XDECREF(bits);
            return -1;
        }
        if (value == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}
