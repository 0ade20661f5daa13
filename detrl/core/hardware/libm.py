"""Another libm (``emulated:pairwise``): transcendental results an FP64 ulp or two away, and GELU and the
backwards of GELU and SiLU written another way (their FP64 results a few ulps of their arguments away). The
perturbation itself is in :mod:`~detrl.core.hardware.machinery`, since the row kernels' ``exp`` and ``log``
share it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from detrl.core.dispatch import bound_arguments
from detrl.core.hardware.machinery import _EXACT_POWERS, _libm_dtype, _perturb_
from detrl.core.hardware.profiles import _LIBM_ONLY, EmulatedProfile, Handler, _register, aten


def _libm_handler(
    x_arg: int, through_arg: int, exact: Callable[[list[Any], Tensor], Tensor] | None = None
) -> Handler:
    """A handler that runs the op natively and, with the profile's libm, perturbs its (first) result.

    ``x_arg`` is the argument the function is evaluated at; a result equal to argument ``through_arg`` (the
    input itself, or the incoming gradient of a backward op) is a pass-through that every libm gets exactly
    (``gelu(x) = x`` for large ``x``, ``sin(x) = x`` for tiny ``x``), and so is a result at ``x = 0``.
    ``exact(bound_args, x)`` marks further elements computed without the libm (``elu`` for ``x > 0``).
    """

    def handler(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        bound = bound_arguments(func, args, kwargs)
        x = bound[x_arg]
        if not p.libm or not _libm_dtype(x):
            return func(*args, **kwargs)
        in_place = func._schema.arguments[0].alias_info is not None
        x0 = x.clone() if in_place else x  # an in-place op overwrites the input we compare against
        through = x0 if through_arg == x_arg else bound[through_arg]
        out = func(*args, **kwargs)
        result = out[0] if isinstance(out, tuple) else out
        if not _libm_dtype(result) or result.dtype != x.dtype:
            return out
        keep = (x0 == 0) | (result == through)
        if exact is not None:
            keep |= exact(bound, x0)
        _perturb_(result, keep)
        return out

    return handler


def _register_libm(*ops: OpOverload) -> Callable[[Handler], Handler]:
    """Register the emulation of ``ops`` as another libm's alone (:data:`_LIBM_ONLY`): a profile without one
    runs them natively, and says it does not reorder them."""
    _LIBM_ONLY.update(ops)
    return _register(*ops)


def _overloads(*names: str) -> list[OpOverload]:
    """The functional and in-place ``.default`` overloads of the named ops that exist in this torch."""
    return [
        getattr(aten, n).default
        for n in names
        if hasattr(aten, n) and "default" in getattr(aten, n).overloads()
    ]


_UNARY = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf", "erfc", "erfinv",
          "sin", "cos", "tan", "rsqrt", "silu", "mish", "log_sigmoid_forward")  # fmt: skip
_register_libm(*_overloads(*_UNARY, *(n + "_" for n in _UNARY)))(_libm_handler(0, 0))


# GELU and the backwards of GELU and SiLU, in FP64, written as another library may write them. torch computes
# GELU's Phi(x) as (1 + erf(x / sqrt 2)) / 2, which cancels for x < -3, and each backward as g times two terms
# that cancel (near x = -0.75 and x = -1.28). Written without those subtractions (erfc, a sigmoid, SiLU's
# backward expanded), the results agree with torch's to some ulps of |x| or |g| (tens at most: torch's own
# tanh-approximate backward is up to 21 off), not of the result: in GELU's tail and near the cancelling points
# they round to other float32 values, as a GPU library's do. So a replay on this profile shows the hazard that
# rules revision 11 logs (revision 10 missed it). An ulp or two of the result, as for the other functions,
# would never show it. float32 keeps that perturbation.
_SQRT_2 = math.sqrt(2.0)
_SQRT_2_PI = math.sqrt(2.0 * math.pi)
_TANH_SCALE = math.sqrt(2.0 / math.pi)  # GELU's tanh approximation: u = sqrt(2 / pi) (x + 0.044715 x**3)
_TANH_CUBE = 0.044715


def _gelu_written_another_way(x: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":  # (1 + tanh(u)) / 2 = sigmoid(2u)
        return x * torch.sigmoid(2.0 * _TANH_SCALE * (x + _TANH_CUBE * x**3))
    return x * (0.5 * torch.erfc(-x / _SQRT_2))


def _gelu_backward_written_another_way(g: Tensor, x: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":  # s + 2 x s (1 - s) u', with s = sigmoid(2u) and 1 - s = sigmoid(-2u)
        z = 2.0 * _TANH_SCALE * (x + _TANH_CUBE * x**3)
        s = torch.sigmoid(z)
        return g * (s + 2.0 * x * s * torch.sigmoid(-z) * _TANH_SCALE * (1.0 + 3.0 * _TANH_CUBE * x * x))
    return g * (0.5 * torch.erfc(-x / _SQRT_2) + x * torch.exp(-0.5 * x * x) / _SQRT_2_PI)


def _silu_backward_written_another_way(g: Tensor, x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return g * (s + x * s * torch.sigmoid(-x))  # 1 - s = sigmoid(-x), without its cancellation


def _formula_handler(x_arg: int, through_arg: int, another: Callable[..., Tensor]) -> Handler:
    """A handler that, with the profile's libm, computes an FP64 op by ``another(*bound_args)`` (its other
    arguments: the incoming gradient, ``approximate``), keeping the native result where x or the gradient is
    not finite, at x = 0 and where it passes argument ``through_arg`` through unchanged (``gelu(x) = x`` for
    large x): every library gets those alike. float32 and profiles without a libm: :func:`_libm_handler`."""
    perturbed = _libm_handler(x_arg, through_arg)

    def handler(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        bound = bound_arguments(func, args, kwargs)
        x = bound[x_arg]
        if not p.libm or not isinstance(x, Tensor) or x.dtype != torch.float64 or x.layout != torch.strided:
            return perturbed(p, func, args, kwargs)
        in_place = func._schema.arguments[0].alias_info is not None
        x0 = x.clone() if in_place else x
        through = x0 if through_arg == x_arg else bound[through_arg]
        theirs = another(*(x0 if i == x_arg else a for i, a in enumerate(bound)))
        out = func(*args, **kwargs)
        if out.dtype != torch.float64 or theirs.shape != out.shape:
            return out
        same = (x0 == 0) | (out == through) | ~torch.isfinite(x0) | ~torch.isfinite(through)
        return out.copy_(torch.where(same, out, theirs))

    return handler


_register_libm(*_overloads("gelu", "gelu_"))(_formula_handler(0, 0, _gelu_written_another_way))
_register_libm(*_overloads("gelu_backward"))(_formula_handler(1, 0, _gelu_backward_written_another_way))
_register_libm(*_overloads("silu_backward"))(_formula_handler(1, 0, _silu_backward_written_another_way))
# elu(x, alpha, scale, input_scale): scale * x for x > 0 (a product); softplus(x, beta, threshold) and its
# backward: x (resp. the gradient) once beta * x > threshold. No libm call there.
_register_libm(*_overloads("elu", "elu_"))(_libm_handler(0, 0, lambda b, x: x > 0))
_register_libm(*_overloads("softplus"))(_libm_handler(0, 0, lambda b, x: x * b[1] > b[2]))
_register_libm(*_overloads("softplus_backward"))(_libm_handler(1, 0, lambda b, x: x * b[2] > b[3]))


@_register_libm(
    aten.pow.Tensor_Scalar, aten.pow_.Scalar, aten.pow.Tensor_Tensor, aten.pow_.Tensor, aten.pow.Scalar
)
def _pow_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``pow`` with the profile's libm, except where kernels use exact IEEE operations (:data:`_EXACT_POWERS`)
    or the result is exact (``1 ** y``, ``x ** 0``, and integer powers of a scalar base such as ``2 ** k``)."""
    base, exponent = bound_arguments(func, args, kwargs)
    if not p.libm:
        return func(*args, **kwargs)
    if isinstance(exponent, Tensor):
        x = exponent if not isinstance(base, Tensor) else base
        if not _libm_dtype(x):
            return func(*args, **kwargs)
        x0 = base.clone() if isinstance(base, Tensor) and func is aten.pow_.Tensor else base
        powers = torch.tensor(_EXACT_POWERS, dtype=exponent.dtype, device=exponent.device)
        exact = torch.isin(exponent, powers)
        if isinstance(x0, Tensor):
            exact = exact | (x0 == 1)
        else:  # a scalar base: exact for integer exponents (2 ** k) and for base 1
            exact = exact | (exponent == exponent.round()) | (x0 == 1)
        out = func(*args, **kwargs)
        return _perturb_(out, exact) if _libm_dtype(out) else out
    if not _libm_dtype(base) or float(exponent) in _EXACT_POWERS:
        return func(*args, **kwargs)
    x0 = base.clone() if func is aten.pow_.Scalar else base
    out = func(*args, **kwargs)
    return _perturb_(out, x0 == 1) if _libm_dtype(out) else out
