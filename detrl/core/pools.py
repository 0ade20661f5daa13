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
    def dtype(self) -> torch.dtype:
        return self.input.dtype

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

    if not all(dense_floating(t) for t in ([x] if grad is None else [x, grad])):
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
#: The backwards of nearest upsampling (rules revision 17), each with its forward, which maps an output
#: position to the input position it copies.
NEAREST_BACKWARDS = {
    aten.upsample_nearest1d_backward.default: aten.upsample_nearest1d.default,
    aten.upsample_nearest2d_backward.default: aten.upsample_nearest2d.default,
    aten.upsample_nearest3d_backward.default: aten.upsample_nearest3d.default,
    aten._upsample_nearest_exact1d_backward.default: aten._upsample_nearest_exact1d.default,
    aten._upsample_nearest_exact2d_backward.default: aten._upsample_nearest_exact2d.default,
    aten._upsample_nearest_exact3d_backward.default: aten._upsample_nearest_exact3d.default,
}
#: Every op a :class:`BoxPool` describes: those, and ``col2im`` (``F.fold``, and ``F.unfold``'s backward).
BOX_POOLS = frozenset({*ADAPTIVE_DIMS, *NEAREST_BACKWARDS, aten.col2im.default})


@dataclasses.dataclass(frozen=True)
class BoxPool:
    """A pool whose window, along each spatial dim, is one run of input positions per output position:
    an adaptive average pool's, or nearest upsampling's (one position each: its backward sums the gradient
    of every copy of an input element). ``col2im`` is such a backward too: each column entry is a copy of
    one image position, or of padding (an empty run). A linear interpolation's units are read over such
    boxes as well (:meth:`detrl.core.interpolation.Interpolation.box`).

    ``values`` are the sums' numerators: a forward's input ``(*batch, *spatial)``, a backward's gradient
    ``(*batch, *out)``. ``in_shape`` is the input's whole shape, ``windows[d][i]`` the input positions
    ``(start, end)`` of output position ``i`` along spatial dim ``d``, and ``averages`` whether each
    window's sum is divided by its size (an adaptive pool's is; a copy is not).

    An adaptive pool's window ``i`` along a dim of ``n`` pooled to ``m`` is ``[floor(i n / m), ceil((i + 1)
    n / m))``: windows of unequal lengths, overlapping where ``m`` does not divide ``n``, so no strided view
    holds them. Each is read through index tensors, one per dim.
    """

    values: torch.Tensor
    in_shape: tuple[int, ...]
    windows: tuple[tuple[tuple[int, int], ...], ...]
    backward: bool
    averages: bool

    @property
    def out(self) -> tuple[int, ...]:
        """The output's spatial shape."""
        return tuple(len(w) for w in self.windows)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def terms(self) -> int:
        """The most terms one sum adds: a forward's longest window; a backward's most windows holding one
        element (their product over the spatial dims)."""
        if not self.backward:
            return math.prod(max(e - s for s, e in w) for w in self.windows)
        return math.prod(max(len(h) for h in self._holding(d)) for d in range(len(self.windows)))

    def divisors(self) -> torch.Tensor:
        """Each window's divisor, FP64 ``(*out)``: its size where the pool averages (the kernels divide by
        its length along each dim in turn, or by the size), else 1."""
        sizes = torch.ones((), dtype=torch.float64, device=self.values.device)
        if not self.averages:
            return sizes.expand(self.out)
        for d, windows in enumerate(self.windows):
            lengths = torch.tensor([float(e - s) for s, e in windows], dtype=torch.float64)
            shape = [1] * len(self.windows)
            shape[d] = -1
            sizes = sizes * lengths.to(self.values.device).view(shape)
        return sizes

    def _slots(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Along ``dim``: ``(index, valid)``, each ``(out[dim], longest)``: the input position of each
        window's ``j``-th element (its last where the window is shorter), and whether it has one."""
        windows = self.windows[dim]
        longest = max(e - s for s, e in windows)
        index = torch.tensor([[min(s + j, e - 1) for j in range(longest)] for s, e in windows])
        valid = torch.tensor([[s + j < e for j in range(longest)] for s, e in windows])
        return index.to(self.values.device), valid.to(self.values.device)

    def _holders(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Along ``dim``: ``(index, valid)``, each ``(size, most)``: the windows holding each input position,
        in order (the last repeated where fewer hold it, the first where none does), and whether there is
        one."""
        holding = self._holding(dim)
        most = max(1, max(len(h) for h in holding))
        index = torch.tensor([[h[min(k, len(h) - 1)] if h else 0 for k in range(most)] for h in holding])
        valid = torch.tensor([[k < len(h) for k in range(most)] for h in holding])
        return index.to(self.values.device), valid.to(self.values.device)

    def _holding(self, dim: int) -> list[list[int]]:
        """Along ``dim``, the windows holding each input position, in order."""
        holding: list[list[int]] = [[] for _ in range(self.in_shape[dim - len(self.windows)])]
        for i, (s, e) in enumerate(self.windows[dim]):
            for j in range(s, e):
                holding[j].append(i)
        return holding

    def _tables(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._holders(dim) if self.backward else self._slots(dim)

    def gathered(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """The terms of every sum, laid out in the kernels' order: a forward's from input-shaped ``t``, each
        window's elements row-major, ``(*batch, *out, longest...)``; a backward's from output-shaped ``t``,
        each input element's windows in order, ``(*batch, *spatial, most...)``. ``fill`` where a sum has
        fewer terms."""
        dims = len(self.windows)
        index, valid = [], None
        for d in range(dims):
            idx, ok = self._tables(d)
            shape = [1] * (2 * dims)
            shape[d], shape[dims + d] = idx.shape
            index.append(idx.view(shape))
            valid = ok.view(shape) if valid is None else valid & ok.view(shape)
        assert valid is not None
        return t[(..., *index)].masked_fill(~valid, fill)

    def reduced(self, t: torch.Tensor, combine: str, fill: float) -> torch.Tensor:
        """``amax`` or ``amin`` (``combine``) of each sum's terms (:meth:`gathered`), one spatial dim at a
        time (a box's extreme is the extreme of its rows' extremes): ``(*batch, *out)`` forward,
        ``(*batch, *spatial)`` backward; ``fill`` where a sum has no term."""
        dims = len(self.windows)
        for d in range(dims):
            axis = t.dim() - dims + d
            runs = self._runs(d)
            if runs is not None:
                t = _run_extremes(t, axis, *runs, combine, fill)
                continue
            idx, ok = self._tables(d)  # runs that are not contiguous (col2im's holders): gathered
            picked = t.index_select(axis, idx.reshape(-1))
            shape = list(picked.shape)
            shape[axis : axis + 1] = list(idx.shape)
            mask = [1] * len(shape)
            mask[axis : axis + 2] = list(ok.shape)
            picked = picked.view(shape).masked_fill(~ok.view(mask), fill)
            t = picked.amax(axis + 1) if combine == "amax" else picked.amin(axis + 1)
        return t

    def _runs(self, dim: int) -> tuple[list[int], list[int]] | None:
        """Along ``dim``, each sum's terms as one run of consecutive positions: ``(starts, lengths)``, of the
        input positions in each window forward, of the windows holding each input position backward (a run
        where windows move only forward); None where some run is not consecutive."""
        if not self.backward:
            return [s for s, _ in self.windows[dim]], [e - s for s, e in self.windows[dim]]
        starts, lengths = [], []
        for holding in self._holding(dim):
            if holding and holding[-1] - holding[0] + 1 != len(holding):
                return None
            starts.append(holding[0] if holding else 0)
            lengths.append(len(holding))
        return starts, lengths


def _run_extremes(
    t: torch.Tensor, axis: int, starts: list[int], lengths: list[int], combine: str, fill: float
) -> torch.Tensor:
    """``amax`` or ``amin`` of ``t`` over runs of consecutive positions along ``axis``: run ``i`` is
    ``lengths[i]`` positions from ``starts[i]`` (``fill`` where it is empty). One sliding extreme over
    ``t`` for each distinct length, then each run's taken from it: memory of the result's size, not of its
    size times the longest run's."""
    shape = list(t.shape)
    shape[axis] = len(starts)
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    for length in sorted(set(lengths) - {0}):
        sliding = t.unfold(axis, length, 1)  # (..., n - length + 1, ..., length): every run of this length
        extreme = sliding.amax(-1) if combine == "amax" else sliding.amin(-1)
        which = [i for i, n in enumerate(lengths) if n == length]
        at = torch.tensor(which, device=t.device)
        begin = torch.tensor([starts[i] for i in which], device=t.device)
        out.index_copy_(axis, at, extreme.index_select(axis, begin))
    return out


def dense_floating(t: object) -> bool:
    """Whether ``t`` is a dense tensor of a floating dtype: the only values a pool's rules read."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided


def box_pool_call(func: object, args: tuple, kwargs: dict) -> BoxPool | None:
    """The :class:`BoxPool` of a call of an op of :data:`BOX_POOLS`, or None where ``func`` is none of those
    or the call is not a plain one (floating dense tensors, batched or not, of the sizes it names)."""
    if func not in BOX_POOLS:
        return None
    bound = bound_arguments(func, args, kwargs)
    values = bound[0]
    if not dense_floating(values):
        return None
    if func in NEAREST_BACKWARDS:
        return _nearest_backward(func, values, bound[1:])
    if func is aten.col2im.default:
        return _col2im(values, bound[1:])
    dims = ADAPTIVE_DIMS[func]
    if func in (aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default):
        x = bound[1]
        if not isinstance(x, torch.Tensor) or values.dim() != x.dim():
            return None
        in_shape, out, backward = tuple(x.shape), tuple(values.shape[-dims:]), True
    else:
        size = bound[1]
        in_shape, out, backward = (
            tuple(values.shape),
            tuple(size) if isinstance(size, (list, tuple)) else (),
            False,
        )
    if len(out) != dims or not all(isinstance(m, int) and m >= 1 for m in out):
        return None
    if len(in_shape) not in (dims + 1, dims + 2) or math.prod(in_shape) == 0:
        return None
    spatial = in_shape[-dims:]
    windows = tuple(tuple((i * n // m, -(-(i + 1) * n // m)) for i in range(m)) for n, m in zip(spatial, out))
    return BoxPool(values, in_shape, windows, backward, averages=True)


def _nearest_backward(func: object, grad: torch.Tensor, rest: list) -> BoxPool | None:
    """The :class:`BoxPool` of a nearest upsampling's backward: each output position's window is the one
    input position it copies, found by running the forward on the positions themselves, dim by dim (so its
    rounding of scales is the kernel's own)."""
    forward = NEAREST_BACKWARDS[func]  # type: ignore[index]
    out, in_shape, *scales = rest
    if not (isinstance(out, (list, tuple)) and isinstance(in_shape, (list, tuple))):
        return None
    dims = len(out)
    if len(in_shape) != dims + 2 or tuple(grad.shape) != (*in_shape[:2], *out) or grad.numel() == 0:
        return None
    windows = []
    for d in range(dims):
        n = in_shape[2 + d]
        shape = [1, 1] + [n if k == d else 1 for k in range(dims)]
        positions = torch.arange(n, dtype=torch.float64).view(shape)
        size = [out[k] if k == d else 1 for k in range(dims)]
        copied = forward(positions, size, *[scales[k] if k == d else None for k in range(dims)])
        windows.append(tuple((int(j), int(j) + 1) for j in copied.reshape(-1).tolist()))
    return BoxPool(grad, tuple(in_shape), tuple(windows), backward=True, averages=False)


def _col2im(columns: torch.Tensor, rest: list) -> BoxPool | None:
    """The :class:`BoxPool` of ``col2im(columns, output_size, kernel_size, dilation, padding, stride)``:
    ``columns`` ``(*N, C * kh * kw, Lh * Lw)`` hold, at kernel offset ``(i, j)`` of block ``(a, b)``, a copy
    of image position ``(a sh - ph + i dh, b sw - pw + j dw)`` (none where that is padding), and the image
    ``(*N, C, H, W)`` sums each position's copies. Laid out as ``(*N, C, kh * Lh, kw * Lw)``, position ``i
    Lh + a`` along the first spatial dim copies one image row, so each image element's copies, in order
    along each dim, are those of kernel offsets ``(i, j)`` row-major: the order the kernels add them."""
    size, kernel, dilation, padding, stride = rest
    params = [size, kernel, dilation, padding, stride]
    if not all(
        isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(i, int) for i in v) for v in params
    ):
        return None
    if columns.dim() not in (2, 3) or columns.numel() == 0 or min(kernel) < 1 or min(stride) < 1:
        return None
    blocks = [
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, d, p, s in zip(size, kernel, dilation, padding, stride)
    ]
    if (
        min(blocks) < 1
        or columns.shape[-1] != blocks[0] * blocks[1]
        or columns.shape[-2] % (kernel[0] * kernel[1])
    ):
        return None
    (kh, kw), (lh, lw) = kernel, blocks
    channels = columns.shape[-2] // (kh * kw)
    batch = tuple(columns.shape[:-2])
    laid = columns.reshape(*batch, channels, kh, kw, lh, lw).movedim(-2, -3)  # (*N, C, kh, Lh, kw, Lw)
    laid = laid.reshape(*batch, channels, kh * lh, kw * lw)
    windows = []
    for n, k, d, p, s, count in zip(size, kernel, dilation, padding, stride, blocks):
        runs = []
        for i in range(k):
            for a in range(count):
                at = a * s - p + i * d
                runs.append((at, at + 1) if 0 <= at < n else (0, 0))
        windows.append(tuple(runs))
    return BoxPool(laid, (*batch, channels, *size), tuple(windows), backward=True, averages=False)
