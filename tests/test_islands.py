"""Every model a user brings replays: float32 islands computed in FP64 and rounded with the log, half types
rounded to the FP32 grid with the log and then cast, fused attention recorded as its math decomposition, and a
divergence report that blames the op whose inputs differed, not the matmul downstream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from detrl import Divergence
from detrl.core import engine, islands, randomness
from detrl.core.hardware import get_profile, profile_names
from detrl.core.islands import UnroundableResult
from detrl.core.oprules import op_name
from detrl.core.rounding import RoundingMode, Thresholds
from detrl.testing import zoo

EMULATED = [p for p in profile_names() if p.startswith("emulated:")]
#: The models a new user tried: float32 inside (HF's labels= loss, Llama's and Qwen2's RMSNorm and rotary
#: frequencies, an MLP's .float().log_softmax), fused attention (Llama's sdpa, nn.TransformerEncoder), and
#: the control that stayed in FP64 (BERT).
FOUND = [
    "upcast_mlp", "hf_gpt2", "hf_llama_eager", "hf_qwen2_eager", "hf_bert", "hf_llama_sdpa",
    "transformer_encoder",
]  # fmt: skip


def specimen(name: str) -> zoo.Specimen:
    s = zoo.SPECIMENS[name]
    if not zoo.available(s):
        pytest.skip(f"transformers has no {s.needs}")
    return s


def weights(session) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in session.model.named_parameters()}


@pytest.mark.parametrize("name", FOUND)
def test_models_that_upcast_or_use_fused_attention_replicate_on_every_emulated_profile(tmp_path, name):
    s = specimen(name)
    rec = zoo.record(s, tmp_path / "run", steps=2)
    assert rec.step_index == 2  # (several log nothing in two steps: their near elements are exact sums)
    want = weights(rec)
    for hw in EMULATED:
        rep = zoo.replay(s, tmp_path / "run", hw, steps=2)
        assert rep.step_index == 2
        got = weights(rep)
        assert all(torch.equal(got[k], want[k]) for k in want), hw


@pytest.mark.parametrize("name", ["upcast_mlp", "hf_gpt2"])
def test_without_islands_float32_ops_diverge_at_step_1_and_the_report_blames_upstream(
    tmp_path, monkeypatch, name
):
    # The control: float32 ops run natively (what detrl did before) make the honest run diverge, and the
    # first refused entry is far from any midpoint: the report says an op before it produced other bits.
    # Under rounding-rule revision 1, whose logs hold entries for these models' sums (revision 2 finds
    # them exact and logs none: the divergence then has no entry to blame).
    s = specimen(name)
    monkeypatch.setattr(islands, "narrow_dtype", lambda args, kwargs: None)
    monkeypatch.setattr(engine, "RULES_REVISION", 1)
    zoo.record(s, tmp_path / "run", steps=2)
    with pytest.raises(Divergence) as e:
        zoo.replay(s, tmp_path / "run", "emulated:splitk", steps=2)
    assert e.value.step == 1
    a = e.value.decisive
    assert a is not None and a.distance is not None and a.distance > 16
    assert f"an op before #{a.op} produced different bits" in e.value.describe()
    assert "inputs already differed" in e.value.describe()


class HalfMatmul(nn.Module):
    """Casts a hidden layer to a half type and computes in it: a scale and a relu (exact), or a matmul, a
    tanh and a softmax (rounded to the FP32 grid with the log, then cast)."""

    def __init__(self, exact_only: bool, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 8), nn.Linear(8, 5)
        self.exact_only, self.dtype = exact_only, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).to(self.dtype)
        if self.exact_only:  # a scale and a relu in the half type: the same bits on every machine
            return self.out((h * 2).relu().double()).log_softmax(-1)
        h = torch.tanh(h @ h.T).softmax(-1) @ h  # a matmul, a tanh and a softmax in the half type
        assert h.dtype == self.dtype  # computed in FP64, but handed back in the model's own dtype
        return self.out(h.double()).log_softmax(-1)


def _half(exact_only: bool, dtype: torch.dtype = torch.bfloat16) -> zoo.Specimen:
    return zoo.Specimen("half", lambda: HalfMatmul(exact_only, dtype), zoo.features, zoo.nll)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matmuls_and_activations_record_and_replicate_on_every_profile(tmp_path, dtype):
    """An op in a half type is computed on FP64 twins, rounded to the FP32 grid with the log (every machine
    then holds the same FP32 value) and cast to the half type, an IEEE conversion of that agreed value."""
    rec = zoo.record(_half(False, dtype), tmp_path / "run", steps=2)
    want = weights(rec)
    assert rec.totals.refused == 0 and rec.step_index == 2
    for hardware in EMULATED:
        rep = zoo.replay(_half(False, dtype), tmp_path / "run", hardware, steps=2)
        assert all(torch.equal(v, want[k]) for k, v in weights(rep).items()), hardware
        assert rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hardware
    # FP64 twin, FP32 rounding, then the cast: a float16 product is rounded from FP32, not computed natively
    with RoundingMode(get_profile("native"), Thresholds(default=2.0**-20)):
        a = torch.tensor([[1.0 + 2.0**-10, 3.0]], dtype=dtype)
        got = a @ a.T
    exact = a.double() @ a.double().T
    assert got.dtype == dtype and got.item() == exact.float().to(dtype).item()


def test_exact_ops_in_bfloat16_record_and_replicate(tmp_path):
    rec = zoo.record(_half(True), tmp_path / "run", steps=2)
    want = weights(rec)
    rep = zoo.replay(_half(True), tmp_path / "run", "emulated:atomic", steps=2)
    assert all(torch.equal(v, want[k]) for k, v in weights(rep).items())


def test_a_refused_result_names_its_submodule_by_path(tmp_path):
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(16, 8), Spectrum())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x).log_softmax(-1)

    class Spectrum(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.fft.rfft(x).sqrt().real  # a complex root: no rule in detrl/core/complexes.py

    s = zoo.Specimen("spectrum", Wrapper, zoo.features, zoo.nll)
    with pytest.raises(UnroundableResult, match=r"no rule for aten\.sqrt on complex128 values in block\.1: "):
        zoo.record(s, tmp_path / "run", steps=1)


def test_fused_attention_with_dropout_0_is_not_random_and_with_dropout_draws():
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    assert not randomness.draws_now(flash, (q, q, q, 0.0), {})
    assert randomness.draws_now(flash, (q, q, q, 0.1), {})
    assert randomness.handler_for(flash, (q, q, q), {"dropout_p": 0.0}) is None
    with pytest.raises(RuntimeError, match="no switchboard stream"):
        randomness.handler_for(flash, (q, q, q, 0.1), {})


def _attention_ops(model: nn.Module, tmp_path, train: bool) -> list[str]:
    """The logged op names of one step that runs ``model`` (a TransformerEncoder) in eval or training."""
    from detrl.core.engine import Session
    from detrl.core.sources import Sources

    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with Session(tmp_path / ("t" if train else "e"), sources=Sources(), planned_steps=1) as s:
        m = s.init(lambda: model)
        m.train(train)
        with s.step(batch=(x,)) as rounding:
            if train:
                m(x).square().mean().backward()
            else:
                with torch.no_grad():
                    m(x)
        return list(rounding.op_names)


@pytest.mark.parametrize("train", [False, True])
def test_multihead_attention_fast_paths_stay_off_in_verifiable_steps(tmp_path, train):
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    names = _attention_ops(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), tmp_path, train)
    assert "bmm" in names or "mm" in names
    fused = {"_native_multi_head_attention", "_transformer_encoder_layer_fwd",
             "_scaled_dot_product_flash_attention_for_cpu"}  # fmt: skip
    assert not fused & set(names)
    assert torch.backends.mha.get_fastpath_enabled()  # restored after the step


def test_attention_dropout_draws_from_the_dropout_stream_and_replicates(tmp_path):
    class DropEncoder(zoo.Encoder):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    s = zoo.Specimen("drop_encoder", DropEncoder, zoo.tokens, zoo.next_token)
    rec = zoo.record(s, tmp_path / "run", steps=2)
    want = weights(rec)
    rep = zoo.replay(s, tmp_path / "run", "emulated:splitk", steps=2)
    assert all(torch.equal(v, want[k]) for k, v in weights(rep).items())


def test_an_island_widens_positional_dtype_arguments_so_decompositions_apply(tmp_path, monkeypatch):
    """``.float().log_softmax`` backward is ``_log_softmax_backward_data(..., input_dtype=float32)``: with the
    dtype argument widened too, the island runs the op's decomposition (one logged ``exp``, the rest exact),
    as its FP64 twin does, instead of rounding and logging the whole op as a reduction."""
    logged: list[str] = []
    original = RoundingMode._round_logged

    def spy(self, func, x, kind, args, tau):  # noqa: ANN001, ANN202
        logged.append(op_name(func))
        return original(self, func, x, kind, args, tau)

    monkeypatch.setattr(RoundingMode, "_round_logged", spy)
    zoo.record(specimen("upcast_mlp"), tmp_path / "run", steps=1)
    assert "_log_softmax" in logged and "exp" in logged
    assert "_log_softmax_backward_data" not in logged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reading_a_narrow_scalar_needs_no_island(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``.item()`` (``_local_scalar_dense``: torch's optimizers read their float32 step counters so) gives a
    Python number, no tensor to round: it reads the value as it is, without an FP64 twin, in half types too."""
    from detrl.core.rounding import StepRounding

    islands_entered: list[str] = []
    original = RoundingMode._island

    def spy(self, func, *rest):  # noqa: ANN001, ANN002, ANN202
        islands_entered.append(op_name(func))
        return original(self, func, *rest)

    monkeypatch.setattr(RoundingMode, "_island", spy)
    mode = RoundingMode(get_profile("native"), Thresholds(default=2.0**-20))
    t = torch.tensor([1.5, 3.0], dtype=dtype)
    with mode.step_scope(StepRounding()):
        values = t[1].item(), float(t[0])
    assert values == (3.0, 1.5) and islands_entered == []


class InPlaceViews(nn.Module):
    """Reshapes a float32 (or half) mask in place, as Hugging Face's BigBird does with ``unsqueeze_``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc, self.dtype = nn.Linear(16, 5), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(16, dtype=self.dtype) % 3 != 0).to(self.dtype).expand(x.shape[0], 16).clone()
        mask.unsqueeze_(1).transpose_(0, 1).squeeze_(0).t_()  # (N, 16) -> (N, 1, 16) -> (1, N, 16) -> (16, N)
        mask.t_().as_strided_((x.shape[0], 16), (16, 1))  # (N, 16) again
        return self.fc(x * mask).log_softmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_view_ops_on_narrow_tensors_keep_their_new_shape(tmp_path, dtype):
    """``unsqueeze_``, ``transpose_``, ``t_``, ``squeeze_`` and ``as_strided_`` change only a tensor's shape and
    strides: no island (an FP64 twin would take the new shape and leave the original's as it was, and the
    next op failed on the shapes)."""
    s = zoo.Specimen("in_place_views", lambda: InPlaceViews(dtype), zoo.features, zoo.nll)
    want = weights(zoo.record(s, tmp_path / "run", steps=2))
    rep = zoo.replay(s, tmp_path / "run", "emulated:pairwise", steps=2)
    assert all(torch.equal(v, want[k]) for k, v in weights(rep).items())


@pytest.mark.parametrize("kind", ["verifiable", "fp64", "fp32"])
def test_float32_data_a_convolution_refuses_is_explained_in_fp64_runs(tmp_path, kind: str) -> None:
    """torch checks a convolution's dtypes before any dispatch mode sees it, so float32 data that a script
    passes to an FP64 model fails there, with torch's words. In fp64 and verifiable precision the error
    carries a note that says why and how to cast; an error of another kind carries none, and in fp32
    precision the same data simply runs."""
    import detrl

    precision = detrl.Precision(kind)
    with detrl.Session(
        tmp_path / "run", mode="record", precision=precision, sources=detrl.Sources(seed=0)
    ) as s:
        model = s.init(lambda: nn.Sequential(nn.Conv2d(3, 4, 3)))
        x = torch.randn(2, 3, 5, 5)
        if kind == "fp32":
            with s.step(batch=(x,)):
                model(x).sum().backward()
            return
        with pytest.raises(RuntimeError, match="bias type") as raised, s.step(batch=(x,)):
            model(x).sum().backward()
        assert any("session.precision.cast(x)" in note for note in raised.value.__notes__)
        with pytest.raises(RuntimeError, match="unrelated") as other, s.step(batch=(x,)):
            raise RuntimeError("unrelated")
        assert not getattr(other.value, "__notes__", [])
        with s.step(batch=(x,)):
            model(s.precision.cast(x)).sum().backward()
