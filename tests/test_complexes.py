"""Complex tensors in verifiable precision (detrl/core/complexes.py): the ops written out as real ops give
torch's complex results, and models that rotate by complex numbers or mix by FFTs record and replay."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.core import complexes
from detrl.core.engine import Session
from detrl.core.sources import Sources
from detrl.testing import zoo

aten = torch.ops.aten


def _real(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _complex(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.complex(_real(*shape, seed=seed), _real(*shape, seed=seed + 1))


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 4, 5, 7, 9, 18, 32, 40, 48]), min_size=1, max_size=3),
    norm=st.sampled_from([0, 1, 2]),
    data=st.data(),
)
def test_written_out_ffts_give_torchs_transforms(shape: list[int], norm: int, data: st.DataObject) -> None:
    """Each transform as a DFT of real products: torch's ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r`` on any
    dims, normalisation, onesided or full, odd and even lengths, outputs longer or shorter than the
    spectrum."""
    dims = data.draw(
        st.lists(st.sampled_from(range(len(shape))), min_size=1, max_size=len(shape), unique=True)
    )
    x, z = _real(*shape), _complex(*shape)
    onesided, forward = data.draw(st.booleans()), data.draw(st.booleans())
    _same(complexes.fft_r2c(x, dims, norm, onesided), aten._fft_r2c(x, dims, norm, onesided))
    _same(complexes.fft_c2c(z, dims, norm, forward), aten._fft_c2c(z, dims, norm, forward))
    last = data.draw(st.integers(1, 2 * shape[dims[-1]]))  # the output's length
    # the spectrum onesided along the last dim, or the full one
    spectrum = _complex(*(last // 2 + 1 if d == dims[-1] else n for d, n in enumerate(shape)))
    full = _complex(*(last if d == dims[-1] else n for d, n in enumerate(shape)))
    for z in (spectrum, full):
        _same(complexes.fft_c2r(z, dims, norm, last), aten._fft_c2r(z, dims, norm, last))


@pytest.mark.parametrize(
    ("name", "written", "want"),
    [
        ("polar", lambda a, b, z, w: complexes.polar(a.abs(), b), lambda a, b, z, w: torch.polar(a.abs(), b)),
        ("complex", lambda a, b, z, w: complexes.complex_(a, b), lambda a, b, z, w: torch.complex(a, b)),
        ("multiply", lambda a, b, z, w: complexes.mul(z, w), lambda a, b, z, w: z * w),
        ("multiply by real", lambda a, b, z, w: complexes.mul(z, b), lambda a, b, z, w: z * b),
        ("real multiplied", lambda a, b, z, w: complexes.mul(a, w), lambda a, b, z, w: a * w),
        ("multiply by a number", lambda a, b, z, w: complexes.mul(a, 0.5j), lambda a, b, z, w: a * 0.5j),
        ("divide", lambda a, b, z, w: complexes.div(z, w), lambda a, b, z, w: z / w),
        ("divide by real", lambda a, b, z, w: complexes.div(z, b), lambda a, b, z, w: z / b),
        ("real divided", lambda a, b, z, w: complexes.div(a, w), lambda a, b, z, w: a / w),
        ("reciprocal", lambda a, b, z, w: complexes.reciprocal(z), lambda a, b, z, w: z.reciprocal()),
        ("abs", lambda a, b, z, w: complexes.abs_(z), lambda a, b, z, w: z.abs()),
        ("sgn", lambda a, b, z, w: complexes.sgn(z * (a > 0)), lambda a, b, z, w: (z * (a > 0)).sgn()),
        ("exp", lambda a, b, z, w: complexes.exp(z), lambda a, b, z, w: z.exp()),
        ("sum", lambda a, b, z, w: complexes.sum_(z, [-1], True), lambda a, b, z, w: z.sum(-1, keepdim=True)),
        (
            "sum of a conjugate",
            lambda a, b, z, w: complexes.sum_(z.conj()),
            lambda a, b, z, w: z.conj().sum(),
        ),
        ("mean", lambda a, b, z, w: complexes.mean(z, [0]), lambda a, b, z, w: z.mean(0)),
        ("mm", lambda a, b, z, w: complexes.mm(z, w.mT), lambda a, b, z, w: z @ w.mT),
        ("mm by real", lambda a, b, z, w: complexes.mm(z, b.mT), lambda a, b, z, w: z @ b.mT.to(z.dtype)),
        ("real mm", lambda a, b, z, w: complexes.mm(a, w.mT), lambda a, b, z, w: a.to(w.dtype) @ w.mT),
        (
            "bmm",
            lambda a, b, z, w: complexes.bmm(z[None], w.mT[None]),
            lambda a, b, z, w: z[None] @ w.mT[None],
        ),
    ],
)
def test_written_out_ops_give_torchs_complex_results(name: str, written, want) -> None:  # noqa: ANN001
    a, b, z, w = _real(4, 6, seed=0), _real(4, 6, seed=2), _complex(4, 6, seed=4), _complex(4, 6, seed=6)
    _same(written(a, b, z, w), want(a, b, z, w))


def test_an_odd_length_takes_its_outputs_in_blocks_of_a_bounded_table(monkeypatch) -> None:
    """A long odd length would need a table of ``4 n^2`` twiddles: its outputs come in blocks instead, the
    same transform."""
    z = _complex(3, 45)
    want = aten._fft_c2c(z, [1], 0, True)
    monkeypatch.setattr(complexes, "TABLE_ENTRIES", 4 * 45 * 4)  # four outputs a block
    _same(complexes.fft_c2c(z, [1], 0, True), want)


def test_twiddles_are_exact_at_quarter_turns_and_fold_symmetrically() -> None:
    """``cos(pi / 2)`` in floating point is ``6e-17``: the table takes 0, 1 and -1 where they are exact, and
    the angles past a half turn fold back, so ``sin`` is odd and ``cos`` even to the bit."""
    j, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    cos, sin = complexes._twiddles(8, j, k, 1.0, torch.zeros(1, dtype=torch.float64))
    r = j * k % 8
    for turn, (c, s) in enumerate([(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0)]):
        assert (cos[r == 2 * turn] == c).all() and (sin[r == 2 * turn] == s).all()
    assert torch.equal(cos[:, 1:], cos[:, 1:].flip(1)) and torch.equal(sin[:, 1:], -sin[:, 1:].flip(1))


def test_complex64_ops_keep_their_dtype_and_round_their_parts(tmp_path) -> None:
    """complex64 is a narrow type: computed on complex128 twins, rounded part by part, cast back; the dtypes
    a step sees are torch's own."""
    session = Session(tmp_path / "run", mode="record", sources=Sources(), planned_steps=1, checkpoint_every=0)
    seen = {}
    with session:
        model = session.init(lambda: torch.nn.Linear(8, 8))
        x = _real(3, 8)
        with session.step(batch=(x,)):
            h = model(x)  # FP64, on the FP32 grid
            z = torch.view_as_complex(h.float().reshape(3, 4, 2))  # complex64
            turned = z * torch.polar(torch.ones(4), torch.arange(4.0))  # complex64 * complex64
            spectrum = torch.fft.fft(turned)
            seen = {"turned": turned.dtype, "spectrum": spectrum.dtype}
            parts = torch.view_as_real(spectrum)
            assert torch.equal(parts.double().float().double(), parts.double())  # on the FP32 grid
            torch.view_as_real(spectrum).sum().backward()
    assert seen == {"turned": torch.complex64, "spectrum": torch.complex64}


def test_a_model_rotating_and_mixing_by_complex_numbers_replays(tmp_path) -> None:
    """Meta Llama's complex rotary embedding, FNet's ``fft2`` mixing and an ``rfft``/``irfft`` filter
    (:class:`detrl.testing.zoo.RotaryFourier`): recorded, then replayed under a reordering profile with
    nothing unlogged and the same weights. (Every such model was refused before: an FFT's sums are ordered
    differently by every library.)"""
    specimen = zoo.SPECIMENS["rotary_fourier"]
    rec = zoo.record(specimen, tmp_path / "run", steps=2)
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    assert rec.totals.logged > 0  # the transforms' sums cancel: near elements, logged
    rep = zoo.replay(specimen, tmp_path / "run", "emulated:atomic", steps=2)
    assert rep.totals.unlogged_near == 0 and rep.totals.refused == 0
    assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters())


@pytest.mark.parametrize("route", [True, False])
def test_real_tensors_times_a_complex_number_record_on_the_route_and_in_the_mode(
    tmp_path, route: bool
) -> None:
    """``x * 0.5j`` has a complex result from a real tensor: no complex tensor among its arguments, so the
    mode sees it only by its result, and runs it again as a written-out product; the native route hands
    it over for the complex number. Both write the same bundle."""
    from detrl.core import native
    from detrl.formats import bundle

    def record(where: str) -> bytes:
        session = Session(
            tmp_path / where, mode="record", sources=Sources(), planned_steps=1, checkpoint_every=0
        )
        with native.switched(route if where == "first" else not route), session:
            model = session.init(lambda: torch.nn.Linear(8, 8))
            x = _real(3, 8)
            with session.step(batch=(x,)):
                z = torch.ops.aten.mul.Scalar(model(x), 0.5j) + torch.polar(torch.ones(8), torch.arange(8.0))
                torch.view_as_real(z).square().sum().backward()
        return (tmp_path / where / bundle.COMMITMENTS).read_bytes()

    assert record("first") == record("second")
