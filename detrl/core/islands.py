"""Float32 and half "islands" inside a verifiable step: ops on narrower floats computed in FP64 too.

Verifiable precision rounds FP64 results. A model can still compute some ops in float32 (Hugging Face's
causal-LM loss calls ``logits.float()``, Llama's RMSNorm ``hidden_states.to(torch.float32)``, a classifier
ends in ``.float().log_softmax(-1)``). Run natively, such an op is unrounded, unlogged and machine
dependent: two machines disagree in its bits and nothing reconciles them.

Every float32 value is exact in FP64, so an op on float32 tensors is computed on FP64 twins of them, under
the hardware profile, rounded with the log like any FP64 op, and its result cast back to float32: exact,
since the rounded result lies on the FP32 grid. An in-place op writes its twin, which is then copied back.

float16 and bfloat16 values are exact in FP64 as well, and take the same road: the op is computed on FP64
twins and rounded to the FP32 grid with the log, so every machine holds the same FP32 value; its cast to
the half type is then a correctly rounded IEEE conversion of that agreed value, the same everywhere. (Two
roundings, FP64 to FP32 to half, can differ from one rounding FP64 to half where the FP32 value lands on a
half-type midpoint: a rule of verifiable precision, the same on every machine, not a machine difference.)
``torch.autocast`` casts only float32 tensors, so in verifiable precision, where every tensor is FP64, it
changes nothing.

Casts need no island and no log entry: FP32 -> FP64 is exact, FP64 -> FP32 and FP64 -> half are correctly
rounded IEEE conversions of values already on the FP32 grid (the first exact), the same on every machine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

#: The float types narrower than FP64 whose ops an island computes on FP64 twins.
NARROW = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: The twin's dtype of each narrow type: FP64, and complex128 for the complex ones (detrl/core/complexes.py).
_WIDE = {
    **dict.fromkeys(NARROW, torch.float64),
    torch.complex64: torch.complex128,
    torch.complex32: torch.complex128,
}


class UnroundableResult(ValueError):
    """A tensor in a verifiable step that verifiable precision has no rule for: a sparse result, or complex
    values that an op outside :mod:`detrl.core.complexes` computes (an op there is exact on every machine
    or written out as real ops; any other might differ between machines, unlogged). Left unrounded, it
    would replicate on the emulated profiles and differ on another machine: refused instead, before
    anything is committed."""

    def __init__(self, func: Any, t: torch.Tensor, module: str) -> None:
        where = f" in {module}" if module else ""
        name = f"aten.{func.overloadpacket.__name__}"
        dtype = str(t.dtype).removeprefix("torch.")
        if t.layout != torch.strided:
            message = (
                f"verifiable precision cannot round a {str(t.layout).removeprefix('torch.')} result of "
                f"{name}{where}: it rounds dense tensors; use dense tensors (nn.Embedding(sparse=False))"
            )
        else:
            message = (
                f"verifiable precision has no rule for {name} on {dtype} values{where}: it computes complex "
                "tensors with the ops detrl/core/complexes.py lists (FFTs, products, polar, ...); compute this "
                "one with real tensors"
            )
        super().__init__(message)
        self.op, self.module = func, module


def unroundable(t: Any) -> bool:
    """Whether ``t`` is a tensor :class:`UnroundableResult` refuses as an op's result: sparse, or complex
    (unless the op moves complex values: a view or a cast; ops on complex arguments go to
    :mod:`detrl.core.complexes` before this)."""
    return isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_complex())


def refuse_result(func: Any, t: torch.Tensor, module: str = "") -> None:
    """Raise :class:`UnroundableResult` (the native route calls it for a result it cannot round)."""
    raise UnroundableResult(func, t, module)


def narrow_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype narrower than FP64 that op arguments ``args``/``kwargs`` compute in: a half type (or
    complex32) if any tensor (or ``dtype=``) is one, else float32 or complex64 if any is; else complex128
    if any is (no island, but an op for :mod:`detrl.core.complexes`); else None. Called for every op:
    plain loops."""
    found, rank = None, 0
    for a in args:
        if isinstance(a, torch.Tensor):
            r = _RANK.get(a.dtype, 0)
            if r > rank:
                if r == 3:
                    return a.dtype
                found, rank = a.dtype, r
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):  # cat, stack, _foreach_*
            for t in a:
                if isinstance(t, torch.Tensor) and _RANK.get(t.dtype, 0) > rank:
                    found, rank = t.dtype, _RANK[t.dtype]
                    if rank == 3:
                        return found
    if kwargs:
        for key, v in kwargs.items():
            d = v if key == "dtype" else v.dtype if isinstance(v, torch.Tensor) else None
            r = _RANK.get(d, 0)
            if r > rank:
                if r == 3:
                    return d
                found, rank = d, r
    return found


#: How narrow a dtype is for :func:`narrow_dtype`: 3 half types, 2 the 32-bit ones, 1 complex128.
_RANK = {
    torch.float16: 3, torch.bfloat16: 3, torch.complex32: 3, torch.float32: 2, torch.complex64: 2,
    torch.complex128: 1,
}  # fmt: skip


def widen(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``args``/``kwargs`` with every narrow float tensor replaced by an FP64 copy (its twin) and every narrow
    dtype argument by FP64, keyword (``dtype=``) or positional (``_log_softmax_backward_data``'s
    ``input_dtype``): so the op runs on FP64 throughout, as its FP64 twin would, decompositions included;
    and ``id(twin) -> (original, twin)``."""
    twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def wide(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dtype in _WIDE:
            twin = a.to(_WIDE[a.dtype])
            twins[id(twin)] = (a, twin)
            return twin
        if isinstance(a, torch.dtype) and a in _WIDE:
            return _WIDE[a]
        return a

    return tree_map(wide, args), tree_map(wide, kwargs), twins


def narrow_back(
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
    twins: dict[int, tuple[torch.Tensor, torch.Tensor]],
    written: list[torch.Tensor],
) -> Any:
    """What ``func(*args, **kwargs)`` returns natively, from ``out``, what it returned on the twins: the
    ``written`` originals (in-place and ``out=`` arguments, batch norm's running statistics) get their
    twins' rounded values, and fresh floating outputs are cast to the dtype the op gives natively."""
    by_original = {id(orig): twin for orig, twin in twins.values()}
    for t in written:
        twin = by_original.get(id(t))
        if twin is not None:
            t.copy_(twin)  # exact: the twin is rounded to the FP32 grid (a half type: an IEEE conversion)
    inputs = {id(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
    flat, spec = tree_flatten(out)
    dtypes: list[torch.dtype] | None = None
    k = -1  # position among the floating outputs (what native_dtypes lists)
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        k += 1
        if id(t) in twins:
            flat[i] = twins[id(t)][0]
        elif id(t) not in inputs:
            if dtypes is None:
                dtypes = native_dtypes(func, args, kwargs, out)
            dtype = dtypes[k] if k < len(dtypes) else t.dtype
            if dtype != t.dtype and (dtype.is_floating_point or dtype.is_complex):
                flat[i] = t.to(dtype)
    return tree_unflatten(flat, spec)


_DTYPES: dict[tuple, list[torch.dtype]] = {}


def native_dtypes(func: Any, args: tuple, kwargs: dict, out: Any) -> list[torch.dtype]:
    """The dtypes of ``func``'s floating outputs, in order, as the op gives them on ``args``/``kwargs``:
    from its meta kernel (cached by the arguments' dtypes, which is all type promotion reads)."""
    leaves = tree_flatten((args, kwargs))[0]
    key = (id(func), tuple(sorted(kwargs)), *(_signature(a) for a in leaves))
    cached = _DTYPES.get(key)
    if cached is None:
        cached = _DTYPES[key] = _meta_dtypes(func, args, kwargs, out)
    return cached


def _signature(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.dim() == 0)
    return a if isinstance(a, torch.dtype) else type(a)


def _meta_dtypes(func: Any, args: tuple, kwargs: dict, out: Any) -> list[torch.dtype]:
    if isinstance(kwargs.get("dtype"), torch.dtype):  # an explicit result dtype: every float output's
        return [kwargs["dtype"]] * len(_floats(out))

    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return a

    try:
        result = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    except Exception:  # noqa: BLE001 - no meta kernel: type promotion's rule over the float inputs
        floats = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        floats = [a for a in floats if a.is_floating_point() or a.is_complex()]
        dims = [a for a in floats if a.dim() > 0] or floats
        dtype = dims[0].dtype if dims else torch.float64
        for a in dims[1:]:
            dtype = torch.promote_types(dtype, a.dtype)
        return [dtype] * len(_floats(out))
    return [t.dtype for t in _floats(result)]


def _floats(out: Any) -> list[torch.Tensor]:
    return [
        t
        for t in tree_flatten(out)[0]
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
