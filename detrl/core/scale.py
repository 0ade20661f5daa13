"""The units in which verifiable precision measures how far two machines' FP64 results of one op can be
apart: FP32 spacings at the element (elementwise ops), at an output channel's largest magnitude
(reductions), at a matrix product's row and column scales (``mm``), or at a sample's and channel's largest
magnitude (a convolution's input gradient).

Recorder, replayer, calibrator and the native kernel all take their units from here, so that the same
inputs give the same thresholds, bit for bit, wherever they are computed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from detrl.core import interpolation, pools
from detrl.core.oprules import (
    BOX_POOLS_FROM_17,
    EXACT_SCATTERS,
    GRADIENT_SCALED_FROM_11,
    INTERPOLATIONS_FROM_18,
    POOL_SUMS_FROM_15,
    RULES_REVISION,
    RUNNING_SUMS_FROM_14,
)

try:  # the native kernel's unit factors and exact sums (detrl/core/_roundkernel.c); torch's where not built
    from detrl.core import _roundkernel as _native
except ImportError:
    _native = None

_EXPONENT_BITS = 0x7FF0000000000000


def spacing32(x: torch.Tensor) -> torch.Tensor:
    """FP32 spacing (ulp) at |x|, as FP64; at least the subnormal spacing 2**-149."""
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), (e - 24).clamp(min=-149))


#: Magnitudes at or above this (2**128 - 2**103, the midpoint above FP32's largest finite value) round to an
#: FP32 infinity. Units are set by the elements whose FP32 rounding is finite (:func:`finite_amax`).
FP32_OVERFLOW = 2.0**128 - 2.0**103


def finite_amax(x: torch.Tensor, dim: list[int] | int) -> torch.Tensor:
    """The largest ``|x|`` over ``dim`` (kept, as size 1) among the elements whose FP32 rounding is finite,
    0 where none is, in ``x``'s dtype.

    An infinity or a NaN rounds alike on every machine and is never near a midpoint, so it must not set
    the unit of the values beside it: an attention score masked with ``-inf`` made its whole channel's
    unit infinite, and every score of it a log entry the replayer then refused (``inf - inf`` is no
    distance). The native kernel takes the same maxima (``abs_max`` in ``_roundkernel.c``)."""
    amax = torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())
    bound = FP32_OVERFLOW if x.dtype == torch.float64 else math.inf  # an FP32 tensor's own infinities
    if bool((amax < bound).all()):  # the usual case: every element finite, one pass fewer
        return amax
    magnitude = x.abs()
    return magnitude.masked_fill_(~(magnitude < bound), 0).amax(dim=dim, keepdim=True)


def scale_spacing(x: torch.Tensor) -> torch.Tensor:
    """FP32 spacing at an output's scale, as FP64: its largest magnitude per channel (dim 1) for tensors of
    rank >= 2 (a convolution's output channel, a linear layer's feature), per tensor otherwise, over the
    elements whose FP32 rounding is finite (:func:`finite_amax`).

    Reduction errors grow with the magnitude of the terms summed, which varies by channel far more than
    within one; the result broadcasts against ``x``. ``x`` may be the FP32 rounding of the output (half
    the bytes to read; its binade is the same or, at a binade edge, one higher: a larger, safe spacing).
    """
    dims = [d for d in range(x.dim()) if d != 1] if x.dim() >= 2 else list(range(x.dim()))
    amax = finite_amax(x, dims).double()
    # 2**floor(log2(amax)) by clearing the mantissa bits, times 2**-23: the FP32 spacing there.
    power = (amax.view(torch.int64) & _EXPONENT_BITS).view(torch.float64)
    return power.mul_(2.0**-23).clamp_(min=2.0**-149)


def _power_of_two(x: torch.Tensor) -> torch.Tensor:
    """2**floor(log2(|x|)) of FP64 ``x`` by clearing its sign and mantissa bits (inf and NaN give inf, zero
    gives zero)."""
    return (x.double().view(torch.int64) & _EXPONENT_BITS).view(torch.float64)


@dataclasses.dataclass(frozen=True)
class Scale:
    """The unit (an FP64 spacing) in which a reduction output's disagreement between machines is measured,
    per element, as factors.

    The output is read row-major as ``(outer, channels, inner)``. The unit at element ``(o, c, i)`` is
    ``col[c]`` when ``row`` is None (a channel scale), else ``max(row[o] * col[c], 2**-149)``: a row scale
    times a column scale, the way an ``mm``'s summation error grows (:func:`reduction_scale`).
    ``col``: FP64 ``(channels,)``; ``row``: FP64 ``(outer,)`` or None. Both are powers of two (or inf).
    """

    outer: int
    channels: int
    inner: int
    col: torch.Tensor
    row: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """The unit, broadcastable against the output viewed as ``(outer, channels, inner)``."""
        if self.row is None:
            return self.col.view(1, -1, 1)
        return (self.row.view(-1, 1, 1) * self.col.view(1, -1, 1)).clamp_(min=2.0**-149)

    def at(self, idx: torch.Tensor) -> torch.Tensor:
        """The unit at row-major indices ``idx`` (int64 ``(n,)``), FP64 ``(n,)``: the same products as
        :meth:`dense`, so the same bits."""
        c = (idx // self.inner) % self.channels
        if self.row is None:
            return self.col[c]
        return (self.row[idx // (self.inner * self.channels)] * self.col[c]).clamp_(min=2.0**-149)


def terms_factor(k: int) -> float:
    """How an ``mm``'s disagreement grows with its sum length ``k`` (>= 1), as a power of two:
    ``2**floor(log2(k) / 2)``, about ``sqrt(k)``.

    Two summation orders of ``k`` terms differ by rounding errors of the partial sums, which add up like a
    random walk: ``sqrt(k)`` of them, not ``k``. With ``k`` itself (the bound for errors that all share a
    sign), one threshold per op kind, set by its worst-measured shape, over-covered the long sums by
    ``sqrt(k)``: GPT-2 small's input gradient of the output embedding (``k`` = 50,257) logged 29k entries a
    step, against 10k with this factor. Calibration measures each shape class in this unit and its
    margin covers the rest; replays on every emulated profile at full size check it (docs/roundlog.md).
    """
    return 2.0 ** (math.floor(math.log2(k)) // 2)


def reduction_scale(
    func: Any, args: tuple, out: torch.Tensor, rules_revision: int = RULES_REVISION
) -> Scale | None:
    """The unit of a matrix product's output ``out = a @ b`` (``aten.mm``; ``a: (M, K)``, ``b: (K, N)``),
    from its inputs: FP32 spacing of ``max_k |a[i, k]| * max_k |b[k, j]| * terms_factor(K)`` (about
    ``sqrt(K)``), as row and column factors. A convolution's input gradient: per sample and channel
    (:func:`_sample_channel_scale`); from rules revision 6, each of its gradients from its terms
    (:func:`_conv_terms_scale`). From rules revision 5 (``rules_revision``, the bundle's), a sum or a
    mean from its terms (:func:`_terms_scale`). None for every other op: they are measured at their
    output's channel scale (:func:`scale_spacing`).

    Each term of ``out[i, j]`` is at most ``max|a[i]| max|b[:, j]|``, and a different summation order moves
    the sum by a few FP64 ulps of the partial sums, which add up like a random walk over K terms
    (:func:`terms_factor`). An output column's largest magnitude, the channel scale, is dominated by its
    largest rows: a weight gradient's rows (an LSTM's gates, GPT-2's output-embedding rows for tokens
    absent from the batch) differ by orders of magnitude, and the small rows' elements then all sat within
    the threshold and were logged, pinned, though no machine disagreed on them. The inputs are the same
    bits on every machine, so recorder and replayer compute the same unit.
    """
    if func is _CONV_BACKWARD:
        return _conv_terms_scale(args, out) if rules_revision >= 6 else _sample_channel_scale(args, out)
    if func in TERMS_SCALED:
        return _terms_scale(func, args, out) if rules_revision >= 5 else None
    if func in GRADIENT_SCALED_FROM_11:
        return _gradient_scale(args, out) if rules_revision >= 11 else None
    if func in RUNNING_SUMS_FROM_14:
        return _running_terms_scale(args, out) if rules_revision >= 14 else None
    if func in POOL_SUMS_FROM_15:
        return _pool_terms_scale(func, args, out) if rules_revision >= 15 else None
    if func in BOX_POOLS_FROM_17:
        return _pool_terms_scale(func, args, out) if rules_revision >= 17 else None
    if func in INTERPOLATIONS_FROM_18:
        return _interpolation_scale(func, args, out) if rules_revision >= 18 else None
    if func is not _MM or len(args) < 2:
        return None
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 2):
        return None
    m, k = a.shape
    n = b.shape[1]
    if out.shape != (m, n) or k == 0 or out.numel() == 0:
        return None
    row = unit_factors(a, 1.0)
    col = unit_factors(b.t(), 2.0**-23 * terms_factor(k))
    return Scale(outer=m, channels=n, inner=1, col=col, row=row)


def unit_factors(x: torch.Tensor, times: float) -> torch.Tensor:
    """A matrix product's unit factor per row of a matrix ``x`` (FP64 ``(rows,)``): the power of two at or
    below the row's largest magnitude (over the elements whose FP32 rounding is finite: :func:`finite_amax`),
    at least 2**-149, times ``times`` (a power of two). The native kernel computes it in one pass over a strided FP64 CPU
    matrix, torch's ops elsewhere: the same bits (a max is exact in any order; the rest is exact), so it
    does so whether or not the rounding itself is on the kernel (:func:`detrl.core.kernel.disabled`)."""
    if _native is None or x.dtype != torch.float64 or not x.is_cpu or x.is_neg() or 0 in x.shape:
        return _power_of_two(finite_amax(x, 1).squeeze(1)).clamp_(min=2.0**-149).mul_(times)
    out = torch.empty(x.shape[0], dtype=torch.float64)
    _native.unit_factors(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.stride(1), times, out.data_ptr()
    )
    return out


#: The unit of GELU and of an activation backward (rules revision 11, :data:`GRADIENT_SCALED_FROM_11`) over the
#: power of two at or below their first argument's magnitude, ``|x|`` or ``|g|``: the FP32 spacing at 16 times
#: it. Their terms are at most 1.3 times that argument, and torch's CPU kernels compute them within 9 FP64
#: ulps of it: at the least threshold (``TAU_FLOOR_MEASURED``) two libraries may differ by 128 ulps of that
#: power of two.
GRADIENT_UNIT = 2.0**-19


def _gradient_scale(args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of ``out = gelu(x)`` or of an activation backward's ``out = g * f'(x)`` (``args[0]``: ``x``
    or ``g``, of ``out``'s shape) at each element: :data:`GRADIENT_UNIT` times the power of two at or below
    ``|args[0]|`` there (inf where it is not finite, and the result is not either), at least 2**-149, as a
    channel scale of one element a channel. None where ``args[0]`` is not a tensor of ``out``'s shape."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.shape != out.shape or out.numel() == 0:
        return None
    unit = _power_of_two(first.detach().reshape(-1)).mul_(GRADIENT_UNIT).clamp_(min=2.0**-149)  # sign: masked
    return Scale(outer=1, channels=out.numel(), inner=1, col=unit)


def _terms_scale(func: Any, args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of a sum's (or a mean's) result ``out`` from its terms (rules revision 5): at each result
    element, FP32 spacing of the largest finite ``|term|`` it sums, times ``terms_factor(n)`` for ``n``
    terms (a mean's, divided by the power of two at or below ``n``), as ``(out.numel(),)`` row factors.
    None where ``args`` are not a plain call (then the output's channel scale).

    Two orders of one sum differ by rounding errors of the partial sums, which scale with the terms, not
    with the result: where the terms cancel, a result's own magnitude says nothing about them. A batch
    norm's backward sums ``grad_out * xhat`` over a channel; followed by global average pooling,
    ``grad_out`` is constant there and ``xhat`` sums to zero, so the result is rounding noise. Measured at
    its own scale, that call disagreed by 0.004 spacings between profiles where the forward sums of its
    class (the same op, sizes and dims) disagreed by 2e-9, and calibration, which had measured those, logged
    it at their threshold: an honest replay diverged with no anomaly. In its terms' units the two
    disagree alike."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0 or out.numel() == 0:
        return None
    if func in (_SUM, _MEAN):
        dims: list[int] = list(range(x.dim()))
    else:
        given = args[1] if len(args) > 1 else None
        if given is not None and not isinstance(given, (list, tuple)):
            return None
        dims = sorted({int(d) % max(x.dim(), 1) for d in given}) if given else list(range(x.dim()))
    n = math.prod(x.shape[d] for d in dims) if x.dim() else 1
    if n == 0 or x.numel() // n != out.numel():
        return None
    largest = finite_amax(x, dims)  # a 0-dim x: dims is [], which reduces nothing and keeps x
    row = _power_of_two(largest.reshape(-1)).clamp_(min=2.0**-149)
    factor = 2.0**-23 * terms_factor(n)
    if func in (_MEAN, _MEAN_DIMS):
        factor *= 2.0 ** -(n.bit_length() - 1)
    col = torch.full((1,), factor, dtype=torch.float64, device=row.device)
    return Scale(outer=out.numel(), channels=1, inner=1, col=col, row=row.double())


def _running_terms_scale(args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of a cumulative sum ``out = cumsum(x, dim)`` (rules revision 14) at each element: the unit
    :func:`_terms_scale` gives the sum of the terms it adds, ``x``'s first ``k`` along ``dim`` (FP32 spacing
    of the largest finite ``|term|`` among them, times ``terms_factor(k)``), as ``(out.numel(),)`` row
    factors. None where ``args`` are not a plain call of a floating ``x`` of ``out``'s shape.

    Each element is a sum of its own terms, and two machines' scans associate them differently (a GPU
    carries each block's total into the next); measured at the channel's largest element, the first of
    a long run of same-signed terms sat near every midpoint."""
    x = args[0] if args else None
    dim = args[1] if len(args) > 1 else None
    if not (isinstance(x, torch.Tensor) and isinstance(dim, int) and x.is_floating_point()):
        return None
    if x.shape != out.shape or out.numel() == 0:
        return None
    x = x.detach().reshape(1) if x.dim() == 0 else x.detach()
    dim %= x.dim()
    magnitude = x.double().abs()
    bound = FP32_OVERFLOW if x.dtype == torch.float64 else math.inf  # finite in FP32: as finite_amax
    magnitude.masked_fill_(~(magnitude < bound), 0)
    largest = magnitude.cummax(dim).values  # of the terms each element sums
    counts = [1] * x.dim()
    counts[dim] = x.shape[dim]
    factor = _running_terms_factors(x.shape[dim]).to(x.device).view(counts)
    row = _power_of_two(largest).clamp_(min=2.0**-149).mul_(factor)
    col = torch.full((1,), 2.0**-23, dtype=torch.float64, device=row.device)
    return Scale(outer=out.numel(), channels=1, inner=1, col=col, row=row.reshape(-1))


def _pool_terms_scale(func: Any, args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of an average pool's output, or of its backward's (rules revision 15), at each element: the
    FP32 spacing of the largest finite ``|term|`` its sum adds, times ``terms_factor`` of a window's size; a
    forward's, divided by the power of two at or below its window's divisor. As ``(out.numel(),)`` row
    factors; None where the call is not a plain one (:func:`detrl.core.pools.pool_call`)."""
    terms = _pool_terms(func, args, out)
    if terms is None:
        return None
    bound = FP32_OVERFLOW if terms.pool.dtype == torch.float64 else math.inf  # as finite_amax
    largest = terms.largest.masked_fill(~(terms.largest < bound), 0)
    row = _power_of_two(largest).clamp_(min=2.0**-149)
    if terms.divisors is not None:
        row = row.div_(_power_of_two(terms.divisors))
    col = torch.full((1,), 2.0**-23 * terms_factor(terms.pool.terms), dtype=torch.float64, device=row.device)
    return Scale(outer=out.numel(), channels=1, inner=1, col=col, row=row.reshape(-1))


def _interpolation_scale(func: Any, args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of a linear interpolation's output, or of its backward's (rules revision 18), at each
    element: the FP32 spacing of the largest finite ``|value|`` its weights can reach (a forward's inputs
    around it, a backward's gradients of the outputs around it: :meth:`Interpolation.box`), times
    ``terms_factor`` of its most products. Each weight is at most 1, so no product is larger. As
    ``(out.numel(),)`` row factors; None where the call is not a plain one."""
    call = _interpolation_of(func, args, out)
    if call is None:
        return None
    magnitude = call.values.detach().double().abs()
    bound = FP32_OVERFLOW if call.values.dtype == torch.float64 else math.inf  # as finite_amax
    magnitude = magnitude.masked_fill(~(magnitude < bound), 0)
    largest = call.box().reduced(magnitude, "amax", 0.0)
    row = _power_of_two(largest).clamp_(min=2.0**-149)
    col = torch.full((1,), 2.0**-23 * terms_factor(call.terms), dtype=torch.float64, device=row.device)
    return Scale(outer=out.numel(), channels=1, inner=1, col=col, row=row.reshape(-1))


def _interpolation_of(func: Any, args: tuple, out: torch.Tensor) -> interpolation.Interpolation | None:
    """The :class:`detrl.core.interpolation.Interpolation` of a plain call whose result is ``out``."""
    call = interpolation.interpolation_call(func, args, {})
    if call is None or out.numel() == 0:
        return None
    expected = call.in_shape if call.backward else (*call.in_shape[:2], *call.out)
    return call if tuple(out.shape) == tuple(expected) else None


@dataclasses.dataclass(frozen=True)
class _PoolTerms:
    """The terms behind each element of an average pool's output (or its backward's), in the output's shape:
    the largest and the smallest nonzero magnitude (inf: none; NaN where a term is NaN), and whether all
    are on the FP32 grid (a forward's window elements are; a backward's ``grad_output / divisor`` is where
    the divisor is a power of two, or the gradient zero). ``divisors``: a forward's windows' divisors (its
    spatial shape), None for a backward."""

    pool: pools.Pool | pools.BoxPool
    largest: torch.Tensor
    smallest: torch.Tensor
    on_grid: torch.Tensor
    divisors: torch.Tensor | None


def _pool_terms(func: Any, args: tuple, out: torch.Tensor) -> _PoolTerms | None:
    """:class:`_PoolTerms` of a call of an average pool or its backward. A forward's terms are its window's
    elements, a backward's ``grad_output / divisor`` of each window that holds the element. None where the
    call is not a plain one of ``out``'s shape."""
    if func in BOX_POOLS_FROM_17:
        return _box_pool_terms(func, args, out)
    pool = pools.pool_call(func, args, {})
    if pool is None or out.numel() == 0:
        return None
    divisors = pool.divisors()
    spatial = tuple(divisors.shape)
    if pool.grad is None:
        if out.shape != (*pool.input.shape[: -len(spatial)], *spatial):
            return None
        magnitude = pool.input.detach().double().abs()
        nonzero = magnitude.masked_fill(magnitude == 0, math.inf)
        largest = _reduced(pool.views(pool.padded(magnitude, spatial), spatial), torch.maximum)
        smallest = _reduced(pool.views(pool.padded(nonzero, spatial, math.inf), spatial), torch.minimum)
        on_grid = torch.ones((), dtype=torch.bool, device=out.device).expand(out.shape)
        return _PoolTerms(pool, largest, smallest, on_grid, divisors)
    if out.shape != pool.input.shape or pool.grad.shape[-len(spatial) :] != spatial:
        return None
    share = pool.grad.detach().double().abs() / divisors  # each window's term, in magnitude
    nonzero = share.masked_fill(share == 0, math.inf)
    off_grid = (share != 0) & ~_is_power_of_two(divisors)
    largest = pool.padded(torch.zeros(out.shape, dtype=torch.float64, device=out.device), spatial)
    smallest = pool.padded(torch.full(out.shape, math.inf, dtype=torch.float64, device=out.device), spatial)
    off = pool.padded(torch.zeros(out.shape, dtype=torch.bool, device=out.device), spatial)
    for at, least, any_off in zip(*(pool.views(t, spatial) for t in (largest, smallest, off)), strict=True):
        at.copy_(torch.maximum(at, share))
        least.copy_(torch.minimum(least, nonzero))
        any_off.logical_or_(off_grid)
    return _PoolTerms(pool, pool.crop(largest), pool.crop(smallest), ~pool.crop(off), None)


def _box_pool_terms(func: Any, args: tuple, out: torch.Tensor) -> _PoolTerms | None:
    """:func:`_pool_terms` of an adaptive average pool, its backward, a nearest upsampling's backward or
    ``col2im`` (rules revision 17): the same terms, over windows of unequal lengths
    (:class:`detrl.core.pools.BoxPool`)."""
    pool = pools.box_pool_call(func, args, {})
    if pool is None or out.numel() == 0:
        return None
    divisors = pool.divisors()
    batch = pool.in_shape[: -len(pool.out)]
    if not pool.backward:
        if out.shape != (*batch, *pool.out):
            return None
        magnitude = pool.values.detach().double().abs()
        nonzero = magnitude.masked_fill(magnitude == 0, math.inf)
        largest, smallest = pool.reduced(magnitude, "amax", 0.0), pool.reduced(nonzero, "amin", math.inf)
        on_grid = torch.ones((), dtype=torch.bool, device=out.device).expand(out.shape)
        return _PoolTerms(pool, largest, smallest, on_grid, divisors)
    if out.shape != pool.in_shape or pool.values.shape != (*batch, *pool.out):
        return None
    share = pool.values.detach().double().abs() / divisors  # each window's term, in magnitude
    nonzero = share.masked_fill(share == 0, math.inf)
    off_grid = ((share != 0) & ~_is_power_of_two(divisors)).to(torch.uint8)
    largest, smallest = pool.reduced(share, "amax", 0.0), pool.reduced(nonzero, "amin", math.inf)
    on_grid = pool.reduced(off_grid, "amax", 0) == 0
    return _PoolTerms(pool, largest, smallest, on_grid, None)


def _divided_alike(terms: _PoolTerms) -> torch.Tensor:
    """Where an exact sum over a window (a forward's ``terms``) divided by the window's size rounds to FP32
    alike however the divisions go: by the size, or by its factors in turn (two or three FP64 roundings).
    A divisor that is a power of two divides exactly. Else the exact quotient ``q`` is an FP32 midpoint
    only if every way gives it exactly (``q`` times any factor has few enough bits), and otherwise lies at
    least a quantum of the window's smallest term, over the divisor, from every midpoint: far beyond the
    FP64 roundings (``3 * 2**-53 q``) where the window's terms span fewer than ``26 - ceil(log2(d))``
    binades. A bool tensor of the output's shape."""
    assert terms.divisors is not None
    spread = torch.frexp(terms.largest)[1] - torch.frexp(terms.smallest.clamp(max=1e308))[1]
    within = spread.double().add_(torch.frexp(terms.divisors - 1)[1]) <= 26
    return within | _is_power_of_two(terms.divisors)


def _reduced(views: Iterator[torch.Tensor], combine: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``combine`` (elementwise max or min) over ``views``, as a new tensor."""
    acc = next(views).clone()
    for view in views:
        acc = combine(acc, view, out=acc)
    return acc


def _is_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """Whether each element of positive FP64 ``x`` is a power of two (frexp's mantissa 0.5)."""
    return torch.frexp(x)[0] == 0.5


@functools.lru_cache(maxsize=64)
def _running_terms_factors(n: int) -> torch.Tensor:
    """``terms_factor(k)`` for ``k = 1, ..., n`` (FP64 ``(n,)``, on the CPU)."""
    return torch.tensor([terms_factor(k) for k in range(1, n + 1)], dtype=torch.float64)


def _sample_channel_scale(args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of a convolution's input gradient ``out`` (``(N, C, *spatial)``, the shape of
    ``convolution_backward``'s ``input`` argument): FP32 spacing at its largest magnitude per sample and
    channel, ``(N * C,)`` row factors. None for its weight and bias gradients (channel scale).

    A sample's input gradient sums that sample's output gradient alone, and those differ between samples by
    orders of magnitude (a well-classified image's loss barely moves): at the channel's scale, set by the
    batch's largest sample, every element of a small sample sat near a midpoint. Computed from the output,
    as the channel scale is (:func:`scale_spacing`), with the same caveat: where a largest magnitude sits
    at a binade edge, two machines' units can be 2x apart.
    """
    if len(args) < 3 or not isinstance(args[1], torch.Tensor) or not isinstance(args[2], torch.Tensor):
        return None
    if out.dim() < 3 or out.shape != args[1].shape or out.shape == args[2].shape or out.numel() == 0:
        return None
    n, c = out.shape[0], out.shape[1]
    flat = out.reshape(n * c, -1)
    amax = finite_amax(flat, 1).squeeze(1)
    row = _power_of_two(amax).mul_(2.0**-23).clamp_(min=2.0**-149)
    # col on row's device: Scale.dense multiplies them and Scale.at indexes col with the entries' indices
    col = torch.ones(1, dtype=torch.float64, device=row.device)
    return Scale(outer=n * c, channels=1, inner=flat.shape[1], col=col, row=row)


def _conv_terms_scale(args: tuple, out: torch.Tensor) -> Scale | None:
    """The unit of a convolution's gradient ``out`` (rules revision 6): at each element, the larger of its
    own scale (revision 5's: the input gradient's per sample and channel, the weight gradient's per input
    channel, the bias gradient's per tensor) and its terms' unit, as an ``mm``'s is: the FP32 spacing of the
    largest magnitudes of the two factors of its terms, times ``terms_factor`` of their count. As row
    factors (powers of two) over ``(N * C_in, S)``, ``(C_out * C_in / groups, kernel)`` or ``(C_out, 1)``.

    ``convolution_backward``'s arguments ``(grad_output, input, weight, ..., transposed, ..., groups)``; a
    weight ``(C_out, C_in / groups, *kernel)``, or ``(C_in, C_out / groups, *kernel)`` when transposed. With
    ``P`` a row's power of two (:func:`unit_factors`) and ``S`` a channel's FP32 spacing (:func:`scale_spacing`,
    dim 1), the terms' units:

    * input gradient ``(N, C_in, *S)``: ``P(grad_output[n]) * S(weight)[i] * terms_factor(C_out / groups *
      kernel)``, the weight's channel of input channel ``i`` (transposed: ``P(weight[i]) * 2**-23``);
    * weight gradient: ``S(grad_output)[o] * S(input)[i] * 2**23 * terms_factor(N * S')`` (``S'`` the
      positions of the operand the kernel slides over; input channels the largest over the groups, the
      wider unit; transposed, the roles swap);
    * bias gradient ``(C_out,)``: ``S(grad_output)[o] * terms_factor(N * S')``.

    Why both: two summation orders differ by the rounding errors of the partial sums. Where the terms
    cancel, those scale with the terms and the result's own magnitude says nothing of them: a layer before a
    training-mode batch norm has a weight gradient of rounding noise on an input channel that is the same in
    every sample (batch norm's backward leaves ``grad_output`` summing to zero over a channel: EfficientNet's
    last projection), and at its own scale an honest replay diverged. Where they add up, the partial sums
    grow past the largest term and the result's own scale follows them (DPT's convolutions: in the terms'
    units alone, a later step disagreed 20-50x more than the calibration step had measured).

    None where ``out`` is none of the three (shapes that cannot tell them apart): its output's channel
    scale."""
    if len(args) < 3 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
        return None
    grad, x, w = args[0], args[1], args[2]
    transposed = bool(args[7]) if len(args) > 7 else False
    groups = int(args[9]) if len(args) > 9 else 1
    if grad.dim() < 3 or x.dim() != grad.dim() or w.dim() != grad.dim() or out.numel() == 0 or groups < 1:
        return None
    kernel = math.prod(w.shape[2:])
    c_out = w.shape[1] * groups if transposed else w.shape[0]
    if grad.shape[1] != c_out or x.shape[1] != (w.shape[0] if transposed else w.shape[1] * groups):
        return None
    if out.shape == x.shape and out.shape != w.shape:  # the input gradient
        own = _sample_channel_scale(args, out)
        assert own is not None and own.row is not None
        if transposed:  # input channel i multiplies weight[i] alone
            per_channel = unit_factors(w.reshape(w.shape[0], -1), 2.0**-23)
        else:  # input channel i of a group multiplies weight[:, i mod C_in / groups], the wider over groups
            per_channel = _channel_spacing(w).repeat(groups)
        per_sample = unit_factors(
            grad.reshape(grad.shape[0], -1), terms_factor(max(c_out // groups * kernel, 1))
        )
        terms = (per_sample[:, None] * per_channel[None, :]).reshape(-1)
        rows, inner = torch.maximum(terms, own.row), math.prod(x.shape[2:])
    elif out.shape == w.shape and out.shape != x.shape:  # the weight gradient
        by_rows, by_cols = (x, grad) if transposed else (grad, x)
        n = x.shape[0] * math.prod((x if transposed else grad).shape[2:])
        per_col = _channel_spacing(by_cols).reshape(groups, w.shape[1]).amax(0)
        per_row = _channel_spacing(by_rows).mul_(2.0**23 * terms_factor(max(n, 1)))
        terms = per_row[:, None] * per_col[None, :]
        rows, inner = torch.maximum(terms, _channel_spacing(out)[None, :]).reshape(-1), kernel
    elif out.dim() == 1 and out.shape[0] == c_out:  # the bias gradient: grad_output summed per channel
        n = grad.shape[0] * math.prod(grad.shape[2:])
        terms = _channel_spacing(grad).mul_(terms_factor(max(n, 1)))
        rows, inner = torch.maximum(terms, _channel_spacing(out.reshape(1, 1, -1))), 1
    else:
        return None
    rows = rows.clamp_(min=2.0**-149)
    col = torch.ones(1, dtype=torch.float64, device=rows.device)  # rows' device (see _sample_channel_scale)
    return Scale(outer=rows.numel(), channels=1, inner=inner, col=col, row=rows)


def _channel_spacing(x: torch.Tensor) -> torch.Tensor:
    """:func:`scale_spacing` per channel (dim 1) of ``x``'s FP32 rounding (rank >= 2), FP64 ``(C,)``: the
    native kernel's pass over a contiguous CPU FP64 tensor (its channel thresholds at tau 1, which read each
    channel's largest magnitude as an FP32 value), torch's elsewhere. Of the FP32 rounding, so that both
    give the same bits where an unrounded largest magnitude would round up into the next binade."""
    if _native is None or x.dtype != torch.float64 or not x.is_cpu or not x.is_contiguous() or x.is_neg():
        return scale_spacing(x.float() if x.dtype == torch.float64 else x).reshape(-1)
    out = torch.empty(x.shape[1], dtype=torch.float64)
    if x.numel():
        _native.channel_thresholds(x.data_ptr(), x.shape[0], x.shape[1], x[0, 0].numel(), 1.0, out.data_ptr())
    else:
        out.fill_(2.0**-149)
    return out


def exact_sum_elements(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Which elements of a sum's result ``out`` every machine computes alike, in any order: a flat bool
    mask over ``out``'s row-major elements, or None where the call is not a plain sum of FP64 terms on the
    FP32 grid (``aten.sum.dim_IntList``, ``aten.embedding_dense_backward``).

    Terms on the FP32 grid whose largest and smallest nonzero magnitudes have frexp exponents ``e_max`` and
    ``e_min`` are multiples of ``2**(e_min - 24)``, and ``n`` of them sum to less than ``n * 2**e_max``:
    when ``e_max - e_min + ceil(log2(n)) <= 29``, every partial sum, in every order, is a multiple of that
    quantum below ``2**53`` of it: exact in FP64. Such an element is the same FP64 value on every machine,
    so it rounds to the same FP32 value and needs no log entry, even where it lies exactly on a midpoint
    (a sum of two FP32 values of one binade does, half the time: every element of GPT-2 small's
    token-embedding gradient is exact, and its rows of tokens seen twice were a sixth of its log). The
    exponents are exact, and so are a max, a min and a count in any order, so recorder and replayer find
    the same elements.
    """
    if func is _SUM_DIMS:
        x = args[0] if args else None
        dims = args[1] if len(args) > 1 else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not dims:
            return None
        dims = sorted({d % x.dim() for d in dims})
        if (
            KERNEL_SUMS
            and hasattr(_native, "exact_sums")  # built (and not a build from before the pass)
            and x.device.type == "cpu"
            and x.dtype == torch.float64
            and x.layout == torch.strided
        ):
            return _exact_sums_kernel(x, dims, out.numel())
        if x.numel() == 0 or not _fp32_grid(x):
            return None
        magnitude = x.abs()
        largest = magnitude.amax(dim=dims)
        smallest = magnitude.masked_fill_(magnitude == 0, math.inf).amin(dim=dims)
        terms = torch.tensor(float(math.prod(x.shape[d] for d in dims)), dtype=torch.float64)
    elif func is _EMBEDDING_BACKWARD:
        if len(args) < 5 or args[4] is not False:  # scale_grad_by_freq divides: not a plain sum
            return None
        grad, indices, rows = args[0], args[1], args[2]
        if not isinstance(grad, torch.Tensor) or grad.dim() == 0:
            return None
        if not isinstance(indices, torch.Tensor) or not isinstance(rows, int) or rows <= 0:
            return None
        width = grad.shape[-1]
        flat = indices.reshape(-1)
        if width == 0 or flat.numel() * width != grad.numel() or rows * width != out.numel():
            return None
        if _embedding_kernel_takes(grad) and flat.device.type == "cpu":
            return _exact_embedding_kernel(grad, flat, rows, width)
        if not _fp32_grid(grad):
            return None
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            return None
        # Only the rows some token names have terms; every other row is a sum of none: zero, exact. So the
        # extremes are taken over the rows seen (a GPT-2 batch names at most B * T of 50,257), not the whole
        # table: full-size FP64 extremes cost a GPT-2 small step 2 GB and seconds.
        seen, row_of = torch.unique(flat, return_inverse=True)
        index = row_of.view(-1, 1).expand(-1, width)
        magnitude = grad.reshape(-1, width).abs()
        shape, device = (len(seen), width), grad.device
        largest = torch.zeros(shape, dtype=torch.float64, device=device).scatter_reduce_(
            0, index, magnitude, "amax"
        )
        magnitude.masked_fill_(magnitude == 0, math.inf)
        smallest = torch.full(shape, math.inf, dtype=torch.float64, device=device).scatter_reduce_(
            0, index, magnitude, "amin"
        )
        terms = torch.bincount(row_of, minlength=len(seen)).double().view(-1, 1)
        exact = torch.ones(rows, width, dtype=torch.bool, device=grad.device)
        exact[seen] = _exact_of(largest, smallest, terms)
        return exact.reshape(-1)
    else:
        return None
    if largest.numel() != out.numel():
        return None
    return _exact_of(largest, smallest, terms).reshape(-1)


def exact_product_elements(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Which elements of a convolution's output every machine computes alike, in any order: all of them
    (a flat bool mask of ones) where the whole call is exact, else None (also where it is not a plain
    FP64 convolution of finite values on the FP32 grid, or transposed).

    Each output element sums at most ``K = C_in / groups * prod(kernel)`` products and a bias. Every
    element of ``x`` is a multiple of ``q_x``, the largest power of two dividing all of them
    (:func:`_quantum`: 1/16 for digit pixels), and likewise ``w`` and ``b``; so every product is a multiple
    of ``q_x * q_w`` (and exact in FP64: 48 significant bits at most), and every partial sum, in every
    order, a multiple of ``q = min(q_x * q_w, q_b)`` of magnitude at most ``K * max|x| * max|w| + max|b|``.
    Where that is at most ``2**52 * q`` (a factor of two below what FP64 holds, so that the bound's own
    rounding cannot matter), every partial sum is exact: the same FP64 value on every machine, even where
    it lies exactly on an FP32 midpoint (digit pixels have 5 significant bits: half of a ResNet-50 step's
    log on digits was its first convolution's ties). The maxima, quanta and the bound's FP64 operations are
    the same on every machine, so recorder and replayer decide alike; the native route decides with the
    same operations (``native_dispatch.cpp``)."""
    if func is not _CONVOLUTION or len(args) < 9 or out.numel() == 0:
        return None
    x, w, b, transposed, groups = args[0], args[1], args[2], args[6], args[8]
    if transposed is not False or not isinstance(groups, int) or groups < 1:
        return None
    parts = [(x, "x"), (w, "w")] + ([(b, "b")] if b is not None else [])
    largest, quantum = {}, {}
    for t, key in parts:
        if not isinstance(t, torch.Tensor) or not _fp32_grid(t):
            return None
        largest[key] = float(t.abs().max()) if t.numel() else 0.0
        if not math.isfinite(largest[key]):
            return None
        quantum[key] = _quantum(t)
    if w.dim() < 1 or w.shape[0] == 0:
        return None
    terms = float(math.prod(w.shape[1:]))  # C_in / groups * prod(kernel)
    q = quantum["x"] * quantum["w"]
    bias_largest = 0.0
    if b is not None:
        q, bias_largest = min(q, quantum["b"]), largest["b"]
    if math.isinf(q):  # no nonzero product and no nonzero bias: zeros
        return torch.ones(out.numel(), dtype=torch.bool, device=out.device)
    if terms * largest["x"] * largest["w"] + bias_largest <= 2.0**52 * q:
        return torch.ones(out.numel(), dtype=torch.bool, device=out.device)
    return None


def _quantum(t: torch.Tensor) -> float:
    """The largest power of two that divides every element of finite FP64 ``t``: the least significant set
    bit of its nonzero elements, the smallest of them (inf: no nonzero element). From the bits, exactly."""
    bits = t.detach().contiguous().view(torch.int64).reshape(-1)
    bits = bits[(bits & 0x7FFFFFFFFFFFFFFF) != 0]  # nonzero, either sign
    if bits.numel() == 0:
        return math.inf
    field = (bits >> 52) & 0x7FF  # biased exponent: 0 for a subnormal, which has no implicit bit
    mantissa = (bits & ((1 << 52) - 1)) | torch.where(field > 0, 1 << 52, 0)
    exponent = torch.where(field > 0, field - 1075, -1074)  # value = mantissa * 2**exponent
    # the lowest set bit, a power of two 2**k: frexp's exponent k + 1, exact on every device (CUDA's log2 of
    # a power of two can miss k by an ulp, and .long() truncates k - ulp to k - 1)
    lowest = torch.frexp((mantissa & -mantissa).double())[1].long() - 1
    return math.ldexp(1.0, int((exponent + lowest).min()))


def exact_elements(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """:func:`exact_sum_elements`, :func:`exact_product_elements` or :func:`exact_scatter_elements`, by op
    (``oprules.exact_rule`` says which ops a rules revision asks it for)."""
    if func is _CONVOLUTION:
        return exact_product_elements(func, args, out)
    if func in EXACT_SCATTERS:
        return exact_scatter_elements(func, args, out)
    if func in RUNNING_SUMS_FROM_14:
        return exact_running_sum_elements(args, out)
    if func in POOL_SUMS_FROM_15 or func in BOX_POOLS_FROM_17:
        return exact_pool_elements(func, args, out)
    if func in INTERPOLATIONS_FROM_18:
        return exact_interpolation_elements(func, args, out)
    return exact_sum_elements(func, args, out)


def exact_pool_elements(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Which elements of an average pool's output, or of its backward's, every machine computes alike, in any
    order (rules revision 15): a flat bool mask over ``out``'s row-major elements, or None where the call is
    not a plain one of FP64 values on the FP32 grid. The rule of :func:`exact_sum_elements` for the terms
    each element sums (:func:`_pool_terms`), counting a window's size of them. A forward's terms are its
    window's elements; its sum, exact, is then divided by the window's divisor in one IEEE division (torch's
    CPU and CUDA kernels divide; none multiplies by a reciprocal), which every machine rounds alike,
    whatever the divisor. A backward's terms are ``grad_output / divisor`` of the windows that hold the
    element, on the FP32 grid only where the divisor is a power of two: elsewhere its element is not exact.
    A 2x2 pool of FP32 values of one binade lies exactly on an FP32 midpoint for one element in twenty, and
    a local response norm's pool over 3 channels (a sum of three squares divided by 3) for 4 % of a small
    model's.

    An adaptive pool's, a nearest upsampling's backward's and ``col2im``'s (rules revision 17) are found
    alike, over their windows of unequal lengths (:class:`detrl.core.pools.BoxPool`). An adaptive pool's
    forward element needs one more thing, since torch's kernels divide its sum in more ways than one: that
    every way rounds to the same FP32 value (:func:`_divided_alike`)."""
    values = args[0] if args else None  # the input, or a backward's grad_output: the terms' numerators
    if not isinstance(values, torch.Tensor) or not _fp32_grid(values):
        return None
    terms = _pool_terms(func, args, out)
    if terms is None:
        return None
    count = torch.tensor(float(terms.pool.terms), dtype=torch.float64, device=out.device)
    exact = _exact_of(terms.largest, terms.smallest, count) & terms.on_grid
    if isinstance(terms.pool, pools.BoxPool) and terms.divisors is not None:
        exact &= _divided_alike(terms)  # the kernels divide it in more ways than one
    return exact.reshape(-1)


def exact_interpolation_elements(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Which elements of a linear interpolation's output, or of its backward's, every machine computes alike
    (rules revision 18): a flat bool mask over ``out``'s row-major elements, or None where the call is not a
    plain one of FP64 values on the FP32 grid. Where every dim's weights are exact on every machine
    (:meth:`detrl.core.interpolation.Interpolation.weight_bits`: a scale factor of 2, 4, 8, ...), each term
    is an FP32 value times a short dyadic weight, and an element is exact where the sum rule holds with
    those weights' bits counted (over the values its weights can reach, and its most products). Upsampling
    by 2 without corners aligned weighs two values of one binade by 3/4 and 1/4: an exact sum that lies on
    an FP32 midpoint for a fifth of its elements. Elsewhere (a weight rounded on some machine) none is."""
    values = args[0] if args else None
    if not isinstance(values, torch.Tensor) or not _fp32_grid(values):
        return None
    call = _interpolation_of(func, args, out)
    if call is None:
        return None
    bits = [call.weight_bits(d) for d in range(len(call.out))]
    if any(b is None for b in bits):
        return torch.zeros(out.numel(), dtype=torch.bool, device=out.device)
    box = call.box()
    magnitude = call.values.detach().double().abs()
    nonzero = magnitude.masked_fill(magnitude == 0, math.inf)
    largest, smallest = box.reduced(magnitude, "amax", 0.0), box.reduced(nonzero, "amin", math.inf)
    count = torch.tensor(float(call.terms), dtype=torch.float64, device=out.device)
    return _exact_of(largest, smallest, count, sum(b for b in bits if b is not None) + 1).reshape(-1)


def exact_running_sum_elements(args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Which elements of a cumulative sum ``out = cumsum(x, dim)`` every machine computes alike, in any order
    (rules revision 14): a flat bool mask over ``out``'s row-major elements, or None where the call is not
    a plain one of FP64 terms on the FP32 grid. The rule of :func:`exact_sum_elements`, at each element for
    the terms it sums (``x``'s first ``k`` along ``dim``): their running largest and smallest nonzero
    magnitudes, and ``k``. A Mamba-2 layer's cumulative decays are sums of a few FP32 values of one binade,
    which land exactly on FP32 midpoints a twentieth of the time."""
    x = args[0] if args else None
    dim = args[1] if len(args) > 1 else None
    if not (isinstance(x, torch.Tensor) and isinstance(dim, int)) or x.dim() == 0 or x.shape != out.shape:
        return None
    if x.numel() == 0 or not _fp32_grid(x):
        return None
    dim %= x.dim()
    magnitude = x.abs()
    largest = magnitude.cummax(dim).values
    smallest = magnitude.masked_fill_(magnitude == 0, math.inf).cummin(dim).values
    counts = [1] * x.dim()
    counts[dim] = x.shape[dim]
    terms = torch.arange(1, x.shape[dim] + 1, dtype=torch.float64, device=x.device).view(counts)
    return _exact_of(largest, smallest, terms).reshape(-1)


def exact_scatter_elements(func: Any, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Which elements of a scatter that adds every machine computes alike, in any order: a flat bool mask over
    ``out``'s row-major elements, or None where the call is not a plain sum of FP64 terms on the FP32 grid.

    ``index_put(self, indices, values, accumulate=True)``, ``scatter_add(self, dim, index, src)`` and
    ``index_add(self, dim, index, source, alpha=1)`` (and their in-place forms) give element ``i`` the sum
    of ``self[i]`` and every value sent to ``i``; the order in which a machine adds the values sent to one
    element is its own. The rule is :func:`exact_sum_elements`' (``self[i]`` counted as a term), applied to
    those terms (``self[i]`` counted where it is not zero). Which element each value goes to is found by
    running the op's own indexing on the element numbers ``0 .. numel - 1``: the same indices, so the same
    broadcasting and masks. A scatter into zeros (the backward of a gather) is an embedding gradient of
    one-element rows, and takes the C kernel's pass where it is built (the same mask; 40 us against 540 for
    a Longformer window's ``index_add``).

    ``args``: every argument in schema order (:func:`detrl.core.dispatch.bound_arguments`: ``alpha`` is a
    keyword), with ``self`` as it was before an in-place form ran.

    As for an embedding's gradient, the extremes are taken over the elements some value reaches (a gather's
    backward into a vocabulary-sized table reaches a batch's rows), not the whole result; every other
    element is ``self``'s value alone, the same on every machine."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].numel() == 0:
        return None
    base = args[0]
    wide = torch.int32 if base.numel() < 2**31 else torch.int64  # the element numbers: half the memory
    numbers = torch.arange(base.numel(), dtype=wide, device=base.device).view(base.shape)
    if func in _INDEX_PUTS:
        if len(args) < 4 or args[3] is not True or not isinstance(args[2], torch.Tensor):
            return None  # without accumulate the values replace: nothing is summed
        indices = tuple(slice(None) if i is None else i for i in args[1])
        destination = numbers[indices]
        values = args[2].expand(destination.shape)
    elif func in _INDEX_ADDS:
        if len(args) < 5 or args[4] != 1 or not isinstance(args[3], torch.Tensor):
            return None  # alpha scales the values: not a plain sum of them
        destination = numbers.index_select(args[1], args[2])
        values = args[3]
    elif func in _SCATTER_ADDS:
        index, src = args[2], args[3]
        if not isinstance(index, torch.Tensor) or not isinstance(src, torch.Tensor):
            return None
        destination = numbers.gather(args[1], index)
        values = src[tuple(slice(0, n) for n in index.shape)]
    else:
        return None
    if destination.shape != values.shape:
        return None
    if _embedding_kernel_takes(values) and base.device.type == "cpu" and not base.any():
        return _exact_embedding_kernel(values.reshape(-1, 1), destination.reshape(-1), base.numel(), 1)
    if not _fp32_grid(values):
        return None
    seen, slot = torch.unique(destination.reshape(-1).long(), return_inverse=True)
    own = base.reshape(-1)[seen]
    if not _fp32_grid(own):
        return None
    own = own.abs_()
    magnitude = values.abs().reshape(-1)
    largest = own.scatter_reduce(0, slot, magnitude, "amax")
    magnitude = magnitude.masked_fill(magnitude == 0, math.inf)
    smallest = own.masked_fill(own == 0, math.inf).scatter_reduce(0, slot, magnitude, "amin")
    terms = torch.bincount(slot, minlength=len(seen)).double().add_(own != 0)
    exact = torch.ones(base.numel(), dtype=torch.bool, device=base.device)
    exact[seen] = _exact_of(largest, smallest, terms)
    return exact


def _exact_of(
    largest: torch.Tensor, smallest: torch.Tensor, terms: torch.Tensor, fraction_bits: int = 0
) -> torch.Tensor:
    """The rule of :func:`exact_sum_elements`, from each sum's largest and smallest nonzero term magnitude
    (inf: none) and its number of terms (broadcast against them): a bool tensor of their shape.
    ``fraction_bits``: each term is an FP32 value times a multiple of ``2**-fraction_bits`` of at most 1
    (an interpolation's weights), finer by as many bits."""
    # frexp exponents e: |x| in [2**(e - 1), 2**e); a term's FP32 quantum is 2**(e - 24) at least
    spread = torch.frexp(largest)[1] - torch.frexp(smallest.clamp(max=1e308))[1]
    # ceil(log2(n)) of the counts n >= 1, exactly: frexp's exponent of n - 1 (0 for n = 1). CUDA's log2 of a
    # power of two can miss the integer it is, and ceil or a cast then moves it a whole binade.
    exact = spread.double().add_(torch.frexp(terms.clamp(min=1) - 1)[1]) <= 29 - fraction_bits
    exact |= torch.isinf(smallest)  # no nonzero term: the sum is zero
    exact &= torch.isfinite(largest)
    return exact


#: Whether :func:`exact_sum_elements` takes a CPU sum through the C kernel where it is built (the same mask;
#: tests compare both paths).
KERNEL_SUMS = True


def _exact_sums_kernel(x: torch.Tensor, dims: list[int], out_elements: int) -> torch.Tensor | None:
    """:func:`exact_sum_elements` of a sum of a CPU FP64 tensor over ``dims`` (sorted, non-negative), whose
    result has ``out_elements``: the same rule and the same mask as the torch path, in one pass of the C
    kernel over the terms laid out as ``(out_elements, terms)``. A DQN update takes this for each bias
    gradient with a near element; the native route calls the same function (``roundkernel.h``)."""
    terms = math.prod(x.shape[d] for d in dims)
    if x.numel() == 0 or out_elements * terms != x.numel():
        return None
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = dense_for_kernel(x.permute(*kept, *dims))  # the terms of each sum in a row
    mask = torch.empty(out_elements, dtype=torch.bool)
    assert _native is not None
    if not _native.exact_sums(rows.data_ptr(), out_elements, terms, mask.data_ptr()):
        return None
    return mask


def _embedding_kernel_takes(terms: torch.Tensor) -> bool:
    """Whether :func:`_exact_embedding_kernel` can take these terms: it is built (and on), and they are a
    CPU FP64 strided tensor."""
    return (
        KERNEL_SUMS
        and hasattr(_native, "exact_embedding_sums")
        and terms.device.type == "cpu"
        and terms.dtype == torch.float64
        and terms.layout == torch.strided
    )


def _exact_embedding_kernel(
    grad: torch.Tensor, flat: torch.Tensor, rows: int, width: int
) -> torch.Tensor | None:
    """:func:`exact_sum_elements` of an embedding's gradient on the CPU: the same rule and mask as the torch
    path, in one pass of the C kernel over the tokens' terms (the torch path's unique, scatters and
    exponents took about 15 torch calls a step: 5 % of a small transformer's verifiable step)."""
    dense = dense_for_kernel(grad)
    indices = flat.to(torch.int64).contiguous()
    mask = torch.empty(rows * width, dtype=torch.bool)
    assert _native is not None
    if not _native.exact_embedding_sums(
        dense.data_ptr(), indices.numel(), width, indices.data_ptr(), rows, mask.data_ptr()
    ):
        return None
    return mask


def dense_for_kernel(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in contiguous CPU memory, as the C kernel reads them: memory as it is, so a lazily
    negated view is materialised and a zero tensor (which has none) given some."""
    dense = x.detach().resolve_neg().contiguous()
    return torch.zeros(dense.shape, dtype=dense.dtype) if dense._is_zerotensor() else dense


def _fp32_grid(x: torch.Tensor) -> bool:
    """Whether every element of FP64 ``x`` is an FP32 value (NaN is not)."""
    return x.dtype == torch.float64 and bool(torch.equal(x, x.to(torch.float32).to(torch.float64)))


def channel_scale(rounded: torch.Tensor) -> Scale:
    """:func:`scale_spacing` of an output (or its FP32 rounding) as a :class:`Scale`."""
    unit = scale_spacing(rounded).reshape(-1)
    if rounded.dim() >= 2:
        return Scale(rounded.shape[0], rounded.shape[1], math.prod(rounded.shape[2:]), unit)
    return Scale(1, 1, rounded.numel(), unit)


_MM = torch.ops.aten.mm.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_SUM_DIMS = torch.ops.aten.sum.dim_IntList
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_CONVOLUTION = torch.ops.aten.convolution.default
_ATEN = torch.ops.aten
#: oprules.EXACT_SCATTERS by argument layout (exact_scatter_elements)
_INDEX_PUTS = frozenset({_ATEN.index_put.default, _ATEN.index_put_.default, _ATEN._index_put_impl_.default})
_SCATTER_ADDS = frozenset({_ATEN.scatter_add.default, _ATEN.scatter_add_.default})
_INDEX_ADDS = frozenset({_ATEN.index_add.default, _ATEN.index_add_.default})
_SUM = torch.ops.aten.sum.default
_MEAN = torch.ops.aten.mean.default
_MEAN_DIMS = torch.ops.aten.mean.dim
#: Rules revision 5: the sums and means :func:`reduction_scale` measures in their terms' units.
TERMS_SCALED = frozenset({_SUM_DIMS, _SUM, _MEAN_DIMS, _MEAN})
#: The ops :func:`reduction_scale` measures from their inputs; every other reduction is measured at its
#: output's channel scale, from the output alone (and the sums and means, before rules revision 5).
SCALED_BY_INPUTS = frozenset({_MM, _CONV_BACKWARD})
