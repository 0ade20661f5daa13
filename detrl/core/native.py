"""Ops that need no Python, rounded below it: the native route of the rounding mode (``native_dispatch.cpp``).

:class:`~detrl.core.rounding.RoundingMode` enters Python for every aten op of a verifiable step (3-5 µs
before it does anything). For KEEP ops (views, copies: nothing to round) and EXACT ops (correctly rounded
IEEE results: round to FP32, no log entry, no op position) that is all overhead. While a step runs,
:func:`scope` puts a C++ dispatcher fallback in front of the mode: it runs those ops and rounds their
outputs itself, and hands every other op to the mode, which then works exactly as without it. The ops it
takes round the same bits and leave the log, the op positions and the stats as the mode would
(``tests/test_native.py`` holds bundles recorded both ways byte-identical).

Which op goes where is decided once per operator, in Python (:func:`route`, from the mode's own plan);
per call the fallback checks only what depends on the arguments: a float32 or half argument (a Python
island) and ``alpha != 1`` (a fused add).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch


class Route(enum.IntEnum):
    """Where the fallback sends an operator (the numbers are ``native_dispatch.cpp``'s)."""

    PYTHON = 0  # the rounding mode's handler
    KEEP = 1  # run it: its outputs are its inputs' values
    EXACT = 2  # run it and round its FP64 outputs (or written arguments) to FP32
    EXACT_IF_ALPHA_ONE = 3  # EXACT when its alpha is 1, else fused: Python
    CAST = 4  # ``_to_copy``: EXACT, except a cast from a narrower float, which needs no rounding
    LOGGED = 5  # ELEMENTWISE: rounded natively when no element is near a midpoint, else by the mode
    SPLIT_ADD = 10  # fused ops split into IEEE steps (detrl/core/fused.py), then EXACT
    SPLIT_SUB = 11
    SPLIT_ADDCMUL = 12
    SPLIT_ADDCDIV = 13
    SPLIT_LERP = 14


_SPLITS = {"add": Route.SPLIT_ADD, "sub": Route.SPLIT_SUB, "addcmul": Route.SPLIT_ADDCMUL}
_SPLITS.update({"addcdiv": Route.SPLIT_ADDCDIV, "lerp": Route.SPLIT_LERP})


def route(func: Any, reorders: Callable[[Any], bool]) -> Route:
    """The route of aten overload ``func`` under a profile whose ``reorders(func)`` says whether it computes
    ``func`` other than the native kernel. What the mode does more than run, round and number goes to
    Python: profiles' emulations, decompositions, random ops, reductions (their units need the op's
    arguments), and any split of a fused op :mod:`detrl.core.fused` has no native rule for."""
    from detrl.core.fused import SPLIT
    from detrl.core.oprules import OpKind
    from detrl.core.rounding import _PLANS, _plan

    plan = _PLANS.get(id(func)) or _plan(func)
    if plan.random or plan.decomposes or reorders(func):
        return Route.PYTHON
    if plan.keep:
        return Route.KEEP
    if func in SPLIT:
        return _SPLITS.get(func.overloadpacket.__name__.rstrip("_"), Route.PYTHON)
    if plan.splits:
        return Route.PYTHON
    if plan.kind is OpKind.ELEMENTWISE and not plan.alpha:
        return Route.LOGGED
    if plan.kind is not OpKind.EXACT:
        return Route.PYTHON
    if plan.widening:
        return Route.CAST
    if plan.alpha:
        has_alpha = any(a.name == "alpha" for a in func._schema.arguments)
        return Route.EXACT_IF_ALPHA_ONE if has_alpha else Route.EXACT
    return Route.EXACT


_enabled = True
_BUILD = Path.home() / ".cache" / "detrl" / "native"


@functools.cache
def _module() -> Any:
    """The built extension, or None where it cannot be built (no C++ compiler or ninja): then every op takes
    the Python mode, with the same bits."""
    from torch.utils import cpp_extension

    source = Path(__file__).with_name("native_dispatch.cpp")
    try:
        return cpp_extension.load(
            "detrl_native_dispatch",
            [str(source)],
            extra_cflags=["-O3", "-fno-fast-math", "-ffp-contract=off"],
        )
    except Exception:  # noqa: BLE001 - any build failure means: the reference path
        return None


def available() -> bool:
    """Whether the native route is built and switched on."""
    return _enabled and _module() is not None


def set_enabled(on: bool) -> None:
    """Switch the native route on or off for this process (off: every op takes the Python mode)."""
    global _enabled
    _enabled = on


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block on the Python mode alone."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


class Routes:
    """One rounding mode's table of operator routes (kept across steps; rebuilt when the profile or the
    thresholds change, since a route holds its op's threshold)."""

    def __init__(self) -> None:
        self._table: Any = None
        self._key: Any = None

    def table(self, module: Any, profile: Any, thresholds: Any) -> Any:
        key = (id(profile), thresholds.default, tuple(sorted(thresholds.per_op.items())))
        if self._table is None or key != self._key:
            reorders = profile.reorders

            def resolve(name: str, overload: str) -> tuple[int, bool, float, str]:
                ns, _, op = name.partition("::")
                func = getattr(getattr(getattr(torch.ops, ns), op), overload or "default")
                short = func.overloadpacket.__name__
                return int(route(func, reorders)), short.endswith("_"), thresholds.tau(short), short

            self._table, self._key = module.Table(resolve), key
        return self._table


@contextlib.contextmanager
def scope(mode: Any, step: Any, logs: bool) -> Iterator[None]:
    """Within: the ops that need no Python are run and rounded natively on this thread (see module doc).
    ``logs``: ELEMENTWISE ops may be rounded natively (recording, not calibrating)."""
    profile = mode.profile
    module = _module() if _enabled and hasattr(profile, "reorders") else None
    if module is None:
        yield
        return
    table = mode._native_routes.table(module, profile, mode.thresholds)
    from detrl.core.oprules import OpKind

    def flush(names: list[str]) -> None:
        step.seq += len(names)
        step.op_names.extend(names)

    def round_logged(name: str, overload: str, t: torch.Tensor) -> None:
        ns, _, op = name.partition("::")
        func = getattr(getattr(getattr(torch.ops, ns), op), overload or "default")
        mode._round_logged(func, t, OpKind.ELEMENTWISE)

    module.enter(table, logs, flush, round_logged)
    try:
        yield
    finally:
        rounded, native_ops, python_ops = module.leave()
        step.stats.rounded_elements += rounded
        step.native_ops += native_ops
        step.python_ops += python_ops
