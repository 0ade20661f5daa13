"""What the handler families share: binding an op's arguments, cutting a reduced axis into a profile's
chunks and combining the partials in its order."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor
from torch._ops import OpOverload

if TYPE_CHECKING:  # annotations only: nothing here needs the profiles module at run time
    from detrl.core.hardware.profiles import EmulatedProfile, Plan, Unit


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
