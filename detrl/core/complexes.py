"""Complex tensors in a verifiable step: each value a pair of real ones, rounded and logged as such.

Verifiable precision rounds real FP64 results to the FP32 grid. A complex128 value is two FP64 numbers
(``torch.view_as_real``), and a complex64 one two FP32 numbers, so complex tensors fit the same scheme:
complex64 is a narrow type (an island, :mod:`detrl.core.islands`, computed on complex128 twins), and a
complex128 result is on the grid when both its parts are. Models use them for rotary position embeddings
(``torch.polar`` and ``view_as_complex``, as Meta's Llama and Hugging Face's Llama 4 write them) and for
Fourier mixing (FNet, Autoformer, spectral convolutions).

The rounding mode sends every op with a complex argument here (``RoundingMode._complex``; the native
route hands such ops to the mode), and each falls in one of three groups:

- **Exact** (:data:`EXACT`): ops that move or copy values (``clone``, ``cat``, ``copy_``, casts,
  conjugation), and ``+`` and ``-``, one IEEE operation per part, whose FP64 result is the same on every
  machine. Their results are rounded to the FP32 grid with nothing to log.
- **Written out** (:data:`WRITTEN`, and :data:`COMPOSITES` for ops whose arguments are real): ops whose
  FP64 result differs between machines, as real ops of the step, each computed under the hardware
  profile, rounded and logged by its own rule.

  - A matrix product is one real product of block matrices
    (``[a_re | a_im] @ [[b_re, b_im], [-b_im, b_re]]``: each output is one sum of ``2K`` exact products).
  - An FFT library orders its butterflies its own way, so a transform is written out too: radix-2
    butterflies while the length is even, each a product by a twiddle and a sum of two terms, every one
    an op of the step that every machine computes alike (``O(n log n)``, nothing to log); an odd length
    left over is a discrete Fourier transform as one real product with a table of twiddles (``O(n^2)``
    along it, its sums logged where near). The twiddles' cosines and sines are ops of the step too.
  - A product's parts are ``ac - bd`` and ``ad + bc``: four products and two sums of the step, each
    rounded, as a float32 complex product without fused multiply-adds computes them (a machine that
    fuses would round ``ac - bd`` once where another rounds three times, unless every operand is on the
    FP32 grid: a Python complex constant is not).
  - Division, absolute value, sign, ``exp``, ``log``, ``angle``, vector norms and sums follow their
    definitions; ``addmm`` and its kin are the product, scaled and summed op by op.
- **Refused**: anything else (``UnroundableResult`` names the op): its FP64 result might differ between
  machines, and no rule here says how.

Views (``view_as_real``, ``view_as_complex``, ``real``, slicing) never reach this module: they move
nothing. The conjugate bit that ``conj()`` sets is resolved (an exact negation) before a written-out op
reads a tensor's parts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten


def _overloads(*items: Any) -> frozenset[Any]:
    """Every overload of each packet, and each overload given as one."""
    found: set[Any] = set()
    for p in items:
        found.update([p] if isinstance(p, torch._ops.OpOverload) else (getattr(p, n) for n in p.overloads()))
    return frozenset(found)


def _packets(*names: str) -> list[Any]:
    """The aten packets of ``names`` that this torch has (some are newer than torch 2.4)."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


#: Ops whose complex results every machine computes alike (see the module docstring): rounded exactly.
EXACT = _overloads(
    aten.add, aten.add_, aten.sub, aten.sub_, aten.rsub, aten.neg, aten.neg_,
    aten.conj_physical, aten.conj_physical_, aten._conj_physical, aten.resolve_conj, aten.resolve_neg,
    aten.clone, aten.copy_, aten._to_copy, aten.cat, aten.stack, aten.new_zeros, aten.new_empty,
    aten.new_empty_strided, aten.new_full, aten.zeros_like, aten.empty_like, aten.ones_like, aten.full_like,
    aten.zeros, aten.empty, aten.full, aten.fill_, aten.zero_, aten.slice_backward, aten.select_backward,
    aten.index_select, aten.index, aten.gather, aten.masked_fill, aten.masked_fill_, aten.where,
    aten.constant_pad_nd, aten.repeat, aten.flip, aten.roll, aten.eq, aten.ne, aten.isnan, aten.isfinite,
    aten.empty_strided, aten.lift_fresh, aten.lift_fresh_copy, aten._unsafe_view, aten.contiguous,
    *_packets(
        "scalar_tensor", "eye", "fill", "empty_permuted", "narrow_copy", "view_copy", "rot90", "block_diag",
        "diagonal_scatter", "as_strided_scatter", "select_scatter", "slice_scatter", "index_fill", "index_fill_",
        "_chunk_cat", "_unsafe_masked_index", "nonzero", "nonzero_static", "isinf", "all", "any",
        "count_nonzero", "logical_not", "logical_and", "logical_or", "logical_xor", "equal", "masked_scatter",
        "masked_scatter_", "index_copy", "index_copy_", "tril", "triu", "diag_embed", "unfold_copy",
        "index_put", "index_put_", "_index_put_impl_", "put", "put_",
    ),
    aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value,
)  # fmt: skip

#: EXACT ops that add what they put when ``accumulate`` is true (argument 3): the sums are written out then.
_ACCUMULATING = _overloads(*_packets("index_put", "index_put_", "_index_put_impl_", "put", "put_"))


def _accumulates(func: Any, args: tuple, kwargs: dict) -> bool:
    return func in _ACCUMULATING and bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))


def exact_call(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` called with ``args`` and ``kwargs`` is in :data:`EXACT`: ``add``/``sub`` only with
    ``alpha`` 1 (``a + alpha * b`` rounds twice), index puts only without ``accumulate``."""
    return func in EXACT and kwargs.get("alpha", 1) == 1 and not _accumulates(func, args, kwargs)


class NoRule(Exception):
    """Raised by a written-out op for a call it has no rule for (a complex ``alpha``, a fractional power):
    the rounding mode refuses the op, as for an op with no rule at all."""


# ----------------------------------------------------------------------------------------------- parts
def parts(x: Any) -> tuple[Any, Any]:
    """``(real, imaginary)`` of a tensor or number: views of a complex tensor's parts (its conjugate bit
    resolved first), ``(x, None)`` for a real one."""
    if isinstance(x, torch.Tensor):
        if not x.is_complex():
            return x, None
        pair = torch.view_as_real(x.resolve_conj())
        return pair[..., 0], pair[..., 1]
    if isinstance(x, complex):
        return x.real, x.imag
    return x, None


def assemble(re: torch.Tensor, im: torch.Tensor | None) -> torch.Tensor:
    """The complex tensor of parts ``re`` and ``im`` (None: zero), broadcast to one shape."""
    if im is None:
        im = torch.zeros_like(re)
    shape = torch.broadcast_shapes(re.shape, im.shape)
    return torch.view_as_complex(torch.stack([re.expand(shape), im.expand(shape)], -1))


# ------------------------------------------------------------------------------------- ops written out
def polar(abs: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's names
    """``abs * (cos(angle) + i sin(angle))``."""
    return assemble(abs * torch.cos(angle), abs * torch.sin(angle))


def complex_(real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
    """``torch.complex(real, imag)``."""
    return assemble(real, imag)


def mul(a: Any, b: Any) -> torch.Tensor:
    """``a * b``: ``(ac - bd) + i (ad + bc)``, or part by part where one factor is real."""
    ar, ai = parts(a)
    br, bi = parts(b)
    if ai is None:
        return assemble(ar * br, ar * bi)
    if bi is None:
        return assemble(ar * br, ai * br)
    return assemble(ar * br - ai * bi, ar * bi + ai * br)


def div(a: Any, b: Any, rounding_mode: str | None = None) -> torch.Tensor:
    """``a / b``: by a real ``b`` part by part; by a complex one, ``a * conj(b) / |b|^2``."""
    if rounding_mode is not None:
        raise TypeError("div with a rounding mode takes real tensors")
    ar, ai = parts(a)
    br, bi = parts(b)
    if bi is None:
        return assemble(ar / br, None if ai is None else ai / br)
    norm = br * br + bi * bi
    if ai is None:
        return assemble(ar * br / norm, -(ar * bi) / norm)
    return assemble((ar * br + ai * bi) / norm, (ai * br - ar * bi) / norm)


def reciprocal(z: torch.Tensor) -> torch.Tensor:
    """``1 / z``."""
    return div(1.0, z)


def abs_(z: torch.Tensor) -> torch.Tensor:
    """``|z| = sqrt(re^2 + im^2)``: squares exact in FP64, the sum and the root correctly rounded."""
    re, im = parts(z)
    return torch.sqrt(re * re + im * im)


def sgn(z: torch.Tensor) -> torch.Tensor:
    """``z / |z|``, 0 where ``z`` is 0."""
    re, im = parts(z)
    size = torch.sqrt(re * re + im * im)
    zero = size == 0
    safe = torch.where(zero, torch.ones_like(size), size)
    return assemble(torch.where(zero, 0.0, re / safe), torch.where(zero, 0.0, im / safe))


def exp(z: torch.Tensor) -> torch.Tensor:
    """``exp(re) * (cos(im) + i sin(im))``."""
    re, im = parts(z)
    size = torch.exp(re)
    return assemble(size * torch.cos(im), size * torch.sin(im))


def _real_dims(z: torch.Tensor, dim: Any) -> list[int]:
    dims = range(z.dim()) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else dim
    return [d % z.dim() for d in ([dims] if isinstance(dims, int) else dims)]


def sum_(z: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    """The sum of each part (over ``dim``; all dims when None or empty; a 0-d ``z`` is its own sum)."""
    pair = torch.view_as_real(z.resolve_conj())
    if z.dim() == 0:  # (an empty dim list would sum the pair's own axis)
        return torch.view_as_complex(pair.clone())
    total = pair.sum(_real_dims(z, dim), keepdim=keepdim)
    return torch.view_as_complex(total.contiguous())


def mean(z: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    """The mean of each part (over ``dim``; all dims when None or empty; a 0-d ``z`` is its own mean)."""
    pair = torch.view_as_real(z.resolve_conj())
    if z.dim() == 0:
        return torch.view_as_complex(pair.clone())
    return torch.view_as_complex(pair.mean(_real_dims(z, dim), keepdim=keepdim).contiguous())


def _part(x: Any, k: int) -> Any:
    """Part ``k`` (0 real, 1 imaginary) of one argument of a partwise op: a complex tensor's, a real float
    tensor's (its imaginary part is zeros), a complex dtype's real dtype; anything else as it is."""
    if isinstance(x, torch.Tensor) and x.is_complex():
        return parts(x)[k]
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x if k == 0 else torch.zeros_like(x)
    if isinstance(x, torch.dtype) and x.is_complex:
        return x.to_real()
    if isinstance(x, complex):
        raise NoRule
    return x


def partwise(func: Any) -> Callable[..., torch.Tensor]:
    """``func`` on the real parts, then on the imaginary parts, each a real op of the step with its own rule:
    for ops linear in every float argument at once (cumulative sums, traces, adding at indices), whose parts
    do not mix. A complex number among the arguments (``alpha``) would mix them: no rule."""

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        leaves, spec = tree_flatten((args, kwargs))
        halves = []
        for k in (0, 1):
            part_args, part_kwargs = tree_unflatten([_part(x, k) for x in leaves], spec)
            halves.append(func(*part_args, **part_kwargs))
        return assemble(halves[0], halves[1])

    return run


def _index_put_impl(
    self: torch.Tensor, indices: Any, values: Any, accumulate: bool = False, unsafe: bool = False
) -> torch.Tensor:
    """``_index_put_impl_`` (behind ``index_put_(..., accumulate=True)``): ``index_put`` part by part."""
    return self.copy_(partwise(aten.index_put.default)(self, indices, values, accumulate))


def pow_(z: Any, exponent: Any) -> torch.Tensor:
    """``z ** n`` for an integer ``n``: products by squaring, highest bit first (a fixed sequence of written
    products); ``1 / z ** -n`` for a negative one. Another exponent: no rule."""
    if isinstance(z, torch.Tensor) and not z.is_complex() or isinstance(exponent, torch.Tensor):
        raise NoRule  # a complex exponent, or a tensor of them
    if isinstance(exponent, complex) or float(exponent) != int(exponent):
        raise NoRule
    n = int(exponent)
    if n == 0:
        return torch.ones_like(z)
    result = z
    for bit in bin(abs(n))[3:]:
        result = mul(result, result)
        if bit == "1":
            result = mul(result, z)
    return reciprocal(result) if n < 0 else result


def _product(a: Any, b: Any, matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``a @ b`` of complex (or one real) batched matrices ``(..., M, K) @ (..., K, N)``: one real product
    ``[a_re | a_im] @ [[b_re, b_im], [-b_im, b_re]]`` of shape ``(..., M, 2N)``, each output one sum of
    ``2K`` exact products; with a real operand, one product with the other's parts side by side."""
    ar, ai = parts(a)
    br, bi = parts(b)
    n = b.shape[-1]
    if ai is None:  # real a: a @ [b_re | b_im]
        out = matmul(ar, torch.cat([br, bi], -1))
    elif bi is None:  # real b: [a_re; a_im] stacked on rows
        m = a.shape[-2]
        out = matmul(torch.cat([ar, ai], -2), br)
        return assemble(out[..., :m, :], out[..., m:, :])
    else:
        left = torch.cat([ar, ai], -1)
        right = torch.cat([torch.cat([br, bi], -1), torch.cat([-bi, br], -1)], -2)
        out = matmul(left, right)
    return assemble(out[..., :n], out[..., n:])


def mm(a: Any, b: Any) -> torch.Tensor:
    """``torch.mm`` with a complex operand."""
    return _product(a, b, torch.mm)


def bmm(a: Any, b: Any) -> torch.Tensor:
    """``torch.bmm`` with a complex operand."""
    return _product(a, b, torch.bmm)


def mv(a: Any, v: Any) -> torch.Tensor:
    """``a @ v`` of a matrix and a vector: the product of ``a`` and one column."""
    return mm(a, v[:, None])[:, 0]


def dot(a: Any, b: Any) -> torch.Tensor:
    """``sum(a * b)`` of two vectors: the product of one row and one column."""
    return mm(a[None, :], b[:, None])[0, 0]


def vdot(a: Any, b: Any) -> torch.Tensor:
    """``sum(conj(a) * b)``."""
    return dot(a.conj() if isinstance(a, torch.Tensor) and a.is_complex() else a, b)


def _plus(self: Any, product: torch.Tensor, beta: Any, alpha: Any) -> torch.Tensor:
    """``beta * self + alpha * product``, each scaling its own product (none where the factor is 1), then
    one sum. With ``beta`` 0, ``self`` is not read (its NaNs do not propagate), as torch defines it."""
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return (self if beta == 1 else self * beta) + product


def addmm(self: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * self + alpha * (a @ b)``: a linear layer with complex weights (``F.linear`` with a bias)."""
    return _plus(self, mm(a, b), beta, alpha)


def addmv(self: Any, a: Any, v: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * self + alpha * (a @ v)``."""
    return _plus(self, mv(a, v), beta, alpha)


def baddbmm(self: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * self + alpha * (a @ b)`` of batches of matrices."""
    return _plus(self, bmm(a, b), beta, alpha)


def addbmm(self: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * self + alpha * sum over the batch of (a @ b)``."""
    return _plus(self, sum_(bmm(a, b), [0]), beta, alpha)


def addr(self: Any, v: Any, w: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * self + alpha * outer(v, w)``: the product of a column and a row."""
    return _plus(self, mm(v[:, None], w[None, :]), beta, alpha)


def angle(z: torch.Tensor) -> torch.Tensor:
    """The argument of ``z``, ``atan2(im, re)`` (a real op of the step, logged as elementwise)."""
    re, im = parts(z)
    return torch.atan2(im, re)


def log(z: torch.Tensor) -> torch.Tensor:
    """The principal logarithm, ``log |z| + i angle(z)``."""
    return assemble(torch.log(abs_(z)), angle(z))


def vector_norm(
    z: torch.Tensor,
    ord: Any = 2,  # noqa: A002 - torch's name
    dim: Any = None,
    keepdim: bool = False,
    *,
    dtype: Any = None,
) -> torch.Tensor:
    """``torch.linalg.vector_norm`` of complex values: the norm of their absolute values, whatever the order."""
    if dtype is not None:  # a complex dtype= names the result's real dtype by its width
        dtype = torch.float64 if dtype in (torch.complex128, torch.float64) else torch.float32
    return torch.linalg.vector_norm(abs_(z), ord, dim, keepdim, dtype=dtype)


# ------------------------------------------------------------------------------------ Fourier transforms
#: The most twiddles one product's table holds (FP64 entries): longer transforms take their outputs in blocks.
TABLE_ENTRIES = 1 << 22


def _twiddles(
    n: int, j: torch.Tensor, k: torch.Tensor, sign: float, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sign * sin)`` of ``2 pi j k / n`` for the integer tensors ``j`` and ``k`` (broadcast), on the
    FP32 grid: ops of the step, rounded and logged.

    The angle of ``r = j k mod n`` is folded to ``min(r, n - r)`` (in ``[0, pi]``) so that it rounds to
    FP32 with a small error, and the quarter turns take their exact values (``cos(pi / 2)`` in floating
    point is ``6e-17``, not 0): the transform of a real constant has an imaginary part of exactly 0."""
    r = (j * k) % n
    folded = torch.minimum(r, n - r)
    angle = folded.to(like.dtype) * (2 * math.pi / n)
    cos, sin = torch.cos(angle), torch.sin(angle)
    sin = torch.where(r > n - r, -sin, sin)  # sin(2 pi - x) = -sin(x)
    quarter = (4 * r) % n == 0  # r = 0, n/4, n/2, 3n/4: cos and sin are -1, 0 or 1
    turn = ((4 * r) // n).clamp(max=3)
    exact_cos = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=like.dtype, device=like.device)[turn]
    exact_sin = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=like.dtype, device=like.device)[turn]
    cos = torch.where(quarter, exact_cos, cos)
    sin = torch.where(quarter, exact_sin, sin)
    return cos, sin * sign


def _last(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    return None if x is None else x.movedim(d, -1)


def _along(
    re: torch.Tensor, im: torch.Tensor | None, d: int, fn: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``fn(re, im) -> (re, im)`` along dim ``d`` (moved last and back)."""
    out_re, out_im = fn(_last(re, d), _last(im, d))
    return out_re.movedim(-1, d), out_im.movedim(-1, d)


def _transform(re: torch.Tensor, im: torch.Tensor | None, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``X_k = sum_j x_j exp(sign * 2 pi i j k / n)`` for every ``k < n`` along the last dim (length ``n``)
    of ``x = re + i im`` (``im`` None: real).

    Radix 2, decimation in time, one level at a time: with ``n = 2^s * m`` (``m`` odd), the ``2^s``
    interleaved subsequences ``x[p::2^s]`` (in bit-reversed order of ``p``: the leaves of splitting into
    even and odd terms ``s`` times) are transformed first, each of length ``m`` (as one product,
    :func:`_product_dft`, whose sums are logged where near; nothing for ``m = 1``). Then each level joins
    neighbouring pairs, the transforms ``E`` and ``O`` of a sequence's even and odd terms:
    ``X_k = E_k + w^k O_k`` and ``X_{k + L} = E_k - w^k O_k``, ``w = exp(sign * 2 pi i / 2L)``. Those are
    products and sums of two terms, ops of the step that every machine computes alike (nothing to log),
    about a dozen ops a level for the whole batch: ``O(n log n)`` work in ``s`` levels."""
    n = re.shape[-1]
    lead = re.shape[:-1]
    groups = n & -n  # 2^s, the largest power of two dividing n
    length = n // groups  # m
    order = torch.tensor(_bit_reversed(groups), device=re.device)

    def leaves(x: torch.Tensor) -> torch.Tensor:  # (..., n) -> (..., 2^s, m): row p is x[rev(p)::2^s]
        return x.reshape(*lead, length, groups).transpose(-1, -2).index_select(-2, order)

    re, im = leaves(re), None if im is None else leaves(im)
    if length > 1:
        re, im = _product_dft(re, im, sign)
    elif im is None:
        im = torch.zeros_like(re)
    if groups > 1:
        one, k = torch.ones(1, dtype=torch.long, device=re.device), torch.arange(n // 2, device=re.device)
        cos_n, sin_n = _twiddles(n, one, k, sign, re)  # w_n^k for k < n/2
    while groups > 1:
        groups //= 2
        pairs_re, pairs_im = re.reshape(*lead, groups, 2, length), im.reshape(*lead, groups, 2, length)
        stride = n // (2 * length)  # w_{2L}^k = w_n^(k n / 2L)
        cos, sin = cos_n[::stride], sin_n[::stride]  # (L,)
        (even_re, odd_re), (even_im, odd_im) = pairs_re.unbind(-2), pairs_im.unbind(-2)
        turned_re, turned_im = cos * odd_re - sin * odd_im, cos * odd_im + sin * odd_re
        re = torch.cat([even_re + turned_re, even_re - turned_re], -1)  # (..., groups, 2L)
        im = torch.cat([even_im + turned_im, even_im - turned_im], -1)
        length *= 2
    return re.reshape(*lead, n), im.reshape(*lead, n)


@functools.cache
def _bit_reversed(size: int) -> tuple[int, ...]:
    """The permutation of ``range(size)`` (a power of two) that reverses each index's bits."""
    bits = size.bit_length() - 1
    return tuple(int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(size))


def _product_dft(re: torch.Tensor, im: torch.Tensor | None, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_transform` as one real product with ``[[cos, sin], [-sin, cos]]`` (``[cos | sin]`` for a real
    ``x``): each output is one sum, rounded and logged by the product's rule. Outputs are taken in blocks
    whose tables hold at most :data:`TABLE_ENTRIES` twiddles."""
    n = re.shape[-1]
    j = torch.arange(n, device=re.device).unsqueeze(1)
    width = max(1, TABLE_ENTRIES // (4 * n))
    blocks_re, blocks_im = [], []
    for start in range(0, n, width):
        k = torch.arange(start, min(n, start + width), device=re.device).unsqueeze(0)
        cos, sin = _twiddles(n, j, k, sign, re)  # (n, block)
        if im is None:
            out = _rows_times(re, torch.cat([cos, sin], -1))
        else:
            table = torch.cat([torch.cat([cos, sin], -1), torch.cat([-sin, cos], -1)], -2)
            out = _rows_times(torch.cat([re, im], -1), table)
        blocks_re.append(out[..., : k.shape[1]])
        blocks_im.append(out[..., k.shape[1] :])
    if len(blocks_re) == 1:
        return blocks_re[0], blocks_im[0]
    return torch.cat(blocks_re, -1), torch.cat(blocks_im, -1)


def _rows_times(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix`` for ``x: (..., K)`` and ``matrix: (K, N)``, as one ``mm`` (the op the rounding rules
    know; ``torch.matmul`` called inside the mode reaches it as itself)."""
    return torch.mm(x.reshape(-1, x.shape[-1]), matrix).reshape(*x.shape[:-1], matrix.shape[-1])


def _hermitian(re: torch.Tensor, im: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full spectrum of length ``n`` of a real signal from its first ``n // 2 + 1`` terms (last dim):
    ``X_{n-k} = conj(X_k)``. (The imaginary parts of ``X_0`` and, for even ``n``, ``X_{n/2}`` then reach
    only the imaginary part of the inverse, and torch ignores them too.)"""
    m = n // 2 + 1
    mirrored = slice(1, n - m + 1)
    return (
        torch.cat([re[..., :m], re[..., mirrored].flip(-1)], -1),
        torch.cat([im[..., :m], -im[..., mirrored].flip(-1)], -1),
    )


def _normalise(re: torch.Tensor, im: torch.Tensor | None, normalization: int, n: int) -> Any:
    """torch's ``normalization``: 0 none, 1 by ``1/sqrt(n)``, 2 by ``1/n``."""
    if normalization == 0:
        return re, im
    scale = 1.0 / math.sqrt(n) if normalization == 1 else 1.0 / n
    return re * scale, None if im is None else im * scale


def fft_r2c(x: torch.Tensor, dim: list[int], normalization: int, onesided: bool) -> torch.Tensor:
    """``aten._fft_r2c``: the forward transform of real ``x`` over ``dim`` (the last of them onesided:
    outputs ``k <= n // 2``)."""
    dims = [d % x.dim() for d in dim]
    last = dims[-1]
    n = x.shape[last]
    re, im = _along(x, None, last, lambda r, i: _transform(r, i, -1.0))
    if onesided:
        re, im = re.narrow(last, 0, n // 2 + 1), im.narrow(last, 0, n // 2 + 1)
    for d in dims[:-1]:
        re, im = _along(re, im, d, lambda r, i: _transform(r, i, -1.0))
    re, im = _normalise(re, im, normalization, math.prod(x.shape[d] for d in dims))
    return assemble(re, im)


def fft_c2c(z: torch.Tensor, dim: list[int], normalization: int, forward: bool) -> torch.Tensor:
    """``aten._fft_c2c``: the transform (``forward``) or its unnormalised inverse of complex ``z`` over
    ``dim``."""
    re, im = parts(z)
    sign = -1.0 if forward else 1.0
    dims = [d % z.dim() for d in dim]
    for d in dims:
        re, im = _along(re, im, d, lambda r, i: _transform(r, i, sign))
    re, im = _normalise(re, im, normalization, math.prod(z.shape[d] for d in dims))
    return assemble(re, im)


def fft_c2r(z: torch.Tensor, dim: list[int], normalization: int, last_dim_size: int) -> torch.Tensor:
    """``aten._fft_c2r``: the inverse transform over ``dim`` of a spectrum onesided along the last of them
    (its first ``last_dim_size // 2 + 1`` terms read): real, ``last_dim_size`` long there."""
    re, im = parts(z)
    dims = [d % z.dim() for d in dim]
    for d in dims[:-1]:
        re, im = _along(re, im, d, lambda r, i: _transform(r, i, 1.0))
    last = dims[-1]

    def inverse(r: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _transform(*_hermitian(r, i, last_dim_size), 1.0)

    out, _ = _along(re, im, last, inverse)  # the real part: the inverse of a Hermitian spectrum
    sizes = [last_dim_size if d == last else z.shape[d] for d in dims]
    out, _ = _normalise(out, None, normalization, math.prod(sizes))
    return out


#: Ops whose arguments are real and whose result is complex: always written out (the rounding mode's
#: composites, :mod:`detrl.core.composites`).
COMPOSITES: dict[Any, Callable[..., torch.Tensor]] = {
    aten.polar.default: polar,
    aten.complex.default: complex_,
    aten._fft_r2c.default: fft_r2c,
}

#: Ops written out when an argument is complex (with real ones, they are the usual real op).
WRITTEN: dict[Any, Callable[..., torch.Tensor]] = {
    aten._fft_c2c.default: fft_c2c,
    aten._fft_c2r.default: fft_c2r,
    aten.mul.Tensor: mul,
    aten.mul.Scalar: mul,
    aten.div.Tensor: div,
    aten.div.Scalar: div,
    aten.div.Tensor_mode: div,
    aten.reciprocal.default: reciprocal,
    aten.abs.default: abs_,
    aten.sgn.default: sgn,
    aten.exp.default: exp,
    aten.sum.default: sum_,
    aten.sum.dim_IntList: sum_,
    aten.mean.default: mean,
    aten.mean.dim: mean,
    aten.mm.default: mm,
    aten.bmm.default: bmm,
    aten.mv.default: mv,
    aten.dot.default: dot,
    aten.vdot.default: vdot,
    aten.addmm.default: addmm,
    aten.addmv.default: addmv,
    aten.baddbmm.default: baddbmm,
    aten.addbmm.default: addbmm,
    aten.angle.default: angle,
    aten.log.default: log,
    aten.linalg_vector_norm.default: vector_norm,
    aten.pow.Tensor_Scalar: pow_,
    aten.cumsum.default: partwise(aten.cumsum.default),
    aten.trace.default: partwise(aten.trace.default),
    aten.index_add.default: partwise(aten.index_add.default),
    aten.scatter_add.default: partwise(aten.scatter_add.default),
    aten.index_put.default: partwise(aten.index_put.default),  # with accumulate (without: EXACT)
    aten.put.default: partwise(aten.put.default),
    aten._index_put_impl_.default: _index_put_impl,
    aten.addr.default: addr,
    **{
        op: partwise(op)
        for op in _overloads(
            *_packets(
                "reflection_pad1d_backward",
                "reflection_pad2d_backward",
                "reflection_pad3d_backward",
                "replication_pad1d_backward",
                "replication_pad2d_backward",
                "replication_pad3d_backward",
                "unfold_backward",
                "masked_scatter_backward",
                "_unsafe_masked_index_put_accumulate",
            )
        )
        if op._overloadname == "default"
    },  # backward ops that add gradients where a forward copied values: linear, part by part
}

#: In-place forms: the out-of-place op written out, copied into ``self``.
IN_PLACE: dict[Any, Any] = {
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Tensor: aten.div.Tensor,
    aten.div_.Scalar: aten.div.Scalar,
    aten.reciprocal_.default: aten.reciprocal.default,
    aten.sgn_.default: aten.sgn.default,
    aten.exp_.default: aten.exp.default,
    aten.log_.default: aten.log.default,
    aten.addmm_.default: aten.addmm.default,
    aten.addmv_.default: aten.addmv.default,
    aten.baddbmm_.default: aten.baddbmm.default,
    aten.addbmm_.default: aten.addbmm.default,
    aten.pow_.Scalar: aten.pow.Tensor_Scalar,
    aten.cumsum_.default: aten.cumsum.default,
    aten.index_add_.default: aten.index_add.default,
    aten.scatter_add_.default: aten.scatter_add.default,
    aten.index_put_.default: aten.index_put.default,
    aten.put_.default: aten.put.default,
}


def written(func: Any) -> Callable[..., torch.Tensor] | None:
    """What ``func`` runs as when an argument is complex (None: it is exact, or refused)."""
    found = WRITTEN.get(func)
    if found is not None:
        return found
    out_of_place = IN_PLACE.get(func)
    if out_of_place is None:
        return None
    fn = WRITTEN[out_of_place]

    def in_place(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.copy_(fn(self, *args, **kwargs))

    return in_place
