/* The rounding kernel of verifiable precision: FP64 -> FP32 rounding, the midpoint test and the compaction
 * of the logged elements, in one pass over an op's output instead of a dozen torch calls.
 *
 * It computes exactly what the pure-torch reference in detrl/rounding.py computes (near_midpoint,
 * scale_spacing, _uncertainty), operation for operation in IEEE double and float arithmetic: the same
 * casts (round to nearest even, overflow to infinity), the same products and clamps, NaN propagated as
 * torch propagates it. tests/test_kernel.py checks both on random and adversarial inputs. Build flags:
 * no fast-math and no contraction into FMA, which would change the bits.
 *
 * Tensors arrive as the address of a contiguous FP64 buffer (torch's data_ptr()), laid out as
 * (outer, channels, inner): the channel of a reduction output is its dim 1 (rank >= 2), or the whole
 * tensor is one channel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static const uint64_t EXPONENT_BITS = 0x7FF0000000000000ULL;

/* rounding.scale_spacing for one channel: FP32 spacing at |max| (an FP32 value; NaN if the channel holds
 * one), times tau. Clearing the mantissa of the double gives 2**floor(log2(amax)); NaN and inf give inf. */
static double channel_threshold(float amax, int has_nan, double tau) {
    double d = has_nan ? (double)NAN : (double)amax;
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    bits &= EXPONENT_BITS;
    memcpy(&d, &bits, sizeof d);
    d *= 0x1p-23;
    if (d < 0x1p-149) d = 0x1p-149;
    return d * tau;
}

/* T at one element, unscaled: clamp(|x| * tau 2**-23, tau 2**-149, tau 2**104). A NaN fails both
 * comparisons and stays NaN, as torch.clamp keeps it. */
static inline double element_threshold(double x, double c1, double lo, double hi) {
    double t = fabs(x) * c1;
    if (t < lo) return lo;
    if (t > hi) return hi;
    return t;
}

static inline int near_midpoint(double x, double t) {
    float rounded = (float)x;
    return ((float)(x - t) != (float)(x + t)) && (rounded != 0.0f);
}

/* round_inplace(address, n): x[i] = (double)(float)x[i]. */
static PyObject *round_inplace(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &address, &n)) return NULL;
    double *x = (double *)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) x[i] = (double)(float)x[i];
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* channel_thresholds(address, outer, channels, inner, tau, out): out[c] = T of channel c. */
static PyObject *channel_thresholds(PyObject *self, PyObject *args) {
    unsigned long long address, out_address;
    Py_ssize_t outer, channels, inner;
    double tau;
    if (!PyArg_ParseTuple(args, "KnnndK", &address, &outer, &channels, &inner, &tau, &out_address))
        return NULL;
    const double *x = (const double *)(uintptr_t)address;
    double *out = (double *)(uintptr_t)out_address;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < channels; c++) {
        float amax = 0.0f;
        int has_nan = 0;
        for (Py_ssize_t o = 0; o < outer; o++) {
            const double *row = x + (o * channels + c) * inner;
            for (Py_ssize_t j = 0; j < inner; j++) {
                float r = fabsf((float)row[j]);
                if (r != r) has_nan = 1;
                else if (r > amax) amax = r;
            }
        }
        out[c] = channel_threshold(amax, has_nan, tau);
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("");
}

/* The near-midpoint pass. With entries == NULL it only counts; otherwise it writes up to capacity
 * entries (row-major index, the FP64 value, its T) and rounds every element in place. */
static Py_ssize_t near_pass(double *x, Py_ssize_t outer, Py_ssize_t channels, Py_ssize_t inner,
                            const double *thresholds, double c1, double lo, double hi, int64_t *indices,
                            double *values, double *taus, Py_ssize_t capacity) {
    Py_ssize_t found = 0;
    for (Py_ssize_t o = 0; o < outer; o++) {
        for (Py_ssize_t c = 0; c < channels; c++) {
            Py_ssize_t base = (o * channels + c) * inner;
            double *row = x + base;
            for (Py_ssize_t j = 0; j < inner; j++) {
                double v = row[j];
                double t = thresholds ? thresholds[c] : element_threshold(v, c1, lo, hi);
                if (near_midpoint(v, t)) {
                    if (indices && found < capacity) {
                        indices[found] = (int64_t)(base + j);
                        values[found] = v;
                        taus[found] = t;
                    }
                    found++;
                }
                if (indices) row[j] = (double)(float)v;
            }
        }
    }
    return found;
}

/* count_near(address, outer, channels, inner, thresholds or 0, c1, lo, hi) -> number of near elements. */
static PyObject *count_near(PyObject *self, PyObject *args) {
    unsigned long long address, thresholds;
    Py_ssize_t outer, channels, inner, found;
    double c1, lo, hi;
    if (!PyArg_ParseTuple(args, "KnnnKddd", &address, &outer, &channels, &inner, &thresholds, &c1, &lo, &hi))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    found = near_pass((double *)(uintptr_t)address, outer, channels, inner,
                      (const double *)(uintptr_t)thresholds, c1, lo, hi, NULL, NULL, NULL, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(found);
}

/* take_near(address, outer, channels, inner, thresholds or 0, c1, lo, hi, indices, values, taus, capacity)
 * -> number of near elements; writes the first `capacity` and rounds the tensor in place. */
static PyObject *take_near(PyObject *self, PyObject *args) {
    unsigned long long address, thresholds, indices, values, taus;
    Py_ssize_t outer, channels, inner, capacity, found;
    double c1, lo, hi;
    if (!PyArg_ParseTuple(args, "KnnnKdddKKKn", &address, &outer, &channels, &inner, &thresholds, &c1, &lo, &hi,
                          &indices, &values, &taus, &capacity))
        return NULL;
    if (capacity < 0 || !indices || !values || !taus) {
        PyErr_SetString(PyExc_ValueError, "take_near needs output buffers");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    found = near_pass((double *)(uintptr_t)address, outer, channels, inner,
                      (const double *)(uintptr_t)thresholds, c1, lo, hi, (int64_t *)(uintptr_t)indices,
                      (double *)(uintptr_t)values, (double *)(uintptr_t)taus, capacity);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"round_inplace", round_inplace, METH_VARARGS, "round_inplace(address, n): FP64 -> FP32 -> FP64 in place"},
    {"channel_thresholds", channel_thresholds, METH_VARARGS,
     "channel_thresholds(address, outer, channels, inner, tau, out): T per channel at the output's scale"},
    {"count_near", count_near, METH_VARARGS, "count_near(...): how many elements lie within T of a midpoint"},
    {"take_near", take_near, METH_VARARGS, "take_near(...): write the near elements, round in place"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_roundkernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__roundkernel(void) { return PyModule_Create(&module); }
