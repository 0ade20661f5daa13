"""The native rounding kernel (``detrl/core/_roundkernel.c``), and when it applies.

Verifiable precision rounds every op's FP64 output to FP32 and, for ops that need a log, finds the elements
within T of an FP32 midpoint. The pure-torch reference in :mod:`detrl.core.rounding` does that in about a dozen
torch calls, each a pass over the output with its own dispatch; the kernel does it in one pass (two for
outputs measured at their channel's scale, one more to count before allocating the entries). It is a plain
C extension, built at install time with the machine's C compiler; where it is missing (no compiler, an
unusual platform) everything runs on the reference, with identical results (``tests/test_kernel.py``).

It handles contiguous FP64 tensors on the CPU; anything else (CUDA tensors, strided views) takes the
reference path. :func:`disabled` turns it off, for benchmarks that compare the two side by side.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

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


def applies(t: torch.Tensor) -> bool:
    """The kernel can take ``t``: it is built and on, and ``t`` is a contiguous FP64 CPU tensor."""
    return (
        _native is not None
        and _enabled
        and t.dtype == torch.float64
        and t.device.type == "cpu"
        and t.is_contiguous()
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


def take_entries_(x: torch.Tensor, tau: float, scaled: bool | Scale, seq: int) -> OpEntries | None:
    """Round ``x`` (see :func:`applies`) to FP32 in place and return op ``seq``'s log entries for its elements
    within T of an FP32 midpoint, or None where there are none: the same entries as
    :func:`detrl.core.rounding.entries_for` makes from :func:`detrl.core.rounding.near_midpoint` (``scaled``: False,
    True, or a :class:`~detrl.core.rounding.Scale`, as there)."""
    assert _native is not None
    n = x.numel()
    if n == 0:
        return None
    address = x.data_ptr()
    thresholds, rows = 0, 0
    keep_alive: list[np.ndarray] = []  # factor arrays the kernel reads by address
    if isinstance(scaled, Scale):
        outer, channels, inner = scaled.outer, scaled.channels, scaled.inner
        cols = np.ascontiguousarray(scaled.col.cpu().numpy(), dtype=np.float64)
        if scaled.row is None:
            cols = cols * tau  # T per channel, the reference's product
        else:
            factors = np.ascontiguousarray(scaled.row.cpu().numpy(), dtype=np.float64)
            keep_alive.append(factors)
            rows = factors.ctypes.data
        keep_alive.append(cols)
        thresholds = cols.ctypes.data
    else:
        outer, channels, inner = _layout(x, scaled)
        if scaled:
            per_channel = np.empty(channels, dtype=np.float64)
            _native.channel_thresholds(address, outer, channels, inner, tau, per_channel.ctypes.data)
            keep_alive.append(per_channel)
            thresholds = per_channel.ctypes.data
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
    )
    n_kept, n_pinned = _native.count_near(*args)
    if n_kept == 0 and n_pinned == 0:  # the usual case: nothing to log, only the rounding
        _native.round_inplace(address, n)
        return None
    entries = OpEntries(
        op=seq,
        indices=np.empty(n_kept, dtype=np.int64),
        up=np.empty(n_kept, dtype=np.bool_),
        pinned_indices=np.empty(n_pinned, dtype=np.int64),
        pinned_values=np.empty(n_pinned, dtype=np.float32),
    )
    found = _native.take_entries(
        *args,
        entries.indices.ctypes.data,
        entries.up.ctypes.data,
        n_kept,
        entries.pinned_indices.ctypes.data,
        entries.pinned_values.ctypes.data,
        n_pinned,
    )
    assert found == (n_kept, n_pinned)
    del keep_alive
    return entries
