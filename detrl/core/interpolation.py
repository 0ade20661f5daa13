"""Linear interpolation, ``F.interpolate`` in the ``linear``, ``bilinear`` and ``trilinear`` modes, and its
backward: the weight each output element gives each input element, one spatial dim at a time.

Along a dim of ``n`` positions interpolated to ``m``, output position ``o`` is ``(1 - l) x[i] + l x[i + 1]``,
with ``i`` and ``l`` from the dim's scale and ``align_corners``; a 2d or 3d output element is the product of
its dims' weights applied to the 4 or 8 input elements around it. The backward sends each output gradient
back with the same weights. The weights are found by running the 1d kernel on the identity (row ``j`` of
``upsample_linear1d(I_n)`` is input ``j``'s weight in every output position): the kernel's own arithmetic,
scales and corner rules included, with no formula of ours to drift from it.

The rounding rules measure each element in units of the input values its weights reach
(:func:`detrl.core.scale.reduction_scale`, rules revision 18, through :meth:`Interpolation.box`), and the
emulated profiles interpolate one dim at a time (:mod:`detrl.core.hardware.products`): mathematically the
same sum, associated otherwise than the kernels' sum of 4 or 8 products.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from detrl.core import pools
from detrl.core.dispatch import bound_arguments

aten = torch.ops.aten

#: The linear interpolations, by their number of spatial dims.
FORWARDS = {
    aten.upsample_linear1d.default: 1,
    aten.upsample_bilinear2d.default: 2,
    aten.upsample_trilinear3d.default: 3,
}
#: Their backwards, by the same.
BACKWARDS = {
    aten.upsample_linear1d_backward.default: 1,
    aten.upsample_bilinear2d_backward.default: 2,
    aten.upsample_trilinear3d_backward.default: 3,
}
INTERPOLATIONS = frozenset({*FORWARDS, *BACKWARDS})


@dataclasses.dataclass(frozen=True)
class Interpolation:
    """One call: ``values`` are the input ``(N, C, *spatial)`` of a forward or the gradient ``(N, C, *out)``
    of a backward; ``in_shape`` the input's whole shape, ``out`` the output's spatial shape, and
    ``align_corners`` and ``scales`` (one per spatial dim, None where the kernel derives it from the
    sizes) as the op takes them."""

    values: torch.Tensor
    in_shape: tuple[int, ...]
    out: tuple[int, ...]
    align_corners: bool
    scales: tuple[float | None, ...]
    backward: bool

    def weights(self, dim: int) -> torch.Tensor:
        """Spatial dim ``dim``'s weights, FP64 ``(out[dim], in[dim])``, on the values' device (shared: not to
        be written)."""
        n, m = self.in_shape[2 + dim], self.out[dim]
        return _weights(n, m, self.align_corners, self.scales[dim], str(self.values.device))

    @property
    def terms(self) -> int:
        """The most products one sum adds: a forward's weights per output element, a backward's per input
        element (their product over the spatial dims)."""
        count = 1
        for d in range(len(self.out)):
            nonzero = self.weights(d) != 0  # (out, in)
            count *= int(nonzero.sum(0 if self.backward else 1).max())
        return max(1, count)

    def weight_bits(self, dim: int) -> int | None:
        """``K`` such that every weight along spatial dim ``dim`` is a multiple of ``2**-K`` computed exactly,
        on every machine; None where some weight may be rounded.

        The kernels compute the dim's scale (``(n - 1) / (m - 1)`` with ``align_corners``, else ``1 /
        scale`` where one is given, else ``n / m``), then each output position's source ``s (o + 1/2) -
        1/2`` (``s o`` with ``align_corners``), its integer part and the fraction ``l`` and ``1 - l``. Where
        the scale is ``p / 2**k`` with few enough bits, every one of those steps is exact in FP64 (fused or
        not), so every machine has the same weights, multiples of ``2**-(k + 1)``: a scale factor of 2, 4 or
        8, or sizes in such ratios."""
        n, m, scale = self.in_shape[2 + dim], self.out[dim], self.scales[dim]
        if self.align_corners:
            ratio = (n - 1) / (m - 1) if m > 1 else 0.0
        else:
            ratio = 1.0 / scale if scale is not None and scale > 0 else n / m
        numerator, denominator = ratio.as_integer_ratio()
        k = denominator.bit_length() - 1  # a float's denominator is a power of two
        if numerator.bit_length() + (2 * m + 1).bit_length() > 50 or k + 2 + n.bit_length() > 50:
            return None
        return k + 1

    def box(self) -> pools.BoxPool:
        """The input elements each sum may weigh, as a :class:`detrl.core.pools.BoxPool` (no division): along
        each dim, an output position's weighted positions and one more on each side, so that a weight
        another machine rounds to zero, or not, is inside either way."""
        windows = []
        for d in range(len(self.out)):
            weighted = self.weights(d) != 0  # (out, in); every output position weighs at least one
            n = weighted.shape[1]
            first = weighted.int().argmax(1)
            last = n - 1 - weighted.flip(1).int().argmax(1)
            starts, ends = (first - 1).clamp(min=0).tolist(), (last + 2).clamp(max=n).tolist()
            windows.append(tuple(zip(starts, ends, strict=True)))
        return pools.BoxPool(self.values, self.in_shape, tuple(windows), self.backward, averages=False)

    def separably(self, t: torch.Tensor) -> torch.Tensor:
        """The interpolation (or its backward) of ``t`` (the op's values, in their own dtype) computed one
        spatial dim at a time: each dim's weights applied as a product over that dim, in order."""
        for d in range(len(self.out)):
            w = self.weights(d).to(t.dtype)
            if not self.backward:
                w = w.T  # (in, out): input positions onto output positions
            t = torch.tensordot(t, w, dims=([2 + d], [0])).movedim(-1, 2 + d)
        return t


@functools.lru_cache(maxsize=64)
def _weights(n: int, m: int, align_corners: bool, scale: float | None, device: str) -> torch.Tensor:
    """:meth:`Interpolation.weights` of a dim of ``n`` positions interpolated to ``m``: row ``j`` of the 1d
    kernel run on the identity is input position ``j``'s weight in every output position."""
    identity = torch.eye(n, dtype=torch.float64, device=device).view(n, 1, n)
    spread = aten.upsample_linear1d.default(identity, [m], align_corners, scale)
    return spread[:, 0, :].T.contiguous()


def interpolation_call(func: object, args: tuple, kwargs: dict) -> Interpolation | None:
    """The :class:`Interpolation` of a call of an op of :data:`INTERPOLATIONS`, or None where ``func`` is
    none of those or the call is not a plain one (floating dense tensors, batched, of the sizes it names)."""
    dims = FORWARDS.get(func) or BACKWARDS.get(func)  # type: ignore[call-overload]
    if dims is None:
        return None
    bound = bound_arguments(func, args, kwargs)
    values = bound[0]
    if not pools.dense_floating(values):
        return None
    if func in BACKWARDS:
        out, in_shape, align_corners, *scales = bound[1:]
    else:
        out, align_corners, *scales = bound[1:]
        in_shape = list(values.shape)
    if not (isinstance(out, (list, tuple)) and isinstance(in_shape, (list, tuple))):
        return None
    if len(out) != dims or len(in_shape) != dims + 2 or len(scales) != dims or values.dim() != dims + 2:
        return None
    if values.numel() == 0 or min(in_shape) < 1 or min(out) < 1:
        return None
    expected = (*in_shape[:2], *out) if func in BACKWARDS else tuple(in_shape)
    if tuple(values.shape) != tuple(expected):
        return None
    return Interpolation(
        values, tuple(in_shape), tuple(out), bool(align_corners), tuple(scales), func in BACKWARDS
    )
