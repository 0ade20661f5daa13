"""Bounded calibration: each shape class of op calls is measured at most ``max_per_class`` times, the
thresholds it gives still replicate on every emulated profile with no unlogged near-midpoint element, and a
recording resumed inside calibration measures what an uninterrupted one does."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detrl import Session, Sources
from detrl.core import calibrate
from detrl.core.calibrate import (
    CLASS_WORST_KEY,
    CLASSES_KEY,
    DEFAULT_MAX_PER_CLASS,
    MIN_SAMPLED_ROWS,
    Calibrator,
    shape_class,
)
from detrl.core.hardware import EmulatedProfile, get_profile
from detrl.core.oprules import OpKind, call_class, op_name
from detrl.core.rounding import Thresholds

PROFILES = ["emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"]
DEPTH = 6  # identical hidden layers: their calls fall into the same classes


class Stack(nn.Module):
    """``DEPTH`` identical ``Linear(16, 16)`` + tanh layers and a linear readout: a model whose layers
    repeat, as ResNet's blocks and GPT-2's layers do."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(d, d) for _ in range(DEPTH))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


class Convs(nn.Module):
    """Two 3x3 convolutions (3 -> 12 -> 12 channels, more than calibration samples: 8) with tanh, a
    spatial mean and a linear readout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 12, 3, padding=1), nn.Conv2d(12, 12, 3, padding=1)
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, 6, 6)
        x = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))  # (B, 12, 6, 6)
        return self.out(x.mean(dim=(2, 3)))


def _data(model: type[nn.Module] = Stack) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (128, 3, 6, 6) if model is Convs else (128, 16)
    return torch.randn(*shape, generator=g), torch.randint(0, 4, (128,), generator=g)


def train(
    session: Session, steps: int, stop_after: int | None = None, model: type[nn.Module] = Stack
) -> None:
    """SGD with momentum on a fixed random classification set; ``stop_after``: stop after that step."""
    net = session.init(model)
    opt = session.track(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    loader = session.loader(_data(model), batch_size=16, steps=steps)
    session.restore()
    for batch in loader:
        with session.step():
            F.cross_entropy(net(batch.x), batch.y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if session.step_index == stop_after:
            session.stop_requested = True
            break


def record(run_dir: Path, steps: int, calibration_steps: int = 1, **kw: Any) -> Session:
    """Record :func:`train` for ``steps`` steps; ``kw``: ``stop_after``, ``model``, or more Session
    arguments."""
    stop_after = kw.pop("stop_after", None)
    model = kw.pop("model", Stack)
    with Session(
        run_dir,
        mode="record",
        precision="verifiable",
        sources=Sources(seed=0),
        calibration_steps=calibration_steps,
        planned_steps=steps,
        **kw,
    ) as s:
        train(s, steps, stop_after, model)
    return s


def count_measurements(
    monkeypatch: pytest.MonkeyPatch, sized: dict[str, set[str]] | None = None
) -> collections.Counter[str]:
    """Counts, per shape class, the op calls the calibrator actually reran under its profiles; ``sized``
    collects each shape class's call classes (with sizes) seen."""
    counts: collections.Counter[str] = collections.Counter()
    orig = Calibrator.__call__

    def counting(self: Calibrator, func: Any, before: tuple, kwargs: dict, produced: list, kind: Any) -> None:
        n, calls = self.calibrated_calls, self.calls
        orig(self, func, before, kwargs, produced, kind)
        key = shape_class(op_name(func), before, kwargs)
        if sized is not None and self.calls > calls:  # a call it takes (one with an FP64 result)
            sized.setdefault(key, set()).add(call_class(op_name(func), before, kwargs))
        if self.calibrated_calls > n:
            counts[key] += 1

    monkeypatch.setattr(Calibrator, "__call__", counting)
    return counts


def test_repeated_layers_are_calibrated_a_bounded_number_of_times_and_replicate(tmp_path, monkeypatch):
    sized: dict[str, set[str]] = {}
    counts = count_measurements(monkeypatch, sized)
    steps = 6
    rec = record(tmp_path / "run", steps, calibration_steps=2)
    cal = rec._calibrator
    assert cal is not None and cal.max_per_class == DEFAULT_MAX_PER_CLASS
    # the bound holds over both steps: twice a class, and once more for each further size of it
    assert counts and all(n <= cal.max_per_class + len(sized[k]) - 1 for k, n in counts.items()), counts
    assert set(cal.class_worst) == set().union(*sized.values())  # every call class measured
    assert dict(counts) == cal.classes
    # the repeated layers do share classes: most calls were not rerun
    assert cal.calibrated_calls < cal.calls / 2, (cal.calibrated_calls, cal.calls)
    # every op kind that was logged with a threshold got it from a measurement
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert set(manifest["thresholds"]["per_op"]) == set(cal.worst)
    assert rec.thresholds.per_class  # (the log itself may be empty: these sums are exact in FP64)
    params = {n: p.detach().clone() for n, p in rec.model.named_parameters()}
    for hw in PROFILES:
        with Session(tmp_path / "run", mode="replay", hardware=hw) as rep:
            train(rep, steps)
            rep.verify_checkpoints()
        assert rep.step_index == steps and rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        for n, p in rep.model.named_parameters():
            assert torch.equal(p, params[n]), (hw, n)


def test_bounded_thresholds_match_unbounded_ones_closely(tmp_path, monkeypatch):
    bounded = record(tmp_path / "bounded", 2).thresholds.per_op
    init = Calibrator.__init__

    def unbounded(self: Calibrator, *a: Any, **k: Any) -> None:
        init(self, *a, **{**k, "max_per_class": None})

    monkeypatch.setattr(Calibrator, "__init__", unbounded)  # the session's calibrator measures every call
    full_session = record(tmp_path / "full", 2)
    assert full_session._calibrator is not None and full_session._calibrator.max_per_class is None
    full = full_session.thresholds.per_op
    assert bounded.keys() == full.keys()
    for name in full:  # a subset of the measurements: never above, and here within a factor of 4
        assert full[name] / 4 <= bounded[name] <= full[name], name


@pytest.mark.parametrize("model", [Stack, Convs])
def test_resuming_inside_calibration_gives_the_uninterrupted_thresholds_and_log(tmp_path, model):
    """Also with thresholds per output (``Convs``: a convolution's backward, rules revision 4), which the
    checkpointed calibration state carries."""
    steps, calibration = 6, 4
    record(tmp_path / "whole", steps, calibration, checkpoint_every=1, model=model)
    record(tmp_path / "resumed", steps, calibration, checkpoint_every=1, stop_after=2, model=model)
    meta = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert meta["status"] == "stopped"
    with Session(tmp_path / "resumed", mode="record", resume=True, planned_steps=steps) as s:
        assert s._calibrator is not None and s._calibrator.classes  # the counts came from the checkpoint
        train(s, steps, model=model)
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("whole", "resumed"))
    assert a["thresholds"] == b["thresholds"]
    if model is Convs:
        assert any("#" in k for k in a["thresholds"]["per_class"])  # thresholds per output were written
    for name in ("commitments", "roundlog"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name


def test_calibration_state_round_trips_and_is_checked():
    cal = Calibrator(Thresholds(), [])
    state = {"mm": 0.5, CLASSES_KEY: {"mm(float64[01])": 2}, CLASS_WORST_KEY: {"mm(float64[01])": 0.25}}
    cal.load_state(state)
    assert cal.state() == state and cal.worst == {"mm": 0.5}
    cal.load_state({"mm": 0.25})  # written before classes were counted: disagreements only
    assert cal.state() == {"mm": 0.25, CLASSES_KEY: {}, CLASS_WORST_KEY: {}}
    bad = [
        [1.0],
        {"mm": -1.0},
        {"mm": float("inf")},
        {"mm": True},
        {"mm": "0.5"},
        {"mm": 0.5, CLASSES_KEY: {"mm(x)": 0}},
        {"mm": 0.5, CLASSES_KEY: {"mm(x)": 1.0}},
        {"mm": 0.5, CLASSES_KEY: {"add(x)": 1}},  # a class of an op never measured
        {"mm": 0.5, CLASSES_KEY: []},
        {"mm": 0.5, CLASS_WORST_KEY: {"mm(x)": 0.75}},  # a class above its op
        {"mm": 0.5, CLASS_WORST_KEY: {"add(x)": 0.25}},  # a class of an op never measured
        {"mm": 0.5, CLASS_WORST_KEY: {"mm(x)": -1.0}},
        {"mm": 0.5, CLASS_WORST_KEY: []},
    ]
    for state in bad:
        with pytest.raises((TypeError, ValueError)):
            cal.load_state(state)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Calibrator(Thresholds(), [], max_per_class=0)


def test_shape_class_keys_structure_not_values():
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    assert shape_class("add", (a, b), {"alpha": 0.5}) == shape_class("add", (b, a), {"alpha": 2.0})
    assert shape_class("add", (a, b), {}) != shape_class("add", (a, b.t().contiguous().t()), {})  # strides
    assert shape_class("sum", (a, [0]), {}) != shape_class("sum", (a, [1]), {})  # dims
    assert shape_class("sum", (a, [0]), {}) != shape_class("mean", (a, [0]), {})
    big = torch.randn(40, 30, dtype=torch.float64)
    assert shape_class("sum", (a, [0]), {}) == shape_class("sum", (big, [0]), {})  # sizes do not count
    assert shape_class("sum", (a, [0]), {}) != shape_class("sum", (big[0], [0]), {})  # ranks do
    assert shape_class("add", (a, a[:1].expand(4, 3)), {}) != shape_class("add", (a, a), {})  # broadcast


def test_a_call_is_rerun_only_under_the_profiles_that_reorder_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``exp`` is another libm's op alone: only emulated:pairwise (the profile with one) reruns it, and its
    disagreement is the one it measures; ``sum`` every profile reorders; ``relu`` none (not measured)."""
    ran: collections.Counter[tuple[str, str]] = collections.Counter()
    call = EmulatedProfile.__call__

    def counted(self: EmulatedProfile, func: Any, args: tuple, kwargs: dict) -> Any:
        ran[(op_name(func), self.name)] += 1
        return call(self, func, args, kwargs)

    monkeypatch.setattr(EmulatedProfile, "__call__", counted)
    cal = Calibrator(
        Thresholds(), [get_profile(p, seed=calibrate.CALIBRATION_SEED) for p in calibrate.PROFILES]
    )
    x = torch.randn(64, 33, dtype=torch.float64)
    aten = torch.ops.aten
    for func, args, kind in (
        (aten.exp.default, (x,), OpKind.ELEMENTWISE),
        (aten.sum.dim_IntList, (x, [1]), OpKind.REDUCTION),
        (aten.relu.default, (x,), OpKind.ELEMENTWISE),
    ):
        cal(func, args, {}, [func(*args)], kind)
    assert {k: v for k, v in ran.items() if k[0] == "exp"} == {("exp", "emulated:pairwise"): 1}
    assert {k[1] for k in ran if k[0] == "sum"} == set(calibrate.PROFILES)
    assert not any(k[0] == "relu" for k in ran)
    assert cal.worst["exp"] > 0 and cal.worst["relu"] == 0  # pairwise's libm moved some exp results


@pytest.mark.parametrize("model", [Stack, Convs])
def test_sampled_calibration_replicates_on_every_profile_and_is_deterministic(tmp_path, monkeypatch, model):
    """Calls larger than ``sample_elements`` are measured on evenly spread rows: here (``sample_elements``
    16) the stack's tanh, its bias gradients' sums, the softmax and its gradient, and the convolutions (by
    output channel) and their gradients (by input channel, past the 3-channel input), so the op kinds'
    thresholds rest on sampled rows (the stack's products, of 16 terms, are cut by no profile and
    not rerun). The recording still replays on every profile, and records the same bytes twice."""
    init = Calibrator.__init__

    def sampled(self: Calibrator, *a: Any, **k: Any) -> None:
        init(self, *a, **{**k, "sample_elements": 16})

    monkeypatch.setattr(Calibrator, "__init__", sampled)
    samples: collections.Counter[str] = collections.Counter()
    real_sample = calibrate._sample

    def counting(func: Any, args: tuple, produced: list, budget: int | None, kwargs: Any = None) -> Any:
        out = real_sample(func, args, produced, budget, kwargs)
        if out is not None:
            assert len(out.rows) == MIN_SAMPLED_ROWS  # 8 of 16 rows (at least 8: the budget asks for 1)
            samples[op_name(func)] += 1
        return out

    monkeypatch.setattr(calibrate, "_sample", counting)
    steps = 3
    rec = record(tmp_path / "run", steps, calibration_steps=2, model=model)
    expected = {"convolution", "convolution_backward"} if model is Convs else {"tanh", "sum", "_log_softmax"}
    assert expected | {"nll_loss_backward"} <= set(samples), samples
    assert rec.thresholds.per_class  # (the log itself may be empty: these sums are exact in FP64)
    params = {n: p.detach().clone() for n, p in rec.model.named_parameters()}
    for hw in PROFILES:
        with Session(tmp_path / "run", mode="replay", hardware=hw) as rep:
            train(rep, steps, model=model)
            rep.verify_checkpoints()
        assert rep.step_index == steps and rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        for n, p in rep.model.named_parameters():
            assert torch.equal(p, params[n]), (hw, n)
    record(tmp_path / "again", steps, calibration_steps=2, model=model)
    for name in ("commitments", "roundlog"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def _slicing_cases() -> list[tuple[Any, tuple]]:
    g = torch.Generator().manual_seed(1)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    aten = torch.ops.aten
    x, w, go = r(4, 20, 5, 5), r(12, 20, 3, 3), r(4, 12, 3, 3)
    conv = (x, w, r(12), [1], [0], [1], False, [0], 1)
    return [
        (aten.mm.default, (r(40, 30), r(30, 20))),
        (aten.addmm.default, (r(20), r(40, 30), r(30, 20))),
        (aten.addmm.default, (r(40, 20), r(40, 30), r(30, 20))),
        (aten.bmm.default, (r(2, 40, 30), r(2, 30, 20))),
        (aten._log_softmax.default, (r(40, 30), 1, False)),
        (aten.sum.dim_IntList, (r(40, 30), [1])),
        (aten.sum.dim_IntList, (r(30, 40), [0], True)),  # a bias gradient: its columns
        (aten.sum.dim_IntList, (r(3, 10, 40), [0, 1])),
        (aten.exp.default, (r(40, 30),)),
        (aten.nll_loss_backward.default, (r(()), r(40, 30), torch.randint(0, 30, (40,), generator=g), None, 1, -100, r(()).abs())),
        (aten.embedding_dense_backward.default, (r(40, 30), torch.randint(0, 12, (40,), generator=g), 12, -1, False)),
        (aten.convolution.default, conv),
        (aten.convolution_backward.default, (go, x, w, [12], [1], [0], [1], False, [0], 1, [True, True, True])),
        (aten.convolution_backward.default, (go, x, w, [12], [1], [0], [1], False, [0], 1, [False, True, False])),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(14))
def test_sampled_rows_are_the_whole_calls_rows(case):
    """Each op the calibrator samples: the cut call's results are the whole call's rows (to rounding: the
    native kernels may block fewer rows otherwise), under an emulated profile that splits its sums."""
    from detrl.core.hardware import get_profile
    from detrl.core.rounding import written_tensors

    func, args = _slicing_cases()[case]
    prof = get_profile("emulated:pairwise")
    whole = written_tensors(func, args, {}, prof(func, args, {}))
    sample = calibrate._sample(func, args, whole, budget=64)
    assert sample is not None and 0 < len(sample.rows) < max(t.numel() for t in whole)
    cut = written_tensors(func, sample.args, {}, prof(func, sample.args, {}))
    assert len(cut) == len(whole) == len(sample.dims)
    for a, b, d in zip(whole, cut, sample.dims, strict=True):
        expected = a if d is None else a.index_select(d, sample.rows)
        assert expected.shape == b.shape and torch.allclose(expected, b, rtol=1e-12, atol=1e-12), (func, d)


def test_a_sums_keepdim_passed_by_keyword_cuts_the_results_own_dim():
    """``sum(x, [0], keepdim=True)`` of a ``(3, 40, 40)`` tensor keeps dims 1 and 2: its columns (dim 2) are
    cut in the argument and at dim 2 of the ``(1, 40, 40)`` result. Read as ``keepdim=False`` (a keyword the
    slicing cannot see), the result's dim would be 1, of the same size, and the comparison wrong."""
    from detrl.core.hardware import get_profile

    aten = torch.ops.aten
    x = torch.randn(3, 40, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    kwargs = {"keepdim": True}
    prof = get_profile("emulated:pairwise")
    whole = prof(aten.sum.dim_IntList, (x, [0]), kwargs)
    sample = calibrate._sample(aten.sum.dim_IntList, (x, [0]), [whole], 64, kwargs)
    assert sample is not None and sample.dims == (2,) and sample.args[0].shape == (3, 40, len(sample.rows))
    cut = prof(aten.sum.dim_IntList, sample.args, kwargs)
    assert torch.allclose(whole.index_select(2, sample.rows), cut, rtol=1e-12, atol=1e-12)


def test_a_disagreement_past_what_the_cap_covers_is_named_not_silently_capped() -> None:
    """A call class whose measured disagreement times the margin exceeds TAU_CAP gets the capped threshold,
    which cannot cover it: calibration warns once per op, naming the op, the disagreement and the class
    (group norm before its decomposition reached 27 times the cap without a word, and its replay diverged)."""
    import warnings

    from detrl.core.calibrate import TAU_CAP, CalibrationCapWarning
    from detrl.core.hardware import Profile
    from detrl.core.oprules import OpKind

    class Sloppy(Profile):  # a machine whose tanh is off by a part in a thousand
        def __call__(self, func, args, kwargs):  # noqa: ANN001, ANN204
            return func(*args, **kwargs) * (1 + 1e-3)

        def reorders(self, func, args=None, kwargs=None) -> bool:  # noqa: ANN001
            return True

    cal = Calibrator(Thresholds(), [Sloppy("sloppy", "off by 1e-3")])
    x = torch.linspace(0.1, 2.0, 64, dtype=torch.float64)
    func = torch.ops.aten.tanh.default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cal(func, (x,), {}, [func(x)], OpKind.ELEMENTWISE)
    capped = [w for w in caught if issubclass(w.category, CalibrationCapWarning)]
    assert len(capped) == 1 and "aten.tanh's results disagree" in str(capped[0].message)
    assert cal.thresholds.per_op["tanh"] == TAU_CAP
    honest = Calibrator(Thresholds(), [Profile("native", "")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationCapWarning)
        honest(func, (x,), {}, [func(x)], OpKind.ELEMENTWISE)
