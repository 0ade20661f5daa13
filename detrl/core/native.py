"""Ops that need no Python, rounded below it: the native route of the rounding mode (``native_dispatch.cpp``).

:class:`~detrl.core.rounding.RoundingMode` enters Python for every aten op of a verifiable step (3-5 µs
before it does anything). Most ops need nothing from Python: KEEP ops (views, copies) round nothing; EXACT
ops (correctly rounded IEEE results) and the fused updates :mod:`detrl.core.fused` splits into them are
rounded to FP32 with no log entry; a logged op (ELEMENTWISE, or a REDUCTION whose unit needs only its
output, or ``mm``'s from its inputs) needs an op position, and log entries only where an element lies near
an FP32 midpoint. While a step runs, :func:`scope` puts a C++ dispatcher fallback in front of the mode: it
runs and rounds those ops itself and hands every other op (and a logged op's output with a near element)
to the mode, which then works exactly as without it. The bits, the log, the op positions and the stats are
the mode's (``tests/test_native.py`` holds bundles recorded both ways byte-identical on every zoo model and
hardware profile).

Which op goes where is decided once per operator, in Python (:func:`route`, from the mode's own plan);
per call the fallback checks only what depends on the arguments: a float32 or half argument (a Python
island), ``alpha != 1`` (a fused add), ``pow``'s exponent, and whether an element is near a midpoint. A
decomposition the mode writes out hands its sums and ``exp`` back to the fallback (:func:`nest`).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrl.core import extensions, kernel, randomness
from detrl.core.fused import SPLIT
from detrl.core.oprules import (
    BOX_POOLS_FROM_17,
    EXACT_PRODUCTS,
    EXACT_SCATTERS,
    EXACT_SUMS,
    FLOAT32_EXACT,
    GRADIENT_SCALED_FROM_11,
    HIDDEN_WRITES,
    INTERPOLATIONS_FROM_18,
    POOL_SUMS_FROM_15,
    RULES_REVISION,
    RUNNING_SUMS_FROM_14,
    SQUARES,
    UNWRITTEN,
    OpKind,
    finite_extremes,
    nans_unlogged,
    negative_zeros,
)
from detrl.core.scale import SCALED_BY_INPUTS, TERMS_SCALED
from detrl.formats.roundlog import OpEntries

aten = torch.ops.aten
MM = aten.mm.default
CONV_BACKWARD = aten.convolution_backward.default


class Route(enum.IntEnum):
    """Where the fallback sends an operator (the numbers are ``native_dispatch.cpp``'s)."""

    PYTHON = 0  # the rounding mode's handler
    KEEP = 1  # run it: its outputs are its inputs' values
    EXACT = 2  # run it and round its FP64 outputs (or written arguments) to FP32
    EXACT_IF_ALPHA_ONE = 3  # EXACT when its alpha is 1, else fused: Python
    CAST = 4  # ``_to_copy``: EXACT, except a cast from a narrower float, which needs no rounding
    LOGGED = 5  # ELEMENTWISE: rounded natively when no element is near a midpoint, else by the mode
    LOGGED_REDUCTION = 6  # REDUCTION at its output's channel scale: the same
    LOGGED_MM = 7  # ``aten.mm``: the same, its unit from its inputs (scale.reduction_scale)
    EXACT_IF_SQUARE = 8  # ``pow(x, 2)`` (rules revision 2): EXACT; any other exponent: LOGGED
    LOGGED_SUM = 9  # LOGGED_REDUCTION, less exact elements' entries (kernel: sum.dim_IntList; else the mode)
    SPLIT_ADD = 10  # fused ops split into IEEE steps (detrl/core/fused.py), then EXACT
    SPLIT_SUB = 11
    SPLIT_ADDCMUL = 12
    SPLIT_ADDCDIV = 13
    SPLIT_LERP = 14
    # ``convolution_backward`` (with the C kernel; else the mode): its input gradient at each sample's and
    # channel's scale (scale.reduction_scale), its weight and bias gradients at their channel scale
    LOGGED_CONV = 15
    # decompose.py's batch norm, layer norm, their backwards and (log-)softmax's backward, written out in
    # C++ with the same torch ops in the same order: their sums and exp take the route, the rest is plain FP64
    # (recording, after calibration, where the formula applies to plain FP64 CPU tensors, layer norm with the
    # C kernel for its exact rows; else the mode decomposes it)
    DECOMPOSED_BATCH_NORM = 16
    DECOMPOSED_BATCH_NORM_BACKWARD = 17
    DECOMPOSED_LOG_SOFTMAX_BACKWARD = 18
    DECOMPOSED_LAYER_NORM = 19  # (with the C kernel: its exact rows)
    DECOMPOSED_LAYER_NORM_BACKWARD = 20
    DECOMPOSED_SOFTMAX_BACKWARD = 21
    # a sum or a mean from rules revision 5 (scale.TERMS_SCALED): its unit from its terms
    # (scale.reduction_scale), ``sum.dim_IntList`` as LOGGED_SUM besides; with the C kernel (else the mode)
    LOGGED_TERMS = 22
    # ``convolution_backward`` from rules revision 6: each gradient at the larger of its own scale and its
    # terms' unit (scale.reduction_scale); with the C kernel (else the mode)
    LOGGED_CONV_TERMS = 23
    # GELU and the backwards of GELU and SiLU from rules revision 11 (oprules.GRADIENT_SCALED_FROM_11): their
    # unit from their first argument (scale._gradient_scale); with the C kernel (else the mode)
    LOGGED_BY_FIRST = 24


_SPLITS = {"add": Route.SPLIT_ADD, "sub": Route.SPLIT_SUB, "addcmul": Route.SPLIT_ADDCMUL}
_SPLITS.update({"addcdiv": Route.SPLIT_ADDCDIV, "lerp": Route.SPLIT_LERP})
#: Decompositions written out natively, and the ops of the step each dispatches (which a profile must not
#: reorder: the mode computes those under the profile).
_DECOMPOSED = {
    aten.native_batch_norm.default: (Route.DECOMPOSED_BATCH_NORM, (aten.sum.dim_IntList,)),
    aten.native_batch_norm_backward.default: (Route.DECOMPOSED_BATCH_NORM_BACKWARD, (aten.sum.dim_IntList,)),
    aten._log_softmax_backward_data.default: (
        Route.DECOMPOSED_LOG_SOFTMAX_BACKWARD,
        (aten.sum.dim_IntList, aten.exp.default),
    ),
    aten.native_layer_norm.default: (Route.DECOMPOSED_LAYER_NORM, (aten.sum.dim_IntList,)),
    aten.native_layer_norm_backward.default: (Route.DECOMPOSED_LAYER_NORM_BACKWARD, (aten.sum.dim_IntList,)),
    aten._softmax_backward_data.default: (Route.DECOMPOSED_SOFTMAX_BACKWARD, (aten.sum.dim_IntList,)),
}

#: The decompositions that take a square root: natively always a correctly rounded one (rules revision 10).
_ROOTED = frozenset({aten.native_batch_norm.default, aten.native_layer_norm.default})


def route(
    func: Any, plan: Any, reorders: Callable[[Any], bool], rules_revision: int = RULES_REVISION
) -> Route:
    """The route of aten overload ``func``, given the rounding mode's ``plan`` of it
    (:func:`detrl.core.rounding.plan_of`), under a profile whose ``reorders(func)`` says whether it computes
    ``func`` other than the native kernel. What the mode does beyond running, rounding and numbering an op
    stays with the mode: profiles' emulations, decompositions, composites, random ops, reductions whose unit needs
    their arguments in a way the fallback does not compute or that write what their schema does not say
    (batch norm), and fused ops no native split covers. Two routes need the C kernel and go to the mode
    without it: a convolution's gradients (``LOGGED_CONV``: the input gradient's unit per sample and
    channel) and a sum's entries at elements every order sums exactly (``LOGGED_SUM``, rules revision 2,
    ``oprules.EXACT_SUMS``: a plain sum's and an embedding gradient's). Batch norm, layer norm, their
    backwards and the backwards of softmax and log-softmax are decomposed natively (``DECOMPOSED_*``) where
    the profile computes them and their steps as the native kernels do."""
    if plan.decomposes and func in _DECOMPOSED and not plan.random:
        if rules_revision < 10 and func in _ROOTED:  # torch's root, not IEEE's (oprules revision 10)
            return Route.PYTHON
        decomposed, steps = _DECOMPOSED[func]
        return Route.PYTHON if reorders(func) or any(reorders(f) for f in steps) else decomposed
    if plan.random or plan.decomposes or plan.composite is not None or reorders(func) or func in UNWRITTEN:
        return Route.PYTHON
    if plan.keep:
        return Route.KEEP
    if func in SPLIT:
        return _SPLITS.get(func.overloadpacket.__name__.rstrip("_"), Route.PYTHON)
    if plan.splits:
        return Route.PYTHON
    if rules_revision >= 2 and func in SQUARES:
        return Route.EXACT_IF_SQUARE if plan.kind is OpKind.ELEMENTWISE and not plan.alpha else Route.PYTHON
    if plan.kind is OpKind.ELEMENTWISE and not plan.alpha:
        return Route.LOGGED
    if plan.kind is OpKind.REDUCTION:
        if func is MM:
            return Route.LOGGED_MM
        if func is CONV_BACKWARD and func not in HIDDEN_WRITES:
            return Route.LOGGED_CONV if rules_revision < 6 else Route.LOGGED_CONV_TERMS
        if rules_revision >= 5 and func in TERMS_SCALED:  # in its terms' units
            return Route.LOGGED_TERMS
        if rules_revision >= 11 and func in GRADIENT_SCALED_FROM_11:  # in its first argument's units
            return Route.LOGGED_BY_FIRST
        if func in SCALED_BY_INPUTS or func in HIDDEN_WRITES:
            return Route.PYTHON
        if rules_revision >= 14 and func in RUNNING_SUMS_FROM_14:  # each element in its own terms' units
            return Route.PYTHON
        if rules_revision >= 15 and func in POOL_SUMS_FROM_15:  # so are a pool's: scale.exact_pool_elements
            return Route.PYTHON
        if rules_revision >= 17 and func in BOX_POOLS_FROM_17:  # and those over boxes: pools.BoxPool
            return Route.PYTHON
        if rules_revision >= 18 and func in INTERPOLATIONS_FROM_18:  # and an interpolation's
            return Route.PYTHON
        if rules_revision >= 2 and func in EXACT_SUMS:
            return Route.LOGGED_SUM
        if rules_revision >= 9 and func in EXACT_SCATTERS:  # scale.exact_scatter_elements: the mode's
            return Route.PYTHON
        return Route.LOGGED_REDUCTION
    if plan.kind is not OpKind.EXACT:
        return Route.PYTHON
    if plan.widening:
        return Route.CAST
    if plan.alpha:
        has_alpha = any(a.name == "alpha" for a in func._schema.arguments)
        return Route.EXACT_IF_ALPHA_ONE if has_alpha else Route.EXACT
    return Route.EXACT


#: ``DETRL_NATIVE_DISPATCH=0`` in the environment runs every op on the Python mode (same bits, slower).
_enabled = os.environ.get("DETRL_NATIVE_DISPATCH", "1") != "0"


@functools.cache
def _module() -> Any:
    """The extension (built by ``pip install``, else here once), or None: then every op takes the Python mode,
    with the same bits."""
    return extensions.load(
        "detrl.core._native_dispatch",
        Path(__file__).with_name("native_dispatch.cpp"),
        "the native rounding route",
    )


def available() -> bool:
    """Whether the native route is built and switched on."""
    return _enabled and _module() is not None


def set_enabled(on: bool) -> None:
    """Switch the native route on or off for this process (off: every op takes the Python mode)."""
    global _enabled
    _enabled = on


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """Run the block with the route switched ``on`` (or off: on the Python mode alone), then as it was."""
    before = _enabled
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)


def disabled() -> contextlib.AbstractContextManager[None]:
    """Run the block on the Python mode alone."""
    return switched(False)


def nest() -> bool:
    """Inside the rounding mode's handler (where the route is off), turn it on again for this thread's
    step, if it has one: a decomposition's sums and exps then take the route like any op. Returns whether
    it did; if so, :func:`unnest` must follow."""
    return _enabled and (module := _module()) is not None and bool(module.nest())


def unnest() -> None:
    """Undo the last :func:`nest` that returned True."""
    _module().unnest()


def _overload(name: str, overload: str) -> Any:
    """The ``OpOverload`` of a qualified operator name (``aten::add``) and overload name, or None."""
    namespace, _, op = name.partition("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
    except (AttributeError, RuntimeError):
        return None


#: Ops of this process's verifiable steps the native route ran (``native``) and handed to the mode
#: (``python``), the logged outputs whose entries it took (``entries``) and the split ops it computed in
#: one pass (``one_pass``), for benchmarks and tests.
counts: collections.Counter[str] = collections.Counter()


def _unnamed(name: str) -> tuple[int, bool, float, str, Any, bool, bool, bool]:
    """A table's entry for an operator Python cannot name: the mode takes it as it comes."""
    return int(Route.PYTHON), False, 0.0, name, None, False, False, False


class Routes:
    """One rounding mode's table of operator routes, kept across steps and rebuilt when the profile or the
    thresholds change (an elementwise op's route holds its threshold). ``plan_of(func, rules_revision)`` is
    the mode's plan of an op."""

    def __init__(self, plan_of: Callable[[Any, int], Any]) -> None:
        self._plan_of = plan_of
        self._table: Any = None
        self._key: Any = None
        self._declined: Any = None  # the calls calibration declined to measure again (kept: counts only grow)

    def declined(self, module: Any) -> Any:
        if self._declined is None:
            self._declined = module.Declined()
        return self._declined

    def table(self, module: Any, profile: Any, thresholds: Any, rules_revision: int) -> Any:
        key = (
            id(profile),
            rules_revision,
            thresholds.default,
            tuple(sorted(thresholds.per_op.items())),
            tuple(sorted(thresholds.per_class.items())),
        )
        if self._table is None or key != self._key:
            reorders, plan_of = profile.reorders, self._plan_of
            classed = thresholds.classed_ops()

            def resolve(name: str, overload: str) -> tuple[int, bool, float, str, Any, bool, bool, bool]:
                func = _overload(name, overload)
                if func is None:
                    return _unnamed(name)
                short = func.overloadpacket.__name__
                return (
                    int(route(func, plan_of(func, rules_revision), reorders, rules_revision)),
                    short.endswith("_"),
                    thresholds.tau(short),
                    short,
                    func,
                    func.overloadpacket in FLOAT32_EXACT,
                    short in classed,
                    rules_revision >= 3 and func in EXACT_PRODUCTS,  # scale.exact_product_elements
                )

            self._table, self._key = module.Table(resolve, negative_zeros(rules_revision), True), key
            # revision 12: a call with FP64's largest finite number as an argument goes to the mode
            self._table.finite_extremes = finite_extremes(rules_revision)
            self._table.nans_unlogged = nans_unlogged(rules_revision)  # revision 16: a NaN is never near
        return self._table


@functools.cache
def _random_table(module: Any) -> Any:
    """The routes of a step that is not verifiable: random ops to the mode (the stream's), every other op
    run as it is (``KEEP``: nothing rounded, nothing refused)."""

    def resolve(name: str, overload: str) -> tuple[int, bool, float, str, Any, bool, bool, bool]:
        func = _overload(name, overload)
        if func is None:
            return _unnamed(name)
        draws = randomness.draws_randomness(func)
        return (
            int(Route.PYTHON if draws else Route.KEEP),
            False,
            0.0,
            func.overloadpacket.__name__,
            func,
            False,
            False,
            False,
        )

    return module.Table(resolve, False, False)


@contextlib.contextmanager
def random_route(profile: Any) -> Iterator[None]:
    """Within a step that is not verifiable, under :class:`~detrl.core.randomness.StreamRandomMode` alone: its
    random ops go to the mode, which draws them from the stream, and every other op runs natively, as the
    mode would have called it back, without a Python call. The same bits as the mode alone. A Python mode
    costs every op of a step; the tiny transformer's FP64 step (dropout: 4 random ops of 360) took 8.5 ms
    with it and 5.5 ms without. Without the extension, or under a profile that cannot say which ops it
    reorders, it does nothing."""
    module = _module() if _enabled and hasattr(profile, "reorders") else None
    if module is None:
        yield
        return

    def unused(*args: Any) -> None:
        raise AssertionError("a plain step's route rounds nothing")

    module.enter(_random_table(module), False, unused, unused, None, unused, unused, None, None, None, None)
    try:
        yield
    finally:
        _, native_ops, python_ops, _, _ = module.leave()
        counts.update(native=native_ops, python=python_ops)


@contextlib.contextmanager
def scope(
    routes: Routes,
    profile: Any,
    thresholds: Any,
    step: Any,
    logs: bool,
    round_logged: Callable[[Any, bool, torch.Tensor, tuple, float], None],
    learned: Callable[[], tuple[tuple[float, ...], bool] | None],
    rules_revision: int,
    calibrator: Any = None,
    nesting: Callable[[int], None] | None = None,
) -> Iterator[None]:
    """Within: the ops of ``step`` (a :class:`detrl.core.rounding.StepRounding`) that need no Python are run
    and rounded natively on this thread (see the module doc). ``logs``: elementwise ops may be rounded here
    (recording); ``round_logged(func, elementwise, t, args, tau)`` is the mode's logged rounding
    of an elementwise op's output or a reduction's (``args``: a matrix product's two inputs, for its unit;
    a sum's arguments, for its exact elements; else empty), for an output with an element near a midpoint.
    ``learned()``: the thresholds the mode gave the last logged call it rounded (one, or one per rounded
    output: rules revision 4), and whether they are its class's own (``RoundingMode.learned``): a call of an op whose threshold depends on the call's class
    goes to the mode once per call key, and the fallback keeps what it learns. In a calibration step (``calibrator``: the
    :class:`~detrl.core.calibrate.Calibrator`) logged calls go to the mode until the calibrator declines
    to measure one (its shape class is measured enough); the fallback then rounds calls like it itself,
    with the live threshold. ``nesting(delta)``: the mode's depth inside decompositions, moved by ``delta``
    around one the fallback writes out (``DECOMPOSED_*``; without it, the mode decomposes them all).
    Without the extension, or under a profile that cannot say which ops it reorders, it does nothing."""
    module = _module() if _enabled and hasattr(profile, "reorders") else None
    if module is None:
        yield
        return

    def numbered(names: list[str]) -> None:  # logged ops the fallback rounded take the next op positions
        step.seq += len(names)
        step.op_names.extend(names)

    def entries(name: str, *arrays: np.ndarray) -> None:  # ... and one the fallback rounded with log entries
        entry = OpEntries(step.seq, *arrays)
        step.seq += 1
        step.op_names.append(name)
        step.recorded.append(entry)
        step.stats.logged += len(entry.indices) + len(entry.pinned_indices) + len(entry.short_indices)

    hooks: tuple = (None, None, None)
    if calibrator is not None:

        def tally() -> tuple[int, int]:
            return calibrator.calls, calibrator.declined

        def declined_call(name: str) -> float:  # what the calibrator does with a call it declines
            calibrator.calls += 1
            calibrator.declined += 1
            return thresholds.tau(name)

        hooks = (routes.declined(module), tally, declined_call)
    table = routes.table(module, profile, thresholds, rules_revision)
    module.enter(table, logs, numbered, round_logged, kernel.c_api(), entries, learned, nesting, *hooks)
    # The fallback numbers the ops it rounds in batches: whatever numbers one in Python takes them first.
    flush, step.flush_numbers = step.flush_numbers, module.flush_numbers
    try:
        yield
    finally:
        step.flush_numbers = flush
        rounded, native_ops, python_ops, entry_ops, one_pass = module.leave()
        step.stats.rounded_elements += rounded
        counts.update(native=native_ops, python=python_ops, entries=entry_ops, one_pass=one_pass)
