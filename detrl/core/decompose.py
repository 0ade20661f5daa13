"""Batch norm, layer norm, softmax and log-softmax backward as small machine-dependent steps plus plain
IEEE arithmetic.

Batch norm's forward and backward kernels each hide a per-channel reduction inside a full-size
elementwise epilogue. As single ops, every element of their output inherits the reduction's machine
dependence, and the elements that cancel to almost nothing must all be logged: batch norm backward was half
of ResNet-50's rounding log. Written out, the only machine-dependent parts are the per-channel sums; the
rest is a fixed sequence of add, sub, mul, div and sqrt, each correctly rounded in FP64 by every IEEE-754
machine, so the final outputs are the same bits everywhere once rounded to FP32. (torch's CPU ``sqrt`` is
not correctly rounded in MKL builds: from rules revision 10 the rounding mode passes
:func:`detrl.core.portable.ieee_sqrt` as :attr:`Steps.sqrt`.)

Log-softmax backward, ``g - exp(y) * sum(g)``, cancels the same way, and worse: with cross-entropy the
target's gradient is ``(p - 1) / N``, tiny once the model is confident, while the libm's error in
``exp(y) = p`` stays an ulp of 1. No threshold at the output's scale measured in the first step covers it
later in training (a 600-step digits run audited under another libm showed unlogged near-midpoint elements
from step 221). Written out, ``exp`` is an elementwise op (logged at the element's own scale, where its
error lives), ``sum(g)`` a small reduction, and the product and difference exact.

Layer norm and softmax backward are the same kind of kernel over rows: a few row sums (one element per
row) inside a full-size epilogue. Written out, only the row sums are logged, and layer norm's mean sum not
even those where :func:`_exact_rows` proves that every order of summation gives the exact FP64 sum: as a
single op, layer norm's mean (exact FP32 ties, rows that cancel at their position's scale) was a fifth of
the tiny transformer's log. The sums are *row sums*: :func:`summing_rows` tells the emulated hardware
profiles to order them as the row kernels they stand for do (``detrl.core.hardware.rows``' ``"row"`` chunks), not as
a plain ``sum`` op. Softmax forward has a formula here, for the profiles, but the rounding mode does not
decompose it (see :func:`softmax`).

Each function takes :class:`Steps`: the rounding mode passes steps that run under itself (rounded, logged,
reordered by the hardware profile) and rounds the final outputs as exact; the emulated hardware profiles
pass their own reordered sums. Results are mathematically equal to torch's kernels.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from detrl.core.portable import ieee_divide
from detrl.core.scale import dense_for_kernel, spacing32

try:  # the C kernel's pass for exact rows (the torch rule in _exact_rows is the reference)
    from detrl.core import _roundkernel as _native
except ImportError:
    _native = None

#: Whether :func:`_exact_rows` takes CPU rows through the C kernel where it is built (tests compare both).
KERNEL_ROWS = True

aten = torch.ops.aten
#: Every formula here, by op: what the emulated hardware profiles compute these ops with.
FORMULAS: dict[Any, Callable[..., Any]] = {}
#: The formulas the rounding mode decomposes its ops into (all but softmax forward, see :func:`softmax`).
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}


def _decomposes(op: Any, rounding: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op in FORMULAS:
            raise RuntimeError(f"duplicate decomposition for {op}")
        FORMULAS[op] = fn
        if rounding:
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
    #: ``1 / sqrt(t)``. The rounding mode passes ``1 / sqrt(t)`` with its ``sqrt``: two correctly rounded
    #: IEEE operations, the same bits everywhere. Only the emulated profiles' plain FP32/FP64 runs pass a
    #: GPU's ``rsqrt`` (their libm).
    inv_sqrt: Callable[[torch.Tensor], torch.Tensor] = lambda t: 1.0 / t.sqrt()  # noqa: E731
    #: ``sqrt(t)``: the rounding mode passes a correctly rounded one (rules revision 10; torch's before).
    sqrt: Callable[[torch.Tensor], torch.Tensor] = torch.sqrt


_ROW_SUMS: contextvars.ContextVar[bool] = contextvars.ContextVar("detrl_row_sums", default=False)


def summing_rows() -> bool:
    """Whether the sum being computed now is a row sum of layer norm or softmax (called from inside
    ``Steps.sum``): a hardware profile orders it as its row kernels do."""
    return _ROW_SUMS.get()


def _row_sum(steps: Steps, t: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``steps.sum(t, dims)``, marked as a row sum for the duration of the call (:func:`summing_rows`)."""
    token = _ROW_SUMS.set(True)
    try:
        return steps.sum(t, dims)
    finally:
        _ROW_SUMS.reset(token)


def _exact_rows(rows: torch.Tensor) -> torch.Tensor:
    """Bool ``(*B)``: the rows of ``rows: (*B, n)`` whose sum every IEEE FP64 machine computes exactly, in
    any order and any chunking (so the same FP64 value everywhere, with nothing to round or log).

    Such a row is FP64 on the FP32 grid, so each term is an integer multiple of its FP32 spacing and all are
    multiples of the smallest one, ``q``; with ``n * max|x| <= 2**52 * q`` every partial sum, whatever the
    order, is a multiple of ``q`` below ``2**53 * q``: representable, so every add is exact. The test itself
    uses only exact operations (max, min, frexp, a product by ``n`` that is correctly rounded, compares), so
    every machine takes the same decision. Zeros, infinities, NaN and values off the FP32 grid are handled
    by the same rules (a row holding inf, NaN or an off-grid value is never exact).
    """
    if rows.dtype != torch.float64 or rows.shape[-1] == 0:
        return torch.zeros(rows.shape[:-1], dtype=torch.bool, device=rows.device)
    if (
        KERNEL_ROWS
        and hasattr(_native, "exact_rows")
        and rows.device.type == "cpu"
        and rows.layout == torch.strided
    ):
        # the same rule in one pass of the C kernel (a dozen torch passes over the rows below)
        dense = dense_for_kernel(rows)
        mask = torch.empty(dense.shape[:-1], dtype=torch.bool)
        assert _native is not None
        _native.exact_rows(dense.data_ptr(), mask.numel(), dense.shape[-1], mask.data_ptr())
        return mask
    magnitude = rows.abs()
    on_grid = (rows.to(torch.float32).to(torch.float64) == rows).all(-1)
    q = spacing32(magnitude).masked_fill(magnitude == 0, torch.inf).amin(-1)
    return on_grid & (magnitude.amax(-1) * rows.shape[-1] <= q * 2.0**52)


def _same_dtype(dtype: torch.dtype, *tensors: Any) -> bool:
    """Whether every entry is None or a strided tensor of ``dtype`` (a floating one)."""
    return dtype.is_floating_point and all(
        t is None or (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype == dtype)
        for t in tensors
    )


def _layer_norm_applies(x: Any, shape: Any, *operands: Any) -> bool:
    """Layer norm over ``shape``, the trailing dims of a non-empty ``x``, with operands of ``x``'s dtype."""
    if not isinstance(x, torch.Tensor) or not isinstance(shape, (list, tuple)) or x.dim() < len(shape):
        return False
    trailing = list(x.shape[x.dim() - len(shape) :])
    return trailing == list(shape) and x.numel() > 0 and _same_dtype(x.dtype, x, *operands)


def _group_norm_applies(x: Any, n: Any, c: Any, hxw: Any, groups: Any, *operands: Any) -> bool:
    """Group norm of a non-empty ``x: (N, C, *S)`` in ``groups`` groups that divide ``C``, with operands of
    ``x``'s dtype (the sizes plain integers)."""
    if not isinstance(x, torch.Tensor) or not all(type(v) is int for v in (n, c, hxw, groups)):
        return False
    if x.dim() < 2 or x.numel() == 0 or tuple(x.shape[:2]) != (n, c) or n * c * hxw != x.numel():
        return False
    return groups > 0 and c % groups == 0 and _same_dtype(x.dtype, x, *operands)


def _rows_applies(grad: Any, out: Any, dim: Any, dtype: Any) -> bool:
    """``(grad, out)`` of one floating dtype (``dtype``, if given, the same), non-empty, rank >= 1."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.numel() == 0 or not isinstance(dim, int):
        return False
    return (dtype is None or dtype == out.dtype) and _same_dtype(out.dtype, grad, out)


def applies(func: Any, args: tuple) -> bool:
    """Whether the rounding mode decomposes ``func(*args)``: it is in :data:`DECOMPOSITIONS` and
    :func:`formula_applies`."""
    return func in DECOMPOSITIONS and formula_applies(func, args)


def formula_applies(func: Any, args: tuple) -> bool:
    """Whether :data:`FORMULAS` computes ``func(*args)`` (positional arguments, as autograd passes them):
    batch norm in training mode (rank >= 2); layer norm and its backward, in training and inference alike,
    on non-empty input whose operands share its floating dtype (and the backward not asked for the gradient
    of a missing weight or bias, which torch refuses); softmax on rank >= 1 without ``half_to_float``, and
    the backward of softmax and log-softmax, of one floating dtype throughout. Elsewhere torch's kernel
    runs (and raises its own errors)."""
    if func is aten._log_softmax_backward_data.default or func is aten._softmax_backward_data.default:
        return len(args) == 4 and _rows_applies(args[0], args[1], args[2], args[3])
    if func is aten._softmax.default:
        return len(args) == 3 and not args[2] and _rows_applies(None, args[0], args[1], None)
    if func is aten.native_layer_norm.default:
        return len(args) == 5 and _layer_norm_applies(*args[:4])
    if func is aten.native_layer_norm_backward.default:
        if len(args) != 8:
            return False
        grad, x, shape, mean, rstd, weight, bias, mask = args
        missing = (mask[1] and weight is None) or (mask[2] and bias is None)
        return not missing and _layer_norm_applies(x, shape, grad, mean, rstd, weight, bias)
    if func is aten.native_group_norm.default:
        return len(args) == 8 and _group_norm_applies(args[0], *args[3:7], args[1], args[2])
    if func is aten.native_group_norm_backward.default:
        if len(args) != 10:
            return False
        grad, x, mean, rstd, weight, n, c, hxw, groups, mask = args
        return not (mask[1] and weight is None) and _group_norm_applies(
            x, n, c, hxw, groups, grad, mean, rstd, weight
        )
    if func not in FORMULAS or len(args) < 8:
        return False
    x, training = args[0], args[5] if func is aten.native_batch_norm.default else args[7]
    return bool(training) and x.dim() >= 2 and x.shape[1] > 0 and x.numel() > x.shape[1]


@_decomposes(aten.native_batch_norm.default)
def batch_norm(steps: Steps, x, weight, bias, running_mean, running_var, training, momentum, eps):  # noqa: ANN001, ANN201
    """``(N, C, *S)`` -> ``(out, save_mean: (C,), save_invstd: (C,))``; updates running statistics in place."""
    channel_sum = steps.sum
    dims, shape, n = channels(x)
    mean = ieee_divide(channel_sum(x, dims), n)
    centred = x - mean.view(shape)
    var = ieee_divide(channel_sum(centred * centred, dims), n)
    invstd = 1.0 / steps.sqrt(var + eps)  # not rsqrt: sqrt (Steps.sqrt) and division are correctly rounded
    # In place from here: the same operations in the same order (so the same bits), without a new
    # activation-sized tensor for each.
    out = centred.mul_(invstd.view(shape))
    if weight is not None:
        out.mul_(weight.view(shape))
    if bias is not None:
        out.add_(bias.view(shape))
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
    xhat = (x - save_mean.view(shape)).mul_(save_invstd.view(shape))
    sum_g = channel_sum(grad_out, dims)
    sum_gx = channel_sum(grad_out * xhat, dims)
    grad_x = None
    if output_mask[0]:
        scale = save_invstd if weight is None else save_invstd * weight
        # (grad_out - sum_g / n - xhat * sum_gx / n) * scale, in place: the same operations in the same order
        grad_x = (grad_out - ieee_divide(sum_g, n).view(shape)).sub_(
            xhat.mul_(ieee_divide(sum_gx, n).view(shape))
        )
        grad_x.mul_(scale.view(shape))
    return grad_x, sum_gx if output_mask[1] else None, sum_g if output_mask[2] else None


@_decomposes(aten._log_softmax_backward_data.default)
def log_softmax_backward(steps: Steps, grad_output, output, dim, input_dtype):  # noqa: ANN001, ANN201
    """Input gradient of ``output = log_softmax(x, dim)``: ``grad - exp(output) * sum(grad, dim)``, shape of
    ``grad``. Both factors of the product lie on the FP32 grid, so it is exact in FP64; the difference is
    one correctly rounded subtraction."""
    dim %= max(grad_output.dim(), 1)
    total = steps.sum(grad_output, [dim])
    return grad_output - steps.exp(output) * (total.unsqueeze(dim) if grad_output.dim() else total)


# ------------------------------------------------------------------------------- rows: layer norm, softmax


def _rows(x: torch.Tensor, shape: list[int]) -> tuple[torch.Tensor, int]:
    """``x: (*B, *S)`` with ``S = shape`` as rows ``(*B, n)``, ``n = prod(S)`` (``(1, n)`` when ``B`` is empty).

    The batch dims stay apart: a row sum's output ``(*B)`` is then logged at the scale torch's own mean and
    rstd outputs were (per dim 1 for ``B`` of rank >= 2: a sequence position), not one scale for all rows.
    """
    n = math.prod(shape)
    return x.reshape(*(x.shape[: x.dim() - len(shape)] or (1,)), n), n


def _stats_shape(x: torch.Tensor, shape: list[int]) -> list[int]:
    """Shape of layer norm's mean and rstd: ``(*B, 1, ..., 1)``, one 1 per normalized dim."""
    return [*x.shape[: x.dim() - len(shape)], *[1] * len(shape)]


def _normalized_rows(steps: Steps, rows: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """``rows: (R, n)`` centred and scaled by their own two-pass statistics (biased variance, as torch):
    ``(xhat: (R, n), mean: (R, 1), rstd: (R, 1))``, from two row sums (layer norm's and group norm's)."""
    n = rows.shape[-1]
    # Rows of FP32-grid values mostly sum exactly in FP64, in any order: those are summed here, the same
    # value everywhere, and reach the logged sum as zeros (never logged). Rounded and logged, their sums
    # were most of layer norm's log (exact FP32 ties, and rows that cancel at their position's scale).
    exact = _exact_rows(rows)
    logged = _row_sum(steps, rows.masked_fill(exact.unsqueeze(-1), 0.0), [-1])
    mean = ieee_divide(torch.where(exact, rows.sum(-1), logged), n).unsqueeze(-1)
    centred = rows - mean
    var = ieee_divide(_row_sum(steps, centred * centred, [-1]), n).unsqueeze(-1)
    rstd = steps.inv_sqrt(var + eps)
    return centred.mul_(rstd), mean, rstd  # in place: the same operations, without a new tensor for each


def _normalized_rows_backward(
    steps: Steps, gw: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """The input gradient of :func:`_normalized_rows` (``gw``, ``xhat: (R, n)``, ``rstd: (R, 1)``):
    ``rstd * (gw - mean(gw) - xhat * mean(gw * xhat))``, from two row sums."""
    n = gw.shape[-1]
    mean_g = ieee_divide(_row_sum(steps, gw, [-1]), n).unsqueeze(-1)
    mean_gx = ieee_divide(_row_sum(steps, gw * xhat, [-1]), n).unsqueeze(-1)
    return (gw - mean_g).sub_(xhat * mean_gx).mul_(rstd)  # in place, the same order


@_decomposes(aten.native_layer_norm.default)
def layer_norm(steps: Steps, x, normalized_shape, weight, bias, eps):  # noqa: ANN001, ANN201
    """Layer norm of ``x: (*B, *S)`` over ``S = normalized_shape``; weight and bias are ``S``-shaped or None.
    Returns ``(out: (*B, *S), mean, rstd: (*B, 1, ..., 1))`` (biased variance, as torch).

    Two-pass statistics from two row sums (``(*B)`` each): the mean, then the squared deviations from it.
    """
    rows, n = _rows(x, normalized_shape)
    out, mean, rstd = _normalized_rows(steps, rows, eps)
    if weight is not None:
        out.mul_(weight.reshape(n))
    if bias is not None:
        out.add_(bias.reshape(n))
    stats = _stats_shape(x, normalized_shape)
    return out.reshape(x.shape), mean.reshape(stats), rstd.reshape(stats)


@_decomposes(aten.native_layer_norm_backward.default)
def layer_norm_backward(  # noqa: ANN201
    steps: Steps,
    grad_out,
    x,
    normalized_shape,
    mean,
    rstd,
    weight,
    bias,
    output_mask,  # noqa: ANN001
):
    """Gradients of :func:`layer_norm`: ``(grad_x: (*B, *S), grad_weight: S, grad_bias: S)``, None where
    masked. ``grad_x = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))`` with ``gw = grad_out * weight``:
    two row sums; the parameter gradients are sums over all rows."""
    g, n = _rows(grad_out, normalized_shape)
    stats = [*g.shape[:-1], 1]
    rstd = rstd.reshape(stats)
    xhat = (_rows(x, normalized_shape)[0] - mean.reshape(stats)).mul_(rstd)
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        gw = g if weight is None else g * weight.reshape(n)
        grad_x = _normalized_rows_backward(steps, gw, xhat, rstd).reshape(x.shape)
    batch = list(range(g.dim() - 1))
    if output_mask[1]:
        grad_w = _row_sum(steps, g * xhat, batch).reshape(weight.shape)
    if output_mask[2]:
        grad_b = _row_sum(steps, g, batch).reshape(bias.shape)
    return grad_x, grad_w, grad_b


@_decomposes(aten.native_group_norm.default)
def group_norm(steps: Steps, x, weight, bias, n, c, hxw, groups, eps):  # noqa: ANN001, ANN201
    """Group norm of ``x: (N, C, *S)`` (``hxw = prod(S)``) over each sample's ``groups`` groups of
    ``C / groups`` channels: :func:`layer_norm`'s row statistics over rows ``(N * groups, C / groups * hxw)``,
    then a per-channel affine (``weight``, ``bias``: ``(C,)`` or None). Returns ``(out, mean, rstd)``, the
    statistics ``(N, groups)``.

    As one op, its backward's input gradient cancels to rounding noise where the incoming gradient is
    constant over a group (one channel a group, then global average pooling): measured at the result's own
    scale the profiles disagreed by up to 27 of the largest threshold a log can take (2**-4, where it was
    cut without a word), and the replay diverged. Written out, only row and channel sums are logged."""
    xhat, mean, rstd = _normalized_rows(steps, x.reshape(n * groups, -1), eps)
    out = xhat.reshape(n, c, hxw)
    if weight is not None:
        out.mul_(weight.reshape(1, c, 1))
    if bias is not None:
        out.add_(bias.reshape(1, c, 1))
    return out.reshape(x.shape), mean.reshape(n, groups), rstd.reshape(n, groups)


@_decomposes(aten.native_group_norm_backward.default)
def group_norm_backward(  # noqa: ANN201
    steps: Steps,
    grad_out,
    x,
    mean,
    rstd,
    weight,
    n,
    c,
    hxw,
    groups,
    output_mask,  # noqa: ANN001
):
    """Gradients of :func:`group_norm`: ``(grad_x: (N, C, *S), grad_weight: (C,), grad_bias: (C,))``, None where
    masked: the input gradient as :func:`layer_norm_backward`'s over the groups' rows, the parameter
    gradients as channel sums over the batch and space."""
    g = grad_out.reshape(n, c, hxw)
    rows_rstd = rstd.reshape(-1, 1)
    xhat = (x.reshape(n * groups, -1) - mean.reshape(-1, 1)).mul_(rows_rstd).reshape(n, c, hxw)
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        gw = g if weight is None else g * weight.reshape(1, c, 1)
        rows = (gw.reshape(n * groups, -1), xhat.reshape(n * groups, -1))
        grad_x = _normalized_rows_backward(steps, *rows, rows_rstd).reshape(x.shape)
    if output_mask[1]:
        grad_w = steps.sum(g * xhat, [0, 2])
    if output_mask[2]:
        grad_b = steps.sum(g, [0, 2])
    return grad_x, grad_w, grad_b


@_decomposes(aten._softmax.default, rounding=False)
def softmax(steps: Steps, x, dim, half_to_float):  # noqa: ANN001, ANN201, ARG001
    """``exp(x - max) / sum(exp(x - max))`` along ``dim``, shape of ``x``. The max is exact in any order
    and ``x - max`` one correctly rounded subtraction; the sum is a reduction to ``x.shape`` without ``dim``.

    The rounding mode does not decompose it (the profiles compute it with this formula): as one op it is
    elementwise, logged at each element's own scale (its error is relative: the sum of positive terms is),
    and almost never logged. Decomposed, the rounded sum of exponentials lands on exact FP32 ties
    (``1 + e`` of a causal row's first two terms) and is logged at its head's scale: the tiny transformer's
    log grew from 419 to 467 entries a step, GPT-2 tiny's from 937 to 1015."""
    dim %= x.dim()
    e = steps.exp(x - x.amax(dim, keepdim=True))
    return e / _row_sum(steps, e, [dim]).unsqueeze(dim)


@_decomposes(aten._softmax_backward_data.default)
def softmax_backward(steps: Steps, grad_output, output, dim, input_dtype):  # noqa: ANN001, ANN201, ARG001
    """Input gradient of ``output = softmax(x, dim)``: ``y * g - y * sum(y * g, dim)``, shape of ``g``. Both
    products are of FP32-grid factors, exact in FP64; the difference is one correctly rounded subtraction."""
    dim %= output.dim()
    yg = output * grad_output
    return yg.sub_(output * _row_sum(steps, yg, [dim]).unsqueeze(dim))  # in place: yg is summed already
