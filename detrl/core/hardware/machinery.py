"""What the handler families share (beside ``dispatch.bound_arguments``, which reads an op's arguments):
cutting a reduced axis into a profile's chunks and combining the partials in its order, and the emulated
libm's perturbation (the libm family's handlers and the row kernels' ``exp``, ``log``, ``rsqrt`` and ``pow``
apply it)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only: nothing here needs the profiles module at run time
    from detrl.core.hardware.profiles import EmulatedProfile, Plan, Unit


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


def _emulable(*tensors: Tensor) -> bool:
    """Whether we reorder ops on these operands: dense, floating point, one dtype."""
    dtype = tensors[0].dtype
    return all(t.layout == torch.strided and t.dtype == dtype for t in tensors) and dtype.is_floating_point


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype to accumulate partials in: half types would lose far more than native kernels (fp32 inside)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _gathered(t: Tensor, dim: int, perm: Tensor) -> Tensor:
    """``t.index_select(dim, perm)``, contiguous like it, by ``gather`` where ``dim`` is not the first: the
    same values in the same layout (so the same bits downstream), and about twice as fast off the first
    dim, where index_select copies element by element."""
    if dim == 0 or t.numel() == 0:
        return t.index_select(dim, perm)
    shape = [1] * t.dim()
    shape[dim] = -1
    return t.gather(dim, perm.view(shape).expand(*t.shape[:dim], -1, *t.shape[dim + 1 :])).contiguous()


def _reordered(t: Tensor, dim: int, groups: int, plan: Plan) -> Tensor:
    """``t`` with ``dim`` unflattened into ``(groups, block)`` and each block reordered as ``plan`` says (a
    flip or a permutation, contiguous; else ``t`` as it is): the chunks of the plan are then consecutive
    along ``dim + 1`` (``dim`` counted from the front)."""
    dim %= t.dim()
    blocked = t.unflatten(dim, (groups, -1))
    if plan.reverse:
        return blocked.flip(dim + 1).contiguous()
    if plan.perm is not None:
        return _gathered(blocked, dim + 1, plan.perm)
    return blocked


def _pieces(t: Tensor, dim: int, groups: int, plan: Plan) -> Iterator[Tensor]:
    """Yield ``t`` restricted to each chunk of ``plan`` along ``dim``.

    ``dim`` holds ``groups`` equal blocks (as channels of a grouped convolution do) and the plan indexes
    positions *within* a block, so each yielded tensor keeps ``groups`` blocks of ``length`` each.
    """
    dim %= t.dim()
    blocked = _reordered(t, dim, groups, plan)
    for start, length in plan.pieces:
        yield blocked.narrow(dim + 1, start, length).flatten(dim, dim + 1)


def _chunk_sums(t: Tensor, plan: Plan) -> Tensor | None:
    """The sum over the last dim of each chunk of ``plan`` (``t: (*kept, n)``, in the profile's order),
    stacked in plan order: ``(chunks, *kept)``; None where ``t`` is not a CPU tensor contiguous along that
    dim (then :func:`_sum` sums a chunk a call).

    The chunks of equal length (all but maybe the last) are summed in one call over a ``(*kept, chunks,
    length)`` view: each sums its own contiguous elements as a call of its own does, the same bits
    (``tests/test_hardware.py`` holds them equal), in one call where there were up to 32."""
    chunk = plan.pieces[0][1]
    equal = sum(1 for _, length in plan.pieces if length == chunk)
    if not t.is_cpu or t.stride(-1) != 1 or equal < 2:
        return None
    heads = t.narrow(-1, 0, equal * chunk).unflatten(-1, (equal, chunk)).sum(-1).movedim(-1, 0)
    if equal == len(plan.pieces):
        return heads.contiguous()
    start, length = plan.pieces[-1]
    return torch.cat([heads, t.narrow(-1, start, length).sum(-1).unsqueeze(0)])


def _accumulated(parts: Tensor, tree: bool) -> Tensor:
    """:func:`_combine` of ``parts: (chunks, *kept)`` along dim 0, in fewer calls and the same bits.

    A tree adds neighbours level by level, an odd one out carried up: the tree :func:`_combine` builds (a
    binary counter) for every count of chunks. In order: ``cumsum`` adds left to right in the dtype for
    float64 on the CPU (the other dtypes accumulate in another there), starting from +0.0 where the first
    chunk is the start: the two differ only where every chunk's sum is -0.0."""
    if tree:
        while parts.shape[0] > 1:
            half = parts.shape[0] // 2
            pairs = parts[0 : 2 * half : 2] + parts[1 : 2 * half : 2]
            parts = torch.cat([pairs, parts[2 * half :]]) if parts.shape[0] % 2 else pairs
        return parts[0]
    if parts.dtype == torch.float64 and parts.is_cpu:
        total = parts.cumsum(0)[-1]
        all_negative_zero = ((parts == 0) & parts.signbit()).all(0)
        return torch.where(all_negative_zero, -0.0, total) if bool(all_negative_zero.any()) else total
    acc = parts[0].clone()
    for part in parts[1:]:
        acc.add_(part)
    return acc


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
    ordered = _reordered(flat, -1, 1, plan).flatten(-2)
    parts = _chunk_sums(ordered, plan)
    if parts is None:
        out = _combine(plan, (ordered.narrow(-1, start, length).sum(-1) for start, length in plan.pieces))
    else:
        out = _accumulated(parts, plan.tree)
    if keepdim:
        out = out.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    return out
