/* The rounding kernel's C API (detrl/core/_roundkernel.c), for the native dispatch route
 * (detrl/core/native_dispatch.cpp): the pass that rounds a logged op's output and writes its log entries,
 * called without a Python frame. The kernel module exports it as the capsule _C_API. */
#ifndef DETRL_ROUNDKERNEL_H
#define DETRL_ROUNDKERNEL_H

#include <Python.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where a pass writes an op's entries, with room for max_ of each kind; n_ counts them. */
typedef struct {
    int64_t *kept;
    uint8_t *up;
    int64_t *pinned;
    float *pinned_values;
    int64_t *short_indices;
    uint16_t *short_bits;
    Py_ssize_t max_kept, max_pinned, max_short, n_kept, n_pinned, n_short;
} DetrlEntries;

#define DETRL_KERNEL_API_VERSION 6
#define DETRL_KERNEL_API_CAPSULE "detrl.core._roundkernel._C_API"

typedef struct {
    int version; /* DETRL_KERNEL_API_VERSION */
    /* The near-midpoint pass of take_entries (see near_pass in _roundkernel.c); flags: 1, a reduction's
     * negative value that rounds to -0 takes part (rules revision 7; version 4); 2, no NaN does (rules
     * revision 16; version 6). */
    Py_ssize_t (*near_pass)(double *x, Py_ssize_t outer, Py_ssize_t channels, Py_ssize_t inner,
                            const double *thresholds, const double *rows, double tau, double c1, double lo,
                            double hi, int flags, Py_ssize_t start, DetrlEntries *out, DetrlEntries *counts);
    /* channel_thresholds: out[c] = T of channel c; returns -1 where it could not allocate. */
    int (*channel_thresholds)(const double *x, Py_ssize_t outer, Py_ssize_t channels, Py_ssize_t inner,
                              double tau, double *out);
    /* unit_factors: a matrix product's unit factor of each row of a strided matrix (strides in elements);
     * returns -1 where it could not allocate. */
    int (*unit_factors)(const double *x, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t row_stride,
                        Py_ssize_t col_stride, double times, double *out);
    /* exact_sums: which of outer sums of terms FP64 terms (sum i's term j at x[i * outer_stride + j *
     * term_stride]) every order computes exactly, as 0/1 bytes; returns 0 (the mask unwritten) where a term
     * is off the FP32 grid, -1 where it could not allocate, else 1 (strides: version 5). */
    int (*exact_sums)(const double *x, Py_ssize_t outer, Py_ssize_t terms, Py_ssize_t outer_stride,
                      Py_ssize_t term_stride, uint8_t *mask);
    /* exact_rows: decompose._exact_rows' rule for a layer norm's outer rows of n FP64 values (row-major):
     * 0/1 bytes, 1 where every order sums the row exactly (version 3). */
    void (*exact_rows)(const double *x, Py_ssize_t outer, Py_ssize_t n, uint8_t *mask);
    /* exact_embedding_sums: exact_sums' rule for an embedding's gradient, tokens x width terms added to the
     * rows indices name in a (rows, width) table: 1 (mask written), 0 (a term off the grid or an index out
     * of range: no mask), -1 (out of memory) (version 4). */
    int (*exact_embedding_sums)(const double *grad, Py_ssize_t tokens, Py_ssize_t width, const int64_t *indices,
                                Py_ssize_t rows, uint8_t *mask);
} DetrlKernelApi;

#ifdef __cplusplus
}
#endif

#endif
