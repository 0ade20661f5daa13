"""Average pooling's windows: which elements each sum adds, and what it divides by.

``avg_pool2d`` and ``avg_pool3d`` give each output element the sum of its window of the input (padding adds
nothing) divided by the window's divisor. Their backwards give each input element the sum, over the windows
that hold it, of ``grad_output / divisor``. The emulated profiles reorder those sums
(:mod:`detrl.core.hardware.sums`), and the rounding rules find the elements that every order sums exactly
(:func:`detrl.core.scale.exact_pool_elements`). Both read the windows here.

A window is walked by its offsets: for the offset ``o`` (one per kernel position), the strided view
``padded[..., o0 : o0 + s0 * (out0 - 1) + 1 : s0, ...]`` holds, at each output position, the input element
at that offset of its window. ``padded`` is the input with zeros around it, enough for every window.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from detrl.core.dispatch import bound_arguments

aten = torch.ops.aten

#: The average pools and their backwards, by the number of spatial dims.
POOL_DIMS = {
    aten.avg_pool2d.default: 2,
    aten.avg_pool3d.default: 3,
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
}
BACKWARDS = frozenset({aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default})


@dataclasses.dataclass(frozen=True)
class Pool:
    """One average-pool call: ``input`` ``(*batch, *spatial)`` with ``len(kernel)`` spatial dims, and for a
    backward its ``grad`` (``(*batch, *out)``). ``kernel``, ``stride``, ``padding``: one int per spatial
    dim."""

    input: torch.Tensor
    grad: torch.Tensor | None
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    ceil_mode: bool
    count_include_pad: bool
    divisor_override: int | None

    @property
    def terms(self) -> int:
        """The most terms one sum adds: a window's size (a backward's element is in at most as many)."""
        return math.prod(self.kernel)

    def options(self, divisor_override: int | None) -> tuple:
        return (
            list(self.kernel),
            list(self.stride),
            list(self.padding),
            self.ceil_mode,
            self.count_include_pad,
            divisor_override,
        )

    def divisors(self) -> torch.Tensor:
        """Each window's divisor, FP64 ``(*out)``: the output's spatial shape (a backward's ``grad``'s). Found
        by the pool itself: its count of input elements (pooled ones, divided by 1) over its mean of ones (the
        count over the divisor). Exact where the divisor is a power of two, and within a few ulps of the
        integer it is elsewhere: rounded."""
        dims = len(self.kernel)
        forward = aten.avg_pool2d.default if dims == 2 else aten.avg_pool3d.default
        ones = torch.ones((1, *self.input.shape[-dims:]), dtype=torch.float64, device=self.input.device)
        count = forward(ones, *self.options(1))
        mean = forward(ones, *self.options(self.divisor_override))
        return count.div_(mean).round_()[0]

    def padded(self, t: torch.Tensor, out: tuple[int, ...], value: float = 0.0) -> torch.Tensor:
        """``t`` (input-shaped) with ``value`` around its spatial dims: ``padding`` before, and after as many as
        the last window reaches (ceil mode's windows reach past the padding), at least none."""
        pads: list[int] = []
        spatial = zip(t.shape[-len(out) :], self.kernel, self.stride, self.padding, out, strict=True)
        for size, k, s, p, o in reversed(list(spatial)):  # F.pad takes the last dim first
            pads += [p, max(0, s * (o - 1) + k - size - p)]
        return F.pad(t, pads, value=value)

    def crop(self, padded: torch.Tensor) -> torch.Tensor:
        """The input's region of a :meth:`padded` tensor."""
        dims = len(self.kernel)
        region = [slice(p, p + n) for p, n in zip(self.padding, self.input.shape[-dims:], strict=True)]
        return padded[(..., *region)]

    def offsets(self) -> list[tuple[int, ...]]:
        """The kernel positions in row-major order: the order a forward kernel adds a window's elements."""
        return list(itertools.product(*(range(k) for k in self.kernel)))

    def views(self, padded: torch.Tensor, out: tuple[int, ...]) -> Iterator[torch.Tensor]:
        """For each offset (:meth:`offsets`), the view of ``padded`` holding that offset of every window, of
        the output's spatial shape ``out``: read for a forward's terms, written for a backward's."""
        for offset in self.offsets():
            steps = zip(offset, self.stride, out, strict=True)
            yield padded[(..., *(slice(o, o + s * (n - 1) + 1, s) for o, s, n in steps))]


def pool_call(func: object, args: tuple, kwargs: dict) -> Pool | None:
    """The :class:`Pool` of a call of an average pool or its backward (:data:`POOL_DIMS`), or None where
    ``func`` is none of those or the call is not a plain one (floating dense tensors, batched or not)."""
    dims = POOL_DIMS.get(func)
    if dims is None:
        return None
    bound = bound_arguments(func, args, kwargs)
    grad = bound.pop(0) if func in BACKWARDS else None
    x, kernel, stride, padding, ceil_mode, include, override = bound

    def per_dim(v: object, default: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
            return default
        v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
        if not all(isinstance(i, int) for i in v) or len(v) not in (1, dims):
            return None
        return v * dims if len(v) == 1 else v

    tensors = [x] if grad is None else [x, grad]
    if not all(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided for t in tensors
    ):
        return None  # (a float16 pool on the CPU, a sparse one: as they are)
    if x.dim() not in (dims + 1, dims + 2) or x.numel() == 0:
        return None
    k = per_dim(kernel)
    s = per_dim(stride, k)
    p = per_dim(padding, (0,) * dims)
    if k is None or s is None or p is None or min(k) < 1 or min(s) < 1:
        return None
    return Pool(x, grad, k, s, p, bool(ceil_mode), bool(include), override)
