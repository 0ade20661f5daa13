"""Hardware profiles: emulate hardware that reduces in a different (but mathematically equal) order.

We have no GPU fleet in CI, yet the interesting question is what happens to training when the *same*
program runs on hardware whose kernels sum the terms of a reduction in another order.  Floating-point
addition is not associative, so such hardware returns results that are mathematically equal to the
native ones but differ in their last bits.  A :class:`Profile` computes one aten op the way such
hardware would; :class:`HardwareMode` applies a profile to every op run under it.

Profiles (see :func:`get_profile`):

``native``
    Plain torch: the op is called unchanged.
``emulated:splitk``
    Split-K: the reduced axis is cut into contiguous chunks of 45 elements (24 input channels for
    convolutions, 3 samples for the batch reduction of weight gradients) -- odd sizes, so the chunk
    boundaries do not line up with the power-of-two blocking of native kernels -- each chunk is reduced
    by the native kernel and the partial results are accumulated left to right.
``emulated:reversed``
    The reduced axis is flipped and then cut into chunks of 64 (16 channels, 2 samples) accumulated
    left to right; i.e. the chunks of the original axis are accumulated last to first and the native
    kernel also walks each chunk backwards.
``emulated:pairwise``
    Chunks of 32 (8 channels, 1 sample) whose partials are summed by a balanced binary tree.
``emulated:atomic``
    Like GPU kernels that accumulate with atomics: every call draws a *fresh* random permutation of the
    reduced axis, cuts it into chunks of 64 (16 channels, 1 sample) and accumulates them in that order.
    The permutations come from a ``torch.Generator`` seeded from ``os.urandom`` when the profile is
    created, so two runs with all seeds fixed still differ (pass ``seed`` for reproducible tests).
``cuda``
    Alias of ``native`` for running on a CUDA device; only available when one is present.

To bound the Python overhead a reduction is never cut into more than :data:`MAX_PIECES` chunks: for
longer axes the chunk grows to the smallest multiple of the base size that fits (e.g. a K of 4608 under
``splitk`` uses 26 chunks of 180, the last one shorter).  Reductions too short for two chunks run natively.

Emulated ops (all floating dtypes, any device): ``mm``, ``addmm``, ``bmm``, ``baddbmm``,
``convolution`` (split over input channels, within each group), ``convolution_backward`` (grad_input
split over output channels, grad_weight / grad_bias split over the batch), ``sum`` and ``mean``.  float16
and bfloat16 are accumulated in float32 and rounded once at the end.  Every other op, integer/complex
dtypes and non-strided layouts run natively.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from detrl import decompose

__all__ = ["HardwareMode", "MAX_PIECES", "Profile", "EmulatedProfile", "get_profile", "profile_names"]

aten = torch.ops.aten

#: Upper bound on the number of chunks one reduction is cut into (bounds the per-call Python loop).
MAX_PIECES = 32

Unit = Literal["k", "channel", "batch"]
"""What a chunk size counts: elements of a plain reduced axis (matmul K, sum), input/output channels of a
convolution (each worth ``kernel_size`` products), or samples of a batch (each worth ``H*W`` products)."""


# --------------------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------------------


class Profile:
    """A hardware profile; the base class is the native one (every op runs unchanged)."""

    deterministic: bool = True

    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description

    def __call__(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        """Compute aten op ``func(*args, **kwargs)`` under this profile; returns what ``func`` returns."""
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(frozen=True)
class Plan:
    """How to evaluate one reduction over an axis of length ``n``.

    ``perm`` (shape ``(n,)``, or None for the identity) reorders the axis first; ``pieces`` are the
    ``(start, length)`` chunks of the reordered axis, each reduced by the native kernel; the partial results
    are accumulated left to right in ``pieces`` order, or by a balanced tree if ``tree``.
    """

    perm: Tensor | None
    pieces: tuple[tuple[int, int], ...]
    tree: bool


class EmulatedProfile(Profile):
    """A profile that reorders the reductions of the ops in the handler registry.

    ``chunks`` maps each :data:`Unit` to a base chunk size; ``reorder`` says how the reduced axis is permuted
    before chunking (``"none"``, ``"reverse"``, or ``"random"`` -- fresh each call); ``tree`` selects pairwise
    instead of sequential accumulation of the partials.
    """

    def __init__(
        self,
        name: str,
        description: str,
        chunks: dict[Unit, int],
        reorder: Literal["none", "reverse", "random"] = "none",
        tree: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(name, description)
        self.chunks = chunks
        self.reorder = reorder
        self.tree = tree
        self.deterministic = reorder != "random"
        self._generator: torch.Generator | None = None
        if reorder == "random":
            # Seeded from the OS, not from torch's global RNG: fixing every seed of a run must not fix it.
            self._generator = torch.Generator()
            self._generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def reseed(self, seed: int) -> None:
        """Restart the random orders of ``emulated:atomic`` from ``seed`` (calibration's orders are part of
        the bundle: they must repeat in every recording of one config, and after a resume)."""
        if self._generator is not None:
            self._generator.manual_seed(seed)

    def __call__(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(self, func, args, kwargs)

    def plan(self, n: int, unit: Unit, device: torch.device) -> Plan | None:
        """Plan a reduction over ``n`` terms counted in ``unit``; None if it is too short to split."""
        base = self.chunks[unit]
        # Grow the chunk (in multiples of the base size) until at most MAX_PIECES chunks remain.
        chunk = base * max(1, math.ceil(math.ceil(n / MAX_PIECES) / base))
        if n < 2 or chunk >= n:
            return None
        pieces = tuple((start, min(chunk, n - start)) for start in range(0, n, chunk))
        perm: Tensor | None = None
        if self.reorder == "reverse":
            perm = torch.arange(n - 1, -1, -1, device=device)
        elif self.reorder == "random":
            perm = torch.randperm(n, generator=self._generator).to(device)
        return Plan(perm, pieces, self.tree)


def _make_profiles(seed: int | None) -> dict[str, Callable[[], Profile]]:
    return {
        "native": lambda: Profile("native", "plain torch kernels"),
        "emulated:splitk": lambda: EmulatedProfile(
            "emulated:splitk",
            "split-K: chunks of 45 (24 channels, 3 samples) accumulated in order",
            {"k": 45, "channel": 24, "batch": 3},
        ),
        "emulated:reversed": lambda: EmulatedProfile(
            "emulated:reversed",
            "reduced axis flipped, chunks of 64 (16 channels, 2 samples) accumulated last to first",
            {"k": 64, "channel": 16, "batch": 2},
            reorder="reverse",
        ),
        "emulated:pairwise": lambda: EmulatedProfile(
            "emulated:pairwise",
            "chunks of 32 (8 channels, 1 sample) summed by a pairwise tree",
            {"k": 32, "channel": 8, "batch": 1},
            tree=True,
        ),
        "emulated:atomic": lambda: EmulatedProfile(
            "emulated:atomic",
            "atomics: fresh random permutation of the reduced axis every call, chunks of 64 (16 channels, "
            "1 sample) accumulated in order",
            {"k": 64, "channel": 16, "batch": 1},
            reorder="random",
            seed=seed,
        ),
    }


_EMULATED_NAMES = ("native", "emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic")


def profile_names() -> list[str]:
    """Names accepted by :func:`get_profile` on this machine (``cuda`` only when a CUDA device exists)."""
    return list(_EMULATED_NAMES) + (["cuda"] if torch.cuda.is_available() else [])


def get_profile(name: str, seed: int | None = None) -> Profile:
    """Create the profile called ``name``; ``seed`` fixes the random orders of ``emulated:atomic``.

    Raises ValueError for unknown names, and for ``cuda`` when no CUDA device is available.
    """
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("hardware profile 'cuda' needs a CUDA device, but no CUDA device is available")
        return Profile("cuda", "plain torch kernels on a CUDA device")
    factories = _make_profiles(seed)
    if name not in factories:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(_EMULATED_NAMES)}, cuda")
    return factories[name]()


class HardwareMode(TorchDispatchMode):
    """Run every aten op under ``profile`` (forward and, via autograd, backward ops alike)."""

    def __init__(self, profile: Profile) -> None:
        super().__init__()
        self.profile = profile

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The mode is popped while we are in here, so the profile's own torch calls reach the kernels.
        return self.profile(func, args, kwargs or {})


# --------------------------------------------------------------------------------------------------------
# Handler registry and shared machinery
# --------------------------------------------------------------------------------------------------------

Handler = Callable[[EmulatedProfile, OpOverload, tuple, dict], Any]
_HANDLERS: dict[OpOverload, Handler] = {}


def _register(*ops: OpOverload) -> Callable[[Handler], Handler]:
    """Register the decorated function as the emulation of ``ops`` (each op at most once)."""

    def decorate(handler: Handler) -> Handler:
        for op in ops:
            if op in _HANDLERS:
                raise RuntimeError(f"hardware handler for {op} registered twice")
            _HANDLERS[op] = handler
        return handler

    return decorate


def _bind(func: OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """All arguments of ``func`` in schema order, defaults filled in (so handlers need not parse kwargs)."""
    bound = []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound.append(args[i])
        elif arg.name in kwargs:
            bound.append(kwargs[arg.name])
        else:
            bound.append(arg.default_value if arg.has_default_value() else None)
    return bound


def _emulable(*tensors: Tensor) -> bool:
    """Whether we reorder ops on these operands: dense, floating point, one dtype."""
    dtype = tensors[0].dtype
    return all(t.layout == torch.strided and t.dtype == dtype for t in tensors) and dtype.is_floating_point


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype to accumulate partials in: half types would lose far more than native kernels (fp32 inside)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _pieces(t: Tensor, dim: int, groups: int, plan: Plan) -> Iterator[Tensor]:
    """Yield ``t`` restricted to each chunk of ``plan`` along ``dim``.

    ``dim`` holds ``groups`` equal blocks (as channels of a grouped convolution do) and the plan indexes
    positions *within* a block, so each yielded tensor keeps ``groups`` blocks of ``length`` each.
    """
    dim %= t.dim()
    blocked = t.unflatten(dim, (groups, -1))
    if plan.perm is not None:
        blocked = blocked.index_select(dim + 1, plan.perm)
    for start, length in plan.pieces:
        yield blocked.narrow(dim + 1, start, length).flatten(dim, dim + 1)


T = TypeVar("T", Tensor, tuple)


def _add_(acc: T, part: T) -> T:
    """``acc += part`` in place, for a tensor or a tuple of tensors with None entries."""
    if isinstance(acc, Tensor):
        return acc.add_(part)
    return tuple(None if a is None else a.add_(p) for a, p in zip(acc, part, strict=True))


def _combine(plan: Plan, parts: Iterable[T]) -> T:
    """Accumulate the partial results of ``plan``'s chunks (consumed lazily, in plan order).

    Sequential plans add left to right.  Tree plans merge equal-sized subtrees as soon as both exist (a
    binary counter), which is a balanced pairwise tree that keeps only O(log n) partials alive.
    """
    if not plan.tree:
        iterator = iter(parts)
        acc = next(iterator)
        for part in iterator:
            acc = _add_(acc, part)
        return acc
    stack: list[tuple[int, T]] = []  # (number of chunks in subtree, subtree sum), sizes strictly decreasing
    for part in parts:
        size, acc = 1, part
        while stack and stack[-1][0] == size:
            left_size, left = stack.pop()
            size, acc = size + left_size, _add_(left, acc)
        stack.append((size, acc))
    _, acc = stack.pop()
    while stack:
        acc = _add_(stack.pop()[1], acc)
    return acc


# --------------------------------------------------------------------------------------------------------
# Matrix products
# --------------------------------------------------------------------------------------------------------


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
    a, b = _bind(func, args, kwargs)
    out = _matmul(p, a, b)
    return func(*args, **kwargs) if out is None else out.to(a.dtype)


@_register(aten.addmm.default, aten.baddbmm.default)
def _addmm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``beta * self + alpha * (m1 @ m2)``; ``self`` broadcasts to ``(M, N)`` / ``(B, M, N)``."""
    self_, m1, m2, beta, alpha = _bind(func, args, kwargs)
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


# --------------------------------------------------------------------------------------------------------
# Convolutions
# --------------------------------------------------------------------------------------------------------


@_register(aten.convolution.default)
def _convolution(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """Convolution ``x: (N, C_in, *S) -> (N, C_out, *S')``, split over the input channels of each group.

    weight is ``(C_out, C_in / G, *k)``, or ``(C_in, C_out / G, *k)`` when transposed; bias ``(C_out,)``.
    """
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = _bind(func, args, kwargs)
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


@_register(aten.convolution_backward.default)
def _convolution_backward(
    p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`_convolution`: ``(grad_input, grad_weight, grad_bias)`` as masked by output_mask.

    grad_input ``(N, C_in, *S)`` reduces over output channels, so it is split over the output channels of
    each group; grad_weight ``(C_out, C_in / G, *k)`` and grad_bias ``(C_out,)`` reduce over the batch (and
    space), so they are split over the batch.
    """
    (go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask) = _bind(
        func, args, kwargs
    )
    if not _emulable(go, x, w):
        return func(*args, **kwargs)
    dtype, acc = x.dtype, _acc_dtype(x.dtype)
    go, x, w = go.to(acc), x.to(acc), w.to(acc)

    def call(go_: Tensor, x_: Tensor, w_: Tensor, mask_: list[bool]) -> tuple:
        sizes = bias_sizes if mask_[2] else None
        return func(go_, x_, w_, sizes, stride, padding, dilation, transposed, output_padding, groups, mask_)

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


# --------------------------------------------------------------------------------------------------------
# Sums and means
# --------------------------------------------------------------------------------------------------------


def _sum(
    p: EmulatedProfile, x: Tensor, dim: list[int] | None, keepdim: bool, dtype: torch.dtype | None
) -> Tensor | None:
    """Sum of ``x`` over ``dim`` (None or empty: all dims), in the accumulation dtype; None: run natively.

    The reduced dims are moved last and flattened into one axis of length ``n``, which is then chunked;
    the result has the kept dims (and size-1 reduced dims if ``keepdim``).
    """
    out_dtype = dtype or x.dtype
    if x.dim() == 0 or x.layout != torch.strided or not out_dtype.is_floating_point:
        return None
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    n = math.prod(x.shape[d] for d in dims)
    plan = p.plan(n, "k", x.device)
    if plan is None:
        return None
    flat = x.to(_acc_dtype(out_dtype)).permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], n)
    out = _combine(plan, (piece.sum(-1) for piece in _pieces(flat, -1, 1, plan)))
    if keepdim:
        out = out.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    return out


@_register(aten.sum.default, aten.sum.dim_IntList)
def _sum_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``sum(x: (*S), dim, keepdim, dtype)``; ``sum.default`` reduces everything to a 0-dim tensor."""
    if func is aten.sum.default:
        (x, dtype), dim, keepdim = _bind(func, args, kwargs), None, False
    else:
        x, dim, keepdim, dtype = _bind(func, args, kwargs)
    out = _sum(p, x, dim, keepdim, dtype)
    return func(*args, **kwargs) if out is None else out.to(dtype or x.dtype)


@_register(aten.mean.default, aten.mean.dim)
def _mean_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``mean(x: (*S), dim, keepdim, dtype)``: the emulated sum divided by the number of reduced terms."""
    if func is aten.mean.default:
        (x, dtype), dim, keepdim = _bind(func, args, kwargs), None, False
    else:
        x, dim, keepdim, dtype = _bind(func, args, kwargs)
    out = _sum(p, x, dim, keepdim, dtype)
    if out is None:
        return func(*args, **kwargs)
    n = x.numel() // max(1, out.numel())  # reduced terms per output element (x.numel() > 0 when emulated)
    return out.div_(n).to(dtype or x.dtype)


@_register(aten.native_batch_norm.default, aten.native_batch_norm_backward.default)
def _batch_norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Batch norm forward and backward in training mode, with per-channel statistics from profile-ordered
    sums (the formulas live in :mod:`detrl.decompose`); inference mode runs natively."""
    if not decompose.applies(func, args) or not _emulable(args[0]):
        return func(*args, **kwargs)

    def channel_sum(t: Tensor, dims: list[int]) -> Tensor:
        total = _sum(p, t, dims, False, None)
        return t.sum(dims) if total is None else total.to(t.dtype)

    return decompose.DECOMPOSITIONS[func](channel_sum, *args, **kwargs)
