"""Ops torch computes only in float32 and narrower types, written as ops it computes in FP64 too.

Verifiable precision computes every op in FP64. A few aten ops have no FP64 kernel at all: the rounding
mode runs each of those as the ops below, every one an op of the step (computed under the profile, rounded
and logged by its own rule), so that the model that calls it records and replays like any other.

``_grouped_mm`` is the one so far: the mixture-of-experts layers of Hugging Face's Mixtral, Qwen2-MoE and
their kin call it (``torch.nn.functional.grouped_mm``) for every expert's tokens at once, and its backward
calls it again. Its CPU kernel takes float32 and half types only.

Quantization-aware training's observer, per-channel fake quantization and learned step sizes (LSQ) are
more: their CPU kernels take float32 state, scales or gradients only (:mod:`detrl.core.fake_quant` writes
them out).

``_efficientzerotensor`` is here for a kindred reason: its result is a "zero tensor" that holds no memory
(autograd makes one for a gradient known to be zero: ``torch.sgn``'s backward on real values), which the
rounding, like every kernel reading its data, cannot read. Inside a step it is ``torch.zeros``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from detrl.core import fake_quant

aten = torch.ops.aten


def _group_bounds(offs: torch.Tensor | None, length: int, what: str) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each group: ``offs[g]`` ends group ``g`` (increasing, at most ``length``)."""
    if offs is None or offs.dim() != 1:
        raise ValueError(f"grouped_mm: {what} needs offs, a 1-d tensor of group ends")
    ends = offs.tolist()
    bounds, start = [], 0
    for end in ends:
        if not start <= end <= length:
            raise ValueError(f"grouped_mm: offs must increase and stay within {length}, got {ends}")
        bounds.append((start, end))
        start = end
    return bounds


def grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch._grouped_mm`` as one matrix product per group (``addmm`` where there is a bias: rounded once,
    as the fused kernel's epilogue adds it). The four forms, ``G`` groups:

    - ``a: (M, K)``, ``b: (G, K, N)``: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]`` -> ``(M, N)``; rows
      past ``offs[-1]`` are zero (torch leaves them unwritten);
    - ``a: (G, M, K)``, ``b: (K, N)``: ``a[g]`` times columns ``offs[g-1]:offs[g]`` of ``b`` -> ``(M, N)``;
    - ``a: (M, K)``, ``b: (K, N)``: the ``K`` columns and rows ``offs[g-1]:offs[g]`` -> ``(G, M, N)`` (an
      expert's weight gradient);
    - ``a: (G, M, K)``, ``b: (G, K, N)``, no ``offs``: a batched product -> ``(G, M, N)``.

    ``bias``: ``(G, N)``, group ``g``'s row added to its results.
    """
    dims = (mat_a.dim(), mat_b.dim())

    def product(g: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b) if bias is None else torch.addmm(bias[g], a, b)

    if dims == (3, 3):
        out = torch.bmm(mat_a, mat_b) if bias is None else torch.baddbmm(bias.unsqueeze(1), mat_a, mat_b)
    elif dims == (2, 3):
        bounds = _group_bounds(offs, mat_a.shape[0], "a 2-d mat_a with a 3-d mat_b")
        pieces = [product(g, mat_a[s:e], mat_b[g]) for g, (s, e) in enumerate(bounds)]
        tail = mat_a.shape[0] - (bounds[-1][1] if bounds else 0)
        pieces.append(mat_a.new_zeros(tail, mat_b.shape[2]))
        out = torch.cat(pieces)
    elif dims == (3, 2):
        bounds = _group_bounds(offs, mat_b.shape[1], "a 3-d mat_a with a 2-d mat_b")
        pieces = [product(g, mat_a[g], mat_b[:, s:e]) for g, (s, e) in enumerate(bounds)]
        tail = mat_b.shape[1] - (bounds[-1][1] if bounds else 0)
        pieces.append(mat_a.new_zeros(mat_a.shape[1], tail))
        out = torch.cat(pieces, dim=1)
    elif dims == (2, 2):
        bounds = _group_bounds(offs, mat_a.shape[1], "2-d mat_a and mat_b")
        out = torch.stack([product(g, mat_a[:, s:e], mat_b[s:e]) for g, (s, e) in enumerate(bounds)])
    else:
        raise ValueError(f"grouped_mm takes 2-d or 3-d operands, not {mat_a.dim()}-d and {mat_b.dim()}-d")
    return out if out_dtype is None or out_dtype == out.dtype else out.to(out_dtype)


#: The ops written out here, by overload: what the rounding mode runs in their place.
def zeros(
    size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> Any:
    """``aten._efficientzerotensor`` as ``torch.zeros``: the same values, in memory."""
    return torch.zeros(size, dtype=dtype, layout=layout, device=device, pin_memory=bool(pin_memory))


COMPOSITES: dict[Any, Callable[..., torch.Tensor]] = {aten._efficientzerotensor.default: zeros}
if hasattr(aten, "_grouped_mm"):  # torch 2.8+
    COMPOSITES[aten._grouped_mm.default] = grouped_mm
COMPOSITES.update(fake_quant.COMPOSITES)
