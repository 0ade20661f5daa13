"""Tests for detrl.hardware: emulated profiles reorder reductions but stay mathematically equal to native."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detrl.hardware import HardwareMode, Profile, get_profile, profile_names

aten = torch.ops.aten
EMULATED = ["emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"]
DETERMINISTIC = ["emulated:splitk", "emulated:reversed", "emulated:pairwise"]
EPS64 = torch.finfo(torch.float64).eps


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _frac_differ(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).double().mean().item()


def _within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, ulps: float = 64) -> bool:
    """|out - ref| <= ulps * eps64 * bound elementwise, where bound is the sum of |terms| (e.g. |a| @ |b|)."""
    return bool(((out - ref).abs() <= ulps * EPS64 * bound).all())


# Operands shared by the tests: a K=512 matmul and a 3x3 convolution over 64 input channels.
A, B = _randn(64, 512, seed=1), _randn(512, 64, seed=2)
X, W, BIAS = _randn(4, 64, 16, 16, seed=3), _randn(32, 64, 3, 3, seed=4), _randn(32, seed=5)


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.conv2d(x, w, b, padding=1)


def _conv_grads(profile: Profile | None, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Output and (grad_x, grad_w, grad_b) of the conv for a fixed upstream gradient, under ``profile``."""
    x, w, b = (t.to(dtype).clone().requires_grad_() for t in (X, W, BIAS))
    upstream = _randn(4, 32, 16, 16, seed=6).to(dtype)
    mode = HardwareMode(profile) if profile is not None else None
    if mode is not None:
        mode.__enter__()
    try:
        y = _conv(x, w, b)
        y.backward(upstream)
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    return y.detach(), x.grad, w.grad, b.grad


# ------------------------------------------------------------------------------------------------ API


def test_profile_names_and_lookup():
    names = profile_names()
    assert names[:5] == ["native", *EMULATED]
    for name in names:
        profile = get_profile(name)
        assert isinstance(profile, Profile) and profile.name == name and profile.description


def test_unknown_profile_raises_with_known_list():
    with pytest.raises(ValueError, match=r"unknown hardware profile 'tpu'; known: native, emulated:splitk"):
        get_profile("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without a CUDA device")
def test_cuda_profile_needs_a_device():
    with pytest.raises(ValueError, match="no CUDA device"):
        get_profile("cuda")


def test_registry_refuses_duplicates():
    from detrl.hardware import _register

    with pytest.raises(RuntimeError, match="registered twice"):
        _register(aten.mm.default)(lambda p, func, args, kwargs: None)


def test_native_profile_is_bitwise_native():
    a, b = A.float(), B.float()
    assert torch.equal(get_profile("native")(aten.mm.default, (a, b), {}), a @ b)


# ------------------------------------------------------------------------ reordering, but equal math


@pytest.mark.parametrize("name", EMULATED)
def test_matmul_float32_differs_float64_agrees(name: str):
    profile = get_profile(name)
    out32 = profile(aten.mm.default, (A.float(), B.float()), {})
    assert out32.dtype == torch.float32 and out32.shape == (64, 64)
    assert _frac_differ(out32, A.float() @ B.float()) > 0.5
    out64 = profile(aten.mm.default, (A, B), {})
    assert _within(out64, A @ B, A.abs() @ B.abs())


@pytest.mark.parametrize("name", EMULATED)
def test_convolution_float32_differs_float64_agrees(name: str):
    with HardwareMode(get_profile(name)):
        out32 = _conv(X.float(), W.float(), BIAS.float())
        out64 = _conv(X, W, BIAS)
    assert _frac_differ(out32, _conv(X.float(), W.float(), BIAS.float())) > 0.5
    bound = _conv(X.abs(), W.abs(), BIAS.abs())
    assert _within(out64, _conv(X, W, BIAS), bound)


@pytest.mark.parametrize("name", EMULATED)
def test_convolution_backward(name: str):
    profile = get_profile(name)
    ref64, ref32 = _conv_grads(None, torch.float64), _conv_grads(None, torch.float32)
    for out, ref in zip(_conv_grads(profile, torch.float64), ref64, strict=True):
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())
    for out, ref in zip(_conv_grads(profile, torch.float32)[1:], ref32[1:], strict=True):
        assert _frac_differ(out, ref) > 0.5


@pytest.mark.parametrize("name", EMULATED)
def test_other_ops_equal_native_in_float64(name: str):
    """addmm/baddbmm scalars, grouped and transposed convolutions (and their grads), half types."""
    profile = get_profile(name, seed=0)
    c = _randn(64, seed=7)
    W_T = _randn(64, 12, 3, 3, seed=8)  # transposed conv weight: (C_in, C_out / groups, 3, 3)
    cases = [
        lambda: torch.addmm(c, A, B, beta=0.5, alpha=-2.0),
        lambda: torch.addmm(c, A, B, beta=0),
        lambda: torch.baddbmm(c.expand(3, 8, 64), A[:24].view(3, 8, 512), B.expand(3, 512, 64), alpha=3),
        lambda: torch.bmm(A[:24].view(3, 8, 512), B.expand(3, 512, 64)),
        lambda: F.conv2d(X, W[:, :16], BIAS, stride=2, groups=4),
        lambda: F.conv_transpose2d(X, W_T, None, stride=2, groups=2, output_padding=1),
        lambda: F.conv1d(X[:, :, 0], W[:, :, 0], dilation=2),
    ]
    for case in cases:
        ref = case()
        with HardwareMode(profile):
            out = case()
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())
    for transposed in (False, True):
        w = (_randn(64, 8, 3, 3, seed=9) if transposed else _randn(32, 16, 3, 3, seed=9)).requires_grad_()
        x = X.clone().requires_grad_()
        conv = F.conv_transpose2d if transposed else F.conv2d

        def grads(x=x, w=w, conv=conv) -> tuple[torch.Tensor, ...]:
            return torch.autograd.grad(conv(x, w, groups=4).square().sum(), (x, w))

        ref = grads()
        with HardwareMode(profile):
            out = grads()
        for o, r in zip(out, ref, strict=True):
            assert torch.allclose(o, r, rtol=1e-12, atol=1e-12 * r.abs().max().item())
    half = (A.half(), B.half())
    out = profile(aten.mm.default, half, {})
    assert out.dtype == torch.float16
    assert torch.allclose(out.float(), (A @ B).float(), rtol=1e-2, atol=0.1)


@pytest.mark.parametrize("name", EMULATED)
def test_sum_and_mean(name: str):
    profile = get_profile(name)
    x64 = _randn(64, 4096, seed=10)
    x32 = x64.float()
    calls = [
        (aten.sum.dim_IntList, (x64, [1]), {}),
        (aten.sum.dim_IntList, (x64.view(64, 64, 64), [-1, 0], True), {}),
        (aten.sum.dim_IntList, (x64, None), {}),
        (aten.sum.dim_IntList, (x64, []), {"dtype": torch.float32}),
        (aten.sum.default, (x64,), {}),
        (aten.mean.default, (x64,), {}),
        (aten.mean.dim, (x64, [1], True), {}),
        (aten.mean.dim, (x32, [1]), {"dtype": torch.float64}),
    ]
    for func, args, kwargs in calls:
        out, ref = profile(func, args, kwargs), func(*args, **kwargs)
        assert out.shape == ref.shape and out.dtype == ref.dtype, func
        rtol = 1e-5 if ref.dtype == torch.float32 else 1e-12
        assert torch.allclose(out, ref, rtol=rtol, atol=rtol * x64.abs().sum().item() / ref.numel() ** 0.5)
    # Large float32 reductions come out in other bits.
    assert _frac_differ(profile(aten.sum.dim_IntList, (x32, [1]), {}), x32.sum(1)) > 0.5
    assert _frac_differ(profile(aten.mean.dim, (x32, [1]), {}), x32.mean(1)) > 0.5
    # Integer sums are exact anyway and run natively.
    ints = torch.arange(4096).view(64, 64)
    assert torch.equal(profile(aten.sum.dim_IntList, (ints, [1]), {}), ints.sum(1))


# ----------------------------------------------------------------------------------- (non)determinism


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_profiles_repeat_bitwise(name: str):
    a, b = A.float(), B.float()
    first = get_profile(name)(aten.mm.default, (a, b), {})
    assert torch.equal(first, get_profile(name)(aten.mm.default, (a, b), {}))
    profile = get_profile(name)
    assert torch.equal(profile(aten.mm.default, (a, b), {}), profile(aten.mm.default, (a, b), {}))
    assert torch.equal(_conv_grads(profile, torch.float32)[2], _conv_grads(profile, torch.float32)[2])


def test_atomic_is_fresh_every_call_and_every_instance():
    a, b = A.float(), B.float()
    profile = get_profile("emulated:atomic")
    assert not profile.deterministic
    assert not torch.equal(profile(aten.mm.default, (a, b), {}), profile(aten.mm.default, (a, b), {}))
    assert not torch.equal(
        get_profile("emulated:atomic")(aten.mm.default, (a, b), {}),
        get_profile("emulated:atomic")(aten.mm.default, (a, b), {}),
    )
    # ... unaffected by torch's global seed, but reproducible with an explicit one.
    torch.manual_seed(0)
    first = get_profile("emulated:atomic")(aten.mm.default, (a, b), {})
    torch.manual_seed(0)
    assert not torch.equal(first, get_profile("emulated:atomic")(aten.mm.default, (a, b), {}))
    seeded = [get_profile("emulated:atomic", seed=3)(aten.mm.default, (a, b), {}) for _ in range(2)]
    assert torch.equal(*seeded)


# ---------------------------------------------------------------------------------- HardwareMode reach


class _Recording(Profile):
    """Delegates to ``inner`` and records which ops it was asked to compute."""

    def __init__(self, inner: Profile) -> None:
        super().__init__("recording", "records ops")
        self.inner = inner
        self.ops: list[torch._ops.OpOverload] = []

    def __call__(self, func, args, kwargs):
        self.ops.append(func)
        return self.inner(func, args, kwargs)


def test_backward_ops_reach_the_profile():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(64, 32, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(32 * 16 * 16, 10)
    ).double()
    recording = _Recording(get_profile("emulated:splitk"))
    with HardwareMode(recording):
        model(X).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    forward = [aten.convolution.default, aten.addmm.default, aten.mean.default]
    for op in [*forward, aten.convolution_backward.default]:
        assert op in recording.ops, op
    assert aten.mm.default in recording.ops  # the Linear's weight / input gradients
    model.zero_grad()
    model(X).square().mean().backward()
    for out, ref in zip(grads, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


@pytest.mark.parametrize(
    "name", ["emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"]
)
def test_batch_norm_forward_and_backward_are_emulated(name):
    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float64, torch.float32):
        for prof in ("native", name):
            torch.manual_seed(1)
            x = (torch.randn(8, 16, 12, 12) * 3 + 1).to(dtype).requires_grad_()
            bn = torch.nn.BatchNorm2d(16).to(dtype)
            with HardwareMode(get_profile(prof)):
                y = bn(x)
                (y * y.detach().sin()).sum().backward()
            results[dtype, prof] = (
                y.detach(),
                x.grad,
                bn.weight.grad,
                bn.bias.grad,
                bn.running_mean,
                bn.running_var,
            )
    for a, b in zip(results[torch.float64, "native"], results[torch.float64, name]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    differ = [
        (a != b).double().mean().item()
        for a, b in zip(results[torch.float32, "native"], results[torch.float32, name])
    ]
    assert differ[0] > 0.3 and differ[1] > 0.3  # output and input gradient: most elements differ in FP32
