"""Tests for detrl.core.hardware: emulated profiles reorder reductions but stay mathematically equal to native."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.core.hardware import HardwareMode, Profile, get_profile, profile_names

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
    from detrl.core.hardware.profiles import _register

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
def test_cumsum_scans_in_chunks_carrying_their_totals(name: str):
    """A cumulative sum as a GPU's scan: the same values up to rounding, in other bits past the first chunk
    (the first chunk is summed as the native kernel sums it), and natively where the axis is short or the
    result is not floating."""
    profile = get_profile(name)
    x = _randn(6, 500, seed=11)
    out, ref = profile(aten.cumsum.default, (x, 1), {}), torch.cumsum(x, 1)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.allclose(out, ref, rtol=0, atol=1e-12 * x.abs().sum(1).max().item())
    assert _frac_differ(out, ref) > 0.2
    first = profile.plan(500, "k", x.device).pieces[0][1]
    assert torch.equal(out[:, :first], ref[:, :first])
    t = x.t().contiguous()  # along dim 0, and with the dtype argument
    as_float = profile(aten.cumsum.default, (t, 0), {"dtype": torch.float32})
    assert as_float.dtype == torch.float32 and torch.allclose(as_float, t.cumsum(0).float(), atol=1e-4)
    assert torch.equal(profile(aten.cumsum.default, (x[:, :4], 1), {}), x[:, :4].cumsum(1))
    ints = torch.arange(600).view(2, 300)
    assert torch.equal(profile(aten.cumsum.default, (ints, 1), {}), ints.cumsum(1))


#: Average-pool calls: (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override), covering
#: overlapping windows, padding counted and not, ceil mode's windows past the padding, and a divisor given.
POOL_CALLS = [
    (2, 2, 0, False, True, None),
    (3, 1, 1, False, True, None),
    (3, 2, 1, True, False, None),
    (2, 1, 1, True, True, None),
    (3, 2, 1, False, True, 5),
    (2, 3, 1, True, False, None),
]


def _pool_args(dims: int, call: tuple, seed: int) -> tuple:
    """An average pool's arguments, of values spread over 60 binades (so that orders differ)."""
    k, s, p, ceil, include, override = call
    shape = (2, 3, 7, 6) if dims == 2 else (2, 3, 5, 6, 7)
    spread = torch.exp2(torch.randint(-30, 30, shape, generator=torch.Generator().manual_seed(seed)).double())
    return (_randn(*shape, seed=seed) * spread, [k] * dims, [s] * dims, [p] * dims, ceil, include, override)


@pytest.mark.parametrize("dims", [2, 3])
def test_average_pools_in_kernel_order_are_the_native_bits(dims: int) -> None:
    """With one term a chunk, added left to right, the emulated pools and their backwards give the native
    bits on every call: the terms are laid out in the kernels' order (a window row-major forward; the windows
    holding an element in order backward), and divided as the kernels divide."""
    from detrl.core.hardware.profiles import EmulatedProfile

    in_order = EmulatedProfile("in-order", "one term a chunk", {"k": 1, "channel": 1, "batch": 1, "row": 1})
    forward = aten.avg_pool2d.default if dims == 2 else aten.avg_pool3d.default
    backward = aten.avg_pool2d_backward.default if dims == 2 else aten.avg_pool3d_backward.default
    for i, call in enumerate(POOL_CALLS):
        args = _pool_args(dims, call, seed=i)
        out = forward(*args)
        grad = _randn(*out.shape, seed=100 + i) * 2.0**20
        for func, call_args in ((forward, args), (backward, (grad, *args))):
            ref = func(*call_args)
            assert torch.equal(in_order(func, call_args, {}).view(torch.int64), ref.view(torch.int64)), (
                func,
                call,
            )


@pytest.mark.parametrize("name", EMULATED)
def test_average_pools_sum_each_window_in_the_profiles_chunks(name: str) -> None:
    """Each profile sums a pool's windows (and a backward's windows per element) in its own order: the same
    values up to rounding, other bits for some elements; a window too short to split runs natively."""
    profile = get_profile(name, seed=0)
    differ = 0
    for i, call in enumerate(POOL_CALLS):
        args = _pool_args(3, call, seed=i)
        out = aten.avg_pool3d.default(*args)
        grad = _randn(*out.shape, seed=100 + i)
        for func, call_args in (
            (aten.avg_pool3d.default, args),
            (aten.avg_pool3d_backward.default, (grad, *args)),
        ):
            ref, got = func(*call_args), profile(func, call_args, {})
            assert got.shape == ref.shape and got.dtype == ref.dtype
            assert float((got - ref).abs().max()) <= 1e-14 * float(ref.abs().max()), (func, call)
            differ += int((got != ref).sum())
    assert differ > 0
    x = _randn(1, 2, 6, 6)
    assert torch.equal(profile(aten.avg_pool2d.default, (x, [1, 1]), {}), x)  # one term a window


#: Adaptive pools' shapes: (input's spatial shape, output's), shrinking, growing (windows that overlap) and
#: mixed.
ADAPTIVE_CALLS = {
    2: [((7, 9), (4, 5)), ((9, 9), (3, 3)), ((5, 6), (7, 11)), ((8, 3), (3, 5))],
    3: [((5, 6, 7), (2, 4, 3)), ((4, 4, 4), (3, 3, 3)), ((3, 5, 2), (5, 2, 3))],
}


def _adaptive(dims: int) -> tuple:
    forward = aten._adaptive_avg_pool2d.default if dims == 2 else aten._adaptive_avg_pool3d.default
    backward = (
        aten._adaptive_avg_pool2d_backward.default
        if dims == 2
        else aten._adaptive_avg_pool3d_backward.default
    )
    return forward, backward


@pytest.mark.parametrize("dims", [2, 3])
def test_adaptive_pools_in_kernel_order_are_a_kernels_bits(dims: int) -> None:
    """With one term a chunk, added left to right, the emulated adaptive pools and their backwards give each
    window's elements row-major (backward: each element's windows in order), divided by the window's size:
    a CPU's channels-last kernel's bits in 2d, written out in 3d (whose CPU kernels divide by each length
    in turn instead). A sum of one term everywhere runs natively."""
    from detrl.core import pools
    from detrl.core.hardware.profiles import EmulatedProfile

    in_order = EmulatedProfile("in-order", "one term a chunk", {"k": 1, "channel": 1, "batch": 1, "row": 1})
    forward, backward = _adaptive(dims)
    for i, (size, out) in enumerate(ADAPTIVE_CALLS[dims]):
        shape = (2, 16, *size)
        spread = torch.exp2(
            torch.randint(-30, 30, shape, generator=torch.Generator().manual_seed(i)).double()
        )
        x = _randn(*shape, seed=i) * spread
        grad = _randn(2, 16, *out, seed=100 + i) * 2.0**20
        for func, args in ((forward, (x, list(out))), (backward, (grad, x))):
            got = in_order(func, args, {})
            pool = pools.box_pool_call(func, args, {})
            assert pool is not None
            divisors = pool.divisors()
            values = x if func is forward else grad / divisors
            terms = pool.gathered(values, 0.0).flatten(-dims)
            want = torch.zeros(terms.shape[:-1], dtype=torch.float64)
            for k in range(terms.shape[-1]):
                want = want + terms[..., k]
            want = want / divisors if func is forward else want
            if pool.terms == 1:  # a sum of one term: not split, run natively
                want = func(*args)
            assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (func, size, out)
            if dims == 2 and pool.terms > 1:
                cl = [
                    a.contiguous(memory_format=torch.channels_last) if torch.is_tensor(a) else a for a in args
                ]
                native = func(*cl)
                assert torch.equal(got.view(torch.int64), native.contiguous().view(torch.int64)), (func, size)


#: Nearest upsamplings' backwards: (op, input's shape, output's spatial shape, scales).
NEAREST_CALLS = [
    (aten.upsample_nearest1d_backward.default, (2, 3, 5), (13,), (None,)),
    (aten.upsample_nearest2d_backward.default, (2, 3, 5, 6), (10, 12), (2.0, 2.0)),
    (aten.upsample_nearest2d_backward.default, (2, 3, 5, 6), (8, 10), (1.7, 1.7)),
    (aten.upsample_nearest2d_backward.default, (2, 3, 5, 6), (7, 11), (None, None)),
    (aten._upsample_nearest_exact2d_backward.default, (2, 3, 5, 6), (7, 11), (None, None)),
    (aten.upsample_nearest3d_backward.default, (1, 2, 3, 4, 5), (6, 8, 7), (None, None, None)),
    (aten._upsample_nearest_exact3d_backward.default, (1, 2, 3, 4, 5), (5, 9, 7), (None, None, None)),
]


def test_nearest_upsampling_backwards_in_kernel_order_are_the_native_bits() -> None:
    """With one term a chunk, added left to right, the emulated backward of a nearest upsampling (plain and
    exact, 1d to 3d, by sizes and by scales) gives the native bits: each input element's copies' gradients
    in the order of the output positions; and every profile sums them in its own order."""
    from detrl.core.hardware.profiles import EmulatedProfile

    in_order = EmulatedProfile("in-order", "one term a chunk", {"k": 1, "channel": 1, "batch": 1, "row": 1})
    differ = 0
    for i, (func, shape, out, scales) in enumerate(NEAREST_CALLS):
        grad = _randn(*shape[:2], *out, seed=i) * torch.exp2(
            torch.randint(-30, 30, (*shape[:2], *out), generator=torch.Generator().manual_seed(i)).double()
        )
        args = (grad, list(out), list(shape), *scales)
        ref = func(*args)
        assert torch.equal(in_order(func, args, {}).view(torch.int64), ref.view(torch.int64)), (func, out)
        for name in EMULATED:
            got = get_profile(name, seed=0)(func, args, {})
            assert float((got - ref).abs().max()) <= 1e-7 * float(ref.abs().max()), (name, func, out)
            differ += int((got != ref).sum())
    assert differ > 0


#: ``col2im`` calls: (columns' shape, output size, kernel, dilation, padding, stride).
COL2IM_CALLS = [
    ((2, 27, 9), [8, 8], [3, 3], [2, 2], [1, 1], [2, 2]),
    ((27, 16), [8, 8], [3, 3], [1, 1], [1, 1], [2, 2]),
    ((2, 12, 49), [8, 8], [2, 2], [1, 1], [0, 0], [1, 1]),
    ((1, 18, 28), [7, 9], [3, 2], [1, 2], [1, 0], [1, 2]),
]


def test_col2im_in_kernel_order_is_the_native_bits() -> None:
    """With one term a chunk, added left to right, the emulated ``col2im`` (``F.fold``, ``F.unfold``'s
    backward) gives the native bits: each image element's copies in the order of their kernel offsets; and
    every profile sums them in its own order."""
    from detrl.core.hardware.profiles import EmulatedProfile

    in_order = EmulatedProfile("in-order", "one term a chunk", {"k": 1, "channel": 1, "batch": 1, "row": 1})
    differ = 0
    for i, (shape, *options) in enumerate(COL2IM_CALLS):
        spread = torch.exp2(
            torch.randint(-30, 30, shape, generator=torch.Generator().manual_seed(i)).double()
        )
        args = (_randn(*shape, seed=i) * spread, *options)
        ref = aten.col2im.default(*args)
        assert torch.equal(
            in_order(aten.col2im.default, args, {}).view(torch.int64), ref.view(torch.int64)
        ), i
        for name in EMULATED:
            got = get_profile(name, seed=0)(aten.col2im.default, args, {})
            assert float((got - ref).abs().max()) <= 1e-7 * float(ref.abs().max()), (name, i)
            differ += int((got != ref).sum())
    assert differ > 0


#: Linear interpolations: (op, input's shape, output's spatial shape, align_corners, scales).
INTERPOLATION_CALLS = [
    (aten.upsample_linear1d.default, (2, 3, 6), (13,), False, (None,)),
    (aten.upsample_bilinear2d.default, (2, 3, 5, 6), (10, 12), False, (2.0, 2.0)),
    (aten.upsample_bilinear2d.default, (2, 3, 5, 6), (7, 11), True, (None, None)),
    (aten.upsample_bilinear2d.default, (2, 3, 9, 8), (4, 5), False, (None, None)),
    (aten.upsample_bilinear2d.default, (2, 3, 5, 6), (8, 10), False, (1.7, 1.7)),
    (aten.upsample_trilinear3d.default, (1, 2, 3, 4, 5), (6, 8, 7), False, (None, None, None)),
]
_INTERPOLATION_BACKWARDS = {
    aten.upsample_linear1d.default: aten.upsample_linear1d_backward.default,
    aten.upsample_bilinear2d.default: aten.upsample_bilinear2d_backward.default,
    aten.upsample_trilinear3d.default: aten.upsample_trilinear3d_backward.default,
}


def interpolation_calls(seed: int = 0) -> list[tuple]:
    """Each of :data:`INTERPOLATION_CALLS` forward and backward: ``(func, args)``, of values in 3 binades."""
    calls = []
    for i, (forward, shape, out, corners, scales) in enumerate(INTERPOLATION_CALLS):
        g = torch.Generator().manual_seed(seed + i)
        x = (
            (
                torch.randn(*shape, generator=g, dtype=torch.float64)
                * torch.exp2(-torch.randint(0, 3, shape, generator=g).double())
            )
            .float()
            .double()
        )
        grad = torch.randn(*shape[:2], *out, generator=g, dtype=torch.float64).float().double()
        calls.append((forward, (x, list(out), corners, *scales)))
        calls.append((_INTERPOLATION_BACKWARDS[forward], (grad, list(out), list(shape), corners, *scales)))
    return calls


def test_profiles_interpolate_one_dim_at_a_time() -> None:
    """Every emulated profile computes a linear interpolation (1d to 3d, corners aligned or not, sizes or
    scales) and its backward one spatial dim at a time, with weights found by the 1d kernel: the kernels'
    values within a few ulps, with other last bits for some elements."""
    for name in EMULATED:
        profile = get_profile(name, seed=0)
        differ = 0
        for func, args in interpolation_calls():
            ref, got = func(*args), profile(func, args, {})
            assert got.shape == ref.shape and got.dtype == ref.dtype
            assert float((got - ref).abs().max()) <= 1e-14 * float(ref.abs().max()), (name, func)
            differ += int((got != ref).sum())
        assert differ > 0, name


@pytest.mark.parametrize("name", EMULATED)
def test_adaptive_pools_sum_each_window_in_the_profiles_chunks(name: str) -> None:
    """Each profile sums an adaptive pool's windows (and a backward's windows per element) in its own order:
    the same values up to rounding, other bits for some elements."""
    profile = get_profile(name, seed=0)
    differ = 0
    for dims in (2, 3):
        forward, backward = _adaptive(dims)
        for i, (size, out) in enumerate(ADAPTIVE_CALLS[dims]):
            x = _randn(2, 3, *size, seed=i) * 1e3
            grad = _randn(2, 3, *out, seed=100 + i)
            for func, args in ((forward, (x, list(out))), (backward, (grad, x))):
                ref, got = func(*args), profile(func, args, {})
                assert got.shape == ref.shape and got.dtype == ref.dtype
                assert float((got - ref).abs().max()) <= 1e-14 * float(ref.abs().max()), (func, size, out)
                differ += int((got != ref).sum())
    assert differ > 0


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


# ------------------------------------------------------ rows: norms, softmax, losses, embedding, vector norms


Call = tuple[torch._ops.OpOverload, tuple, dict]


def _scalar_calls(func: torch._ops.OpOverload, scores: torch.Tensor, *rest: object) -> list[Call]:
    """Eight calls of a loss whose result is one number, with targets from eight seeds: another order of a
    sum gives the same one number now and then, so the bits must differ on some input, not on each."""
    calls = []
    for seed in range(8):
        shape = (scores.shape[0], *scores.shape[2:])
        target = torch.randint(0, scores.shape[1], shape, generator=torch.Generator().manual_seed(100 + seed))
        calls.append((func, (scores, target, *rest), {}))
    return calls


def _row_cases() -> dict[str, Call | list[Call]]:
    """Calls of each row op the profiles emulate, on FP64 operands big enough for several row chunks."""
    x = _randn(24, 7, 40, seed=20) * 3 + 0.5  # rows of 40 (or 7 x 40) elements, off-centre
    w, b = _randn(40, seed=21), _randn(40, seed=22)
    go = _randn(24, 7, 40, seed=23)
    _, mean, rstd = aten.native_layer_norm.default(x, [40], w, b, 1e-5)
    xg, wg, bg = _randn(6, 12, 5, 5, seed=24), _randn(12, seed=25), _randn(12, seed=26)
    _, gmean, grstd = aten.native_group_norm.default(xg, wg, bg, 6, 12, 25, 3, 1e-5)
    logits = _randn(1000, 40, seed=27) * 2
    target = torch.randint(0, 40, (1000,), generator=torch.Generator().manual_seed(28))
    target[::17] = -100  # ignored rows
    class_w = torch.rand(40, generator=torch.Generator().manual_seed(29), dtype=torch.float64) + 0.5
    logp = aten._log_softmax.default(logits, 1, False)
    _, total_w = aten.nll_loss_forward.default(logp, target, class_w, 1, -100)
    img = aten._log_softmax.default(_randn(4, 40, 6, 5, seed=30), 1, False)  # log-probs: no cancelling
    img_target = torch.randint(0, 40, (4, 6, 5), generator=torch.Generator().manual_seed(31))
    _, img_total = aten.nll_loss2d_forward.default(img, img_target, class_w, 1, -100)
    grad_emb = _randn(16, 30, 24, seed=32)
    ids = torch.randint(0, 50, (16, 30), generator=torch.Generator().manual_seed(33))
    soft = aten._softmax.default(logits, 1, False)
    return {
        "layer_norm": (aten.native_layer_norm.default, (x, [40], w, b, 1e-5), {}),
        "layer_norm_2d_shape": (aten.native_layer_norm.default, (x, [7, 40], None, None, 1e-5), {}),
        "layer_norm_backward": (
            aten.native_layer_norm_backward.default,
            (go, x, [40], mean, rstd, w, b, [True, True, True]),
            {},
        ),
        "group_norm": (aten.native_group_norm.default, (xg, wg, bg, 6, 12, 25, 3, 1e-5), {}),
        "group_norm_backward": (
            aten.native_group_norm_backward.default,
            (_randn(6, 12, 5, 5, seed=34), xg, gmean, grstd, wg, 6, 12, 25, 3, [True, True, True]),
            {},
        ),
        "softmax": (aten._softmax.default, (logits, 1, False), {}),
        "softmax_dim0": (aten._softmax.default, (x, 0, False), {}),
        "softmax_backward": (
            aten._softmax_backward_data.default,
            (_randn(1000, 40, seed=35), soft, 1, torch.float64),
            {},
        ),
        "log_softmax": (aten._log_softmax.default, (logits, -1, False), {}),
        "log_softmax_backward": (
            aten._log_softmax_backward_data.default,
            (_randn(1000, 40, seed=36), logp, 1, torch.float64),
            {},
        ),
        "nll_loss_mean": _scalar_calls(aten.nll_loss_forward.default, logp, class_w, 1, -100),
        "nll_loss_sum": _scalar_calls(aten.nll_loss_forward.default, logp, None, 2, -100),
        "nll_loss_backward": (
            aten.nll_loss_backward.default,
            (torch.tensor(0.7, dtype=torch.float64), logp, target, class_w, 1, -100, total_w),
            {},
        ),
        "nll_loss2d": _scalar_calls(aten.nll_loss2d_forward.default, img, class_w, 1, -100),
        "nll_loss2d_backward": (
            aten.nll_loss2d_backward.default,
            (torch.tensor(1.3, dtype=torch.float64), img, img_target, class_w, 1, -100, img_total),
            {},
        ),
        "embedding_backward": (aten.embedding_dense_backward.default, (grad_emb, ids, 50, -1, False), {}),
        "embedding_backward_pad_freq": (
            aten.embedding_dense_backward.default,
            (grad_emb, ids, 50, 3, True),
            {},
        ),
        "vector_norm": (aten.linalg_vector_norm.default, (x,), {}),
        "vector_norm_dims": (aten.linalg_vector_norm.default, (x, 2, [0, 2], True), {}),
        "vector_norm_1": (aten.linalg_vector_norm.default, (x, 1, [-1]), {}),
        "vector_norm_3": (aten.linalg_vector_norm.default, (x, 3.0, [1]), {}),
        "norm": (aten.norm.Scalar, (x, 2), {}),
        "norm_dim": (aten.norm.ScalarOpt_dim, (x, 2, [2], False), {}),
        "foreach_norm": (aten._foreach_norm.Scalar, ([x, w, logits], 2), {}),
    }


ROW_CASES = _row_cases()


def _outputs(out: object) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else [out]
    return [t for t in items if isinstance(t, torch.Tensor)]


def _calls(case: str) -> list[Call]:
    calls = ROW_CASES[case]
    return calls if isinstance(calls, list) else [calls]


@pytest.mark.parametrize("case", list(ROW_CASES))
@pytest.mark.parametrize("name", EMULATED)
def test_row_ops_are_reordered_but_equal_native(name: str, case: str):
    """Each emulated row op: the native result to a few FP64 ulps at its scale, other bits on some input,
    and (except atomic) the same bits on every call."""
    profile = get_profile(name, seed=0)
    differs = False
    for func, args, kwargs in _calls(case):
        ref = _outputs(func(*args, **kwargs))
        out = _outputs(profile(func, args, kwargs))
        assert len(out) == len(ref)
        for o, r in zip(out, ref, strict=True):
            assert o.shape == r.shape and o.dtype == r.dtype and o.stride() == r.stride(), case
            scale = r.abs().max().item()
            assert (o - r).abs().max().item() <= 16 * EPS64 * scale, case
        differs |= any(not torch.equal(o, r) for o, r in zip(out, ref, strict=True))
        if profile.deterministic:
            again = _outputs(get_profile(name)(func, args, kwargs))
            assert all(torch.equal(a, o) for a, o in zip(again, out, strict=True)), case
    assert differs, f"{case}: native bits on {name}"


@pytest.mark.parametrize("name", EMULATED)
def test_results_keep_the_native_layout_of_a_channels_last_input(name: str):
    """A softmax over a channels-last tensor's channels is emulated through ``movedim``; its results take
    the strides the native kernel gives, so a later kernel that needs a contiguous argument (cross-entropy's
    ``nll_loss2d_backward``, as a segmentation head's loss calls it) runs under every profile."""

    def run(mode: HardwareMode | None) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=g).contiguous(
            memory_format=torch.channels_last
        )
        x.requires_grad_()
        target = torch.randint(0, 3, (4, 8, 8), generator=g)
        with mode if mode is not None else torch.enable_grad():
            soft, log_soft = torch.softmax(x, 1), torch.log_softmax(x, 1)
            loss = F.cross_entropy(x, target)
            loss.backward()
        return [soft, log_soft, loss, x.grad]

    ref, out = run(None), run(HardwareMode(get_profile(name, seed=0)))
    for o, r in zip(out, ref, strict=True):
        assert o.stride() == r.stride()
        assert torch.allclose(o, r, rtol=1e-12, atol=1e-14)


def test_atomic_row_ops_are_fresh_every_call():
    profile = get_profile("emulated:atomic", seed=0)
    for case in ("layer_norm_backward", "softmax", "embedding_backward", "vector_norm"):
        func, args, kwargs = _calls(case)[0]
        first, second = _outputs(profile(func, args, kwargs)), _outputs(profile(func, args, kwargs))
        assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True)), case


@pytest.mark.parametrize("name", EMULATED)
def test_row_ops_in_autograd_equal_native(name: str):
    """Layer norm, softmax, group norm, cross-entropy with class weights, a tied embedding and gradient
    clipping, forward and backward under the mode: in float64 every result within a few ulps of native;
    in float32 the profiles' bits differ from native ones."""

    def loss_and_grads(dtype: torch.dtype, mode: HardwareMode | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        emb, ln = torch.nn.Embedding(50, 40).to(dtype), torch.nn.LayerNorm(40).to(dtype)
        gn = torch.nn.GroupNorm(4, 16).to(dtype)
        ids, targets = torch.randint(0, 50, (8, 30)), torch.randint(0, 50, (8, 30))
        class_w = torch.rand(50, dtype=dtype)
        r1, r2 = torch.randn(8, 30, 40, dtype=dtype), torch.randn(8, 16, 5, 8, dtype=dtype)
        with mode if mode is not None else torch.enable_grad():
            h = ln(emb(ids))
            logits = h @ emb.weight.T  # tied read-out
            loss = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), weight=class_w)
            att = (h @ h.transpose(1, 2) / 8).softmax(-1) @ h
            loss = loss + (att * r1).sum() + (gn(h[:, :16].reshape(8, 16, 5, 8)) * r2).sum()
            params = [*emb.parameters(), *ln.parameters(), *gn.parameters()]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        return [loss.detach(), *(p.grad for p in params)]

    ref = loss_and_grads(torch.float64, None)
    out = loss_and_grads(torch.float64, HardwareMode(get_profile(name)))
    for o, r in zip(out, ref, strict=True):
        assert torch.allclose(o, r, rtol=1e-12, atol=1e-12 * r.abs().max().item())
    ref32 = loss_and_grads(torch.float32, None)
    out32 = loss_and_grads(torch.float32, HardwareMode(get_profile(name)))
    assert _frac_differ(out32[1], ref32[1]) > 0.3  # the tied embedding's gradient


def test_row_ops_run_natively_where_nothing_is_reordered():
    """Half types, ``reduction='none'`` and rows too short to split keep the native kernel's bits."""
    profile = get_profile("emulated:splitk")
    x = _randn(8, 40, seed=40)
    target = torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(41))
    same = [
        (aten.native_layer_norm.default, (x.half(), [40], None, None, 1e-5)),
        (aten._softmax.default, (x.half(), 1, False)),
        (aten.nll_loss_forward.default, (x, target, None, 0, -100)),
        (aten.linalg_vector_norm.default, (x, float("inf"))),
        (aten.embedding_dense_backward.default, (x, torch.arange(8), 10, -1, False)),  # no repeats
    ]
    for func, args in same:
        for o, r in zip(_outputs(profile(func, args, {})), _outputs(func(*args)), strict=True):
            assert torch.equal(o, r), func
    # A reduction of two elements is not split, but the two-pass layer norm still is another kernel.
    tiny = (x[:, :2].contiguous(), [2], None, None, 1e-5)
    for o, r in zip(profile(aten.native_layer_norm.default, tiny, {}), aten.native_layer_norm.default(*tiny)):
        assert torch.allclose(o, r, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------------ another libm

x_pos = _randn(4096, seed=50).abs() + 0.01
x_any = _randn(4096, seed=51) * 3
LIBM_CASES = {
    "exp": (aten.exp.default, (x_any,)),
    "exp_": (aten.exp_.default, (x_any.clone(),)),
    "log": (aten.log.default, (x_pos,)),
    "log1p": (aten.log1p.default, (x_pos,)),
    "expm1": (aten.expm1.default, (x_any,)),
    "tanh": (aten.tanh.default, (x_any,)),
    "tanh_": (aten.tanh_.default, (x_any.clone(),)),
    "sigmoid": (aten.sigmoid.default, (x_any,)),
    "erf": (aten.erf.default, (x_any,)),
    "erfinv": (aten.erfinv.default, ((x_any / 10).clamp(-0.99, 0.99),)),
    "sin": (aten.sin.default, (x_any,)),
    "rsqrt": (aten.rsqrt.default, (x_pos,)),
    "silu": (aten.silu.default, (x_any,)),
    "softplus": (aten.softplus.default, (x_any, 1.0, 20.0)),
    "softplus_backward": (aten.softplus_backward.default, (_randn(4096, seed=54), x_any, 1.0, 20.0)),
    "elu": (aten.elu.default, (-x_pos,)),  # the exp branch (x > 0 is a product)
    "log_sigmoid": (aten.log_sigmoid_forward.default, (x_any,)),
    "pow": (aten.pow.Tensor_Scalar, (x_pos, 1.7)),
    "pow_tensor": (aten.pow.Tensor_Tensor, (x_pos, x_any)),
    "pow_scalar_base": (aten.pow.Scalar, (2.5, x_any)),
}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Signed distance from ``b`` to ``a`` in ulps of their dtype (same-sign values)."""
    view = torch.int64 if a.dtype == torch.float64 else torch.int32
    return a.view(view).to(torch.int64) - b.view(view).to(torch.int64)


def _call(case: str, profile: Profile) -> torch.Tensor:
    func, args, *rest = LIBM_CASES[case]
    kwargs = rest[0] if rest else {}
    args = tuple(
        a.clone() if isinstance(a, torch.Tensor) and func._schema.name.endswith("_") else a for a in args
    )
    out = profile(func, args, kwargs)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("case", list(LIBM_CASES))
def test_another_libm_moves_transcendentals_by_one_or_two_ulps(case: str):
    """emulated:pairwise's libm: results an ulp or two from native, about half of them moved, as a pure
    function of the value (the same bits every call); the other profiles keep the native libm."""
    ref, out = _call(case, get_profile("native")), _call(case, get_profile("emulated:pairwise"))
    assert out.dtype == ref.dtype and out.shape == ref.shape
    moved = _ulps(out, ref)
    assert int(moved.abs().max()) <= 2 and bool(((moved == 0) | (torch.sign(out) == torch.sign(ref))).all())
    assert 0.3 < (moved != 0).double().mean().item() < 0.7, case
    assert torch.equal(out, _call(case, get_profile("emulated:pairwise")))
    for name in ("emulated:splitk", "emulated:reversed", "emulated:atomic"):
        assert torch.equal(_call(case, get_profile(name)), ref), name


#: GELU and the backwards of GELU and SiLU: emulated:pairwise writes them another way (x_arg: the argument the
#: function is evaluated at; the other one is the incoming gradient).
FORMULA_CASES = {
    "gelu": (aten.gelu.default, (x_any,), {}),
    "gelu_tanh": (aten.gelu.default, (x_any,), {"approximate": "tanh"}),
    "gelu_backward": (aten.gelu_backward.default, (_randn(4096, seed=52), x_any), {}),
    "gelu_backward_tanh": (
        aten.gelu_backward.default,
        (_randn(4096, seed=52), x_any),
        {"approximate": "tanh"},
    ),
    "silu_backward": (aten.silu_backward.default, (_randn(4096, seed=53), x_any), {}),
}


@pytest.mark.parametrize("case", list(FORMULA_CASES))
def test_another_libm_writes_gelu_and_the_activation_backwards_another_way(case: str):
    """Another library's GELU (through erfc or a sigmoid) and backwards (without the terms that cancel): the
    results agree with torch's to some FP64 ulps of |x| or of the incoming gradient, not of the result, so
    at inputs where torch's cancels they round to other float32 values (GELU's tail, and the points near
    x = -0.75 and x = -1.28 where a backward's terms cancel), which an ulp of the result never does. Each call
    gives the same bits; the profiles without a libm compute them natively; float32 keeps an ulp or two."""
    func, args, kwargs = FORMULA_CASES[case]
    pairwise = get_profile("emulated:pairwise")
    ref, out = func(*args, **kwargs), pairwise(func, args, kwargs)
    term = args[0].abs()  # |x|, or the incoming gradient's magnitude
    # (torch's own tanh-approximate backward is up to 21 FP64 ulps of |g| from the exact value near x = 7;
    # the other ways are within one)
    assert float(((out - ref).abs() / (term * 2.0**-52)).max()) <= 32.0
    assert torch.equal(out, pairwise(func, args, kwargs))
    for name in ("emulated:splitk", "emulated:reversed", "emulated:atomic"):
        assert torch.equal(get_profile(name)(func, args, kwargs), ref), name
    where = {"gelu": -5.0, "gelu_backward": -0.7517915246935645, "silu_backward": -1.2784645427610737}
    if case in where:  # 8,001 consecutive float32 inputs where torch's result cancels
        at = where[case]
        step = 2.0**-21 if at == -5.0 else 2.0**-23  # the float32 spacing there
        x = (torch.arange(-4000, 4001, dtype=torch.float64) * step + at).float().double()
        near = (x,) if case == "gelu" else (torch.ones_like(x), x)
        assert bool((func(*near).float() != pairwise(func, near, {}).float()).any())
    args32 = tuple(a.float() for a in args)
    moved = _ulps(pairwise(func, args32, kwargs), func(*args32, **kwargs))
    assert int(moved.abs().max()) <= 2 and bool((moved != 0).any())


def test_another_libm_is_a_function_of_the_value_and_keeps_exact_results():
    profile = get_profile("emulated:pairwise")
    v = _randn(512, seed=60)
    twice = profile(aten.exp.default, (torch.cat([v, v.flip(0)]),), {})
    assert torch.equal(twice[:512], twice[512:].flip(0))  # same value, same result, wherever it sits
    x = torch.tensor([0.0, -0.0, 1e-300, float("inf"), -float("inf"), float("nan")], dtype=torch.float64)
    exact = [
        (aten.exp.default, (x,), {}),  # exp(0) = 1, exp(inf) = inf, exp(-inf) = 0
        (aten.sigmoid.default, (x,), {}),
        (aten.sin.default, (x[:3],), {}),  # sin(x) = x for tiny x: a pass-through
        (aten.cos.default, (torch.zeros(8, dtype=torch.float64),), {}),
        (aten.pow.Tensor_Scalar, (_randn(64, seed=61), 2), {}),  # x * x
        (aten.pow.Tensor_Scalar, (x_pos, 0.5), {}),  # sqrt
        (aten.pow.Tensor_Scalar, (x_pos, -1), {}),
        (aten.pow.Scalar, (2.0, torch.arange(-5.0, 6.0, dtype=torch.float64)), {}),  # 2 ** k
        (aten.elu.default, (x_pos,), {}),  # x for x > 0
        (aten.softplus.default, (x_pos + 20, 1.0, 20.0), {}),  # x past the threshold
        (aten.gelu.default, (x_pos + 10,), {}),  # gelu(x) = x once erf(x / sqrt 2) = 1
    ]
    for func, args, kwargs in exact:
        out, ref = profile(func, args, kwargs), func(*args, **kwargs)
        assert torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0)), func
    # float32 (fp32 runs under HardwareMode): another float32 libm, an ulp or two away.
    v32 = v.float()
    moved = _ulps(profile(aten.tanh.default, (v32,), {}), torch.tanh(v32))
    assert int(moved.abs().max()) <= 2 and bool((moved != 0).any())


def test_another_libm_reaches_the_composite_kernels():
    """Softmax, log-softmax (and its backward) and layer norm's rsqrt call the profile's libm. On rows of
    two elements no profile splits a sum, so the profiles without a libm of their own agree bitwise, and
    pairwise's bits differ through its libm alone."""
    x = _randn(256, 2, seed=70)
    logp = aten._log_softmax.default(x, 1, False)
    calls = [
        (aten._softmax.default, (x, 1, False)),
        (aten._log_softmax.default, (x, 1, False)),
        (aten._log_softmax_backward_data.default, (_randn(256, 2, seed=71), logp, 1, torch.float64)),
        (aten.native_layer_norm.default, (x, [2], None, None, 1e-5)),
    ]
    for func, args in calls:
        plain = [_outputs(get_profile(n)(func, args, {})) for n in ("emulated:splitk", "emulated:reversed")]
        assert all(torch.equal(a, b) for a, b in zip(*plain, strict=True)), func
        libm = _outputs(get_profile("emulated:pairwise")(func, args, {}))
        assert any(not torch.equal(a, b) for a, b in zip(libm, plain[0], strict=True)), func


# ------------------------------------------------------------------------ which calls a profile splits


def _product_call(
    op: str, k: int, c: int, n: int, groups: int, mask: list[bool], dtype: torch.dtype
) -> tuple:
    """``(func, args)``: a product of ``k`` terms, or a 3x3 convolution of ``c * groups`` input channels,
    ``2 * groups`` output channels and batch ``n`` (or its backward with output mask ``mask``)."""
    g = torch.Generator().manual_seed(k * 1000 + c * 10 + n)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    if op == "mm":
        return aten.mm.default, (r(3, k), r(k, 2))
    if op == "bmm":
        return aten.bmm.default, (r(2, 3, k), r(2, k, 2))
    if op == "addmm":
        return aten.addmm.default, (r(2), r(3, k), r(k, 2))
    if op == "baddbmm":
        return aten.baddbmm.default, (r(2, 3, 2), r(2, 3, k), r(2, k, 2))
    x, w = r(n, c * groups, 4, 4), r(2 * groups, c, 3, 3)
    if op == "convolution":
        return aten.convolution.default, (x, w, r(2 * groups), [1, 1], [1, 1], [1, 1], False, [0, 0], groups)
    go = r(n, 2 * groups, 4, 4)
    args = (go, x, w, [2 * groups], [1, 1], [1, 1], [1, 1], False, [0, 0], groups, mask)
    return aten.convolution_backward.default, args


#: Sizes at the profiles' chunk edges (8, 16, 24, 32, 45, 64 terms; 1, 2, 3 samples) and beyond.
_EDGES = [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32, 33, 44, 45, 46, 63, 64, 65, 100, 140]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(EMULATED),
    op=st.sampled_from(["mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward"]),
    k=st.sampled_from(_EDGES),
    c=st.sampled_from(_EDGES[:18]),
    n=st.sampled_from(_EDGES[:6]),
    groups=st.sampled_from([1, 2]),
    mask=st.lists(st.booleans(), min_size=3, max_size=3).filter(any),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_a_call_that_splits_nothing_is_the_native_call(name, op, k, c, n, groups, mask, dtype):
    """``reorders(func, args, kwargs)`` is true exactly where the emulation draws a plan that cuts (so
    calibration may skip the others), and a call it is false for gives the native kernel's bits."""
    from detrl.core.hardware import profiles

    func, args = _product_call(op, k, c, n, groups, mask, dtype)
    profile = get_profile(name, seed=0)
    cuts: list[bool] = []
    real_plan = profiles.EmulatedProfile.plan

    def plan(self, *a):  # noqa: ANN001, ANN202
        out = real_plan(self, *a)
        cuts.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiles.EmulatedProfile, "plan", plan)
        emulated = profile(func, args, {})
    assert profile.reorders(func, args, {}) == any(cuts)
    if not any(cuts):
        native = func(*args)
        if op == "convolution_backward":  # what the mask asks for (the CPU kernel may add a weight gradient)
            emulated, native = (
                [g for g, wanted in zip(o, mask, strict=True) if wanted] for o in (emulated, native)
            )
        for a, b in zip(
            *(o if isinstance(o, (tuple, list)) else (o,) for o in (emulated, native)), strict=True
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", EMULATED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_embedding_gradient_chunks_in_one_call_are_the_per_rank_adds(
    name: str, dtype: torch.dtype, monkeypatch
):
    """On the CPU a chunk of ranks is one ``index_add_`` (it adds rows in their order); elsewhere one call a
    rank. Both give the same bits: 512 lookups of 16 rows (each row about 32 times, cut into the profile's
    chunks), with padding and frequency scaling."""
    g = torch.Generator().manual_seed(7)
    go, idx = torch.randn(512, 8, generator=g, dtype=dtype), torch.randint(0, 16, (512,), generator=g)
    func = aten.embedding_dense_backward.default
    for args in ((go, idx, 16, -1, False), (go, idx, 16, 3, True)):
        together = get_profile(name, seed=1)(func, args, {})
        monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False))  # as on a GPU: rank by rank
        one_by_one = get_profile(name, seed=1)(func, args, {})
        monkeypatch.undo()
        assert torch.equal(together, one_by_one)
        if dtype == torch.float32:  # the chunks did reorder the sums: other float32 bits than native
            assert not torch.equal(together, func(*args))


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(EMULATED),
    shape=st.sampled_from([(7,), (300,), (4, 50), (50, 4), (3, 5, 64), (16, 9, 70), (2, 3, 4, 5), (600, 3)]),
    transpose=st.booleans(),
    pick=st.integers(0, 15),
    keepdim=st.booleans(),
    unit=st.sampled_from(["k", "row"]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    negative_zeros=st.booleans(),
)
def test_a_sums_equal_chunks_in_one_call_are_the_chunk_by_chunk_sums(
    name, shape, transpose, pick, keepdim, unit, dtype, negative_zeros
):
    """The emulated sum adds a plan's equal chunks in one ``sum`` over a ``(..., chunks, length)`` view where
    the reduced axis is contiguous, and accumulates the chunks' sums level by level (a tree) or by a
    ``cumsum`` (float64): the same bits as a ``sum`` a chunk added one by one, on every profile, for any dims
    kept, a transposed input (a strided axis: chunk by chunk), each accumulation dtype, and -0.0 sums."""
    from detrl.core.hardware import machinery

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(pick), dtype=torch.float64).to(dtype)
    x = torch.full_like(x, -0.0) if negative_zeros else x
    x = x.transpose(0, -1) if transpose else x
    dims = [d for d in range(x.dim()) if pick >> d & 1] or [x.dim() - 1]
    plan_of = get_profile(name, seed=pick).plan(math.prod(x.shape[d] for d in dims), unit, x.device)
    if plan_of is None:
        return
    kept = [d for d in range(x.dim()) if d not in dims]
    flat = x.to(machinery._acc_dtype(x.dtype)).permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], -1)
    chunk_by_chunk = machinery._combine(
        plan_of, (piece.sum(-1) for piece in machinery._pieces(flat, -1, 1, plan_of))
    )
    out = machinery._sum(get_profile(name, seed=pick), x, dims, keepdim, None, unit)
    out = out.reshape(chunk_by_chunk.shape)
    assert torch.equal(out, chunk_by_chunk) and torch.equal(out.signbit(), chunk_by_chunk.signbit())


@pytest.mark.parametrize("name", EMULATED)
def test_a_channels_last_grouped_convolutions_gradients_are_the_native_ones_reordered(name: str) -> None:
    """The emulated convolution backward cuts the batch into pieces; a one-sample piece of a channels_last
    batch has a batch stride of C (legal for a dim of size 1), for which torch's CPU kernel returns a wrong
    grouped weight gradient (off by its own size). The pieces go in the default layout: every gradient is
    the native one up to the reordering's rounding."""
    g = torch.Generator().manual_seed(0)
    x, w, go = (
        torch.randn(*shape, generator=g, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        for shape in ((4, 8, 10, 10), (8, 4, 3, 3), (4, 8, 8, 8))
    )
    args = (go, x, w, [8], [1, 1], [0, 0], [1, 1], False, [0, 0], 2, [True, True, True])
    func = torch.ops.aten.convolution_backward.default
    want = func(*args)
    got = get_profile(name, seed=0)(func, args, {})
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
