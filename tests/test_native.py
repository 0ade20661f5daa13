"""The native dispatch route (detrl/core/native.py) against the Python rounding mode alone: the same bundle,
byte for byte, for every zoo model on every hardware profile; the routes it takes; and the modes it must
leave alone."""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from detrl.core import native
from detrl.core.engine import Session
from detrl.core.hardware import get_profile, profile_names
from detrl.core.native import Route
from detrl.core.oprules import RULES_REVISION
from detrl.core.rounding import plan_of
from detrl.core.sources import Sources
from detrl.formats import bundle as bundle_mod
from detrl.testing import zoo
from detrl.testing.opwalk import OpNames

needs_native = pytest.mark.skipif(not native.available(), reason="the native route is not built here")
aten = torch.ops.aten
TINY_DQN = Path(__file__).resolve().parents[1] / "configs" / "dqn" / "tiny.yaml"
EMULATED = [p for p in profile_names() if p.startswith("emulated:")]


def test_the_route_is_built_where_a_cpp_compiler_exists() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the Python mode does every op")
    assert native.available()


def test_the_environment_can_switch_the_route_off() -> None:
    probe = "from detrl.core import native; print(native.available())"
    env = {**os.environ, "DETRL_NATIVE_DISPATCH": "0"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_routes_follow_the_modes_plan_and_the_profile() -> None:
    plain, pairwise = get_profile("native"), get_profile("emulated:pairwise", seed=0)

    def route(func, profile=plain, rules_revision=RULES_REVISION) -> Route:  # noqa: ANN001
        return native.route(func, plan_of(func, rules_revision), profile.reorders, rules_revision)

    assert route(aten.view.default) is Route.KEEP
    assert route(aten.mul.Tensor) is Route.EXACT
    assert route(aten.add.Tensor) is Route.SPLIT_ADD  # split when alpha != 1
    assert route(aten.addcdiv_.default) is Route.SPLIT_ADDCDIV
    assert route(aten._to_copy.default) is Route.CAST
    assert route(aten.sigmoid.default) is Route.LOGGED
    # the norms' root natively is the IEEE one (rules revision 10); a bundle of an older revision took torch's
    assert route(aten.native_batch_norm.default) is Route.DECOMPOSED_BATCH_NORM
    assert route(aten.native_layer_norm.default, rules_revision=9) is Route.PYTHON
    assert (
        route(aten.native_layer_norm_backward.default, rules_revision=9)
        is Route.DECOMPOSED_LAYER_NORM_BACKWARD
    )
    assert route(aten.sum.dim_IntList, rules_revision=1) is Route.LOGGED_REDUCTION  # at its channel scale
    assert route(aten.pow.Tensor_Scalar, rules_revision=1) is Route.LOGGED
    # from rules revision 2, pow is exact for exponent 2, and a sum's near elements go to the mode with its
    # terms, which finds those every order computes exactly
    assert route(aten.pow.Tensor_Scalar) is Route.EXACT_IF_SQUARE
    assert route(aten.pow_.Scalar) is Route.EXACT_IF_SQUARE
    assert route(aten.pow.Tensor_Tensor) is Route.LOGGED
    assert route(aten.sum.dim_IntList, rules_revision=4) is Route.LOGGED_SUM
    assert route(aten.embedding_dense_backward.default) is Route.LOGGED_SUM
    assert route(aten.sum.default, rules_revision=4) is Route.LOGGED_REDUCTION
    # from rules revision 5, sums and means in their terms' units (a sum over dims as LOGGED_SUM besides)
    assert route(aten.sum.dim_IntList) is Route.LOGGED_TERMS
    assert route(aten.sum.default) is Route.LOGGED_TERMS
    assert route(aten.mean.dim) is Route.LOGGED_TERMS
    assert route(aten.mean.dim, rules_revision=4) is Route.LOGGED_REDUCTION
    # another libm, another summation order: only the mode knows how
    assert route(aten.sigmoid.default, pairwise) is Route.PYTHON
    assert route(aten.sum.dim_IntList, pairwise) is Route.PYTHON
    # a profile without another libm computes sigmoid natively: the route takes it; not its sums
    splitk = get_profile("emulated:splitk")
    assert route(aten.sigmoid.default, splitk) is Route.LOGGED
    assert route(aten.pow.Tensor_Tensor, splitk) is Route.LOGGED
    assert route(aten.sum.dim_IntList, splitk) is Route.PYTHON
    # a unit from the inputs, a hidden write, random, decomposed
    assert route(aten.mm.default) is Route.LOGGED_MM  # its unit from its inputs
    # from rules revision 6, each gradient at the larger of its own scale and its terms' unit
    assert route(aten.convolution_backward.default) is Route.LOGGED_CONV_TERMS
    assert route(aten.convolution_backward.default, rules_revision=5) is Route.LOGGED_CONV  # its own scale
    assert route(aten.convolution_backward.default, pairwise) is Route.PYTHON
    # rules revision 14: a cumulative sum in each element's terms' units, its exact elements found (the mode)
    assert route(aten.cumsum.default, rules_revision=13) is Route.LOGGED_REDUCTION
    assert route(aten.cumsum.default) is Route.PYTHON
    assert route(aten.cumsum.default, splitk, rules_revision=13) is Route.PYTHON  # a scan in chunks
    # rules revision 15: so are the average pools and their backwards (they sum windows in chunks there)
    for func in (aten.avg_pool2d.default, aten.avg_pool3d_backward.default):
        assert route(func, rules_revision=14) is Route.LOGGED_REDUCTION
        assert route(func) is Route.PYTHON and route(func, splitk, rules_revision=14) is Route.PYTHON
    # rules revision 11: GELU and the backwards of GELU and SiLU in their first argument's units (elementwise
    # before); PReLU exact, an in-place activation as its out-of-place form
    for func in (aten.gelu.default, aten.gelu_backward.default, aten.silu_backward.default):
        assert route(func, splitk) is Route.LOGGED_BY_FIRST and route(func, splitk, 10) is Route.LOGGED
    assert route(aten._prelu_kernel_backward.default) is Route.EXACT
    assert route(aten.silu_.default, splitk) is route(aten.silu.default, splitk) is Route.LOGGED
    for func in (
        aten._native_batch_norm_legit.default,
        aten.native_dropout.default,
    ):
        assert route(func) is Route.PYTHON
    # decompositions: written out natively where the profile reorders neither the op nor its steps
    assert route(aten.native_layer_norm.default) is Route.DECOMPOSED_LAYER_NORM
    assert route(aten.native_batch_norm_backward.default) is Route.DECOMPOSED_BATCH_NORM_BACKWARD
    assert route(aten._softmax_backward_data.default) is Route.DECOMPOSED_SOFTMAX_BACKWARD
    assert route(aten.native_layer_norm.default, pairwise) is Route.PYTHON
    assert route(aten._softmax.default) is Route.LOGGED  # a formula for the profiles, one op for the mode


def _record(specimen: zoo.Specimen, run_dir, hardware: str, on: bool) -> Session:  # noqa: ANN001
    profile = get_profile(hardware, seed=3) if hardware == "emulated:atomic" else hardware
    session = Session(run_dir, mode="record", sources=Sources(), hardware=profile, planned_steps=2)
    with native.switched(on):
        return zoo.train(session, specimen, 2)


def _assert_same_bundles(specimen: zoo.Specimen, tmp_path, hardware: str) -> collections.Counter:  # noqa: ANN001
    """Records ``specimen`` with the route and without; returns the route's counts of the first."""
    native.counts.clear()
    a = _record(specimen, tmp_path / "native", hardware, on=True)
    assert native.counts["native"] > 0, "the native route handled no op"
    routed = native.counts.copy()
    native.counts.clear()
    b = _record(specimen, tmp_path / "python", hardware, on=False)
    assert native.counts["native"] == 0
    assert a.totals == b.totals
    for name in (bundle_mod.ROUNDLOG, bundle_mod.COMMITMENTS):
        assert (tmp_path / "native" / name).read_bytes() == (tmp_path / "python" / name).read_bytes(), name
    return routed


@needs_native
@pytest.mark.parametrize("hardware", ["native", *EMULATED])
@pytest.mark.parametrize("name", sorted(zoo.SPECIMENS))
def test_every_zoo_model_is_the_same_bundle_on_every_profile(tmp_path, name: str, hardware: str) -> None:  # noqa: ANN001
    """Gates on strided views (the LSTM), float32 and bfloat16 islands, fused Adam updates, attention,
    softmax, GELU, layer and RMS norms: every zoo model, recorded both ways, on every hardware profile."""
    specimen = zoo.SPECIMENS[name]
    if not zoo.available(specimen):
        pytest.skip(f"this transformers has no {specimen.needs}")
    _assert_same_bundles(specimen, tmp_path, hardware)


def _gone_nan() -> torch.nn.Module:
    """A run gone NaN: one NaN bias makes every later value NaN (a softmax, a norm and GELU take it too)."""
    first = torch.nn.Linear(16, 32)  # zoo.features: width // 2 = 16
    with torch.no_grad():
        first.bias[3] = math.nan
    return torch.nn.Sequential(
        first, torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Softmax(-1), torch.nn.Linear(32, 5)
    )


@needs_native
@pytest.mark.parametrize("hardware", ["native", "emulated:splitk"])
def test_a_run_gone_nan_is_the_same_bundle_and_logs_no_nan(tmp_path, hardware: str) -> None:  # noqa: ANN001
    """Rules revision 16: no NaN is near a midpoint, on the route (the C kernel's flags) as in the mode."""
    specimen = zoo.Specimen("gone_nan", _gone_nan, zoo.features, zoo.classify)
    routed = _record(specimen, tmp_path / "native", hardware, on=True)
    plain = _record(specimen, tmp_path / "python", hardware, on=False)
    assert routed.totals == plain.totals and routed.totals.logged == 0
    assert any(p.isnan().any() for p in routed.model.parameters())
    for name in (bundle_mod.ROUNDLOG, bundle_mod.COMMITMENTS):
        assert (tmp_path / "native" / name).read_bytes() == (tmp_path / "python" / name).read_bytes(), name


@needs_native
@pytest.mark.parametrize("name", ["autocast_bf16", "hf_vit"])
def test_without_the_c_kernel_the_route_leaves_entries_to_the_mode(tmp_path, name: str) -> None:  # noqa: ANN001
    """The route takes log entries through the C kernel's API; with the kernel switched off (the torch
    reference rounds), an output with a near element goes to the mode, and the bundle is the same."""
    from detrl.core import kernel

    if not zoo.available(zoo.SPECIMENS[name]):
        pytest.skip(f"this transformers has no {zoo.SPECIMENS[name].needs}")
    with kernel.disabled():
        assert _assert_same_bundles(zoo.SPECIMENS[name], tmp_path, "native")["entries"] == 0
    assert _assert_same_bundles(zoo.SPECIMENS[name], tmp_path / "kernel", "native")["entries"] > 0


def _float32_ops(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """A loss through float32 islands: numbers float32 holds (the route computes those ops in float32) and
    numbers it does not (0.1, 1/3: the mode's FP64 twins), in place and out of place, mixed with FP64."""
    h = model(batch[0]).float()
    h = (h * 3 + 0.5) / 7 - 0.1
    h = torch.where(h > 0, h.clamp(max=0.25).sqrt(), h.square() * (1 / 3))
    h.add_(1).mul_(2.0)
    return (h.double() * batch[0][:, :1]).sum()


class _DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 4)
        h = torch.nn.functional.dropout(torch.relu(self.fc1(x)), 0.3, self.training)
        return self.fc2(torch.nn.functional.dropout(h, 0.1, self.training) + torch.rand_like(h) * 1e-3)


@needs_native
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_a_plain_runs_random_ops_take_the_stream_and_the_rest_runs_natively(tmp_path, precision: str) -> None:  # noqa: ANN001
    """A step that is not verifiable draws its dropout masks (and any random op) from the ``dropout`` stream
    in a Python mode; with the route on, only those ops enter it and every other op runs as it is: the same
    weights, bit for bit, as the mode alone, and a complex result is no reason to refuse anything."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))

    def train(on: bool) -> tuple[list[torch.Tensor], collections.Counter]:
        native.counts.clear()
        with native.switched(on), Session(tmp_path / f"{precision}{on}", mode="off", precision=precision,
                                          sources=Sources(seed=3)) as s:  # fmt: skip
            model = s.init(_DropoutNet)
            opt = s.track(torch.optim.AdamW(model.parameters(), lr=1e-2))
            for _ in range(3):
                with s.step():
                    batch = x.to(s.precision.dtype)
                    loss = model(batch).square().mean() + torch.fft.rfft(batch).abs().mean() * 0
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        return [p.detach().clone() for p in model.parameters()], collections.Counter(native.counts)

    routed, counts = train(True)
    alone, _ = train(False)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(routed, alone, strict=True)
    )
    assert counts["python"] == 3 * 3  # two dropouts and a rand_like a step
    assert counts["native"] > 10 * counts["python"]


@needs_native
def test_float32_islands_of_exact_ops_run_natively_with_the_same_bits(tmp_path) -> None:  # noqa: ANN001
    """An exact op on float32 operands and numbers float32 holds gives its FP64 twin's rounded result in
    float32 itself (one IEEE rounding, or none); the route runs those natively, and the bundle is the same."""

    def batch() -> tuple[torch.Tensor, ...]:  # the same every step and every recording
        return (torch.randn(16, 4, generator=torch.Generator().manual_seed(5)),)

    specimen = zoo.Specimen("float32_ops", lambda: torch.nn.Linear(4, 3), batch, _float32_ops)
    for hardware in ("native", "emulated:pairwise"):
        _assert_same_bundles(specimen, tmp_path / hardware, hardware)


@needs_native
def test_a_dqn_calibrating_for_a_hundred_steps_is_the_same_bundle(tmp_path) -> None:  # noqa: ANN001
    """A DQN calibrates until its first update: a hundred steps of the same acting calls, which the
    calibrator declines to measure after two of each class and the native route then rounds itself, with
    their log entries."""
    from detrl.cli import main

    def record(where: str, on: bool) -> None:
        argv = [
            "train",
            "configs/dqn/tiny.yaml",
            "--out",
            str(tmp_path / where),
            "--quiet",
            "--no-tensorboard",
        ]
        argv += ["--set", "train.steps=300", "--set", "agent.learning_starts=100", "--set", "eval.episodes=0"]
        with contextlib.nullcontext() if on else native.disabled():
            assert main(argv) == 0

    native.counts.clear()
    record("native", on=True)
    assert native.counts["native"] > 0
    assert native.counts["entries"] > 0  # its log is dense: entries taken natively, as the mode takes them
    record("python", on=False)
    for name in (bundle_mod.ROUNDLOG, bundle_mod.COMMITMENTS):
        assert (tmp_path / "native" / name).read_bytes() == (tmp_path / "python" / name).read_bytes(), name


@needs_native
def test_a_mode_entered_inside_a_step_still_sees_every_op(tmp_path) -> None:  # noqa: ANN001
    """A user's dispatch mode inside a verifiable step (a FLOP counter, a tracer) sees the ops it saw
    without the native route: the route stands aside while another mode is on the stack."""
    seen = {}
    for on in (True, False):
        session = Session(tmp_path / str(on), mode="record", sources=Sources(), planned_steps=1)
        with native.switched(on), session:
            model = session.init(lambda: torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()))
            x = torch.ones(2, 4, dtype=torch.float64)
            with session.step(batch=(x,)), OpNames() as count:
                model(x).sum().backward()
        seen[on] = count.ops

    # Except the detach calls autograd makes inside TensorImpl when it saves a tensor: not a dispatched op
    # but a call into the top mode, which torch makes only while the Python key is not excluded.
    def dispatched(ops: list[str]) -> list[str]:
        return [op for op in ops if op != "aten.detach.default"]

    assert dispatched(seen[True]) == dispatched(seen[False])
    assert "aten.tanh.default" in seen[True] and "aten.tanh_backward.default" in seen[True]


def _recorded(
    on: bool, tau: float, body: Callable[[], object], rules_revision: int = RULES_REVISION
) -> tuple:
    """``body()`` in one recording step of a fresh rounding mode on the native profile at threshold ``tau``,
    under rules revision ``rules_revision``, the route ``on`` or off. Returns the step's stats, op names and
    entries (op, indices, directions, short indices), and the route's counts."""
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    step = StepRounding()
    mode = RoundingMode(get_profile("native"), Thresholds(default=tau))
    mode.rules_revision = rules_revision
    native.counts.clear()
    with native.switched(on), mode.step_scope(step):
        body()
    entries = [(e.op, e.indices.tolist(), e.up.tolist(), e.short_indices.tolist()) for e in step.recorded]
    return (step.stats, step.op_names, entries), native.counts.copy()


@needs_native
@pytest.mark.parametrize("tau", [2.0**-26, 2.0**-8])
def test_activations_in_their_first_arguments_units_take_the_modes_entries(tau: float) -> None:
    """GELU (both forms), its backward and SiLU's, measured in units of their first argument from rules
    revision 11 (``LOGGED_BY_FIRST``): at the least threshold a few elements are near a midpoint, at a large
    one most are, and the route takes their entries itself. Its step is the mode's: op names, entries,
    stats and gradients."""
    g = torch.Generator().manual_seed(5)
    x0 = (torch.randn(64, 96, generator=g, dtype=torch.float64) * 3).float().double()

    def run(on: bool) -> tuple:
        x = x0.clone().requires_grad_()

        def body() -> None:
            f = torch.nn.functional
            y = f.gelu(x) * f.silu(x) + f.gelu(x, approximate="tanh")
            y.sum().backward()

        recorded, counts = _recorded(on, tau, body)
        return recorded, counts, x.grad

    (on, counts, grad_on), (off, _, grad_off) = run(True), run(False)
    assert on == off and torch.equal(grad_on, grad_off)
    names = {name.split(".")[-2] if "." in name else name for name in on[1]}
    assert {"gelu", "gelu_backward", "silu_backward"} <= names, names
    assert on[0].logged > (1000 if tau > 2.0**-20 else 0), on[0].logged
    assert counts["native"] > 0


@needs_native
def test_ops_that_only_move_values_take_no_op_position_from_rules_revision_8() -> None:
    """An LSTM's forward and backward (gate split: ``unsafe_split``) and a few other ops of
    ``oprules.KEEP_FROM_8`` (the backward of a slice, a triangle, nearest upsampling, reflective padding), in
    one recorded step: under revision 7 they take op positions, under 8 none; the same results and the same
    gradients under both, and the route's step equals the mode's (op names, entries, stats) under each."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 16, batch_first=True).double()
    x0 = torch.randn(3, 5, 8, dtype=torch.float64).float().double()
    moved = {"unsafe_split", "slice_backward", "tril", "upsample_nearest2d", "reflection_pad2d"}

    def run(on: bool, revision: int) -> tuple:
        results: list[torch.Tensor] = []

        def body() -> None:
            lstm.zero_grad()
            x = x0.clone().requires_grad_()
            out, _ = lstm(x)
            image = torch.nn.functional.interpolate(out[:, 1:, None, :].tril(), scale_factor=2.0)
            padded = torch.nn.functional.pad(image, (1, 1, 1, 1), mode="reflect")
            padded.square().sum().backward()
            results.extend([padded.detach(), x.grad, *(p.grad for p in lstm.parameters())])

        recorded, _ = _recorded(on, 2.0**-30, body, rules_revision=revision)
        return recorded, results

    steps = {(on, revision): run(on, revision) for on in (True, False) for revision in (7, 8)}
    for revision in (7, 8):
        assert steps[(True, revision)][0] == steps[(False, revision)][0]
    (before, old), (after, new) = steps[(True, 7)], steps[(True, 8)]
    assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    names = [{name.split(".")[-2] if "." in name else name for name in n} for n in (before[1], after[1])]
    assert moved <= names[0] and not moved & names[1], names
    assert len(after[1]) < len(before[1])


@needs_native
@pytest.mark.parametrize("tau", [2.0**-30, 2.0**-4])
def test_strided_views_are_rounded_in_place_with_the_modes_bits(tau: float) -> None:
    """In-place ops on strided views: an LSTM's gates (column blocks of one matrix: runs of 128 elements),
    a permuted cube (runs of 32) and a transposed matrix (runs of one element, which go through a dense
    copy). Elementwise ops with no element near a midpoint and exact ops are tested and rounded in place on
    the route; at the large threshold most views have near elements and take the dense copy. Either way the
    route's step is the mode's: op names, entries, stats and bits."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(16, 512, generator=g, dtype=torch.float64)
    cube = torch.randn(4, 8, 32, generator=g, dtype=torch.float64)

    def run(on: bool) -> tuple:
        results: list[torch.Tensor] = []

        def body() -> None:
            x, c = base.clone(), cube.clone()
            gates = x.unsafe_split(128, 1)
            gates[0].sigmoid_()
            gates[1].tanh_()
            gates[2].mul_(0.1)
            gates[3].add_(1.0 / 3.0)
            c.permute(1, 0, 2).exp_()
            x.t()[:64].sigmoid_()
            results.extend([x, c])

        recorded, counts = _recorded(on, tau, body)
        return recorded, results, counts

    (on, on_bits, counts), (off, off_bits, _) = run(True), run(False)
    assert on == off
    assert all(torch.equal(a, b) for a, b in zip(on_bits, off_bits, strict=True))
    assert counts["python"] == 0, dict(counts)
    assert (len(on[2]) > 0) == (tau > 2.0**-10), on[2]  # entries where the threshold is large


@pytest.mark.parametrize("on", [True, False])
def test_a_copied_small_value_is_no_log_entry_from_rules_revision_8(on: bool) -> None:
    """Under revision 7 an op that only moves values (unlisted) was a reduction, measured at its channel's
    largest value: a copied value far below it lay "near" a midpoint and was logged, as a pinned value,
    though every machine copies it alike (slicing's backward, ReLU6's, a mixture of experts' routing). From
    revision 8 such an op takes no position and logs nothing, on the route and in the mode."""
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
        -40, 1, (4, 8), generator=g
    )
    x = x.float().double()  # FP32-grid values over 40 binades
    logged = {}
    for revision in (7, 8):
        step = StepRounding()
        mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-20))
        mode.rules_revision = revision
        with native.switched(on), mode.step_scope(step):
            out = torch.ops.aten.slice_backward.default(x, [4, 10], 1, 1, 9, 1)
        assert torch.equal(out[:, 1:9], x) and not out[:, [0, 9]].any()
        logged[revision] = (step.op_names, step.stats.logged)
    assert logged[7][0] == ["slice_backward"] and logged[7][1] > 0
    assert logged[8] == ([], 0)


def _layer_norm_step(route: str, tau: float, values: torch.Tensor, monkeypatch) -> tuple:  # noqa: ANN001
    """A layer norm's forward and backward in one recorded step; ``route``: "off" (the mode alone), "on"
    (the route, which writes layer norm out itself), "mode" (the route, but the mode writes layer norm out
    and hands its sums back) or "flat" (that, and the sums stay in the mode). Returns the step's stats, op
    names, entries and the gradients, and the route's counts."""
    x = values.clone().requires_grad_()
    weight = torch.ones(values.shape[-1], dtype=torch.float64, requires_grad=True)

    def body() -> None:
        y = torch.nn.functional.layer_norm(x, values.shape[-1:], weight)
        y.backward(torch.ones_like(y))

    with monkeypatch.context() as m:
        if route in ("mode", "flat"):
            m.setattr(native, "_DECOMPOSED", {})
        if route == "flat":
            m.setattr(native, "nest", lambda: False)
        got, counts = _recorded(route != "off", tau, body)
    return (*got, x.grad, weight.grad), counts


@needs_native
@pytest.mark.parametrize("tau", [2.0**-20, 2.0**-3])
def test_a_decompositions_sums_take_the_route_and_count_as_its_parts(tau: float, monkeypatch) -> None:  # noqa: ANN001
    """Layer norm is written out as row sums and IEEE arithmetic, natively or by the mode; the row sums take
    the route either way (two forward, three backward; in the mode they come back to it), and the elements
    rounded are the layer norm's outputs alone, as the mode counts them: the same stats, entries and
    gradients with the route on and off. At the larger threshold the sums have near elements."""
    torch.manual_seed(0)
    values = torch.randn(8, 16, dtype=torch.float64).float().double()
    on, counts = _layer_norm_step("on", tau, values, monkeypatch)
    in_mode, mode_counts = _layer_norm_step("mode", tau, values, monkeypatch)
    flat, flat_counts = _layer_norm_step("flat", tau, values, monkeypatch)
    off, _ = _layer_norm_step("off", tau, values, monkeypatch)
    assert counts["python"] == 0  # written out natively
    assert mode_counts["python"] == flat_counts["python"] == 2  # native_layer_norm and its backward
    assert counts["native"] - mode_counts["native"] == 2  # the two ops themselves
    assert mode_counts["native"] - flat_counts["native"] == 5  # the five row sums inside the two
    if tau == 2.0**-3:
        assert on[2], "no entries: no row sum had an element near a midpoint"
    for got in (on, in_mode, flat):
        assert got[:3] == off[:3]
        assert torch.equal(got[3], off[3]) and torch.equal(got[4], off[4])


@needs_native
def test_a_written_out_layer_norm_gives_the_modes_layout_and_bits() -> None:
    """The route's layer norm computes dense rows in loops, and rows laid out otherwise (a transposed
    sequence of patches, as SegFormer normalises) with torch's ops, whose results take the rows' layout:
    later ops may depend on it. Either way the output, mean and rstd have the mode's strides and bits, with
    and without a weight and a bias."""
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    g = torch.Generator().manual_seed(6)
    base = torch.randn(4, 24, 10, generator=g, dtype=torch.float64).float().double()
    weight, bias = (torch.randn(24, generator=g, dtype=torch.float64).float().double() for _ in range(2))
    for x in (base.transpose(1, 2), base.transpose(1, 2).contiguous()):
        for w, b in ((weight, bias), (None, None), (weight, None)):
            results = {}
            for on in (True, False):
                mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-20))
                with native.switched(on), mode.step_scope(StepRounding()):
                    results[on] = torch.ops.aten.native_layer_norm.default(x, [24], w, b, 1e-5)
            for got, want in zip(results[True], results[False], strict=True):
                assert got.stride() == want.stride() and torch.equal(got, want)


@needs_native
def test_a_written_out_layer_norm_backward_gives_the_modes_layout_and_bits() -> None:
    """The route's layer norm backward computes its element passes over dense rows in two loops, and rows
    laid out otherwise with torch's ops. Either way each gradient has the mode's strides and bits, and the
    step logs the same entries: with and without a weight, under every output mask, on values of every kind
    (zeros, infinities, NaN, subnormals) and on FP32-grid values whose row sums have near elements."""
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    g = torch.Generator().manual_seed(8)
    special = _special_values((4, 24, 10), g)
    grid = torch.randn(4, 24, 10, generator=g, dtype=torch.float64).float().double()
    weight = torch.randn(24, generator=g, dtype=torch.float64).float().double()
    masks = ([True, True, True], [True, False, False], [False, True, True], [True, True, False])
    checked = near = 0
    for base, tau in ((special, 2.0**-20), (grid, 2.0**-3)):
        for x in (base.transpose(1, 2), base.transpose(1, 2).contiguous()):
            # the incoming gradient dense, or its rows spaced out in memory (a slice of a wider buffer: the
            # rows are a view that is not dense, which takes torch's ops)
            wide = (torch.randn(*x.shape[:-1], 30, generator=g, dtype=torch.float64) * 3).float().double()
            grad_out = wide[..., :24] if x.is_contiguous() else wide[..., :24].contiguous()
            _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [24], weight, None, 1e-5)
            for mask, w in itertools.product(masks, (weight, None)):
                if mask[1] and w is None:
                    continue  # a weight's gradient needs a weight
                results, logged = {}, {}
                for on in (True, False):
                    mode = RoundingMode(get_profile("native"), Thresholds(default=tau))
                    step = StepRounding()
                    with native.switched(on), mode.step_scope(step):
                        results[on] = torch.ops.aten.native_layer_norm_backward.default(
                            grad_out, x, [24], mean, rstd, w, w, mask
                        )
                    logged[on] = (step.stats.logged, step.op_names, list(step.recorded))
                assert logged[True] == logged[False]
                near += logged[True][0]
                for got, want in zip(results[True], results[False], strict=True):
                    assert (got is None) == (want is None)
                    if got is not None:
                        assert got.stride() == want.stride()
                        assert torch.equal(got.view(torch.int64), want.view(torch.int64))
                        checked += 1
    assert checked == 2 * 2 * 9  # nine gradients under the masks, for each set of values and layout
    assert near > 0  # the FP32-grid rows' sums had elements near a midpoint


@needs_native
def test_sums_with_near_elements_log_alike_on_the_route_and_in_the_mode() -> None:
    """Under rules revision 2 a sum's entries leave out the elements every order computes exactly; the route
    finds them with the C kernel (an embedding gradient's in the mode): random sums over random dims (FP32
    values of few binades, whose sums tie often; zeros; channels of very different scales; transposed and
    negated views) log the same entries on the route, which takes them all, and in the mode."""
    from detrl.core import kernel
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    g = torch.Generator().manual_seed(2)
    calls = []
    for trial in range(60):
        nd = int(torch.randint(1, 4, (1,), generator=g))
        shape = [int(torch.randint(1, 7, (1,), generator=g)) for _ in range(nd)]
        binades = torch.randint(-2, 3, shape, generator=g).double() * (1 + trial % 3)
        x = (torch.randint(-8, 9, shape, generator=g).double() * 2.0**binades).float().double()
        if nd >= 2:
            x[:, 0] *= 2.0**-30  # a channel far below the others
            if trial % 4 == 0:
                x = x.transpose(0, 1)
        if trial % 7 == 3:  # an infinity among the terms (rules revision 5: it sets no unit)
            x[(0,) * nd] = -torch.inf
        if trial % 5 == 0:
            x = torch._neg_view(x)
        dims = [
            int(d)
            for d in torch.randperm(nd, generator=g)[: int(torch.randint(1, nd + 1, (1,), generator=g))]
        ]
        calls.append((x, dims))
    # wider ones: a bias gradient's column sums and a transposed matrix's row sums (read in place, side by
    # side), row sums of every other column (terms strided), and kept dims that do not step through memory
    # as one (a copy)
    views = {"t": lambda x: x.t(), "odd": lambda x: x[:, ::2], None: lambda x: x}
    for shape, dims, view in (
        ((16, 37), [0], None),
        ((37, 16), [1], "t"),
        ((16, 18), [1], "odd"),
        ((3, 16, 9), [1], None),
    ):
        binades = torch.randint(-2, 3, shape, generator=g).double()
        x = views[view]((torch.randint(-8, 9, shape, generator=g).double() * 2.0**binades).float().double())
        calls += [(x, dims), (torch._neg_view(x), dims)]
    logs = {}
    for on in (True, False, "revision 1"):
        step = StepRounding()
        mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-4))
        if on == "revision 1":  # every near element logged: what the exact elements leave out
            mode.rules_revision = 1
        native.counts.clear()
        with native.switched(on is True), mode.step_scope(step):
            sums = [torch.sum(x, dims) for x, dims in calls]
        logs[on] = ([(e.op, e.indices.tolist(), e.up.tolist()) for e in step.recorded], step.stats, sums)
        if on is True and kernel.available():
            assert native.counts["python"] == 0 and native.counts["entries"] > 0, dict(native.counts)
    assert logs[True][0] == logs[False][0] and logs[True][1] == logs[False][1]
    assert logs[True][0], "no entries"
    assert logs[True][1].logged < logs["revision 1"][1].logged, "no near element was exact"
    assert all(torch.equal(a, b) for a, b in zip(logs[True][2], logs[False][2], strict=True))


def _split_ops(g: torch.Generator, nans: bool) -> list[torch.Tensor]:
    """Every split op (add and sub with alpha, addcmul, addcdiv, lerp) on random FP64 operands, in place and
    not, with number and tensor weights, operands that alias self, and (``nans``) infinities and NaNs."""

    def values(shape: tuple[int, ...]) -> torch.Tensor:
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
            -30, 30, shape, generator=g
        )
        x = x.float().double()
        if nans:
            r = torch.rand(shape, generator=g)
            x[r < 0.05] = math.inf
            x[r > 0.97] = -math.nan
            x[(r > 0.5) & (r < 0.55)] = 0.0
        return x

    out = []
    for _ in range(20):
        shape = (int(torch.randint(1, 70, (1,), generator=g)), 3)
        a, b, c, w = values(shape), values(shape), values(shape), values(shape).abs()
        out += [a.clone().lerp_(b, 0.3), torch.lerp(a, b, w), a.clone().lerp_(b, w)]
        out += [torch.lerp(a, b, torch.tensor(0.7, dtype=torch.float64))]
        out += [a.clone().addcmul_(b, c, value=0.25), torch.addcmul(a, b, c, value=3), torch.addcmul(a, b, c)]
        out += [a.clone().addcdiv_(b, c, value=-1e-3), torch.addcdiv(a, b, c)]
        out += [a.clone().add_(b, alpha=-0.01), torch.sub(a, b, alpha=2), a.clone().sub_(b, alpha=0.5)]
        x = a.clone()
        x.addcmul_(x, x, value=0.5)  # every operand self itself
        y = a.clone()
        y.lerp_(b.clone(), 0.5)
        out += [x, y, torch.lerp(a[:, :2], b[:, :2], 0.5)]  # a strided view: the dispatched calls
    return out


@needs_native
@pytest.mark.parametrize("nans", [False, True])
def test_split_ops_in_one_pass_give_the_modes_bits(nans: bool) -> None:
    """A split op whose operands are dense FP64 CPU tensors is computed and rounded in one pass on the route
    (a per-tensor Adam's lerp, addcmul and addcdiv): bit for bit what the mode's IEEE steps give, signed
    zeros, infinities and NaN signs included (an op with a NaN in its results takes the dispatched steps)."""
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    results = {}
    for on in (True, False):
        step = StepRounding()
        mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-20))
        native.counts.clear()
        with native.switched(on), mode.step_scope(step):
            results[on] = _split_ops(torch.Generator().manual_seed(3), nans)
        if on:
            assert native.counts["one_pass"] > (0 if nans else 200), dict(native.counts)
    for got, want in zip(results[True], results[False], strict=True):
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@needs_native
@pytest.mark.parametrize("tau", [2.0**-20, 2.0**-4])
def test_convolution_gradients_log_alike_on_the_route_and_in_the_mode(tau: float) -> None:
    """A convolution's gradients on the route: the input gradient at each sample's and channel's scale
    (samples whose gradients differ by orders of magnitude, one sample all zeros, one with an infinity),
    the weight and bias gradients at their channel scale; 1-d, 2-d and strided, grouped and transposed
    convolutions log the same entries and give the same bits with the route on and off."""
    from detrl.core import kernel
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    g = torch.Generator().manual_seed(4)
    cases = []  # (convolution, input, output gradient), drawn outside the step (random ops take the mode)
    for conv, x_shape in (
        (torch.nn.Conv2d(3, 6, 3, padding=1), (5, 3, 6, 6)),
        (torch.nn.Conv1d(4, 4, 2, stride=2, groups=2), (3, 4, 8)),
        (torch.nn.ConvTranspose2d(2, 3, 2, stride=2), (2, 2, 3, 3)),
    ):
        conv = conv.double()
        x = torch.randn(x_shape, generator=g, dtype=torch.float64).float().double()
        scales = 2.0 ** torch.randint(-12, 12, (x_shape[0],) + (1,) * (len(x_shape) - 1), generator=g)
        with torch.no_grad():
            go = torch.randn(conv(x).shape, generator=g, dtype=torch.float64).float().double()
        go[0] = 0.0  # a sample whose input gradient is all zeros
        go[-1, 0, 0] = math.inf if x_shape[0] > 2 else go[-1, 0, 0]  # one channel's infinity
        if go.shape[0] > 2:
            go[1] *= 2.0**-40  # a sample far below the others
        cases.append((conv, x * scales, go))

    def step() -> list[torch.Tensor]:
        grads = []
        for conv, x, go in cases:
            conv.zero_grad(set_to_none=True)
            x = x.clone().requires_grad_()
            conv(x).backward(go)
            grads += [x.grad, conv.weight.grad, conv.bias.grad]
        return grads

    results = {}
    for on in (True, False):
        rounding = StepRounding()
        mode = RoundingMode(get_profile("native"), Thresholds(default=tau))
        native.counts.clear()
        with native.switched(on), mode.step_scope(rounding):
            grads = step()
        if on and kernel.available():
            assert native.counts["python"] == 0, dict(native.counts)
        entries = [
            (e.op, e.indices.tolist(), e.up.tolist(), e.pinned_indices.tolist()) for e in rounding.recorded
        ]
        results[on] = (rounding.stats, rounding.op_names, entries, grads)
    assert results[True][:3] == results[False][:3]
    assert "convolution_backward" in results[True][1]
    if tau == 2.0**-4:
        assert results[True][2], "no entries"
    for a, b in zip(results[True][3], results[False][3], strict=True):
        assert torch.equal(a.view(torch.int64), b.view(torch.int64))


@needs_native
@pytest.mark.parametrize("exponent", [2, 2.0, 3, 0.5, True])
def test_pow_is_exact_for_exponent_two_alone_on_the_route(exponent: object) -> None:
    """``pow(x, 2)`` is exact under rules revision 2 and any other exponent logged: the route reads the
    exponent as the mode does, out of place and in place, and the two log and round alike."""
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    torch.manual_seed(1)
    x = (torch.rand(64, dtype=torch.float64) + 0.5).float().double()
    results = {}
    for on in (True, False):
        step = StepRounding()
        mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-3))  # large: entries at most ops
        with native.switched(on), mode.step_scope(step):
            out = torch.pow(x, exponent)
            inplace = x.clone()
            inplace.pow_(exponent)
        entries = [(e.op, e.indices.tolist(), e.up.tolist()) for e in step.recorded]
        results[on] = (step.stats, step.op_names, entries, out, inplace)
    assert results[True][:3] == results[False][:3]
    assert torch.equal(results[True][3], results[False][3]) and torch.equal(
        results[True][4], results[False][4]
    )
    logged = results[True][1]
    assert logged.count("pow") + logged.count("pow_") == (0 if exponent == 2 and exponent is not True else 2)


@pytest.mark.parametrize("on", [True, False])
def test_a_call_is_logged_at_its_class_threshold(on: bool) -> None:
    """Two classes of ``mm`` (``a @ b`` and ``a @ c``, of other sizes): where the thresholds give the second
    class its own, smaller threshold, its calls log as under an op threshold that small, and the first
    class's as under the op's; the native route, which learns a call's threshold from the mode once per
    call key, logs the same entries as the mode (``on``: the route, else the mode). The class names no
    layout (rules revision 6): ``c`` read through a transpose is the same class."""
    from detrl.core.oprules import call_class
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    torch.manual_seed(0)
    a = torch.randn(64, 96, dtype=torch.float64).float().double()
    b = torch.randn(96, 80, dtype=torch.float64).float().double()
    c = torch.randn(40, 96, dtype=torch.float64).float().double().t()  # (96, 40), column-major
    narrow = call_class("mm", (a, c), {})
    assert narrow != call_class("mm", (a, b), {}) and narrow == call_class("mm", (a, c.contiguous()), {})
    big, small = 2.0**-6, 2.0**-12

    def logged(thresholds: Thresholds) -> list[int]:
        step = StepRounding()
        mode = RoundingMode(get_profile("native"), thresholds)
        with native.switched(on), mode.step_scope(step):
            for _ in range(2):  # the second call of each key: learned, where the route is on
                torch.mm(a, b)
                torch.mm(a, c)
        assert len(step.op_names) == 4
        per_op = [0] * 4
        for e in step.recorded:
            per_op[e.op] += len(e.indices) + len(e.pinned_indices) + len(e.short_indices)
        return per_op

    classed = logged(Thresholds(per_op={"mm": big}, per_class={narrow: small}))
    all_big = logged(Thresholds(per_op={"mm": big}))
    all_small = logged(Thresholds(per_op={"mm": small}))
    assert all_big[1] > 4 * all_small[1] > 0  # the thresholds matter here
    assert classed == [all_big[0], all_small[1], all_big[2], all_small[3]]


def _batch_norm_step(on: bool, tau: float, values: torch.Tensor) -> tuple:
    """Batch norm 2-d (affine, running statistics) and 1-d (neither), then cross-entropy and a softmax,
    forward and backward in one recorded step, the route ``on`` or off. Returns the step's stats, op names,
    entries, gradients and running statistics, and the route's counts."""
    torch.manual_seed(0)
    bn2d = torch.nn.BatchNorm2d(values.shape[1]).double()
    bn1d = torch.nn.BatchNorm1d(values.shape[1], affine=False, track_running_stats=False).double()
    bn2d.bias.requires_grad_(False)  # a frozen bias: the backward's output mask leaves its gradient out
    x = values.clone().requires_grad_()
    labels = torch.arange(values.shape[0]) % values.shape[1]

    def body() -> None:
        z = bn1d(torch.nn.functional.relu(bn2d(x)).mean((2, 3)))
        (torch.nn.functional.cross_entropy(z, labels) + (torch.softmax(z, 1) * z).sum()).backward()

    got, counts = _recorded(on, tau, body)
    return (*got, (x.grad, bn2d.weight.grad, bn2d.running_mean, bn2d.running_var)), counts


@needs_native
@pytest.mark.parametrize("tau, with_kernel", [(2.0**-20, True), (2.0**-3, True), (2.0**-3, False)])
def test_batch_norm_and_softmax_backwards_are_decomposed_natively_with_the_modes_bits(
    tau: float, with_kernel: bool
) -> None:
    """Batch norm, its backward and the backwards of log-softmax and softmax are written out in C++ with the Python
    decomposition's ops (decompose.py): nothing reaches the mode, and the stats, op names, entries,
    gradients and running statistics equal the mode's. At the larger threshold their sums and exp have
    elements near a midpoint: entries taken by the C kernel, or, without it, the outputs handed to the
    mode as parts of the decomposed op (not counted as rounded outputs of their own)."""
    from detrl.core import kernel

    torch.manual_seed(1)
    values = (torch.randn(6, 4, 5, 5, dtype=torch.float64) * 3 + 1).float().double()
    # dense activations take the loops of batch norm backward; channels-last ones, torch's ops
    for x in (values, values.contiguous(memory_format=torch.channels_last)):
        with kernel.disabled() if not with_kernel else contextlib.nullcontext():
            on, counts = _batch_norm_step(True, tau, x)
            off, _ = _batch_norm_step(False, tau, x)
        assert counts["python"] == 0, counts  # every op native, the four decompositions included
        if tau == 2.0**-3:
            assert on[2], "no entries: no sum or exp had an element near a midpoint"
        assert on[:3] == off[:3]
        for got, want in zip(on[3], off[3], strict=True):
            assert (got is None and want is None) or (
                torch.equal(got, want) and got.stride() == want.stride()
            )


def _special_values(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random FP64 values over 80 binades, with zeros, signed zeros, infinities, NaN and FP64 subnormals."""
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
        -40, 40, shape, generator=g
    )
    r = torch.rand(shape, generator=g)
    x[r < 0.02] = 0.0
    x[(r >= 0.02) & (r < 0.03)] = -0.0
    x[(r >= 0.03) & (r < 0.035)] = float("inf")
    x[(r >= 0.035) & (r < 0.04)] = float("nan")
    x[(r >= 0.04) & (r < 0.05)] = 5e-324
    return x


@needs_native
def test_batch_norm_backwards_element_passes_give_the_torch_ops_bits() -> None:
    """The written-out batch norm backward replaces its element-wise torch ops by two loops; each element
    must take the same IEEE operations in the same order. Rounding to FP32 hides most last-bit differences
    (the route-against-mode tests cannot see them), so the loops are held to the unrounded torch results,
    bit for bit, on values of every kind, with and without spatial dims."""
    module = native._module()
    g = torch.Generator().manual_seed(4)
    for shape in ((6, 5, 7, 3), (9, 4), (2, 3, 5)):
        x, grad, count = _special_values(shape, g), _special_values(shape, g), shape[1]
        mean, invstd, a, b, s = (_special_values((count,), g) for _ in range(5))
        view = [1, count] + [1] * (len(shape) - 2)
        xhat, product = module.batch_norm_centred(x, grad, mean, invstd)
        want_xhat = torch.sub(x, mean.view(view)).mul_(invstd.view(view))
        assert torch.equal(xhat.view(torch.int64), want_xhat.view(torch.int64))
        assert torch.equal(product.view(torch.int64), torch.mul(grad, want_xhat).view(torch.int64))
        got = module.batch_norm_grad_input(grad, want_xhat, a, b, s)
        want = torch.sub(grad, a.view(view)).sub_(want_xhat.clone().mul_(b.view(view))).mul_(s.view(view))
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@needs_native
def test_layer_norm_backwards_element_passes_give_the_torch_ops_bits() -> None:
    """The written-out layer norm backward replaces its element-wise torch ops by two loops over the rows:
    xhat, the weighted incoming gradient, its product with xhat and grad_out * xhat in one, the input
    gradient in the other. Rounding to FP32 hides most last-bit differences (the route-against-mode test
    cannot see them), so the loops are held to the unrounded torch results, bit for bit, on values of every
    kind, with and without a weight and with each output left out."""
    module = native._module()
    g = torch.Generator().manual_seed(9)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64)

    for shape in ((4, 6, 32), (9, 7), (1, 1)):
        x, grad = _special_values(shape, g), _special_values(shape, g)
        stats = (*shape[:-1], 1)
        mean, rstd, a, b = (_special_values(stats, g) for _ in range(4))
        weight = _special_values(shape[-1:], g)
        want_xhat = torch.sub(x, mean).mul_(rstd)
        for w, terms, products in itertools.product((weight, None), (True, False), (True, False)):
            xhat, gw, weighted, product = module.layer_norm_grad_passes(
                x, grad, mean, rstd, w, terms, products
            )
            assert torch.equal(bits(xhat), bits(want_xhat))
            want_gw = torch.mul(grad, w) if w is not None else grad
            if terms:
                assert torch.equal(bits(gw), bits(want_gw))
                assert torch.equal(bits(weighted), bits(torch.mul(want_gw, want_xhat)))
            else:
                assert gw is None and weighted is None
            if products:
                assert torch.equal(bits(product), bits(torch.mul(grad, want_xhat)))
            else:
                assert product is None
        for gw in (torch.mul(grad, weight), grad):
            got = module.layer_norm_grad_input(gw, want_xhat, a, b, rstd)
            want = torch.sub(gw, a).sub_(torch.mul(want_xhat, b)).mul_(rstd)
            assert torch.equal(bits(got), bits(want))


@needs_native
def test_layer_norms_element_passes_give_the_torch_ops_bits() -> None:
    """The written-out layer norm's three loops against the torch ops they replace, bit for bit: the rows
    with exact ones zeroed and those rows' sums (exact rows: FP32-grid values of few binades, rows of -0s
    and of zeros among them; any order sums them alike), the centred rows and their squares, and the
    output with and without a weight and a bias, on values of every kind."""
    from detrl.core import decompose

    module = native._module()
    g = torch.Generator().manual_seed(5)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64)

    for shape in ((4, 6, 32), (9, 7), (1, 1)):
        rows = _special_values(shape, g)
        flat = rows.view(-1, shape[-1])
        half = (flat.shape[0] + 1) // 2  # rows that sum exactly: integers over a few binades
        flat[:half] = torch.randint(-8, 9, (half, shape[-1]), generator=g) * 2.0 ** torch.randint(
            -3, 3, (half, shape[-1]), generator=g
        )
        flat[-1] = -0.0
        exact = decompose._exact_rows(rows)
        masked, sums = module.layer_norm_masked(rows, exact)
        assert torch.equal(bits(masked), bits(rows.masked_fill(exact.unsqueeze(-1), 0.0)))
        assert bool(exact.any()) and torch.equal(bits(sums[exact]), bits(rows.sum(-1)[exact]))
        mean = _special_values((*shape[:-1], 1), g)
        centred, squares = module.layer_norm_centred(rows, mean)
        want = torch.sub(rows, mean)
        assert torch.equal(bits(centred), bits(want)) and torch.equal(
            bits(squares), bits(torch.mul(want, want))
        )
        rstd = _special_values((*shape[:-1], 1), g)
        weight, bias = _special_values(shape[-1:], g), _special_values(shape[-1:], g)
        for w, b in ((weight, bias), (weight, None), (None, bias), (None, None)):
            want = torch.sub(rows, mean).mul_(rstd)
            if w is not None:
                want.mul_(w)
            if b is not None:
                want.add_(b)
            assert torch.equal(bits(module.layer_norm_scaled(centred, rstd, w, b)), bits(want))


def _convolution_step(on: bool, rules: int, pixels: torch.Tensor) -> tuple:
    """Two convolutions in one recorded step, the first on few-bit ``pixels`` (exact in every order), the
    second on its 24-bit output, at a threshold that finds near elements; the route ``on`` or off, under
    rules revision ``rules``. Returns the stats, op names and entries, and the route's counts."""
    g = torch.Generator().manual_seed(0)
    first = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64).float().double()
    second = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64).float().double()

    def body() -> None:
        h = torch.nn.functional.conv2d(pixels, first, padding=1)
        torch.nn.functional.conv2d(h, second, padding=1)

    return _recorded(on, 2.0**-3, body, rules)


@needs_native
@pytest.mark.parametrize("with_kernel", [True, False])
def test_a_convolution_exact_in_every_order_logs_alike_on_the_route_and_in_the_mode(
    with_kernel: bool,
) -> None:
    """Rules revision 3 leaves out the entries of a convolution exact in every order (few-bit pixels): the
    route decides with the mode's bound (scale.exact_product_elements), taking the entries with the C kernel
    or handing the output to the mode with the call's arguments without it: the same stats, op names and
    entries. Under revision 2 the first convolution's ties are logged."""
    from detrl.core import kernel

    g = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 17, (2, 3, 8, 8), generator=g).double() / 16
    with kernel.disabled() if not with_kernel else contextlib.nullcontext():
        on, counts = _convolution_step(True, 3, pixels)
        off, _ = _convolution_step(False, 3, pixels)
        older, _ = _convolution_step(True, 2, pixels)
    assert counts["python"] == 0 or not with_kernel
    assert on == off
    assert [op for op, *_ in on[2]] == [1]  # the second convolution's entries only
    assert [op for op, *_ in older[2]] == [0, 1]  # revision 2: the first one's ties too


@needs_native
def test_layer_norms_statistics_loops_give_the_torch_ops_bits() -> None:
    """The written-out layer norm's row statistics against the torch ops they replace, bit for bit, on values
    of every kind: the means ``(exact ? sums : logged) / n`` (with and without the exact rows) and
    ``rstd = (1 / sqrt(spread / n + eps)) * 1`` (decompose.Steps.inv_sqrt, with a correctly rounded root)."""
    module = native._module()
    g = torch.Generator().manual_seed(11)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64)

    for shape, n in (((4, 6), 32), ((9,), 7), ((1,), 1), ((3, 2), 768)):
        sums, logged, spread = (_special_values(shape, g) for _ in range(3))
        exact = torch.rand(shape, generator=g) < 0.5
        want = torch.div(torch.where(exact, sums, logged), n).unsqueeze(-1)
        assert torch.equal(bits(module.row_means(exact, sums, logged, n)), bits(want))
        want = torch.div(logged, n).unsqueeze(-1)
        assert torch.equal(bits(module.row_means(None, sums, logged, n)), bits(want))
        for eps in (1e-5, 1e-12, 0.0):
            var = torch.div(spread, n).unsqueeze(-1) + eps
            with np.errstate(invalid="ignore"):  # numpy's root is the processor's, correctly rounded
                roots = torch.from_numpy(np.sqrt(var.numpy()))
            want = torch.mul(torch.reciprocal(roots), 1.0)
            assert torch.equal(bits(module.inverse_deviations(spread, n, eps)), bits(want))
