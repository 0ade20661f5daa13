"""``detrl bench perop``: what one aten op costs under verifiable precision, and where that time goes.

A verifiable step is its ops' plain FP64 cost plus, per op, the rounding mode's work. This benchmark times
single ops (an add, an in-place multiply, an exp, a sum over rows, a matrix product, a layer norm and its
backward) at a small and a large size, each called directly and under four layers, so that the differences
name the parts:

* ``plain``: the op on FP64 tensors, no mode;
* ``any mode``: under a dispatch mode that only calls the op back (the native profile's ``HardwareMode``:
  torch's ``TorchDispatchMode`` entry, the floor of any Python mode);
* ``rounded``: under the rounding mode outside a step (its plan, the profile call, rounding to FP32, no log);
* ``recorded``: inside a recording step, as a verifiable run records: the native dispatch route
  (:mod:`detrl.core.native`) takes the ops that need no Python, the mode the rest (rounding, the
  near-midpoint test and the log entries);
* ``recorded, Python mode``: the same with the native route off: every op enters the Python mode;
* ``recorded, torch``: that, and the native rounding kernel off too (the pure-torch reference).

Each cell is the best of several interleaved rounds of many calls (the least disturbed by a shared machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from detrl.bench.registry import benchmark
from detrl.core import kernel, native
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
    grad = torch.randn(side, side, generator=g, dtype=torch.float64).float().double()
    w, b = (torch.randn(side, generator=g, dtype=torch.float64).float().double() for _ in range(2))
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(rows, [side], w, b, 1e-5)
    return {
        "add": lambda: torch.add(x, y),
        "mul_ (in place)": lambda: x.mul_(1.0),
        "exp": lambda: torch.exp(y),
        "sum over rows": lambda: torch.sum(rows, 1),
        "mm": lambda: rows @ rows,
        # written out as row sums and element passes (a transformer's every block has two)
        "layer norm": lambda: torch.ops.aten.native_layer_norm.default(rows, [side], w, b, 1e-5),
        "layer norm backward": lambda: torch.ops.aten.native_layer_norm_backward.default(
            grad, rows, [side], mean, rstd, w, b, [True, True, True]
        ),
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


def _layers(fn: Callable[[], Any], calls: int, rounds: int) -> list[float]:
    """Microseconds per call of ``fn``: plain, any mode, rounded, recorded, recorded on the Python mode alone,
    recorded on the torch reference."""
    profile = get_profile("native")
    mode = RoundingMode(profile, Thresholds(default=2.0**-20))
    out = [_best_us(fn, calls, rounds)]
    with HardwareMode(
        profile
    ):  # a mode that only calls the op, through the profile as the rounding mode does
        out.append(_best_us(fn, calls, rounds))
    with mode:
        out.append(_best_us(fn, calls, rounds))
    with mode.step_scope(StepRounding()):
        out.append(_best_us(fn, calls, rounds))
    with native.disabled(), mode.step_scope(StepRounding()):
        out.append(_best_us(fn, calls, rounds))
    with native.disabled(), kernel.disabled(), mode.step_scope(StepRounding()):
        out.append(_best_us(fn, calls, rounds))
    return out


@benchmark("perop", "microseconds per aten op: plain FP64, any dispatch mode, rounded, recorded")
def bench_perop(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="detrl bench perop", description=__doc__)
    p.add_argument("--sizes", default="256,65536", help="comma list of output sizes (elements)")
    p.add_argument("--calls", type=int, default=300, help="calls per round (small sizes; fewer for large)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per cell; the best is kept")
    args = p.parse_args(rest)
    torch.set_num_threads(1)
    print(machine_line(1))
    if not native.available():
        print("note: the native dispatch route is not built here: 'recorded' is the Python mode's")
    rows = []
    for numel in (int(s) for s in args.sizes.split(",")):
        calls = max(10, args.calls * 256 // max(numel, 256))
        for name, fn in _ops(numel).items():
            plain, any_mode, rounded, recorded, python_mode, torch_ref = _layers(fn, calls, args.rounds)
            rows.append(
                [f"{name}, {numel:,}", f"{plain:.1f}", f"{any_mode:.1f}", f"{rounded:.1f}", f"{recorded:.1f}",
                 f"{python_mode:.1f}", f"{torch_ref:.1f}", f"{any_mode - plain:+.1f}",
                 f"{python_mode - any_mode:+.1f}", f"{recorded - plain:+.1f}"]
            )  # fmt: skip
    headers = ["op, elements", "plain us", "any mode", "rounded", "recorded", "recorded, Python mode",
               "recorded, torch", "mode entry", "Python mode's own", "recorded - plain"]  # fmt: skip
    print(table(headers, rows))
    print(
        "us per call, best of the rounds. mode entry: any mode - plain (torch's Python dispatch, paid by every "
        "Python mode); Python mode's own: recorded, Python mode - any mode (its plan, rounding, test and log, "
        "in Python and the native kernel); recorded - plain: what a recorded op costs beyond its kernel, the "
        "native route taking the ops that need no Python (here all of them, where no element is near a "
        "midpoint)"
    )
    return 0
