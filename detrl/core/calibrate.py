"""Threshold calibration: how far apart can two machines' FP64 results of one op be?

During the first recorded step(s), :class:`Calibrator` reruns logged ops under each emulated hardware
profile on the same inputs and measures the largest FP64 disagreement with the result actually computed,
in the op kind's units (FP32 spacings at the element, or at the output's largest magnitude for
reductions). It keeps the live :class:`~detrl.core.rounding.Thresholds` up to date as it goes, so each op call
it measures is logged with a threshold covering its own measured disagreement:

    tau(op kind) = clamp(margin x largest disagreement so far, floor, TAU_CAP)

where the floor is TAU_FLOOR_MEASURED for reductions whose disagreement the profiles produce, and
TAU_FLOOR for everything else.

Calibration is bounded: each *shape class* of calls (:func:`shape_class`: the op, the dtype, rank and
stride order of every tensor argument, and the values of its structural arguments) is measured at most
``max_per_class`` times over all calibration steps. A model's layers make the same kinds of calls again
and again, with disagreements alike, so measuring every one of them (the old rule) mostly repeated work:
ten times a later step's time for ResNet-50. A call of sizes not measured yet (its *call class*,
:func:`call_class`) is measured too, and the class gets a threshold of its own,

    tau(call class) = clamp(margin x the class's largest disagreement, floor, TAU_CAP),

where the profiles disagree on it at all; the op kind's threshold is the largest of its classes'. A call
that is not measured is logged with its class's threshold, else its op kind's so far, which always
includes a measurement of that op kind: the first call of a kind opens a new class and is measured
before it is rounded.

A measured call is rerun only under the profiles that can change its bits (an op a profile does not
reorder, on the CPU, disagrees by 0 under it: ``exp`` but under the profile with another libm), and a call too large to rerun whole (GPT-2's 50,257-wide logits and their
gradients, ResNet's convolutions) on evenly spread rows of its result (:func:`_sample`), measured in the
units of the whole result: the calibration step of GPT-2 small had cost 5.4 later steps.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from detrl.core.dispatch import bound_arguments, registrar
from detrl.core.oprules import RULES_REVISION, OpKind, call_class, op_name, shape_class
from detrl.core.rounding import (
    TAU_FLOOR,
    TAU_FLOOR_MEASURED,
    Thresholds,
    output_key,
    snapshot,
    written_tensors,
)
from detrl.core.scale import Scale, reduction_scale, scale_spacing, spacing32

if TYPE_CHECKING:  # the profiles are the engine's to build: calibration only runs them
    from detrl.core.hardware import Profile

aten = torch.ops.aten

DEFAULT_MARGIN = 16.0
# TAU_FLOOR (2**-22): libm and FMA differences of elementwise ops, and every op whose disagreement the
# emulated profiles cannot show (they compute it natively): there tau cannot come from a measurement.
# TAU_FLOOR_MEASURED (2**-26): for reductions the profiles do reorder, the measurement (x margin) is the
# threshold, down to this. Both live with the thresholds in rounding, where the auditor enforces them.
TAU_CAP = 2.0**-4
#: Seed of the random accumulation orders calibration measures (emulated:atomic), reseeded every step.
CALIBRATION_SEED = 0x5EED_CA1B
#: The profiles calibration measures against, each built with ``seed=CALIBRATION_SEED``.
PROFILES = ("emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic")
#: Measurements per shape class: two, so that a class's threshold rests on two sets of input values (a
#: repeated layer's first call may see unusually tame data, e.g. freshly initialised activations).
DEFAULT_MAX_PER_CLASS = 2
#: The key of :meth:`Calibrator.state` under which the class counts are (not a possible op name).
CLASSES_KEY = "#classes"
#: ... and the largest disagreement measured per call class (:func:`call_class`: with sizes).
CLASS_WORST_KEY = "#class-worst"
#: A measured call whose largest tensor (an argument or a result) holds more elements than this is measured
#: on a sample of its rows (:func:`_sample`): evenly spread rows of about this many elements of that tensor,
#: at least :data:`MIN_SAMPLED_ROWS` of them. GPT-2 small's logits and their gradients (50,257 wide: 25.7M
#: elements, products of 20 GFLOP) were measured whole under each of the four profiles. 2**14 (2**16 before):
#: each profile still meets over 16,000 results of a sampled call, and the character LSTM's calibration step,
#: whose 512-row products and bias-gradient sums were a third of it, fell from 2.3x to 2.0x a later step.
DEFAULT_SAMPLE_ELEMENTS = 1 << 14
MIN_SAMPLED_ROWS = 8


class CalibrationCapWarning(RuntimeWarning):
    """A call class's measured disagreement times the margin is above :data:`TAU_CAP`: its threshold is
    capped there, so its log cannot cover what another machine may compute (the class's results cancel at
    their own unit's scale). Every op detrl knows to cancel so is written out (batch, layer and group norm,
    the softmax backwards) or measured in its terms' units (sums, rules revision 5); this names any other."""


class Calibrator:
    """Measures per-op-kind disagreement between profiles and updates ``thresholds`` in place.

    ``profiles``: the alternatives to measure against, as built by the caller: the engine builds
    :data:`PROFILES` with ``seed=CALIBRATION_SEED``, so that the thresholds (and so the log's bytes) are
    the same in every recording of a config.

    ``max_per_class``: measurements per :func:`shape_class` over all calibration steps (None: every call,
    the unbounded calibration). Counts, like the disagreements, are part of :meth:`state`, so a recording
    resumed inside calibration measures the calls an uninterrupted one does.

    ``sample_elements``: a call with a larger tensor is measured on a sample of its rows (:func:`_sample`;
    None: every call whole)."""

    def __init__(
        self,
        thresholds: Thresholds,
        profiles: Sequence[Profile],
        margin: float = DEFAULT_MARGIN,
        max_per_class: int | None = DEFAULT_MAX_PER_CLASS,
        sample_elements: int | None = DEFAULT_SAMPLE_ELEMENTS,
        per_output: bool = True,
        rules_revision: int = RULES_REVISION,
    ) -> None:
        if max_per_class is not None and max_per_class < 1:
            raise ValueError(f"max_per_class must be at least 1 (or None), not {max_per_class}")
        if sample_elements is not None and sample_elements < 1:
            raise ValueError(f"sample_elements must be at least 1 (or None), not {sample_elements}")
        self.thresholds = thresholds
        self.margin = margin
        self.max_per_class = max_per_class
        self.sample_elements = sample_elements
        #: a class's calls with several rounded outputs give each a threshold of its own (rules revision 4)
        self.per_output = per_output
        #: the rules the recording follows: its units (scale.reduction_scale) are the ones measured in
        self.rules_revision = rules_revision
        self.profiles = list(profiles)
        self.worst: dict[str, float] = {}
        #: the largest disagreement measured per call class (:func:`call_class`), each measured at least once
        self.class_worst: dict[str, float] = {}
        #: measurements so far per shape class (only counted when bounded)
        self.classes: dict[str, int] = {}
        #: op calls seen, measured, and declined for a class measured enough (this session, for reports and
        #: the native route, which rounds calls it has seen declined itself; not checkpointed)
        self.calls = 0
        self.calibrated_calls = 0
        self.declined = 0
        #: the ops warned about: a call class measured past what TAU_CAP covers (CalibrationCapWarning)
        self.capped: set[str] = set()

    def begin_step(self, step: int) -> None:
        """Reseed the random-order profiles for ``step``: a resumed recording calibrates as an uninterrupted
        one does."""
        for prof in self.profiles:
            reseed = getattr(prof, "reseed", None)
            if reseed is not None:
                reseed(CALIBRATION_SEED + step)

    def state(self) -> dict[str, Any]:
        """What a checkpoint inside calibration carries: the largest disagreement measured so far per op,
        under :data:`CLASSES_KEY` (no op's name) the measurements per shape class and under
        :data:`CLASS_WORST_KEY` the largest disagreement per call class. Flat, as it was before classes were
        counted, so a state still reads as ``{op: disagreement}``."""
        return {
            **dict(sorted(self.worst.items())),
            CLASSES_KEY: dict(sorted(self.classes.items())),
            CLASS_WORST_KEY: dict(sorted(self.class_worst.items())),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state` (read from a bundle: every entry checked). A state without
        :data:`CLASSES_KEY` (written before classes were counted) loads with no class measured yet; one
        without :data:`CLASS_WORST_KEY` (before classes had thresholds) with no class threshold."""
        if not isinstance(state, Mapping):
            raise TypeError(f"calibration state: a mapping, not {type(state).__name__}")
        worst = {k: v for k, v in state.items() if k not in (CLASSES_KEY, CLASS_WORST_KEY)}
        classes = state.get(CLASSES_KEY, {})
        class_worst = state.get(CLASS_WORST_KEY, {})
        if not isinstance(classes, Mapping) or not isinstance(class_worst, Mapping):
            raise TypeError(f"calibration state: {CLASSES_KEY} and {CLASS_WORST_KEY} must be mappings")
        parsed_worst = _disagreements(worst, "disagreement")
        parsed_classes: dict[str, int] = {}
        for k, v in classes.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"calibration state: class count {k!r}: {v!r}")
            # a class is counted only with a measurement of its op, which the disagreements then hold
            if k.partition("(")[0] not in parsed_worst:
                raise ValueError(f"calibration state: class {k!r} of an op with no measurement")
            parsed_classes[k] = v
        parsed_class_worst = _disagreements(class_worst, "class disagreement")
        for k, v in parsed_class_worst.items():
            if parsed_worst.get(k.partition("(")[0], -1.0) < v:  # an op's is the largest of its classes'
                raise ValueError(f"calibration state: class disagreement {k!r} above its op's")
        self.worst, self.classes, self.class_worst = parsed_worst, parsed_classes, parsed_class_worst

    def __call__(
        self, func: Any, before: tuple, kwargs: dict, produced: list[torch.Tensor], kind: OpKind
    ) -> None:
        """``before``: the op's inputs as they were before it ran; ``produced``: its unrounded results."""
        if not any(t.dtype == torch.float64 for t in produced):
            return
        name = op_name(func)
        self.calls += 1
        sized = call_class(name, before, kwargs, self.rules_revision)
        if self.max_per_class is not None:
            key = shape_class(name, before, kwargs)
            seen = self.classes.get(key, 0)
            # A new class is measured, so an op kind's first call always is: the threshold an unmeasured
            # call is logged with (``thresholds.per_op[name]``) always rests on a measurement. So is a
            # call of new sizes, which has a threshold of its own (``thresholds.per_class``).
            if seen >= self.max_per_class and name in self.worst and sized in self.class_worst:
                self.declined += 1
                return
            self.classes[key] = seen + 1
        self.calibrated_calls += 1
        class_worst = self.class_worst.get(sized, 0.0)
        profiles = self._rerunning(func, before, kwargs, produced)
        if profiles:
            # the rounded outputs' positions (rounding.output_key: float64, with an element)
            slots = [i for i, a in enumerate(produced) if a.dtype == torch.float64 and a.numel()]
            sample = _sample(func, before, produced, self.sample_elements, kwargs)
            if sample is None:
                args = before
                # each result's unit once, not once per profile: the same for every alternative it meets
                units = [
                    _unit(func, before, a, kind, self.rules_revision)
                    if a.dtype == torch.float64 and a.numel()
                    else None
                    for a in produced
                ]
            else:  # the rows' own results, in the units the whole results are logged in
                args, rows = sample.args, sample.rows
                revision = self.rules_revision
                units = [
                    _unit(func, before, a, kind, revision)
                    if d is None
                    else _unit(func, before, a, kind, revision, args, d, rows)
                    for a, d in zip(produced, sample.dims, strict=True)
                ]
                produced = [
                    a if d is None else a.index_select(d, rows) for a, d in zip(produced, sample.dims)
                ]
            # each rounded output's largest disagreement (with its earlier calls')
            outputs = {i: self.class_worst.get(output_key(sized, k), 0.0) for k, i in enumerate(slots)}
            for prof in profiles:
                fresh = snapshot(func, args)  # in-place ops must not touch the snapshot
                alt = written_tensors(func, fresh, kwargs, prof(func, fresh, kwargs))
                for i, (a, b, unit) in enumerate(zip(produced, alt, units)):
                    if i in outputs and b.dtype == torch.float64 and a.shape == b.shape:
                        outputs[i] = max(outputs[i], _disagreement(a, b, unit))
            class_worst = max(class_worst, *outputs.values(), 0.0)
            if self.per_output and len(slots) > 1:  # each output's own threshold, where it has a disagreement
                for k, i in enumerate(slots):
                    if outputs[i] > 0:
                        self.class_worst[output_key(sized, k)] = outputs[i]
                        self.thresholds.per_class[output_key(sized, k)] = self._tau(kind, outputs[i])
        worst = self.worst[name] = max(self.worst.get(name, 0.0), class_worst)
        if self.margin * class_worst > TAU_CAP and name not in self.capped:
            self.capped.add(name)
            warnings.warn(
                f"calibration: aten.{name}'s results disagree between the emulated profiles by "
                f"{class_worst:.3g} units, beyond what its log threshold can cover ({TAU_CAP:g} with margin "
                f"{self.margin:g}): a replay on another machine may diverge at it (its call class: "
                f"{sized[:200]})",
                CalibrationCapWarning,
                stacklevel=2,
            )
        self.thresholds.per_op[name] = self._tau(kind, worst)
        self.class_worst[sized] = class_worst
        if class_worst > 0:
            # A class the profiles reorder has its own threshold; one they do not (measured 0 here, for
            # want of a profile that changes it) keeps its op's, which rests on the op's other classes.
            self.thresholds.per_class[sized] = self._tau(kind, class_worst)

    def _tau(self, kind: OpKind, worst: float) -> float:
        floor = TAU_FLOOR_MEASURED if kind is OpKind.REDUCTION and worst > 0 else TAU_FLOOR
        return min(TAU_CAP, max(floor, self.margin * worst))

    def _rerunning(self, func: Any, args: tuple, kwargs: dict, produced: list[torch.Tensor]) -> list[Profile]:
        """The profiles whose reruns of the call ``func(*args, **kwargs)`` can give other bits than
        ``produced``: those that reorder it (:meth:`~detrl.core.hardware.Profile.reorders`), where it ran
        on the CPU. A profile that does not calls the same native kernel on the same inputs as the recorder,
        and a CPU kernel gives the same bits each time (its disagreement is 0, measured or not): ``exp``
        under a profile without another libm, every op no profile emulates, a product of fewer terms than
        the profile's chunk. A CUDA kernel need not (atomics): there every profile reruns it."""
        if any(t.device.type != "cpu" for t in produced):
            return self.profiles
        return [prof for prof in self.profiles if prof.reorders(func, args, kwargs)]


def _disagreements(state: Mapping[Any, Any], what: str) -> dict[str, float]:
    """``{key: largest disagreement}`` from a checkpoint's calibration state, every entry checked."""
    parsed: dict[str, float] = {}
    for k, v in state.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"calibration state: {what} {k!r}: {v!r}")
        if not 0.0 <= float(v) < float("inf"):
            raise ValueError(f"calibration state: {what} {k!r} out of range: {v!r}")
        parsed[k] = float(v)
    return parsed


def _unit(
    func: Any,
    args: tuple,
    a: torch.Tensor,
    kind: OpKind,
    rules_revision: int,
    sampled_args: tuple | None = None,
    dim: int = 0,
    rows: torch.Tensor | None = None,
) -> tuple[tuple[int, ...], torch.Tensor]:
    """The units result ``a`` is logged in, as ``(view shape, unit)``, ``unit`` broadcasting against ``a``
    viewed so: its :class:`Scale` (an ``mm``), its channel scale (other reductions) or each element's own
    spacing. With ``rows`` (int64 indices along ``a``'s dim ``dim``, of the call with ``sampled_args``):
    the same units at ``a.index_select(dim, rows)`` only, viewed as that."""
    if rows is None:
        scale: Scale | None = reduction_scale(func, args, a, rules_revision)
        if scale is not None:
            return (scale.outer, scale.channels, scale.inner), scale.dense()
        return tuple(a.shape), scale_spacing(a) if kind is OpKind.REDUCTION else spacing32(a)
    assert sampled_args is not None
    part = a.index_select(dim, rows)
    # An mm's unit is a row scale (from the rows of ``a @ b``'s ``a``) times a column scale: the sampled
    # call's are the whole call's rows. An element's own spacing is its own. A channel scale is the whole
    # result's largest magnitude per channel: taken from the whole result, then the sampled channels'.
    scale = reduction_scale(func, sampled_args, part, rules_revision)
    if scale is not None:
        return (scale.outer, scale.channels, scale.inner), scale.dense()
    if kind is not OpKind.REDUCTION:
        return tuple(part.shape), spacing32(part)
    spacing = scale_spacing(a)
    if spacing.shape[dim] != 1:
        spacing = spacing.index_select(dim, rows)
    return tuple(part.shape), spacing


def _disagreement(a: torch.Tensor, b: torch.Tensor, unit: tuple[tuple[int, ...], torch.Tensor]) -> float:
    """Largest ``|a - b|`` in the units ``unit`` (:func:`_unit` of ``a``)."""
    shape, spacing = unit
    rel = (a - b).abs_().reshape(shape).div_(spacing)
    if not rel.numel():
        return 0.0
    # Most results are finite everywhere: then the largest is the answer, with no mask to build. A NaN or
    # an infinity (an inf in either result, an infinite unit) makes it non-finite: then only finite ones count.
    largest = float(rel.max())
    if math.isfinite(largest):
        return largest
    rel = rel[torch.isfinite(rel)]
    return float(rel.max()) if rel.numel() else 0.0


@dataclasses.dataclass(frozen=True)
class _Sample:
    """A sampled measurement: the call's arguments with every argument that holds the sampled rows cut to
    ``rows`` (int64 indices); ``dims``: per result, the dim its rows are cut along (None: it is whole)."""

    args: tuple
    dims: tuple[int | None, ...]
    rows: torch.Tensor


_Cut = tuple[dict[int, int], tuple[int | None, ...]]
#: Ops whose results' slices along one dim are computed from the same slices of some arguments alone, in
#: the same order: ``(args) -> ({argument position: its dim that holds the rows}, per result: its dim
#: that holds them, or None where the result does not depend on them)``, or None where this call's
#: arguments do not allow it (a broadcast operand, a softmax over that very dim, a grouped convolution).
_Slicing = Callable[[tuple], _Cut | None]
_SLICINGS: dict[Any, _Slicing] = {}


_slices = registrar(_SLICINGS, "calibration sampling")


def _tensors(args: tuple, n: int) -> bool:
    return len(args) >= n and all(isinstance(a, torch.Tensor) for a in args[:n])


@_slices(aten.mm.default)
def _mm_rows(args: tuple) -> _Cut | None:
    """``a @ b``: row i of the result is row i of ``a`` times ``b``."""
    return ({0: 0}, (0,)) if _tensors(args, 2) and args[0].dim() == 2 else None


@_slices(aten.addmm.default)
def _addmm_rows(args: tuple) -> _Cut | None:
    """``self + m1 @ m2``: the rows of ``m1``, and of ``self`` where it has rows of its own (a bias
    broadcasts)."""
    if not _tensors(args, 3) or args[1].dim() != 2:
        return None
    bias = args[0]
    if bias.dim() < 2 or bias.shape[0] == 1:
        return {1: 0}, (0,)
    return ({0: 0, 1: 0}, (0,)) if bias.shape[0] == args[1].shape[0] else None


@_slices(aten.bmm.default)
def _bmm_rows(args: tuple) -> _Cut | None:
    """``a @ b`` per batch: rows (dim 1) of ``a``."""
    return ({0: 1}, (1,)) if _tensors(args, 2) and args[0].dim() == 3 else None


@_slices(aten._log_softmax.default, aten._softmax.default)
def _softmax_rows(args: tuple) -> _Cut | None:
    """Softmax over ``dim``: every other dim's slices are independent; dim 0 unless it is ``dim``."""
    x = args[0]
    return ({0: 0}, (0,)) if x.dim() >= 2 and args[1] % x.dim() != 0 else None


@_slices(aten.sum.dim_IntList)
def _sum_kept(args: tuple) -> _Cut | None:
    """A sum over some dims is independent along each dim it keeps: cut along dim 0 where it is kept (the
    row sums of a decomposed softmax or layer norm), else along the last kept dim (a bias gradient: the
    columns of a ``(rows, features)`` sum over its rows), which is dim ``kept - reduced before it`` of the
    result without ``keepdim``."""
    x, dims = args[0], args[1] if len(args) > 1 else None
    if x.dim() < 2 or not dims:
        return None
    reduced = {d % x.dim() for d in dims}
    kept = [d for d in range(x.dim()) if d not in reduced]
    if not kept:
        return None
    keepdim = len(args) > 2 and bool(args[2])
    cut = 0 if kept[0] == 0 else kept[-1]
    return {0: cut}, (cut if keepdim else cut - sum(d < cut for d in reduced),)


@_slices(aten.nll_loss_backward.default)
def _nll_backward_rows(args: tuple) -> _Cut | None:
    """The gradient ``(N, C)`` of a mean or summed loss: row i from row i of the scores and target i (the
    incoming gradient and the total weight are scalars)."""
    if not _tensors(args, 3) or args[1].dim() != 2 or args[0].dim() != 0:
        return None
    return {1: 0, 2: 0}, (0,)


@_slices(aten.embedding_dense_backward.default)
def _embedding_backward_columns(args: tuple) -> _Cut | None:
    """The weight gradient ``(num_weights, D)``: column j sums column j of ``grad_output: (*I, D)``."""
    if not _tensors(args, 2) or args[0].dim() < 1:
        return None
    return {0: args[0].dim() - 1}, (1,)


@_slices(aten.convolution.default)
def _convolution_channels(args: tuple) -> _Cut | None:
    """``(N, C_in, *S) -> (N, C_out, *S')``, ungrouped: output channel c from the weight's filter c (and
    bias c) alone; the profiles split the input channels, which all stay."""
    if not _tensors(args, 2) or len(args) < 9 or args[6] or args[8] != 1:
        return None
    bias = args[2]
    return ({1: 0} if bias is None else {1: 0, 2: 0}), (1,)


@_slices(aten.convolution_backward.default)
def _convolution_backward_channels(args: tuple) -> _Cut | None:
    """Gradients of an ungrouped convolution, cut by *input* channel: ``grad_input[:, c]`` sums over the
    output channels (which the profiles split, and which all stay) through the weight's ``[:, c]``;
    ``grad_weight[:, c]`` over the batch (split by the profiles) through the input's channel c; ``grad_bias``
    does not depend on them (whole)."""
    if not _tensors(args, 3) or len(args) < 11 or args[7] or args[9] != 1:
        return None
    return {1: 1, 2: 1}, tuple(d for d, wanted in zip((1, 1, None), args[10]) if wanted)


def _elementwise_rows(args: tuple) -> _Cut | None:
    """Elementwise: every tensor argument of the result's shape, row for row (none broadcast)."""
    tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    shapes = {a.shape for a in tensors.values()}
    if len(shapes) != 1 or not next(iter(shapes)) or any(isinstance(a, (list, tuple)) for a in args):
        return None
    return dict.fromkeys(tensors, 0), (0,)


_slices(
    *[
        getattr(aten, n).default
        for n in ("exp", "log", "tanh", "sigmoid", "gelu", "silu", "erf", "rsqrt", "gelu_backward",
                  "silu_backward", "tanh_backward", "sigmoid_backward")
        if hasattr(aten, n)
    ],
    aten.pow.Tensor_Scalar,
)(_elementwise_rows)  # fmt: skip


def _sample(
    func: Any, args: tuple, produced: list[torch.Tensor], budget: int | None, kwargs: Mapping | None = None
) -> _Sample | None:
    """Evenly spread rows of a call too large to measure whole (None: measure it whole): a call of an op in
    :data:`_SLICINGS` whose largest tensor cut has more than ``budget`` elements. Enough rows that that
    tensor's share is about ``budget`` elements, at least :data:`MIN_SAMPLED_ROWS`. The slicing reads the
    arguments passed by keyword (``kwargs``: a sum's ``keepdim``) at their schema positions; it cuts only
    arguments passed by position.

    The rows are a function of the sizes alone (no random draw), so a recording samples the same rows
    every time. Each row's results under a profile are what that profile computes for it in the whole call
    (the order of each sum is the row's own), up to the native kernels' blocking of fewer rows: another
    order a machine may take too."""
    slicing = _SLICINGS.get(func)
    if budget is None or slicing is None:
        return None
    cut = slicing(tuple(bound_arguments(func, args, kwargs)) if kwargs else args)
    if cut is None or len(cut[1]) != len(produced):
        return None
    holders, dims = cut
    if any(i >= len(args) for i in holders):
        return None
    sliced = [(args[i], d) for i, d in holders.items()]
    sliced += [(t, d) for t, d in zip(produced, dims) if d is not None]
    if any(t.dim() <= d for t, d in sliced):
        return None
    n = sliced[0][0].shape[sliced[0][1]]
    if n == 0 or any(t.shape[d] != n for t, d in sliced):
        return None
    if max(t.numel() for t, _ in sliced) <= budget:
        return None
    per_row = max(t.numel() // n for t, _ in sliced)
    take = max(MIN_SAMPLED_ROWS, -(-budget // max(per_row, 1)))
    if take >= n:
        return None
    rows = torch.arange(take, device=produced[0].device) * n // take  # evenly spread, the first row included
    cut_args = list(args)
    for i, d in holders.items():
        cut_args[i] = args[i].index_select(d, rows)
    return _Sample(tuple(cut_args), dims, rows)
