"""Random ops inside a step draw from a switchboard stream, never from a device RNG.

:class:`StreamRandomMode` is a dispatch mode with one job: it sees every aten op tagged
``nondeterministic_seeded`` (dropout, bernoulli, rand, randn, randperm, uniform_, normal_, ...), draws the
randomness on the host from the given stream's CPU generator, and moves the result to the op's device. A
CPU run and a GPU run therefore draw identical masks. A seeded random op without a handler is an error:
silently falling back to the device RNG would break replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from detrl.core.dispatch import EagerDispatchMode, registrar

aten = torch.ops.aten
_HANDLERS: dict[Any, Callable[..., Any]] = {}


_handles = registrar(_HANDLERS, "random-op handler")


@_handles(aten.native_dropout.default)
def _native_dropout(g: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    x, p, train = args[0], float(args[1]), args[2]
    if train is False or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = torch.empty(x.shape, dtype=torch.float64).bernoulli_(1.0 - p, generator=g)
    mask = keep.to(device=x.device, dtype=torch.bool)
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    return x * mask * scale, mask


@_handles(aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default, aten.normal_.default)
@_handles(aten.exponential_.default, aten.random_.default, getattr(aten.random_, "from"), aten.random_.to)
@_handles(aten.cauchy_.default, aten.geometric_.default, aten.log_normal_.default)
def _inplace(g: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    # Fill a CPU twin from the stream, then copy into the (possibly device) tensor.
    target = args[0]
    rest = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args[1:])
    twin = torch.empty(target.shape, dtype=target.dtype)
    func(twin, *rest, **{**kwargs, "generator": g})
    return target.copy_(twin)


@_handles(
    aten.rand.default, aten.randn.default, aten.randperm.default, aten.randint.low, aten.randint.default
)
@_handles(aten.rand.generator, aten.randn.generator, aten.randperm.generator, aten.normal.float_float)
def _factory(g: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    # Call the public factory (torch.rand, torch.randint, torch.normal(mean, std, size), ...) on the CPU with
    # the stream's generator.
    public = getattr(torch, func.overloadpacket.__name__)
    dtype = kwargs.get("dtype")
    out = public(*args, generator=g, **({"dtype": dtype} if dtype is not None else {}))
    return out.to(kwargs.get("device") or "cpu")


@_handles(aten.randint_like.default, aten.randint_like.low_dtype, aten.randint_like.Tensor)
def _randint_like(g: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.randint_like(x, [low,] high)``: integers drawn on the CPU in ``x``'s shape (``high`` may be
    a 0-d tensor), in ``x``'s dtype and device unless the call names others."""
    x, bounds = args[0], [int(b) for b in args[1:]]
    low, high = (0, bounds[0]) if len(bounds) == 1 else bounds
    dtype = kwargs.get("dtype") or x.dtype
    return torch.randint(low, high, x.shape, generator=g, dtype=dtype).to(kwargs.get("device") or x.device)


@_handles(aten.rand_like.default, aten.randn_like.default)
def _like(g: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dtype = kwargs.get("dtype") or x.dtype
    device = kwargs.get("device") or x.device
    base = torch.rand if func is aten.rand_like.default else torch.randn
    return base(x.shape, dtype=dtype, generator=g).to(device)


@_handles(aten.bernoulli.default, aten.bernoulli.p)
@_handles(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
@_handles(aten.multinomial.default, aten.poisson.default, aten._standard_gamma.default, aten.binomial.default)
@_handles(aten.uniform.default, aten.exponential.default, aten.cauchy.default)
@_handles(aten.geometric.default, aten.log_normal.default)
@_handles(
    aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default, aten.rrelu_with_noise_functional.default
)
def _on_cpu(g: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    """Any random op with a ``generator`` argument (``bernoulli(p)``, ``torch.normal(mean, std)``,
    ``multinomial``, ``poisson``, gamma and binomial draws, ``rrelu_with_noise``, ...): run on CPU copies of
    its tensor arguments with the stream's generator. The arguments it writes (``rrelu_with_noise``'s noise,
    an in-place op's self) get the CPU results back, and its new results move to its tensors' device."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    out = func(*cpu, **{**kwargs, "generator": g})
    for arg, twin, spec in zip(args, cpu, func._schema.arguments):
        if twin is not arg and spec.alias_info is not None and spec.alias_info.is_write:
            arg.copy_(twin)
    if func._schema.returns and func._schema.returns[0].alias_info is not None:
        return args[0]  # an in-place op returns its (written) self
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)


Handler = Callable[[torch.Generator, Any, tuple, dict], Any]


def draws_randomness(func: Any) -> bool:
    """Whether ``func`` is a random op: it has a handler here, or torch tags it as seeded."""
    return func in _HANDLERS or torch.Tag.nondeterministic_seeded in func.tags


def handler_for(func: Any, args: tuple, kwargs: dict) -> Handler | None:
    """The handler that draws ``func``'s randomness from a stream, or None for an op that needs no stream
    (it is not random, or names its generator explicitly: an already chosen stream).

    Raises RuntimeError for a seeded random op without a handler: silently falling back to the device RNG
    would break replay."""
    if kwargs.get("generator") is not None:
        return None
    handler = _HANDLERS.get(func)
    if handler is None and torch.Tag.nondeterministic_seeded in func.tags and draws_now(func, args, kwargs):
        raise RuntimeError(
            f"random op {func} has no switchboard stream in detrl; it would draw from the device RNG "
            "and break replay (add a handler in detrl/core/randomness.py)"
        )
    return handler


#: Arguments that switch a seeded op's randomness off: a dropout probability of 0, or eval mode.
_OFF_WHEN_ZERO = ("dropout_p", "dropout")
_OFF_WHEN_FALSE = ("train", "training")


def draws_now(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether seeded op ``func`` draws randomness with these arguments. torch tags an op as seeded when it
    *can* draw: fused attention (``_scaled_dot_product_flash_attention_for_cpu``, ...) and the RNN ops do
    only for a dropout probability above 0 in training; with ``dropout_p=0`` they are plain arithmetic."""
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        if arg.name in _OFF_WHEN_ZERO and isinstance(value, (int, float)) and value == 0:
            return False
        if arg.name in _OFF_WHEN_FALSE and value is False:
            return False
    return True


class StreamRandomMode(EagerDispatchMode):
    """Route seeded random aten ops to the CPU generator ``generator`` (a switchboard stream).

    In verifiable precision the rounding mode routes them itself (:class:`detrl.core.rounding.RoundingMode`'s
    ``random``), through the same :func:`handler_for`: a second dispatch mode costs every op of a step
    about 10 microseconds."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        handler = handler_for(func, args, kwargs)
        if handler is not None:
            return handler(self.generator, func, args, kwargs)
        return func(*args, **kwargs)
