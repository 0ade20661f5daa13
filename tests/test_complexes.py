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
        ("mv", lambda a, b, z, w: complexes.mv(z, w[0]), lambda a, b, z, w: z @ w[0]),
        ("dot", lambda a, b, z, w: complexes.dot(z[0], w[1]), lambda a, b, z, w: torch.dot(z[0], w[1])),
        ("vdot", lambda a, b, z, w: complexes.vdot(z[0], w[1]), lambda a, b, z, w: torch.vdot(z[0], w[1])),
        (
            "addmm",
            lambda a, b, z, w: complexes.addmm(z[0, :4], w, z.mT),
            lambda a, b, z, w: torch.addmm(z[0, :4], w, z.mT),
        ),
        (
            "addmm, real bias, beta and alpha",
            lambda a, b, z, w: complexes.addmm(a[:, 0], w, z.mT, beta=0.5, alpha=2),
            lambda a, b, z, w: torch.addmm(a[:, 0].to(w.dtype), w, z.mT, beta=0.5, alpha=2),
        ),
        (
            "addmv, beta 0 reads no NaN",
            lambda a, b, z, w: complexes.addmv(z[:, 0] * torch.nan, z, w[0], beta=0),
            lambda a, b, z, w: torch.addmv(z[:, 0] * torch.nan, z, w[0], beta=0),
        ),
        (
            "baddbmm",
            lambda a, b, z, w: complexes.baddbmm(z[None, :, :4], z[None], w.mT[None], alpha=-1),
            lambda a, b, z, w: torch.baddbmm(z[None, :, :4], z[None], w.mT[None], alpha=-1),
        ),
        (
            "addbmm",
            lambda a, b, z, w: complexes.addbmm(z[:, :4], torch.stack([z, w]), torch.stack([w.mT, z.mT])),
            lambda a, b, z, w: torch.addbmm(z[:, :4], torch.stack([z, w]), torch.stack([w.mT, z.mT])),
        ),
        ("angle", lambda a, b, z, w: complexes.angle(z), lambda a, b, z, w: z.angle()),
        ("log", lambda a, b, z, w: complexes.log(z), lambda a, b, z, w: z.log()),
        (
            "vector norms",
            lambda a, b, z, w: torch.stack([complexes.vector_norm(z, o, [1]) for o in (2, 1, 3, torch.inf)]),
            lambda a, b, z, w: torch.stack(
                [torch.linalg.vector_norm(z, o, [1]) for o in (2, 1, 3, torch.inf)]
            ),
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


# ----------------------------------------------------------------------------------- complex parameters
class _Gains(torch.nn.Module):
    """A linear layer, then a learned complex gain per frequency (a ``cfloat`` parameter, as Fourier neural
    operators declare their weights) between ``rfft`` and ``irfft``; ``built`` keeps the gain as built."""

    built: torch.Tensor | None = None

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.gain = torch.nn.Parameter(torch.randn(5, dtype=torch.cfloat) / 2 + 1)  # (8 // 2 + 1,)
        _Gains.built = self.gain.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B, 8)
        return torch.fft.irfft(torch.fft.rfft(self.fc(x)) * self.gain, n=8)


def _train_gains(session: Session, steps: int, stop_after: int | None = None) -> torch.nn.Module:
    """SGD with momentum and weight decay (``add_(..., alpha=-lr)`` on complex tensors) on a fixed set."""
    model = session.init(_Gains)
    opt = session.track(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    loader = session.loader((x, x.roll(1, 1)), batch_size=16, steps=steps)
    session.restore()
    for batch in loader:
        with session.step():
            torch.nn.functional.mse_loss(model(batch.x), batch.y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if session.step_index == stop_after:
            session.stop_requested = True
            break
    return model


@pytest.mark.parametrize(
    "precision, dtype",
    [("fp32", torch.complex64), ("fp64", torch.complex128), ("verifiable", torch.complex128)],
)
def test_complex_parameters_keep_their_imaginary_parts_at_init(precision: str, dtype: torch.dtype) -> None:
    """``Session.init`` puts weights on the FP32 grid: a complex one becomes complex64 (``Module.to(float32)``
    would drop its imaginary part), then the precision's complex dtype."""
    session = Session(None, mode="off", precision=precision, sources=Sources())
    with session:
        model = session.init(_Gains)
    assert model.gain.dtype == dtype and model.fc.weight.dtype == session.precision.dtype
    assert _Gains.built is not None and _Gains.built.imag.abs().min() > 0
    assert torch.equal(model.gain.detach(), _Gains.built.to(dtype))


def test_sgd_on_complex_weights_records_replays_and_resumes(tmp_path) -> None:
    """SGD's ``p.add_(g, alpha=-lr)``, momentum and weight decay on complex weights are written out step by
    step, as for real ones: the weights stay on the FP32 grid, the run replays under a reordering profile to
    the same weights, its checkpoints hold the complex state (as real pairs), and a run stopped and resumed
    from one writes the uninterrupted run's commitments and log."""
    from detrl.formats import bundle

    steps = 4
    with Session(tmp_path / "whole", sources=Sources(seed=0), planned_steps=steps, checkpoint_every=1) as s:
        model = _train_gains(s, steps)
    parts = torch.view_as_real(model.gain.detach())
    assert model.gain.dtype == torch.complex128 and torch.equal(parts.float().double(), parts)
    assert not torch.equal(model.gain.detach(), _Gains.built.to(torch.complex128))  # it trained
    with Session(tmp_path / "whole", mode="replay", hardware="emulated:atomic") as r:
        replayed = _train_gains(r, steps)
    assert r.totals.unlogged_near == 0 and r.totals.refused == 0
    assert torch.equal(replayed.gain, model.gain) and torch.equal(replayed.fc.weight, model.fc.weight)

    with Session(tmp_path / "resumed", sources=Sources(seed=0), planned_steps=steps, checkpoint_every=1) as s:
        _train_gains(s, steps, stop_after=2)
    with Session(tmp_path / "resumed", mode="record", resume=True, planned_steps=steps) as s:
        _train_gains(s, steps)
    for name in (bundle.COMMITMENTS, bundle.ROUNDLOG):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name


def test_checkpoints_store_complex_tensors_as_real_pairs_and_check_the_list() -> None:
    """safetensors has no complex128: a checkpoint stores a complex tensor as its real view and lists its
    name in the metadata. A list that names a missing tensor, or one that is not real pairs, is refused."""
    import json

    from safetensors.torch import save

    from detrl.formats.bundle import COMPLEX_KEY, BundleError, Caps, decode_checkpoint, encode_checkpoint

    tensors = {"a": _complex(3, 2), "b": _complex(4).to(torch.complex64), "c": _real(5)}
    got, meta = decode_checkpoint(encode_checkpoint(tensors, {"step": 1}), "ckpt", Caps())
    assert meta == {"step": 1}
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in tensors.items())
    assert encode_checkpoint({"c": _real(5)}, {"step": 1}) == save(
        {"c": _real(5)}, metadata={"detrl": '{"step":1}'}
    )  # a real checkpoint is what it was

    def bad(names: object, stored: dict[str, torch.Tensor]) -> str:
        data = save(stored, metadata={"detrl": json.dumps({"step": 1, COMPLEX_KEY: names})})
        with pytest.raises(BundleError) as e:
            decode_checkpoint(data, "ckpt", Caps())
        return str(e.value)

    assert "not a list of tensor names" in bad("a", {"a": _real(3, 2)})
    assert "'z' is named complex" in bad(["z"], {"a": _real(3, 2)})
    assert "'a' is named complex" in bad(["a"], {"a": _real(3, 3)})
    assert "'a' is named complex" in bad(["a"], {"a": torch.zeros(3, 2, dtype=torch.int64)})
    assert "'a' is named complex" in bad(["a", "a"], {"a": _real(3, 2)})


def test_complex_weights_export_as_complex64_and_load_back(tmp_path) -> None:
    """``export_safetensors`` writes a complex weight as complex64 (its values on the FP32 grid), and
    ``model.init_from`` loads it back into a fresh model; a real tensor for a complex weight is refused."""
    from safetensors.torch import load_file, save_file

    from detrl.supervised.weights import export_safetensors, load_init

    with Session(tmp_path / "run", sources=Sources(seed=0), planned_steps=2, checkpoint_every=1) as s:
        model = _train_gains(s, 2)
    export_safetensors(tmp_path / "run", tmp_path / "w.safetensors")
    exported = load_file(tmp_path / "w.safetensors")
    assert exported["gain"].dtype == torch.complex64
    assert torch.equal(exported["gain"].to(torch.complex128), model.gain.detach())
    fresh = _Gains()
    load_init(fresh, tmp_path / "w.safetensors")
    assert torch.equal(fresh.gain.detach(), exported["gain"])
    real = torch.view_as_real(exported["gain"])[..., 0].contiguous()
    save_file({**exported, "gain": real}, tmp_path / "r.st")
    with pytest.raises(ValueError, match=r"gain has dtype torch.float32, the model's torch.complex64"):
        load_init(_Gains(), tmp_path / "r.st")


def test_a_bitflip_on_a_complex_weight_moves_its_real_part_one_float() -> None:
    from detrl.core.sources import Sources as Switchboard

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.cfloat))
    before = module.w.detach().clone()
    where = Switchboard(bitflip=True).apply_bitflip(module)
    changed = (module.w.detach() != before).nonzero()
    assert where is not None and len(changed) == 1
    i = tuple(changed[0])
    assert where == f"w[{int(i[0]) * 4 + int(i[1])}]"
    assert module.w[i].imag == before[i].imag
    assert module.w[i].real == torch.nextafter(before[i].real, torch.tensor(float("inf")))


class _ComplexValued(torch.nn.Module):
    """A complex-valued network: ``nn.Linear`` layers with complex weights (``addmm``), a modReLU (a learned
    bias on the magnitude, the phase kept), and the magnitude and phase (``angle``) as features."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(16, 16, dtype=torch.cfloat)
        self.l2 = torch.nn.Linear(16, 4, dtype=torch.cfloat)
        self.bias = torch.nn.Parameter(torch.zeros(16))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 3)
        z = self.l1(torch.fft.fft(x))  # (B, 16) complex
        size = z.abs()
        z = self.l2(torch.relu(size + self.bias) * (z / (size + 1e-6)))  # (B, 4)
        return self.head(torch.cat([z.abs().log1p(), z.angle()], -1))


def test_a_complex_valued_network_replays(tmp_path) -> None:
    """Complex weights in ``nn.Linear`` (``addmm`` and its backward's products on complex values),
    magnitudes and phases: recorded, then replayed under a reordering profile to the same weights."""
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0, 1, 2, 0, 1, 2])

    def run(session: Session) -> torch.nn.Module:
        with session:
            model = session.init(_ComplexValued)
            opt = session.track(torch.optim.AdamW(model.parameters(), lr=1e-2))
            for _ in range(3):
                with session.step(batch=(x, y)):
                    torch.nn.functional.cross_entropy(model(session.precision.cast(x)), y).backward()
                    opt.step()
                    opt.zero_grad()
        return model

    model = run(Session(tmp_path / "run", sources=Sources(), planned_steps=3, checkpoint_every=0))
    assert model.l1.weight.dtype == torch.complex128
    replay = Session(tmp_path / "run", mode="replay", hardware="emulated:atomic")
    replayed = run(replay)
    assert replay.totals.unlogged_near == 0 and replay.totals.refused == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), replayed.parameters()))


@pytest.mark.parametrize(
    ("name", "written", "want"),
    [
        ("sum of a 0-d tensor", lambda z: complexes.sum_(z[0, 0]), lambda z: z[0, 0].sum()),
        ("mean of a 0-d tensor", lambda z: complexes.mean(z[0, 0], []), lambda z: z[0, 0].mean([])),
        ("cumsum", lambda z: complexes.WRITTEN[aten.cumsum.default](z, 1), lambda z: z.cumsum(1)),
        ("trace", lambda z: complexes.WRITTEN[aten.trace.default](z[:, :4]), lambda z: z[:, :4].trace()),
        (
            "index_add with a real source",
            lambda z: complexes.WRITTEN[aten.index_add.default](
                z, 0, torch.tensor([1, 1]), z.real[:2], alpha=2
            ),
            lambda z: z.index_add(0, torch.tensor([1, 1]), z.real[:2].to(z.dtype), alpha=2),
        ),
        (
            "scatter_add",
            lambda z: complexes.WRITTEN[aten.scatter_add.default](
                z, 1, torch.zeros(4, 6, dtype=torch.long), z
            ),
            lambda z: z.scatter_add(1, torch.zeros(4, 6, dtype=torch.long), z),
        ),
        (
            "index_put, accumulating",
            lambda z: complexes.WRITTEN[aten.index_put.default](z, [torch.tensor([0, 0, 2])], z[:3], True),
            lambda z: z.index_put([torch.tensor([0, 0, 2])], z[:3], accumulate=True),
        ),
        (
            "addr",
            lambda z: complexes.addr(z[:, :4], z[:, 0], z[0, :4], beta=2),
            lambda z: torch.addr(z[:, :4], z[:, 0], z[0, :4], beta=2),
        ),
        (
            "integer powers",
            lambda z: torch.stack([complexes.pow_(z, n) for n in (0, 1, 2, 3, 5, -1, -2, 2.0)]),
            lambda z: torch.stack([z**n for n in (0, 1, 2, 3, 5, -1, -2, 2.0)]),
        ),
    ],
)
def test_ops_taken_part_by_part_give_torchs_complex_results(name: str, written, want) -> None:  # noqa: ANN001
    z = _complex(4, 6, seed=8)
    _same(written(z), want(z))


def test_a_power_with_no_rule_is_refused_in_one_line_and_integer_powers_record(tmp_path) -> None:
    """``z ** 2`` (and every integer power) is a fixed sequence of written products; ``z ** 0.5`` has no rule
    and is refused, naming the op, as an op with no rule at all is."""
    from detrl.core.islands import UnroundableResult

    session = Session(tmp_path / "run", sources=Sources(), planned_steps=2, checkpoint_every=0)
    with session:
        model = session.init(lambda: torch.nn.Linear(4, 8))
        with session.step(batch=()):
            z = torch.view_as_complex(model(torch.ones(3, 4, dtype=torch.float64)).view(3, 4, 2))
            parts = torch.view_as_real((z**2 + z**-1).cumsum(1))
            assert torch.equal(parts, parts.float().double())  # on the FP32 grid
            parts.sum().backward()
        refused = pytest.raises(UnroundableResult, match=r"no rule for aten\.pow on complex128 values")
        with refused, session.step(batch=()):
            z = torch.view_as_complex(model(torch.ones(3, 4, dtype=torch.float64)).view(3, 4, 2))
            z**0.5
