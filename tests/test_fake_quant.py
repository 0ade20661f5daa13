"""Quantization-aware training in verifiable precision (detrl/core/fake_quant.py): the observer and the
fake quantizations written out give torch's float32 kernels' bits, and a QAT model records and replays
on every emulated profile."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn

from detrl.core import fake_quant
from detrl.core.hardware import get_profile
from detrl.testing import zoo

aten = torch.ops.aten


def _state(per_row: bool) -> list[torch.Tensor]:
    """A fresh observer's state as the QAT modules hold it: running min and max (per channel: empty, sized
    at the first call; per tensor: +-inf), scale and zero point."""
    if per_row:
        return [torch.empty(0), torch.empty(0), torch.ones(1), torch.zeros(1, dtype=torch.int32)]
    return [torch.tensor(math.inf), torch.tensor(-math.inf), torch.ones(1), torch.zeros(1, dtype=torch.int32)]


@pytest.mark.parametrize(
    ("per_row", "symmetric", "quant_range"),
    [
        (False, False, (0, 127)),  # activations: quint8 with reduce_range, affine
        (False, True, (-128, 127)),
        (True, True, (-128, 127)),  # weights: per channel, symmetric
        (True, False, (0, 255)),
        (False, True, (-3, 4)),  # a symmetric zero point halfway, 0.5: to even, 0
    ],
)
def test_the_observer_written_out_gives_the_float32_kernels_bits(per_row, symmetric, quant_range) -> None:
    """Three observed calls each, on inputs from 1e-7 (scales below torch's least) to 1e3, offset or
    not, 2-d and 3-d: the same output, mask, running minimum and maximum, scale and zero point, bit for
    bit, with observation and fake quantization switched on and off."""
    g = torch.Generator().manual_seed(0)
    for magnitude, offset, shape in itertools.product(
        (1e-7, 1e-3, 1.0, 1e3), (0.0, 3.0), ((6, 9), (5, 4, 3))
    ):
        want, got = _state(per_row), _state(per_row)
        for call in range(3):
            x = (torch.randn(*shape, generator=g) + offset) * magnitude
            switches = (torch.tensor([int(call != 2)]), torch.tensor([int(call != 1)]))  # off once each
            options = (0.01, *quant_range, 0, per_row, symmetric)
            ref = aten._fused_moving_avg_obs_fq_helper(x, *switches, *want, *options)
            out = fake_quant.fused_observe(x, *switches, *got, *options)
            for a, b in zip((*ref, *want), (*out, *got), strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (magnitude, offset, shape, call)


def test_per_channel_fake_quantization_along_any_axis_gives_the_kernels_bits() -> None:
    """Inputs half a step from the grid too, where ``x * (1 / scale)`` and ``x / scale`` round to different
    integers (a tenth of them here): the kernels multiply by the reciprocal."""
    g = torch.Generator().manual_seed(1)
    for axis in range(3):
        shape = [40, 60, 50]
        scale = torch.rand(shape[axis], generator=g) * 0.1 + 0.01
        point = torch.randint(-5, 5, (shape[axis],), generator=g, dtype=torch.int32)
        along = [1] * 3
        along[axis] = -1
        steps = torch.randint(-20, 20, shape, generator=g) + 0.5
        for x in (torch.randn(*shape, generator=g) * 3, steps * scale.view(along)):
            ref = aten.fake_quantize_per_channel_affine_cachemask(x, scale, point, axis, -16, 15)
            out = fake_quant.per_channel(x, scale, point, axis, -16, 15)
            assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])


def test_choosing_qparams_for_a_range_never_observed_is_refused() -> None:
    with pytest.raises(ValueError, match="observed minimum inf is above the maximum -inf"):
        fake_quant.choose_qparams(math.inf, -math.inf, 0, 255, False)


def _lsq_operands(g: torch.Generator, trial: int, channels: int | None) -> tuple:
    """Inputs, output gradients, scales and zero points for an LSQ call, from 1e-3 to 1e2 in magnitude;
    every seventh per-tensor zero point halfway between two integers."""
    quant_min, quant_max = [(0, 255), (-128, 127), (0, 15), (-8, 7)][trial % 4]
    magnitude = 10.0 ** (trial % 5 - 2)
    x, grad = torch.randn(5, 7, 3, generator=g) * magnitude, torch.randn(5, 7, 3, generator=g)
    size = 1 if channels is None else channels
    scale = torch.rand(size, generator=g) * 0.05 * magnitude + 1e-6
    point = torch.rand(size, generator=g) * (quant_max - quant_min) + quant_min
    if channels is None and trial % 7 == 0:
        point = torch.round(point) + 0.5
    return x, grad, scale, point, quant_min, quant_max, [1.0, 0.3, 1 / 3][trial % 3]


def test_learned_step_size_fake_quantization_gives_the_kernels_results() -> None:
    """LSQ per tensor and per channel (along each axis), forward and backward, on 100 and 120 calls: the
    forward, the input's and the zero point's gradients bit for bit; the scale's gradient to 1e-4 of the
    largest. Torch's CPU build contracts the kernels' ``(clamp(q) - z) * scale - x`` into one fused
    multiply-add (a compiler's choice; a GPU's compiler makes its own), which rounds once where the ops
    here round twice."""
    g = torch.Generator().manual_seed(2)
    for trial in range(100):
        x, grad, scale, point, low, high, factor = _lsq_operands(g, trial, None)
        ref = aten._fake_quantize_learnable_per_tensor_affine(x, scale, point, low, high, factor)
        assert torch.equal(ref, fake_quant.learnable_per_tensor(x, scale, point, low, high, factor))
        refs = aten._fake_quantize_learnable_per_tensor_affine_backward(
            grad, x, scale, point, low, high, factor
        )
        outs = fake_quant.learnable_per_tensor_backward(grad, x, scale, point, low, high, factor)
        assert torch.equal(refs[0], outs[0]) and torch.equal(refs[2], outs[2]), trial
        torch.testing.assert_close(outs[1], refs[1], rtol=0, atol=1e-4 * float(refs[1].abs().max()))
    for trial in range(40):
        for axis in range(3):
            x, grad, _, _, low, high, factor = _lsq_operands(g, trial, None)
            x, grad, scale, point, low, high, factor = _lsq_operands(g, trial, x.shape[axis])
            ref = aten._fake_quantize_learnable_per_channel_affine(x, scale, point, axis, low, high, factor)
            assert torch.equal(
                ref, fake_quant.learnable_per_channel(x, scale, point, axis, low, high, factor)
            )
            refs = aten._fake_quantize_learnable_per_channel_affine_backward(
                grad, x, scale, point, axis, low, high, factor
            )
            outs = fake_quant.learnable_per_channel_backward(grad, x, scale, point, axis, low, high, factor)
            assert torch.equal(refs[0], outs[0]) and torch.equal(refs[2], outs[2]), (trial, axis)
            torch.testing.assert_close(outs[1], refs[1], rtol=0, atol=1e-4 * float(refs[1].abs().max()))


class _QuantizedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def _prepared() -> nn.Module:
    """The MLP prepared for QAT with torch's default x86 recipe: fused observers on the activations (per
    tensor, affine) and the weights (per channel, symmetric)."""
    model = _QuantizedMLP().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's notice that eager quantization moves to torchao
        return torch.ao.quantization.prepare_qat(model)


class _LearnedStepMLP(nn.Module):
    """An MLP quantized with learned step sizes (LSQ, torch's ``_LearnableFakeQuantize``): the first weight per
    channel (affine), the hidden activations per tensor with gradient scaling; scales and zero points are
    parameters the optimizer moves."""

    def __init__(self) -> None:
        from torch.ao.quantization import MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver
        from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 5)
        self.activations = _LearnableFakeQuantize(
            MovingAverageMinMaxObserver, quant_min=0, quant_max=255, use_grad_scaling=True
        )
        self.weights = _LearnableFakeQuantize(
            MovingAveragePerChannelMinMaxObserver,
            quant_min=-128,
            quant_max=127,
            dtype=torch.qint8,
            qscheme=torch.per_channel_affine,
            channel_len=32,
            ch_axis=0,
        )
        with torch.no_grad():
            self.activations.scale.fill_(0.02)
            self.activations.zero_point.fill_(3.4)
            self.weights.scale.copy_(torch.linspace(0.001, 0.003, 32))
            self.weights.zero_point.copy_(torch.linspace(-2.4, 2.6, 32))
        for quantizer in (self.activations, self.weights):
            quantizer.enable_param_learning()  # the observer off: the step sizes are learned

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16) -> (N, 5)
        hidden = torch.relu(nn.functional.linear(x, self.weights(self.fc1.weight), self.fc1.bias))
        return self.fc2(self.activations(hidden))


def test_a_learned_step_size_model_records_and_replays_on_every_profile(tmp_path) -> None:
    """LSQ's backward failed at the first verifiable step ("Expected dY_.scalar_type() == ScalarType::Float").
    Now its step sizes move in 3 steps, and it replays on every emulated profile."""
    specimen = zoo.Specimen("lsq_mlp", _LearnedStepMLP, zoo.features, zoo.classify)
    recorded = zoo.record(specimen, tmp_path / "lsq", steps=3)
    assert float(recorded.model.activations.scale.detach()) != pytest.approx(0.02, abs=1e-6)
    for hardware in ("emulated:splitk", "emulated:pairwise", "emulated:atomic"):
        replayed = zoo.replay(specimen, tmp_path / "lsq", get_profile(hardware), steps=3)
        assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, hardware
        assert replayed.leaves == recorded.leaves, hardware


def test_a_qat_model_records_and_replays_on_every_profile(tmp_path) -> None:
    """The QAT step failed at its first observer ("expected scalar type Float but found Double"). Now it
    records 3 steps and replays on every emulated profile with nothing unlogged or refused; a changed loss
    is caught."""
    specimen = zoo.Specimen("qat_mlp", _prepared, zoo.features, zoo.classify)
    recorded = zoo.record(specimen, tmp_path / "qat", steps=3)
    for hardware in ("emulated:splitk", "emulated:pairwise", "emulated:atomic"):
        replayed = zoo.replay(specimen, tmp_path / "qat", get_profile(hardware), steps=3)
        assert replayed.totals.unlogged_near == 0 and replayed.totals.refused == 0, hardware
        assert replayed.leaves == recorded.leaves, hardware
    doubled = zoo.Specimen("qat_mlp", _prepared, zoo.features, lambda m, b: 1.5 * zoo.classify(m, b))
    with pytest.raises(Exception, match="diverged at step 1"):
        zoo.replay(doubled, tmp_path / "qat", get_profile("emulated:splitk"), steps=3)
