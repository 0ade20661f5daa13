"""Another libm: transcendental results an FP64 ulp or two away (``emulated:pairwise``). The perturbation
itself is in :mod:`~detrl.core.hardware.machinery`, since the row kernels' ``exp`` and ``log`` share it."""

from __future__ import annotations

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
          "sin", "cos", "tan", "rsqrt", "silu", "gelu", "mish", "log_sigmoid_forward")  # fmt: skip
_register_libm(*_overloads(*_UNARY, *(n + "_" for n in _UNARY)))(_libm_handler(0, 0))
_register_libm(*_overloads("gelu_backward", "silu_backward"))(_libm_handler(1, 0))
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
