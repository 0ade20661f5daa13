"""Hardware profiles: ``native``, the emulated GPUs (``emulated:splitk``, ``reversed``, ``pairwise``, ``atomic``)
and ``cuda``; the dispatch mode that runs every aten op under one; and the registry of the ops an emulated
profile reorders (the handler families register into it)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch._ops import OpOverload

from detrl.core.dispatch import EagerDispatchMode, registrar

aten = torch.ops.aten

#: Upper bound on the number of chunks one reduction is cut into (bounds the per-call Python loop).
MAX_PIECES = 32

Unit = Literal["k", "channel", "batch", "row"]
"""What a chunk size counts: elements of a plain reduced axis (matmul K, sum), input/output channels of a
convolution (each worth ``kernel_size`` products), samples of a batch (each worth ``H*W`` products), or
elements of a row reduced inside a normalisation, softmax, loss or norm kernel (GPU kernels give each thread
a few elements of the row and combine the threads' partials by warp shuffles: short chunks)."""


#: (op, its arguments' shapes, strides and dtypes, its other arguments) -> the strides of its fresh results
#: as the native kernel lays them out (from its meta kernel), or None where that cannot be told.
_LAYOUTS: dict[tuple, tuple[tuple[int, ...] | None, ...] | None] = {}
_MAX_LAYOUTS = 4096


def _signature(a: Any) -> Any:
    if isinstance(a, Tensor):
        return (tuple(a.shape), a.stride(), a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else type(a).__name__


def _meta(a: Any) -> Any:
    if isinstance(a, Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    return a


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out with no gap and no overlap (a permutation of contiguous)."""
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def _native_strides(func: OpOverload, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, ...] | None:
    """The strides the native kernel gives each of ``func``'s results on these arguments (None: a result
    that aliases an argument, or is not a tensor), from its meta kernel; None where it has none."""
    try:
        out = func(*_meta(args), **{k: _meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - no meta kernel (or one that refuses these arguments): leave results as given
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    returns = func._schema.returns
    return tuple(
        t.stride()
        if isinstance(t, Tensor)
        and (i >= len(returns) or returns[i].alias_info is None)
        and _dense(tuple(t.shape), t.stride())
        else None
        for i, t in enumerate(outs)
    )


def native_layout(func: OpOverload, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` (an emulation's results of ``func(*args, **kwargs)``) with each fresh result laid out as the
    native kernel lays it out, as its meta kernel tells: the same values, the same strides. For the ops
    whose meta kernels lay results out as their CPU kernels do (:func:`laid_out_natively`), not for all: a
    depthwise convolution's FP64 CPU kernel keeps a channels-last input's layout, its meta kernel does not."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if all(t.is_contiguous() for t in outs if isinstance(t, Tensor)) and all(
        a.is_contiguous() for a in args if isinstance(a, Tensor)
    ):
        return out  # contiguous in, contiguous out: what the native kernels give (no meta call to ask)
    key = (id(func), _signature(args), _signature(tuple(sorted(kwargs.items()))) if kwargs else ())
    try:
        strides = _LAYOUTS[key]
    except KeyError:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:  # shapes that keep changing: bound the cache
            _LAYOUTS.clear()
        strides = _LAYOUTS[key] = _native_strides(func, args, kwargs)
    except TypeError:  # an unhashable argument
        return out
    if strides is None:
        return out
    single = not isinstance(out, (tuple, list))
    outs = [out] if single else list(out)
    changed = False
    for i, (t, want) in enumerate(zip(outs, strides)):
        if want is not None and isinstance(t, Tensor) and t.dim() == len(want) and t.stride() != want:
            outs[i] = torch.empty_strided(t.shape, want, dtype=t.dtype, device=t.device).copy_(t)
            changed = True
    if not changed:
        return out
    return outs[0] if single else type(out)(outs)


def laid_out_natively(handler: Handler) -> Handler:
    """An emulation whose results take the native kernel's strides (:func:`native_layout`). A softmax over
    a channels-last tensor's channels, written as elementwise ops on it, keeps its channels-last strides
    where the native kernel returns a contiguous result, and a later kernel that needs a contiguous
    argument (cross-entropy's ``nll_loss2d_backward``, as a segmentation head's loss calls it) failed under
    the profile alone."""

    def laid_out(p: EmulatedProfile, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        return native_layout(func, args, kwargs, handler(p, func, args, kwargs))

    return laid_out


class Profile:
    """A hardware profile; the base class is the native one (every op runs unchanged)."""

    deterministic: bool = True
    #: where a Session on this profile keeps model and data (the emulated profiles run on any device)
    device: str = "cpu"

    def __init__(self, name: str, description: str, device: str = "cpu") -> None:
        self.name = name
        self.description = description
        self.device = device

    def __call__(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        """Compute aten op ``func(*args, **kwargs)`` under this profile; returns what ``func`` returns."""
        return func(*args, **kwargs)

    def reorders(self, func: OpOverload, args: tuple | None = None, kwargs: dict | None = None) -> bool:
        """Whether this profile may compute ``func`` other than the native kernel does (the native profile
        never does); with ``args`` and ``kwargs``, that call of it."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(frozen=True)
class Plan:
    """How to evaluate one reduction over an axis of length ``n``.

    ``perm`` (shape ``(n,)``, or None for the identity) reorders the axis first, or ``reverse`` flips it
    (the permutation ``n - 1, ..., 0``, which a flip applies several times faster than a gather);
    ``pieces`` are the ``(start, length)`` chunks of the reordered axis, each reduced by the native kernel;
    the partial results are accumulated left to right in ``pieces`` order, or by a balanced tree if
    ``tree``.
    """

    perm: Tensor | None
    pieces: tuple[tuple[int, int], ...]
    tree: bool
    reverse: bool = False


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

    def reorders(self, func: OpOverload, args: tuple | None = None, kwargs: dict | None = None) -> bool:
        """Whether ``func`` has an emulation here: every emulated profile shares the registry (an op without
        one runs the native kernel under all of them), but another libm's ops (:data:`_LIBM_ONLY`) run the
        native kernel under a profile without one (``libm=False``). With ``args`` and ``kwargs``: whether
        this call splits a reduction, where its op's family says (:data:`_SPLITS`: a product over 32 terms,
        a convolution of 8 input channels, run natively here); without, or where it does not say, whether
        it may."""
        if func not in _HANDLERS or (not self.libm and func in _LIBM_ONLY):
            return False
        splits = _SPLITS.get(func)
        return splits is None or args is None or splits(self, func, args, kwargs or {})

    def splits(self, n: int, unit: Unit) -> bool:
        """Whether :meth:`plan` cuts ``n`` terms counted in ``unit`` (no random order is drawn to tell)."""
        return n >= 2 and self._chunk(n, unit) < n

    def _chunk(self, n: int, unit: Unit) -> int:
        """The base chunk of ``unit``, grown (in multiples of it) until at most MAX_PIECES chunks remain."""
        base = self.chunks[unit]
        return base * max(1, math.ceil(math.ceil(n / MAX_PIECES) / base))

    def plan(self, n: int, unit: Unit, device: torch.device) -> Plan | None:
        """Plan a reduction over ``n`` terms counted in ``unit``; None if it is too short to split."""
        if not self.splits(n, unit):
            return None
        chunk = self._chunk(n, unit)
        pieces = tuple((start, min(chunk, n - start)) for start in range(0, n, chunk))
        if self.reorder == "reverse":
            return Plan(None, pieces, self.tree, reverse=True)
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
            "libm (transcendental results moved by 1-2 FP64 ulps; GELU and its and SiLU's backwards written "
            "another way)",
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
        return Profile("cuda", "plain torch kernels on a CUDA device", device="cuda")
    factories = _make_profiles(seed)
    if name not in factories:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(_EMULATED_NAMES)}, cuda")
    return factories[name]()


class HardwareMode(EagerDispatchMode):
    """Run every aten op under ``profile`` (forward and, via autograd, backward ops alike)."""

    def __init__(self, profile: Profile) -> None:
        super().__init__()
        self.profile = profile

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The mode is popped while we are in here, so the profile's own torch calls reach the kernels.
        return self.profile(func, args, kwargs or {})


Handler = Callable[[EmulatedProfile, OpOverload, tuple, dict], Any]
_HANDLERS: dict[OpOverload, Handler] = {}
#: The ops whose only emulation is another libm's results (:mod:`detrl.core.hardware.libm`): a profile
#: without one computes them natively, so it does not reorder them.
_LIBM_ONLY: set[OpOverload] = set()


_register = registrar(_HANDLERS, "hardware handler")  # @_register(ops): the emulation of ops
#: Whether a call of an op splits a reduction under a profile (the handler then reorders it; else it runs
#: the native kernel on the same inputs, and gives the native bits): ``(profile, func, args, kwargs) ->
#: bool``, true wherever the handler draws a plan that cuts. Calibration skips the reruns that cannot
#: disagree (:meth:`EmulatedProfile.reorders`); an op without one is taken to split every call.
Splits = Callable[["EmulatedProfile", OpOverload, tuple, dict], bool]
_SPLITS: dict[OpOverload, Splits] = {}
_splits = registrar(_SPLITS, "split rule")  # @_splits(ops): when the emulation of ops splits a call
