"""Rows: layer norm, group norm, softmax, log-softmax, NLL loss, embedding backward and vector norms,
their row sums cut into short chunks as GPU kernels combine threads' partials."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from detrl.core import decompose
from detrl.core.dispatch import bound_arguments
from detrl.core.hardware.machinery import _combine, _exp, _log, _pow, _rsqrt, _sum
from detrl.core.hardware.profiles import EmulatedProfile, Plan, _register, aten, laid_out_natively

# Each is recomputed from its textbook formula, with every reduction in the profile's "row" order and its
# transcendental functions from the profile's libm: mathematically the native kernel, other last bits.

_ROW_DTYPES = (torch.float32, torch.float64)


def _rows(*tensors: Any) -> bool:
    """Whether the row kernels are emulated on these operands: dense float32/float64 of one dtype (half
    types and other layouts run natively; None entries, optional operands, are skipped)."""
    present = [t for t in tensors if t is not None]
    dtype = present[0].dtype
    return dtype in _ROW_DTYPES and all(t.layout == torch.strided and t.dtype == dtype for t in present)


def _reduce(p: EmulatedProfile, t: Tensor, dims: list[int], keepdim: bool = True) -> Tensor:
    """``t.sum(dims, keepdim)`` in the profile's row order (natively where too short to split)."""
    out = _sum(p, t, dims, keepdim, None, "row")
    return t.sum(dims, keepdim=keepdim) if out is None else out


@_register(
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten.native_group_norm.default,
    aten.native_group_norm_backward.default,
    aten._softmax.default,
    aten._softmax_backward_data.default,
)
@laid_out_natively
def _row_decomposed(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Layer norm, group norm and softmax, forward and backward, from their formulas in
    :mod:`detrl.core.decompose` (two-pass statistics where native kernels use Welford's update, which
    leaves an ulp of error in the mean that a two-pass sum of FP32-grid values does not), with every sum in
    the profile's row order, ``exp`` and the norms' ``rsqrt`` from its libm. Where the formula does not apply, and for half types,
    the native kernel runs. (In verifiable precision the rounding mode decomposes all but softmax forward
    before a profile sees them; their row sums reach :func:`_sum_op`, which orders them the same way.)"""
    bound = tuple(bound_arguments(func, args, kwargs))
    if not decompose.formula_applies(func, bound) or not _rows(*(t for t in bound if isinstance(t, Tensor))):
        return func(*args, **kwargs)
    steps = decompose.Steps(
        lambda t, dims: _reduce(p, t, dims, keepdim=False), lambda t: _exp(p, t), lambda t: _rsqrt(p, t)
    )
    return decompose.FORMULAS[func](steps, *bound)


@_register(aten._log_softmax.default)
@laid_out_natively
def _log_softmax(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``(x - max) - log(sum(exp(x - max)))`` along ``dim``."""
    x, dim, half_to_float = bound_arguments(func, args, kwargs)
    if half_to_float or not _rows(x) or x.dim() == 0 or x.numel() == 0:
        return func(*args, **kwargs)
    shifted = x - x.amax(dim, keepdim=True)
    return shifted - _log(p, _reduce(p, _exp(p, shifted), [dim]))


@_register(aten._log_softmax_backward_data.default)
@laid_out_natively
def _log_softmax_backward(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``g - exp(y) * sum(g)`` along ``dim``, for ``y = log_softmax(x)``."""
    g, y, dim, input_dtype = bound_arguments(func, args, kwargs)
    if not _rows(g, y) or input_dtype != g.dtype or g.dim() == 0 or g.numel() == 0:
        return func(*args, **kwargs)
    return g - _exp(p, y) * _reduce(p, g, [dim])


def _nll_rows(x: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(scores: (R, C), valid: (R,) bool, classes: (R,) with ignored rows at 0)`` for nll_loss's
    ``(C,)``/``(N, C)`` input or nll_loss2d's ``(N, C, H, W)`` with targets ``(N, H, W)``: the class axis
    last, one row per prediction. None if a target is out of range (the native kernel raises its own error
    for those)."""
    if x.dim() == 1:
        scores, target = x.unsqueeze(0), target.reshape(1)
    elif x.dim() == 2:
        scores = x
    else:
        scores, target = x.movedim(1, -1).reshape(-1, x.shape[1]), target.reshape(-1)
    valid = target != ignore_index
    classes = target.where(valid, 0)
    if classes.numel() and (int(classes.min()) < 0 or int(classes.max()) >= scores.shape[1]):
        return None
    return scores, valid, classes


@_register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    """Summed or mean NLL: ``(sum_i w[t_i] * -x[i, t_i] (/ sum_i w[t_i]), total_weight)``, both 0-dim, the
    sums in the profile's row order. ``reduction = none`` sums nothing and runs natively."""
    x, target, weight, reduction, ignore_index = bound_arguments(func, args, kwargs)
    if reduction == 0 or not _rows(x, weight) or x.numel() == 0:
        return func(*args, **kwargs)
    rows = _nll_rows(x, target, ignore_index)
    if rows is None:
        return func(*args, **kwargs)
    scores, valid, classes = rows
    w = valid.to(x.dtype) if weight is None else weight[classes] * valid
    # Ignored rows add an exact zero, whatever their scores (-inf at a masked class included).
    picked = torch.where(valid, -scores.gather(1, classes.unsqueeze(1)).squeeze(1) * w, 0.0)
    total = _reduce(p, w, [0], keepdim=False)  # a count without class weights: exact in any order
    loss = _reduce(p, picked, [0], keepdim=False)
    return (loss / total if reduction == 1 else loss), total


@_register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def _nll_loss_backward(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """Gradient of :func:`_nll_loss` (input-shaped, zero off the targets). It sums nothing: the only order
    left is the class weight's product, ``-(w[t] * g) / total`` here, ``w[t] * -(g / total)`` natively
    (the same bits without class weights)."""
    g, x, target, weight, reduction, ignore_index, total = bound_arguments(func, args, kwargs)
    if reduction == 0 or weight is None or not _rows(g, x, weight, total) or x.numel() == 0:
        return func(*args, **kwargs)
    rows = _nll_rows(x, target, ignore_index)
    if rows is None:
        return func(*args, **kwargs)
    scores, valid, classes = rows
    value = -(weight[classes] * g)
    if reduction == 1:
        value = value / total
    value = torch.where(valid, value, 0.0)  # ignored rows get no gradient (not 0 / 0 when all are ignored)
    grad = torch.zeros_like(scores).scatter_(1, classes.unsqueeze(1), value.unsqueeze(1))
    if x.dim() <= 2:
        return grad.reshape(x.shape)
    return grad.reshape(x.shape[0], *x.shape[2:], x.shape[1]).movedim(-1, 1).contiguous()


@_register(aten.embedding_dense_backward.default)
def _embedding_backward(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """Weight gradient ``(num_weights, D)`` of an embedding lookup: the rows of ``grad_output: (*I, D)``
    added up per index of ``indices: (*I)``.

    Native CPU kernels add the duplicates of each index in the order they occur; GPU kernels sort the
    indices and reduce segments. Here the occurrences are permuted by the profile, each index's duplicates
    are ranked in that order, ranks are cut into the profile's row chunks (each chunk added in rank order)
    and the chunk partials combined in plan order. Every add targets distinct rows, so no device's
    scatter-add order enters.
    """
    go, indices, num_weights, padding_idx, scale_grad_by_freq = bound_arguments(func, args, kwargs)
    if not _rows(go) or go.numel() == 0:
        return func(*args, **kwargs)
    idx = indices.reshape(-1)
    g = go.reshape(idx.numel(), -1)
    if scale_grad_by_freq:
        g = g / torch.bincount(idx, minlength=num_weights).to(g.dtype)[idx].unsqueeze(1)
    keep = (idx != padding_idx).nonzero().squeeze(1)
    idx, g = idx[keep], g[keep]
    uniq, slot, counts = torch.unique(idx, return_inverse=True, return_counts=True)
    plan = p.plan(int(counts.max()), "row", go.device) if counts.numel() else None
    if plan is None:  # no index repeats enough to split: each gradient row is one exact sum anyway
        return func(*args, **kwargs)
    order = p.order(idx.numel(), go.device)
    occurrence = order if order is not None else torch.arange(idx.numel(), device=go.device)
    by_slot = occurrence[torch.sort(slot[occurrence], stable=True).indices]  # grouped; profile order within
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(idx.numel(), device=go.device) - first[slot[by_slot]]
    by_rank = by_slot[torch.sort(rank, stable=True).indices]  # rank 0 of every index, then rank 1, ...
    per_rank = torch.bincount(rank, minlength=int(counts.max())).tolist()
    bounds = [0, *itertools.accumulate(per_rank)]

    def chunk_sum(start: int, length: int) -> Tensor:
        # The chunk's ranks in rank order, one index_add_: it adds its rows one at a time in their order
        # (a sequential loop on the CPU; a GPU's atomics would not, so only there rank by rank), so each
        # slot gets rank start, then start + 1, ...: the same adds, in the same order, as one call a rank.
        part = torch.zeros(uniq.numel(), g.shape[1], dtype=g.dtype, device=g.device)
        if part.is_cpu:
            rows = by_rank[bounds[start] : bounds[start + length]]
            return part.index_add_(0, slot[rows], g[rows])
        for r in range(start, start + length):  # within a rank the slots are distinct: plain adds
            rows = by_rank[bounds[r] : bounds[r + 1]]
            part.index_add_(0, slot[rows], g[rows])
        return part

    total = _combine(Plan(None, plan.pieces, plan.tree), (chunk_sum(s, n) for s, n in plan.pieces))
    out = torch.zeros(num_weights, g.shape[1], dtype=g.dtype, device=g.device)
    out[uniq] = total
    return out


def _vector_norm(p: EmulatedProfile, x: Tensor, ord: float, dim: Any, keepdim: bool) -> Tensor:
    """``(sum |x|**ord) ** (1 / ord)`` over ``dim`` (None or empty: all), in the profile's row order:
    ``sqrt(sum x * x)`` for ord 2 (sqrt is correctly rounded), ``sum |x|`` for ord 1."""
    dims = [dim] if isinstance(dim, int) else (list(dim) if dim else list(range(x.dim())))
    if ord == 2:
        return torch.sqrt(_reduce(p, x * x, dims, keepdim))
    if ord == 1:
        return _reduce(p, x.abs(), dims, keepdim)
    return _pow(p, _reduce(p, _pow(p, x.abs(), ord), dims, keepdim), 1.0 / ord)


def _norm_emulable(x: Any, ord: Any) -> bool:
    """Norms we reorder: finite, non-zero orders (inf/-inf are a max/min, 0 a count: exact in any order) of
    dense float32/float64 tensors with at least one dim."""
    return (
        isinstance(x, Tensor)
        and _rows(x)
        and x.dim() > 0
        and x.numel() > 0
        and ord is not None
        and math.isfinite(float(ord))
        and float(ord) != 0
    )


@_register(aten.linalg_vector_norm.default)
def _linalg_vector_norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``linalg_vector_norm(x, ord, dim, keepdim, dtype)`` (``x.norm()`` and ``clip_grad_norm_`` reach it)."""
    x, ord, dim, keepdim, dtype = bound_arguments(func, args, kwargs)
    if dtype is not None and dtype != x.dtype or not _norm_emulable(x, ord):
        return func(*args, **kwargs)
    return _vector_norm(p, x, float(ord), dim, keepdim)


@_register(aten.norm.Scalar, aten.norm.ScalarOpt_dim)
def _norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """The legacy ``norm(x, p)`` / ``norm(x, p, dim, keepdim)`` overloads (``p = None`` is 2)."""
    bound = bound_arguments(func, args, kwargs)
    x, ord = bound[0], 2 if bound[1] is None else bound[1]
    dim, keepdim = (bound[2], bound[3]) if func is aten.norm.ScalarOpt_dim else (None, False)
    if not _norm_emulable(x, ord):
        return func(*args, **kwargs)
    return _vector_norm(p, x, float(ord), dim, keepdim)


@_register(aten._foreach_norm.Scalar)
def _foreach_norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> list[Tensor]:
    """Per-tensor norms of a list (``clip_grad_norm_``'s first step): one 0-dim tensor each."""
    tensors, ord, dtype = bound_arguments(func, args, kwargs)
    if dtype is not None or not all(_norm_emulable(t, ord) for t in tensors):
        return func(*args, **kwargs)
    return [_vector_norm(p, t, float(ord), None, False) for t in tensors]
