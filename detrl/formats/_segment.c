/* The rounding log's record encoding (detrl/formats/roundlog.py, encode_segment) in one C call a step.
 *
 * A step's records are a few numpy calls each in Python (validation, deltas, byte planes, packed bits): on a
 * DQN step of five logged ops that was as much as the rest of the bundle's append. This writes the same
 * bytes for the entries the engine writes (every array 1-D, C-contiguous and of its exact dtype: int64
 * indices, bool directions, float32 pinned values, uint16 short bits) and returns None for anything else,
 * valid or not, so that the Python encoder, the reference, validates it and says what is wrong.
 * tests/test_roundlog.py holds the two byte for byte equal on random steps.
 *
 * Layout (docs/roundlog.md): per record, op u32 | count u32 | width u8 (4 or 8, | 0x80 pinned, | 0x40
 * short), then the delta-coded indices in `width` byte planes, then the payload: direction bits packed
 * MSB-first, or FP32 values in 4 byte planes, or low 16 key bits in 2. Per op: direction, pinned, short;
 * ops with no entry write nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_HEADER 9
#define PINNED_FLAG 0x80
#define SHORT_FLAG 0x40

/* One array attribute of an OpEntries, as a buffer of `count` elements. */
typedef struct {
    Py_buffer view;
    int held;
} Array;

static void release(Array *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

/* Whether format `f` (a buffer's struct format) is one of the accepted spellings. */
static int format_is(const char *f, const char *a, const char *b) {
    if (f == NULL) return 0;
    return strcmp(f, a) == 0 || (b != NULL && strcmp(f, b) == 0);
}

/* Takes attribute `name` of `e` as a 1-D C-contiguous array of `itemsize`-byte items in one of the formats;
 * 0 where it is not one (no exception left set), -1 on an error to raise. */
static int take_array(PyObject *e, PyObject *name, Py_ssize_t itemsize, const char *f1, const char *f2, Array *a) {
    PyObject *obj = PyObject_GetAttr(e, name);
    if (obj == NULL) return -1;
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_DECREF(obj);
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(obj); /* the buffer holds the object */
    a->held = 1;
    if (a->view.ndim != 1 || a->view.itemsize != itemsize || !format_is(a->view.format, f1, f2)) {
        release(a);
        return 0;
    }
    return 1;
}

static Py_ssize_t count_of(const Array *a) { return a->view.shape[0]; }

/* Whether indices (n) are >= 0 and strictly increasing: the deltas the format needs. Writes the largest
 * delta (the first index counts as one) to *largest. */
static int increasing(const int64_t *idx, Py_ssize_t n, uint64_t *largest) {
    if (n && idx[0] < 0) return 0;
    uint64_t top = n ? (uint64_t)idx[0] : 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (idx[i] <= idx[i - 1]) return 0;
        uint64_t d = (uint64_t)idx[i] - (uint64_t)idx[i - 1];
        if (d > top) top = d;
    }
    *largest = top;
    return 1;
}

/* Whether two strictly increasing index arrays share no element. */
static int disjoint(const int64_t *a, Py_ssize_t na, const int64_t *b, Py_ssize_t nb) {
    Py_ssize_t i = 0, j = 0;
    while (i < na && j < nb) {
        if (a[i] == b[j]) return 0;
        if (a[i] < b[j]) i++;
        else j++;
    }
    return 1;
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int k = 0; k < 4; k++) p[k] = (uint8_t)(v >> (8 * k));
}

/* The record's header and delta planes; returns the end of what it wrote. */
static uint8_t *write_indices(uint8_t *p, uint32_t op, const int64_t *idx, Py_ssize_t n, int width, int flag) {
    put_u32(p, op);
    put_u32(p + 4, (uint32_t)n);
    p[8] = (uint8_t)(width | flag);
    p += RECORD_HEADER;
    for (int b = 0; b < width; b++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t d = (uint64_t)(i ? idx[i] - idx[i - 1] : idx[0]);
            *p++ = (uint8_t)(d >> (8 * b));
        }
    }
    return p;
}

/* Little-endian bytes of n items of `size` bytes, in `size` planes. */
static uint8_t *write_planes(uint8_t *p, const uint8_t *items, Py_ssize_t n, int size) {
    for (int b = 0; b < size; b++) {
        for (Py_ssize_t i = 0; i < n; i++) *p++ = items[i * size + b];
    }
    return p;
}

typedef struct {
    uint32_t op;
    Array idx, up, pidx, pvals, sidx, sbits;
    int width[3];
} Op;

static void release_op(Op *o) {
    release(&o->idx), release(&o->up), release(&o->pidx), release(&o->pvals), release(&o->sidx),
        release(&o->sbits);
}

static int width_of(uint64_t largest) { return largest < ((uint64_t)1 << 32) ? 4 : 8; }

/* encode_records(ops) -> (payload bytes, number of records), or None where an op is not what the engine
 * writes (then the Python encoder decides). ops: a list of OpEntries in strictly increasing op order. */
static PyObject *encode_records(PyObject *self, PyObject *arg) {
    static PyObject *names[7];
    static const char *const spelled[7] = {"op", "indices", "up", "pinned_indices", "pinned_values",
                                           "short_indices", "short_bits"};
    if (names[6] == NULL) { /* the last one set last: a failure part way leaves it NULL, and the next call retries */
        for (int k = 0; k < 7; k++) {
            if (names[k] != NULL) continue;
            names[k] = PyUnicode_InternFromString(spelled[k]);
            if (names[k] == NULL) return NULL;
        }
    }
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) Py_RETURN_NONE; /* the byte planes below are little-endian's */
    if (!PyList_Check(arg)) Py_RETURN_NONE;
    PyObject *items = PyList_AsTuple(arg); /* holds the entries, whatever happens to the list */
    if (items == NULL) return NULL;
    Py_ssize_t n_ops = PyTuple_GET_SIZE(items);
    Op *ops = PyMem_Calloc(n_ops ? (size_t)n_ops : 1, sizeof(Op));
    if (ops == NULL) {
        Py_DECREF(items);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    int ok = 1;
    Py_ssize_t size = 0, records = 0;
    long long prev = -1;
    for (Py_ssize_t k = 0; k < n_ops && ok; k++) {
        PyObject *e = PyTuple_GET_ITEM(items, k);
        Op *o = &ops[k];
        PyObject *op = PyObject_GetAttr(e, names[0]);
        if (op == NULL) goto fail;
        if (!PyLong_CheckExact(op)) {
            Py_DECREF(op);
            ok = 0;
            break;
        }
        long long v = PyLong_AsLongLong(op);
        Py_DECREF(op);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        if (v <= prev || v >= ((long long)1 << 32)) { /* out of order or range: the reference says so */
            ok = 0;
            break;
        }
        prev = v;
        o->op = (uint32_t)v;
        int got;
        /* numpy spells int64 "l" (LP64) or "q"; bool "?"; float32 "f"; uint16 "H" */
        if ((got = take_array(e, names[1], 8, "l", "q", &o->idx)) <= 0 ||
            (got = take_array(e, names[2], 1, "?", NULL, &o->up)) <= 0 ||
            (got = take_array(e, names[3], 8, "l", "q", &o->pidx)) <= 0 ||
            (got = take_array(e, names[4], 4, "f", NULL, &o->pvals)) <= 0 ||
            (got = take_array(e, names[5], 8, "l", "q", &o->sidx)) <= 0 ||
            (got = take_array(e, names[6], 2, "H", NULL, &o->sbits)) <= 0) {
            if (got < 0) goto fail;
            ok = 0;
            break;
        }
        Py_ssize_t n = count_of(&o->idx), np_ = count_of(&o->pidx), ns = count_of(&o->sidx);
        if (count_of(&o->up) != n || count_of(&o->pvals) != np_ || count_of(&o->sbits) != ns ||
            (uint64_t)n >= ((uint64_t)1 << 32) || (uint64_t)np_ >= ((uint64_t)1 << 32) ||
            (uint64_t)ns >= ((uint64_t)1 << 32)) {
            ok = 0;
            break;
        }
        const int64_t *idx = o->idx.view.buf, *pidx = o->pidx.view.buf, *sidx = o->sidx.view.buf;
        uint64_t l0, l1, l2;
        if (!increasing(idx, n, &l0) || !increasing(pidx, np_, &l1) || !increasing(sidx, ns, &l2) ||
            !disjoint(pidx, np_, idx, n) || !disjoint(sidx, ns, idx, n) || !disjoint(sidx, ns, pidx, np_)) {
            ok = 0;
            break;
        }
        const uint8_t *up = o->up.view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (up[i] > 1) { /* a bool array holds 0 or 1; anything else is not numpy's bool */
                ok = 0;
                break;
            }
        }
        if (!ok) break;
        o->width[0] = width_of(l0), o->width[1] = width_of(l1), o->width[2] = width_of(l2);
        /* each count is below 2**32 and each item at most 12 bytes: an op adds under 2**38 bytes, so the
         * total is checked against PY_SSIZE_T_MAX before it could wrap */
        uint64_t op_size = (n ? RECORD_HEADER + (uint64_t)n * o->width[0] + ((uint64_t)n + 7) / 8 : 0) +
                           (np_ ? RECORD_HEADER + (uint64_t)np_ * (o->width[1] + 4) : 0) +
                           (ns ? RECORD_HEADER + (uint64_t)ns * (o->width[2] + 2) : 0);
        if (op_size > (uint64_t)PY_SSIZE_T_MAX - (uint64_t)size) {
            ok = 0;
            break;
        }
        size += (Py_ssize_t)op_size;
        records += (n != 0) + (np_ != 0) + (ns != 0);
    }
    if (!ok) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, size);
    if (result == NULL) goto fail;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(result);
    for (Py_ssize_t k = 0; k < n_ops; k++) {
        Op *o = &ops[k];
        Py_ssize_t n = count_of(&o->idx), np_ = count_of(&o->pidx), ns = count_of(&o->sidx);
        if (n) {
            p = write_indices(p, o->op, o->idx.view.buf, n, o->width[0], 0);
            const uint8_t *up = o->up.view.buf;
            for (Py_ssize_t i = 0; i < n; i += 8) {
                uint8_t byte = 0;
                for (Py_ssize_t j = 0; j < 8 && i + j < n; j++) byte |= (uint8_t)(up[i + j] << (7 - j));
                *p++ = byte;
            }
        }
        if (np_) {
            p = write_indices(p, o->op, o->pidx.view.buf, np_, o->width[1], PINNED_FLAG);
            p = write_planes(p, o->pvals.view.buf, np_, 4);
        }
        if (ns) {
            p = write_indices(p, o->op, o->sidx.view.buf, ns, o->width[2], SHORT_FLAG);
            p = write_planes(p, o->sbits.view.buf, ns, 2);
        }
    }
    {
        PyObject *pair = Py_BuildValue("(Nn)", result, records);
        result = pair;
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    for (Py_ssize_t k = 0; k < n_ops; k++) release_op(&ops[k]); /* unheld arrays are zero: left alone */
    PyMem_Free(ops);
    Py_DECREF(items);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_records", encode_records, METH_O,
     "encode_records(ops) -> (payload, records) or None: a step's log records, as roundlog.encode_segment "
     "encodes them before compression"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_segment", NULL, -1, methods};

PyMODINIT_FUNC PyInit__segment(void) { return PyModule_Create(&module); }
