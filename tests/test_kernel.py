"""The native rounding kernel against the pure-torch reference: the same log entries, thresholds and rounded
bits on random and adversarial inputs (ties, subnormals, binade edges, overflow, infinities, NaN), and the
same bundle for a whole recording."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from detrl.core import kernel
from detrl.core import scale as scale_module
from detrl.core.rounding import _take, _uncertainty, entries_for, near_midpoint, split_short
from detrl.core.scale import Scale, channel_scale, reduction_scale
from detrl.formats.roundlog import OpEntries

needs_kernel = pytest.mark.skipif(not kernel.available(), reason="the native kernel is not built here")
TAUS = [0.0, 2.0**-30, 2.0**-16, 2.0**-8, 0.25, 0.5]


def test_the_kernel_is_built_where_a_c_compiler_exists() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the install falls back to the pure-torch reference")
    assert kernel.available(), "pip install built no detrl.core._roundkernel although a C compiler exists"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64) if t.dtype == torch.float64 else t.contiguous().view(torch.int32)


def _reference(  # noqa: ANN202
    x: torch.Tensor, tau: float, scaled: bool | Scale, negative_zeros: bool = False, skip_nans: bool = False
):
    x = x.clone()
    rounded = x.to(torch.float32)
    near = near_midpoint(
        x,
        tau,
        scaled,
        rounded=rounded,
        negative_zeros=negative_zeros and scaled is not False,
        skip_nans=skip_nans,
    )
    idx = near.reshape(-1).nonzero().squeeze(1)
    entries = None
    if idx.numel():
        entries = entries_for(7, idx, _take(x, idx), _uncertainty(x, rounded, idx, tau, scaled))
    x.copy_(rounded)
    if entries is not None:
        entries = split_short(entries, x, tau, scaled)
    return x, entries


def _assert_same(
    x: torch.Tensor, tau: float, scaled: bool | Scale, negative_zeros: bool = False, skip_nans: bool = False
) -> OpEntries | None:
    """The kernel's entries and rounding of ``x`` are the reference's (``negative_zeros``: rules revision 7's
    test, which the kernel applies to reductions only, as the mode asks the reference for it; ``skip_nans``:
    revision 16's, for every op)."""
    want_x, want = _reference(x, tau, scaled, negative_zeros, skip_nans)
    got_x = x.clone()
    got = kernel.take_entries_(got_x, tau, scaled, 7, negative_zeros, skip_nans)
    assert torch.equal(_bits(got_x), _bits(want_x))
    assert (got is None) == (want is None)
    if got is not None:
        assert got.op == want.op == 7
        for field in ("indices", "up", "pinned_indices", "short_indices", "short_bits"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and np.array_equal(a, b), field
        assert np.array_equal(got.pinned_values.view(np.int32), want.pinned_values.view(np.int32))
    rounded = x.clone()
    kernel.round_(rounded)
    assert torch.equal(_bits(rounded), _bits(want_x))
    return got


def _adversarial() -> torch.Tensor:
    """FP64 values where rounding to FP32 is hardest: exact ties and their FP64 neighbours, at ordinary
    scales, in the FP32 subnormal range, at binade edges and at the overflow boundary; zeros, infinities,
    NaN, FP64 subnormals."""
    g = np.random.default_rng(0)
    grid = np.concatenate(
        [
            g.standard_normal(64).astype(np.float32),
            (g.standard_normal(16) * 1e-40).astype(np.float32),  # FP32 subnormals
            np.float32(2.0) ** np.arange(-149, 128, 7, dtype=np.float32),  # binade edges, smallest to largest
            np.array(
                [np.finfo(np.float32).max, np.finfo(np.float32).tiny, -np.finfo(np.float32).max], np.float32
            ),
        ]
    )
    with np.errstate(over="ignore"):  # FLT_MAX's neighbour above is inf, as wanted
        up = np.nextafter(grid, np.float32(np.inf))
        down = np.nextafter(grid, np.float32(-np.inf))
    lo, hi = grid.astype(np.float64), up.astype(np.float64)
    ties = np.where(np.isfinite(hi), (lo + hi) / 2, lo)  # exact in FP64
    ties_below = (lo + down.astype(np.float64)) / 2
    values = [grid.astype(np.float64), ties, ties_below]
    for k in (1, 2, 3, 1000, 2**20):  # FP64 ulps beside the ties
        values += [ties + k * np.spacing(ties), ties - k * np.spacing(ties)]
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 5e-324, -5e-324, 2.2250738585072014e-308,
               float(np.finfo(np.float32).max) * (1 + 2.0**-25), 1e300, -1e300, 2.0**-150, 2.0**-151]  # fmt: skip
    values.append(np.array(special))
    return torch.from_numpy(np.concatenate(values))


@needs_kernel
@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("room", [kernel.FIRST_ROOM, 1])
@pytest.mark.parametrize("negative_zeros", [False, True])
@pytest.mark.parametrize("skip_nans", [False, True])
def test_adversarial_values_flat(
    tau: float,
    scaled: bool,
    room: int,
    negative_zeros: bool,
    skip_nans: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernel, "FIRST_ROOM", room)
    x = _adversarial()
    entries = _assert_same(x, tau, scaled, negative_zeros, skip_nans)
    nans = set(torch.isnan(x).nonzero().squeeze(1).tolist())
    logged = set() if entries is None else {*entries.indices, *entries.pinned_indices, *entries.short_indices}
    assert nans & {int(i) for i in logged} == (set() if skip_nans else nans)  # a NaN was near every midpoint
    _assert_same(x[torch.isfinite(x)], tau, scaled, negative_zeros, skip_nans)  # a channel without inf or NaN


@needs_kernel
@pytest.mark.parametrize("tau", [2.0**-16, 0.25])
@pytest.mark.parametrize("shape", [(), (1,), (7, 3), (4, 5, 6), (2, 3, 4, 5), (3, 1, 1, 2), (2, 0, 3)])
def test_shapes_and_channels(tau: float, shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape))
    x = _adversarial()
    x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(n))][:n]
    if len(x) < n:
        x = torch.cat([x, torch.randn(n - len(x), dtype=torch.float64)])
    x = x.reshape(shape)
    for scaled in (False, True):
        _assert_same(x, tau, scaled)
        if x.dim() >= 2 and x.numel():  # a channel of ordinary values beside one holding inf or NaN
            y = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            y[:, 0] = x[:, 0]
            _assert_same(y, tau, scaled)


_MM = torch.ops.aten.mm.default


def _matrix_inputs(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a: (m, k)``, ``b: (k, n)`` on the FP32 grid, rows and columns of very different magnitudes (a
    weight gradient's shape of trouble)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, dtype=torch.float64, generator=g) * 10.0 ** torch.randint(
        -20, 5, (m, 1), generator=g
    )
    b = torch.randn(k, n, dtype=torch.float64, generator=g) * 10.0 ** torch.randint(
        -5, 5, (1, n), generator=g
    )
    return a.float().double(), b.float().double()


@needs_kernel
@pytest.mark.parametrize("tau", TAUS)
def test_matrix_scale_row_times_column(tau: float) -> None:
    """mm's unit (row factor x column factor from its inputs): the kernel and the reference agree on random
    products, on adversarial outputs, and where an input row or column holds inf, NaN or only zeros."""
    a, b = _matrix_inputs(33, 20, 17, seed=3)
    out = a @ b
    scale = reduction_scale(_MM, (a, b), out)
    assert scale is not None and scale.row is not None
    _assert_same(out, tau, scale)
    adv = _adversarial()[: 33 * 17]
    _assert_same(adv.reshape(33, 17), tau, scale)  # any output values against that unit
    a[0, 0], a[1, :], b[0, 2], b[:, 3] = float("inf"), 0.0, float("nan"), 0.0
    special = reduction_scale(_MM, (a, b), out)
    # an infinity or a NaN does not set its row's or column's unit: the finite elements beside it do, in
    # the kernel and in torch's ops alike
    plain = reduction_scale(_MM, (a.nan_to_num(posinf=0.0), b.nan_to_num(nan=0.0)), out)
    assert special is not None and plain is not None and special.row is not None and plain.row is not None
    assert torch.equal(special.row, plain.row) and torch.equal(special.col, plain.col)
    assert torch.isfinite(special.row).all() and torch.isfinite(special.col).all()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scale_module, "_native", None)
        by_torch = reduction_scale(_MM, (a, b), out)
    assert by_torch is not None and by_torch.row is not None
    assert torch.equal(by_torch.row, special.row) and torch.equal(by_torch.col, special.col)
    _assert_same(out, tau, special)
    _assert_same(out, tau, channel_scale(out))  # a channel scale as a Scale: the same as scaled=True
    want = _reference(out, tau, True)[1]
    got = _reference(out, tau, channel_scale(out))[1]
    assert (want is None) == (got is None) and (want is None or want == got)


@needs_kernel
@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("negative_zeros", [False, True])
def test_rows_along_channels_are_tested_first_at_their_largest_threshold(
    tau: float, negative_zeros: bool
) -> None:
    """A product's output is searched a block at a time against the row's largest T before each element's
    own T (the vector pass's shortcut): column factors 2**-60..2**60 apart, ties and their neighbours at small
    and large columns, rows long enough for several blocks, a channel scale along rows (no row factor), and
    NaN or infinite factors, which mark every block: the kernel's entries and bits are the reference's."""
    g = torch.Generator().manual_seed(8)
    rows_n, cols_n = 9, 100
    spread = 2.0 ** torch.randint(-60, 61, (cols_n,), generator=g).double()
    row = 2.0 ** torch.randint(-20, 21, (rows_n,), generator=g).double()
    for col in (spread, torch.full((cols_n,), 2.0**-30, dtype=torch.float64)):  # even columns: T is the row's
        unit = row.view(-1, 1) * col.view(1, -1)  # the unit at each element (no clamp at these sizes)
        # FP32 values in [1, 2) times 2**23 units (an FP32 spacing of one unit), moved to their midpoint and
        # off it by a multiple of T: near below 1 T (a search at a quarter of T would miss 0.5 and 0.9). One
        # such element a row, the others far from any midpoint: a block holds at most one near element.
        m = (1 + torch.rand(rows_n, cols_n, generator=g, dtype=torch.float64)).float().double()
        off = torch.tensor([0.0, 0.5, 0.9, 1.1, 3.0], dtype=torch.float64)
        pick = torch.full((rows_n, cols_n), 1e6, dtype=torch.float64)
        at = torch.randint(0, cols_n, (rows_n,), generator=g)
        pick[torch.arange(rows_n), at] = off[torch.arange(rows_n) % 5]
        sign = torch.randint(0, 2, (rows_n, cols_n), generator=g).double() * 2 - 1
        x = sign * (m * 2.0**23 * unit + unit / 2 + pick * tau * unit)
        for c in (
            col,
            torch.where(torch.arange(cols_n) == 7, float("inf"), col),
            torch.where(torch.arange(cols_n) == 50, float("nan"), col),
        ):
            scale = Scale(outer=rows_n, channels=cols_n, inner=1, col=c, row=row)
            _assert_same(x, tau, scale, negative_zeros)
            _assert_same(x, tau, Scale(outer=rows_n, channels=cols_n, inner=1, col=c), negative_zeros)
            y = x.clone()
            y[::2, 3::7] = math.nan  # NaN values along the channels, where the search runs a block at a time
            _assert_same(y, tau, scale, negative_zeros, skip_nans=True)
            _assert_same(y, tau, scale, negative_zeros, skip_nans=False)


def test_matrix_scale_follows_the_rows_a_channel_scale_does_not() -> None:
    """A row of tiny terms gets a tiny unit under mm's scale; under the channel (column) scale it shares
    the largest row's, so at the same tau every one of its elements would be logged."""
    a, b = _matrix_inputs(8, 64, 8, seed=4)
    a[0] *= 1e12  # one dominant row
    out = (a @ b).float().double()
    scale = reduction_scale(_MM, (a, b), out)
    small_row = near_midpoint(out, 2.0**-20, scale)[1:]
    column_scaled = near_midpoint(out, 2.0**-20, True)[1:]
    assert column_scaled.all() and not small_row.any()
    assert reduction_scale(torch.ops.aten.addmm.default, (out, a, b), out) is None  # only mm


def test_matrix_scale_grows_with_the_square_root_of_the_sum_length() -> None:
    """mm's unit grows like sqrt(K) (2**floor(log2(K) / 2)), not like K: a 4x longer sum, a 2x unit."""
    g = torch.Generator().manual_seed(5)
    cols = []
    for k in (1, 3, 4, 512, 2048, 50257):
        a = torch.ones(2, k, dtype=torch.float64)
        b = torch.ones(k, 3, dtype=torch.float64)
        scale = reduction_scale(_MM, (a, b), torch.randn(2, 3, dtype=torch.float64, generator=g))
        assert scale is not None and scale.row is not None
        cols.append(float(scale.col[0]) / 2.0**-23)
    assert cols == [1.0, 1.0, 2.0, 16.0, 32.0, 128.0]


@needs_kernel
def test_matrix_scale_row_maxima_match_torch_on_strided_and_special_inputs() -> None:
    """mm's unit factors come from the kernel (one pass, no ``abs`` temporary): the same bits as torch's
    ``x.abs().amax(dim=1)`` through the power of two, clamp and scale, on contiguous, transposed, sliced and
    expanded matrices of magnitudes 1e-50..1e30 (below the floor 2**-149 too), with NaN, infinities and
    FP64 values past FP32's range: none of them sets a factor (those of the other elements of its row do)."""
    from detrl.core import scale as scale_mod

    g = torch.Generator().manual_seed(7)
    for trial in range(60):
        m, k = (int(v) for v in torch.randint(1, 40, (2,), generator=g))
        x = torch.randn(m, k, dtype=torch.float64, generator=g) * 10.0 ** torch.randint(
            -50, 30, (m, 1), generator=g
        )
        flat = x.view(-1)
        if trial % 3 == 0:
            flat[torch.randint(0, m * k, (2,), generator=g)] = float("nan")
        if trial % 4 == 0:
            flat[torch.randint(0, m * k, (1,), generator=g)] = -float("inf")
        if trial % 5 == 0:  # finite in FP64, an infinity in FP32
            flat[torch.randint(0, m * k, (1,), generator=g)] = 1e39
        for view in (x, x.t(), x.t().contiguous().t(), x[:, ::2], x[:1].expand(m, k)):
            for times in (1.0, 2.0**-23 * 16):
                magnitude = view.abs()
                finite = magnitude.where(magnitude < scale_mod.FP32_OVERFLOW, 0.0)
                want = scale_mod._power_of_two(finite.amax(dim=1)).clamp_(min=2.0**-149).mul_(times)
                assert torch.equal(scale_mod.unit_factors(view, times), want)


@needs_kernel
def test_convolution_input_gradient_scale_per_sample_and_channel() -> None:
    """A convolution's input gradient is measured per (sample, channel): a quiet sample's elements get its
    own small unit (the channel scale would give them the loud sample's), kernel and reference agree; its
    weight gradient keeps the channel scale (rules revision 5: from 6, :func:`test_convolution_gradients_in_their_terms_units`)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64, generator=g).float().double()
    w = torch.randn(5, 4, 3, 3, dtype=torch.float64, generator=g).float().double()
    grad_out = torch.randn(3, 5, 4, 4, dtype=torch.float64, generator=g).float().double()
    grad_out[1] *= 1e-9  # a well-classified sample: a tiny gradient
    conv_backward = torch.ops.aten.convolution_backward.default
    args = (grad_out, x, w, [5], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    grad_in, grad_w, _ = conv_backward(*args)
    scale = reduction_scale(conv_backward, args, grad_in, 5)
    assert scale is not None and scale.row is not None and (scale.outer, scale.inner) == (12, 36)
    assert reduction_scale(conv_backward, args, grad_w, 5) is None
    quiet = near_midpoint(grad_in, 2.0**-20, scale)[1]
    assert near_midpoint(grad_in, 2.0**-20, True)[1].all() and not quiet.any()
    for tau in (2.0**-20, 2.0**-8):
        _assert_same(grad_in, tau, scale)


@pytest.mark.parametrize("groups, transposed", [(1, False), (2, False), (1, True), (2, True)])
def test_convolution_gradients_in_their_terms_units(groups: int, transposed: bool) -> None:
    """Rules revision 6: each gradient of a convolution is measured at the larger of its own scale
    (revision 5's unit) and its terms' unit (the largest magnitudes of the two factors of its terms, times
    terms_factor of their count). A weight gradient that cancels (an input channel the same in every sample
    and a gradient that sums to zero over the batch, as a batch norm's backward leaves it) gets its terms'
    unit, far above its own scale. Kernel and reference round and log alike in these units."""
    g = torch.Generator().manual_seed(7)
    c_in, c_out, size = 4, 6, (7 if transposed else 3)
    x = torch.randn(8, c_in, 5, 5, dtype=torch.float64, generator=g).float().double()
    x[:, 0] = 0.75  # the same in every sample
    w_shape = (c_in, c_out // groups, 3, 3) if transposed else (c_out, c_in // groups, 3, 3)
    w = torch.randn(*w_shape, dtype=torch.float64, generator=g).float().double()
    grad_out = torch.randn(8, c_out, size, size, dtype=torch.float64, generator=g)
    grad_out = (grad_out - grad_out.mean(0, keepdim=True)).float().double()  # sums to ~0 over the batch
    conv_backward = torch.ops.aten.convolution_backward.default
    args = (grad_out, x, w, [c_out], [1, 1], [0, 0], [1, 1], transposed, [0, 0], groups, [True, True, True])
    grad_in, grad_w, grad_b = conv_backward(*args)
    old_in = reduction_scale(conv_backward, args, grad_in, 5)
    assert old_in is not None
    owns = [old_in.dense().expand(old_in.outer, 1, old_in.inner), scale_module.scale_spacing(grad_w)]
    owns.append(scale_module.scale_spacing(grad_b))
    for out, own in zip((grad_in, grad_w, grad_b), owns, strict=True):
        scale = reduction_scale(conv_backward, args, out, 6)
        assert scale is not None and scale.outer * scale.channels * scale.inner == out.numel()
        unit = scale.dense().expand(scale.outer, scale.channels, scale.inner).reshape(out.shape)
        assert (unit >= own.reshape(out.shape) if own.numel() == out.numel() else unit >= own).all()
        for tau in (2.0**-20, 2.0**-8):
            _assert_same(out, tau, scale)
    if not transposed:  # input channel 0 (the first group's weight[:, 0]) sums grad_out * 0.75: it cancels
        scale_w = reduction_scale(conv_backward, args, grad_w, 6)
        unit_w = scale_w.dense().expand(scale_w.outer, 1, scale_w.inner).reshape(grad_w.shape)
        first_group = unit_w[: c_out // groups, 0]
        assert (first_group > 16 * scale_module.scale_spacing(grad_w[: c_out // groups])[:, 0]).all()


@needs_kernel
def test_random_op_outputs_at_many_scales() -> None:
    g = torch.Generator().manual_seed(2)
    for scale in (1e-30, 1e-6, 1.0, 1e6, 1e30):
        x = torch.randn(64, 16, 9, dtype=torch.float64, generator=g) * scale
        x[3] *= 1e-9  # a quiet channel beside loud ones
        x.view(-1)[::97] = x.view(-1)[::97].to(torch.float32).double()  # some on the grid
        for tau in (2.0**-16, 2.0**-22):
            _assert_same(x, tau, True)
            _assert_same(x, tau, False)


@needs_kernel
@pytest.mark.parametrize("room", [kernel.FIRST_ROOM, 0, 5])
@pytest.mark.parametrize("length", [7, 8, 31, 32, 33, 63, 64, 65, 100])
def test_vector_blocks_at_their_edges(length: int, room: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel tests a block of elements at a time in vector lanes and takes the scalar path only for a
    block holding a near element: rows of every length around the block and vector sizes, with adversarial
    values planted at the first, last and a random element of a block, under each form of threshold (per
    element, per channel along the inner axis, a matrix product's row x column along the channels, a
    per-(sample, channel) unit), give the reference's entries; a NaN or an infinity in a channel too. With
    less room for entries than an output has (``room``), the first pass stops at the block that overflowed
    and a second one takes the rest: the same entries and bits."""
    monkeypatch.setattr(kernel, "FIRST_ROOM", room)
    g = torch.Generator().manual_seed(length)
    adversarial = _adversarial()
    planted = adversarial[torch.randperm(len(adversarial), generator=g)]
    for shape in ((3, 4, length), (5, length)):
        x = torch.randn(shape, dtype=torch.float64, generator=g) * 10.0 ** torch.randint(
            -3, 3, shape[:-1] + (1,), generator=g
        )
        flat = x.view(-1)
        spots = torch.cat([torch.arange(0, flat.numel(), 32), torch.arange(31, flat.numel(), 32)])
        spots = torch.cat([spots, torch.randint(0, flat.numel(), (4,), generator=g)])
        flat[spots] = planted[: len(spots)]
        x[(2, 0) if x.dim() == 2 else (1, 2, 0)] = float("nan")  # a channel holding NaN beside finite values
        x[(4, -1) if x.dim() == 2 else (2, 1, -1)] = float("inf")
        finite = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=torch.float64))
        for values in (x, finite):
            for tau in (2.0**-16, 2.0**-6):
                _assert_same(values, tau, False)
                _assert_same(values, tau, True)
                if values.dim() == 2:  # (m, n): a matrix product's unit along its n channels
                    a, b = _matrix_inputs(values.shape[0], 9, values.shape[1], seed=length)
                    _assert_same(values, tau, reduction_scale(_MM, (a, b), values))
                    _assert_same(values, tau, channel_scale(values))  # per channel, inner == 1
                else:  # (samples, channels, length): a unit per (sample, channel), as a convolution's input gradient
                    row = torch.tensor([2.0**k for k in range(12)], dtype=torch.float64) * 2.0**-30
                    unit = Scale(
                        outer=12, channels=1, inner=length, col=torch.ones(1, dtype=torch.float64), row=row
                    )
                    _assert_same(values, tau, unit)


@needs_kernel
@pytest.mark.parametrize("tau", [2.0**-16, 0.5])
def test_quiet_channels_at_the_floor_spacing(tau: float) -> None:
    """Channels whose largest magnitude is zero, FP32-subnormal or below FP32's range: their threshold is
    the floor, tau subnormal spacings (2**-149), which only exactness at that floor gets right."""
    sub = 2.0**-149

    def f64(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    x = torch.zeros(3, 5, 6, dtype=torch.float64)
    x[:, 1] = f64(0.5, 1.5, 2.5, 3.5, -0.5, 0.75) * sub  # ties between FP32 subnormals
    x[:, 2] = f64(0.25, 0.5, 0.5000001, 2.0**-10, -0.5, 1.0) * sub  # below the smallest subnormal
    x[:, 3] = f64(1.5, 2.5, 1001.5, 2.0**20 + 0.5, 7.0, -3.5) * sub  # larger subnormals
    x[:, 4] = f64(2.0**-126, 2.0**-126 * (1 + 2.0**-24), 1.0, 3.0, -2.0, 0.1)  # a normal channel
    x[1] += (
        torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2.0**-52 * sub
    )
    for scaled in (True, False):
        _assert_same(x, tau, scaled)
    # channels 1 and 3 (subnormal ties) have entries at the floor threshold
    entries = _assert_same(x, tau, True)
    assert entries is not None
    channels = (np.concatenate([entries.indices, entries.pinned_indices, entries.short_indices]) // 6) % 5
    assert {1, 3} <= set(channels.tolist())


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=0, max_dims=4, max_side=6),
        elements=st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=64),
    ),
    st.sampled_from(TAUS),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_property_kernel_equals_reference(
    values: np.ndarray, tau: float, scaled: bool, negative_zeros: bool, skip_nans: bool
) -> None:
    _assert_same(torch.from_numpy(values.copy()), tau, scaled, negative_zeros, skip_nans)


@needs_kernel
@pytest.mark.parametrize("tau", [2.0**-23, 2.0**-10])
def test_a_reduction_logs_its_negative_values_that_round_to_zero_from_rules_revision_7(tau: float) -> None:
    """Rules revision 7: a reduction's negative value that rounds to -0 is pinned as -0; an exact zero of
    either sign is not (the same on every machine), nor a positive value that rounds to +0 (the replay's
    default), nor any zero of an elementwise op, nor any zero under the earlier rules. The kernel's entries
    are the reference's, in a matrix product's unit too."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(3, 4, 5, dtype=torch.float64, generator=g) + 1).float().double()  # one binade: none near
    x *= torch.randint(0, 2, x.shape, generator=g) * 2 - 1
    x[0, 1, 2], x[1, 2, 3], x[2, 0, 0], x[2, 3, 4] = -0.0, -(2.0**-160), 0.0, 2.0**-160
    tiny_negative = [1 * 20 + 2 * 5 + 3]
    entries = _assert_same(x, tau, True, negative_zeros=True)
    assert entries is not None and entries.pinned_indices.tolist() == tiny_negative
    assert entries.pinned_values.view(np.int32).tolist() == [np.float32(-0.0).view(np.int32)]
    assert not len(entries.indices) and not len(entries.short_indices)  # the grid values: nothing else
    for scaled, zeros in ((True, False), (False, True), (False, False)):
        assert _assert_same(x, tau, scaled, negative_zeros=zeros) is None
    product = x.reshape(12, 5)
    unit = reduction_scale(torch.ops.aten.mm.default, (product, torch.eye(5, dtype=torch.float64)), product)
    entries = _assert_same(product, tau, unit, negative_zeros=True)
    assert entries is not None and entries.pinned_indices.tolist() == tiny_negative


def test_non_contiguous_and_other_dtypes_take_the_reference() -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    assert not kernel.applies(x.t())
    assert not kernel.applies(x.float())
    with kernel.disabled():
        assert not kernel.applies(x) and not kernel.available()


#: Overrides that keep a recipe's ops and shrink their sizes (a fast test).
SMALLER = {"lstm_lm": ["data.seq_len=8", "data.n=64", "model.hidden=32", "model.d_model=16"]}


@needs_kernel
@pytest.mark.parametrize("recipe", ["digits_cnn", "lstm_lm"])
def test_a_recording_is_the_same_bundle_with_and_without_the_kernel(tmp_path, recipe: str) -> None:  # noqa: ANN001
    """The whole record path: every log entry, threshold and commitment the same, byte for byte. The LSTM's
    gates are strided views of one matrix (``unsafe_split``, then ``sigmoid_`` in place on them), which the
    kernel takes through a dense copy where an element is near a midpoint."""
    from detrl.formats import bundle as bundle_mod
    from detrl.run import config as config_mod
    from detrl.run import sessions, tasks

    def record(where):  # noqa: ANN001, ANN202
        cfg = config_mod.load(
            f"configs/supervised/{recipe}.yaml",
            ["train.steps=6", "verify.checkpoint_every=3"] + SMALLER.get(recipe, []),
        )
        session = sessions.session_for(cfg, where, "record", force=True)
        with session:
            tasks.get(cfg.task).run(cfg, session)
        return session

    a = record(tmp_path / "kernel")
    with kernel.disabled():
        b = record(tmp_path / "reference")
    assert a.totals.logged > 0 and a.totals.logged == b.totals.logged
    for name in (bundle_mod.ROUNDLOG, bundle_mod.COMMITMENTS):
        assert (tmp_path / "kernel" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
