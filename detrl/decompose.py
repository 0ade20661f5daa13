"""Batch norm and log-softmax backward as small machine-dependent steps plus plain IEEE arithmetic.

Batch norm's forward and backward kernels each hide a per-channel reduction inside a full-size
elementwise epilogue. As single ops, every element of their output inherits the reduction's machine
dependence, and the elements that cancel to almost nothing must all be logged: batch norm backward was half
of ResNet-50's rounding log. Written out, the only machine-dependent parts are the per-channel sums; the
rest is a fixed sequence of add, sub, mul, div and sqrt, each correctly rounded in FP64 by every IEEE-754
machine, so the final outputs are the same bits everywhere once rounded to FP32.

Log-softmax backward, ``g - exp(y) * sum(g)``, cancels the same way, and worse: with cross-entropy the
target's gradient is ``(p - 1) / N``, tiny once the model is confident, while the libm's error in
``exp(y) = p`` stays an ulp of 1. No threshold at the output's scale measured in the first step covers it
later in training (a 600-step digits run audited under another libm showed unlogged near-midpoint elements
from step 221). Written out, ``exp`` is an elementwise op (logged at the element's own scale, where its
error lives), ``sum(g)`` a small reduction, and the product and difference exact.

Each function takes :class:`Steps`: the rounding mode passes steps that run under itself (rounded, logged,
reordered by the hardware profile) and rounds the final outputs as exact; the emulated hardware profiles
pass their own reordered sums. Results are mathematically equal to torch's kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}


def _decomposes(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op in DECOMPOSITIONS:
            raise RuntimeError(f"duplicate decomposition for {op}")
        DECOMPOSITIONS[op] = fn
        return fn

    return register


def channels(x: torch.Tensor) -> tuple[list[int], list[int], int]:
    """For ``x: (N, C, *S)``: reduced dims, per-channel broadcast shape, terms per channel."""
    return [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2), x.numel() // x.shape[1]


ChannelSum = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Steps:
    """The machine-dependent steps a decomposition calls: ``sum(t, dims)`` (the dims removed) and
    ``exp(t)``; everything else in a decomposition is correctly rounded IEEE arithmetic."""

    sum: ChannelSum
    exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp


def applies(func: Any, args: tuple) -> bool:
    """Whether ``func(*args)`` has a decomposition here: batch norm in training mode (rank >= 2), and
    log-softmax backward of one floating dtype throughout."""
    if func is aten._log_softmax_backward_data.default:
        if len(args) < 4 or not all(isinstance(t, torch.Tensor) for t in args[:2]):
            return False
        grad, out, _, input_dtype = args[:4]
        return grad.is_floating_point() and grad.dtype == out.dtype == input_dtype and grad.numel() > 0
    if func not in DECOMPOSITIONS or len(args) < 8:
        return False
    x, training = args[0], args[5] if func is aten.native_batch_norm.default else args[7]
    return bool(training) and x.dim() >= 2 and x.shape[1] > 0 and x.numel() > x.shape[1]


@_decomposes(aten.native_batch_norm.default)
def batch_norm(steps: Steps, x, weight, bias, running_mean, running_var, training, momentum, eps):  # noqa: ANN001, ANN201
    """``(N, C, *S)`` -> ``(out, save_mean: (C,), save_invstd: (C,))``; updates running statistics in place."""
    channel_sum = steps.sum
    dims, shape, n = channels(x)
    mean = channel_sum(x, dims) / n
    centred = x - mean.view(shape)
    var = channel_sum(centred * centred, dims) / n
    invstd = 1.0 / (var + eps).sqrt()  # not rsqrt: sqrt and division are correctly rounded everywhere
    out = centred * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None and running_var is not None:
        running_mean.mul_(1 - momentum).add_(mean * momentum)
        running_var.mul_(1 - momentum).add_(var * (n / max(n - 1, 1)) * momentum)
    return out, mean, invstd


@_decomposes(aten.native_batch_norm_backward.default)
def batch_norm_backward(  # noqa: ANN201
    steps: Steps,
    grad_out,
    x,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    train,
    eps,
    output_mask,  # noqa: ANN001
):
    """Gradients of :func:`batch_norm`: ``(grad_x, grad_weight, grad_bias)``, None where masked."""
    channel_sum = steps.sum
    dims, shape, n = channels(x)
    xhat = (x - save_mean.view(shape)) * save_invstd.view(shape)
    sum_g = channel_sum(grad_out, dims)
    sum_gx = channel_sum(grad_out * xhat, dims)
    grad_x = None
    if output_mask[0]:
        scale = save_invstd if weight is None else save_invstd * weight
        grad_x = (grad_out - (sum_g / n).view(shape) - xhat * (sum_gx / n).view(shape)) * scale.view(shape)
    return grad_x, sum_gx if output_mask[1] else None, sum_g if output_mask[2] else None


@_decomposes(aten._log_softmax_backward_data.default)
def log_softmax_backward(steps: Steps, grad_output, output, dim, input_dtype):  # noqa: ANN001, ANN201
    """Input gradient of ``output = log_softmax(x, dim)``: ``grad - exp(output) * sum(grad, dim)``, shape of
    ``grad``. Both factors of the product lie on the FP32 grid, so it is exact in FP64; the difference is
    one correctly rounded subtraction."""
    dim %= max(grad_output.dim(), 1)
    total = steps.sum(grad_output, [dim])
    return grad_output - steps.exp(output) * (total.unsqueeze(dim) if grad_output.dim() else total)
