/* The rounding log's record encoding (detrl/formats/roundlog.py, encode_segment) in one C call a step.
 *
 * A step's records are a few numpy calls each in Python (validation, deltas, byte planes, packed bits): on a
 * DQN step of five logged ops that was as much as the rest of the bundle's append. This writes the same
 * bytes for the entries the engine writes (every array 1-D, C-contiguous and of its exact dtype: int64
 * indices, bool directions, float32 pinned values, uint16 short bits) and returns None for anything else,
 * valid or not, so that the Python encoder, the reference, validates it and says what is wrong.
 * tests/test_roundlog.py holds the two byte for byte equal on random steps.
 *
 * Layout (docs/roundlog.md), version 4: per record, op u32 | count u32 | kind u8 (the Rice parameter k,
 * | 0x80 pinned, | 0x40 short) | unary u32, then the Rice code of the index gaps (the first index, then
 * each index minus the one before minus 1): the quotients gap >> k in unary (`unary` bytes), then the
 * remainders' low k bits back to back; then the payload: direction bits packed MSB-first, or FP32 values in
 * 4 byte planes, or low 16 key bits in 2. Version 3 (a resumed older recording): op u32 | count u32 |
 * width u8 (4 or 8, | flags), the deltas in `width` byte planes, then the payload. Per op: direction,
 * pinned, short; ops with no entry write nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_HEADER_V3 9
#define RECORD_HEADER 13
#define RICE_MAX 62
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

/* A version-3 record's header and delta planes; returns the end of what it wrote. */
static uint8_t *write_indices_v3(uint8_t *p, uint32_t op, const int64_t *idx, Py_ssize_t n, int width, int flag) {
    put_u32(p, op);
    put_u32(p + 4, (uint32_t)n);
    p[8] = (uint8_t)(width | flag);
    p += RECORD_HEADER_V3;
    for (int b = 0; b < width; b++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t d = (uint64_t)(i ? idx[i] - idx[i - 1] : idx[0]);
            *p++ = (uint8_t)(d >> (8 * b));
        }
    }
    return p;
}

/* Gap i of strictly increasing indices >= 0: the first index, then each minus the one before minus 1. */
static uint64_t gap(const int64_t *idx, Py_ssize_t i) {
    return i ? (uint64_t)idx[i] - (uint64_t)idx[i - 1] - 1 : (uint64_t)idx[0];
}

/* D(k) = sum(gap >> k) - sum(gap >> (k + 1)) over the n gaps (at most the last index, below 2**63). */
static uint64_t rice_drop(const int64_t *idx, Py_ssize_t n, int k) {
    uint64_t d = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t g = gap(idx, i);
        d += (g >> k) - (g >> (k + 1));
    }
    return d;
}

/* The Rice parameter of roundlog.rice_parameter: the smallest k with D(k) <= n (D never grows with k, so
 * the code's length n * (k + 1) + sum(gap >> k) is least there). Searched from the k of the mean gap. */
static int rice_parameter(const int64_t *idx, Py_ssize_t n) {
    uint64_t mean = (uint64_t)idx[n - 1] / (uint64_t)n; /* the gaps add up to idx[n-1] - (n - 1) */
    int k = 0;
    while (k < RICE_MAX && (mean >> (k + 1))) k++;
    if (rice_drop(idx, n, k) <= (uint64_t)n) {
        while (k > 0 && rice_drop(idx, n, k - 1) <= (uint64_t)n) k--;
    } else {
        while (k < RICE_MAX && rice_drop(idx, n, k) > (uint64_t)n) k++;
    }
    return k;
}

/* Bytes of the unary code of the quotients gap >> k: their sum plus n bits (one ends each). */
static uint64_t unary_bytes(const int64_t *idx, Py_ssize_t n, int k) {
    uint64_t bits = (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) bits += gap(idx, i) >> k;
    return (bits + 7) / 8;
}

/* A version-4 record's header and Rice code (unary quotients, then remainders); returns its end. */
static uint8_t *write_indices(uint8_t *p, uint32_t op, const int64_t *idx, Py_ssize_t n, int k, uint64_t unary,
                              int flag) {
    put_u32(p, op);
    put_u32(p + 4, (uint32_t)n);
    p[8] = (uint8_t)(k | flag);
    put_u32(p + 9, (uint32_t)unary);
    p += RECORD_HEADER;
    uint64_t rem_bytes = ((uint64_t)n * (uint64_t)k + 7) / 8;
    memset(p, 0, (size_t)(unary + rem_bytes));
    uint64_t pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        pos += gap(idx, i) >> k;
        p[pos >> 3] |= (uint8_t)(0x80 >> (pos & 7));
        pos++;
    }
    p += unary;
    pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t g = gap(idx, i);
        for (int b = k - 1; b >= 0; b--, pos++) {
            if ((g >> b) & 1) p[pos >> 3] |= (uint8_t)(0x80 >> (pos & 7));
        }
    }
    return p + rem_bytes;
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
    int width[3];      /* version 3: bytes per delta; version 4: the Rice parameter */
    uint64_t unary[3]; /* version 4: bytes of the unary code */
} Op;

static void release_op(Op *o) {
    release(&o->idx), release(&o->up), release(&o->pidx), release(&o->pvals), release(&o->sidx),
        release(&o->sbits);
}

static int width_of(uint64_t largest) { return largest < ((uint64_t)1 << 32) ? 4 : 8; }

/* Bytes of a record of n entries with `payload` bytes per entry of its kind (direction: its packed bits). */
static uint64_t record_bytes(int version, Py_ssize_t n, int width, uint64_t unary, uint64_t payload) {
    if (!n) return 0;
    uint64_t body = payload ? (uint64_t)n * payload : ((uint64_t)n + 7) / 8;
    if (version == 3) return RECORD_HEADER_V3 + (uint64_t)n * (uint64_t)width + body;
    return RECORD_HEADER + unary + ((uint64_t)n * (uint64_t)width + 7) / 8 + body;
}

/* encode_records(ops, version) -> (payload bytes, number of records), or None where an op is not what the
 * engine writes (then the Python encoder decides). ops: a list of OpEntries in strictly increasing op
 * order; version: 4, or 3 for a log continued in it. */
static PyObject *encode_records(PyObject *self, PyObject *args) {
    PyObject *arg;
    int version;
    if (!PyArg_ParseTuple(args, "Oi", &arg, &version)) return NULL;
    if (version != 3 && version != 4) Py_RETURN_NONE;
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
        const int64_t *kinds[3] = {idx, pidx, sidx};
        Py_ssize_t counts[3] = {n, np_, ns};
        uint64_t largest[3] = {l0, l1, l2};
        for (int j = 0; j < 3; j++) {
            if (version == 3) {
                o->width[j] = width_of(largest[j]);
            } else if (counts[j]) {
                o->width[j] = rice_parameter(kinds[j], counts[j]);
                o->unary[j] = unary_bytes(kinds[j], counts[j], o->width[j]);
            }
        }
        /* each count is below 2**32 and each item at most 12 bytes (version 4: the Rice code is at most 3
         * bits of unary code and 62 of remainder an entry): an op adds under 2**40 bytes, so the total is
         * checked against PY_SSIZE_T_MAX before it could wrap */
        uint64_t op_size = record_bytes(version, n, o->width[0], o->unary[0], 0) +
                           record_bytes(version, np_, o->width[1], o->unary[1], 4) +
                           record_bytes(version, ns, o->width[2], o->unary[2], 2);
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
            p = version == 3 ? write_indices_v3(p, o->op, o->idx.view.buf, n, o->width[0], 0)
                             : write_indices(p, o->op, o->idx.view.buf, n, o->width[0], o->unary[0], 0);
            const uint8_t *up = o->up.view.buf;
            for (Py_ssize_t i = 0; i < n; i += 8) {
                uint8_t byte = 0;
                for (Py_ssize_t j = 0; j < 8 && i + j < n; j++) byte |= (uint8_t)(up[i + j] << (7 - j));
                *p++ = byte;
            }
        }
        if (np_) {
            p = version == 3 ? write_indices_v3(p, o->op, o->pidx.view.buf, np_, o->width[1], PINNED_FLAG)
                             : write_indices(p, o->op, o->pidx.view.buf, np_, o->width[1], o->unary[1], PINNED_FLAG);
            p = write_planes(p, o->pvals.view.buf, np_, 4);
        }
        if (ns) {
            p = version == 3 ? write_indices_v3(p, o->op, o->sidx.view.buf, ns, o->width[2], SHORT_FLAG)
                             : write_indices(p, o->op, o->sidx.view.buf, ns, o->width[2], o->unary[2], SHORT_FLAG);
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
    {"encode_records", encode_records, METH_VARARGS,
     "encode_records(ops, version) -> (payload, records) or None: a step's log records in format version 3 "
     "or 4, as roundlog.encode_segment encodes them before compression"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_segment", NULL, -1, methods};

PyMODINIT_FUNC PyInit__segment(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* the versions encode_records writes: roundlog takes this module only where they are its own */
    PyObject *versions = Py_BuildValue("(ii)", 3, 4);
    int failed = versions == NULL || PyModule_AddObjectRef(m, "FORMAT_VERSIONS", versions) < 0;
    Py_XDECREF(versions);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
