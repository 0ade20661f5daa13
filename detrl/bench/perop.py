"""``detrl bench perop``: what one aten op costs under verifiable precision, and where that time goes.

A verifiable step is its ops' plain FP64 cost plus, per op, the rounding mode's work. This benchmark times
single ops (an add, an in-place multiply, an exp, a sum over rows, a matrix product) at a small and a large
size, each called directly and under four layers, so that the differences name the parts:

* ``plain``: the op on FP64 tensors, no mode;
* ``any mode``: under a dispatch mode that only calls the op back (the native profile's ``HardwareMode``:
  torch's ``TorchDispatchMode`` entry, the floor of any Python mode);
* ``rounded``: under the rounding mode outside a step (its plan, the profile call, rounding to FP32, no log);
* ``recorded``: inside a recording step (rounding, the near-midpoint test and the log entries);
* ``recorded, torch``: the same with the native kernel off (the pure-torch reference).

With ``--cpp-fallback`` a column comes first: the op under a boxed C++ dispatcher fallback that does no work
(``fallback_probe.cpp``, built on first use with ``torch.utils.cpp_extension``: a C++ compiler and ninja,
about a minute), on a dispatch key below autograd, where the Python modes see ops. Against ``any mode`` it
measures what moving the per-op work out of Python could save at best.

Each cell is the best of several interleaved rounds of many calls (the least disturbed by a shared machine).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from detrl.bench.registry import benchmark
from detrl.core import kernel
from detrl.core.hardware import HardwareMode, get_profile
from detrl.core.rounding import RoundingMode, StepRounding, Thresholds
from detrl.run.fmt import machine_line, table


def _ops(numel: int) -> dict[str, Callable[[], Any]]:
    """The timed ops on FP32-grid FP64 inputs of about ``numel`` output elements."""
    g = torch.Generator().manual_seed(0)
    side = max(1, int(numel**0.5))
    x = torch.randn(numel, generator=g, dtype=torch.float64).float().double()
    y = torch.randn(numel, generator=g, dtype=torch.float64).float().double()
    rows = torch.randn(side, side, generator=g, dtype=torch.float64).float().double()
    return {
        "add": lambda: torch.add(x, y),
        "mul_ (in place)": lambda: x.mul_(1.0),
        "exp": lambda: torch.exp(y),
        "sum over rows": lambda: torch.sum(rows, 1),
        "mm": lambda: rows @ rows,
    }


def _best_us(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    for _ in range(max(1, calls // 10)):  # warm: allocator, first-call caches
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def fallback_probe() -> Any:
    """The built C++ fallback probe (``fallback_probe.cpp``); raises RuntimeError with the reason when it
    cannot be built here (no compiler, no ninja, or a torch without the dispatch key)."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            "detrl_fallback_probe", [str(Path(__file__).with_name("fallback_probe.cpp"))]
        )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"the C++ fallback probe could not be built: {reason}") from None


def _layers(fn: Callable[[], Any], calls: int, rounds: int, probe: Any = None) -> list[float]:
    """Microseconds per call of ``fn``: plain, any mode, rounded, recorded, recorded on the torch reference;
    with ``probe``, also under the C++ fallback probe (last)."""
    native = get_profile("native")
    mode = RoundingMode(native, Thresholds(default=2.0**-20))
    out = [_best_us(fn, calls, rounds)]
    with HardwareMode(native):  # a mode that only calls the op, through the profile as the rounding mode does
        out.append(_best_us(fn, calls, rounds))
    with mode:
        out.append(_best_us(fn, calls, rounds))
    with mode.step_scope(StepRounding()):
        out.append(_best_us(fn, calls, rounds))
    with kernel.disabled(), mode.step_scope(StepRounding()):
        out.append(_best_us(fn, calls, rounds))
    if probe is not None:
        probe.enter()
        try:
            out.append(_best_us(fn, calls, rounds))
        finally:
            probe.leave()
    return out


@benchmark("perop", "microseconds per aten op: plain FP64, any dispatch mode, rounded, recorded (and C++)")
def bench_perop(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="detrl bench perop", description=__doc__)
    p.add_argument("--sizes", default="256,65536", help="comma list of output sizes (elements)")
    p.add_argument("--calls", type=int, default=300, help="calls per round (small sizes; fewer for large)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per cell; the best is kept")
    p.add_argument(
        "--cpp-fallback", action="store_true", help="also time each op under a C++ fallback that does no work"
    )
    args = p.parse_args(rest)
    torch.set_num_threads(1)
    print(machine_line(1))
    probe = None
    if args.cpp_fallback:
        print("building the C++ fallback probe (cached after the first build) ...", flush=True)
        try:
            probe = fallback_probe()
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    rows = []
    for numel in (int(s) for s in args.sizes.split(",")):
        calls = max(10, args.calls * 256 // max(numel, 256))
        for name, fn in _ops(numel).items():
            plain, any_mode, rounded, recorded, torch_ref, *cpp = _layers(fn, calls, args.rounds, probe)
            row = [f"{name}, {numel:,}", f"{plain:.1f}"]
            if cpp:
                row += [f"{cpp[0]:.1f}", f"{cpp[0] - plain:+.1f}"]
            row += [f"{any_mode:.1f}", f"{rounded:.1f}", f"{recorded:.1f}", f"{torch_ref:.1f}",
                    f"{any_mode - plain:+.1f}", f"{recorded - any_mode:+.1f}"]  # fmt: skip
            rows.append(row)
    headers = ["op, elements", "plain us", *(["C++ fallback", "C++ entry"] if probe is not None else []),
               "any mode", "rounded", "recorded", "recorded, torch", "mode entry", "rounding mode's own"]  # fmt: skip
    print(table(headers, rows))
    print(
        "us per call, best of the rounds. mode entry: any mode - plain (torch's Python dispatch, paid by every "
        "Python mode); rounding mode's own: recorded - any mode (its plan, rounding, test and "
        "log, in Python and the native kernel)"
        + ("; C++ entry: C++ fallback - plain (a boxed fallback that only redispatches)" if probe else "")
    )
    if probe is not None:
        print(f"the C++ fallback passed {probe.seen():,} ops through")
    return 0
