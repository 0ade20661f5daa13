"""Which aten ops need rounding, and which need rounding-log entries, in verifiable precision.

Every FP64 result is rounded to FP32 so that each op starts from FP32-grid inputs on every machine. What
differs between ops is whether two IEEE-754 machines can disagree about the FP64 result:

``KEEP``
    The result is one of the inputs' values (or a constant on the grid): views, copies, concatenation,
    indexing, relu, max, neg, abs, where, ... Nothing to do.
``EXACT``
    IEEE-754 requires the FP64 result to be correctly rounded (add, sub, mul, div, sqrt of FP32-grid
    inputs, casts, fills), so every conforming machine computes the same FP64 value and the FP32 rounding
    of it is the same too. Round to nearest; no log entries.
``ELEMENTWISE``
    Per-element results whose last FP64 bits depend on the implementation: transcendental functions
    (libm and CUDA differ within an ulp or two), and fused multi-step ops (addcmul, addcdiv, lerp, add with
    ``alpha``) that a GPU compiler contracts into FMAs. The disagreement is relative to the element, so
    the threshold is measured in FP32 spacings *at the element*.
``REDUCTION``
    Sums whose order varies by hardware: mm, convolution and their backward, sum/mean, norm layers,
    log-softmax, losses, embedding backward. The disagreement scales with the output's magnitude, not the
    element's, so the threshold is measured in FP32 spacings *at the output's largest magnitude*. This is
    the default for every op not listed: an unknown op is logged, never trusted.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

aten = torch.ops.aten


class OpKind(enum.Enum):
    KEEP = "keep"
    EXACT = "exact"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


_KEEP = _packets(
    "clone", "copy_", "detach", "alias", "lift_fresh", "lift_fresh_copy", "_unsafe_view", "contiguous",
    "cat", "stack", "index", "index_select", "gather", "select_scatter", "slice_scatter", "embedding",
    "relu", "relu_", "threshold_backward", "max_pool2d_with_indices", "neg", "neg_", "abs", "abs_",
    "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "new_zeros", "new_ones", "zero_", "sign", "maximum", "minimum", "max", "min",
    "amax", "amin", "sort", "topk", "flip", "roll", "repeat", "bernoulli_", "bernoulli", "_foreach_neg",
    "_foreach_zero_", "_foreach_copy_", "_foreach_abs", "unbind", "split", "split_with_sizes", "chunk",
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit", "narrow", "squeeze", "unsqueeze", "t", "transpose", "permute", "expand", "view", "reshape",
    "slice", "select", "diagonal", "unfold", "as_strided", "masked_select", "resize_", "set_",
    "_local_scalar_dense", "item",
)  # fmt: skip
# (_local_scalar_dense, behind .item() and float(t), reads one value out as a Python number: no tensor to
# round, and a float32 one needs no FP64 twin. Torch's optimizers read their float32 step counters so.)

_EXACT = _packets(
    "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_", "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "sqrt", "sqrt_", "reciprocal",
    "reciprocal_", "_to_copy", "to", "fill", "fill_", "full", "full_like", "scalar_tensor", "masked_fill",
    "masked_fill_", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "hardtanh",
    "hardtanh_", "constant_pad_nd", "where", "native_dropout", "native_dropout_backward", "arange",
    "_foreach_add", "_foreach_add_", "_foreach_sub", "_foreach_sub_", "_foreach_mul", "_foreach_mul_",
    "_foreach_div", "_foreach_div_", "_foreach_sqrt", "_foreach_sqrt_", "_foreach_reciprocal",
    "_foreach_reciprocal_", "square", "_foreach_maximum_", "_foreach_clamp_min_", "_foreach_clamp_max_",
    "mse_loss_backward", "uniform_", "normal_", "rand", "randn", "randint", "randperm", "exponential_",
    "random_", "rand_like", "randn_like",
)  # fmt: skip

#: EXACT ops whose float32 result is the FP64 result rounded to FP32, for float32 operands and numbers that
#: float32 holds exactly: one IEEE add, subtract, multiply or divide (FP64 has more than twice float32's
#: precision, so rounding twice gives the same value), or no arithmetic at all (fills, selections, clamps,
#: padding). A float32 "island" of one of them may run natively in float32 (the native route does): the same
#: bits as its FP64 twin rounded (detrl/core/islands.py). Not the others: torch's float32 sqrt and
#: reciprocal are vectorised approximations that can round the other way (measured: sqrt of 0.2091 came out
#: one ulp above the correctly rounded value), mse_loss_backward is several operations, div with a rounding
#: mode rounds in between, arange accumulates.
FLOAT32_EXACT = _packets(
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "fill", "fill_", "full", "full_like",
    "scalar_tensor", "masked_fill", "masked_fill_", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max",
    "clamp_max_", "hardtanh", "hardtanh_", "constant_pad_nd", "where", "square", "_foreach_add",
    "_foreach_add_", "_foreach_sub", "_foreach_sub_", "_foreach_mul", "_foreach_mul_", "_foreach_div",
    "_foreach_div_", "_foreach_maximum_", "_foreach_clamp_min_", "_foreach_clamp_max_",
)  # fmt: skip

#: torch.amp's GradScaler bookkeeping, which takes its scale and flags in float32 by design (its CPU kernels
#: refuse them in float64): run as given, not as an FP64 island. EXACT: the gradients' product by the
#: float32 inverse scale is exact in FP64 (24 by 24 significant bits), the rest is flags and powers of two.
AS_GIVEN = _packets("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_")

_ELEMENTWISE = _packets(
    "exp", "exp_", "log", "log_", "log1p", "expm1", "tanh", "tanh_", "sigmoid", "sigmoid_", "gelu",
    "gelu_backward", "erf", "erfinv", "pow", "pow_", "rsqrt", "rsqrt_", "sin", "cos", "silu",
    "silu_backward", "softplus", "softplus_backward", "tanh_backward", "sigmoid_backward", "addcmul",
    "addcmul_", "addcdiv", "addcdiv_", "lerp", "lerp_", "_foreach_addcmul", "_foreach_addcmul_",
    "_foreach_addcdiv", "_foreach_addcdiv_", "_foreach_lerp", "_foreach_lerp_", "_foreach_pow",
    "_foreach_pow_", "_foreach_exp", "_foreach_exp_", "_softmax", "elu", "elu_backward", "leaky_relu",
    "leaky_relu_backward", "hardswish", "log_sigmoid_forward",
)  # fmt: skip
# (addcmul, addcdiv, lerp and add/sub with alpha are computed step by step by detrl/core/fused.py, which
# makes them EXACT; they are listed above for the overloads it does not cover, e.g. ``out=`` variants.)

# Ops in _EXACT that become fused (FMA-able) when a scaling argument is not 1.
_ALPHA_FUSED = _packets(
    "add", "add_", "sub", "sub_", "rsub", "_foreach_add", "_foreach_add_", "_foreach_sub_"
)


#: Ops that update arguments their schema does not mark as written (batch norm's running statistics), by
#: the positions of those arguments: the rounding mode rounds (and logs) them too.
HIDDEN_WRITES: dict[Any, tuple[int, ...]] = {
    aten.native_batch_norm.default: (3, 4),
    aten._native_batch_norm_legit.default: (3, 4),
}


def _ctc_unwritten(args: Sequence[Any], out: Any) -> None:
    """``_ctc_loss(log_probs: (T, N, C), targets, input_lengths, target_lengths, ...)`` returns
    ``(loss: (N,), log_alpha: (N, T, 2 * max target length + 1))``; the CPU kernel writes a sample's
    ``log_alpha`` only up to its input length and ``2 * target length + 1`` states, and leaves the rest as
    the allocator gave it (other values at every call). Its backward reads only the written ones: the rest
    is set to ``-inf`` (log 0), the same on every machine."""
    log_alpha = out[1]
    lengths = [args[2], args[3]]
    inputs, targets = (
        [int(v) for v in x.tolist()] if isinstance(x, torch.Tensor) else list(x) for x in lengths
    )
    for n, (t, s) in enumerate(zip(inputs, targets, strict=True)):
        log_alpha[n, t:].fill_(-math.inf)
        log_alpha[n, :, 2 * s + 1 :].fill_(-math.inf)


#: Ops whose outputs hold elements their kernel leaves unwritten (uninitialised memory, other values at
#: every call): ``(args, out) -> None`` sets them to a value every machine agrees on, before they are
#: rounded or logged (the native route leaves these ops to the mode).
UNWRITTEN: dict[Any, Callable[[Sequence[Any], Any], None]] = {
    aten._ctc_loss.default: _ctc_unwritten,
    aten._ctc_loss.Tensor: _ctc_unwritten,
}


#: Rules revision 8: ops whose result holds only their inputs' values, zeros, or their inputs rounded to
#: integers (an FP32 value's integer part is an FP32 value), so the FP64 result of FP32-grid inputs is on the
#: grid already: ``KEEP``. Before, unlisted, they were logged as reductions, rounded to no effect and
#: numbered; a strided result (the LSTM's gate split, ``unsafe_split``) was copied dense to be rounded and
#: copied back. Splits, the backwards of slicing (zeros, then the gradient copied in), triangles, shuffles,
#: nearest upsampling and reflective or replicating padding (copies; their backwards add overlapping
#: gradients and stay logged), the element a selection picks (median, kthvalue, running max), and the
#: functionalised copies of views. Not ``view_copy``, whose ``dtype`` overload reinterprets bits.
KEEP_FROM_8 = _packets(
    "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk", "slice_backward", "select_backward",
    "diagonal_backward", "ceil", "ceil_", "floor", "floor_", "trunc", "trunc_", "tril", "tril_", "triu",
    "triu_", "masked_scatter", "masked_scatter_", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
    "native_channel_shuffle", "repeat_interleave", "_unsafe_index", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "diag_embed", "diag", "im2col",
    "hardtanh_backward", "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "kthvalue", "median", "nanmedian", "cummax", "cummin", "msort", "alias_copy",
    "unsqueeze_copy", "squeeze_copy", "t_copy", "transpose_copy", "permute_copy", "expand_copy", "slice_copy",
    "select_copy", "split_copy", "split_with_sizes_copy", "unbind_copy", "diagonal_copy", "as_strided_copy",
    "detach_copy", "_reshape_copy", "unfold_copy", "index_copy", "index_copy_", "take",
)  # fmt: skip


#: Rules revision 11: activations and their pieces that were unlisted, so logged as reductions at their
#: channel's largest value (a small element of a channel lay "near" a midpoint and took a pinned entry). PReLU
#: is one product an element (forward: ``x`` or ``w * x``; backward: ``g`` or ``w * g``, and ``x * g``), exact
#: in FP64 for FP32-grid operands; ``threshold`` picks ``x`` or the given value. Hard sigmoid is an exact
#: ``x + 3`` and one division (a GPU's multiply by ``1/6`` is within an ulp of it), its backward ``g / 6``,
#: and Mish ``x * tanh(softplus(x))``: per-element results with no terms to cancel, off by an ulp or two
#: between libraries, so ``ELEMENTWISE``. Not Mish's backward, whose two terms cancel near its minimum, at
#: an element's own units beyond what its libraries' error allows: it stays a reduction.
KINDS_FROM_11: dict[Any, OpKind] = {
    **dict.fromkeys(_packets("_prelu_kernel", "_prelu_kernel_backward", "threshold"), OpKind.EXACT),
    **dict.fromkeys(_packets("hardsigmoid", "hardsigmoid_backward", "mish"), OpKind.ELEMENTWISE),
}


#: Rules revision 11: GELU and the backwards of GELU and SiLU, whose results cancel, measured in units of their
#: first argument. GELU is ``x Phi(x)`` with ``Phi`` from ``1 + erf`` (or ``1 + tanh``), which cancels for
#: ``x < -3``; the backwards are ``g`` times two terms that cancel near one point (``Phi(x) + x phi(x)`` at
#: ``x = -0.75``, ``s (1 + x (1 - s))`` at ``x = -1.28``). A library computes them within a few ulps of
#: ``|x|`` or ``|g|``, not of the result: against a 200-bit reference, torch's CPU kernels were off by up to
#: 2.6e5 FP64 ulps of the result for GELU at x = -5 (2.4e6 with the tanh form) and up to 5.9e7 (GELU's
#: backward) and 3.0e6 (SiLU's) at float32 inputs within 0.002 of those points. As ``ELEMENTWISE`` their
#: threshold, in ulps of the result, did not cover that: a replay on another library could round such an
#: element the other way, unlogged. From 11 they are reductions in units of ``|x|`` or ``|g|``
#: (:func:`detrl.core.scale.reduction_scale`). GELU in place (``gelu_``, whose input is gone once it ran) is
#: left a reduction at its channel's scale, as it was.
GRADIENT_SCALED_FROM_11 = frozenset(
    {aten.gelu.default, aten.gelu_backward.default, aten.silu_backward.default}
)
#: Rules revision 14: the cumulative sums measured in their terms' units, element by element.
RUNNING_SUMS_FROM_14 = frozenset({aten.cumsum.default})
#: Rules revision 15: the average pools and their backwards, measured in their terms' units element by element.
POOL_SUMS_FROM_15 = frozenset({
    aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default,
})  # fmt: skip
#: Rules revision 17: the adaptive average pools and their backwards, the backwards of nearest upsampling,
#: and ``col2im``, as the average pools from 15 (their windows: :class:`detrl.core.pools.BoxPool`).
BOX_POOLS_FROM_17 = frozenset({
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default,
    aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default,
    aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
    aten.upsample_nearest3d_backward.default, aten._upsample_nearest_exact1d_backward.default,
    aten._upsample_nearest_exact2d_backward.default, aten._upsample_nearest_exact3d_backward.default,
    aten.col2im.default,
})  # fmt: skip
#: Rules revision 18: the linear interpolations and their backwards, measured in units of the values their
#: weights reach, element by element, with their exact elements found (:mod:`detrl.core.interpolation`).
INTERPOLATIONS_FROM_18 = frozenset({
    aten.upsample_linear1d.default, aten.upsample_bilinear2d.default, aten.upsample_trilinear3d.default,
    aten.upsample_linear1d_backward.default, aten.upsample_bilinear2d_backward.default,
    aten.upsample_trilinear3d_backward.default,
})  # fmt: skip


def classify(func: Any, kwargs: dict[str, Any], rules_revision: int | None = None) -> OpKind:
    """The :class:`OpKind` of aten overload ``func`` called with ``kwargs``, under rules revision
    ``rules_revision`` (a bundle's; None: the current one, :data:`RULES_REVISION`)."""
    kind = _base_kind(func)
    if kind is OpKind.EXACT and func.overloadpacket in _ALPHA_FUSED and kwargs.get("alpha", 1) != 1:
        return OpKind.ELEMENTWISE
    if kind is OpKind.REDUCTION and func.overloadpacket in KEEP_FROM_8:
        return OpKind.KEEP if (rules_revision or RULES_REVISION) >= 8 else kind
    if kind is OpKind.REDUCTION and (rules_revision or RULES_REVISION) >= 11:
        return _kind_from_11(func.overloadpacket) or kind
    if func in GRADIENT_SCALED_FROM_11 and (rules_revision or RULES_REVISION) >= 11:
        return OpKind.REDUCTION
    return kind


@functools.cache
def _kind_from_11(packet: Any) -> OpKind | None:
    """An unlisted op's kind from rules revision 11 (None: still a reduction): :data:`KINDS_FROM_11`'s, or the
    kind of the op an in-place op is the form of (``silu_`` is ``silu``, written into its input: an
    ``inplace=True`` activation was logged as a reduction while its out-of-place form was not)."""
    if packet in KINDS_FROM_11:
        return KINDS_FROM_11[packet]
    name = packet.__name__
    functional = getattr(aten, name[:-1], None) if name.endswith("_") and not name.endswith("__") else None
    if functional is None:
        return None
    if any(getattr(functional, o) in GRADIENT_SCALED_FROM_11 for o in functional.overloads()):
        return None  # its unit needs its input, which the op overwrites
    kind = KINDS_FROM_11.get(functional)
    if kind is None and functional in _KEEP | _EXACT | _ELEMENTWISE:
        kind = _base_kind(next(getattr(functional, o) for o in functional.overloads()))
    return kind


@functools.cache
def _base_kind(func: Any) -> OpKind:
    packet = func.overloadpacket
    if packet in _KEEP:
        return OpKind.KEEP
    if packet in _EXACT:
        return OpKind.EXACT
    if packet in _ELEMENTWISE:
        return OpKind.ELEMENTWISE
    return OpKind.REDUCTION


#: The revision of the rules that decide, per call, an op's kind and the unit its threshold is measured in.
#: A verifiable bundle's log is keyed by the position of each logged op and checked in its unit, so a bundle
#: replays under the rules it was recorded with: its manifest says which (``rules_revision``, 1 where
#: absent), and the engine keeps every older rule for as long as bundles of it should replay.
#:
#: 1. The rules before revisions.
#: 2. ``pow(x, 2)`` is EXACT: torch computes it as ``x * x`` on every device, and the square of an FP32
#:    value is exact in FP64 (48 significant bits), so every machine rounds the same FP64 value. (Squares
#:    land on an FP32 midpoint far more often than other results: 118 of a million random FP32 values.)
#:    Elements of a sum (:data:`EXACT_SUMS`) that are exact in FP64 in every order need no log entry
#:    (:func:`detrl.core.scale.exact_sum_elements`).
#: 3. A convolution whose every partial sum of products is exact in FP64 in every order (inputs with few
#:    significant bits: a first layer on pixel data) needs no log entry
#:    (:func:`detrl.core.scale.exact_product_elements`, :data:`EXACT_PRODUCTS`).
#: 4. Calibration gives each output of a call class with several rounded outputs a threshold of its own
#:    (:func:`detrl.core.rounding.output_key`): a convolution's input gradient (a few thousand products a
#:    sum) was logged at its weight gradient's threshold (8,192 products a sum, 10-50x the disagreement).
#: 5. A sum or a mean (``sum``, ``mean``, with or without dims) is measured in its terms' units, not its
#:    result's (:func:`detrl.core.scale.reduction_scale`): where the terms cancel, the result's own
#:    magnitude says nothing of how far two orders can be apart (a batch norm's backward before global
#:    average pooling sums to rounding noise), and such a call, logged at the threshold of its class's
#:    well-conditioned calls, diverged on replay with no anomaly.
#: 6. A convolution's weight and bias gradients are measured in their terms' units, as an ``mm`` is
#:    (:func:`detrl.core.scale.reduction_scale`): followed by a training-mode batch norm, a layer's gradient
#:    cancels over the batch (EfficientNet's last projection), and at its own channel scale an honest
#:    replay diverged. And a call's class (:func:`call_class`, the key of its threshold) names no memory
#:    layout and no device: those are the machine's choice, and a replay on another layout took another
#:    threshold than the recorder's.
#: 7. A replayer takes an unlogged element of a reduction that it sees near a midpoint, within reach of
#:    zero, for the recorder's +0, and the recorder logs a reduction's negative values that round to -0
#:    (:func:`negative_zeros`). Before, no element that rounds to zero was ever logged, and a layer norm's
#:    backward row sum that cancelled to exactly 0.0 on the recorder left rounding noise (1e-19) on another
#:    order, which the replay rounded: about half of the initialisations of a layer norm followed by a mean
#:    over its features diverged.
#: 8. Ops that only move, select or zero their inputs' values, or round them to integers, are ``KEEP``
#:    (:data:`KEEP_FROM_8`): they were logged as reductions (unlisted), which rounded nothing, took an op
#:    position, copied a strided result dense and back (the LSTM's gate split: 1,170 copies a step), and
#:    logged a copied value far below its channel's largest as "near" a midpoint (a mixture of experts'
#:    routing: a fifth of its log), though every machine copies it alike.
#: 9. Elements of a scatter that adds (``index_put`` with ``accumulate=True``, ``scatter_add``, ``index_add``:
#:    :data:`EXACT_SCATTERS`) that are exact in FP64 in every order need no log entry, as a sum's
#:    (:func:`detrl.core.scale.exact_scatter_elements`). The backward of a gather is one: a mixture of
#:    experts' routing (each token's gradient from its two experts, 91 % of a tiny Mixtral's log), a graph
#:    network's messages.
#: 10. The decompositions (batch norm, layer norm, group norm) take a correctly rounded FP64 square root
#:    (:func:`detrl.core.portable.ieee_sqrt`): torch's CPU ``sqrt`` of MKL builds is a vector library's,
#:    off the nearest double in about 1 % of elements, and a GPU's is correctly rounded, so the root of a
#:    variance (not on the FP32 grid) could differ in its last bit between recorder and auditor, and every
#:    normalised element of that channel or row with it, unlogged (rounded as exact).
#: 11. PReLU and ``threshold`` are ``EXACT``, hard sigmoid (and its backward) and Mish ``ELEMENTWISE``
#:    (:data:`KINDS_FROM_11`), and an in-place op takes its out-of-place form's kind (``silu_``,
#:    ``leaky_relu_``, ``elu_``, ``hardsigmoid_``, ...): unlisted, each was a reduction at its channel's largest
#:    value, and its small elements took pinned entries (PReLU's backward in a saturated network). And GELU
#:    and the backwards of GELU and SiLU are reductions in units of their first argument
#:    (:data:`GRADIENT_SCALED_FROM_11`): as elementwise ops, where their terms cancel, two libraries'
#:    results lay further apart than their threshold covered.
#: 12. An op argument that is FP64's largest finite number, either sign (a Python number, or a one-element
#:    FP64 tensor on the CPU: ``torch.finfo(torch.float64).min``), is taken as FP32's
#:    (:func:`fp32_extremes`). A model asks ``torch.finfo`` of the dtype it runs in, which is FP64 here, and
#:    writes its minimum as "minus infinity, but finite" into attention masks: in FP32 that is -3.4e38, but
#:    rounded to FP32 it was -inf, and a row masked whole (a padded query row of DeBERTa's, a left-padded
#:    sequence's first rows) became NaN through its softmax, which trains nothing, and whose NaN bits
#:    differ between machines.
#: 13. A commitment takes every NaN as one NaN (:func:`canonical_nans`;
#:    :func:`detrl.formats.commit.nans_canonical`): IEEE leaves a NaN's sign and payload to the hardware and
#:    to the order of operands (an x86 CPU's invalid operation gives -NaN, an emulated sum's +NaN, a GPU its
#:    own), so a run gone NaN committed bits that an honest replay on other hardware did not have: its state
#:    hashes differed at the first NaN though every value agreed.
#: 14. A cumulative sum (:data:`RUNNING_SUMS_FROM_14`) is a sum at each element: its elements exact in every
#:    order need no log entry (:func:`detrl.core.scale.exact_running_sum_elements`), and each is measured in
#:    the units of the terms it sums (:func:`detrl.core.scale.reduction_scale`). Unlisted, it was a reduction
#:    at its channel's largest value, and its elements that are sums of a few FP32 values of one binade,
#:    exactly on an FP32 midpoint, took entries no machine needed: a tiny Mamba-2's cumulative decays, a
#:    twentieth of their elements and 85 % of its log.
#: 15. An average pool and its backward (:data:`POOL_SUMS_FROM_15`) are sums at each element: those exact in
#:    every order need no log entry (:func:`detrl.core.scale.exact_pool_elements`: a window's sum exact in
#:    FP64, then one IEEE division; a backward's terms divided by a power of two), and each is measured in
#:    the units of the terms it sums (:func:`detrl.core.scale.reduction_scale`). Unlisted, a 2x2 pool of
#:    FP32 values, a sum of four divided by 4, lay exactly on an FP32 midpoint for one element in twenty,
#:    and each took an entry: local response norm's and LP pool's pools were 98 % of a model's log.
#: 16. A NaN is never near a midpoint (:func:`nans_unlogged`): it compares unequal to everything, so every
#:    NaN element took an entry that changes nothing on replay (rounding a NaN in either direction leaves a
#:    NaN, and commitments take every NaN as one from 13). A run gone NaN logged most of its elements: an
#:    attention layer with one sample's keys all padding, 54,046 entries a step.
#: 17. An adaptive average pool, its backward, a nearest upsampling's backward and ``col2im``
#:    (:data:`BOX_POOLS_FROM_17`) are sums at each element, as the average pools are from 15, over windows of
#:    unequal lengths (``F.interpolate(mode="area")``, a pyramid pooling's bins; a feature pyramid's
#:    upsampling by 2, whose backward sums four gradients; ``F.fold``'s overlap-add). An adaptive pool's
#:    forward element is exact where its window's sum is and every way of dividing that sum rounds alike
#:    (:func:`detrl.core.scale.exact_pool_elements`): a CPU divides by the window's size in its vectorised
#:    channels-last loop and by each of its lengths in turn elsewhere, in one call. Unlisted, a window of two
#:    FP32 values of one binade lay exactly on an FP32 midpoint for about half of its elements: an area
#:    upsampling from 7 x 7 to 11 x 11 logged 1,208 entries in 3 steps and logs none, a nearest one 369 and
#:    1, an unfold and fold of 3 x 3 patches 473 and 1.
#: 18. A linear interpolation and its backward (:data:`INTERPOLATIONS_FROM_18`: ``F.interpolate`` in the
#:    ``linear``, ``bilinear`` and ``trilinear`` modes) are measured at each element in units of the input
#:    values its weights reach (:func:`detrl.core.scale.reduction_scale`), and where every dim's weights are
#:    exact on every machine (a scale factor of 2, 4, 8, ...) its elements exact in every order need no
#:    entry (:func:`detrl.core.scale.exact_interpolation_elements`). Unlisted, they were reductions at their
#:    channel's largest value, and upsampling by 2 (3/4 and 1/4 of two values of one binade: an exact sum,
#:    on an FP32 midpoint a fifth of the time) took most of a segmentation model's log: a tiny BEiT's 17,410
#:    entries in 3 steps, 15,931 of them in ``upsample_bilinear2d``, and 328 under 18.
RULES_REVISION = 18
#: The revisions that fixed a replication hazard, with what they fixed: under the revision before, an honest
#: replay on hardware unlike the recorder's could diverge, with no log entry where the machines disagreed.
#: (The others made the log smaller.) The auditor names those after a bundle's revision when it diverges.
REPLICATION_FIXES = {
    5: "sums and means in their terms' units",
    6: "convolution gradients in their terms' units",
    7: "reductions that cancel to -0",
    10: "a correctly rounded square root in the norms",
    11: "GELU and the activation backwards in their arguments' units",
    12: "FP64's extremes (torch.finfo(torch.float64).min, attention masks' value) taken as FP32's",
    13: "every NaN committed as one NaN (its sign and payload are the hardware's)",
}
#: Revision 2: the overloads whose call with exponent 2 is exact.
SQUARES = frozenset({aten.pow.Tensor_Scalar, aten.pow_.Scalar})
#: Revision 2: the sums whose elements exact in every order are found and left unlogged.
EXACT_SUMS = frozenset({aten.sum.dim_IntList, aten.embedding_dense_backward.default})
#: Revision 3: the sums of products whose calls exact in every order are found and left unlogged.
EXACT_PRODUCTS = frozenset({aten.convolution.default})
#: Revision 9: the scatters that add, whose elements exact in every order are found and left unlogged. The
#: in-place forms too (the rounding mode keeps a copy of what they add to): ``index_put`` runs as
#: ``_index_put_impl_`` on a copy below the native route.
EXACT_SCATTERS = frozenset({
    aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
    aten.scatter_add.default, aten.scatter_add_.default, aten.index_add.default, aten.index_add_.default,
})  # fmt: skip


def exact_rule(func: Any, rules_revision: int) -> bool:
    """Whether calls of ``func`` have elements every machine computes alike that need no log entry, under
    rules revision ``rules_revision`` (:func:`detrl.core.scale.exact_elements` finds them)."""
    return (
        (rules_revision >= 2 and func in EXACT_SUMS)
        or (rules_revision >= 3 and func in EXACT_PRODUCTS)
        or (rules_revision >= 9 and func in EXACT_SCATTERS)
        or (rules_revision >= 14 and func in RUNNING_SUMS_FROM_14)
        or (rules_revision >= 15 and func in POOL_SUMS_FROM_15)
        or (rules_revision >= 17 and func in BOX_POOLS_FROM_17)
        or (rules_revision >= 18 and func in INTERPOLATIONS_FROM_18)
    )


def negative_zeros(rules_revision: int) -> bool:
    """Whether, under rules revision ``rules_revision``, a reduction's negative value that rounds to -0 takes
    part in the near-midpoint test, and a replayer rounds an unlogged near element within reach of zero to
    +0 (revision 7: :func:`detrl.core.rounding.near_midpoint`, ``rounding._unlogged_zeros``).

    Exact zeros stay out of the test on both sides: structural ones (untouched gradient slots, a one-hot
    loss gradient, masked scores) and exact -0s (Llama's rotary gradient copies -0s through
    ``slice_backward``: 600 to 1,000 entries a step in tiny Hugging Face decoders when they were pinned)
    are the same on every machine."""
    return rules_revision >= 7


#: Revision 12: FP64's largest finite number and FP32's (the ``max`` of ``torch.finfo``; ``min`` is minus it).
FP64_EXTREME, FP32_EXTREME = torch.finfo(torch.float64).max, torch.finfo(torch.float32).max


def finite_extremes(rules_revision: int) -> bool:
    """Whether, under rules revision ``rules_revision``, an op argument that is FP64's largest finite number,
    either sign, is taken as FP32's (revision 12, :func:`fp32_extremes`)."""
    return rules_revision >= 12


def nans_unlogged(rules_revision: int) -> bool:
    """Whether, under rules revision ``rules_revision``, a NaN is never near a midpoint (revision 16): no entry
    changes a NaN, and commitments take every NaN as one from revision 13 (:func:`canonical_nans`)."""
    return rules_revision >= 16


def canonical_nans(rules_revision: int) -> bool:
    """Whether, under rules revision ``rules_revision``, commitments (state hashes, a dispute's op digests)
    take every NaN as the one NaN of its dtype (revision 13, :func:`detrl.formats.commit.nans_canonical`)."""
    return rules_revision >= 13


def _extreme(a: Any) -> bool:
    if type(a) is float:
        return abs(a) == FP64_EXTREME
    # (a device's tensor would be read with a synchronisation: torch.tensor(number) makes a CPU one)
    return (
        isinstance(a, torch.Tensor)
        and a.dtype == torch.float64
        and a.numel() == 1
        and a.layout == torch.strided
        and a.device.type == "cpu"
        and abs(a.item()) == FP64_EXTREME
    )


def _fp32_extreme(a: Any) -> Any:
    if type(a) is float:
        return math.copysign(FP32_EXTREME, a)
    return torch.full_like(a, math.copysign(FP32_EXTREME, a.item()))


def fp32_extremes(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``args`` and ``kwargs`` of a call of ``func`` with each one that is FP64's largest finite number,
    either sign (a Python number, or a one-element FP64 CPU tensor, as ``torch.tensor(torch.finfo(
    torch.float64).min)`` makes), replaced by FP32's; None where none is (rules revision 12). A tensor the
    call writes (``fill_``'s self, an ``out=``) stays itself: the write must reach it. The native route
    sends such calls to the mode (``native_dispatch.cpp``, ``fp64_extreme_argument``)."""
    if not any(map(_extreme, args)) and not any(map(_extreme, kwargs.values())):
        return None
    schema = func._schema.arguments
    written = {x.name for x in schema if x.alias_info is not None and x.alias_info.is_write}

    def swap(name: str, a: Any) -> Any:
        return (
            _fp32_extreme(a) if _extreme(a) and not (name in written and isinstance(a, torch.Tensor)) else a
        )

    return (
        tuple(swap(schema[i].name if i < len(schema) else "", a) for i, a in enumerate(args)),
        {k: swap(k, v) for k, v in kwargs.items()},
    )


def squares(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call of an overload in :data:`SQUARES` squares: its exponent is an int or float equal to 2
    (not a bool; a tensor exponent is another overload). The native route reads the exponent alike."""
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    return not isinstance(exponent, bool) and isinstance(exponent, (int, float)) and exponent == 2


def op_name(func: Any) -> str:
    """Short stable name of an op kind, a key of the threshold table (``"mm"``, ``"convolution"``)."""
    return func.overloadpacket.__name__


def shape_class(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The class of an op call whose calibrations stand for each other: ``name``; for every tensor argument
    its dtype, rank and the order of its strides (which operand of a product is transposed, which dims are
    broadcast), but not its sizes; every structural argument (int, bool, str, None, dtype: conv stride
    and padding, reduction dims, keepdim, output masks) as it is; float scalars (learning rates, alphas,
    epsilons) by their type only. Arguments in order, keyword ones sorted by name.

    Why not the sizes: the disagreement is measured in FP32 spacings of the result (at its largest
    magnitude for reductions), which takes out the scale, and what is left depends on the sizes far
    less than the margin allows: in a ResNet-50 step at batch 8, the 104 convolution calls (forward and
    backward) past the 3-channel stem disagree by 3.7e-9 to 2.8e-8 spacings, 80% of them within a factor
    4, across widths 64-2048 and resolutions 32-4. With sizes, each stage of a network is a new class
    (67 classes for the step's 328 calibrated calls, still 65% of the full calibration time at two per
    class); without them, 19 classes. Float values would make every step of a learning-rate schedule a
    new class, and they scale values, which the units take out too.

    A string (deterministic, JSON-safe): a key of the checkpointed calibration state."""
    parts = [_arg_class(a) for a in args]
    parts += [f"{k}={_arg_class(kwargs[k])}" for k in sorted(kwargs)]
    return f"{name}({','.join(parts)})"


def call_class(
    name: str, args: Sequence[Any], kwargs: Mapping[str, Any], rules_revision: int = RULES_REVISION
) -> str:
    """The class of an op call that has its own threshold: its :func:`shape_class` with every tensor's
    sizes, ``"mm(float64[10]{768,512},float64[01]{512,3072})"``.

    Why a threshold per class, not only per op: one op's calls disagree by far more in some classes than
    in others. In a GPT-2 small step, ``mm``'s weight gradients (``x.T @ dy``, sums over the batch)
    disagree by up to 2.2e-7 spacings where the tied output embedding's is computed and by 4.5e-8 in the
    MLP's first layer, its input gradients (``dy @ W.T``) by 3e-8 and the output embedding's input
    gradient by 4.5e-9; one threshold per op logged every ``mm`` at the worst call's. Sizes, because
    one stride class holds calls as different as the output embedding's weight gradient and a layer's.

    A string (deterministic, JSON-safe): the same for the same call on every machine (no value and no
    stride enters it but the order of the strides), a key of a bundle's thresholds
    (:attr:`detrl.core.rounding.Thresholds.per_class`), so its format is part of the bundle format
    (docs/verifiable.md).

    From rules revision 6 (``rules_revision``, the bundle's) no layout enters it at all, and no device: the
    class is ``"mm(float64{768,512},float64{512,3072})"`` (a broadcast dim still marked, ``float64[.b]{4,8}``:
    an ``expand`` the model wrote). Which memory layout a kernel gives its result is the machine's choice
    (a depthwise convolution's FP64 CPU kernel keeps a channels-last input's layout, an emulation of it need
    not, and a GPU library picks its own), so a key with the stride order named another class on another
    machine: the replay took its op's threshold instead of the class's, 13x the recorder's (DPT's residual
    convolutions), and reported elements near a midpoint the recorder had rightly not logged."""
    portable = rules_revision >= 6
    parts = [_arg_class(a, sized=True, portable=portable) for a in args]
    parts += [f"{k}={_arg_class(kwargs[k], sized=True, portable=portable)}" for k in sorted(kwargs)]
    return f"{name}({','.join(parts)})"


def _arg_class(a: Any, sized: bool = False, portable: bool = False) -> str:
    if isinstance(a, torch.Tensor):
        dtype = str(a.dtype).removeprefix("torch.")
        sizes = "{" + ",".join(str(n) for n in a.shape) + "}" if sized else ""
        if a.layout != torch.strided:
            return f"{dtype}<{a.layout}>{sizes}"
        strides = a.stride()
        if portable:  # no layout: only the broadcast dims, which the model's own expand makes
            marks = "".join("b" if s == 0 and n > 1 else "." for s, n in zip(strides, a.shape))
            return f"{dtype}[{marks}]{sizes}" if "b" in marks else f"{dtype}{sizes}"
        # dims from the outermost in memory to the innermost; a broadcast (stride 0) dim is marked
        order = sorted(range(a.dim()), key=lambda i: (-strides[i], i))
        return f"{dtype}[{''.join('b' if strides[i] == 0 else str(i) for i in order)}]{sizes}"
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_arg_class(x, sized, portable) for x in a) + "]"
    if portable and isinstance(a, torch.device):
        return "device"  # the machine's, not the call's
    if isinstance(a, bool) or a is None or isinstance(a, (int, str, torch.dtype, torch.device)):
        return repr(a)
    return type(a).__name__  # float, complex, SymFloat, memory formats...: by type only
