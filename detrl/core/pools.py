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


#: The adaptive average pools and their backwards, by the number of spatial dims (rules revision 17).
ADAPTIVE_DIMS = {
    aten._adaptive_avg_pool2d.default: 2,
    aten._adaptive_avg_pool3d.default: 3,
    aten._adaptive_avg_pool2d_backward.default: 2,
    aten._adaptive_avg_pool3d_backward.default: 3,
}
ADAPTIVE_BACKWARDS = frozenset(
    {aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default}
)


@dataclasses.dataclass(frozen=True)
class AdaptivePool:
    """One adaptive average-pool call: ``input`` ``(*batch, *spatial)``, ``out`` the output's spatial shape,
    and for a backward its ``grad`` ``(*batch, *out)``.

    Along each spatial dim of size ``n`` pooled to ``m``, window ``i`` is ``[floor(i n / m), ceil((i + 1) n /
    m))``: windows of unequal lengths, overlapping where ``m`` does not divide ``n``, so no strided view holds
    them. Each is read instead through index tensors, one per dim (:meth:`slots`, :meth:`holders`).
    """

    input: torch.Tensor
    grad: torch.Tensor | None
    out: tuple[int, ...]

    def windows(self, dim: int) -> list[tuple[int, int]]:
        """Spatial dim ``dim``'s windows, ``(start, end)``, as the kernels bound them."""
        n, m = self.input.shape[dim - len(self.out)], self.out[dim]
        return [(i * n // m, -(-(i + 1) * n // m)) for i in range(m)]

    @property
    def terms(self) -> int:
        """The most terms one sum adds: a forward's longest window; a backward's most windows holding one
        element (their product over the spatial dims)."""
        if self.grad is None:
            return math.prod(max(e - s for s, e in self.windows(d)) for d in range(len(self.out)))
        return math.prod(int(self._holders(d)[1].sum(1).max()) for d in range(len(self.out)))

    def divisors(self) -> torch.Tensor:
        """Each window's size, FP64 ``(*out)`` (the kernels divide by its length along each dim in turn)."""
        sizes = torch.ones((), dtype=torch.float64, device=self.input.device)
        for d in range(len(self.out)):
            lengths = torch.tensor([float(e - s) for s, e in self.windows(d)], dtype=torch.float64)
            shape = [1] * len(self.out)
            shape[d] = -1
            sizes = sizes * lengths.to(self.input.device).view(shape)
        return sizes

    def _slots(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Along ``dim``: ``(index, valid)``, each ``(out[dim], longest)``: the input position of each window's
        ``j``-th element (its last where the window is shorter), and whether it has one."""
        windows = self.windows(dim)
        longest = max(e - s for s, e in windows)
        index = torch.tensor([[min(s + j, e - 1) for j in range(longest)] for s, e in windows])
        valid = torch.tensor([[s + j < e for j in range(longest)] for s, e in windows])
        return index.to(self.input.device), valid.to(self.input.device)

    def _holders(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Along ``dim``: ``(index, valid)``, each ``(size, most)``: the windows holding each input position,
        in order (the last repeated where fewer hold it), and whether there is one."""
        n = self.input.shape[dim - len(self.out)]
        holding: list[list[int]] = [[] for _ in range(n)]
        for i, (s, e) in enumerate(self.windows(dim)):
            for j in range(s, e):
                holding[j].append(i)
        most = max(len(h) for h in holding)
        index = torch.tensor([[h[min(k, len(h) - 1)] for k in range(most)] for h in holding])
        valid = torch.tensor([[k < len(h) for k in range(most)] for h in holding])
        return index.to(self.input.device), valid.to(self.input.device)

    def gathered(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """The terms of every sum, laid out in the kernels' order: a forward's from input-shaped ``t``, each
        window's elements row-major, ``(*batch, *out, longest...)``; a backward's from output-shaped ``t``,
        each input element's windows in order, ``(*batch, *spatial, most...)``. ``fill`` where a sum has
        fewer terms."""
        dims = len(self.out)
        tables = [self._slots(d) if self.grad is None else self._holders(d) for d in range(dims)]
        index, valid = [], None
        for d, (idx, ok) in enumerate(tables):
            shape = [1] * (2 * dims)
            shape[d], shape[dims + d] = idx.shape
            index.append(idx.view(shape))
            valid = ok.view(shape) if valid is None else valid & ok.view(shape)
        assert valid is not None
        terms = t[(..., *index)]
        return terms.masked_fill(~valid, fill)

    def reduced(self, t: torch.Tensor, combine: str, fill: float) -> torch.Tensor:
        """``amax`` or ``amin`` (``combine``) of each sum's terms (:meth:`gathered`), one spatial dim at a
        time (a box's extreme is the extreme of its rows' extremes): ``(*batch, *out)`` forward,
        ``(*batch, *spatial)`` backward."""
        dims = len(self.out)
        for d in range(dims):
            idx, ok = self._slots(d) if self.grad is None else self._holders(d)
            axis = t.dim() - dims + d
            picked = t.index_select(axis, idx.reshape(-1))
            shape = list(picked.shape)
            shape[axis : axis + 1] = list(idx.shape)
            picked = picked.view(shape)
            mask_shape = [1] * len(shape)
            mask_shape[axis : axis + 2] = list(ok.shape)
            picked = picked.masked_fill(~ok.view(mask_shape), fill)
            t = picked.amax(axis + 1) if combine == "amax" else picked.amin(axis + 1)
        return t


def adaptive_pool_call(func: object, args: tuple, kwargs: dict) -> AdaptivePool | None:
    """The :class:`AdaptivePool` of a call of an adaptive average pool or its backward
    (:data:`ADAPTIVE_DIMS`), or None where ``func`` is none of those or the call is not a plain one
    (floating dense tensors, batched or not, no empty window)."""
    dims = ADAPTIVE_DIMS.get(func)
    if dims is None:
        return None
    bound = bound_arguments(func, args, kwargs)
    if func in ADAPTIVE_BACKWARDS:
        grad, x = bound
        out = tuple(grad.shape[-dims:]) if isinstance(grad, torch.Tensor) else ()
    else:
        (x, size), grad = bound, None
        out = tuple(size) if isinstance(size, (list, tuple)) else ()
    tensors = [x] if grad is None else [x, grad]
    if not all(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided for t in tensors
    ):
        return None
    if len(out) != dims or not all(isinstance(m, int) and m >= 1 for m in out):
        return None
    if x.dim() not in (dims + 1, dims + 2) or x.numel() == 0 or min(x.shape[-dims:]) < 1:
        return None
    return AdaptivePool(x, grad, out)
