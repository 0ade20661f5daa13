/* The rounding kernel of verifiable precision: FP64 -> FP32 rounding, the midpoint test and the compaction
 * of the logged elements, in one pass over an op's output instead of a dozen torch calls.
 *
 * It computes exactly what the pure-torch reference in detrl/core/rounding.py computes (near_midpoint,
 * scale_spacing, _uncertainty), operation for operation in IEEE double and float arithmetic: the same
 * casts (round to nearest even, overflow to infinity), the same products and clamps, NaN propagated as
 * torch propagates it. tests/test_kernel.py checks both on random and adversarial inputs. Build flags:
 * no fast-math and no contraction into FMA, which would change the bits.
 *
 * Tensors arrive as the address of a contiguous FP64 buffer (torch's data_ptr()), laid out as
 * (outer, channels, inner): the channel of a reduction output is its dim 1 (rank >= 2), or the whole
 * tensor is one channel. A matrix product's threshold is a row factor times a column factor
 * (rounding.Scale): then rows[o] and cols[c] come in, and T = max(rows[o] * cols[c], 2**-149) * tau.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "roundkernel.h"

static const uint64_t EXPONENT_BITS = 0x7FF0000000000000ULL;

/* 2**floor(log2(d)) of a non-negative double by clearing its mantissa (scale._power_of_two): NaN and inf
 * give inf, zero gives zero. */
static inline double power_of_two(double d) {
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    bits &= EXPONENT_BITS;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* Magnitudes at or above this round to an FP32 infinity (2**128 - 2**103, the midpoint above FLT_MAX, ties
 * to even). A unit is set by the elements whose FP32 rounding is finite (scale.FP32_OVERFLOW). */
static const double FP32_OVERFLOW = 0x1.ffffffp+127;

/* rounding.scale_spacing for one channel: FP32 spacing at |max| (an FP32 value), times tau. */
static double channel_threshold(float amax, double tau) {
    double d = power_of_two((double)amax) * 0x1p-23;
    if (d < 0x1p-149) d = 0x1p-149;
    return d * tau;
}

/* T at one element, unscaled: clamp(|x| * tau 2**-23, tau 2**-149, tau 2**104). A NaN fails both
 * comparisons and stays NaN, as torch.clamp keeps it. (Conditional moves, not branches: the loops below
 * that call it vectorise.) */
static inline double element_threshold(double x, double c1, double lo, double hi) {
    double t = fabs(x) * c1;
    t = t < lo ? lo : t;
    return t > hi ? hi : t;
}

/* The flags of a near-midpoint pass (near_pass's flags; rounding.near_midpoint's arguments). */
#define NEAR_NEGATIVE_ZEROS 1 /* a reduction's negative value that rounds to -0 takes part (rules revision 7) */
#define NEAR_NO_NANS 2        /* a NaN never takes part (rules revision 16) */

/* x - t and x + t round to different FP32 values, and x takes part: its FP32 rounding is not zero or, with
 * NEAR_NEGATIVE_ZEROS in tiny, x is a negative value that rounds to -0; with NEAR_NO_NANS, x is not a NaN.
 * An exact zero never takes part, nor a positive value that rounds to +0. Without a branch, so that the
 * loops that call it vectorise. */
static inline int near_flag(double x, double t, int tiny) {
    return ((float)(x - t) != (float)(x + t)) & (((float)x != 0.0f) | ((tiny & NEAR_NEGATIVE_ZEROS) & (x < 0.0))) &
           (((tiny >> 1) ^ 1) | (x == x));
}

/* Vector builds of the hot loops. The elements are independent, so a vector unit computes each exactly as
 * the scalar code does: the same IEEE double and float operations, rounded to nearest (no fast-math, no
 * FMA contraction). On x86-64 with GCC or clang the loader picks an AVX-512 clone where the CPU has it, else an
 * AVX2 one (the AVX-512 clone took 2-4 us off a verifiable (512, 32) @ (32, 96) product's 30 us of rounding). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* The elements are checked a block at a time: blocks with no element near a midpoint, nearly all of them,
 * cost one vectorised pass; only a block with one takes the scalar path that writes entries. Each search
 * runs from j0 to the first block [j, j + BLOCK) holding a near element and returns j (n if none). A full
 * block's loop has a constant trip count, so the compiler emits it without a remainder loop: rows of 32-128
 * elements (matrix products, attention scores) paid that remainder's setup at every block (5-15% of the
 * search's time). */
#define BLOCK 32

VECTOR_CLONES static Py_ssize_t first_near_at(const double *x, Py_ssize_t j0, Py_ssize_t n, double t,
                                              int tiny) {
    Py_ssize_t j = j0;
    for (; n - j >= BLOCK; j += BLOCK) {
        const double *b = x + j;
        int any = 0;
        for (int i = 0; i < BLOCK; i++) any |= near_flag(b[i], t, tiny);
        if (any) return j;
    }
    int any = 0;
    for (Py_ssize_t i = j; i < n; i++) any |= near_flag(x[i], t, tiny);
    return any ? j : n;
}

VECTOR_CLONES static Py_ssize_t first_near_each(const double *x, Py_ssize_t j0, Py_ssize_t n, double c1, double lo,
                                                double hi, int tiny) {
    Py_ssize_t j = j0;
    for (; n - j >= BLOCK; j += BLOCK) {
        const double *b = x + j;
        int any = 0;
        for (int i = 0; i < BLOCK; i++) any |= near_flag(b[i], element_threshold(b[i], c1, lo, hi), tiny);
        if (any) return j;
    }
    int any = 0;
    for (Py_ssize_t i = j; i < n; i++) any |= near_flag(x[i], element_threshold(x[i], c1, lo, hi), tiny);
    return any ? j : n;
}

/* T of channel c of an outer row: with a row factor, max(row * cols[c], 2**-149) * tau, as
 * rounding.Scale.dense; without, cols[c] is T. */
static inline double column_threshold(const double *cols, Py_ssize_t c, int has_row, double row, double tau) {
    if (!has_row) return cols[c];
    double t = row * cols[c];
    t = t < 0x1p-149 ? 0x1p-149 : t;
    return t * tau;
}

/* t_max: the row's largest T (column_threshold at the largest column factor). A block is first tested
 * against it alone, which costs no T per element: x - t and x + t lie within x - t_max and x + t_max, and
 * IEEE subtraction, addition and rounding to FP32 are monotone, so an element near at its own T is near at
 * t_max too. Only a block with an element near at t_max takes the test at each element's T. */
VECTOR_CLONES static Py_ssize_t first_near_columns(const double *x, Py_ssize_t j0, Py_ssize_t n, const double *cols,
                                                   int has_row, double row, double tau, int tiny, double t_max) {
    for (Py_ssize_t j = j0; j < n; j += BLOCK) {
        Py_ssize_t end = n - j < BLOCK ? n : j + BLOCK;
        int maybe = 0;
        if (end - j == BLOCK) {
            const double *b = x + j;
            for (int i = 0; i < BLOCK; i++) maybe |= (float)(b[i] - t_max) != (float)(b[i] + t_max);
        } else {
            for (Py_ssize_t i = j; i < end; i++) maybe |= (float)(x[i] - t_max) != (float)(x[i] + t_max);
        }
        if (!maybe) continue;
        int any = 0;
        for (Py_ssize_t i = j; i < end; i++) any |= near_flag(x[i], column_threshold(cols, i, has_row, row, tau), tiny);
        if (any) return j;
    }
    return n;
}

VECTOR_CLONES static void round_block(double *x, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) x[j] = (double)(float)x[j];
}

/* max |x| over the n elements whose FP32 rounding is finite, as a double (0 where none is): an infinity
 * or a NaN, which rounds alike on every machine, must not set the unit of the values beside it (an
 * attention mask's -inf made every score of its channel a log entry). Rounding to FP32 is monotone and
 * symmetric, so (float) of this max is the max of the finite |(float)x|, the reference's FP32 amax, without
 * a cast per element. The max is exact in any order: the reduction may run in vector lanes
 * (-fopenmp-simd; the OpenMP runtime is not used). */
VECTOR_CLONES static double abs_max(const double *x, Py_ssize_t n, double amax) {
#pragma omp simd reduction(max : amax)
    for (Py_ssize_t j = 0; j < n; j++) {
        double r = fabs(x[j]);
        r = r < FP32_OVERFLOW ? r : 0.0; /* NaN fails the comparison too */
        amax = r > amax ? r : amax;
    }
    return amax;
}

/* round_inplace(address, n): x[i] = (double)(float)x[i]. */
static PyObject *round_inplace(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &address, &n)) return NULL;
    double *x = (double *)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    round_block(x, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* unit_factors(address, rows, cols, row_stride, col_stride, times, out): a matrix product's unit factors
 * (scale.reduction_scale) of a strided FP64 matrix (strides in elements): out[r] = max(2**floor(log2(m_r)),
 * 2**-149) * times, m_r = max |x[r, c]| over the row's elements whose FP32 rounding is finite (abs_max).
 * times is a power of two. Rows run contiguous (col_stride 1) or side by side (row_stride 1: a transposed
 * view). */
VECTOR_CLONES static void strided_row_abs_max(const double *restrict x, Py_ssize_t rows, Py_ssize_t cols,
                                              Py_ssize_t row_stride, Py_ssize_t col_stride, double *restrict out) {
    if (col_stride == 1) {
        for (Py_ssize_t r = 0; r < rows; r++) out[r] = abs_max(x + r * row_stride, cols, 0.0);
        return;
    }
    for (Py_ssize_t r = 0; r < rows; r++) out[r] = 0.0;
    if (row_stride == 1) {
        for (Py_ssize_t c = 0; c < cols; c++) {
            const double *column = x + c * col_stride;
            for (Py_ssize_t r = 0; r < rows; r++) {
                double v = fabs(column[r]);
                v = v < FP32_OVERFLOW ? v : 0.0;
                out[r] = v > out[r] ? v : out[r];
            }
        }
    } else {
        for (Py_ssize_t r = 0; r < rows; r++)
            for (Py_ssize_t c = 0; c < cols; c++) {
                double v = fabs(x[r * row_stride + c * col_stride]);
                v = v < FP32_OVERFLOW ? v : 0.0;
                out[r] = v > out[r] ? v : out[r];
            }
    }
}

static int unit_factors_into(const double *x, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t row_stride,
                             Py_ssize_t col_stride, double times, double *out) {
    strided_row_abs_max(x, rows, cols, row_stride, col_stride, out);
    for (Py_ssize_t r = 0; r < rows; r++) {
        double p = power_of_two(out[r]);
        out[r] = (p < 0x1p-149 ? 0x1p-149 : p) * times;
    }
    return 0;
}

static PyObject *unit_factors(PyObject *self, PyObject *args) {
    unsigned long long address, out_address;
    Py_ssize_t rows, cols, row_stride, col_stride;
    double times;
    if (!PyArg_ParseTuple(args, "KnnnndK", &address, &rows, &cols, &row_stride, &col_stride, &times, &out_address))
        return NULL;
    if (rows < 0 || cols < 0) {
        PyErr_SetString(PyExc_ValueError, "unit_factors: negative size");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = unit_factors_into((const double *)(uintptr_t)address, rows, cols, row_stride, col_stride, times,
                               (double *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* out[c] = T of channel c of a dense (outer, channels, inner) buffer (0: it cannot fail). */
static int channel_thresholds_into(const double *x, Py_ssize_t outer, Py_ssize_t channels, Py_ssize_t inner,
                                   double tau, double *out) {
    if (inner == 1) { /* (outer, channels): a channel is a column, every row updates all maxima side by side */
        strided_row_abs_max(x, channels, outer, 1, channels, out);
        for (Py_ssize_t c = 0; c < channels; c++) out[c] = channel_threshold((float)out[c], tau);
    } else {
        for (Py_ssize_t c = 0; c < channels; c++) {
            double amax = 0.0;
            for (Py_ssize_t o = 0; o < outer; o++) amax = abs_max(x + (o * channels + c) * inner, inner, amax);
            out[c] = channel_threshold((float)amax, tau);
        }
    }
    return 0;
}

/* channel_thresholds(address, outer, channels, inner, tau, out): out[c] = T of channel c. */
static PyObject *channel_thresholds(PyObject *self, PyObject *args) {
    unsigned long long address, out_address;
    Py_ssize_t outer, channels, inner;
    double tau;
    if (!PyArg_ParseTuple(args, "KnnndK", &address, &outer, &channels, &inner, &tau, &out_address))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = channel_thresholds_into((const double *)(uintptr_t)address, outer, channels, inner, tau,
                                     (double *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    return Py_BuildValue("");
}

/* rounding.spacing32 of an FP32 value (as double): 2**(e - 24), e its frexp exponent, at least 2**-149.
 * torch.frexp (and glibc) give exponent 0 for zero, infinities and NaN. */
static inline double spacing32(double r) {
    int e = 0;
    if (r != 0.0 && isfinite(r)) frexp(r, &e);
    int k = e - 24;
    if (k < -149) k = -149;
    return ldexp(1.0, k);
}

/* One log entry's kind, as rounding.entries_for decides it: pinned (the value itself is logged) where the
 * uncertainty reaches a quarter of the element's own spacing, or where it rounds to zero (rules revision 7's
 * -0), else the direction of its nearest rounding. */
static inline int is_pinned(double x, double t) {
    float r = (float)x;
    return 4.0 * t >= spacing32((double)r) || r == 0.0f;
}

/* rounding.split_short's test for a pinned FP32 value r whose uncertainty, computed from r as the replayer
 * would (t_r), is at most 2**12 of its spacings: it is stored as the low 16 bits of its key. Not a zero. */
static inline int is_short(float r, double t_r) {
    return isfinite(r) && r != 0.0f && t_r <= 0x1p12 * spacing32((double)r);
}

/* roundlog.key32(r) & 0xFFFF: order-preserving key of an FP32 value, its low 16 bits. */
static inline uint16_t low16_key(float r) {
    uint32_t bits;
    memcpy(&bits, &r, sizeof bits);
    uint32_t key = (bits & 0x80000000u) ? ~bits : bits ^ 0x80000000u;
    return (uint16_t)(key & 0xFFFFu);
}

typedef DetrlEntries Entries; /* roundkernel.h */

/* The near-midpoint pass over the elements from flat index start (the start of a row or of a block in it;
 * 0 or a stop this pass returned). With out == NULL it only counts (into *counts: directions, pinned and
 * short pinned values apart) and returns the element count. Else it writes the entries and rounds every
 * element it passes in place, until a block holds more entries than out has room left for: it returns
 * that block's first index, leaving the block unrounded and the counts at the entries written, so that a
 * caller can resume there with larger buffers. */
static Py_ssize_t near_pass(double *x, Py_ssize_t outer, Py_ssize_t channels, Py_ssize_t inner,
                            const double *thresholds, const double *rows, double tau, double c1, double lo,
                            double hi, int flags, Py_ssize_t start, Entries *out, Entries *counts) {
    Entries *e = out ? out : counts;
    /* a reduction's (thresholds given) negative value that rounds to -0 takes part from rules revision 7; no
     * NaN from rules revision 16 */
    const int tiny = (thresholds ? flags & NEAR_NEGATIVE_ZEROS : 0) | (flags & NEAR_NO_NANS);
    e->n_kept = e->n_pinned = e->n_short = 0;
    /* Blocks run along the innermost axis; with inner == 1 and thresholds per channel (a matrix product's
     * unit) they run along the channels of an outer row instead, with T per element. Rows shorter than a
     * vector's few elements skip the vector search. */
    int along_channels = inner == 1 && thresholds;
    Py_ssize_t rows_n = along_channels ? outer : outer * channels, length = along_channels ? channels : inner;
    /* along the channels: the largest channel factor, for each row's largest T (first_near_columns); a NaN
     * among them makes it NaN, which marks every block for the test at each element's T */
    double col_max = 0.0;
    int nan_col = 0;
    for (Py_ssize_t c = 0; along_channels && c < channels; c++) {
        nan_col |= thresholds[c] != thresholds[c];
        col_max = thresholds[c] > col_max ? thresholds[c] : col_max;
    }
    if (nan_col) col_max = NAN;
    Py_ssize_t total = rows_n * length;
    for (Py_ssize_t r = length ? start / length : rows_n; r < rows_n; r++) {
        Py_ssize_t o = along_channels ? r : r / channels, c = along_channels ? 0 : r % channels;
        Py_ssize_t base = r * length;
        double *row = x + base;
        double row_factor = rows ? rows[o] : 0.0;
        /* T of this row's channel (blocks along the channels take it per element instead) */
        double tc = !along_channels && thresholds ? column_threshold(thresholds, c, rows != NULL, row_factor, tau)
                                                  : 0.0;
        Py_ssize_t j0 = base < start ? start - base : 0;
        while (j0 < length) {
            /* the next block with a near element (rows shorter than a vector's few elements: this one) */
            Py_ssize_t hit = length < 8       ? j0
                             : along_channels ? first_near_columns(row, j0, length, thresholds, rows != NULL,
                                                                   row_factor, tau, tiny,
                                                                   column_threshold(&col_max, 0, rows != NULL,
                                                                                    row_factor, tau))
                             : thresholds     ? first_near_at(row, j0, length, tc, tiny)
                                              : first_near_each(row, j0, length, c1, lo, hi, tiny);
            if (out) round_block(row + j0, hit - j0);
            if (hit == length) break;
            Py_ssize_t end = length - hit < BLOCK ? length : hit + BLOCK;
            Py_ssize_t k_block = e->n_kept, p_block = e->n_pinned, s_block = e->n_short;
            for (Py_ssize_t j = hit; j < end; j++) {
                double v = row[j];
                double t = along_channels ? column_threshold(thresholds, j, rows != NULL, row_factor, tau)
                           : thresholds   ? tc
                                          : element_threshold(v, c1, lo, hi);
                if (!near_flag(v, t, tiny)) continue;
                float rv = (float)v;
                if (!is_pinned(v, t)) {
                    if (out && e->n_kept == e->max_kept) goto full;
                    if (out) {
                        e->kept[e->n_kept] = (int64_t)(base + j);
                        e->up[e->n_kept] = fabs((double)rv) > fabs(v);
                    }
                    e->n_kept++;
                } else if (is_short(rv, thresholds ? t : element_threshold((double)rv, c1, lo, hi))) {
                    /* a reduction's T does not depend on the element; an elementwise op's is taken at the
                     * value, as the replayer will (rounding.split_short) */
                    if (out && e->n_short == e->max_short) goto full;
                    if (out) {
                        e->short_indices[e->n_short] = (int64_t)(base + j);
                        e->short_bits[e->n_short] = low16_key(rv);
                    }
                    e->n_short++;
                } else {
                    if (out && e->n_pinned == e->max_pinned) goto full;
                    if (out) {
                        e->pinned[e->n_pinned] = (int64_t)(base + j);
                        e->pinned_values[e->n_pinned] = rv;
                    }
                    e->n_pinned++;
                }
            }
            if (out) round_block(row + hit, end - hit);
            j0 = end;
            continue;
        full: /* this block's entries do not fit: give them back and stop before it, unrounded */
            e->n_kept = k_block;
            e->n_pinned = p_block;
            e->n_short = s_block;
            return base + hit;
        }
    }
    return total;
}

/* ceil(log2(terms)) of a sum of terms >= 1 terms (exactly: the least k with 2**k >= terms). */
static int ceil_log2(int64_t terms) {
    int k = 0;
    while (k < 63 && ((int64_t)1 << k) < terms) k++;
    return k;
}

/* frexp's exponent of a positive normal double, from its bits (no libc call: a sum's two magnitudes, at every
 * output of a sum with a near element). */
static inline int normal_exponent(double d) {
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    return (int)((bits >> 52) & 0x7FF) - 1022;
}

/* The rule for one sum of FP32-grid terms, from its largest and smallest nonzero term magnitudes (INFINITY:
 * none) and ceil(log2(its number of terms)). */
static int sum_is_exact(double largest, double smallest, int log2_terms) {
    if (!isfinite(largest)) return 0;
    if (isinf(smallest)) return 1; /* no nonzero term: the sum is zero */
    /* nonzero FP32-grid magnitudes are normal doubles (2**-149 and up), so the bits give frexp's exponents */
    int e_max = normal_exponent(largest), e_min = normal_exponent(smallest < 1e308 ? smallest : 1e308);
    return e_max - e_min + log2_terms <= 29;
}

/* One sum's terms, `terms` of them side by side: the largest and the smallest nonzero magnitude (INFINITY:
 * none) into *largest and *smallest; returns whether a term is off the FP32 grid (a NaN is). A max and a
 * min are exact in any order, so the loop may run in vector lanes. */
VECTOR_CLONES static int term_extremes(const double *x, Py_ssize_t terms, double *largest, double *smallest) {
    double big = 0.0, small = INFINITY;
    int off = 0;
#pragma omp simd reduction(max : big) reduction(min : small) reduction(| : off)
    for (Py_ssize_t j = 0; j < terms; j++) {
        double v = x[j];
        off |= (double)(float)v != v;
        double m = fabs(v), nonzero = m != 0.0 ? m : INFINITY;
        big = m > big ? m : big;
        small = nonzero < small ? nonzero : small;
    }
    *largest = big, *smallest = small;
    return off;
}

/* term_extremes of `outer` sums side by side (sum i's term j at x[i + j * stride]: a matrix's column sums, a
 * bias gradient), one row of terms at a time across all sums. */
VECTOR_CLONES static int columns_extremes(const double *restrict x, Py_ssize_t outer, Py_ssize_t terms, Py_ssize_t stride,
                                          double *restrict largest, double *restrict smallest) {
    int off = 0;
    for (Py_ssize_t i = 0; i < outer; i++) largest[i] = 0.0, smallest[i] = INFINITY;
    for (Py_ssize_t j = 0; j < terms; j++) {
        const double *row = x + j * stride;
        for (Py_ssize_t i = 0; i < outer; i++) {
            double v = row[i];
            off |= (double)(float)v != v;
            double m = fabs(v), nonzero = m != 0.0 ? m : INFINITY;
            largest[i] = m > largest[i] ? m : largest[i];
            smallest[i] = nonzero < smallest[i] ? nonzero : smallest[i];
        }
    }
    return off;
}

/* scale.exact_sum_elements' rule for sums of FP32-grid terms: x holds `outer` sums of `terms` FP64 terms
 * each, sum i's term j at x[i * outer_stride + j * term_stride] (strides in elements: row-major rows, or
 * the columns of a matrix read in place). Where every term is on the FP32 grid, writes mask[i] = 1 for a sum
 * every order computes exactly (frexp exponents of its largest and smallest nonzero magnitudes e_max,
 * e_min: e_max - e_min + ceil(log2(terms)) <= 29, or no nonzero term), and a finite largest term, else 0;
 * returns 1. Returns 0, the mask unwritten, where some term is off the grid (a NaN is): then the rule claims
 * no element; -1 where it could not allocate. The exponents, maxima, minima and the count are exact, so
 * this is the torch reference's mask (tests/test_rounding.py compares the two). */
static int exact_sums_into(const double *x, Py_ssize_t outer, Py_ssize_t terms, Py_ssize_t outer_stride,
                           Py_ssize_t term_stride, uint8_t *mask) {
    const int log2_terms = ceil_log2(terms);
    if (outer_stride == 1 && term_stride != 1 && outer > 1) {
        double *largest = malloc(2 * (size_t)outer * sizeof *largest);
        if (!largest) return -1;
        double *smallest = largest + outer;
        const int off = columns_extremes(x, outer, terms, term_stride, largest, smallest);
        for (Py_ssize_t i = 0; i < outer && !off; i++) mask[i] = (uint8_t)sum_is_exact(largest[i], smallest[i], log2_terms);
        free(largest);
        return !off;
    }
    for (Py_ssize_t i = 0; i < outer; i++) {
        double largest = 0.0, smallest = INFINITY;
        if (term_stride == 1) {
            if (term_extremes(x + i * outer_stride, terms, &largest, &smallest)) return 0;
        } else {  /* strided terms, read one by one */
            for (Py_ssize_t j = 0; j < terms; j++) {
                double v = x[i * outer_stride + j * term_stride];
                if ((double)(float)v != v) return 0;
                double m = fabs(v);
                largest = m > largest ? m : largest;
                smallest = m != 0.0 && m < smallest ? m : smallest;
            }
        }
        mask[i] = (uint8_t)sum_is_exact(largest, smallest, log2_terms);
    }
    return 1;
}

/* scale.exact_sum_elements' rule for an embedding's gradient (aten.embedding_dense_backward, unscaled): grad
 * holds `tokens` rows of `width` FP64 terms (row-major), indices[i] the row of the (rows, width) table that
 * token i adds to. Writes mask[r * width + j] = 1 where every order sums element (r, j) exactly (as
 * exact_sums_into decides it; a row no token names sums no term: zero, exact), else 0; returns 1. Returns 0,
 * the mask unwritten, where a term is off the FP32 grid or an index outside [0, rows) (then the rule claims
 * no element), and -1 where it could not allocate. The extremes are kept for the rows seen only (a GPT-2
 * batch names a few thousand of 50,257), each in the order of its first token. */
static int exact_embedding_sums_into(const double *grad, Py_ssize_t tokens, Py_ssize_t width, const int64_t *indices,
                                     Py_ssize_t rows, uint8_t *mask) {
    Py_ssize_t *slot = malloc((size_t)(rows > 0 ? rows : 1) * sizeof *slot);
    if (!slot) return -1;
    for (Py_ssize_t r = 0; r < rows; r++) slot[r] = -1;
    Py_ssize_t seen = 0;
    for (Py_ssize_t i = 0; i < tokens; i++) {
        int64_t r = indices[i];
        if (r < 0 || r >= rows) {
            free(slot);
            return 0;
        }
        if (slot[r] < 0) slot[r] = seen++;
    }
    size_t cells = (size_t)(seen > 0 ? seen : 1) * (size_t)(width > 0 ? width : 1);
    double *largest = calloc(cells, sizeof *largest), *smallest = malloc(cells * sizeof *smallest);
    int64_t *count = calloc((size_t)(seen > 0 ? seen : 1), sizeof *count);
    int status = largest && smallest && count ? 1 : -1;
    for (size_t c = 0; status == 1 && c < cells; c++) smallest[c] = INFINITY;
    for (Py_ssize_t i = 0; status == 1 && i < tokens; i++) {
        Py_ssize_t s = slot[indices[i]];
        const double *row = grad + i * width;
        double *big = largest + s * width, *small = smallest + s * width;
        count[s]++;
        for (Py_ssize_t j = 0; j < width; j++) {
            double v = row[j];
            if ((double)(float)v != v) { /* off the grid: overflows to inf, or NaN */
                status = 0;
                break;
            }
            double m = fabs(v);
            big[j] = m > big[j] ? m : big[j];
            small[j] = m != 0.0 && m < small[j] ? m : small[j];
        }
    }
    if (status == 1) {
        memset(mask, 1, (size_t)rows * (size_t)width);
        for (Py_ssize_t r = 0; r < rows; r++) {
            Py_ssize_t s = slot[r];
            if (s < 0) continue;
            const int log2_terms = ceil_log2(count[s]);
            for (Py_ssize_t j = 0; j < width; j++)
                mask[r * width + j] = (uint8_t)sum_is_exact(largest[s * width + j], smallest[s * width + j], log2_terms);
        }
    }
    free(slot);
    free(largest);
    free(smallest);
    free(count);
    return status;
}

/* exact_embedding_sums(grad, tokens, width, indices, rows, mask) -> 1, 0 or -1: exact_embedding_sums_into on
 * a contiguous FP64 buffer of tokens x width terms and one of tokens int64 indices, the mask into a buffer of
 * rows x width bytes. */
static PyObject *exact_embedding_sums(PyObject *self, PyObject *args) {
    unsigned long long grad, indices, mask;
    Py_ssize_t tokens, width, rows;
    if (!PyArg_ParseTuple(args, "KnnKnK", &grad, &tokens, &width, &indices, &rows, &mask)) return NULL;
    if (tokens < 0 || width < 1 || rows < 1 || (tokens && (!grad || !indices)) || !mask) {
        PyErr_SetString(PyExc_ValueError, "exact_embedding_sums: needs a row of at least one term, and the buffers");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = exact_embedding_sums_into((const double *)(uintptr_t)grad, tokens, width,
                                       (const int64_t *)(uintptr_t)indices, rows, (uint8_t *)(uintptr_t)mask);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    return PyBool_FromLong(status);
}

/* exact_sums(address, outer, terms, mask) -> bool: exact_sums_into on a contiguous FP64 buffer of outer x
 * terms elements, the mask into a buffer of outer bytes; False where a term is off the FP32 grid. */
static PyObject *exact_sums(PyObject *self, PyObject *args) {
    unsigned long long address, mask;
    Py_ssize_t outer, terms;
    if (!PyArg_ParseTuple(args, "KnnK", &address, &outer, &terms, &mask)) return NULL;
    if (outer < 0 || terms < 1 || (outer && (!address || !mask))) {
        PyErr_SetString(PyExc_ValueError, "exact_sums: needs at least one term a sum, and both buffers");
        return NULL;
    }
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = exact_sums_into((const double *)(uintptr_t)address, outer, terms, terms, 1, (uint8_t *)(uintptr_t)mask);
    Py_END_ALLOW_THREADS
    if (found < 0) return PyErr_NoMemory();
    return PyBool_FromLong(found);
}

/* decompose._exact_rows' rule for a layer norm's rows: x holds `outer` rows of n FP64 values, row-major.
 * mask[i] = 1 where every value of row i is on the FP32 grid (a NaN is not) and n * max|x| <= 2**52 * q,
 * q the smallest FP32 spacing of its nonzero values (scale.spacing32: 2**max(e - 24, -149) for frexp
 * exponent e; an infinity's is 2**-24, as torch's frexp gives it exponent 0; no nonzero value: q = inf),
 * as the torch reference computes it: the same max, min, product by n and compare
 * (tests/test_decompose.py compares the two). */
static void exact_rows_into(const double *x, Py_ssize_t outer, Py_ssize_t n, uint8_t *mask) {
    /* q from one value a row: spacing32 is monotone in a finite magnitude (frexp's exponent is), so the
     * smallest spacing of a row's nonzero values is that of the smallest of them. A row holding an infinity
     * is never exact (n * inf exceeds any bound), whatever spacing the infinity is given. */
    for (Py_ssize_t i = 0; i < outer; i++) {
        double largest, smallest;
        const int off = term_extremes(x + i * n, n, &largest, &smallest);
        double q = INFINITY;
        if (smallest < INFINITY) {
            int e;
            frexp(smallest, &e);
            q = ldexp(1.0, e - 24 < -149 ? -149 : e - 24);
        }
        mask[i] = (uint8_t)(!off && isfinite(largest) && largest * (double)n <= q * 0x1p52);
    }
}

/* exact_rows(address, outer, n, mask): exact_rows_into on a contiguous FP64 buffer of outer x n elements,
 * the mask into a buffer of outer bytes. */
static PyObject *exact_rows(PyObject *self, PyObject *args) {
    unsigned long long address, mask;
    Py_ssize_t outer, n;
    if (!PyArg_ParseTuple(args, "KnnK", &address, &outer, &n, &mask)) return NULL;
    if (outer < 0 || n < 1 || (outer && (!address || !mask))) {
        PyErr_SetString(PyExc_ValueError, "exact_rows: needs at least one value a row, and both buffers");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    exact_rows_into((const double *)(uintptr_t)address, outer, n, (uint8_t *)(uintptr_t)mask);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* count_near(address, outer, channels, inner, thresholds or 0, rows or 0, tau, c1, lo, hi, flags, start) ->
 * (directions, pinned, short): how many near elements from flat index start get each kind of entry. With
 * rows, thresholds are column factors. */
static PyObject *count_near(PyObject *self, PyObject *args) {
    unsigned long long address, thresholds, rows;
    Py_ssize_t outer, channels, inner, start;
    double tau, c1, lo, hi;
    int flags;
    if (!PyArg_ParseTuple(args, "KnnnKKddddin", &address, &outer, &channels, &inner, &thresholds, &rows, &tau, &c1,
                          &lo, &hi, &flags, &start))
        return NULL;
    if (rows && !thresholds) {
        PyErr_SetString(PyExc_ValueError, "count_near: row factors need column factors");
        return NULL;
    }
    Entries counts;
    Py_BEGIN_ALLOW_THREADS
    near_pass((double *)(uintptr_t)address, outer, channels, inner, (const double *)(uintptr_t)thresholds,
              (const double *)(uintptr_t)rows, tau, c1, lo, hi, flags, start, NULL, &counts);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("nnn", counts.n_kept, counts.n_pinned, counts.n_short);
}

/* take_entries(address, outer, channels, inner, thresholds or 0, rows or 0, tau, c1, lo, hi, flags, start, indices,
 * up, n, pinned_indices, pinned_values, n_pinned, short_indices, short_bits, n_short) -> (directions,
 * pinned, short, stop): from flat index start, writes the entries into buffers with room for n directions
 * (row-major indices; up as 0/1 bytes), n_pinned pinned values (FP32) and n_short short ones (low 16 key
 * bits), and rounds in place, up to stop: the number of elements when all fit, else the first index of the
 * block whose entries did not (near_pass). */
static PyObject *take_entries(PyObject *self, PyObject *args) {
    unsigned long long address, thresholds, rows, kept, up, pinned, pinned_values, short_indices, short_bits;
    Py_ssize_t outer, channels, inner, start, n_kept, n_pinned, n_short;
    double tau, c1, lo, hi;
    int flags;
    if (!PyArg_ParseTuple(args, "KnnnKKddddinKKnKKnKKn", &address, &outer, &channels, &inner, &thresholds, &rows,
                          &tau, &c1, &lo, &hi, &flags, &start, &kept, &up, &n_kept, &pinned, &pinned_values, &n_pinned,
                          &short_indices, &short_bits, &n_short))
        return NULL;
    if (rows && !thresholds) {
        PyErr_SetString(PyExc_ValueError, "take_entries: row factors need column factors");
        return NULL;
    }
    if (n_kept < 0 || n_pinned < 0 || n_short < 0 || (n_kept && (!kept || !up)) ||
        (n_pinned && (!pinned || !pinned_values)) || (n_short && (!short_indices || !short_bits))) {
        PyErr_SetString(PyExc_ValueError, "take_entries needs an output buffer for every entry it may write");
        return NULL;
    }
    Entries out = {(int64_t *)(uintptr_t)kept, (uint8_t *)(uintptr_t)up, (int64_t *)(uintptr_t)pinned,
                   (float *)(uintptr_t)pinned_values, (int64_t *)(uintptr_t)short_indices,
                   (uint16_t *)(uintptr_t)short_bits, n_kept, n_pinned, n_short, 0, 0, 0};
    Py_ssize_t stop;
    Py_BEGIN_ALLOW_THREADS
    stop = near_pass((double *)(uintptr_t)address, outer, channels, inner, (const double *)(uintptr_t)thresholds,
                     (const double *)(uintptr_t)rows, tau, c1, lo, hi, flags, start, &out, NULL);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("nnnn", out.n_kept, out.n_pinned, out.n_short, stop);
}

static PyMethodDef methods[] = {
    {"round_inplace", round_inplace, METH_VARARGS, "round_inplace(address, n): FP64 -> FP32 -> FP64 in place"},
    {"channel_thresholds", channel_thresholds, METH_VARARGS,
     "channel_thresholds(address, outer, channels, inner, tau, out): T per channel at the output's scale"},
    {"unit_factors", unit_factors, METH_VARARGS,
     "unit_factors(address, rows, cols, row_stride, col_stride, times, out): mm unit factors per row"},
    {"count_near", count_near, METH_VARARGS, "count_near(...): (directions, pinned) entries an op needs"},
    {"take_entries", take_entries, METH_VARARGS, "take_entries(...): write an op's entries while they fit, round in place"},
    {"exact_sums", exact_sums, METH_VARARGS, "exact_sums(address, outer, terms, mask): which sums every order computes exactly"},
    {"exact_rows", exact_rows, METH_VARARGS, "exact_rows(address, outer, n, mask): a layer norm's rows summed exactly"},
    {"exact_embedding_sums", exact_embedding_sums, METH_VARARGS,
     "exact_embedding_sums(grad, tokens, width, indices, rows, mask): an embedding gradient's exact elements"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_roundkernel", NULL, -1, methods};

/* The C API (roundkernel.h): the same passes, for native code that calls them without a Python frame. */
static DetrlKernelApi api = {DETRL_KERNEL_API_VERSION, near_pass, channel_thresholds_into, unit_factors_into,
                             exact_sums_into, exact_rows_into, exact_embedding_sums_into};

PyMODINIT_FUNC PyInit__roundkernel(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *capsule = PyCapsule_New(&api, DETRL_KERNEL_API_CAPSULE, NULL);
    if (!capsule || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
