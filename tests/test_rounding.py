"""The rounding mode: every op result on the FP32 grid, near-midpoint detection, logged directions."""

import contextlib
import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from detrl.core import kernel
from detrl.core.hardware import get_profile
from detrl.core.oprules import RULES_REVISION, OpKind, classify
from detrl.core.rounding import RoundingMode, StepRounding, Thresholds, near_midpoint, split_short
from detrl.core.scale import Scale, reduction_scale, scale_spacing
from detrl.formats.roundlog import OpEntries, key32

aten = torch.ops.aten


def midpoints(values):
    x32 = torch.tensor(values, dtype=torch.float32)
    up = torch.nextafter(x32, torch.full_like(x32, float("inf")))
    return (x32.double() + up.double()) / 2, x32.double(), up.double()


def on_grid(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.float().double(), t))


def test_near_midpoint_reads_distance_off_the_bits():
    mid, lo, _ = midpoints([1.0, 3.0, -7.5, 1e-3, 1e30])
    assert near_midpoint(mid, 1e-6, False).all()  # exact ties
    ulp64 = 2.0**-52
    off = mid * (1 + 2000 * ulp64)  # ~2000 FP64 ulps = ~3.7e-6 FP32 spacings away
    assert not near_midpoint(off, 1e-6, False).any()
    assert near_midpoint(off, 1e-5, False).all()
    assert not near_midpoint(lo, 0.1, False).any()  # on the grid: as far from a midpoint as can be
    special = torch.tensor([0.0, -0.0, float("inf"), 1e39], dtype=torch.float64)
    assert not near_midpoint(special, 0.1, False).any()
    sub_mid, sub_lo, _ = midpoints([1e-40])  # FP32 subnormal range: spacing 2**-149
    assert near_midpoint(sub_mid, 1e-6, False).all() and not near_midpoint(sub_lo, 0.1, False).any()


def test_fraction_logged_grows_with_tau_not_with_size():
    x = torch.randn(200_000, dtype=torch.float64)
    for tau in (1e-2, 1e-3):
        frac = near_midpoint(x, tau, False).double().mean().item()
        assert 0.9 * 2 * tau < frac < 1.1 * 4 * tau  # the element's spacing is bounded within 2x
    # relative to the tensor's scale, small elements are logged more often
    assert near_midpoint(x, 1e-3, True).sum() > near_midpoint(x, 1e-3, False).sum()


def test_op_classes():
    assert classify(aten.mul.Tensor, {}) is OpKind.EXACT
    assert classify(aten.add_.Tensor, {"alpha": -0.1}) is OpKind.ELEMENTWISE
    assert classify(aten.addcdiv_.default, {}) is OpKind.ELEMENTWISE
    assert classify(aten.mm.default, {}) is OpKind.REDUCTION
    assert classify(aten.relu.default, {}) is OpKind.KEEP
    assert classify(aten.special_bessel_j0.default, {}) is OpKind.REDUCTION  # unknown ops are logged


def _mode(tau=2.0**-20):
    return RoundingMode(get_profile("native"), Thresholds(default=tau))


def test_every_result_lands_on_the_fp32_grid_forward_backward_and_foreach_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.GELU(),
        torch.nn.Flatten(),
        torch.nn.Linear(144, 3),
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.float().double())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.rand(8, 1, 8, 8).double()
    mode = _mode()
    step = StepRounding()
    mode.step = step
    seen = []
    original = mode.profile

    def spy(func, args, kwargs):
        seen.append(func.overloadpacket.__name__)
        return original(func, args, kwargs)

    mode.profile = spy
    with mode:
        loss = model(x).logsumexp(1).mean()
        loss.backward()
        opt.step()
    for name, p in model.named_parameters():
        assert on_grid(p), name
        assert on_grid(p.grad), name
        for k, v in opt.state[p].items():
            if v.dtype == torch.float64:
                assert on_grid(v), (name, k)
    for b in model.buffers():
        if b.is_floating_point():
            assert on_grid(b)
    # backward ops and foreach optimizer ops reach the mode
    # (batch norm is decomposed: its per-channel sums reach the profile, see detrl/core/decompose.py)
    assert {"convolution_backward", "gelu_backward", "mm", "sum"} <= set(seen)
    assert any(n.startswith("_foreach_") for n in seen)
    assert step.stats.rounded_elements > 0


def test_replay_rounds_logged_elements_in_the_logged_direction():
    mid, lo, up = midpoints([1.0, 3.0, 5.0, -7.5])
    eye = torch.eye(4, dtype=torch.float64)

    def compute(step):
        mode = _mode(1e-6)
        mode.step = step
        with mode:
            return torch.mm(mid.view(1, 4), eye).view(4)  # a logged (reduction) op whose results are ties

    rec = StepRounding()
    out = compute(rec)
    assert len(rec.recorded) == 1 and len(rec.recorded[0].indices) == 4
    entries = rec.recorded[0]
    # recorder rounds ties to even; the log says which neighbour that was
    assert torch.equal(out, mid.float().double())
    assert (entries.up == (out.abs() > mid.abs()).numpy()).all()
    flipped = OpEntries(op=entries.op, indices=entries.indices, up=~entries.up)
    rep = StepRounding(replay={entries.op: flipped})
    out2 = compute(rep)
    expect = torch.where(
        torch.from_numpy(~entries.up), torch.maximum(lo.abs(), up.abs()), torch.minimum(lo.abs(), up.abs())
    )
    assert torch.equal(out2.abs(), expect)
    assert rep.stats.corrected == 4
    assert rep.anomalies and rep.anomalies[0].kind == "logged-direction-differs"
    # without the entry the replayer finds unlogged near-midpoint elements and says where
    rep2 = StepRounding(replay={})
    compute(rep2)
    assert rep2.stats.unlogged_near == 4
    assert rep2.anomalies[0].kind == "unlogged-near" and rep2.anomalies[0].name == "mm"


def test_logged_entries_are_sparse_for_a_matmul():
    torch.manual_seed(1)
    a = torch.randn(128, 256).double()
    b = torch.randn(256, 128).double()
    step = StepRounding()
    mode = _mode(2.0**-20)
    mode.step = step
    with mode:
        torch.mm(a, b)
    n = sum(len(e.indices) for e in step.recorded)
    assert n < 0.001 * 128 * 128
    assert all(isinstance(e.indices, np.ndarray) for e in step.recorded)


def test_fused_updates_are_split_into_exact_steps_and_need_no_log():
    torch.manual_seed(2)
    w = torch.randn(100_000).float().double() * 0.03
    g = torch.randn(100_000).float().double()
    d = torch.rand(100_000).float().double() + 0.5
    step = StepRounding()
    mode = _mode()
    mode.step = step
    sgd, adam, lerped = w.clone(), w.clone(), w.clone()
    with mode:
        sgd.add_(g, alpha=-0.01)  # SGD: 0.5 % of these land exactly on a midpoint in one fused kernel
        adam.addcdiv_(g, d, value=-1e-3)
        lerped.lerp_(g, 0.1)
    assert step.recorded == []  # no log entries: every machine computes these bits
    assert torch.equal(sgd, (w + g * -0.01).float().double())
    assert torch.equal(adam, (w + (g / d) * -1e-3).float().double())
    assert torch.equal(lerped, (w + (g - w) * 0.1).float().double())


def test_calibration_sets_thresholds_as_it_goes_and_keeps_the_first_step_small(tmp_path):
    import torch.nn.functional as F

    from detrl import Session, Sources
    from detrl.core.calibrate import TAU_FLOOR_MEASURED
    from detrl.supervised import data
    from detrl.supervised.models import DigitsCNN

    x, y = data.digits()
    with Session(tmp_path / "run", sources=Sources(seed=0)) as s:
        model = s.init(lambda: DigitsCNN(channels=8))
        opt = s.track(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        for batch in s.loader((x, y), batch_size=32, steps=3):
            with s.step():
                F.cross_entropy(model(batch.x), batch.y).backward()
                opt.step()
                opt.zero_grad()
    per_op = s.thresholds.per_op
    assert {"convolution", "convolution_backward", "sum"} <= set(per_op)
    assert all(TAU_FLOOR_MEASURED <= tau <= 2.0**-4 for tau in per_op.values())
    first, later = s.step_stats[0].logged, max(st.logged for st in s.step_stats[1:])
    assert first <= 3 * later + 100


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize(
    ("tau", "short"),
    # T = tau * mm's unit (2**-23 here: terms of 1, K = 2) against the result's spacing 2**-47: 2**4
    # spacings (at most 2**12: the value is stored short, 16 key bits) or 2**13 (the full FP32 value)
    [(2.0**-20, True), (2.0**-11, False)],
    ids=["short", "full"],
)
def test_cancellation_results_are_pinned_and_replayed_by_value(tau: float, short: bool, native: bool):
    # Element (1, 0) of a @ b sums two terms of magnitude 1 that cancel to 2**-24: at the terms' scale
    # (mm's unit: row and column maxima of its inputs) the FP64 uncertainty spans many of the result's own
    # spacings, so a direction bit cannot name its FP32 value; the recorder stores the value itself
    # ("pinned"), or, where the uncertainty is small enough that the replayer's own rounding names all but
    # the low 16 bits of its key, only those ("short").
    if native and not kernel.available():
        pytest.skip("native kernel not built")
    a = torch.tensor([[1.0, 0.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0], [1.0 - 2.0**-24, 1.0]], dtype=torch.float64)

    def compute(step, nudge=0.0):
        def profile(func, args, kwargs):
            out = func(*args, **kwargs)
            if func is torch.ops.aten.mm.default and nudge:
                out[1, 0] -= 1.0  # cancellation: another machine's sum lands a few small spacings away
                out[1, 0] += 1.0 + nudge
            return out

        mode = RoundingMode(profile, Thresholds(default=tau))
        mode.step = step
        with mode:
            return torch.mm(a, b)

    rec = StepRounding()
    ctx = contextlib.nullcontext() if native else kernel.disabled()
    with ctx:
        out = compute(rec)
    pinned = [e for e in rec.recorded if len(e.pinned_indices) or len(e.short_indices)]
    assert pinned, rec.recorded
    entry = pinned[-1]
    want = out[1, 0].item()
    assert want == 2.0**-24
    if short:
        assert entry.short_indices.tolist() == [2] and not len(entry.pinned_indices)  # element (1, 0)
        assert entry.short_bits.tolist() == [int(key32(np.array([want], np.float32))[0]) & 0xFFFF]
    else:
        assert entry.pinned_indices.tolist() == [2] and not len(entry.short_indices)
    assert rec.stats.logged == len(entry.indices) + 1
    rep = StepRounding(replay={e.op: e for e in rec.recorded})
    out2 = compute(rep, nudge=3e-14)  # several FP32 spacings of 2**-24 (2**-47, about 7e-15, each)
    assert out2[1, 0].item() == want and rep.stats.corrected >= 1
    assert any(an.kind == "pinned-value-differs" for an in rep.anomalies)
    assert not any(an.violation for an in rep.anomalies)
    # a forged pinned value far from anything this machine could compute is refused
    if short:  # the farthest a forged low half can name: 2**15 keys from this machine's own value
        low = (entry.short_bits.astype(np.int64) + (1 << 15)) & 0xFFFF
        forged = dataclasses.replace(entry, short_bits=low.astype(np.uint16))
    else:
        forged = dataclasses.replace(entry, pinned_values=np.full_like(entry.pinned_values, 0.5))
    rep3 = StepRounding(replay={**{e.op: e for e in rec.recorded}, entry.op: forged})
    out3 = compute(rep3)
    assert out3[1, 0].item() == want
    assert any(an.kind == "pinned-value-far" for an in rep3.anomalies)
    assert rep3.stats.refused == 1


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "reference"])
def test_zeros_that_cancel_replay_as_the_recorders_from_rules_revision_7(native: bool) -> None:
    """A sum that cancels to exactly zero on the recorder leaves rounding noise on another order. From rules
    revision 7 the replayer takes an unlogged element near a midpoint whose window reaches zero for +0, and
    the recorder pins the negative values that round to -0; exact zeros (an exact -0 here: a copy of one)
    are logged by neither, and keep their sign. Under revision 6 the noise stays: elements near a midpoint,
    unlogged, another value. Noise beyond the window stays a violation, and a log that leaves the -0 out
    replays a +0, which the commitments then tell apart."""
    if native and not kernel.available():
        pytest.skip("native kernel not built")
    a = torch.tensor([[1.0, -1.0], [2.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)  # row 0: 1 - 1 in each column
    recorder = (0.0, -0.0, -(2.0**-160))  # cancelled, an exact -0, a negative value below FP32's range

    def compute(step, revision, row=recorder):
        def profile(func, args, kwargs):
            out = func(*args, **kwargs)
            if func is aten.mm.default:
                out[0] = torch.tensor(row, dtype=out.dtype)  # this machine's order of the sums
            return out

        mode = RoundingMode(profile, Thresholds(default=2.0**-20))  # T = 2**-20 2**-23 = 2**-43
        mode.step, mode.rules_revision = step, revision
        with mode, contextlib.nullcontext() if native else kernel.disabled():
            return torch.mm(a, b)

    bits = lambda t: t[0].float().view(torch.int32).tolist()  # noqa: E731
    rec = StepRounding()
    want = compute(rec, 7)
    assert bits(want) == [0, -(2**31), -(2**31)]  # +0, -0, -0
    (entry,) = rec.recorded
    assert entry.pinned_indices.tolist() == [2] and not len(entry.indices) and not len(entry.short_indices)
    noise = (1e-19, -0.0, -3e-19)
    rep = StepRounding(replay={entry.op: entry})
    assert bits(compute(rep, 7, noise)) == bits(want)
    assert not any(an.violation for an in rep.anomalies) and rep.stats.corrected == 2

    old = StepRounding()
    assert bits(compute(old, 6)) == bits(want) and old.recorded == []
    rep = StepRounding(replay={})
    assert compute(rep, 6, noise)[0, 0].item() == np.float32(1e-19)  # diverged
    assert rep.stats.unlogged_near == 2 and rep.anomalies[0].kind == "unlogged-near"

    rep = StepRounding(replay={entry.op: entry})
    far = compute(rep, 7, (2.0**-40, -0.0, -3e-19))  # 8 T: not this op's arithmetic
    assert far[0, 0].item() != 0.0 and rep.stats.unlogged_near == 1
    rep = StepRounding(replay={})  # the -0 left out
    assert bits(compute(rep, 7, noise)) == [0, -(2**31), 0]
    # a forged pinned zero for a value no machine rounds to zero is refused (its reach is the threshold's
    # and the smallest subnormal's, not the 2**-24 that spacing32 gives a zero)
    forged = dataclasses.replace(
        entry, pinned_indices=np.array([0, 2]), pinned_values=np.array([0.0, -0.0], np.float32)
    )
    rep = StepRounding(replay={entry.op: forged})
    assert compute(rep, 7, (1e-9, -0.0, -3e-19))[0, 0].item() == np.float32(1e-9)
    assert rep.stats.refused == 1 and rep.anomalies[0].kind == "pinned-value-far"


def test_short_pinned_values_split_by_uncertainty():
    # split_short keeps a pinned value full where T exceeds 2**12 of its spacings, or it is not finite
    values = np.array([1.0, 1.0, np.inf, -3.0], np.float32)
    entries = OpEntries(
        op=0,
        indices=np.zeros(0, np.int64),
        up=np.zeros(0, bool),
        pinned_indices=np.arange(4, dtype=np.int64),
        pinned_values=values,
    )
    unit = torch.tensor([2.0**-23 * 2**12, 2.0**-23 * 2**13, 1.0, 2.0**-22 * 2**12], dtype=torch.float64)
    scale = Scale(outer=1, channels=4, inner=1, col=unit)
    x = torch.from_numpy(values.astype(np.float64)).view(1, 4)
    got = split_short(entries, x, 1.0, scale)
    assert got.pinned_indices.tolist() == [1, 2] and got.short_indices.tolist() == [0, 3]
    assert got.short_bits.tolist() == (key32(values[[0, 3]]) & 0xFFFF).tolist()
    assert np.array_equal(got.pinned_values.view(np.uint32), values[[1, 2]].view(np.uint32))
    # elementwise ops: T = tau |v| 2**-23: tau spacings at 1.0, 1.5 tau at -3.0
    for tau, n_short in [(2.0**11, 3), (2.0**12, 2), (2.0**12 * 1.01, 0)]:
        got = split_short(entries, x, tau, False)
        assert len(got.short_indices) == n_short, tau


def test_log_entries_for_elements_far_from_a_midpoint_are_refused():
    x = torch.tensor([[1.0, 3.0]], dtype=torch.float64)  # exact FP32 values: nowhere near a midpoint
    eye = torch.eye(2, dtype=torch.float64)
    forged = OpEntries(op=0, indices=np.array([0, 1]), up=np.array([True, True]))
    step = StepRounding(replay={0: forged})
    mode = _mode(2.0**-20)
    mode.step = step
    with mode:
        out = torch.mm(x, eye)
    assert torch.equal(out, x)  # not moved to the next float
    assert step.anomalies[0].kind == "logged-not-near"


def test_detrl_dispatch_modes_are_called_without_torch_dynamo_wrappers():
    """Each op under a detrl mode calls its ``__torch_dispatch__`` directly (torch wraps other modes' in
    ``torch._disable_dynamo``, two frames and two eval-frame swaps an op)."""
    from detrl.core.hardware.profiles import HardwareMode
    from detrl.core.randomness import StreamRandomMode
    from detrl.core.rounding import RoundingMode

    for mode in (RoundingMode, HardwareMode, StreamRandomMode):
        assert not hasattr(mode.__dict__["__torch_dispatch__"], "__wrapped__"), mode.__name__


def test_verifiable_sessions_pin_optimizers_to_one_op_sequence_on_every_device(tmp_path):
    """torch picks foreach ops on a GPU and a per-tensor loop on a CPU when ``foreach`` is left None: a
    verifiable Session pins the loop (explicit choices stay), refuses fused, and leaves FP32 runs alone."""
    from detrl import Session, Sources

    params = [torch.nn.Parameter(torch.zeros(3))]
    with Session(tmp_path / "v", mode="off", sources=Sources(seed=0)) as s:
        auto = s.track(torch.optim.AdamW(params))
        chosen = s.track(torch.optim.Adam(params, foreach=True))
        with pytest.raises(ValueError, match="fused=True"):
            s.track(torch.optim.Adam(params, fused=True))
    assert auto.param_groups[0]["foreach"] is False and chosen.param_groups[0]["foreach"] is True
    with Session(tmp_path / "f", mode="off", precision="fp32", sources=Sources(seed=0)) as s:
        plain = s.track(torch.optim.AdamW(params))
        s.track(torch.optim.Adam(params, fused=True))
    assert plain.param_groups[0]["foreach"] is None


def test_each_rules_revision_replays_as_it_was_recorded(tmp_path, monkeypatch):
    """Rules revision 2 takes ``pow(x, 2)`` as exact (``x * x``): a GPT-2 (tanh GELU: squares in its
    backward) records the same weights under revisions 1, 4 and the latest (8: ops that only move values
    kept; 7: a reduction's -0 logged, an unlogged replayed element within reach of zero taken for +0),
    a smaller log under 4 than under 1 (its squares' ties are not logged), and each bundle replays on its
    own rules on two profiles with nothing unlogged or refused. A bundle of a revision this detrl does not
    know is bad input, in one line."""
    import json

    from detrl.core import engine
    from detrl.formats import bundle as bundle_mod
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["hf_gpt2"]
    if not zoo.available(specimen):
        pytest.skip("this transformers has no GPT2LMHeadModel")
    old, middle, new = tmp_path / "rules1", tmp_path / "rules4", tmp_path / "latest"
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 1)
        before = zoo.record(specimen, old, steps=3)
        m.setattr(engine, "RULES_REVISION", 4)
        after = zoo.record(specimen, middle, steps=3)
    zoo.record(specimen, new, steps=3)
    manifests = [json.loads((d / bundle_mod.MANIFEST).read_text()) for d in (old, middle, new)]
    assert [m["rules_revision"] for m in manifests] == [1, 4, RULES_REVISION] == [1, 4, 18]
    assert len({m["durable"]["merkle_root"] for m in manifests}) == 1
    assert 0 < after.totals.logged < before.totals.logged
    for bundle in (old, middle, new):
        for hardware in ("native", get_profile("emulated:splitk", seed=0)):
            replayed = zoo.replay(specimen, bundle, hardware, steps=3)  # raises Divergence if it differs
            assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0
    manifests[2]["rules_revision"] = RULES_REVISION + 1
    (new / bundle_mod.MANIFEST).write_text(json.dumps(manifests[2]))
    with pytest.raises(engine.BundleError) as raised:
        zoo.replay(specimen, new, "native", steps=3)
    message = str(raised.value)
    assert (
        f"recorded by a newer detrl (rounding-rule revision {RULES_REVISION + 1}; this one applies revisions 1 "
        f"to {RULES_REVISION})" in message
    )
    assert "\n" not in message


def test_a_convolution_gradient_that_cancels_is_covered_from_rules_revision_6(tmp_path, monkeypatch):
    """The zoo's conditioned projection (a 1x1 convolution over features and a learned constant map, into a
    training-mode batch norm): the projection's weight gradient on the constant channels cancels to
    rounding noise. Under revision 5 it was measured at its own scale: calibration capped its threshold
    (a warning), the log held over a hundred times the entries, and a replay still met elements near a
    midpoint that no entry covered. Under 6 (its terms' units) the log is small, it matters (the replay
    corrects elements), and nothing is left uncovered."""
    from detrl.core import engine
    from detrl.core.calibrate import CalibrationCapWarning
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["conditioned_projection"]
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 5)
        with pytest.warns(CalibrationCapWarning, match="convolution_backward"):
            old = zoo.record(specimen, tmp_path / "rules5", steps=2)
    new = zoo.record(specimen, tmp_path / "rules6", steps=2)
    assert 0 < 100 * new.totals.logged < old.totals.logged
    hardware = get_profile("emulated:reversed")
    replayed_old = zoo.replay(specimen, tmp_path / "rules5", hardware, steps=2)
    assert replayed_old.totals.unlogged_near > 0
    replayed = zoo.replay(specimen, tmp_path / "rules6", hardware, steps=2)
    assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0
    assert replayed.totals.corrected > 0


def test_a_layer_norm_sum_that_cancels_to_zero_is_covered_from_rules_revision_7(tmp_path, monkeypatch):
    """The zoo's layer norm followed by a mean over its features: the norm's backward row sums cancel, to
    exactly 0.0 in some rows on the recorder and to noise on other orders. Recorded under revision 6, the
    fixed emulated orders diverge (``emulated:atomic`` draws a fresh order every call: most of its draws
    do); under 7 each replicates with nothing unlogged, atomic's draws too, from a log no larger."""
    from detrl.core import engine
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["layer_norm_then_mean"]
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 6)
        old = zoo.record(specimen, tmp_path / "rules6", steps=2)
    new = zoo.record(specimen, tmp_path / "rules7", steps=2)
    assert new.totals.logged <= old.totals.logged
    for name in ("emulated:pairwise", "emulated:splitk"):
        with pytest.raises(engine.Divergence, match="unlogged-near"):
            zoo.replay(specimen, tmp_path / "rules6", get_profile(name), steps=2)
    for name, seed in (
        ("emulated:pairwise", None),
        ("emulated:splitk", None),
        *[("emulated:atomic", s) for s in range(3)],
    ):
        replayed = zoo.replay(specimen, tmp_path / "rules7", get_profile(name, seed=seed), steps=2)
        assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0


#: A call of each op :data:`detrl.core.oprules.KEEP_FROM_8` lists, on FP32-grid FP64 inputs ``x`` (4-d).
def _kept_from_8_calls(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    aten = torch.ops.aten
    m, v, idx = x[0, 0], x.flatten()[:10], torch.tensor([4, 1])
    return {
        "unsafe_split": lambda: aten.unsafe_split.Tensor(x, 2, 1),
        "unsafe_split_with_sizes": lambda: aten.unsafe_split_with_sizes.default(x, [1, 3], 1),
        "unsafe_chunk": lambda: aten.unsafe_chunk.default(x, 2, 1),
        "slice_backward": lambda: aten.slice_backward.default(x, [2, 4, 6, 8], 3, 1, 7, 1),
        "select_backward": lambda: aten.select_backward.default(m, [3, 6, 6], 0, 1),
        "diagonal_backward": lambda: aten.diagonal_backward.default(m[0], [6, 6], 0, 0, 1),
        "ceil": lambda: aten.ceil.default(x * 8),
        "ceil_": lambda: aten.ceil_.default(x * 8),
        "floor": lambda: aten.floor.default(x * 8),
        "floor_": lambda: aten.floor_.default(x * 8),
        "trunc": lambda: aten.trunc.default(x * 8),
        "trunc_": lambda: aten.trunc_.default(x * 8),
        "tril": lambda: aten.tril.default(m),
        "tril_": lambda: aten.tril_.default(m.clone()),
        "triu": lambda: aten.triu.default(m, 1),
        "triu_": lambda: aten.triu_.default(m.clone()),
        "masked_scatter": lambda: aten.masked_scatter.default(m, m > 0, x),
        "masked_scatter_": lambda: aten.masked_scatter_.default(m.clone(), m > 0, x),
        "pixel_shuffle": lambda: aten.pixel_shuffle.default(x, 2),
        "pixel_unshuffle": lambda: aten.pixel_unshuffle.default(x, 2),
        "channel_shuffle": lambda: aten.channel_shuffle.default(x, 2),
        "native_channel_shuffle": lambda: aten.native_channel_shuffle.default(x, 2),
        "repeat_interleave": lambda: aten.repeat_interleave.self_int(x, 2, 1),
        "_unsafe_index": lambda: aten._unsafe_index.Tensor(x, [None, torch.tensor([3, 0, 3])]),
        "upsample_nearest1d": lambda: aten.upsample_nearest1d.default(x[0], [9]),
        "upsample_nearest2d": lambda: aten.upsample_nearest2d.default(x, [9, 12]),
        "upsample_nearest3d": lambda: aten.upsample_nearest3d.default(x[None], [3, 9, 12]),
        "_upsample_nearest_exact1d": lambda: aten._upsample_nearest_exact1d.default(x[0], [9]),
        "_upsample_nearest_exact2d": lambda: aten._upsample_nearest_exact2d.default(x, [9, 12]),
        "_upsample_nearest_exact3d": lambda: aten._upsample_nearest_exact3d.default(x[None], [3, 9, 12]),
        "reflection_pad1d": lambda: aten.reflection_pad1d.default(x[0], [2, 3]),
        "reflection_pad2d": lambda: aten.reflection_pad2d.default(x, [2, 3, 1, 2]),
        "reflection_pad3d": lambda: aten.reflection_pad3d.default(x, [2, 3, 1, 2, 1, 1]),
        "replication_pad1d": lambda: aten.replication_pad1d.default(x[0], [2, 3]),
        "replication_pad2d": lambda: aten.replication_pad2d.default(x, [2, 3, 1, 2]),
        "replication_pad3d": lambda: aten.replication_pad3d.default(x, [2, 3, 1, 2, 1, 1]),
        "diag_embed": lambda: aten.diag_embed.default(x),
        "diag": lambda: aten.diag.default(v, 1),
        "im2col": lambda: aten.im2col.default(x, [3, 3], [1, 1], [1, 1], [2, 2]),
        "hardtanh_backward": lambda: aten.hardtanh_backward.default(x, x.flip(0), -0.5, 0.5),
        "max_pool3d_with_indices": lambda: aten.max_pool3d_with_indices.default(x, [2, 2, 2], [1, 2, 2]),
        "adaptive_max_pool1d": lambda: aten.adaptive_max_pool1d.default(x[0], [4]),
        "adaptive_max_pool2d": lambda: aten.adaptive_max_pool2d.default(x, [4, 4]),
        "adaptive_max_pool3d": lambda: aten.adaptive_max_pool3d.default(x, [2, 4, 4]),
        "kthvalue": lambda: aten.kthvalue.default(x, 3, -1),
        "median": lambda: aten.median.dim(x, -1),
        "nanmedian": lambda: aten.nanmedian.dim(x, -1),
        "cummax": lambda: aten.cummax.default(x, -1),
        "cummin": lambda: aten.cummin.default(x, -1),
        "msort": lambda: aten.msort.default(x),
        "alias_copy": lambda: aten.alias_copy.default(x),
        "unsqueeze_copy": lambda: aten.unsqueeze_copy.default(x, 1),
        "squeeze_copy": lambda: aten.squeeze_copy.default(x[:1]),
        "t_copy": lambda: aten.t_copy.default(m),
        "transpose_copy": lambda: aten.transpose_copy.int(x, 1, 3),
        "permute_copy": lambda: aten.permute_copy.default(x, [3, 1, 0, 2]),
        "expand_copy": lambda: aten.expand_copy.default(m[:1], [4, 6]),
        "slice_copy": lambda: aten.slice_copy.Tensor(x, 3, 1, 5, 2),
        "select_copy": lambda: aten.select_copy.int(x, 2, 3),
        "split_copy": lambda: aten.split_copy.Tensor(x, 4, 3),
        "split_with_sizes_copy": lambda: aten.split_with_sizes_copy.default(x, [2, 4], 3),
        "unbind_copy": lambda: aten.unbind_copy.int(x, 1),
        "diagonal_copy": lambda: aten.diagonal_copy.default(x, 0, 2, 3),
        "as_strided_copy": lambda: aten.as_strided_copy.default(x, [3, 3], [7, 2], 1),
        "detach_copy": lambda: aten.detach_copy.default(x),
        "_reshape_copy": lambda: aten._reshape_copy.default(x, [8, 36]),
        "unfold_copy": lambda: aten.unfold_copy.default(x, 3, 2, 1),
        "index_copy": lambda: aten.index_copy.default(m, 0, idx, x[1, 1, :2]),
        "index_copy_": lambda: aten.index_copy_.default(m.clone(), 0, idx, x[1, 1, :2]),
        "take": lambda: aten.take.default(x, torch.tensor([[3, 70], [5, 1]])),
    }


def test_ops_kept_from_rules_revision_8_leave_fp32_grid_values_on_the_grid():
    """What makes an op ``KEEP`` from revision 8: its FP64 result of FP32-grid inputs is on the grid, so
    rounding it changes nothing and no machine can round it otherwise. Each listed op, on random grid
    values (scaled by 8 where it rounds to integers, so that they have fractions), gives grid values; under
    revision 7 each was an unlisted reduction. A sum of the same values is off the grid: the check can fail."""
    from detrl.core.oprules import KEEP_FROM_8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64).float().double()
    calls = _kept_from_8_calls(x)
    assert set(calls) == {p.__name__ for p in KEEP_FROM_8}, "a listed op without a call here, or one unlisted"
    for name, call in calls.items():
        out = call()
        for t in (out,) if isinstance(out, torch.Tensor) else out:
            if t.is_floating_point():
                assert torch.equal(t.float().double(), t), name
        for overload in getattr(torch.ops.aten, name).overloads():
            func = getattr(getattr(torch.ops.aten, name), overload)
            assert classify(func, {}, 8) is OpKind.KEEP and classify(func, {}, 7) is OpKind.REDUCTION, func
    total = x.sum(-1)
    assert not torch.equal(total.float().double(), total)


def test_an_lstm_keeps_its_gate_split_from_rules_revision_8(tmp_path, monkeypatch):
    """The zoo's LSTM splits its gates with ``unsafe_split``, unlisted before revision 8 and so logged as a
    reduction: its views were rounded (to no effect) and took op positions. Recorded under 7 and 8, the
    weights are the same bit for bit, and each bundle replicates under its own rules on two orders."""
    import json

    from detrl.core import engine
    from detrl.formats import bundle as bundle_mod
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["lstm"]
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 7)
        zoo.record(specimen, tmp_path / "rules7", steps=2)
        m.setattr(engine, "RULES_REVISION", 8)
        zoo.record(specimen, tmp_path / "rules8", steps=2)
    manifests = [json.loads((tmp_path / d / bundle_mod.MANIFEST).read_text()) for d in ("rules7", "rules8")]
    assert [m["rules_revision"] for m in manifests] == [7, 8]
    assert manifests[0]["durable"]["merkle_root"] == manifests[1]["durable"]["merkle_root"]
    for bundle in ("rules7", "rules8"):
        for name in ("emulated:pairwise", "emulated:splitk"):
            replayed = zoo.replay(specimen, tmp_path / bundle, get_profile(name), steps=2)
            assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0


def test_activations_take_their_own_kinds_from_rules_revision_11():
    """PReLU and ``threshold`` are exact, hard sigmoid (and its backward) and Mish elementwise, and an
    in-place op is its out-of-place form (``silu_`` as ``silu``, ``square_`` as ``square``, ``sign_`` as
    ``sign``); under revision 10 each was a reduction. Mish's backward and unlisted in-place ops whose
    out-of-place form is unlisted too (``lgamma_``) stay reductions, and listed ops keep their kinds."""
    aten = torch.ops.aten
    kinds = {
        aten._prelu_kernel.default: OpKind.EXACT, aten._prelu_kernel_backward.default: OpKind.EXACT,
        aten.threshold.default: OpKind.EXACT, aten.threshold_.default: OpKind.EXACT,
        aten.hardsigmoid.default: OpKind.ELEMENTWISE, aten.hardsigmoid_.default: OpKind.ELEMENTWISE,
        aten.hardsigmoid_backward.default: OpKind.ELEMENTWISE, aten.mish.default: OpKind.ELEMENTWISE,
        aten.mish_.default: OpKind.ELEMENTWISE, aten.silu_.default: OpKind.ELEMENTWISE,
        aten.leaky_relu_.default: OpKind.ELEMENTWISE, aten.elu_.default: OpKind.ELEMENTWISE,
        aten.sin_.default: OpKind.ELEMENTWISE, aten.square_.default: OpKind.EXACT, aten.sign_.default: OpKind.KEEP,
    }  # fmt: skip
    for func, kind in kinds.items():
        assert classify(func, {}, 11) is kind and classify(func, {}, 10) is OpKind.REDUCTION, func
    for func in (aten.mish_backward.default, aten.lgamma_.default, aten.sum.default, aten.__ilshift__.Tensor):
        assert classify(func, {}, 11) is OpKind.REDUCTION, func
    for func in (
        aten.gelu.default,
        aten.gelu_backward.default,
        aten.silu_backward.default,
    ):  # arguments' units
        assert classify(func, {}, 10) is OpKind.ELEMENTWISE and classify(func, {}, 11) is OpKind.REDUCTION
    assert classify(aten.gelu_.default, {}, 11) is OpKind.REDUCTION  # its input is gone: its channel's scale
    for func in (aten.relu_.default, aten.add_.Tensor, aten.tanh_.default, aten.ceil_.default):
        assert classify(func, {}, 11) is classify(func, {}, 10), func


def _cancelling_activation(op: str) -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
    """``(func, x, another)``: an op of ``oprules.GRADIENT_SCALED_FROM_11``, 8,001 consecutive float32 inputs
    where its result cancels, and the same function written another way in FP64 (another library's)."""
    aten = torch.ops.aten
    s2, s2pi = math.sqrt(2), math.sqrt(2 * math.pi)
    cases = {  # op: (func, where it cancels, the same function written another way)
        "gelu": (aten.gelu.default, -5.0, lambda x: x * 0.5 * torch.erfc(-x / s2)),
        "gelu_backward": (
            aten.gelu_backward.default,
            -0.7517915246935645,
            lambda g, x: g * (0.5 * torch.erfc(-x / s2) + x * torch.exp(-x * x / 2) / s2pi),
        ),
        "silu_backward": (
            aten.silu_backward.default,
            -1.2784645427610737,
            lambda g, x: g * (torch.sigmoid(x) + x * torch.sigmoid(x) * (1 - torch.sigmoid(x))),
        ),
    }
    func, at, another = cases[op]
    step = 2.0**-21 if op == "gelu" else 2.0**-23  # float32 spacing there
    return func, (torch.arange(-4000, 4001, dtype=torch.float64) * step + at).float().double(), another


@pytest.mark.parametrize("op", ["gelu", "gelu_backward", "silu_backward"])
def test_an_activation_that_cancels_is_logged_in_its_arguments_units_from_rules_revision_11(op: str) -> None:
    """GELU cancels for x < -3 (``1 + erf``), and GELU's and SiLU's backwards near x = -0.75 and x = -1.28:
    there torch's FP64 result and another library's (the same function, written another way) round to
    different float32 values. Under revision 10 (elementwise, at the result's own spacing) such an element
    was not near a midpoint, so no entry named its direction and a replay on that library diverged; from 11
    (in units of ``|x|`` or the incoming gradient, at the least threshold) every one is, and random inputs
    still log about 1 element in 50,000."""
    from detrl.core.rounding import TAU_FLOOR, TAU_FLOOR_MEASURED

    func, x, another = _cancelling_activation(op)
    args = (x,) if op == "gelu" else (torch.ones_like(x), x)
    ours, theirs = func(*args), another(*args)
    differ = ours.float() != theirs.float()
    assert classify(func, {}, 10) is OpKind.ELEMENTWISE and classify(func, {}, 11) is OpKind.REDUCTION
    assert reduction_scale(func, args, ours, rules_revision=10) is None
    scale = reduction_scale(func, args, ours, rules_revision=11)
    assert scale is not None and differ.any()
    assert (differ & ~near_midpoint(ours, TAU_FLOOR, False)).any()  # revision 10 missed it
    assert not (differ & ~near_midpoint(ours, TAU_FLOOR_MEASURED, scale)).any()
    gen = torch.Generator().manual_seed(0)
    random = tuple(torch.randn(100_000, generator=gen, dtype=torch.float64).float().double() for _ in args)
    out = func(*random)
    assert int(near_midpoint(out, TAU_FLOOR_MEASURED, reduction_scale(func, random, out, 11)).sum()) <= 10


def _gelu_in_its_tail() -> torch.nn.Module:
    """An MLP whose GELU inputs lie around -4 (its first bias): in GELU's tail, where torch's 1 + erf cancels."""
    first = torch.nn.Linear(16, 32)
    with torch.no_grad():
        first.bias.fill_(-4.0)
    return torch.nn.Sequential(first, torch.nn.GELU(), torch.nn.Linear(32, 5))


def test_a_gelu_in_its_tail_replays_on_another_library_from_rules_revision_11(tmp_path, monkeypatch) -> None:
    """emulated:pairwise computes GELU through erfc and its backward without the terms that cancel, as another
    library may, so in GELU's tail its results differ from torch's by far more than an ulp of themselves.
    Calibrating a revision 10 recording (GELU elementwise, at its result's spacing), the profiles' disagreement
    there is beyond what a threshold can cover, and the calibration warns. Revision 11 (in units of x, and of
    the incoming gradient) records without a warning, and its replay on that profile replicates with nothing
    unlogged. (No small model here showed a revision 10 bundle diverging in its state, even the tied-embedding
    LM over 40 steps at width 128: later roundings absorb the differing tail values. The warning shows it.)"""
    from detrl.core import engine
    from detrl.core.calibrate import CalibrationCapWarning
    from detrl.testing import zoo

    specimen = zoo.Specimen("gelu_tail", _gelu_in_its_tail, zoo.features, zoo.classify)
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 10)
        with pytest.warns(CalibrationCapWarning, match="aten.gelu"):
            zoo.record(specimen, tmp_path / "rules10", steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationCapWarning)
        zoo.record(specimen, tmp_path / "rules11", steps=2)
    for name in ("emulated:pairwise", "emulated:splitk"):
        replayed = zoo.replay(specimen, tmp_path / "rules11", get_profile(name), steps=2)
        assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, name


def _gelu_of_a_nan() -> torch.nn.Module:
    first = torch.nn.Linear(16, 32)  # zoo.features: width // 2 = 16
    with torch.no_grad():
        first.bias[3] = math.nan  # a run gone NaN: every later value is NaN
    return torch.nn.Sequential(first, torch.nn.GELU(), torch.nn.Linear(32, 5))


def test_a_run_gone_nan_replays_on_its_own_hardware_with_nothing_refused(tmp_path, monkeypatch) -> None:
    """Under rules revision 15, GELU's unit is its argument's (revision 11), and a NaN's is NaN: its NaN
    results are pinned, and a replay honours a pinned NaN with a NaN (which takes the recorder's sign and
    payload); it refused every one. From 16 a NaN takes no entry: the same run logs nothing, its weights are
    the same, and it replays on every profile with nothing unlogged or refused."""
    from detrl.core import engine
    from detrl.testing import zoo

    specimen = zoo.Specimen("gelu_of_a_nan", _gelu_of_a_nan, zoo.features, zoo.classify)
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 15)
        recorded = zoo.record(specimen, tmp_path / "rules15", steps=2)
    assert recorded.totals.logged > 0 and any(p.isnan().any() for p in recorded.model.parameters())
    replayed = zoo.replay(specimen, tmp_path / "rules15", "native", steps=2)
    assert replayed.totals.refused == 0 and replayed.totals.logged == recorded.totals.logged
    unlogged = zoo.record(specimen, tmp_path / "rules16", steps=2)
    assert unlogged.totals.logged == 0 and unlogged.leaves == recorded.leaves
    for hardware in ("native", "emulated:splitk", "emulated:pairwise"):
        replayed = zoo.replay(specimen, tmp_path / "rules16", get_profile(hardware), steps=2)
        assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, hardware
        assert replayed.leaves == unlogged.leaves, hardware


class _InfiniteMasks(torch.nn.Module):
    """Self-attention whose padded query rows are masked whole with -inf: those rows softmax to NaN, and the
    NaN spreads into every weight (a run gone NaN, as one does with an explicit ``-inf`` mask)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, 3 * width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.emb(tokens)  # (B, T, width)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, width) each
        keep = tokens >= 8  # ids below 8 pad
        pair = keep[:, :, None] & keep[:, None, :]  # (B, T, T)
        attn = (q @ k.transpose(1, 2)).masked_fill(~pair, -math.inf).softmax(-1)  # NaN rows
        return self.head(x + attn @ v)


def test_a_run_gone_nan_replicates_on_other_hardware_from_rules_revision_13(tmp_path, monkeypatch) -> None:
    """A NaN's sign and payload are the hardware's: this machine's invalid operations give -NaN, the emulated
    profiles' +NaN. Under revision 12 the states committed those bits, and a replay on other hardware
    diverged at the first step with every value the same (on the recorder's own hardware it replicates).
    From revision 13 a commitment takes every NaN as one: the replays replicate, nothing refused."""
    from detrl.core import engine
    from detrl.testing import zoo

    masks = zoo.SPECIMENS["extreme_masks"]
    build = functools.partial(_InfiniteMasks, *masks.build.args)  # the same width and vocabulary
    specimen = zoo.Specimen("infinite_masks", build, masks.batch, masks.loss)
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 12)
        before = zoo.record(specimen, tmp_path / "rules12", steps=2)
        assert any(p.isnan().any() for p in before.model.parameters())
        zoo.replay(specimen, tmp_path / "rules12", "native", steps=2)
        with pytest.raises(engine.Divergence, match="diverged at step 1"):
            zoo.replay(specimen, tmp_path / "rules12", get_profile("emulated:splitk"), steps=2)
    after = zoo.record(specimen, tmp_path / "rules13", steps=2)
    assert any(p.isnan().any() for p in after.model.parameters())
    for name in ("emulated:splitk", "emulated:atomic"):
        replayed = zoo.replay(specimen, tmp_path / "rules13", get_profile(name), steps=2)
        assert replayed.totals.refused == 0 and replayed.totals.logged == after.totals.logged, name


def test_a_row_masked_whole_with_fp64s_minimum_trains_and_replays_from_rules_revision_12(
    tmp_path, monkeypatch
) -> None:
    """Attention masked with ``torch.finfo(scores.dtype).min``, FP64's minimum here (as a number, through
    ``torch.tensor`` and through ``torch.where``), rounded to FP32 was -inf, and a padded query's row, masked
    whole, softmaxed to NaN: under revision 11 the model's weights are NaN after two steps. From revision 12
    that minimum is FP32's, as the same model writes it in FP32: the row is uniform, the weights stay finite, and the replays on other hardware replicate with nothing refused or unlogged."""
    from detrl.core import engine
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["extreme_masks"]
    assert (zoo.tokens()[0] < 8).any(), "the batch has padding: rows masked whole"
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 11)
        before = zoo.record(specimen, tmp_path / "rules11", steps=2)
    assert any(p.isnan().any() for p in before.model.parameters())
    after = zoo.record(specimen, tmp_path / "rules12", steps=2)
    assert all(p.isfinite().all() for p in after.model.parameters())
    for name in ("emulated:splitk", "emulated:atomic"):
        replayed = zoo.replay(specimen, tmp_path / "rules12", get_profile(name), steps=2)
        assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, name


def test_fp64s_extremes_as_arguments_are_fp32s_from_rules_revision_12() -> None:
    """The arguments revision 12 takes as FP32's: FP64's largest finite number, either sign, as a number or
    a one-element FP64 CPU tensor, unless the call writes that tensor. Not a larger tensor, another dtype, or
    any other number (FP32's own extreme, infinities)."""
    from detrl.core.oprules import FP32_EXTREME, FP64_EXTREME, finite_extremes, fp32_extremes

    assert finite_extremes(12) and not finite_extremes(11)
    aten = torch.ops.aten
    low = torch.tensor(-FP64_EXTREME, dtype=torch.float64)
    scores, mask = torch.zeros(2, dtype=torch.float64), torch.tensor([True, False])
    args, kwargs = fp32_extremes(aten.masked_fill.Tensor, (scores, mask, low), {})
    assert args[2].dtype == torch.float64 and args[2].item() == -FP32_EXTREME and low.item() == -FP64_EXTREME
    assert args[:2] == (scores, mask) and kwargs == {}
    args, kwargs = fp32_extremes(aten.clamp.default, (scores,), {"min": -FP64_EXTREME, "max": 2.0})
    assert kwargs == {"min": -FP32_EXTREME, "max": 2.0}
    assert fp32_extremes(aten.fill_.Scalar, (low, 1.0), {})[0][0] is low  # the tensor it writes stays itself
    assert fp32_extremes(aten.fill_.Scalar, (scores, FP64_EXTREME), {})[0][1] == FP32_EXTREME
    for other in (
        torch.full((2,), -FP64_EXTREME, dtype=torch.float64),
        torch.tensor(-FP32_EXTREME, dtype=torch.float32),
        FP32_EXTREME,
        -math.inf,
        1e308,
        5,
    ):
        assert fp32_extremes(aten.masked_fill.Scalar, (scores, mask, other), {}) is None, other


@pytest.mark.parametrize("on", [True, False])
def test_prelu_over_many_binades_needs_no_entry_from_rules_revision_11(on: bool) -> None:
    """PReLU, forward and backward, over values spanning 60 binades within each channel (gradients of a
    saturated network: in an RMSprop MLP, PReLU's backward was 338,583 of 903,147 entries in 3 steps). As
    a reduction at its channel's largest value (revision 10), the small elements lie "near" a midpoint and
    are logged; as one product an element, exact in FP64 (revision 11), none is. The same results under
    both, with the native route on or off."""
    from detrl.core import native

    g = torch.Generator().manual_seed(11)
    binades = 2.0 ** -torch.randint(0, 60, (256, 1), generator=g, dtype=torch.float64)
    x, grad = (
        (torch.randn(256, 8, generator=g, dtype=torch.float64) * binades).float().double() for _ in "xg"
    )
    weight = torch.rand(8, generator=g, dtype=torch.float64).float().double()

    def step(revision: int) -> tuple[StepRounding, list[torch.Tensor]]:
        step = StepRounding()
        mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-22))
        mode.rules_revision = revision
        with native.switched(on), mode.step_scope(step):
            out = torch.ops.aten._prelu_kernel.default(x, weight)
            grads = torch.ops.aten._prelu_kernel_backward.default(grad, x, weight)
        return step, [out, *grads]

    (before, old), (after, new) = step(10), step(11)
    assert before.stats.logged > 100 and after.stats.logged == 0 and after.recorded == []
    assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))


def test_sums_exact_in_every_order_are_found():
    """An element of a sum of FP32 values is exact in FP64 in every order when its terms' exponents span
    at most 29 - ceil(log2(n)) binades: every permutation gives the same bits there. Terms off the FP32
    grid, or an embedding gradient scaled by frequency, are not plain sums: no element is claimed."""
    from detrl.core.scale import exact_sum_elements

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(64, 16, generator=g, dtype=torch.float64) + 1.0).float().double()  # one binade
    x[5, 8:] *= 2.0**-24  # spread 24 + ceil(log2(64)) = 30 binades: not exact
    x[7, :4] *= 2.0**-23  # 29: exact
    exact = exact_sum_elements(aten.sum.dim_IntList, (x, [0]), x.sum(0))
    assert exact is not None and exact.tolist() == [True] * 8 + [False] * 8
    for _ in range(20):  # any order: the same FP64 sums where claimed exact
        order = torch.randperm(64, generator=g)
        assert torch.equal(x[order].cumsum(0)[-1][:8], x.cumsum(0)[-1][:8])
    assert exact_sum_elements(aten.sum.dim_IntList, (x + 2.0**-40, [0]), x.sum(0)) is None  # off the grid

    grad = torch.randn(4, 8, 6, generator=g, dtype=torch.float64).float().double()
    tokens = torch.randint(0, 5, (4, 8), generator=g)
    out = aten.embedding_dense_backward(grad, tokens, 10, -1, False)
    exact = exact_sum_elements(aten.embedding_dense_backward.default, (grad, tokens, 10, -1, False), out)
    assert exact is not None and exact.shape == (60,) and bool(exact[30:].all())  # rows 5-9: no token
    assert (
        exact_sum_elements(aten.embedding_dense_backward.default, (grad, tokens, 10, -1, True), out) is None
    )


def test_a_convolution_exact_in_every_order_is_found_and_is_the_same_on_every_profile():
    """Rules revision 3: a convolution of few-bit inputs (digit pixels) whose every partial sum of products
    is exact in FP64 is claimed whole, and every hardware profile computes it to the same bits (the claim's
    point); 24-bit inputs over many terms, a value off the FP32 grid, an infinity or a transposed
    convolution are not claimed. A bias joins the bound with its own spacing."""
    from detrl.core.hardware import HardwareMode, profile_names
    from detrl.core.scale import exact_product_elements

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 17, (4, 3, 9, 9), generator=g).double() / 16  # 5 significant bits at most
    weight = torch.randn(6, 3, 3, 3, generator=g, dtype=torch.float64).float().double()
    bias = torch.randn(6, generator=g, dtype=torch.float64).float().double()

    def args(x: torch.Tensor, w: torch.Tensor, b: Any = None, transposed: bool = False) -> tuple:
        return (x, w, b, [1, 1], [1, 1], [1, 1], transposed, [0, 0], 1)

    def claimed(*a: Any) -> bool:
        out = aten.convolution.default(*a)
        found = exact_product_elements(aten.convolution.default, a, out)
        assert found is None or (found.shape == (out.numel(),) and bool(found.all()))
        return found is not None

    assert claimed(*args(pixels, weight))
    assert claimed(*args(pixels, weight, bias))
    want = aten.convolution.default(*args(pixels, weight, bias))
    for name in (p for p in profile_names() if p.startswith("emulated:")):
        with HardwareMode(get_profile(name, seed=1)):
            got = aten.convolution.default(*args(pixels, weight, bias))
        assert torch.equal(got, want), name
    features = torch.randn(4, 64, 9, 9, generator=g, dtype=torch.float64).float().double()
    wide = torch.randn(6, 64, 3, 3, generator=g, dtype=torch.float64).float().double()
    assert not claimed(*args(features, wide))  # 24 bits times 24 bits over 576 terms
    assert not claimed(*args(pixels + 2.0**-40, weight))  # off the FP32 grid
    with_inf = pixels.clone()
    with_inf[0, 0, 0, 0] = math.inf
    assert not claimed(*args(with_inf, weight))
    assert not claimed(*args(pixels, weight.transpose(0, 1).contiguous(), None, True))
    assert claimed(*args(torch.zeros_like(pixels), weight))  # no nonzero product: zeros


def test_rules_revision_3_leaves_a_first_convolutions_exact_ties_unlogged(tmp_path, monkeypatch, capsys):
    """The digits CNN's first convolution takes digit pixels (5 significant bits): under rules revision 3
    its outputs are exact in every order, and their FP32 ties need no entry. The same weights as under
    revision 2 (the same Merkle root), a smaller log, and both bundles audit on an emulated GPU."""
    _record_two_revisions(tmp_path, monkeypatch, capsys, 2, 3)


def _record_two_revisions(tmp_path, monkeypatch, capsys, older: int, newer: int) -> list[int]:  # noqa: ANN001
    """The digits CNN recorded under rules revisions ``older`` and ``newer``: the same weights (Merkle root),
    a smaller log under ``newer``, and both bundles audit on an emulated GPU. Returns the two logs' sizes."""
    import json

    from detrl.cli import main
    from detrl.core import engine
    from detrl.formats import bundle as bundle_mod

    old, new = tmp_path / f"rules{older}", tmp_path / f"rules{newer}"
    config = "configs/supervised/digits_cnn.yaml"
    for revision, out in ((older, old), (newer, new)):
        with monkeypatch.context() as m:
            m.setattr(engine, "RULES_REVISION", revision)
            assert main(["train", config, "--out", str(out), "--quiet", "--set", "train.steps=12"]) == 0
    manifests = [json.loads((d / bundle_mod.MANIFEST).read_text()) for d in (old, new)]
    assert [m["rules_revision"] for m in manifests] == [older, newer]
    assert manifests[0]["durable"]["merkle_root"] == manifests[1]["durable"]["merkle_root"]
    sizes = [(d / bundle_mod.ROUNDLOG).stat().st_size for d in (old, new)]
    assert sizes[1] < sizes[0], sizes
    for bundle in (old, new):
        assert main(["audit", str(bundle), "--hardware", "emulated:splitk", "--quiet"]) == 0
    capsys.readouterr()
    return sizes


def test_rules_revision_4_gives_each_output_of_a_call_its_own_threshold(tmp_path, monkeypatch, capsys):
    """Under rules revision 4 a convolution's input gradient is logged at its own threshold, not at its
    weight gradient's (8x8 images, batch 32: 2,048 products a weight-gradient sum, 288 an input-gradient
    one): the same weights, a smaller log, and both audit. The thresholds say so: each output of the
    second convolution's backward has its own, the input gradient's below the weight gradient's."""
    import json

    from detrl.core.rounding import Thresholds, output_key

    _record_two_revisions(tmp_path, monkeypatch, capsys, 3, 4)
    thresholds = Thresholds.from_json(
        json.loads((tmp_path / "rules4" / "manifest.json").read_text())["thresholds"]
    )
    backward = [k for k in thresholds.per_class if k.startswith("convolution_backward(") and "#" not in k]
    assert backward
    for cls in backward:
        own = [thresholds.per_class.get(output_key(cls, i)) for i in range(2)]
        if None not in own:  # both gradients measured: the input's is its own, below the class's
            assert own[0] < own[1] == thresholds.per_class[cls]
            break
    else:
        raise AssertionError(f"no convolution_backward class with a threshold per output: {backward}")


def test_the_kernel_path_of_exact_sums_finds_what_the_torch_path_finds(monkeypatch) -> None:
    """A CPU sum's exact elements are found by the C kernel (faster for small sums); on random sums over random
    dims, with zeros, infinities, NaN, terms off the FP32 grid, spreads of up to about 90 binades and transposed
    layouts, it gives the torch path's answer, element for element. A sum over an empty dim has none."""
    from detrl.core import scale

    if scale._native is None:
        pytest.skip("the C kernel is not built here")
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    exact_seen = 0
    for trial in range(600):
        nd = int(torch.randint(1, 4, (1,), generator=g))
        shape = [int(torch.randint(1, 6, (1,), generator=g)) for _ in range(nd)]
        binades = torch.randint(-15, 15, shape, generator=g).double() * (trial % 4)
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0**binades).float().double()
        r = torch.rand(shape, generator=g)
        x[r < 0.2] = 0
        if trial % 7 == 0:
            x[r > 0.95] = math.inf
        if trial % 13 == 0:
            x[r > 0.98] = math.nan
        if trial % 17 == 0:
            x = x + 2.0**-60
        if trial % 5 == 0 and nd >= 2:
            x = x.transpose(0, -1)
        if trial % 11 == 0:  # a lazily negated view: its memory holds the values unnegated
            x = torch._neg_view(x)
        dims = [
            int(d)
            for d in torch.randperm(nd, generator=g)[: int(torch.randint(1, nd + 1, (1,), generator=g))]
        ]
        out = x.sum(dims)
        found = {}
        for fast in (True, False):
            monkeypatch.setattr(scale, "KERNEL_SUMS", fast)
            found[fast] = scale.exact_sum_elements(aten.sum.dim_IntList, (x, dims), out)
        assert (found[True] is None) == (found[False] is None), (shape, dims)
        if found[True] is not None:
            assert torch.equal(found[True], found[False]), (shape, dims)
            exact_seen += int(found[True].sum())
    assert exact_seen > 100  # the comparison saw both answers
    empty = torch.zeros(0, 3, dtype=torch.float64)
    for fast in (True, False):
        monkeypatch.setattr(scale, "KERNEL_SUMS", fast)
        assert scale.exact_sum_elements(aten.sum.dim_IntList, (empty, [0]), empty.sum(0)) is None


@pytest.mark.parametrize("on_kernel", [True, False], ids=["kernel", "torch"])
def test_an_embeddings_exact_elements_are_found_over_the_rows_its_tokens_name(
    on_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding gradient's exact elements are found from the rows some token names (a GPT-2 batch
    names at most 512 of 50,257); every other row sums no term and is exact. The mask is the one the rule
    gives over the whole table (the reference below), with padding tokens, repeated tokens, zeros and
    infinities, on the C kernel's pass and on torch's alike; tokens outside the table, or a term off the
    FP32 grid, claim nothing."""
    from detrl.core import scale

    if on_kernel and not hasattr(scale._native, "exact_embedding_sums"):
        pytest.skip("native kernel not built")
    monkeypatch.setattr(scale, "KERNEL_SUMS", on_kernel)

    backward = torch.ops.aten.embedding_dense_backward

    def whole_table(grad: torch.Tensor, tokens: torch.Tensor, rows: int) -> torch.Tensor:
        width, flat = grad.shape[-1], tokens.reshape(-1)
        index = flat.view(-1, 1).expand(-1, width)
        magnitude = grad.reshape(-1, width).abs()
        largest = torch.zeros(rows, width, dtype=torch.float64).scatter_reduce_(0, index, magnitude, "amax")
        magnitude.masked_fill_(magnitude == 0, math.inf)
        smallest = torch.full((rows, width), math.inf, dtype=torch.float64)
        smallest.scatter_reduce_(0, index, magnitude, "amin")
        terms = torch.bincount(flat, minlength=rows).double().view(-1, 1)
        spread = torch.frexp(largest)[1] - torch.frexp(smallest.clamp(max=1e308))[1]
        exact = spread.double().add_(torch.log2(terms.clamp(min=1)).ceil_()) <= 29
        return ((exact | torch.isinf(smallest)) & torch.isfinite(largest)).reshape(-1)

    g = torch.Generator().manual_seed(1)
    exact_seen = not_exact_seen = 0
    for trial in range(300):
        b, t, width, rows = (int(torch.randint(1, k, (1,), generator=g)) for k in (4, 9, 7, 12))
        binades = torch.randint(-20, 20, (b, t, width), generator=g).double() * (trial % 3)
        grad = (torch.randn(b, t, width, generator=g, dtype=torch.float64) * 2.0**binades).float().double()
        grad[torch.rand(b, t, width, generator=g) < 0.2] = 0
        if trial % 9 == 0:
            grad[0, 0, 0] = math.inf
        tokens = torch.randint(0, rows, (b, t), generator=g, dtype=torch.int32 if trial % 2 else torch.int64)
        args = (grad, tokens, rows, int(torch.randint(-1, rows, (1,), generator=g)), False)
        found = scale.exact_sum_elements(backward.default, args, backward(*args))
        assert found is not None and torch.equal(found, whole_table(grad, tokens.long(), rows)), trial
        exact_seen, not_exact_seen = exact_seen + int(found.sum()), not_exact_seen + int((~found).sum())
    assert exact_seen > 100 and not_exact_seen > 100
    grad = torch.ones(1, 2, 3, dtype=torch.float64)
    outside = (grad, torch.tensor([[0, 7]]), 5, -1, False)
    assert scale.exact_sum_elements(backward.default, outside, torch.zeros(5, 3, dtype=torch.float64)) is None
    off_grid = (grad + 2.0**-40, torch.tensor([[0, 1]]), 5, -1, False)
    assert (
        scale.exact_sum_elements(backward.default, off_grid, torch.zeros(5, 3, dtype=torch.float64)) is None
    )


@pytest.mark.parametrize("on", [True, False])
def test_an_exact_sum_needs_no_entry_and_an_entry_for_one_is_refused(on: bool) -> None:
    """1 + 2**-24 lies exactly on an FP32 midpoint and is exact in FP64 in any order: rules revision 1 logs
    it, revision 2 does not; a replay refuses an entry there (one could steer the tie either way), with
    the native route on or off (on: the route runs the sum and hands its near output to the mode)."""
    from detrl.core import native

    x = torch.tensor([[1.0, 3.0], [2.0**-24, 0.5]], dtype=torch.float64)

    def entries(revision: int, replay: Any = None) -> StepRounding:
        step = StepRounding(replay=replay)
        mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-20))
        mode.rules_revision = revision
        native.counts.clear()
        with native.switched(on), mode.step_scope(step):
            torch.sum(x, [0])
        if on and native.available() and replay is None:
            assert native.counts["native"] == 1 and native.counts["python"] == 0
        return step

    assert [len(e.indices) for e in entries(1).recorded] == [1]
    assert entries(2).recorded == []
    forged = {0: OpEntries(op=0, indices=np.array([0], dtype=np.int64), up=np.array([True]))}
    step = entries(2, replay=forged)
    assert step.stats.refused == 1 and [a.kind for a in step.anomalies] == ["logged-not-near"]
    assert entries(1, replay=forged).stats.refused == 0  # revision 1 honours it


def test_infinite_attention_scores_set_no_unit_and_need_no_entry(tmp_path) -> None:
    """Causal and key-padding masks of ``-inf`` (plain torch's ``nn.TransformerEncoder`` with
    ``generate_square_subsequent_mask``) put infinities in a matrix product's output. An infinity rounds
    alike everywhere: it is never near a midpoint, and the unit of the scores beside it is their own
    largest finite magnitude. Before, it made its channel's unit infinite: 330 of 337 entries were the
    masked scores, and the replayer refused every one (``inf - inf`` is no distance), so an honest bundle
    audited as log incomplete on its own machine."""
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["masked_encoder"]
    rec = zoo.record(specimen, tmp_path / "run", steps=2)
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    assert rec.totals.logged < 50
    for hardware in ("native", "emulated:pairwise"):
        rep = zoo.replay(specimen, tmp_path / "run", hardware, steps=2)
        assert rep.totals.refused == 0 and rep.totals.unlogged_near == 0, hardware
        assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters()), hardware
    x = torch.tensor([[1.5, float("-inf"), -3.0], [float("inf"), float("nan"), 1e39]], dtype=torch.float64)
    # the largest magnitude per channel (column) that is finite in FP32: 1.5, none (0), 3 (1e39 overflows)
    assert torch.equal(scale_spacing(x), torch.tensor([[2.0**-23, 2.0**-149, 2.0**-22]], dtype=torch.float64))


def test_a_sum_whose_terms_cancel_is_measured_in_its_terms_units(tmp_path) -> None:
    """Rules revision 5: instance norm then global average pooling, layer norm then a mean over its features
    (the zoo's ``norms_then_means``): their backward sums cancel to rounding noise. Measured at their
    results' own scale, those calls disagreed between profiles by 0.004 spacings where their class's
    forward sums, which calibration had measured, disagreed by 2e-9; logged at that class's threshold, the
    replay diverged at step 1 on every emulated profile, with no anomaly. In their terms' units they log
    their noise, pinned, and replay."""
    from detrl.testing import zoo

    specimen = zoo.SPECIMENS["norms_then_means"]
    rec = zoo.record(specimen, tmp_path / "run", steps=2)
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    for hardware in ("emulated:reversed", "emulated:pairwise"):
        rep = zoo.replay(specimen, tmp_path / "run", hardware, steps=2)  # raises Divergence if it differs
        assert rep.totals.refused == 0 and rep.totals.unlogged_near == 0, hardware
        assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters()), hardware
    # the unit of a sum is its terms': at a result that cancelled to 0, still the spacing at its terms
    x = torch.tensor([[3.0, -3.0], [0.5, 0.25]], dtype=torch.float64)
    unit = reduction_scale(torch.ops.aten.sum.dim_IntList, (x, [1]), x.sum(1))
    assert unit is not None and unit.row is not None
    assert torch.equal(unit.dense().reshape(-1), torch.tensor([2.0, 0.5], dtype=torch.float64) * 2.0**-23)
    assert reduction_scale(torch.ops.aten.sum.dim_IntList, (x, [1]), x.sum(1), rules_revision=4) is None


@pytest.mark.parametrize("route", [True, False])
@pytest.mark.parametrize("case", ["complex_sqrt", "complex_noise", "sparse_gradient"])
def test_sparse_and_complex_results_are_refused_in_one_line(tmp_path, route: bool, case: str) -> None:
    """No rule rounds a sparse result, nor complex values an op outside detrl/core/complexes.py computes
    (left unrounded, one would replicate on the emulated profiles and differ on another machine): refused,
    on the native route and in the mode, naming the op. (Before, an FFT passed unrounded, a complex view's
    ``abs`` leaked FP64 values, and a sparse embedding gradient crashed in ``contiguous``.)"""
    from detrl.core import native
    from detrl.core.engine import Session
    from detrl.core.islands import UnroundableResult
    from detrl.core.sources import Sources

    models = {
        "complex_sqrt": (
            lambda: torch.nn.Linear(4, 3),
            lambda m, x: m(torch.view_as_complex(x.view(-1, 4, 2)).sqrt().real),
            "no rule for aten.sqrt on complex128 values",
        ),
        "complex_noise": (
            lambda: torch.nn.Linear(8, 3),
            lambda m, x: m(x + torch.view_as_real(torch.randn(4, 8, dtype=torch.complex128))[..., 0]),
            "no rule for aten.randn on complex128 values",
        ),
        "sparse_gradient": (  # a functional sparse embedding (a module with sparse=True is refused at init)
            lambda: torch.nn.Embedding(10, 8),
            lambda m, x: torch.nn.functional.embedding(
                (x.abs() * 3).long().clamp(max=9), m.weight, sparse=True
            ),
            "cannot round a sparse_coo result of aten._sparse_coo_tensor_with_dims_and_tensors",
        ),
    }
    build, forward, want = models[case]
    session = Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=1, checkpoint_every=0)
    with native.switched(route), pytest.raises(UnroundableResult) as raised, session:
        model = session.init(build)
        opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        with session.step(batch=(x,)):
            forward(model, x).sum().backward()
            opt.step()
    message = str(raised.value)
    assert want in message
    assert "\n" not in message


@pytest.mark.parametrize("precision", ["verifiable", "fp32"])
def test_a_module_that_makes_sparse_gradients_is_refused_at_init_in_verifiable_precision(
    tmp_path, precision: str
) -> None:
    """An ``nn.Embedding(sparse=True)`` (here inside a model) is refused by ``Session.init`` in one line that
    names it, before step 1 (the bundle holds no step); plain precisions train it."""
    from detrl.core.engine import Session
    from detrl.core.precision import Precision
    from detrl.core.sources import Sources

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Embedding(10, 8, sparse=True), torch.nn.Linear(8, 2))

    session = Session(
        tmp_path / "run", mode="record", sources=Sources(), precision=Precision(precision), planned_steps=1
    )
    if precision == "fp32":
        with session:
            assert session.init(build)[0].sparse
        return
    with pytest.raises(ValueError) as raised, session:
        session.init(build)
    message = str(raised.value)
    assert "\n" not in message and message == (
        "Session.init: 0 (Embedding) makes sparse gradients (sparse=True); verifiable precision rounds dense "
        "tensors: use nn.Embedding(..., sparse=False)"
    )


@pytest.mark.parametrize("route", [True, False])
def test_printing_tensors_inside_a_step_works_and_changes_nothing(tmp_path, route: bool) -> None:
    """``print(loss)`` inside a step: torch formats a tensor with the dispatch modes set aside, and on the
    native route that was an internal assert in torch (the Python key reached with no mode). Its ops run as
    they do without a mode, outside the step's ops: the bundle is the one a step without the print writes."""
    from detrl.core import native
    from detrl.core.engine import Session
    from detrl.core.sources import Sources
    from detrl.formats import bundle

    def record(where: str, show: bool) -> bytes:
        session = Session(tmp_path / where, sources=Sources(), planned_steps=1, checkpoint_every=0)
        with native.switched(route), session:
            model = session.init(lambda: torch.nn.Linear(4, 4))
            with session.step(batch=()):
                h = model(torch.ones(2, 4, dtype=torch.float64))
                loss = h.square().sum()
                if show:
                    assert "tensor(" in f"{h} {loss!r}" and f"{loss:.3f}" == f"{loss.item():.3f}"
                loss.backward()
        return b"".join(
            (tmp_path / where / name).read_bytes() for name in (bundle.COMMITMENTS, bundle.ROUNDLOG)
        )

    assert record("printed", True) == record("quiet", False)


@pytest.mark.parametrize("route", [True, False])
def test_a_zero_tensor_gradient_is_made_of_memory_inside_a_step(tmp_path, route: bool) -> None:
    """``torch.sgn``'s backward on real values returns ``_efficientzerotensor``: a tensor of zeros with no memory,
    which the rounding read at address 0 and crashed the process (on the native route and in the mode). Inside
    a step it is ``torch.zeros``: the step records, and both paths write the same bundle."""
    from detrl.core import native
    from detrl.core.engine import Session
    from detrl.core.sources import Sources
    from detrl.formats import bundle

    def record(where: str) -> bytes:
        session = Session(tmp_path / where, sources=Sources(), planned_steps=1, checkpoint_every=0)
        with native.switched(route if where == "first" else not route), session:
            model = session.init(lambda: torch.nn.Linear(4, 4))
            opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
            with session.step(batch=()):
                h = model(torch.ones(2, 4, dtype=torch.float64))
                (torch.sgn(h) * h).sum().backward()  # sgn's own gradient: a zero tensor
                opt.step()
        assert model.weight.grad is not None and not model.weight.grad._is_zerotensor()
        return (tmp_path / where / bundle.COMMITMENTS).read_bytes()

    assert record("first") == record("second")


def test_a_sparse_parameter_is_refused_at_init(tmp_path) -> None:
    """A run commits and rounds dense tensors: a sparse parameter is refused by ``Session.init``, naming it.
    (Complex parameters are held as complex64 or complex128: tests/test_complexes.py.)"""
    from detrl.core.engine import Session
    from detrl.core.sources import Sources

    class Sparse(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(4).to_sparse())

    session = Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=1, checkpoint_every=0)
    with pytest.raises(ValueError, match=r"Session.init: w is a sparse_coo tensor; .*densify it"), session:
        session.init(Sparse)


def test_ctc_loss_unwritten_alphas_are_set_before_they_are_rounded(tmp_path) -> None:
    """``_ctc_loss``'s CPU kernel leaves a sample's ``log_alpha`` past its input and target lengths as the
    allocator gave it (other values at every call): they were rounded and logged as data, and even a replay
    on the recorder's own profile refused or corrected entries. They are ``-inf`` (log 0) now, which its
    backward never reads: a CTC model replays with nothing refused, unlogged or corrected."""
    import functools

    from detrl.core.oprules import UNWRITTEN
    from detrl.testing import zoo

    def ctc(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        log_probs = model(batch[0]).view(8, 2, 5).log_softmax(-1)  # (T, N, C)
        targets = torch.tensor([[1, 2, 3], [4, 4, 2]])
        return torch.nn.functional.ctc_loss(log_probs, targets, [8, 7], [3, 2], zero_infinity=True)

    specimen = zoo.Specimen(
        "ctc", lambda: torch.nn.Linear(16, 10), functools.partial(zoo.features, zoo.Size(batch=2)), ctc
    )
    zoo.record(specimen, tmp_path / "run", steps=2)
    for hardware in ("native", "emulated:pairwise"):
        rep = zoo.replay(specimen, tmp_path / "run", hardware, steps=2)
        assert (rep.totals.refused, rep.totals.unlogged_near, rep.totals.corrected) == (0, 0, 0), hardware
    lp = torch.randn(8, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    args = (lp, torch.tensor([[1, 2, 3], [4, 4, 2]]), [8, 7], [3, 2], 0, True)
    out = torch.ops.aten._ctc_loss.default(*args)
    UNWRITTEN[torch.ops.aten._ctc_loss.default](args, out)
    assert torch.isneginf(out[1][1, 7:]).all() and torch.isneginf(out[1][1, :, 5:]).all()
    assert torch.isfinite(out[1][0, :, :2]).all()  # written entries stay


def test_a_grad_scaler_runs_its_float32_bookkeeping_as_given_and_replays(tmp_path) -> None:
    """torch.amp's GradScaler unscales FP64 gradients by a float32 inverse scale and keeps float32 flags, and
    its CPU kernels refuse float64 ones: the FP64 island had widened them, and the step crashed with
    torch's "inv_scale must be a float tensor". Its ops run as given (EXACT) and the run replays."""
    from detrl.core.engine import Session
    from detrl.core.sources import Sources

    def run(session: Session) -> Session:
        with session:
            model = session.init(lambda: torch.nn.Linear(4, 3))
            opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.arange(8) % 3
            for _ in range(2):
                with session.step(batch=(x, y)):
                    opt.zero_grad()
                    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
                    scaler.step(opt)
                    scaler.update()
        return session

    run(Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=2, checkpoint_every=0))
    for hardware in ("native", "emulated:pairwise"):
        replayed = run(
            Session(tmp_path / "run", mode="replay", hardware=hardware)
        )  # Divergence if it differs
        assert replayed.step_index == 2 and replayed.totals.refused == 0, hardware


def test_random_ops_of_tensor_arguments_draw_from_the_stream_and_replay(tmp_path) -> None:
    """``torch.normal(mean, std)`` with tensor arguments, ``multinomial``, ``poisson`` and gamma draws take the
    step's stream (they had no handler: a verifiable step refused them): a run replays bit for bit."""
    from detrl.core.engine import Session
    from detrl.core.sources import Sources

    def run(session: Session) -> Session:
        with session:
            model = session.init(lambda: torch.nn.Linear(4, 3))
            opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            for _ in range(2):
                with session.step(batch=(x,)):
                    h = model(x)
                    noisy = torch.normal(h, 0.1) + torch.normal(0.0, h.abs() + 0.1) + torch.poisson(h.abs())
                    pick = torch.multinomial(h.softmax(-1), 2, replacement=True)
                    loss = noisy.gather(1, pick).sum() + torch._standard_gamma(h.abs() + 1).sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        return session

    want = run(Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=2)).model.weight
    for hardware in ("native", "emulated:pairwise"):
        replayed = run(Session(tmp_path / "run", mode="replay", hardware=hardware))
        assert torch.equal(replayed.model.weight, want) and replayed.totals.refused == 0, hardware


def test_rrelu_and_the_other_seeded_fills_draw_from_the_stream_and_replay(tmp_path) -> None:
    """``nn.RReLU`` in training (its noise written in place, read again by its backward), ``randint_like``,
    ``torch.normal(mean, std, size)`` and the in-place ``cauchy_``, ``geometric_`` and ``log_normal_`` take
    the step's stream (a verifiable step refused them): a run replays bit for bit, and another seed draws
    other values."""
    from detrl.core.engine import Session
    from detrl.core.sources import Sources

    def run(session: Session) -> Session:
        with session:
            model = session.init(lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.RReLU()))
            opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            for _ in range(2):
                with session.step(batch=(x,)):
                    h = model(x)
                    cols = torch.randint_like(h[:, 0], 8).long()
                    noise = torch.normal(0.0, 0.1, h.shape, dtype=h.dtype)
                    fills = torch.empty_like(h).cauchy_().clamp(-1, 1) + torch.empty_like(h).geometric_(0.5)
                    fills = fills + torch.empty_like(h).log_normal_()
                    loss = (h + noise).gather(1, cols[:, None]).sum() + (h * fills).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        return session

    want = run(Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=2)).model[0].weight
    for hardware in ("native", "emulated:pairwise"):
        replayed = run(Session(tmp_path / "run", mode="replay", hardware=hardware))
        assert torch.equal(replayed.model[0].weight, want) and replayed.totals.refused == 0, hardware
    # the same initial model, another dropout stream (the one a step's random ops draw from)
    other_draws = Sources(streams={"dropout": {"seed": 12345}})
    other = run(Session(tmp_path / "other", mode="record", sources=other_draws, planned_steps=2))
    assert not torch.equal(other.model[0].weight, want)


class _Routed(torch.nn.Module):
    """Each of 12 tokens goes to two of three experts (a fixed routing): gathers whose backwards are an
    ``index_add`` (``index_select``) and an ``index_put`` with ``accumulate=True`` (indexing the experts;
    ``_index_put_impl_`` below the native route), and a ``scatter_add`` that brings the outputs back."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.experts = torch.nn.Parameter(torch.randn(3, 8, 8) / 4)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (12, 8) -> (12, 5)
        h = self.inp(x)
        token = torch.arange(12).repeat(2)  # (24,): every token twice
        expert = torch.cat([torch.arange(12) % 3, (torch.arange(12) + 1) % 3])
        routed = torch.bmm(h.index_select(0, token).unsqueeze(1), self.experts[expert]).squeeze(1)  # (24, 8)
        back = torch.zeros_like(h).scatter_add(0, token.view(-1, 1).expand(-1, 8), routed)
        return self.head(back)


def test_cumulative_sums_exact_in_every_order_are_found() -> None:
    """The sum rule at each element of a cumulative sum, for the terms it adds so far: exact where their
    exponents span at most 29 - ceil(log2(k)) binades, and the same bits in every profile's scan there.
    Terms off the FP32 grid are no plain sum: nothing is claimed."""
    from detrl.core.scale import exact_running_sum_elements

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4, 100, generator=g, dtype=torch.float64) + 1.0).float().double()  # one binade
    x[2, 50] *= 2.0**-26  # from there 26 + ceil(log2(k > 50)) = 32 binades: not exact
    x[3, 10] *= 2.0**-20  # 20 + 7 = 27: exact
    out = x.cumsum(1)
    exact = exact_running_sum_elements((x, 1), out)
    assert exact is not None
    want = torch.ones(4, 100, dtype=torch.bool)
    want[2, 50:] = False
    assert torch.equal(exact.view(4, 100), want)
    for name in ("emulated:splitk", "emulated:pairwise", "emulated:atomic"):  # scans in chunks
        scanned = get_profile(name)(aten.cumsum.default, (x, 1), {})
        assert torch.equal(scanned[want], out[want]), name
    assert torch.equal(exact_running_sum_elements((x.t(), 0), out.t()).view(100, 4), want.t())
    assert exact_running_sum_elements((x + 2.0**-40, 1), out) is None  # off the grid


def test_a_cumulative_sums_unit_is_that_of_the_terms_each_element_sums() -> None:
    """Rules revision 14: at element ``k`` the FP32 spacing of the largest finite term among the first ``k``,
    times ``terms_factor(k)``; an infinite term sets no unit (as a sum's). Before 14, none: the channel's."""
    from detrl.core.scale import reduction_scale

    cumsum = torch.ops.aten.cumsum.default
    x = torch.tensor([[1.0, 3.0, -8.0, 0.5, math.inf]], dtype=torch.float64)
    scale = reduction_scale(cumsum, (x, 1), x.cumsum(1))
    assert scale is not None
    assert scale.dense().reshape(-1).tolist() == [2.0**-23, 2.0**-22, 2.0**-20, 2.0**-19, 2.0**-19]
    assert reduction_scale(cumsum, (x, 1), x.cumsum(1), rules_revision=13) is None


class _RunningSums(torch.nn.Module):
    """Cumulative sums over a long axis (96, past an emulated profile's chunk): of values in one binade, as a
    state-space layer's cumulative decays are (sums of a few of them lie exactly on FP32 midpoints), and of
    values of both signs over 30 binades (no element exact: each in its terms' units)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.wide, self.out = (
            torch.nn.Linear(16, 96),
            torch.nn.Linear(16, 96),
            torch.nn.Linear(96, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        decays = torch.sigmoid(self.inp(x)) + 1.0  # (N, 96), in [1, 2)
        spread = torch.tanh(self.inp(x)) * torch.exp(10 * torch.tanh(self.wide(x)))  # (N, 96)
        return self.out(decays.cumsum(-1) / 96 + spread.cumsum(-1) * 1e-4)


def _before_and_after(specimen: Any, tmp_path: Any, monkeypatch: Any, revision: int) -> tuple[Any, Any]:
    """``specimen`` recorded for 2 steps under rules revision ``revision - 1`` and under the current one (a
    rule that changes only the log: the same weights), each replayed on every emulated profile with nothing
    unlogged or refused and the same weights; returns the two sessions."""
    from detrl.core import engine
    from detrl.testing import zoo

    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", revision - 1)
        before = zoo.record(specimen, tmp_path / "before", steps=2)
    after = zoo.record(specimen, tmp_path / "after", steps=2)
    assert after.leaves == before.leaves
    for run, recorded in (("before", before), ("after", after)):
        for hardware in ("emulated:splitk", "emulated:pairwise", "emulated:atomic", "emulated:reversed"):
            replayed = zoo.replay(specimen, tmp_path / run, get_profile(hardware), steps=2)
            assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, (run, hardware)
            assert replayed.leaves == recorded.leaves, (run, hardware)
    return before, after


def test_cumulative_sums_log_only_their_inexact_elements_from_revision_14(tmp_path, monkeypatch) -> None:
    """Rules revision 14 logs a cumulative sum's elements only where some order could round them otherwise;
    the weights are the same under 13 and 14, and each replays on its own rules on every emulated profile
    (which scan in chunks) with nothing unlogged or refused."""
    from detrl.testing import zoo

    specimen = zoo.Specimen("running_sums", _RunningSums, zoo.features, zoo.classify)
    before, after = _before_and_after(specimen, tmp_path, monkeypatch, 14)
    assert after.totals.logged < before.totals.logged / 2, (after.totals.logged, before.totals.logged)


def test_average_pool_elements_exact_in_every_order_are_found() -> None:
    """Rules revision 15: a pool's element is exact where its window's sum is (the sum rule over a window's
    size of terms), whatever its divisor; a backward's where its terms are on the FP32 grid too (every
    window holding it divides by a power of two) and their sum exact. Those elements have the same bits
    under every profile; values off the FP32 grid claim nothing."""
    from detrl.core.scale import exact_pool_elements

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(2, 3, 8, 8, generator=g, dtype=torch.float64) + 1.0).float().double()  # one binade
    x[0, 0, 0, 0] *= 2.0**-27  # 27 + ceil(log2(9)) = 31 binades in its windows: not exact
    pool = (x, [3, 3], [1, 1], [1, 1], False, False, None)  # divisors 4, 6 and 9
    out = aten.avg_pool2d.default(*pool)
    exact = exact_pool_elements(aten.avg_pool2d.default, pool, out)
    assert exact is not None
    want = torch.ones(2, 3, 8, 8, dtype=torch.bool)
    want[0, 0, :2, :2] = False  # the windows holding x[0, 0, 0, 0]
    assert torch.equal(exact.view(2, 3, 8, 8), want)
    grad = (torch.rand(2, 3, 8, 8, generator=g, dtype=torch.float64) + 1.0).float().double()
    back = (grad, *pool)
    grad_in = aten.avg_pool2d_backward.default(*back)
    exact_back = exact_pool_elements(aten.avg_pool2d_backward.default, back, grad_in)
    assert exact_back is not None and not bool(exact_back.any())  # every element has a term divided by 6 or 9
    halves = (grad, x, [2, 2], [2, 2], [0, 0], False, True, None)  # each element one term, divided by 4
    grad_half = (torch.rand(2, 3, 4, 4, generator=g, dtype=torch.float64) + 1.0).float().double()
    halves = (grad_half, *halves[1:])
    exact_half = exact_pool_elements(
        aten.avg_pool2d_backward.default, halves, aten.avg_pool2d_backward.default(*halves)
    )
    assert exact_half is not None and bool(exact_half.all())
    for name in ("emulated:splitk", "emulated:pairwise", "emulated:atomic", "emulated:reversed"):
        assert torch.equal(get_profile(name)(aten.avg_pool2d.default, pool, {})[want], out[want]), name
    assert (
        exact_pool_elements(aten.avg_pool2d.default, (x + 2.0**-40, *pool[1:]), out) is None
    )  # off the grid


@pytest.mark.parametrize("dims", [2, 3])
def test_every_profile_gives_an_average_pools_exact_elements_the_same_bits(dims: int) -> None:
    """Over pools with and without overlap, padding counted or not, ceil mode and a divisor given, of values
    in 3 binades and over 40: the elements found exact have the native bits under every profile (which
    differ elsewhere), forward and backward, and the profiles' disagreement is far inside the unit."""
    from detrl.core.scale import exact_pool_elements

    aten = torch.ops.aten
    forward = aten.avg_pool2d.default if dims == 2 else aten.avg_pool3d.default
    backward = aten.avg_pool2d_backward.default if dims == 2 else aten.avg_pool3d_backward.default
    shape = (2, 3, 9, 8) if dims == 2 else (2, 3, 5, 6, 7)
    g = torch.Generator().manual_seed(dims)

    def values(*size: int, binades: int) -> torch.Tensor:
        spread = torch.exp2(-torch.randint(0, binades, size, generator=g).double())
        return (torch.randn(*size, generator=g, dtype=torch.float64) * spread).float().double()

    calls = [(2, 2, 0, False, True, None), (3, 1, 1, False, True, None), (3, 2, 1, True, False, None),
             (2, 1, 1, True, True, None), (3, 2, 1, False, True, 5), (2, 1, 0, False, True, 4)]  # fmt: skip
    exact_seen = differ = 0
    for (k, s, p, ceil, include, override), binades in itertools.product(calls, (3, 40)):
        pool = (values(*shape, binades=binades), [k] * dims, [s] * dims, [p] * dims, ceil, include, override)
        out = forward(*pool)
        back = (values(*out.shape, binades=binades), *pool)
        for func, args in ((forward, pool), (backward, back)):
            ref = func(*args)
            exact = exact_pool_elements(func, args, ref)
            unit = reduction_scale(func, args, ref)
            assert exact is not None and unit is not None
            exact_seen += int(exact.sum())
            for name in ("emulated:splitk", "emulated:pairwise", "emulated:reversed", "emulated:atomic"):
                got = get_profile(name, seed=0)(func, args, {})
                same = got.reshape(-1).view(torch.int64) == ref.reshape(-1).view(torch.int64)
                assert bool(same[exact].all()), (name, func, k, s, p, ceil, include, override)
                differ += int((~same).sum())
                apart = (got - ref).abs().reshape(-1) / unit.dense().reshape(-1)
                assert float(apart.max()) < 2.0**-20, (name, func, float(apart.max()))
    assert exact_seen > 0 and differ > 0


def test_an_average_pools_unit_is_that_of_the_terms_each_element_sums() -> None:
    """Rules revision 15: at each element the FP32 spacing of its largest term, times ``terms_factor`` of the
    window's size; a forward's divided by the power of two at or below its divisor. Before 15, none."""
    from detrl.core.scale import reduction_scale

    aten = torch.ops.aten
    x = torch.tensor([[[[1.0, 3.0, 0.25], [-8.0, 0.5, 0.125]]]], dtype=torch.float64)  # (1, 1, 2, 3)
    pool = (x, [2, 2], [1, 1], [0, 0], False, True, None)  # two windows of 4: terms_factor(4) = 2
    out = aten.avg_pool2d.default(*pool)
    scale = reduction_scale(aten.avg_pool2d.default, pool, out)
    assert scale is not None
    assert scale.dense().reshape(-1).tolist() == [2.0**-23 * 8 * 2 / 4, 2.0**-23 * 2 * 2 / 4]
    assert reduction_scale(aten.avg_pool2d.default, pool, out, rules_revision=14) is None
    grad = torch.tensor([[[[4.0, -1.0]]]], dtype=torch.float64)
    back = (grad, *pool)
    scale = reduction_scale(aten.avg_pool2d_backward.default, back, aten.avg_pool2d_backward.default(*back))
    assert scale is not None  # the terms 1 and -0.25: the first window's, where it is
    assert scale.dense().reshape(-1).tolist() == [2.0**-23 * 2] * 2 + [2.0**-23 * 2 / 4] + [
        2.0**-23 * 2
    ] * 2 + [2.0**-23 * 2 / 4]


class _Pools(torch.nn.Module):
    """Average pools whose elements lie exactly on FP32 midpoints: a 2x2 pool of values in one binade,
    a local response norm (a pool over 3 channels of squares, and its backward divides by 3), and an
    overlapping 3x3 pool that leaves padding out (divisors 4, 6 and 9)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(16, 4 * 8 * 8), torch.nn.Linear(4 * (16 + 64 + 64), 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        h = (torch.sigmoid(self.inp(x)) + 1.0).view(-1, 4, 8, 8)  # in [1, 2)
        halves = torch.nn.functional.avg_pool2d(h, 2)  # (N, 4, 4, 4)
        normed = torch.nn.functional.local_response_norm(h, 3)  # (N, 4, 8, 8)
        smooth = torch.nn.functional.avg_pool2d(h * torch.tanh(h), 3, 1, 1, count_include_pad=False)
        return self.out(torch.cat([halves.flatten(1), normed.flatten(1), smooth.flatten(1)], 1))


def test_average_pools_log_only_their_inexact_elements_from_revision_15(tmp_path, monkeypatch) -> None:
    """Rules revision 15 logs an average pool's elements only where some order could round them otherwise:
    none of the forwards' here, and only backward elements with terms divided by 3, 6 or 9. The weights
    are the same under 14 and 15, and each replays on its own rules on every emulated profile (which sum
    the windows in their own orders) with nothing unlogged or refused."""
    from detrl.testing import zoo

    specimen = zoo.Specimen("pools", _Pools, zoo.features, zoo.classify)
    before, after = _before_and_after(specimen, tmp_path, monkeypatch, 15)
    assert after.totals.logged < before.totals.logged / 3, (
        after.totals.logged,
        before.totals.logged,
    )  # 548, 2,046


def test_adaptive_pool_elements_exact_in_every_order_and_division_are_found() -> None:
    """Rules revision 17: an adaptive pool's element is exact where its window's sum is and where that sum,
    divided by the window's size or by its lengths in turn, rounds alike: its divisor a power of two, or its
    terms within ``26 - ceil(log2(size))`` binades. A backward's where every window holding it divides by a
    power of two. Before 17, no rule."""
    from detrl.core.scale import exact_elements, exact_pool_elements

    aten = torch.ops.aten
    forward, backward = aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(2, 3, 9, 8, generator=g, dtype=torch.float64) + 1.0).float().double()  # one binade
    x[0, 0, 0, 0] *= 2.0**-20  # 20 + ceil(log2(6)) = 23 binades: divided alike
    x[0, 1, 0, 0] *= 2.0**-24  # 24 + 3 = 27: an exact sum (27 + 3 <= 29), but not divided alike
    x[1, 0, 0, 0] *= 2.0**-30  # 30 + 3: not an exact sum
    pool = (x, [3, 4])  # windows of 3 x 2: divisor 6
    out = forward(*pool)
    exact = exact_pool_elements(forward, pool, out)
    assert exact is not None
    want = torch.ones(2, 3, 3, 4, dtype=torch.bool)
    want[0, 1, 0, 0] = want[1, 0, 0, 0] = False
    assert torch.equal(exact.view(2, 3, 3, 4), want)
    halves = (x[..., :8, :], [4, 4])  # windows of 2 x 2: divisor 4, the sum rule alone
    exact_halves = exact_pool_elements(forward, halves, forward(*halves))
    assert exact_halves is not None and int((~exact_halves).sum()) == 1  # the 2**-30 one
    grad = (torch.rand(2, 3, 3, 4, generator=g, dtype=torch.float64) + 1.0).float().double()
    exact_back = exact_pool_elements(backward, (grad, x), backward(grad, x))
    assert exact_back is not None and not bool(exact_back.any())  # divided by 6
    grown = (grad, x[..., :2, :2])  # 2 x 2 grown to 3 x 4: windows of 1 or 2 along each dim, divisors 1, 2, 4
    exact_grown = exact_pool_elements(backward, grown, backward(*grown))
    assert exact_grown is not None and bool(exact_grown.all())
    assert exact_elements(forward, pool, out) is not None
    for name in ("emulated:splitk", "emulated:pairwise", "emulated:atomic", "emulated:reversed"):
        got = get_profile(name)(forward, pool, {}).reshape(-1)
        assert torch.equal(got[exact], out.reshape(-1)[exact]), name


@pytest.mark.parametrize("dims", [2, 3])
def test_every_profile_gives_an_adaptive_pools_exact_elements_the_same_bits(dims: int) -> None:
    """Over adaptive pools that shrink, grow (overlapping windows) or both, of values in 3 binades and over
    40, in both memory formats (a CPU divides by a window's size, or by its lengths in turn): the elements
    found exact round to the same FP32 bits under every profile and format, forward and backward, and the
    disagreements elsewhere are far inside the unit."""
    from detrl.core.scale import exact_pool_elements

    aten = torch.ops.aten
    forward = aten._adaptive_avg_pool2d.default if dims == 2 else aten._adaptive_avg_pool3d.default
    backward = (
        aten._adaptive_avg_pool2d_backward.default
        if dims == 2
        else aten._adaptive_avg_pool3d_backward.default
    )
    last = torch.channels_last if dims == 2 else torch.channels_last_3d
    g = torch.Generator().manual_seed(dims)

    def values(*size: int, binades: int) -> torch.Tensor:
        spread = torch.exp2(-torch.randint(0, binades, size, generator=g).double())
        return (torch.randn(*size, generator=g, dtype=torch.float64) * spread).float().double()

    calls = {2: [((9, 8), (3, 3)), ((7, 9), (4, 5)), ((5, 6), (7, 11)), ((6, 6), (4, 4))],
             3: [((5, 6, 7), (2, 4, 3)), ((3, 5, 2), (5, 2, 3))]}[dims]  # fmt: skip
    exact_seen = differ = 0
    for (size, out_size), binades in itertools.product(calls, (3, 40)):
        x = values(2, 8, *size, binades=binades)
        back = (values(2, 8, *out_size, binades=binades), x)
        for func, args in ((forward, (x, list(out_size))), (backward, back)):
            ref = func(*args)
            exact = exact_pool_elements(func, args, ref)
            unit = reduction_scale(func, args, ref)
            assert exact is not None and unit is not None
            exact_seen += int(exact.sum())
            formatted = func(*(a.contiguous(memory_format=last) if torch.is_tensor(a) else a for a in args))
            results = [("channels last", formatted.contiguous())]
            results += [
                (name, get_profile(name, seed=0)(func, args, {}))
                for name in ("emulated:splitk", "emulated:pairwise", "emulated:reversed", "emulated:atomic")
            ]
            for name, got in results:
                # their FP32 roundings: the FP64 quotients of one exact sum may differ in their last bits
                rounded = got.reshape(-1).float().view(torch.int32) == ref.reshape(-1).float().view(
                    torch.int32
                )
                assert bool(rounded[exact].all()), (name, func, size, out_size)
                differ += int((got != ref).sum())
                apart = (got - ref).abs().reshape(-1) / unit.dense().reshape(-1)
                assert float(apart.max()) < 2.0**-20, (name, func, float(apart.max()))
    assert exact_seen > 0 and differ > 0


def test_a_nearest_upsamplings_backward_elements_exact_in_every_order_are_found() -> None:
    """Rules revision 17: a nearest upsampling's backward sums the gradients of each input element's copies;
    an element is exact where that sum is exact in every order (the sum rule over the most copies). Those
    elements have the same bits under every profile, which sum the copies in their own orders. The rules
    list the ops that ``pools.BoxPool`` describes, no more and no fewer."""
    from detrl.core import pools
    from detrl.core.oprules import BOX_POOLS_FROM_17
    from detrl.core.scale import exact_pool_elements

    assert pools.BOX_POOLS == BOX_POOLS_FROM_17
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    for func, scales in (
        (aten.upsample_nearest2d_backward.default, (2.0, 2.0)),  # four copies of each
        (aten._upsample_nearest_exact2d_backward.default, (None, None)),  # one to four
    ):
        grad = (torch.rand(2, 3, 10, 12, generator=g, dtype=torch.float64) + 1.0).float().double()
        grad[0, 0, 0, 0] *= 2.0**-28  # 28 + ceil(log2(4)) = 30 binades for its element's sum: not exact
        args = (grad, [10, 12], [2, 3, 5, 6], *scales)
        ref = func(*args)
        exact = exact_pool_elements(func, args, ref)
        assert exact is not None
        assert int((~exact).sum()) == 1 and not bool(exact[0]), func
        for name in ("emulated:splitk", "emulated:pairwise", "emulated:atomic", "emulated:reversed"):
            got = get_profile(name, seed=0)(func, args, {}).reshape(-1)
            assert torch.equal(got[exact], ref.reshape(-1)[exact]), (name, func)


def test_col2im_elements_exact_in_every_order_are_found() -> None:
    """Rules revision 17: ``col2im`` (``F.fold``, ``F.unfold``'s backward) sums each image element's copies
    in the columns; an element is exact where that sum is exact in every order, and those elements have the
    same bits under every profile."""
    from detrl.core.scale import exact_pool_elements

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    columns = (torch.rand(2, 3 * 9, 36, generator=g, dtype=torch.float64) + 1.0).float().double()
    columns[0, 8, 0] *= 2.0**-26  # offset (2, 2) of block 0: image element (2, 2), 9 copies, 30 binades
    args = (columns, [8, 8], [3, 3], [1, 1], [0, 0], [1, 1])  # up to 9 copies of an element
    ref = aten.col2im.default(*args)
    exact = exact_pool_elements(aten.col2im.default, args, ref)
    assert exact is not None and int((~exact).sum()) == 1 and not bool(exact[2 * 8 + 2])
    for name in ("emulated:splitk", "emulated:pairwise", "emulated:atomic", "emulated:reversed"):
        got = get_profile(name, seed=0)(aten.col2im.default, args, {}).reshape(-1)
        assert torch.equal(got[exact], ref.reshape(-1)[exact]), name


def test_a_box_pools_extremes_are_those_of_its_gathered_terms() -> None:
    """``BoxPool.reduced`` (runs of consecutive positions: one sliding extreme per run length; col2im's
    holders, which are not consecutive: gathered) gives each sum's largest and smallest term, as the terms
    laid out in kernel order say: adaptive pools shrinking and growing, forward and backward, in 2d and 3d,
    a nearest backward, col2im, and an interpolation's boxes."""
    import math

    from detrl.core import interpolation, pools

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = randn(2, 3, 7, 9)
    calls = [
        (aten._adaptive_avg_pool2d.default, (x, [4, 5])),
        (aten._adaptive_avg_pool2d.default, (x, [11, 13])),
        (aten._adaptive_avg_pool2d_backward.default, (randn(2, 3, 11, 13), x)),
        (aten._adaptive_avg_pool2d_backward.default, (randn(2, 3, 3, 4), x)),
        (aten._adaptive_avg_pool3d.default, (randn(1, 2, 3, 4, 5), [5, 2, 3])),
        (aten.upsample_nearest2d_backward.default, (randn(2, 3, 2, 3), [2, 3], [2, 3, 5, 6], None, None)),
        (aten.col2im.default, (randn(2, 27, 9), [8, 8], [3, 3], [2, 2], [1, 1], [2, 2])),
    ]
    boxes = [pools.box_pool_call(func, args, {}) for func, args in calls]
    for func, args in (
        (aten.upsample_bilinear2d.default, (x, [20, 13], False)),
        (aten.upsample_bilinear2d_backward.default, (randn(2, 3, 3, 4), [3, 4], [2, 3, 7, 9], False)),
    ):
        call = interpolation.interpolation_call(func, args, {})
        assert call is not None
        boxes.append(call.box())
    for box in boxes:
        assert box is not None
        t = box.values.abs()
        terms = box.gathered(t, math.nan).flatten(-len(box.out))
        for combine in ("amax", "amin"):
            fill = 0.0 if combine == "amax" else math.inf
            want = terms.nan_to_num(fill).amax(-1) if combine == "amax" else terms.nan_to_num(fill).amin(-1)
            assert torch.equal(box.reduced(t, combine, fill), want), (box.out, box.backward, combine)


class _BoxPools(torch.nn.Module):
    """Sums over windows of unequal lengths, of values in one binade: an area upsampling
    (``F.interpolate(mode="area")``, windows of one or two elements along each dim), a pyramid pooling's
    bins of 2, 3 and 6, a feature pyramid's top-down path (a nearest upsampling by 2, whose backward
    sums four gradients), and an overlap-add (``F.fold`` of 3 x 3 patches, ``F.unfold``'s backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = (
            torch.nn.Linear(16, 4 * 6 * 6),
            torch.nn.Linear(4 * (81 + 4 + 9 + 36 + 144 + 36), 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        h = (torch.sigmoid(self.inp(x)) + 1.0).view(-1, 4, 6, 6)  # in [1, 2)
        area = torch.nn.functional.interpolate(h, size=(9, 9), mode="area")  # (N, 4, 9, 9)
        bins = [torch.nn.functional.adaptive_avg_pool2d(h * torch.tanh(h), b).flatten(1) for b in (2, 3, 6)]
        top = torch.nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")  # (N, 4, 12, 12)
        patches = torch.nn.functional.unfold(h, 3, padding=1)  # (N, 36, 36)
        added = torch.nn.functional.fold(patches, (6, 6), 3, padding=1)  # (N, 4, 6, 6): up to 9 copies
        return self.out(torch.cat([area.flatten(1), *bins, torch.tanh(top).flatten(1), added.flatten(1)], 1))


def test_box_pools_log_only_their_inexact_elements_from_revision_17(tmp_path, monkeypatch) -> None:
    """Rules revision 17 logs the elements of an adaptive pool and of a nearest upsampling's backward only
    where some order or way of dividing could round them otherwise. The weights are the same under 16 and
    17, and each replays on its own rules on every emulated profile (which sum the windows in their own
    orders and divide by their sizes) with nothing unlogged or refused."""
    from detrl.testing import zoo

    specimen = zoo.Specimen("box_pools", _BoxPools, zoo.features, zoo.classify)
    before, after = _before_and_after(specimen, tmp_path, monkeypatch, 17)
    assert after.totals.logged < before.totals.logged / 3, (after.totals.logged, before.totals.logged)


def test_an_interpolations_exact_elements_and_units_hold_on_every_profile() -> None:
    """Rules revision 18: a linear interpolation's element (or its backward's) is exact where every dim's
    weights are exact on every machine (a dyadic scale) and the sum rule holds with their bits; nothing is
    claimed where a weight is rounded. Exact elements have the same bits under every profile (which
    interpolate one dim at a time), and elsewhere the profiles' disagreement is far inside each element's
    unit (the values its weights reach). Before 18, no unit and no rule."""
    from test_hardware import interpolation_calls

    from detrl.core.scale import exact_elements

    exact_seen, differ = 0, 0
    for func, args in interpolation_calls(seed=7):
        ref = func(*args)
        exact, unit = exact_elements(func, args, ref), reduction_scale(func, args, ref)
        assert exact is not None and unit is not None, func
        assert reduction_scale(func, args, ref, rules_revision=17) is None
        exact_seen += int(exact.sum())
        corners, scales = args[2] if func in _FORWARD_INTERPOLATIONS else args[3], args[-1]
        if corners and func is not torch.ops.aten.upsample_linear1d.default and scales is None:
            assert not bool(exact.any()), func  # 5 -> 7 with corners aligned: weights of 2/3, rounded
        for name in ("emulated:splitk", "emulated:pairwise", "emulated:reversed", "emulated:atomic"):
            got = get_profile(name, seed=0)(func, args, {})
            same = got.reshape(-1).view(torch.int64) == ref.reshape(-1).view(torch.int64)
            assert bool(same[exact].all()), (name, func)
            differ += int((~same).sum())
            apart = (got - ref).abs().reshape(-1) / unit.dense().reshape(-1)
            assert float(apart.max()) < 2.0**-20, (name, func, float(apart.max()))
    assert exact_seen > 0 and differ > 0


_FORWARD_INTERPOLATIONS = {
    torch.ops.aten.upsample_linear1d.default,
    torch.ops.aten.upsample_bilinear2d.default,
    torch.ops.aten.upsample_trilinear3d.default,
}


def test_an_upsampling_by_two_is_exact_where_the_sum_rule_holds_with_its_weights_bits() -> None:
    """Upsampling by 2 (corners not aligned) weighs each pair of values by 3/4 and 1/4, in each dim: terms
    that are FP32 values times multiples of 2**-4 in 2d. An element is exact where its values span at most
    29 - 4 - 1 - ceil(log2(4)) binades; a value 2**-30 below its neighbours makes the elements around it
    inexact, and only those. Scales such as 1.7 give rounded weights: nothing is claimed."""
    from detrl.core.scale import exact_elements

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1, 1, 6, 6, generator=g, dtype=torch.float64) + 1.0).float().double()
    x[0, 0, 3, 3] *= 2.0**-30
    args = (x, [12, 12], False, 2.0, 2.0)
    ref = aten.upsample_bilinear2d.default(*args)
    exact = exact_elements(aten.upsample_bilinear2d.default, args, ref)
    assert exact is not None
    near = torch.zeros(12, 12, dtype=torch.bool)
    near[3:11, 3:11] = True  # the outputs whose boxes (weighted positions and one more each side) hold it
    assert torch.equal(~exact.view(12, 12), near)
    rounded = (x, [10, 10], False, 1.7, 1.7)
    none = exact_elements(
        aten.upsample_bilinear2d.default, rounded, aten.upsample_bilinear2d.default(*rounded)
    )
    assert none is not None and not bool(none.any())


class _Interpolations(torch.nn.Module):
    """A segmentation head's upsamplings of values in one binade: bilinear by 2 and to a size 8 times the
    input's (weights of a few bits: exact sums, a fifth of them on FP32 midpoints), trilinear by 2, and
    bilinear by 1.7 (rounded weights: measured in their values' units)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(16, 2 * 4 * 4), torch.nn.Linear(2 * (64 + 1024 + 128 + 36), 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        h = (torch.sigmoid(self.inp(x)) + 1.0).view(-1, 2, 4, 4)  # in [1, 2)
        up = torch.nn.functional.interpolate(h, scale_factor=2.0, mode="bilinear")  # (N, 2, 8, 8)
        big = torch.nn.functional.interpolate(h, size=(32, 32), mode="bilinear")  # (N, 2, 32, 32)
        cube = torch.nn.functional.interpolate(h.view(-1, 2, 2, 2, 4), scale_factor=2.0, mode="trilinear")
        odd = torch.nn.functional.interpolate(h, scale_factor=1.7, mode="bilinear")  # (N, 2, 6, 6)
        flat = [t.flatten(1) for t in (up, torch.tanh(big), cube, odd)]
        return self.out(torch.cat(flat, 1))


def test_interpolations_log_only_their_inexact_elements_from_revision_18(tmp_path, monkeypatch) -> None:
    """Rules revision 18 logs a linear interpolation's elements only where some machine could round them
    otherwise, measured in their values' units. The weights are the same under 17 and 18, and each replays
    on its own rules on every emulated profile (which interpolate one dim at a time) with nothing unlogged
    or refused."""
    from detrl.testing import zoo

    specimen = zoo.Specimen("interpolations", _Interpolations, zoo.features, zoo.classify)
    before, after = _before_and_after(specimen, tmp_path, monkeypatch, 18)
    assert after.totals.logged < before.totals.logged / 3, (after.totals.logged, before.totals.logged)


def test_scatters_that_add_log_only_their_inexact_elements_from_revision_9(tmp_path, monkeypatch):
    """Rules revision 9: an element of ``index_put(accumulate=True)``, ``scatter_add`` or ``index_add`` that
    every order sums exactly (here each token's two gradients) needs no entry, as a sum's. The recording's weights are
    the same under revisions 8 and 9; 9 logs less, none of it at those ops; each replays on its own rules on
    every emulated profile with nothing unlogged or refused, through the native route and the Python mode."""
    from detrl.core import engine, native
    from detrl.formats import bundle as bundle_mod
    from detrl.testing import zoo

    specimen = zoo.Specimen(
        "routed", _Routed, lambda: zoo.features(zoo.Size(width=16, batch=3)), zoo.classify
    )
    logged: dict[int, set[str]] = {}
    real_end = engine.Session._end_step

    def end_step(self, step, rounding, t0, frozen):  # noqa: ANN001, ANN202
        if rounding is not None:
            logged.setdefault(self.rules_revision, set()).update(
                rounding.op_names[e.op] for e in rounding.recorded
            )
        return real_end(self, step, rounding, t0, frozen)

    monkeypatch.setattr(engine.Session, "_end_step", end_step)
    with monkeypatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 8)
        before = zoo.record(specimen, tmp_path / "rules8", steps=3)
    after = zoo.record(specimen, tmp_path / "rules9", steps=3)
    assert after.rules_revision == RULES_REVISION >= 9 and before.rules_revision == 8
    assert after.leaves == before.leaves
    assert {"_index_put_impl_", "scatter_add", "index_add_"} <= logged[8]
    assert not logged[RULES_REVISION]  # the scatters were all that logged here
    assert after.totals.logged < before.totals.logged
    for run in ("rules8", "rules9"):
        for hardware in ("emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"):
            replayed = zoo.replay(specimen, tmp_path / run, hardware, steps=3)
            assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, (run, hardware)
    with native.switched(False):  # the Python mode sees index_put itself, and logs what the route logs
        zoo.record(specimen, tmp_path / "python", steps=3)
    for name in (bundle_mod.ROUNDLOG, bundle_mod.COMMITMENTS):
        assert (tmp_path / "rules9" / name).read_bytes() == (tmp_path / "python" / name).read_bytes(), name


def test_scatter_elements_exact_in_every_order_are_found():
    """The sum rule on a scatter's terms: ``self[i]`` and every value sent to ``i``, found by the op's own
    indexing. A destination whose terms span more than 29 - ceil(log2(n)) binades is not exact; one no value
    reaches is; a replacing ``index_put``, an ``index_add`` whose alpha scales, or values off the FP32 grid
    claim nothing."""
    from detrl.core.scale import exact_scatter_elements

    aten = torch.ops.aten
    base = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0**-40, 0.0]], dtype=torch.float64)
    rows = torch.tensor([0, 0, 2])
    values = torch.tensor([[1.5, 3.0], [2.0**-30, 1.0], [1.0, 0.0]], dtype=torch.float64)
    mask = exact_scatter_elements(aten.index_put.default, (base, [rows], values, True), base)
    # (0, 0): 1 + 1.5 + 2**-30 spans 30 binades over 3 terms; (2, 0): 2**-40 + 1: 40 binades
    assert mask.tolist() == [False, True, True, True, False, True]
    masked = exact_scatter_elements(
        aten._index_put_impl_.default, (base, [None, torch.tensor([1])], values[:, :1], True), base
    )
    assert masked.all()  # one value into each element of column 1: exact
    index = torch.tensor([[0, 1], [0, 1]])
    scattered = exact_scatter_elements(aten.scatter_add.default, (base, 0, index, values), base)
    assert scattered.tolist() == [False, True, True, True, True, True]  # (0, 0): 1 + 1.5 + 2**-30 again
    added = exact_scatter_elements(aten.index_add_.default, (base, 0, rows, values, 1), base)
    assert added.tolist() == mask.tolist()  # index_add(0, rows, values) is that index_put
    assert exact_scatter_elements(aten.index_add.default, (base, 0, rows, values, 2), base) is None  # alpha
    assert exact_scatter_elements(aten.index_put.default, (base, [rows], values, False), base) is None
    assert exact_scatter_elements(aten.index_put.default, (base, [rows], values + 0.1, True), base) is None


def test_a_scatter_into_zeros_gets_the_same_mask_from_the_c_kernel(monkeypatch):
    """A scatter into zeros is an embedding gradient of one-element rows: where the C kernel is built it
    takes that pass, and its mask is the torch path's, on values whose spans straddle the rule's bound."""
    from detrl.core import scale

    if not hasattr(scale._native, "exact_embedding_sums"):
        pytest.skip("the C kernel is not built")
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(7)
    base = torch.zeros(300, dtype=torch.float64)
    index = torch.randint(0, 300, (2000,), generator=g)
    exponents = torch.randint(-30, 1, (2000,), generator=g).double()
    values = (torch.randn(2000, generator=g).float().double() * torch.exp2(exponents)).float().double()
    values[::17] = 0.0
    for func, args in [
        (aten.index_add_.default, (base, 0, index, values, 1)),
        (aten.index_put.default, (base, [index], values, True)),
        (aten.scatter_add.default, (base, 0, index, values)),
    ]:
        native = scale.exact_scatter_elements(func, args, base)
        with monkeypatch.context() as m:
            m.setattr(scale, "KERNEL_SUMS", False)
            torch_path = scale.exact_scatter_elements(func, args, base)
        assert native is not None and torch.equal(native, torch_path), func
        assert 0 < int(native.sum()) < 300  # both kinds of element occur
