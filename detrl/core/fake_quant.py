"""Quantization-aware training's fake quantization, written as ops torch computes in FP64.

``torch.ao.quantization.prepare_qat`` puts a ``FusedMovingAvgObsFakeQuantize`` on each weight and
activation. Its op, ``_fused_moving_avg_obs_fq_helper``, updates the observer's running minimum and maximum
in place, chooses a scale and zero point from them, and rounds its input to that grid. Its CPU kernel
takes float32 state only, and the per-channel fake quantization it calls for weights
(``fake_quantize_per_channel_affine_cachemask``) refuses an FP64 scale: in verifiable precision, where every
floating tensor is FP64, a QAT model failed at its first step; so did learned step sizes (LSQ,
``_LearnableFakeQuantize``), whose backward kernels take float32 only. The rounding mode runs them all as
the functions here (:data:`detrl.core.composites.COMPOSITES`), every op in them an op of the step.

The arithmetic is the kernels', in the same order. The kernels compute in float32, and each op here is
one IEEE operation on float32 values, rounded to FP32 by the mode: ``+ - *`` and a reciprocal rounded once
from FP64 are the float32 results (FP64 holds more than twice float32's precision). So a QAT step here
quantizes to the grid a float32 step would. (One exception: torch's CPU build fuses the LSQ backward's
``(clamp(q) - z) * scale - x`` into a multiply-add, which rounds once; here it rounds twice, and the scale's
gradient can differ from the CPU kernel's by a few ulps.) The scale and zero point are chosen in Python floats
(IEEE double, the same on every machine), as torch's ``ChooseQuantizationParams`` chooses them in C++.
"""

from __future__ import annotations

import math

import numpy as np
import torch

aten = torch.ops.aten

#: torch's least quantization scale (float16's smallest normal): a smaller one is raised to it.
SMALL_SCALE = float(np.float32(6.1e-5))


def _f32(value: float) -> float:
    """``value`` rounded to float32 (to nearest, ties to even; inf past its range), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def choose_qparams(
    low: float, high: float, quant_min: int, quant_max: int, symmetric: bool
) -> tuple[float, int]:
    """The scale (a float32 value) and zero point torch chooses for the observed range ``[low, high]`` (float32
    values) and the integer range ``[quant_min, quant_max]``; ``symmetric`` keeps zero in the middle.

    The steps of torch's ``ChooseQuantizationParams``, each in the precision torch takes it in: float32
    where its C++ variable is a ``float``, double elsewhere. Raises ValueError where ``low > high`` (an
    observer that has seen nothing), as torch does."""
    if not low <= high:
        raise ValueError(f"fake quantization: the observed minimum {low} is above the maximum {high}")
    if low < 0 < high and symmetric:
        span_low, span_high = -((quant_max - quant_min) // 2 + 1), (quant_max - quant_min) // 2
        widest = max(abs(_f32(low / span_low)), abs(_f32(high / span_high)))
        low, high = _f32(widest * span_low), _f32(widest * span_high)
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / (quant_max - quant_min)
    if _f32(scale) == 0.0 or math.isinf(_f32(1.0 / _f32(scale))):
        scale = 0.1
    if scale < SMALL_SCALE:
        below = _f32(scale)
        scale = SMALL_SCALE
        if low == 0.0:
            high = _f32(SMALL_SCALE * (quant_max - quant_min))
        elif high == 0.0:
            low = _f32(-SMALL_SCALE * (quant_max - quant_min))
        else:
            amplifier = _f32(SMALL_SCALE / below)
            low, high = _f32(low * amplifier), _f32(high * amplifier)
    from_min, from_max = quant_min - low / scale, quant_max - high / scale
    error_min, error_max = abs(quant_min) - abs(low / scale), abs(quant_max) - abs(high / scale)
    initial = from_min if error_min < error_max else from_max
    if low < 0 < high and symmetric:
        initial = (quant_min + quant_max) / 2
    if initial < quant_min:
        point = quant_min
    elif initial > quant_max:
        point = quant_max
    else:
        point = round(initial)  # to nearest, ties to even: C's nearbyint
    return _f32(scale), int(point)


def _fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int, quant_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` rounded to the grid of ``scale`` and ``zero_point`` (broadcast against ``x``), clamped to
    ``[quant_min, quant_max]``, and the mask of elements inside it: the kernels' ``zero_point +
    nearbyint(x * (1 / scale))``, then ``(clamp(q) - zero_point) * scale``."""
    point = zero_point.to(x.dtype)
    q = torch.round(x * torch.reciprocal(scale.to(x.dtype))) + point  # round: to nearest, ties to even
    mask = (q >= quant_min) & (q <= quant_max)
    return (q.clamp(quant_min, quant_max) - point) * scale.to(x.dtype), mask


def per_channel(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, quant_min: int, quant_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fake_quantize_per_channel_affine_cachemask``: ``x`` quantized with ``scale[c]`` and
    ``zero_point[c]`` (``(C,)`` each) along ``axis`` (of size ``C``); the output and its mask, ``x``'s
    shape."""
    along = [1] * x.dim()
    along[axis] = -1
    return _fake_quantize(x, scale.reshape(along), zero_point.reshape(along), quant_min, quant_max)


def fused_observe(
    x: torch.Tensor,
    observer_on: torch.Tensor,
    fake_quant_on: torch.Tensor,
    running_min: torch.Tensor,
    running_max: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    averaging_const: float,
    quant_min: int,
    quant_max: int,
    ch_axis: int,
    per_row_fake_quant: bool = False,
    symmetric_quant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_fused_moving_avg_obs_fq_helper``: observe ``x`` (its minimum and maximum, per channel along
    ``ch_axis`` with ``per_row_fake_quant``) into the moving averages ``running_min`` and ``running_max``
    (in place; an infinite one, not yet observed, takes the observation), choose ``scale`` and
    ``zero_point`` from them (in place), and fake-quantize ``x``. ``observer_on`` and ``fake_quant_on``
    (one-element tensors) switch the two halves; with fake quantization off, ``x`` and an all-true mask."""
    if per_row_fake_quant:
        rows = x.movedim(ch_axis, 0).flatten(1)  # (C, the rest)
        if running_min.numel() == 0:  # the first call sizes the observer's state by the channels
            channels = rows.shape[0]
            running_min.resize_(channels).fill_(math.inf)
            running_max.resize_(channels).fill_(-math.inf)
            scale.resize_(channels)
            zero_point.resize_(channels)
        observed = (rows.amin(1), rows.amax(1))
    else:
        observed = (x.amin(), x.amax())
    if int(observer_on.reshape(-1)[0]):
        weight = _f32(averaging_const)  # the kernel's float averaging constant
        for running, now in zip((running_min, running_max), observed, strict=True):
            moved = running + (now.reshape(running.shape) - running) * weight
            running.copy_(torch.where(torch.isinf(running), now.reshape(running.shape), moved))
    if not int(fake_quant_on.reshape(-1)[0]):
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    chosen = [
        choose_qparams(low, high, quant_min, quant_max, symmetric_quant)
        for low, high in zip(running_min.reshape(-1).tolist(), running_max.reshape(-1).tolist(), strict=True)
    ]
    scale.copy_(
        torch.tensor([s for s, _ in chosen], dtype=scale.dtype, device=scale.device).reshape(scale.shape)
    )
    points = torch.tensor([p for _, p in chosen], dtype=zero_point.dtype, device=zero_point.device)
    zero_point.copy_(points.reshape(zero_point.shape))
    if per_row_fake_quant:
        return per_channel(x, scale, zero_point, ch_axis, quant_min, quant_max)
    return _fake_quantize(x, scale.reshape(-1)[:1], zero_point.reshape(-1)[:1], quant_min, quant_max)


def _learned_qparams(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    forward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable per-tensor scale and zero point (one-element float tensors) as torch's kernels take them,
    as ``(1,)`` tensors of ``x``'s dtype: the scale a float32 value; the zero point rounded to nearest in the
    forward, plus a half in the backward, clamped to the range, then truncated to an integer."""
    point = _f32(zero_point.reshape(-1)[0].item())
    point = float(round(point)) if forward else _f32(point + 0.5)
    point = int(min(max(point, float(quant_min)), float(quant_max)))
    scale_value = torch.full((1,), _f32(scale.reshape(-1)[0].item()), dtype=x.dtype, device=x.device)
    return scale_value, torch.full_like(scale_value, point)


def learnable_per_tensor(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    grad_factor: float = 1.0,
) -> torch.Tensor:
    """``_fake_quantize_learnable_per_tensor_affine`` (LSQ): :func:`_fake_quantize` at the learnable scale
    and zero point (one-element tensors; the zero point rounded to nearest and clamped)."""
    scale_value, point = _learned_qparams(x, scale, zero_point, quant_min, quant_max, forward=True)
    return _fake_quantize(x, scale_value, point, quant_min, quant_max)[0]


def _learnable_gradients(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    grad_factor: float,
    point_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LSQ kernels' gradients at each element, before their sums: ``(d x, d scale, d zero point)``, each
    ``x``'s shape; ``scale`` and ``point`` broadcast against ``x``. Inside the range, ``x``'s gradient
    passes and the scale's is ``grad * (x_fq - x) / scale``; outside, the scale's is ``grad`` times the
    distance of the clamped end from the zero point, and the zero point's ``-grad * scale`` (each times
    ``grad_factor``, in the kernels' order of operations). ``point_first``: the per-channel kernel adds the
    zero point before rounding to an integer (a float sum, which can round to a half), the per-tensor one
    after."""
    factor = _f32(grad_factor)
    inverse = torch.reciprocal(scale)
    q = torch.round(point + x * inverse) if point_first else torch.round(x * inverse) + point
    inside = (q >= quant_min) & (q <= quant_max)
    grad_x = grad * inside
    fake = (q.clamp(quant_min, quant_max) - point) * scale
    grad_scale_inside = grad * (fake - x) * inverse * factor
    grad_scale_outside = (
        torch.where(q < quant_min, grad * (quant_min - point), grad * (quant_max - point)) * factor
    )
    grad_scale = torch.where(inside, grad_scale_inside, grad_scale_outside)
    grad_point = torch.where(inside, torch.zeros_like(grad), grad * -1 * scale * factor)
    return grad_x, grad_scale, grad_point


def learnable_per_tensor_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    grad_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_fake_quantize_learnable_per_tensor_affine_backward``: ``x``'s gradient, and the scale's and zero
    point's, each the sum of its per-element gradients (``(1,)`` each)."""
    scale_value, point = _learned_qparams(x, scale, zero_point, quant_min, quant_max, forward=False)
    grad_x, grad_scale, grad_point = _learnable_gradients(
        grad, x, scale_value, point, quant_min, quant_max, grad_factor, False
    )
    return (
        grad_x,
        grad_scale.sum().unsqueeze(0).to(scale.dtype),
        grad_point.sum().unsqueeze(0).to(zero_point.dtype),
    )


def _rounded_points(zero_point: torch.Tensor, quant_min: int, quant_max: int) -> torch.Tensor:
    """Learnable per-channel zero points as torch's kernels take them: rounded to nearest, clamped."""
    return torch.round(zero_point).clamp(quant_min, quant_max)


def learnable_per_channel(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    grad_factor: float = 1.0,
) -> torch.Tensor:
    """``_fake_quantize_learnable_per_channel_affine`` (LSQ per channel): :func:`per_channel` at the learnable
    scales and the rounded zero points."""
    points = _rounded_points(zero_point, quant_min, quant_max)
    return per_channel(x, scale, points, axis, quant_min, quant_max)[0]


def learnable_per_channel_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    grad_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_fake_quantize_learnable_per_channel_affine_backward``: ``x``'s gradient, and each channel's scale
    and zero point gradient (``(C,)``), summed over every dim but ``axis``."""
    along = [1] * x.dim()
    along[axis] = -1
    points = _rounded_points(zero_point, quant_min, quant_max).to(x.dtype).reshape(along)
    grad_x, grad_scale, grad_point = _learnable_gradients(
        grad, x, scale.to(x.dtype).reshape(along), points, quant_min, quant_max, grad_factor, True
    )
    others = [d for d in range(x.dim()) if d != axis]
    return grad_x, grad_scale.sum(others).to(scale.dtype), grad_point.sum(others).to(zero_point.dtype)


#: The fake quantizations torch has no FP64 kernel for, by overload: what the rounding mode runs instead.
COMPOSITES = {
    aten._fused_moving_avg_obs_fq_helper.default: fused_observe,
    aten.fake_quantize_per_channel_affine_cachemask.default: per_channel,
    aten._fake_quantize_learnable_per_tensor_affine.default: learnable_per_tensor,
    aten._fake_quantize_learnable_per_tensor_affine_backward.default: learnable_per_tensor_backward,
    aten._fake_quantize_learnable_per_channel_affine.default: learnable_per_channel,
    aten._fake_quantize_learnable_per_channel_affine_backward.default: learnable_per_channel_backward,
}
