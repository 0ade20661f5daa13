"""FP64 compute -> FP32 round -> threshold log, as a torch dispatch mode.

In verifiable precision every tensor is FP64 but lies on the FP32 grid. :class:`RoundingMode` sees every
aten op (forward, the ops autograd runs in backward, optimizer updates) and rounds each floating result
to the nearest FP32 value, kept in the FP64 tensor. Two machines then compute every op from identical
inputs; their FP64 results differ by a tiny delta, and round to the same FP32 value unless an FP32 rounding
midpoint lies between them. Elements within the op's threshold of a midpoint are *logged* with the
neighbour chosen; a replayer rounds those as logged and everything else to nearest.

An element is within T of a midpoint exactly when ``x - T`` and ``x + T`` round to different FP32 values
(see :func:`near_midpoint` and docs/verifiable.md). Infinities are never logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from detrl.core import complexes, cpu_composites, decompose, islands, kernel, native, portable, randomness
from detrl.core.composites import COMPOSITES
from detrl.core.dispatch import EagerDispatchMode, bound_arguments
from detrl.core.fused import run_split, split_needed
from detrl.core.oprules import (
    AS_GIVEN,
    EXACT_SCATTERS,
    HIDDEN_WRITES,
    RULES_REVISION,
    SQUARES,
    UNWRITTEN,
    OpKind,
    call_class,
    canonical_nans,
    classify,
    exact_rule,
    finite_extremes,
    fp32_extremes,
    nans_unlogged,
    negative_zeros,
    op_name,
    squares,
)
from detrl.core.optrace import OpTrace
from detrl.core.scale import Scale, exact_elements, reduction_scale, scale_spacing, spacing32
from detrl.formats.roundlog import OpEntries, RoundLogMisfit, key32, nearest_with_low16

aten = torch.ops.aten

#: The replayer checks the recorder's honesty within this fraction of tau (see RoundingMode._round_logged).
REPLAY_CHECK_FRACTION = 0.5
#: The least threshold calibration gives an op kind it cannot measure (every non-reduction: libm and FMA
#: differences of elementwise ops), 128 FP64 ulps; :mod:`detrl.core.calibrate` floors at it.
TAU_FLOOR = 2.0**-22
#: The least threshold calibration gives a reduction whose disagreement it measured: 8 FP64 ulps at the
#: output's scale (an FMA-contracted epilogue differs by an ulp or two of terms at that scale).
TAU_FLOOR_MEASURED = 2.0**-26


def auditor_floor(reduction: bool) -> float:
    """The threshold the auditor holds a log to at least, whatever the bundle declares: the least one an
    honest calibration writes for the op's kind (a reduction, or anything else)."""
    return TAU_FLOOR_MEASURED if reduction else TAU_FLOOR


def output_key(cls: str, output: int) -> str:
    """The ``per_class`` key of output ``output`` of calls of class ``cls`` (rules revision 4): its position
    among the call's rounded outputs, those of dtype float64 with an element (a convolution's gradients:
    0 the input's, 1 the weight's, 2 the bias's, of those its output mask asks for)."""
    return f"{cls}#{output}"


#: Most per-class thresholds a bundle may declare, and the longest class key (a bundle is untrusted input).
MAX_CLASSES = 1 << 16
MAX_CLASS_KEY = 1 << 12


@dataclasses.dataclass
class Thresholds:
    """Per-op-kind threshold tau, in FP32 spacings (at the element or at the output's scale, see oprules).

    ``per_class`` maps call classes (:func:`detrl.core.oprules.call_class`:
    ``"mm(float64[10]{768,512},float64[01]{512,3072})"``) to tau: calibration writes one for every class
    whose disagreement it measured. ``per_op`` maps op
    names (``"mm"``, ``"convolution_backward"``) to tau, the largest of the op's classes: a call of a
    class not in ``per_class`` (one no profile reorders, or first seen after calibration) uses it. Ops in
    neither use ``default``.
    """

    per_op: dict[str, float] = dataclasses.field(default_factory=dict)
    default: float = 2.0**-16
    per_class: dict[str, float] = dataclasses.field(default_factory=dict)

    def tau(self, name: str) -> float:
        return self.per_op.get(name, self.default)

    def tau_of(self, name: str, cls: str | None, output: int | None = None) -> float:
        """The threshold of a call of op ``name`` in class ``cls`` (None: the op's); with ``output`` (the
        position of a rounded output among the call's, :func:`output_key`), that output's where it has one."""
        if cls is not None:
            if output is not None and (tau := self.per_class.get(output_key(cls, output))) is not None:
                return tau
            if (tau := self.per_class.get(cls)) is not None:
                return tau
        return self.per_op.get(name, self.default)

    def classed_ops(self) -> frozenset[str]:
        """The op names with a per-class threshold (their calls' thresholds depend on the class)."""
        return frozenset(k.partition("(")[0] for k in self.per_class)

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"default": self.default, "per_op": dict(sorted(self.per_op.items()))}
        if self.per_class:  # absent where there are none: such a manifest reads as it did before classes
            obj["per_class"] = dict(sorted(self.per_class.items()))
        return obj

    @classmethod
    def from_json(cls, obj: Any) -> Thresholds:
        if not isinstance(obj, dict) or not isinstance(obj.get("per_op", {}), dict):
            raise ValueError("thresholds must be an object with 'default' and 'per_op'")
        classes = obj.get("per_class", {})
        if not isinstance(classes, dict):
            raise ValueError("thresholds.per_class must be an object")
        if len(classes) > MAX_CLASSES:
            raise ValueError(f"thresholds.per_class: {len(classes)} classes, more than {MAX_CLASSES}")
        raw = {
            **{str(k): v for k, v in obj.get("per_op", {}).items()},
            "default": obj.get("default", cls.default),
        }
        for name, value in [*raw.items(), *classes.items()]:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"threshold for {str(name)[:64]} is {value!r}, not a number")
        default = float(raw.pop("default"))
        per_op = {k: float(v) for k, v in raw.items()}
        per_class: dict[str, float] = {}
        for key, value in classes.items():
            if not isinstance(key, str) or not 0 < len(key) <= MAX_CLASS_KEY or "(" not in key:
                raise ValueError(f"thresholds.per_class: {str(key)[:64]!r} is not a call class")
            per_class[key] = float(value)
        for name, tau in [*per_op.items(), *per_class.items(), ("default", default)]:
            if not (0.0 <= tau <= 0.5):
                raise ValueError(f"threshold for {name[:64]} is {tau}, outside [0, 0.5]")
        return cls(per_op=per_op, default=default, per_class=per_class)


class Scratch:
    """Grow-only flat buffers, reused across ops: allocating (and page-faulting) fresh full-size
    temporaries for every op cost more than the arithmetic done in them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = self._buffers[key] = torch.empty(like.numel(), dtype=dtype, device=like.device)
        return buf[: like.numel()].view(like.shape)


def near_midpoint(
    x: torch.Tensor,
    tau: float,
    scale_relative: bool | Scale,
    rounded: torch.Tensor | None = None,
    scratch: Scratch | None = None,
    negative_zeros: bool = False,
    skip_nans: bool = False,
) -> torch.Tensor:
    """Bool mask (logical shape of ``x``) of FP64 elements within ``tau`` FP32 spacings of an FP32 midpoint.

    An element is within T of a midpoint exactly when ``x - T`` and ``x + T`` round to different FP32
    values, which costs two adds and two casts instead of a dozen integer passes, and handles the FP32
    subnormal range, the binade edges and overflow by the cast's own rules. With ``scale_relative`` T is
    tau spacings at the output's scale (:func:`scale_spacing`: how reduction errors behave); otherwise it is
    tau spacings at the element (over-estimated by at most 2x: ``|x| * 2**-23`` bounds the spacing). A
    :class:`Scale` as ``scale_relative`` gives the unit itself (:func:`reduction_scale`).
    ``rounded`` (``x`` rounded to FP32) and ``scratch`` are reused when given. With ``scratch`` the mask
    lives in a scratch buffer: read it before the next call.

    An element that rounds to zero is never near, except with ``negative_zeros`` (a reduction's, from rules
    revision 7: :func:`detrl.core.oprules.negative_zeros`) a negative value that rounds to -0. An exact zero
    never is. With ``skip_nans`` (rules revision 16: :func:`detrl.core.oprules.nans_unlogged`) a NaN never
    is.
    """
    scratch = scratch or Scratch()
    if rounded is None:
        rounded = x.to(torch.float32)
    if isinstance(scale_relative, Scale):  # T per (row, column): computed on the (outer, C, inner) view
        shape, sc = x.shape, scale_relative
        x, rounded = (
            x.reshape(sc.outer, sc.channels, sc.inner),
            rounded.reshape(sc.outer, sc.channels, sc.inner),
        )
    work = scratch.get("work", x, torch.float64)
    t: torch.Tensor
    if isinstance(scale_relative, Scale):
        t = scale_relative.dense() * tau  # (outer or 1, C, 1)
    elif scale_relative:
        t = scale_spacing(rounded).mul_(tau)  # (1, C, 1, ...): cheap
    else:  # finite for infinities, at least tau subnormal spacings
        t = torch.abs(x, out=scratch.get("t", x, torch.float64))
        t.mul_(tau * 2.0**-23).clamp_(min=tau * 2.0**-149, max=tau * 2.0**104)
    lo, hi = scratch.get("lo", x, torch.float32), scratch.get("hi", x, torch.float32)
    lo.copy_(torch.sub(x, t, out=work))
    hi.copy_(torch.add(x, t, out=work))
    near = torch.ne(lo, hi, out=scratch.get("near", x, torch.bool))
    # Exact zeros are on the grid (often structurally: untouched gradient slots), never near. (A NaN
    # compares unequal and was logged, harmlessly: its entry changes nothing on replay; from revision 16 it
    # is not.) From revision 7 a reduction's negative value that rounds to -0 is: the replayer takes an
    # unlogged element within reach of zero for +0 (RoundingMode._replay), so the recorder logs the other
    # zeros a rounding makes.
    counted = torch.ne(rounded, 0, out=scratch.get("nonzero", x, torch.bool))
    if negative_zeros:
        counted.logical_or_(torch.lt(x, 0))
    if skip_nans:
        counted.logical_and_(torch.eq(x, x))
    near = near.logical_and_(counted)
    return near.view(shape) if isinstance(scale_relative, Scale) else near


def entries_for(seq: int, idx: torch.Tensor, xs: torch.Tensor, t: torch.Tensor) -> OpEntries:
    """Log entries of op ``seq`` for its near-midpoint elements: their row-major indices ``idx``, FP64 values
    ``xs`` and uncertainties ``t`` (all ``(n,)``). Each records the neighbour its nearest rounding chose,
    or, where the uncertainty reaches a quarter of the element's own spacing (heavy cancellation), the
    rounded value itself (pinned; :func:`split_short` then stores some of those as 16 key bits). A zero is
    always pinned (rules revision 7's -0): the neighbour a direction names is never a zero's other sign."""
    rs = xs.to(torch.float32).to(torch.float64)
    pinned = (4 * t >= spacing32(rs)) | (rs == 0)
    keep = ~pinned
    return OpEntries(
        op=seq,
        indices=idx[keep].cpu().numpy(),
        up=(rs.abs() > xs.abs())[keep].cpu().numpy(),
        pinned_indices=idx[pinned].cpu().numpy(),
        pinned_values=rs[pinned].to(torch.float32).cpu().numpy(),
    )


#: A pinned value is stored short (16 key bits) when its uncertainty is at most this many of its spacings.
SHORT_PINNED_SPACINGS = 2.0**12


def split_short(entries: OpEntries, x: torch.Tensor, tau: float, scaled: bool | Scale) -> OpEntries:
    """``entries`` with the pinned values that the replayer's own rounding names up to their low 16 key
    bits (:func:`detrl.formats.roundlog.key32`) moved to ``short_indices``/``short_bits``; ``x`` is the op's output
    already rounded to FP32 (in FP64). The reference recording path calls this after rounding, with nothing
    but the rounded values and the op's unit; the native kernel takes the same decision per entry (its
    ``is_short``), and ``tests/test_kernel.py`` holds the two to the same entries.

    A value ``v`` is stored short when it is finite and its uncertainty ``T <= 2**12 s`` (``s``: spacing32
    of ``v``). Why the replayer's rounded value ``r'`` then lies within 2**15 keys of ``v``: the replayer
    honours ``v`` only within reach ``2 T + s`` of its FP64 result ``x'``, and ``r'`` is within half a
    spacing of ``x'``; ``|x'| <= |v| (1 + 2**-10)`` so ``x'``'s spacing is at most ``2 s``, and
    ``|r' - v| <= 2**13 s + 2 s``. Between ``v`` and ``r'`` the FP32 spacing is at least ``s / 2`` (a
    distance of ``2**13 s`` is below ``|v| / 2**10`` for a normal ``v``, so at most one binade edge, where
    the spacing halves, is crossed, and never zero; subnormals all have the spacing 2**-149), so they are
    at most ``2**14 + 4`` keys apart: half the 2**15 that makes the reconstruction unique, a 2x margin.
    (A replayer whose own T is larger, from a channel scale one binade up or an honour floor, honours a
    wider reach; but an honest replayer's FP64 result lies within T of the recorder's, and then ``r'`` is
    at most about 2**13 keys from ``v``.)
    T is computed here as the replayer computes it, but from ``v``: for reduction ops it is tau units of
    the :class:`Scale` or of the channel scale of the rounded output (what :func:`near_midpoint` uses,
    independent of the element); for elementwise ops it is ``tau |x| 2**-23`` clamped, and taking ``v``
    for ``x`` is safe: ``|x - v| <= s / 2`` gives ``T(x) <= T(v) (1 + 2**-23)``, inside the 2x margin.
    """
    if not len(entries.pinned_indices):
        return entries
    idx = torch.from_numpy(entries.pinned_indices).to(x.device)
    vs = torch.from_numpy(entries.pinned_values).to(x.device).double()
    t = (
        _uncertainty(x, x, idx, tau, scaled)
        if isinstance(scaled, Scale) or scaled
        else _element_uncertainty(vs, tau)
    )
    # not a zero: keys are dense about it (subnormals), and its spacing32 is no bound on the replay's keys
    short = (torch.isfinite(vs) & (vs != 0) & (t <= SHORT_PINNED_SPACINGS * spacing32(vs))).cpu().numpy()
    if not short.any():
        return entries
    return OpEntries(
        op=entries.op,
        indices=entries.indices,
        up=entries.up,
        pinned_indices=entries.pinned_indices[~short],
        pinned_values=entries.pinned_values[~short],
        short_indices=entries.pinned_indices[short],
        short_bits=(key32(entries.pinned_values[short]) & 0xFFFF).astype(np.uint16),
    )


@dataclasses.dataclass
class Anomaly:
    """Something the replayer saw in one op that the log did not predict."""

    op: int  # op position in the step
    name: str  # aten op name
    module: str  # module path (or "" when not tracked)
    index: int  # logical row-major element index
    kind: str  # one of LOG_VIOLATIONS or CORRECTIONS
    #: a refused entry: how far this machine's FP64 value is from the recorder's claim, in thresholds (from
    #: the nearest FP32 midpoint for a direction, from the pinned value for a pinned one); None otherwise
    distance: float | None = None

    @property
    def violation(self) -> bool:
        """The log breaks its own claim here (as opposed to an honest correction)."""
        return self.kind in LOG_VIOLATIONS

    def where(self) -> str:
        """``op #k aten.NAME in MODULE, element i``, or for an entry at an op position the replay never
        reached, ``op #k (never reached by this replay)``."""
        if self.kind == UNREACHED:
            return f"op #{self.op} (never reached by this replay)"
        module = f" in {self.module}" if self.module else ""
        return f"op #{self.op} aten.{self.name}{module}, element {self.index}"

    def blame(self) -> str:
        """Why this op is (or is not) where the replay first went wrong, for a divergence's report.

        An honest machine's FP64 result lies within a fraction of the threshold of the recorder's (the
        threshold is a margin times the largest disagreement calibration measured). A value many thresholds
        from the recorder's claim is not this op's own arithmetic: its inputs already differed."""
        if self.kind == UNREACHED:
            return "the replay ran fewer ops than the recorder logged: an op before it took another path"
        if self.distance is not None and self.distance >= FAR_THRESHOLDS:
            return (
                f"this machine's value is {self.distance:.3g} thresholds from the recorder's claim, far beyond "
                f"any difference in the op's own arithmetic: its inputs already differed, so an op before "
                f"#{self.op} produced different bits (or the recorder computed something else)"
            )
        return (
            f"if op #{self.op}'s inputs already differed (the other anomalies of the step tell), an op before "
            f"#{self.op} produced different bits"
        )


#: A refused entry this many thresholds from its claim means the op's inputs differed (Anomaly.blame).
FAR_THRESHOLDS = 16.0

#: A log record for an op position the replay never reached: an honest recorder logs only ops it ran.
UNREACHED = "logged-op-not-reached"


#: Anomalies where the log breaks its claim: a near-midpoint element it omits, an entry this machine refuses
#: (far from any midpoint, a pinned value out of reach), an index outside the op's output.
LOG_VIOLATIONS = (
    "unlogged-near",
    "logged-not-near",
    "pinned-value-far",
    "logged-index-out-of-range",
    UNREACHED,
)
#: Anomalies that are the log doing its job: this machine's own nearest rounding differed from the
#: recorder's, and the logged direction or value was applied (hardware that needs corrections shows many).
CORRECTIONS = ("logged-direction-differs", "pinned-value-differs")


@dataclasses.dataclass
class StepStats:
    rounded_elements: int = 0  # elements rounded to FP32 (EXACT and logged kinds)
    logged: int = 0  # elements in the log for this step
    unlogged_near: int = 0  # replay: near-midpoint elements the recorder did not log
    corrected: int = 0  # replay: logged elements whose own nearest rounding differed from the log
    refused: int = 0  # replay: logged elements refused (far from any midpoint here, or out of reach)


class StepRounding:
    """The rounding work of one step: what to record, or what to replay.

    ``replay`` is None when recording; otherwise the step's log: a streaming cursor
    (:meth:`detrl.formats.roundlog.RoundLogReader.cursor`, read op by op with a memory bound from each op's size)
    or a mapping op position -> entries. ``max_anomalies`` caps the anomalies kept *per kind*, so that many
    honest corrections never push the one missing entry out of the report.
    """

    def __init__(self, replay: Any = None, max_anomalies: int = 20) -> None:
        self.replay = replay
        self.recorded: list[OpEntries] = []
        self.stats = StepStats()
        self.anomalies: list[Anomaly] = []
        self.max_anomalies = max_anomalies
        self._kept: dict[str, int] = {}
        self.seq = 0  # the next logged op's position
        self.op_names: list[str] = []
        #: Hands over the op positions the native route took but has not numbered here yet (it numbers in
        #: batches: detrl/core/native.py): called before an op is numbered here. None outside its scope.
        self.flush_numbers: Callable[[], None] | None = None

    def entries(self, seq: int, numel: int, name: str = "") -> OpEntries | None:
        """The log's entries for op position ``seq`` (``name``, an output of ``numel`` elements), if any."""
        if self.replay is None:
            return None
        if isinstance(self.replay, dict):
            return self.replay.get(seq)
        try:
            return self.replay.take(seq, numel)
        except RoundLogMisfit as e:  # the log's op here is another op: say what this replay ran
            raise RoundLogMisfit(
                f"{e}; this replay's op {seq} ({name or 'unnamed'}) has {numel}: the bundle was altered, "
                "or this replay runs other ops than its recording did (other model code, or state kept from an "
                "earlier run in this process, such as a cached tensor)"
            ) from None

    def keep(self, anomaly: Anomaly) -> None:
        n = self._kept.get(anomaly.kind, 0)
        if n < self.max_anomalies:
            self._kept[anomaly.kind] = n + 1
            self.anomalies.append(anomaly)


class RoundingMode(EagerDispatchMode):
    """Verifiable precision: compute each op under ``profile`` and round every FP64 result to FP32.

    Args:
        profile: callable ``(func, args, kwargs) -> out`` that computes an op (a hardware profile).
        thresholds: tau per op kind.
        module_path: optional callable returning the current module path, for anomaly reports.
    """

    def __init__(
        self,
        profile: Callable[[Any, tuple, dict], Any],
        thresholds: Thresholds,
        module_path: Callable[[], str] | None = None,
    ) -> None:
        super().__init__()
        self.profile = profile
        self.thresholds = thresholds
        self.module_path = module_path
        self.step: StepRounding | None = None
        self._nested = 0  # depth inside decompositions (detrl/core/decompose.py)
        #: thresholds for the replayer's unlogged-near check, when not tau/2 (the calibration step)
        self.check_thresholds: Thresholds | None = None
        self._scratch = Scratch()
        self.calibrate: Callable[[Any, tuple, dict, Any, OpKind], None] | None = None
        #: the stream seeded random ops draw from inside a step (see :func:`detrl.core.randomness.handler_for`)
        self.random: torch.Generator | None = None
        #: replay: entries are honoured within 2 x max(tau, this) (see :meth:`step_scope`)
        self.honour_floor = 0.0
        #: per-op digests of the step, when a dispute asks for them (:mod:`detrl.core.optrace`); None (the
        #: default) costs each op one attribute test
        self.trace: OpTrace | None = None
        self._native_routes = native.Routes(plan_of)
        #: whether the native route may take ops first (where built): a step off the CPU has it off, so
        #: every op meets this mode, which computes as a CPU would (core/portable.py)
        self.native_route = True
        #: the noise of each device dropout expanded as a CPU's (:meth:`_device_dropout`), by its mask's id
        self._device_noise: dict[int, torch.Tensor] = {}
        # A decomposition's machine-dependent steps (this mode's sums and exps) and, from rules revision 10,
        # a correctly rounded root (portable.ieee_sqrt); torch's root before.
        self._steps = decompose.Steps(
            self._logged_sum, self._logged_exp, inv_sqrt=_inverse_root, sqrt=portable.ieee_sqrt
        )
        self._steps_before_10 = decompose.Steps(self._logged_sum, self._logged_exp)
        self.rules_revision = RULES_REVISION
        # the threshold of the last logged call, per thread: the native route reads it on the thread that
        # handed the call over, and autograd's device threads run the mode beside it
        self._last = threading.local()
        # the ops with class thresholds, for the per_class dict it was taken from (held, so its id stays its
        # own) at its length (classes are only ever added: calibration adds them, nothing removes one)
        self._classed: tuple[dict[str, float] | None, int, frozenset[str]] = (None, 0, frozenset())

    @property
    def rules_revision(self) -> int:
        """The rounding rules the steps follow (:data:`detrl.core.oprules.RULES_REVISION`; a replay: its
        bundle's). Setting it selects the ops' plans of that revision."""
        return self._revision

    @rules_revision.setter
    def rules_revision(self, revision: int) -> None:
        self._revision = revision
        self._plans = _PLANS.setdefault(revision, {})
        self._finite_extremes = finite_extremes(revision)

    @contextlib.contextmanager
    def step_scope(
        self,
        step: StepRounding,
        calibrate: Callable[[Any, tuple, dict, Any, OpKind], None] | None = None,
        check_thresholds: Thresholds | None = None,
        random: torch.Generator | None = None,
        honour_floor: float = 0.0,
    ) -> Iterator[StepRounding]:
        """Enter the mode for one training step's ops: what to record or replay (``step``), an optional
        calibrator, the replayer's unlogged-near thresholds when not tau/2, the stream that seeded random
        ops draw from (None: they are not routed), and the least threshold a replayer honours entries
        within (a calibration step's: the recorder's thresholds were still moving). Restored on exit."""
        self.step, self.calibrate, self.check_thresholds = step, calibrate, check_thresholds
        self.random, self.honour_floor = random, honour_floor
        try:
            # Ops that need no Python (views, exact ops, logged ops with nothing near a midpoint) run
            # natively; in a calibration step, logged calls only once the calibrator declines to measure
            # them (a calibrator that does not count its declines keeps every logged op in the mode).
            counts_declines = calibrate is None or hasattr(calibrate, "declined")
            logs = step.replay is None and counts_declines
            fast = (
                native.scope(
                    self._native_routes,
                    self.profile,
                    self.thresholds,
                    step,
                    logs,
                    self._round_for_native,
                    self.learned,
                    self.rules_revision,
                    calibrate if logs else None,
                    self._nesting,
                )
                if self.trace is None and self.native_route
                else contextlib.nullcontext()
            )
            with self, fast:
                yield step
        finally:
            self.step, self.calibrate, self.check_thresholds, self.random = None, None, None, None
            self.honour_floor = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        self._last.learned = None
        if self._finite_extremes and (fp32 := fp32_extremes(func, args, kwargs)) is not None:
            args, kwargs = fp32  # rules revision 12: torch.finfo(torch.float64).min as FP32's
        if func in _DEVICE_DROPOUT_OPS and (out := self._device_dropout(func, args)) is not None:
            return out
        plan = self._plans.get(id(func)) or _plan(func, self._revision)
        if plan.island and (narrow := islands.narrow_dtype(args, kwargs)) is not None:
            if narrow is torch.complex128:  # no island: an op on complex values (core/complexes.py)
                return self._complex(func, args, kwargs)
            return self._island(func, types, args, kwargs)
        if plan.decomposes and decompose.applies(func, args):
            # Only the sums (and log-softmax backward's exp) are machine dependent: they run as ops of the step
            # (rounded, logged, computed by the profile; by the native route where it takes them: see
            # _nested_op); the rest is plain IEEE arithmetic: exact outputs.
            steps = self._steps if self.rules_revision >= 10 else self._steps_before_10
            out = decompose.DECOMPOSITIONS[func](steps, *args, **kwargs)
            written = written_tensors(func, args, kwargs, out)
            for t in written:
                self._round_exact(t)
            if self.trace is not None:
                self._trace(func, written)
            return out
        if plan.composite is not None:  # no FP64 kernel: its parts are ops of the step (core/composites.py)
            with self:
                return plan.composite(*args, **kwargs)
        if kwargs:  # alpha= and the like: decided per call
            split = plan.splits and split_needed(func, kwargs)
            kind = (
                OpKind.EXACT if split else classify(func, kwargs, self._revision) if plan.alpha else plan.kind
            )
        else:  # the usual call: decided once, in the plan
            split = plan.splits_plain
            kind = OpKind.EXACT if split else plan.kind
        if plan.square and self.rules_revision >= 2 and squares(func, args, kwargs):
            kind = OpKind.EXACT  # x * x: exact in FP64 (oprules.RULES_REVISION)
        calibrating = self.calibrate is not None and kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION)
        before = snapshot(func, args) if calibrating or plan.scatter_terms else args
        # a scatter's rule takes its terms: what an in-place form added to, alpha from the keywords
        terms = tuple(bound_arguments(func, before, kwargs)) if plan.scatter_terms else args
        draw = randomness.handler_for(func, args, kwargs) if plan.random and self.random is not None else None
        if draw is not None:  # drawn from the stream (plain IEEE arithmetic), then rounded as its kind says
            out = draw(self.random, func, args, kwargs)
        elif split:
            out = run_split(func, args, kwargs)
        else:  # off the CPU: IEEE division, and factories as a CPU computes them (core/portable.py)
            out = portable.compute(self.profile, func, args, kwargs)
        if plan.unwritten is not None:
            plan.unwritten(args, out)
        for t in (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ():
            # complex from real arguments: a view or a cast moves values; an op with a complex number among
            # its arguments runs again as complexes.py says (rare, and out of place: nothing was written)
            if islands.unroundable(t) and (plan.island or not t.is_complex()):
                if t.is_complex() and (complexes.exact_call(func, args, kwargs) or complexes.written(func)):
                    return self._complex(func, args, kwargs)
                raise islands.UnroundableResult(func, t, self.module_path() if self.module_path else "")
        if plan.keep or kind is OpKind.KEEP or (plan.widening and _widens_floats(args)):
            return out
        targets = written_tensors(func, args, kwargs, out)
        if calibrating:
            self.calibrate(func, before, kwargs, targets, kind)
        taus: list[float] | None = None
        rounded = 0  # rounded outputs so far: the next one's position (rules revision 4: its threshold)
        for t in targets:
            if kind is OpKind.EXACT or self.step is None:
                self._round_exact(t)
            elif _rounded_output(t):
                if taus is None:
                    taus = self._call_taus(func, args, kwargs, sum(map(_rounded_output, targets)))
                self._round_logged(func, t, kind, terms, taus[min(rounded, len(taus) - 1)])
                rounded += 1
        if self.trace is not None:
            self._trace(func, targets)
        return out

    def _device_dropout(self, func: Any, args: tuple) -> Any:
        """A device's ``at::dropout`` inside a C++ composite (``native_dropout``, see
        :func:`detrl.core.portable.device_dropout_now`) as the CPU's ops of the step, and its backward
        (``native_dropout_backward`` of such a mask) as the CPU's ``mul`` by the noise; None for any other
        call of them (a model's own ``native_dropout``: an op of the step as it is)."""
        if func is aten.native_dropout.default:
            x, p, train = args[0], float(args[1]), args[2]
            if not portable.device_dropout_now() or train is False or not 0.0 < p < 1.0:
                return None
            with self:
                out, noise = cpu_composites.dropout_noise_as_on_cpu(x, p)
            mask = noise != 0  # native_dropout's second output, for its backward: not an op of the step
            self._device_noise[id(mask)] = noise
            weakref.finalize(mask, self._device_noise.pop, id(mask), None)
            return out, mask
        noise = self._device_noise.get(id(args[1]))
        if noise is None:
            return None
        with self:  # the backward of the CPU's x * noise
            return aten.mul.Tensor(args[0], noise)

    def _trace(self, func: Any, written: list[torch.Tensor]) -> None:
        """Add an op's rounded float outputs to the trace (ops inside a decomposition are its own parts:
        the decomposed op is traced once, for its outputs)."""
        outputs = [t for t in written if t.is_floating_point()]
        if outputs and self.step is not None and not self._nested and self.trace is not None:
            module = self.module_path() if self.module_path is not None else ""
            self.trace.add(op_name(func), module, outputs, canonical_nans(self.rules_revision))

    def _island(self, func, types, args, kwargs):  # noqa: ANN001, ANN202
        """An op on float32 or half tensors: computed in FP64 under the profile and rounded, with the log,
        exactly as its FP64 twin would be, then cast back to the op's own output dtype: exact for float32
        (the result is on the FP32 grid), a correctly rounded IEEE conversion of that agreed FP32 value for
        a half type (the same on every machine; see detrl/core/islands.py)."""
        wide_args, wide_kwargs, twins = islands.widen(args, kwargs)
        out = self.__torch_dispatch__(func, types, wide_args, wide_kwargs)
        written = written_tensors(func, args, kwargs, None)  # in-place and out= arguments, hidden writes
        return islands.narrow_back(func, args, kwargs, out, twins, written)

    def _complex(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op with a complex128 argument: written out as real ops of the step, or computed and rounded
        part by part where every machine computes it alike, or refused (detrl/core/complexes.py)."""
        written = None if complexes.exact_call(func, args, kwargs) else complexes.written(func)
        if written is not None:
            # refused below where this call has no rule (a fractional power, a complex alpha)
            with contextlib.suppress(complexes.NoRule), self:
                return written(*args, **kwargs)
        elif split_needed(func, kwargs):
            # a + alpha * b, addcmul, lerp (SGD's update): step by step, as for real tensors
            with self:
                return run_split(func, args, kwargs)
        if not complexes.exact_call(func, args, kwargs):
            leaves = tree_flatten((args, kwargs))[0]
            culprit = next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_complex()), None)
            if culprit is None:  # a complex dtype= only
                culprit = torch.empty(0, dtype=torch.complex128)
            raise islands.UnroundableResult(func, culprit, self.module_path() if self.module_path else "")
        out = self.profile(func, args, kwargs)
        targets = written_tensors(func, args, kwargs, out, complex_too=True)
        for t in targets:  # _round_exact leaves all but FP64 and complex128 as they are
            self._round_exact(t)
        if self.trace is not None:
            self._trace(func, targets)
        return out

    def _round_exact(self, t: torch.Tensor) -> None:
        # a complex result's parts: a lazy conjugate's stored ones (rounding commutes with negation)
        if t.dtype == torch.complex128:
            t = torch.view_as_real(t.conj() if t.is_conj() else t)
        if t.dtype != torch.float64 or t.numel() == 0 or t._is_zerotensor():  # zeros, with no memory to write
            return
        if kernel.applies(t):
            kernel.round_(t)
        else:
            rounded = self._scratch.get("round", t, torch.float32)
            t.copy_(rounded.copy_(t))  # round to nearest FP32 through a reused buffer
        if self.step is not None and not self._nested:
            self.step.stats.rounded_elements += t.numel()

    def _nesting(self, delta: int) -> None:
        """The native route writes a decomposition out (``native.Route.DECOMPOSED_*``): a step of it this
        mode takes (a sum with an element near a midpoint) is the decomposed op's part, as in
        :meth:`_nested_op`."""
        self._nested += delta

    def _logged_sum(self, t: torch.Tensor, dims: list[int]) -> torch.Tensor:
        """``t.sum(dims)`` dispatched as an op of the step (this mode, or the native route where it takes the
        op), for decompositions (not counted as rounded output)."""
        return self._nested_op(torch.sum, t, dims)

    def _logged_exp(self, t: torch.Tensor) -> torch.Tensor:
        """``exp(t)`` dispatched as an op of the step (rounded, logged as elementwise), for decompositions."""
        return self._nested_op(torch.exp, t)

    def _nested_op(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        self._nested += 1
        routed = False
        try:
            routed = native.nest()  # the native route takes it where it would take the op outside
            with self:
                return fn(*args)
        finally:
            try:
                if routed:
                    native.unnest()
            finally:
                self._nested -= 1

    # ------------------------------------------------------------------ the logged path
    def _call_taus(self, func: Any, args: tuple, kwargs: dict, outputs: int) -> list[float]:
        """The thresholds of a logged call's ``outputs`` rounded outputs (float64, with an element; in
        order): its class's (:func:`call_class`) where the thresholds have one, an output's own where it
        has one (:func:`output_key`), else its op's. The native route learns them from here, per call key
        (``learned``)."""
        name = op_name(func)
        per_class = self.thresholds.per_class
        cls = (
            call_class(name, args, kwargs, self.rules_revision)
            if per_class and name in self._classed_ops()
            else None
        )
        if outputs > 1 and cls is not None:
            taus = [self.thresholds.tau_of(name, cls, i) for i in range(outputs)]
        else:
            taus = [self.thresholds.tau_of(name, cls)]
        self._last.learned = (tuple(taus), cls is not None and cls in per_class)
        return taus

    def _classed_ops(self) -> frozenset[str]:
        per_class = self.thresholds.per_class
        if self._classed[0] is not per_class or self._classed[1] != len(per_class):
            self._classed = (per_class, len(per_class), self.thresholds.classed_ops())
        return self._classed[2]

    def learned(self) -> tuple[tuple[float, ...], bool] | None:
        """The thresholds of the last logged call rounded here (one, or one per rounded output), and whether
        they are its class's own (final once calibration declines the class), then forgotten; None if none
        was (for the native route)."""
        learned = getattr(self._last, "learned", None)
        self._last.learned = None
        return learned

    def _round_for_native(
        self, func: Any, elementwise: bool, x: torch.Tensor, args: tuple, tau: float
    ) -> None:
        """An elementwise op's output, or a reduction's (``args``: what its unit needs), rounded with its log
        entries at threshold ``tau``: for the native route, which ran the op and found an element near a
        midpoint."""
        self._round_logged(func, x, OpKind.ELEMENTWISE if elementwise else OpKind.REDUCTION, args, tau)

    def _round_logged(self, func: Any, x: torch.Tensor, kind: OpKind, args: tuple, tau: float) -> None:
        step = self.step
        assert step is not None
        if step.flush_numbers is not None:
            step.flush_numbers()
        seq = step.seq
        step.seq += 1
        name = op_name(func)
        step.op_names.append(name)
        if not self._nested:
            step.stats.rounded_elements += x.numel()
        scaled: bool | Scale = kind is OpKind.REDUCTION
        if scaled:
            scaled = reduction_scale(func, args, x, self.rules_revision) or True
        # rules revisions 2 and 3: elements every machine sums alike need no entry (scale.exact_elements);
        # found only where some element is near a midpoint (most calls have none)
        sums = exact_rule(func, self.rules_revision)
        zeros = scaled is not False and negative_zeros(self.rules_revision)
        nans = nans_unlogged(self.rules_revision)
        if step.replay is None:
            if kernel.applies(x, strided=True):  # native: test, compact and round, in one pass
                # A strided view (split, in place on it) goes as a dense copy, whose flat order is the
                # logical row-major order of the entries.
                dense = x.contiguous()
                entries = kernel.take_entries_(dense, tau, scaled, seq, zeros, nans)
                if dense is not x:
                    x.copy_(dense)
            else:
                rounded = x.to(torch.float32)
                near = near_midpoint(
                    x,
                    tau,
                    scaled,
                    rounded=rounded,
                    scratch=self._scratch,
                    negative_zeros=zeros,
                    skip_nans=nans,
                )
                idx = near.reshape(-1).nonzero().squeeze(1)
                entries = None
                if idx.numel():
                    entries = entries_for(seq, idx, _take(x, idx), _uncertainty(x, rounded, idx, tau, scaled))
                x.copy_(rounded)
                if entries is not None:
                    entries = split_short(entries, x, tau, scaled)  # x is rounded now
            if entries is not None and sums and (exact := exact_elements(func, args, x)) is not None:
                entries = _without(entries, exact)[0]
                entries = entries if entries.last_index() >= 0 else None
            if entries is not None:
                step.recorded.append(entries)
                step.stats.logged += (
                    len(entries.indices) + len(entries.pinned_indices) + len(entries.short_indices)
                )
            return
        rounded = x.to(torch.float32)
        exact = (lambda: exact_elements(func, args, x)) if sums else None
        self._replay(step, seq, name, x, rounded, tau, scaled, exact, zeros)
        x.copy_(rounded)

    def _replay(
        self,
        step: StepRounding,
        seq: int,
        name: str,
        x: torch.Tensor,
        rounded: torch.Tensor,
        tau: float,
        scaled: bool | Scale,
        exact: Callable[[], torch.Tensor | None] | None = None,
        zeros: bool = False,
    ) -> None:
        """Apply the log to ``rounded`` and check it: an entry is honoured only where this machine also
        sees the element near a midpoint (within 2 tau) or, for a pinned value, within reach of it, and
        never for an element every machine computes alike (``exact()``: a flat mask, rules revision 2).
        With ``zeros`` (a reduction from rules revision 7) an unlogged element near a midpoint whose
        check window reaches a value that rounds to zero is the recorder's +0 (:func:`_unlogged_zeros`)."""
        entries = step.entries(seq, x.numel(), name)
        # The bundle's thresholds are the trainer's claim: its log is checked against at least the floor
        # an honest calibration cannot go below, so a bundle that lowers its own thresholds gains nothing.
        claimed = max(tau, auditor_floor(scaled is not False))
        check_tau = (
            self.check_thresholds.tau(name) if self.check_thresholds else claimed * REPLAY_CHECK_FRACTION
        )
        honour = max(tau, self.honour_floor)  # the largest threshold the recorder may have logged it with
        flat_near = near_midpoint(
            x,
            check_tau,
            scaled,
            rounded=rounded,
            scratch=self._scratch,
            negative_zeros=zeros,
            skip_nans=nans_unlogged(self.rules_revision),
        ).reshape(-1)
        mask = None
        if exact is not None and (
            bool(flat_near.any()) or (entries is not None and entries.last_index() >= 0)
        ):
            mask = exact()
        if mask is not None:
            flat_near = flat_near & ~mask.to(flat_near.device)
        if entries is not None and (last := entries.last_index()) >= 0:  # -1: no entry of any kind
            if last >= x.numel():
                self._anomaly(seq, name, last, "logged-index-out-of-range")
                raise LogOutOfRange(seq, name, last, x.numel())
            if mask is not None:  # an entry for an element no machine rounds otherwise: refuse it
                entries, first, refused = _without(entries, mask)
                if refused:
                    step.stats.refused += refused
                    self._anomaly(seq, name, first, "logged-not-near")
            flat_near = flat_near.clone()
            if len(entries.indices):
                self._apply_directions(step, seq, name, x, rounded, entries, honour, scaled)
                flat_near[torch.from_numpy(entries.indices).to(x.device)] = False
            if len(entries.pinned_indices):
                self._apply_pinned(step, seq, name, x, rounded, entries, honour, scaled)
                flat_near[torch.from_numpy(entries.pinned_indices).to(x.device)] = False
            if len(entries.short_indices):
                # The value whose key has the logged low 16 bits nearest this machine's own rounding; then
                # the pinned checks: a forged low half names a value within 2**15 keys of ours, which
                # the reach check bounds like any pinned value.
                sidx = torch.from_numpy(entries.short_indices).to(x.device)
                own = _take(rounded, sidx).cpu().numpy()
                values = nearest_with_low16(own, entries.short_bits)
                as_pinned = OpEntries(
                    op=entries.op,
                    indices=entries.indices[:0],
                    up=entries.up[:0],
                    pinned_indices=entries.short_indices,
                    pinned_values=values,
                )
                self._apply_pinned(step, seq, name, x, rounded, as_pinned, honour, scaled)
                flat_near[sidx] = False
        if zeros and bool(flat_near.any()):
            flat_near = _unlogged_zeros(step, x, rounded, flat_near, check_tau, scaled)
        n_unlogged = int(flat_near.sum())
        if n_unlogged:
            step.stats.unlogged_near += n_unlogged
            self._anomaly(seq, name, int(flat_near.nonzero()[0, 0]), "unlogged-near")

    def _apply_directions(self, step, seq, name, x, rounded, entries, tau, scaled) -> None:  # noqa: ANN001
        idx = torch.from_numpy(entries.indices).to(x.device)
        want_up = torch.from_numpy(entries.up.astype(np.bool_)).to(x.device)
        xs, rs = _take(x, idx), _take(rounded, idx)
        t2 = 2 * _uncertainty(x, rounded, idx, tau, scaled)
        honoured = (xs - t2).to(torch.float32) != (xs + t2).to(torch.float32)
        if not bool(honoured.all()):  # a log entry for an element far from any midpoint: refuse it
            step.stats.refused += int((~honoured).sum())
            bad = int((~honoured).nonzero()[0, 0])
            far = _midpoint_distance(xs[bad], t2[bad] / 2)
            self._anomaly(seq, name, int(idx[bad]), "logged-not-near", far)
        wrong = (rs.double().abs() > xs.abs()) != want_up
        wrong &= honoured
        n_wrong = int(wrong.sum())
        step.stats.logged += idx.numel()
        if n_wrong:
            step.stats.corrected += n_wrong
            toward = torch.where(want_up, torch.copysign(torch.full_like(rs, math.inf), xs.float()), 0.0)
            _put(rounded, idx, torch.where(wrong, torch.nextafter(rs, toward.to(rs.dtype)), rs))
            self._anomaly(seq, name, int(idx[wrong.nonzero()[0, 0]]), "logged-direction-differs")

    def _apply_pinned(self, step, seq, name, x, rounded, entries, tau, scaled) -> None:  # noqa: ANN001
        idx = torch.from_numpy(entries.pinned_indices).to(x.device)
        values = torch.from_numpy(entries.pinned_values).to(x.device)
        xs, vs = _take(x, idx), values.double()
        # The recorder's value is within half a spacing of its FP32 rounding and within tau/margin of ours.
        t = _uncertainty(x, rounded, idx, tau, scaled)
        # a zero's own spacing is the smallest subnormal's (spacing32 gives 2**-24 there, frexp's exponent 0)
        reach = 2 * t + torch.where(vs == 0, 2.0**-149, spacing32(vs))
        # A NaN is pinned where its first argument is a NaN (revision 11's units): a NaN here honours it, and
        # takes its sign and payload (IEEE leaves them to the order of operands).
        honoured = ((xs - vs).abs() <= reach) | (xs.isnan() & vs.isnan())
        if not bool(honoured.all()):  # a pinned value this machine cannot have computed: refuse it
            step.stats.refused += int((~honoured).sum())
            bad = int((~honoured).nonzero()[0, 0])
            far = float((xs[bad] - vs[bad]).abs() / t[bad].clamp(min=1e-300))
            self._anomaly(seq, name, int(idx[bad]), "pinned-value-far", far)
        step.stats.logged += idx.numel()
        rs = _take(rounded, idx)
        changed = honoured & (rs.view(torch.int32) != values.view(torch.int32))  # bits: -0 is not +0
        if bool(changed.any()):
            step.stats.corrected += int(changed.sum())
            _put(rounded, idx, torch.where(honoured, values, rs))
            self._anomaly(seq, name, int(idx[changed.nonzero()[0, 0]]), "pinned-value-differs")

    def _anomaly(self, seq: int, name: str, index: int, kind: str, distance: float | None = None) -> None:
        step = self.step
        assert step is not None
        if step._kept.get(kind, 0) < step.max_anomalies:
            module = self.module_path() if self.module_path is not None else ""
            step.keep(Anomaly(op=seq, name=name, module=module, index=index, kind=kind, distance=distance))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the rounding mode decides about an op once, not at every call (per call, only what depends on
    its arguments): whether it may be decomposed, split or routed to a random stream, its kind, and
    whether its output needs no rounding at all."""

    decomposes: bool  # has a decomposition (decompose.applies decides per call)
    splits: bool  # a fused op computed step by step (fused.split_needed decides per call)
    splits_plain: bool  # ... when called without keyword arguments (alpha = 1)
    alpha: bool  # its kind depends on ``alpha`` (oprules.classify decides per call)
    kind: OpKind
    random: bool  # draws randomness (randomness.handler_for routes it)
    keep: bool  # a view, or a KEEP op: its outputs are its inputs' values
    widening: bool  # a cast: to FP64 from a narrower float type, its output is on the FP32 grid already
    square: bool  # pow by a number: its kind depends on the exponent (oprules.squares decides per call)
    #: a float32 or half argument makes it an island (:meth:`RoundingMode._island`); not for a view or a KEEP
    #: op (it moves values), a cast, an op that takes float32 arguments by design (oprules.AS_GIVEN), or one
    #: that changes only its argument's shape or strides (``unsqueeze_``, ``t_``: torch's ``inplace_view``
    #: tag; a twin would take the new shape and leave the original's as it was)
    island: bool
    unwritten: Callable[[Any, Any], None] | None  # sets what its kernel leaves unwritten (oprules.UNWRITTEN)
    composite: Callable[..., Any] | None  # the ops it runs as, having no FP64 kernel (composites.COMPOSITES)
    #: a scatter with an exactness rule (oprules.EXACT_SCATTERS): scale.exact_scatter_elements takes all its
    #: arguments, with a copy of what an in-place form adds to, taken before it runs
    scatter_terms: bool


#: per rules revision, by id(): an OpOverload's __hash__ is Python code, called at every op
_PLANS: dict[int, dict[int, _Plan]] = {}
#: Casts between float types: to FP64 from a narrower type they need no rounding (see :func:`_widens_floats`).
CASTS = frozenset({torch.ops.aten._to_copy.default})


#: A device's dropout and its backward (:meth:`RoundingMode._device_dropout`).
_DEVICE_DROPOUT_OPS = frozenset({aten.native_dropout.default, aten.native_dropout_backward.default})


def _inverse_root(t: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(t)``, both correctly rounded (``Steps.inv_sqrt`` from rules revision 10)."""
    return 1.0 / portable.ieee_sqrt(t)


def plan_of(func: Any, rules_revision: int = RULES_REVISION) -> _Plan:
    """What the mode decides about ``func`` once (cached), under rules revision ``rules_revision``."""
    return _PLANS.get(rules_revision, {}).get(id(func)) or _plan(func, rules_revision)


def _plan(func: Any, rules_revision: int) -> _Plan:
    kind = classify(func, {}, rules_revision)
    keep, widening = bool(func.is_view) or kind is OpKind.KEEP, func in CASTS
    in_place_view = torch.Tag.inplace_view in func.tags
    plan = _Plan(
        decomposes=func in decompose.DECOMPOSITIONS,
        splits=split_needed(func, {}) or split_needed(func, {"alpha": 2}),
        splits_plain=split_needed(func, {}),
        alpha=classify(func, {"alpha": 2}, rules_revision) is not kind,
        kind=kind,
        random=randomness.draws_randomness(func),
        keep=keep,
        widening=widening,
        square=func in SQUARES,
        island=not (keep or widening or in_place_view or func.overloadpacket in AS_GIVEN),
        unwritten=UNWRITTEN.get(func),
        composite=COMPOSITES.get(func) or complexes.COMPOSITES.get(func),
        scatter_terms=rules_revision >= 9 and func in EXACT_SCATTERS,
    )
    _PLANS.setdefault(rules_revision, {})[id(func)] = plan
    return plan


def _without(entries: OpEntries, exact: torch.Tensor) -> tuple[OpEntries, int, int]:
    """``entries`` without those at elements the flat bool mask ``exact`` holds, the first such index
    (-1: none) and how many there were."""
    mask = exact.cpu().numpy()
    kinds = [entries.indices, entries.pinned_indices, entries.short_indices]
    keep = [~mask[idx] for idx in kinds]
    dropped = [idx[~k] for idx, k in zip(kinds, keep, strict=True)]
    n = sum(len(d) for d in dropped)
    if n == 0:
        return entries, -1, 0
    first = min(int(d[0]) for d in dropped if len(d))
    kept = OpEntries(
        op=entries.op,
        indices=entries.indices[keep[0]],
        up=entries.up[keep[0]],
        pinned_indices=entries.pinned_indices[keep[1]],
        pinned_values=entries.pinned_values[keep[1]],
        short_indices=entries.short_indices[keep[2]],
        short_bits=entries.short_bits[keep[2]],
    )
    return kept, first, n


def _widens_floats(args: tuple) -> bool:
    """A cast's input is a narrower float type: every value is on the FP32 grid, so is the FP64 output."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype in islands.NARROW


class LogOutOfRange(Exception):
    def __init__(self, seq: int, name: str, index: int, numel: int) -> None:
        super().__init__(f"rounding log entry for op #{seq} ({name}) has index {index} >= {numel} elements")


def _uncertainty(
    x: torch.Tensor, rounded: torch.Tensor, idx: torch.Tensor, tau: float, scaled: bool | Scale
) -> torch.Tensor:
    """T at the elements ``idx`` (FP64, shape (n,)): tau units of ``scaled`` (a :class:`Scale`), tau
    spacings at their channel's scale, or at the element itself (see :func:`near_midpoint`)."""
    if isinstance(scaled, Scale):
        return scaled.at(idx) * tau
    if not scaled:
        return _element_uncertainty(_take(x, idx), tau)
    t = scale_spacing(rounded).mul_(tau).reshape(-1)
    if t.numel() == 1:
        return t.expand(idx.numel())
    inner = math.prod(x.shape[2:])  # channel of a row-major index in (N, C, *S)
    return t[(idx // inner) % x.shape[1]]


def _unlogged_zeros(
    step: StepRounding,
    x: torch.Tensor,
    rounded: torch.Tensor,
    flat_near: torch.Tensor,
    check_tau: float,
    scaled: bool | Scale,
) -> torch.Tensor:
    """Rules revision 7, a reduction's replay: the unlogged near elements (``flat_near``, a flat mask) whose
    check window ``[|x| - T, |x| + T]`` (T at ``check_tau``) reaches a value that rounds to zero are set to +0
    in ``rounded``; returns the mask of the others, which stay unlogged-near.

    Why +0: the recorder logs every element near a midpoint at its threshold tau but its exact zeros and
    the positive values that round to +0 (:func:`near_midpoint`). An honest replay is within tau/2 = T of
    the recorder's FP64 value; where this machine sees the element near a midpoint within T and holds no
    entry for it, the recorder's value was not near within tau (its window of 2T around this one's holds
    the midpoint), so it was one of those. A sum whose terms cancel exactly gives +0 in round to nearest,
    and on another order leaves rounding noise: the layer-norm-then-mean model diverged there. An exact -0
    (a copy of one, a ceiling, a sum of -0 terms) is the same -0 on every machine, and this one's exact
    zero is never near, so it keeps its own. What this takes on trust: an op whose kernel multiplies a sum
    that cancelled exactly by a negative factor (-0) while another order leaves noise; that replay
    diverges at the step, it is not accepted. A dishonest log gains nothing: a +0 where the recorder had
    another value differs from its commitments.
    """
    idx = flat_near.nonzero().squeeze(1)
    xs = _take(x, idx)
    t = _uncertainty(x, rounded, idx, check_tau, scaled)
    to_zero = (xs.abs() - t).to(torch.float32) <= 0  # the window reaches a value that rounds to zero
    if not bool(to_zero.any()):
        return flat_near
    zeroed = idx[to_zero]
    step.stats.corrected += int((_take(rounded, zeroed).view(torch.int32) != 0).sum())
    _put(rounded, zeroed, torch.zeros(zeroed.numel(), dtype=rounded.dtype, device=rounded.device))
    flat_near = flat_near.clone()
    flat_near[zeroed] = False
    return flat_near


def _element_uncertainty(values: torch.Tensor, tau: float) -> torch.Tensor:
    """T of elementwise ops at FP64 ``values``: tau spacings at each, ``|v| * 2**-23`` bounding the spacing,
    at least tau subnormal spacings and finite for infinities (:func:`near_midpoint`'s rule)."""
    return (values.abs() * (tau * 2.0**-23)).clamp_(min=tau * 2.0**-149, max=tau * 2.0**104)


def _midpoint_distance(x: torch.Tensor, t: torch.Tensor) -> float:
    """How many ``t`` FP64 scalar ``x`` lies from the nearest FP32 rounding midpoint (the two around its
    own FP32 rounding; each midpoint of FP32 neighbours is exact in FP64)."""
    r = x.to(torch.float32).reshape(1)
    up = torch.nextafter(r, torch.tensor([math.inf], device=r.device)).double()  # on x's device (CUDA too)
    down = torch.nextafter(r, torch.tensor([-math.inf], device=r.device)).double()
    rd = r.double()
    d = torch.minimum((x - (rd + up) / 2).abs(), (x - (rd + down) / 2).abs())
    return float(d / t.clamp(min=1e-300))


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)[idx] if x.is_contiguous() else x.flatten()[idx]


def _put(x: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    if x.is_contiguous():
        x.view(-1)[idx] = values
    else:
        x[torch.unravel_index(idx, x.shape)] = values


_WRITES: dict[int, tuple[int, ...]] = {}  # by id(), as _PLANS: hashing an OpOverload runs Python code
_HIDDEN_WRITES = {id(func): positions for func, positions in HIDDEN_WRITES.items()}


def _schema_writes(func: Any) -> tuple[int, ...]:
    """Positions of the arguments ``func``'s schema marks as written (in-place, ``out=``, foreach lists)."""
    writes = _WRITES.get(id(func))
    if writes is None:
        writes = _WRITES[id(func)] = tuple(
            i
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return writes


def _hidden_writes(func: Any, args: tuple) -> list[torch.Tensor]:
    return [
        args[i]
        for i in _HIDDEN_WRITES.get(id(func), ())
        if i < len(args) and isinstance(args[i], torch.Tensor)
    ]


def snapshot(func: Any, args: tuple) -> tuple:
    """The op's arguments, with copies of those it will write (so a rerun sees the inputs, untouched)."""
    written = set(_schema_writes(func)) | set(_HIDDEN_WRITES.get(id(func), ()))
    out = []
    for i, a in enumerate(args):
        if i in written and isinstance(a, torch.Tensor):
            a = a.clone()
        elif i in written and isinstance(a, (list, tuple)):
            a = type(a)(t.clone() if isinstance(t, torch.Tensor) else t for t in a)
        out.append(a)
    return tuple(out)


def _rounded_output(t: torch.Tensor) -> bool:
    """Whether ``t`` is a rounded output of a logged op, one with a threshold (:func:`output_key` counts
    them): float64 with an element, and memory (no "zero tensor"), as the native route's ``rounded_output``."""
    return t.dtype == torch.float64 and t.numel() > 0 and not t._is_zerotensor()


def written_tensors(
    func: Any, args: tuple, kwargs: dict, out: Any, complex_too: bool = False
) -> list[torch.Tensor]:
    """The tensors an op produced: its mutated arguments if it has any, else its floating outputs (and its
    complex ones, with ``complex_too``)."""
    written: list[torch.Tensor] = []
    writes = _schema_writes(func)
    if writes:
        for i in writes:
            value = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
            if isinstance(value, torch.Tensor):  # the usual case, without a pytree walk (every op pays it)
                written.append(value)
                continue
            flat, _ = tree_flatten(value)
            written.extend(t for t in flat if isinstance(t, torch.Tensor))
        return written
    if isinstance(out, torch.Tensor):
        outs = [out] if out.is_floating_point() or (complex_too and out.is_complex()) else []
    else:
        flat, _ = tree_flatten(out)
        outs = [
            t
            for t in flat
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or (complex_too and t.is_complex()))
        ]
    return outs + _hidden_writes(func, args) if id(func) in _HIDDEN_WRITES else outs
