"""Hardware profiles: emulate hardware that computes in a different (but mathematically equal) order.

We have no GPU fleet in CI, yet the interesting question is what happens to training when the *same*
program runs on hardware whose kernels sum the terms of a reduction in another order, or whose math library
returns other last bits.  Floating-point addition is not associative, so such hardware returns results that
are mathematically equal to the native ones but differ in their last bits.  A :class:`Profile` computes one
aten op the way such hardware would; :class:`HardwareMode` applies a profile to every op run under it.

Profiles (see :func:`get_profile`):

``native``
    Plain torch: the op is called unchanged.
``emulated:splitk``
    Split-K: the reduced axis is cut into contiguous chunks of 45 elements (24 input channels for
    convolutions, 3 samples for the batch reduction of weight gradients, 3 elements of a row) -- odd sizes,
    so the chunk boundaries do not line up with the power-of-two blocking of native kernels -- each chunk is
    reduced by the native kernel and the partial results are accumulated left to right.
``emulated:reversed``
    The reduced axis is flipped and then cut into chunks of 64 (16 channels, 2 samples, 4 row elements)
    accumulated left to right; i.e. the chunks of the original axis are accumulated last to first and the
    native kernel also walks each chunk backwards.
``emulated:pairwise``
    GPU-like: chunks of 32 (8 channels, 1 sample, 2 row elements) whose partials are summed by a balanced
    binary tree, as warp shuffles do; and *another libm*: every transcendental result (exp, exp2, expm1,
    log, log2, log10, log1p, tanh, sigmoid, erf, erfc, erfinv, sin, cos, tan, rsqrt, pow, and the
    activations built on them: gelu, silu, mish, elu, softplus, log-sigmoid, with the backward kernels of
    gelu, silu and softplus) moves by 0, 1 or 2 FP64 ulps (float32: ulps of float32), picked by a hash of
    the result's own bits -- a pure function of the input, as a libm is -- while results every libm gets
    exactly stay (``exp(0) = 1``, saturated ``+-1``, pass-throughs such as ``gelu(x) = x``, the branches of
    elu and softplus that call no libm, and ``pow`` exponents kernels compute with IEEE operations: 0,
    0.5, 1, 2, 3, -1, -2).  ``sqrt`` and division are correctly rounded by IEEE 754 and never move.  The
    libm rides on this profile rather than one of its own: a GPU differs in both ways at once, and
    calibration (which reruns every op under each profile) and the replay matrices keep four profiles.
``emulated:atomic``
    Like GPU kernels that accumulate with atomics: every call draws a *fresh* random permutation of the
    reduced axis, cuts it into chunks of 64 (16 channels, 1 sample, 4 row elements) and accumulates them in
    that order.  The permutations come from a ``torch.Generator`` seeded from ``os.urandom`` when the
    profile is created, so two runs with all seeds fixed still differ (pass ``seed`` for reproducible tests).
``cuda``
    Alias of ``native`` for running on a CUDA device; only available when one is present.

To bound the Python overhead a reduction is never cut into more than :data:`MAX_PIECES` chunks: for
longer axes the chunk grows to the smallest multiple of the base size that fits (e.g. a K of 4608 under
``splitk`` uses 26 chunks of 180, the last one shorter).  Reductions too short for two chunks run natively.

Emulated ops (float32 and float64 everywhere, half types where noted; any device):

* Matrix products and convolutions, half types too (accumulated in float32, rounded once at the end):
  ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``convolution`` (split over input channels, within each group),
  ``convolution_backward`` (grad_input split over output channels, grad_weight / grad_bias over the batch).
* ``sum`` and ``mean``; batch norm forward and backward in training mode (per-channel sums in profile order,
  :mod:`detrl.core.decompose`); ``cumsum`` as a chunked scan; ``avg_pool2d``, ``avg_pool3d`` and their
  backward (each element's terms, :mod:`detrl.core.pools`, summed in the profile's row chunks); the same for
  the adaptive average pools and their backward (each window's sum divided by its size), nearest
  upsampling's backward and ``col2im``.
* Linear interpolations (``upsample_linear1d``, ``upsample_bilinear2d``, ``upsample_trilinear3d``) and
  their backward, one spatial dim at a time as products with each dim's weights (a separable kernel's
  order, :mod:`detrl.core.interpolation`).
* Rows, recomputed from their textbook formulas with every sum in the profile's row order (the ``"row"``
  chunk) and pairwise's libm: layer norm and group norm, forward (two-pass mean and variance where native
  kernels use Welford's update, which leaves an ulp of error in the mean that a two-pass sum of FP32-grid
  values does not) and backward (the row sums of
  the input gradient; the weight and bias gradients summed over rows); ``_softmax``, ``_log_softmax`` and
  their backward (the max is exact in any order, the sum of exponentials is not); layer norm, softmax and
  their backward from the formulas in :mod:`detrl.core.decompose`, as batch norm; ``nll_loss`` and
  ``nll_loss2d`` with ``sum``/``mean`` reduction (cross-entropy is log-softmax plus NLL), and their backward
  (which sums nothing: only the class weight's product is taken in another order); ``embedding_dense_backward``
  (each index's duplicate rows ranked in the profile's order of the occurrences, cut into row chunks and
  combined in plan order, every add to distinct rows so no device's scatter-add order enters);
  ``linalg_vector_norm``, ``norm`` and ``_foreach_norm`` (``clip_grad_norm_``) for finite non-zero orders.
* Pairwise's libm: the transcendental ops listed above (functional and in-place ``.default`` overloads).

Every other op, ``out=`` overloads, integer/complex dtypes, half types outside matrix products and
convolutions, and non-strided layouts run natively.  In verifiable precision the rounding mode decomposes
batch norm, layer norm and their backward, and the backward of softmax and log-softmax, before a profile
sees them (:mod:`detrl.core.decompose`): their sums and exponentials reach the profile as ``sum`` and ``exp``
ops, the row sums of layer norm and softmax marked (:func:`detrl.core.decompose.summing_rows`) to be ordered in
row chunks.  In float64 the emulated results agree with native to
a few ulps at the result's scale; in float32 most elements of a large reduction differ.
"""

from __future__ import annotations

# The handler families register the ops they reorder when imported; the profiles dispatch through them.
from detrl.core.hardware import libm, products, rows, sums  # noqa: F401
from detrl.core.hardware.profiles import (
    MAX_PIECES,
    EmulatedProfile,
    HardwareMode,
    Profile,
    get_profile,
    profile_names,
)

__all__ = ["HardwareMode", "MAX_PIECES", "Profile", "EmulatedProfile", "get_profile", "profile_names"]
