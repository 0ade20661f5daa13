"""Matrix products and convolutions, forward and backward: split-K accumulation in a profile's order. And
linear interpolations, as products with their weights one dim at a time."""

from __future__ import annotations

import torch
from torch import Tensor
from torch._ops import OpOverload

from detrl.core import interpolation
from detrl.core.dispatch import bound_arguments
from detrl.core.hardware.machinery import _acc_dtype, _combine, _emulable, _pieces
from detrl.core.hardware.profiles import EmulatedProfile, _register, _splits, aten


def _matmul(p: EmulatedProfile, a: Tensor, b: Tensor) -> Tensor | None:
    """``a @ b`` for ``a: (M, K), b: (K, N)`` or ``a: (B, M, K), b: (B, K, N)``, split along K.

    Returns the product in the accumulation dtype, or None if the op should run natively.
    """
    if not _emulable(a, b):
        return None
    plan = p.plan(a.shape[-1], "k", a.device)
    if plan is None:
        return None
    acc = _acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    mul = torch.mm if a.dim() == 2 else torch.bmm
    pairs = zip(_pieces(a, -1, 1, plan), _pieces(b, -2, 1, plan), strict=True)
    return _combine(plan, (mul(ai, bi) for ai, bi in pairs))


@_register(aten.mm.default, aten.bmm.default)
def _mm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``mm: (M, K) @ (K, N) -> (M, N)``; ``bmm: (B, M, K) @ (B, K, N) -> (B, M, N)``."""
    a, b = bound_arguments(func, args, kwargs)
    out = _matmul(p, a, b)
    return func(*args, **kwargs) if out is None else out.to(a.dtype)


@_register(aten.addmm.default, aten.baddbmm.default)
def _addmm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``beta * self + alpha * (m1 @ m2)``; ``self`` broadcasts to ``(M, N)`` / ``(B, M, N)``."""
    self_, m1, m2, beta, alpha = bound_arguments(func, args, kwargs)
    if not _emulable(self_, m1, m2):
        return func(*args, **kwargs)
    out = _matmul(p, m1, m2)
    if out is None:
        return func(*args, **kwargs)
    if alpha != 1:
        out.mul_(alpha)
    if beta != 0:  # beta == 0 ignores self entirely (NaNs in it included), like the native kernel
        out.add_(self_.to(out.dtype), alpha=beta)
    return out.to(m1.dtype)


@_splits(aten.mm.default, aten.bmm.default)
def _mm_splits(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> bool:
    a, b = bound_arguments(func, args, kwargs)
    return _emulable(a, b) and p.splits(a.shape[-1], "k")


@_splits(aten.addmm.default, aten.baddbmm.default)
def _addmm_splits(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> bool:
    self_, m1, m2, _, _ = bound_arguments(func, args, kwargs)
    return _emulable(self_, m1, m2) and p.splits(m1.shape[-1], "k")


@_register(aten.convolution.default)
def _convolution(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """Convolution ``x: (N, C_in, *S) -> (N, C_out, *S')``, split over the input channels of each group.

    weight is ``(C_out, C_in / G, *k)``, or ``(C_in, C_out / G, *k)`` when transposed; bias ``(C_out,)``.
    """
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = bound_arguments(
        func, args, kwargs
    )
    plan = p.plan(x.shape[1] // groups, "channel", x.device) if _emulable(x, w) else None
    if plan is None:
        return func(*args, **kwargs)
    acc = _acc_dtype(x.dtype)
    xs = _pieces(x.to(acc), 1, groups, plan)
    # The weight's input-channel axis is per group already (dim 1), except for transposed convs (dim 0).
    ws = _pieces(w.to(acc), 0, groups, plan) if transposed else _pieces(w.to(acc), 1, 1, plan)
    out = _combine(
        plan,
        (
            func(xi, wi, None, stride, padding, dilation, transposed, output_padding, groups)
            for xi, wi in zip(xs, ws, strict=True)
        ),
    )
    if bias is not None:  # added once, after the reduction, as the native kernels' epilogue does
        out.add_(bias.to(acc).reshape(1, -1, *[1] * (out.dim() - 2)))
    return out.to(x.dtype)


@_splits(aten.convolution.default)
def _convolution_splits(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> bool:
    x, w, *_, groups = bound_arguments(func, args, kwargs)
    return _emulable(x, w) and p.splits(x.shape[1] // groups, "channel")


@_register(aten.convolution_backward.default)
def _convolution_backward(
    p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`_convolution`: ``(grad_input, grad_weight, grad_bias)`` as masked by output_mask.

    grad_input ``(N, C_in, *S)`` reduces over output channels, so it is split over the output channels of
    each group; grad_weight ``(C_out, C_in / G, *k)`` and grad_bias ``(C_out,)`` reduce over the batch (and
    space), so they are split over the batch.
    """
    (go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask) = (
        bound_arguments(func, args, kwargs)
    )
    if not _emulable(go, x, w):
        return func(*args, **kwargs)
    dtype, acc = x.dtype, _acc_dtype(x.dtype)
    go, x, w = go.to(acc), x.to(acc), w.to(acc)

    def call(go_: Tensor, x_: Tensor, w_: Tensor, mask_: list[bool]) -> tuple:
        sizes = bias_sizes if mask_[2] else None
        # Pieces in the default layout: a one-sample piece of a channels_last batch has a batch stride of
        # C (legal for a dim of size 1), and torch's CPU kernel then returns a wrong grouped weight gradient
        go_, x_ = go_.contiguous(), x_.contiguous()
        grads = func(go_, x_, w_, sizes, stride, padding, dilation, transposed, output_padding, groups, mask_)
        # only what the mask asks for: the CPU kernel returns a weight gradient it was not asked for, for
        # a batch of two samples or more, and then one piece's would meet another's None
        return tuple(g if wanted else None for g, wanted in zip(grads, mask_, strict=True))

    grad_input = grad_weight = grad_bias = None
    if mask[0]:
        plan = p.plan(go.shape[1] // groups, "channel", go.device)
        if plan is None:
            grad_input = call(go, x, w, [True, False, False])[0]
        else:
            gos = _pieces(go, 1, groups, plan)
            # The weight's output-channel axis is dim 0 (in G blocks), or the per-group dim 1 when transposed.
            ws = _pieces(w, 1, 1, plan) if transposed else _pieces(w, 0, groups, plan)
            grad_input = _combine(
                plan, (call(gi, x, wi, [True, False, False])[0] for gi, wi in zip(gos, ws, strict=True))
            )
    if mask[1] or mask[2]:
        sub_mask = [False, bool(mask[1]), bool(mask[2])]
        plan = p.plan(x.shape[0], "batch", x.device)
        if plan is None:
            _, grad_weight, grad_bias = call(go, x, w, sub_mask)
        else:
            parts = (
                call(gi, xi, w, sub_mask)[1:]
                for gi, xi in zip(_pieces(go, 0, 1, plan), _pieces(x, 0, 1, plan), strict=True)
            )
            grad_weight, grad_bias = _combine(plan, parts)
    return tuple(None if g is None else g.to(dtype) for g in (grad_input, grad_weight, grad_bias))


@_splits(aten.convolution_backward.default)
def _convolution_backward_splits(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> bool:
    go, x, w, _, _, _, _, _, _, groups, mask = bound_arguments(func, args, kwargs)
    if not _emulable(go, x, w):
        return False
    return bool(mask[0] and p.splits(go.shape[1] // groups, "channel")) or bool(
        (mask[1] or mask[2]) and p.splits(x.shape[0], "batch")
    )


@_register(*interpolation.INTERPOLATIONS)
def _interpolation(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """A linear interpolation (``F.interpolate`` in the ``linear``, ``bilinear`` or ``trilinear`` mode) or its
    backward computed one spatial dim at a time, as products with each dim's weights: the same sums as the
    kernels', which add each element's 2, 4 or 8 weighted terms at once, associated otherwise (a separable
    kernel's order), so their last bits differ."""
    call = interpolation.interpolation_call(func, args, kwargs)
    if call is None or not _emulable(call.values):
        return func(*args, **kwargs)
    acc = _acc_dtype(call.values.dtype)
    return call.separably(call.values.to(acc)).to(call.values.dtype).contiguous()
