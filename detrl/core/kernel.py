"""The native rounding kernel (``detrl/core/_roundkernel.c``), and when it applies.

Verifiable precision rounds every op's FP64 output to FP32 and, for ops that need a log, finds the elements
within T of an FP32 midpoint. The pure-torch reference in :mod:`detrl.core.rounding` does that in about a dozen
torch calls, each a pass over the output with its own dispatch; the kernel does it in one pass (two for
outputs measured at their channel's scale, which first find each channel's largest magnitude), testing
blocks of elements in vector lanes and writing entries only from the rare block that holds one. It is a plain
C extension, built at install time with the machine's C compiler; where it is missing (no compiler, an
unusual platform) everything runs on the reference, with identical results (``tests/test_kernel.py``).

It handles contiguous FP64 tensors on the CPU; anything else (CUDA tensors, strided views) takes the
reference path. :func:`disabled` turns it off, for benchmarks that compare the two side by side.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from detrl.core.scale import Scale
from detrl.formats.roundlog import OpEntries

try:
    from detrl.core import _roundkernel as _native
except ImportError:  # built without a C compiler: the pure-torch reference does the work
    _native = None

_enabled = True


def available() -> bool:
    """Whether the kernel was built and is switched on."""
    return _native is not None and _enabled


def c_api() -> object | None:
    """The kernel's C API (``roundkernel.h``) as a capsule for native code, or None where the kernel is not
    built or switched off (see :mod:`detrl.core.native`)."""
    return getattr(_native, "_C_API", None) if available() else None


def set_enabled(on: bool) -> None:
    """Switch the kernel on or off for this process (off: every op takes the pure-torch reference)."""
    global _enabled
    _enabled = on


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block on the pure-torch reference."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def applies(t: torch.Tensor, strided: bool = False) -> bool:
    """The kernel can take ``t``: it is built and on, and ``t`` is a contiguous FP64 CPU tensor (with
    ``strided``, any FP64 CPU tensor: the caller hands the kernel a contiguous copy)."""
    return (
        _native is not None
        and _enabled
        and t.dtype == torch.float64
        and t.is_cpu
        and (strided or t.is_contiguous())
        and not t.is_conj()
        and not t.is_neg()
    )


def round_(t: torch.Tensor) -> None:
    """Round ``t`` (see :func:`applies`) to the nearest FP32 value in place."""
    assert _native is not None
    if t.numel():
        _native.round_inplace(t.data_ptr(), t.numel())


def _layout(x: torch.Tensor, scaled: bool) -> tuple[int, int, int]:
    """``(outer, channels, inner)``: the channel of a scale-relative output of rank >= 2 is dim 1."""
    if scaled and x.dim() >= 2:
        channels, inner = x.shape[1], math.prod(x.shape[2:])
        return x.shape[0], channels, inner
    return 1, 1, x.numel()


def take_entries_(
    x: torch.Tensor,
    tau: float,
    scaled: bool | Scale,
    seq: int,
    negative_zeros: bool = False,
    skip_nans: bool = False,
) -> OpEntries | None:
    """Round ``x`` (see :func:`applies`) to FP32 in place and return op ``seq``'s log entries for its elements
    within T of an FP32 midpoint, or None where there are none: the same entries as
    :func:`detrl.core.rounding.entries_for` makes from :func:`detrl.core.rounding.near_midpoint` (``scaled``: False,
    True, or a :class:`~detrl.core.rounding.Scale`, ``negative_zeros`` and ``skip_nans``, as there)."""
    assert _native is not None
    n = x.numel()
    if n == 0:
        return None
    address = x.data_ptr()
    thresholds, rows = 0, 0
    keep_alive: list[torch.Tensor] = []  # factor tensors the kernel reads by address
    if isinstance(scaled, Scale):
        outer, channels, inner = scaled.outer, scaled.channels, scaled.inner
        cols = _float64(scaled.col)
        if scaled.row is None:
            cols = cols * tau  # T per channel, the reference's product
        else:
            factors = _float64(scaled.row)
            keep_alive.append(factors)
            rows = factors.data_ptr()
        keep_alive.append(cols)
        thresholds = cols.data_ptr()
    else:
        outer, channels, inner = _layout(x, scaled)
        if scaled:
            per_channel = torch.empty(channels, dtype=torch.float64)
            _native.channel_thresholds(address, outer, channels, inner, tau, per_channel.data_ptr())
            keep_alive.append(per_channel)
            thresholds = per_channel.data_ptr()
    # the reference's constants, computed in the same Python doubles
    args = (
        address,
        outer,
        channels,
        inner,
        thresholds,
        rows,
        tau,
        tau * 2.0**-23,
        tau * 2.0**-149,
        tau * 2.0**104,
        (1 if negative_zeros else 0) | (2 if skip_nans else 0),  # the kernel's NEAR_ flags
    )
    # One pass in the usual case: entries go to this thread's buffers while the output is rounded. A rare
    # output with more entries than they hold stops at the block that overflowed; the rest is counted, and
    # taken into buffers of the exact size from there.
    found = _first_buffers()
    *counts, stop = _native.take_entries(*args, 0, *found.whole)
    if stop < n:
        more = _native.count_near(*args, stop)
        found = found.grown(counts, more)
        *rest, end = _native.take_entries(*args, stop, *found.buffers(counts, more))
        assert (*rest, end) == (*more, n)
        counts = [a + b for a, b in zip(counts, more)]
    del keep_alive
    n_kept, n_pinned, n_short = counts
    if n_kept == 0 and n_pinned == 0 and n_short == 0:  # the usual case: nothing to log, only the rounding
        return None
    return OpEntries(
        op=seq,
        indices=found.indices[:n_kept].copy(),
        up=found.up[:n_kept].copy(),
        pinned_indices=found.pinned_indices[:n_pinned].copy(),
        pinned_values=found.pinned_values[:n_pinned].copy(),
        short_indices=found.short_indices[:n_short].copy(),
        short_bits=found.short_bits[:n_short].copy(),
    )


#: Entries of each kind an op's first pass has room for (an output with more takes a second, shorter pass).
FIRST_ROOM = 4096


def _float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous FP64 CPU tensor, the kernel's operand (itself when it is one already)."""
    return t.to(device="cpu", dtype=torch.float64).contiguous()


_threads = threading.local()


def _first_buffers() -> _Found:
    """This thread's buffers for an op's first pass (:data:`FIRST_ROOM` entries of each kind), made once: the
    entries found are copied out of them."""
    found = getattr(_threads, "found", None)
    if found is None or len(found.indices) != FIRST_ROOM:
        found = _threads.found = _Found((FIRST_ROOM,) * 3)
    return found


class _Found:
    """Buffers the kernel writes an op's entries into, of three kinds: directions (index, up), pinned values
    (index, FP32 value) and short pinned values (index, low 16 key bits: :func:`detrl.core.rounding.split_short`'s
    decision, taken in the kernel)."""

    def __init__(self, room: tuple[int, int, int]) -> None:
        kept, pinned, short = room
        self.indices = np.empty(kept, dtype=np.int64)
        self.up = np.empty(kept, dtype=np.bool_)
        self.pinned_indices = np.empty(pinned, dtype=np.int64)
        self.pinned_values = np.empty(pinned, dtype=np.float32)
        self.short_indices = np.empty(short, dtype=np.int64)
        self.short_bits = np.empty(short, dtype=np.uint16)
        self.addresses = tuple(  # ndarray.ctypes is slow to reach (a Python object per call): read once
            a.ctypes.data
            for a in (
                self.indices,
                self.up,
                self.pinned_indices,
                self.pinned_values,
                self.short_indices,
                self.short_bits,
            )
        )
        self.whole = self.buffers((0, 0, 0), room)  # the arguments for all of them, from the start

    def buffers(self, start: Sequence[int], room: Sequence[int]) -> tuple[int, ...]:
        """The kernel's buffer arguments: addresses from entry ``start[kind]`` of each kind, with room for
        ``room[kind]`` more (bounds checked here, since the kernel writes by address)."""
        (k0, p0, s0), (k, p, s) = start, room
        assert k0 + k <= len(self.indices) and p0 + p <= len(self.pinned_indices)
        assert s0 + s <= len(self.short_indices)
        indices, up, pinned, values, short, bits = self.addresses
        return (
            indices + 8 * k0,
            up + k0,
            k,
            pinned + 8 * p0,
            values + 4 * p0,
            p,
            short + 8 * s0,
            bits + 2 * s0,
            s,
        )

    def grown(self, have: Sequence[int], more: Sequence[int]) -> _Found:
        """A copy with the first ``have[kind]`` entries of each kind and room for exactly ``more[kind]`` after."""
        k, p, s = have
        grown = _Found(tuple(a + b for a, b in zip(have, more)))  # type: ignore[arg-type]
        grown.indices[:k], grown.up[:k] = self.indices[:k], self.up[:k]
        grown.pinned_indices[:p], grown.pinned_values[:p] = self.pinned_indices[:p], self.pinned_values[:p]
        grown.short_indices[:s], grown.short_bits[:s] = self.short_indices[:s], self.short_bits[:s]
        return grown
