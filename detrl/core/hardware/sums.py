"""Sums, means, batch norm, cumulative sums, average pools and the other sums over windows (adaptive pools,
nearest upsampling's backward, ``col2im``): the reduced axis cut into a profile's chunks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from detrl.core import decompose, pools
from detrl.core.dispatch import bound_arguments
from detrl.core.hardware.machinery import _acc_dtype, _emulable, _sum
from detrl.core.hardware.profiles import EmulatedProfile, _register, _splits, aten


@_register(aten.sum.default, aten.sum.dim_IntList)
def _sum_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``sum(x: (*S), dim, keepdim, dtype)``; ``sum.default`` reduces everything to a 0-dim tensor."""
    if func is aten.sum.default:
        (x, dtype), dim, keepdim = bound_arguments(func, args, kwargs), None, False
    else:
        x, dim, keepdim, dtype = bound_arguments(func, args, kwargs)
    # A row sum of a decomposed layer norm or softmax (verifiable precision) is ordered as the row kernel it
    # came from would order it: in "row" chunks, not as a plain sum over a long axis.
    out = _sum(p, x, dim, keepdim, dtype, "row" if decompose.summing_rows() else "k")
    return func(*args, **kwargs) if out is None else out.to(dtype or x.dtype)


@_register(aten.mean.default, aten.mean.dim)
def _mean_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``mean(x: (*S), dim, keepdim, dtype)``: the emulated sum divided by the number of reduced terms."""
    if func is aten.mean.default:
        (x, dtype), dim, keepdim = bound_arguments(func, args, kwargs), None, False
    else:
        x, dim, keepdim, dtype = bound_arguments(func, args, kwargs)
    out = _sum(p, x, dim, keepdim, dtype)
    if out is None:
        return func(*args, **kwargs)
    n = x.numel() // max(1, out.numel())  # reduced terms per output element (x.numel() > 0 when emulated)
    return out.div_(n).to(dtype or x.dtype)


@_register(aten.native_batch_norm.default, aten.native_batch_norm_backward.default)
def _batch_norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Batch norm forward and backward in training mode, with per-channel statistics from profile-ordered
    sums (the formulas live in :mod:`detrl.core.decompose`); inference mode runs natively."""
    if not decompose.applies(func, args) or not _emulable(args[0]):
        return func(*args, **kwargs)

    def channel_sum(t: Tensor, dims: list[int]) -> Tensor:
        total = _sum(p, t, dims, False, None)
        return t.sum(dims) if total is None else total.to(t.dtype)

    return decompose.DECOMPOSITIONS[func](decompose.Steps(channel_sum), *args, **kwargs)


@_register(aten.cumsum.default)
def _cumsum_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``cumsum(x: (*S), dim, dtype)`` as a GPU's scan orders it: the axis cut into the profile's ``k``
    chunks, each summed left to right, and each chunk's running sums added to the total of the chunks before
    it (those totals carried in order). Past the first chunk every partial sum is another association than
    the native kernel's one pass left to right. A chunk is never reordered: a scan's terms keep their order."""
    x, dim, dtype = bound_arguments(func, args, kwargs)
    out_dtype = dtype or x.dtype
    if x.dim() == 0 or x.layout != torch.strided or not out_dtype.is_floating_point:
        return func(*args, **kwargs)
    dim %= x.dim()
    plan = p.plan(x.shape[dim], "k", x.device)
    if plan is None:
        return func(*args, **kwargs)
    acc = x.to(_acc_dtype(out_dtype))
    runs = [acc.narrow(dim, start, length).cumsum(dim) for start, length in plan.pieces]  # the plan's chunks
    carried = runs[0].narrow(dim, runs[0].shape[dim] - 1, 1)  # the total of the chunks so far
    for i in range(1, len(runs)):
        runs[i] = runs[i] + carried
        carried = runs[i].narrow(dim, runs[i].shape[dim] - 1, 1)
    return torch.cat(runs, dim).to(out_dtype)


_POOLS = (aten.avg_pool2d.default, aten.avg_pool3d.default)
_POOL_BACKWARDS = (aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)


@_register(*_POOLS)
def _avg_pool(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``avg_pool2d/3d(x: (*B, *S)) -> (*B, *S')``: each window's elements (its kernel positions in
    row-major order, the order a CPU or GPU kernel adds them) summed in the profile's ``row`` chunks, then
    divided by the window's divisor, as the kernels do. Padding's zeros are terms here: adding a zero
    changes no sum, and the result's zeros are +0 as the kernels' (their sums start from +0)."""
    pool = pools.pool_call(func, args, kwargs)
    if pool is None or not p.splits(pool.terms, "row"):
        return func(*args, **kwargs)
    divisors = pool.divisors()
    out = tuple(divisors.shape)
    x = pool.input.to(_acc_dtype(pool.input.dtype))
    terms = torch.stack(list(pool.views(pool.padded(x, out), out)), dim=-1)  # (*B, *S', terms)
    total = _sum(p, terms, [-1], False, None, "row")
    if total is None:
        return func(*args, **kwargs)
    return total.add_(0.0).div_(divisors.to(total.dtype)).to(pool.input.dtype)


@_register(*_POOL_BACKWARDS)
def _avg_pool_backward(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """The backward of :func:`_avg_pool`: each input element's terms ``grad_output / divisor`` (one per window
    that holds it) summed in the profile's ``row`` chunks. The kernels add them window by window in order,
    which is the kernel positions in reverse: the terms are laid out so, and summed from +0."""
    pool = pools.pool_call(func, args, kwargs)
    if pool is None or pool.grad is None or not p.splits(pool.terms, "row"):
        return func(*args, **kwargs)
    divisors = pool.divisors()
    out = tuple(divisors.shape)
    share = pool.grad.to(_acc_dtype(pool.grad.dtype)) / divisors.to(_acc_dtype(pool.grad.dtype))
    blank = pool.padded(torch.zeros(pool.input.shape, dtype=share.dtype, device=share.device), out)
    placed = []
    for view in reversed(list(pool.views(blank, out))):
        view.copy_(share)
        placed.append(pool.crop(blank).clone())
        view.zero_()
    total = _sum(p, torch.stack(placed, dim=-1), [-1], False, None, "row")
    if total is None:
        return func(*args, **kwargs)
    return total.add_(0.0).to(pool.input.dtype)


@_splits(*_POOLS, *_POOL_BACKWARDS)
def _avg_pool_splits(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> bool:
    pool = pools.pool_call(func, args, kwargs)
    return pool is not None and p.splits(pool.terms, "row")


@_register(*pools.BOX_POOLS)
def _box_pool(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``_adaptive_avg_pool2d/3d(x: (*B, *S), out) -> (*B, *out)``, their backwards, the backwards of nearest
    upsampling and ``col2im`` (:class:`detrl.core.pools.BoxPool`), as :func:`_avg_pool` and
    :func:`_avg_pool_backward` order them: each window's elements row-major (backward: each input element's
    windows in order) summed in the profile's ``row`` chunks. An adaptive window's sum is divided by its
    size, as a CPU's vectorised channels-last kernel divides; the plain kernels divide by its length along
    each dim in turn, which rounds otherwise (:func:`detrl.core.scale.exact_pool_elements` claims only what
    every way of dividing gives alike)."""
    pool = pools.box_pool_call(func, args, kwargs)
    if pool is None or not p.splits(pool.terms, "row"):
        return func(*args, **kwargs)
    acc = _acc_dtype(pool.dtype)
    divisors = pool.divisors().to(acc)
    values = pool.values.to(acc) / divisors if pool.backward else pool.values.to(acc)
    terms = pool.gathered(values, 0.0).flatten(-len(pool.out))  # (*B, *S', terms): +0 where fewer
    total = _sum(p, terms, [-1], False, None, "row")
    if total is None:
        return func(*args, **kwargs)
    total = total.add_(0.0)  # the kernels' sums start from +0
    return (total if pool.backward else total.div_(divisors)).to(pool.dtype)


@_splits(*pools.BOX_POOLS)
def _box_pool_splits(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> bool:
    pool = pools.box_pool_call(func, args, kwargs)
    return pool is not None and p.splits(pool.terms, "row")
