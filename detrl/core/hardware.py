"""Hardware profiles: emulate hardware that computes in a different (but mathematically equal) order.

We have no GPU fleet in CI, yet the interesting question is what happens to training when the *same*
program runs on hardware whose kernels sum the terms of a reduction in another order, or whose math library
returns other last bits.  Floating-point addition is not associative, so such hardware returns results that
are mathematically equal to the native ones but differ in their last bits.  A :class:`Profile` computes one
aten op the way such hardware would; :class:`HardwareMode` applies a profile to every op run under it.

Profiles (see :func:`get_profile`):

``native``
    Plain torch: the op is called unchanged.
``emulated:splitk``
    Split-K: the reduced axis is cut into contiguous chunks of 45 elements (24 input channels for
    convolutions, 3 samples for the batch reduction of weight gradients, 3 elements of a row) -- odd sizes,
    so the chunk boundaries do not line up with the power-of-two blocking of native kernels -- each chunk is
    reduced by the native kernel and the partial results are accumulated left to right.
``emulated:reversed``
    The reduced axis is flipped and then cut into chunks of 64 (16 channels, 2 samples, 4 row elements)
    accumulated left to right; i.e. the chunks of the original axis are accumulated last to first and the
    native kernel also walks each chunk backwards.
``emulated:pairwise``
    GPU-like: chunks of 32 (8 channels, 1 sample, 2 row elements) whose partials are summed by a balanced
    binary tree, as warp shuffles do; and *another libm*: every transcendental result (exp, exp2, expm1,
    log, log2, log10, log1p, tanh, sigmoid, erf, erfc, erfinv, sin, cos, tan, rsqrt, pow, and the
    activations built on them: gelu, silu, mish, elu, softplus, log-sigmoid, with the backward kernels of
    gelu, silu and softplus) moves by 0, 1 or 2 FP64 ulps (float32: ulps of float32), picked by a hash of
    the result's own bits -- a pure function of the input, as a libm is -- while results every libm gets
    exactly stay (``exp(0) = 1``, saturated ``+-1``, pass-throughs such as ``gelu(x) = x``, the branches of
    elu and softplus that call no libm, and ``pow`` exponents kernels compute with IEEE operations: 0,
    0.5, 1, 2, 3, -1, -2).  ``sqrt`` and division are correctly rounded by IEEE 754 and never move.  The
    libm rides on this profile rather than one of its own: a GPU differs in both ways at once, and
    calibration (which reruns every op under each profile) and the replay matrices keep four profiles.
``emulated:atomic``
    Like GPU kernels that accumulate with atomics: every call draws a *fresh* random permutation of the
    reduced axis, cuts it into chunks of 64 (16 channels, 1 sample, 4 row elements) and accumulates them in
    that order.  The permutations come from a ``torch.Generator`` seeded from ``os.urandom`` when the
    profile is created, so two runs with all seeds fixed still differ (pass ``seed`` for reproducible tests).
``cuda``
    Alias of ``native`` for running on a CUDA device; only available when one is present.

To bound the Python overhead a reduction is never cut into more than :data:`MAX_PIECES` chunks: for
longer axes the chunk grows to the smallest multiple of the base size that fits (e.g. a K of 4608 under
``splitk`` uses 26 chunks of 180, the last one shorter).  Reductions too short for two chunks run natively.

Emulated ops (float32 and float64 everywhere, half types where noted; any device):

* Matrix products and convolutions, half types too (accumulated in float32, rounded once at the end):
  ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``convolution`` (split over input channels, within each group),
  ``convolution_backward`` (grad_input split over output channels, grad_weight / grad_bias over the batch).
* ``sum`` and ``mean``; batch norm forward and backward in training mode (per-channel sums in profile order,
  :mod:`detrl.core.decompose`).
* Rows, recomputed from their textbook formulas with every sum in the profile's row order (the ``"row"``
  chunk) and pairwise's libm: layer norm and group norm, forward (two-pass mean and variance where native
  kernels use Welford's update, which leaves an ulp of error in the mean that a two-pass sum of FP32-grid
  values does not) and backward (the row sums of
  the input gradient; the weight and bias gradients summed over rows); ``_softmax``, ``_log_softmax`` and
  their backward (the max is exact in any order, the sum of exponentials is not); layer norm, softmax and
  their backward from the formulas in :mod:`detrl.core.decompose`, as batch norm; ``nll_loss`` and
  ``nll_loss2d`` with ``sum``/``mean`` reduction (cross-entropy is log-softmax plus NLL), and their backward
  (which sums nothing: only the class weight's product is taken in another order); ``embedding_dense_backward``
  (each index's duplicate rows ranked in the profile's order of the occurrences, cut into row chunks and
  combined in plan order, every add to distinct rows so no device's scatter-add order enters);
  ``linalg_vector_norm``, ``norm`` and ``_foreach_norm`` (``clip_grad_norm_``) for finite non-zero orders.
* Pairwise's libm: the transcendental ops listed above (functional and in-place ``.default`` overloads).

Every other op, ``out=`` overloads, integer/complex dtypes, half types outside matrix products and
convolutions, and non-strided layouts run natively.  In verifiable precision the rounding mode decomposes
batch norm, layer norm and their backward, and the backward of softmax and log-softmax, before a profile
sees them (:mod:`detrl.core.decompose`): their sums and exponentials reach the profile as ``sum`` and ``exp``
ops, the row sums of layer norm and softmax marked (:func:`detrl.core.decompose.summing_rows`) to be ordered in
row chunks.  In float64 the emulated results agree with native to
a few ulps at the result's scale; in float32 most elements of a large reduction differ.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from detrl.core import decompose

__all__ = ["HardwareMode", "MAX_PIECES", "Profile", "EmulatedProfile", "get_profile", "profile_names"]

aten = torch.ops.aten

#: Upper bound on the number of chunks one reduction is cut into (bounds the per-call Python loop).
MAX_PIECES = 32

Unit = Literal["k", "channel", "batch", "row"]
"""What a chunk size counts: elements of a plain reduced axis (matmul K, sum), input/output channels of a
convolution (each worth ``kernel_size`` products), samples of a batch (each worth ``H*W`` products), or
elements of a row reduced inside a normalisation, softmax, loss or norm kernel (GPU kernels give each thread
a few elements of the row and combine the threads' partials by warp shuffles: short chunks)."""


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
    instead of sequential accumulation of the partials; ``libm`` swaps in another math library, whose
    transcendental results differ from the native ones by an FP64 ulp or two (:func:`_perturb_`).
    """

    def __init__(
        self,
        name: str,
        description: str,
        chunks: dict[Unit, int],
        reorder: Literal["none", "reverse", "random"] = "none",
        tree: bool = False,
        seed: int | None = None,
        libm: bool = False,
    ) -> None:
        super().__init__(name, description)
        self.chunks = chunks
        self.reorder = reorder
        self.tree = tree
        self.libm = libm
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
        return Plan(self.order(n, device), pieces, self.tree)

    def order(self, n: int, device: torch.device) -> Tensor | None:
        """The permutation (shape ``(n,)``) this profile applies to ``n`` terms before chunking them; None for
        the identity. ``random`` draws a fresh one on every call."""
        if self.reorder == "reverse":
            return torch.arange(n - 1, -1, -1, device=device)
        if self.reorder == "random":
            return torch.randperm(n, generator=self._generator).to(device)
        return None


def _make_profiles(seed: int | None) -> dict[str, Callable[[], Profile]]:
    return {
        "native": lambda: Profile("native", "plain torch kernels"),
        "emulated:splitk": lambda: EmulatedProfile(
            "emulated:splitk",
            "split-K: chunks of 45 (24 channels, 3 samples, 3 row elements) accumulated in order",
            {"k": 45, "channel": 24, "batch": 3, "row": 3},
        ),
        "emulated:reversed": lambda: EmulatedProfile(
            "emulated:reversed",
            "reduced axis flipped, chunks of 64 (16 channels, 2 samples, 4 row elements) accumulated last to "
            "first",
            {"k": 64, "channel": 16, "batch": 2, "row": 4},
            reorder="reverse",
        ),
        "emulated:pairwise": lambda: EmulatedProfile(
            "emulated:pairwise",
            "GPU-like: chunks of 32 (8 channels, 1 sample, 2 row elements) summed by a pairwise tree; another "
            "libm (transcendental results moved by 1-2 FP64 ulps)",
            {"k": 32, "channel": 8, "batch": 1, "row": 2},
            tree=True,
            libm=True,
        ),
        "emulated:atomic": lambda: EmulatedProfile(
            "emulated:atomic",
            "atomics: fresh random permutation of the reduced axis every call, chunks of 64 (16 channels, "
            "1 sample, 4 row elements) accumulated in order",
            {"k": 64, "channel": 16, "batch": 1, "row": 4},
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
    p: EmulatedProfile,
    x: Tensor,
    dim: list[int] | None,
    keepdim: bool,
    dtype: torch.dtype | None,
    unit: Unit = "k",
) -> Tensor | None:
    """Sum of ``x`` over ``dim`` (None or empty: all dims), in the accumulation dtype; None: run natively.

    The reduced dims are moved last and flattened into one axis of length ``n``, which is then chunked in
    ``unit``'s chunk size; the result has the kept dims (and size-1 reduced dims if ``keepdim``).
    """
    out_dtype = dtype or x.dtype
    if x.dim() == 0 or x.layout != torch.strided or not out_dtype.is_floating_point:
        return None
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    n = math.prod(x.shape[d] for d in dims)
    plan = p.plan(n, unit, x.device)
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
    # A row sum of a decomposed layer norm or softmax (verifiable precision) is ordered as the row kernel it
    # came from would order it: in "row" chunks, not as a plain sum over a long axis.
    out = _sum(p, x, dim, keepdim, dtype, "row" if decompose.summing_rows() else "k")
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
    sums (the formulas live in :mod:`detrl.core.decompose`); inference mode runs natively."""
    if not decompose.applies(func, args) or not _emulable(args[0]):
        return func(*args, **kwargs)

    def channel_sum(t: Tensor, dims: list[int]) -> Tensor:
        total = _sum(p, t, dims, False, None)
        return t.sum(dims) if total is None else total.to(t.dtype)

    return decompose.DECOMPOSITIONS[func](decompose.Steps(channel_sum), *args, **kwargs)


# --------------------------------------------------------------------------------------------------------
# Another libm: transcendental results an FP64 ulp or two away
# --------------------------------------------------------------------------------------------------------

#: How far the emulated libm moves a result, in ulps away from zero (negative: towards zero), picked by three
#: bits of a hash of the result: half the results move, as much as two faithfully rounded libms disagree.
_LIBM_STEPS = (1, 1, -1, 2, 0, 0, 0, 0)
_HASH = -7046029254386353131  # 0x9E3779B97F4A7C15 (Fibonacci hashing) as a signed int64
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32}


def _libm_dtype(t: Any) -> bool:
    """Whether the emulated libm applies to ``t``: a dense float32/float64 tensor (half types are computed
    in float32 and rounded, which hides an ulp of float32 almost always)."""
    return isinstance(t, Tensor) and t.layout == torch.strided and t.dtype in _INT_VIEW


def _perturb_(t: Tensor, exact: Tensor | None = None) -> Tensor:
    """Move each element of ``t`` (in place) by the :data:`_LIBM_STEPS` ulps its own bits hash to.

    A pure function of the value, so the same input gives the same bits every time. ``exact`` (broadcasting
    against ``t``) marks elements a libm returns exactly (``exp(0) = 1``, pass-throughs); they stay, as do
    zeros, subnormals, infinities, NaNs and results of exactly +-1 (saturation: ``tanh``, ``erf`` and
    ``sigmoid`` of large arguments, ``exp`` and ``cos`` of tiny ones, which every libm returns exactly).
    The integer view steps ulps within the binade and across its edges alike: sign-magnitude bits, so
    adding k moves ``|x|`` up by k ulps for either sign.
    """
    bits = t.view(_INT_VIEW[t.dtype])
    select = ((bits.to(torch.int64) * _HASH) >> 61) & 7
    steps = torch.tensor(_LIBM_STEPS, dtype=bits.dtype, device=t.device)[select]
    magnitude = t.abs()
    # ulps away from the FP range's edges: normal numbers, more than 2 ulps below the largest finite one
    ok = (magnitude >= torch.finfo(t.dtype).tiny) & (magnitude < torch.finfo(t.dtype).max / 2)
    ok &= magnitude != 1
    if exact is not None:
        ok &= ~exact
    bits.add_(steps * ok)
    return t


def _exp(p: EmulatedProfile, x: Tensor) -> Tensor:
    """``exp(x)`` with the profile's libm (inside emulated composite kernels: softmax, log-softmax)."""
    out = torch.exp(x)
    return _perturb_(out, x == 0) if p.libm and _libm_dtype(out) else out


def _log(p: EmulatedProfile, x: Tensor) -> Tensor:
    out = torch.log(x)
    return _perturb_(out) if p.libm and _libm_dtype(out) else out  # log(1) = 0: zeros stay anyway


def _rsqrt(p: EmulatedProfile, x: Tensor) -> Tensor:
    """``1 / sqrt(x)``: two correctly rounded ops natively; a GPU's rsqrt instruction with the libm."""
    return _perturb_(torch.rsqrt(x)) if p.libm and _libm_dtype(x) else 1.0 / torch.sqrt(x)


def _pow(p: EmulatedProfile, x: Tensor, exponent: float) -> Tensor:
    out = torch.pow(x, exponent)
    if p.libm and _libm_dtype(out) and exponent not in _EXACT_POWERS:
        _perturb_(out, x == 1)
    return out


#: Exponents that CPU and CUDA kernels compute with correctly rounded IEEE operations instead of ``pow``
#: (``sqrt``, ``x * x``, ``x * x * x``, ``1 / x``, ``1 / (x * x)``) or that give exact results.
_EXACT_POWERS = (0.0, 0.5, 1.0, 2.0, 3.0, -1.0, -2.0)


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
        bound = _bind(func, args, kwargs)
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


def _overloads(*names: str) -> list[OpOverload]:
    """The functional and in-place ``.default`` overloads of the named ops that exist in this torch."""
    return [
        getattr(aten, n).default
        for n in names
        if hasattr(aten, n) and "default" in getattr(aten, n).overloads()
    ]


_UNARY = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf", "erfc", "erfinv",
          "sin", "cos", "tan", "rsqrt", "silu", "gelu", "mish", "log_sigmoid_forward")  # fmt: skip
_register(*_overloads(*_UNARY, *(n + "_" for n in _UNARY)))(_libm_handler(0, 0))
_register(*_overloads("gelu_backward", "silu_backward"))(_libm_handler(1, 0))
# elu(x, alpha, scale, input_scale): scale * x for x > 0 (a product); softplus(x, beta, threshold) and its
# backward: x (resp. the gradient) once beta * x > threshold. No libm call there.
_register(*_overloads("elu", "elu_"))(_libm_handler(0, 0, lambda b, x: x > 0))
_register(*_overloads("softplus"))(_libm_handler(0, 0, lambda b, x: x * b[1] > b[2]))
_register(*_overloads("softplus_backward"))(_libm_handler(1, 0, lambda b, x: x * b[2] > b[3]))


@_register(
    aten.pow.Tensor_Scalar, aten.pow_.Scalar, aten.pow.Tensor_Tensor, aten.pow_.Tensor, aten.pow.Scalar
)
def _pow_op(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``pow`` with the profile's libm, except where kernels use exact IEEE operations (:data:`_EXACT_POWERS`)
    or the result is exact (``1 ** y``, ``x ** 0``, and integer powers of a scalar base such as ``2 ** k``)."""
    base, exponent = _bind(func, args, kwargs)
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


# --------------------------------------------------------------------------------------------------------
# Rows: layer norm, group norm, softmax, log-softmax, NLL loss, embedding backward, vector norms
# --------------------------------------------------------------------------------------------------------
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


def _normalize(p: EmulatedProfile, rows: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Two-pass statistics of ``rows: (M, n)``: ``(xhat: (M, n), mean: (M, 1), rstd: (M, 1))``.

    Native kernels (CPU and CUDA) use Welford's update; the two-pass formula is the same mathematics in
    another order, as another kernel is. (On FP32-grid rows the two-pass mean is often exact where
    Welford's is an ulp off: exact FP32 ties that the recorder and the replayer round apart.)
    """
    n = rows.shape[1]
    mean = _reduce(p, rows, [1]) / n
    centred = rows - mean
    var = _reduce(p, centred * centred, [1]) / n
    rstd = _rsqrt(p, var + eps)
    return centred * rstd, mean, rstd


def _normalize_backward(p: EmulatedProfile, g: Tensor, xhat: Tensor, rstd: Tensor) -> Tensor:
    """Input gradient of ``xhat = (x - mean) * rstd`` over rows ``(M, n)``, given ``g = dL/dxhat``:
    ``rstd * (g - mean(g) - xhat * mean(g * xhat))``."""
    n = g.shape[1]
    return (g - _reduce(p, g, [1]) / n - xhat * (_reduce(p, g * xhat, [1]) / n)) * rstd


@_register(
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten._softmax.default,
    aten._softmax_backward_data.default,
)
def _row_decomposed(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Layer norm and softmax, forward and backward, from their formulas in :mod:`detrl.core.decompose` (two-pass
    layer norm statistics where native kernels use Welford's update, which leaves an ulp of error in the
    mean that a two-pass sum of FP32-grid values does not), with every row sum in the profile's row order,
    ``exp`` and layer norm's ``rsqrt`` from its libm. Where the formula does not apply, and for half types,
    the native kernel runs. (In verifiable precision the rounding mode decomposes all but softmax forward
    before a profile sees them; their row sums reach :func:`_sum_op`, which orders them the same way.)"""
    bound = tuple(_bind(func, args, kwargs))
    if not decompose.formula_applies(func, bound) or not _rows(*(t for t in bound if isinstance(t, Tensor))):
        return func(*args, **kwargs)
    steps = decompose.Steps(
        lambda t, dims: _reduce(p, t, dims, keepdim=False), lambda t: _exp(p, t), lambda t: _rsqrt(p, t)
    )
    return decompose.FORMULAS[func](steps, *bound)


@_register(aten.native_group_norm.default)
def _group_norm(
    p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict
) -> tuple[Tensor, Tensor, Tensor]:
    """Group norm of ``x: (N, C, *S)`` with ``HxW = prod(S)``: ``(out, mean: (N, G), rstd: (N, G))``;
    weight and bias are ``(C,)``."""
    x, weight, bias, n_, c, hxw, groups, eps = _bind(func, args, kwargs)
    if not _rows(x, weight, bias) or x.numel() == 0:
        return func(*args, **kwargs)
    xhat, mean, rstd = _normalize(p, x.reshape(n_ * groups, -1), eps)
    out = xhat.reshape(n_, c, hxw)
    if weight is not None:
        out = out * weight.reshape(1, c, 1)
    if bias is not None:
        out = out + bias.reshape(1, c, 1)
    return out.reshape(x.shape), mean.reshape(n_, groups), rstd.reshape(n_, groups)


@_register(aten.native_group_norm_backward.default)
def _group_norm_backward(
    p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`_group_norm`: ``(grad_x: (N, C, *S), grad_weight: (C,), grad_bias: (C,))``; the
    parameter gradients sum over the batch and space."""
    go, x, mean, rstd, weight, n_, c, hxw, groups, mask = _bind(func, args, kwargs)
    if not _rows(go, x, mean, rstd, weight) or x.numel() == 0 or (mask[1] and weight is None):
        return func(*args, **kwargs)
    g = go.reshape(n_, c, hxw)
    xhat = ((x.reshape(n_ * groups, -1) - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)).reshape(n_, c, hxw)
    grad_x = grad_w = grad_b = None
    if mask[0]:
        gw = g if weight is None else g * weight.reshape(1, c, 1)
        rows = (gw.reshape(n_ * groups, -1), xhat.reshape(n_ * groups, -1), rstd.reshape(-1, 1))
        grad_x = _normalize_backward(p, *rows).reshape(x.shape)
    if mask[1]:
        grad_w = _reduce(p, g * xhat, [0, 2], keepdim=False)
    if mask[2]:
        grad_b = _reduce(p, g, [0, 2], keepdim=False)
    return grad_x, grad_w, grad_b


@_register(aten._log_softmax.default)
def _log_softmax(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``(x - max) - log(sum(exp(x - max)))`` along ``dim``."""
    x, dim, half_to_float = _bind(func, args, kwargs)
    if half_to_float or not _rows(x) or x.dim() == 0 or x.numel() == 0:
        return func(*args, **kwargs)
    shifted = x - x.amax(dim, keepdim=True)
    return shifted - _log(p, _reduce(p, _exp(p, shifted), [dim]))


@_register(aten._log_softmax_backward_data.default)
def _log_softmax_backward(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``g - exp(y) * sum(g)`` along ``dim``, for ``y = log_softmax(x)``."""
    g, y, dim, input_dtype = _bind(func, args, kwargs)
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
    x, target, weight, reduction, ignore_index = _bind(func, args, kwargs)
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
    g, x, target, weight, reduction, ignore_index, total = _bind(func, args, kwargs)
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
    go, indices, num_weights, padding_idx, scale_grad_by_freq = _bind(func, args, kwargs)
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
        part = torch.zeros(uniq.numel(), g.shape[1], dtype=g.dtype, device=g.device)
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
        isinstance(x, Tensor) and _rows(x) and x.dim() > 0 and x.numel() > 0
        and ord is not None and math.isfinite(float(ord)) and float(ord) != 0
    )  # fmt: skip


@_register(aten.linalg_vector_norm.default)
def _linalg_vector_norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """``linalg_vector_norm(x, ord, dim, keepdim, dtype)`` (``x.norm()`` and ``clip_grad_norm_`` reach it)."""
    x, ord, dim, keepdim, dtype = _bind(func, args, kwargs)
    if dtype is not None and dtype != x.dtype or not _norm_emulable(x, ord):
        return func(*args, **kwargs)
    return _vector_norm(p, x, float(ord), dim, keepdim)


@_register(aten.norm.Scalar, aten.norm.ScalarOpt_dim)
def _norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Tensor:
    """The legacy ``norm(x, p)`` / ``norm(x, p, dim, keepdim)`` overloads (``p = None`` is 2)."""
    bound = _bind(func, args, kwargs)
    x, ord = bound[0], 2 if bound[1] is None else bound[1]
    dim, keepdim = (bound[2], bound[3]) if func is aten.norm.ScalarOpt_dim else (None, False)
    if not _norm_emulable(x, ord):
        return func(*args, **kwargs)
    return _vector_norm(p, x, float(ord), dim, keepdim)


@_register(aten._foreach_norm.Scalar)
def _foreach_norm(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> list[Tensor]:
    """Per-tensor norms of a list (``clip_grad_norm_``'s first step): one 0-dim tensor each."""
    tensors, ord, dtype = _bind(func, args, kwargs)
    if dtype is not None or not all(_norm_emulable(t, ord) for t in tensors):
        return func(*args, **kwargs)
    return [_vector_norm(p, t, float(ord), None, False) for t in tensors]
