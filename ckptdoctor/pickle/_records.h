/* What the index records give the DCP index's C (ckptdoctor.formats._dcp_index), C to C and one way: the capsule
 * ckptdoctor.pickle._native.records_api (_records.c) holds a RecordsApi. Its functions run no Python code. */
#ifndef CKPTDOCTOR_PICKLE_RECORDS_H
#define CKPTDOCTOR_PICKLE_RECORDS_H

#define RECORDS_API_NAME "ckptdoctor.pickle._native.records_api"

typedef struct {
    PyTypeObject **index_record, **tuple_state_record, **record; /* index_records' types and stand_ins.Record
                                                                 (NULL: not set up) */
    int (*is_compact)(PyObject *record);                       /* [CompactKeys(names), values...] */
    PyObject *(*compact_value)(PyObject *record, PyObject *name); /* borrowed; NULL (no error): none */
    int (*refuse_properties_state)(PyObject *state); /* -1 with torch's error for a TensorProperties tuple state */
} RecordsApi;

#endif
