"""Acceptance: verifiable runs replicate bit for bit on every profile; plain FP32 runs do not; and what the
log does, as measured: the replays need corrections, and which models diverge without their log."""

import functools
import math
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detrl import Divergence, Session, Sources
from detrl.run.config import apply_overrides, validate
from detrl.supervised.data import synthetic_text
from detrl.supervised.models import LSTMLM
from detrl.supervised.train import fingerprint, run
from detrl.testing.logrewrite import strip_log

PROFILES = ["emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"]
MODELS = {
    "cnn_bn": {"data": {"name": "digits"}, "model": {"name": "cnn_bn", "channels": 8}},
    "mlp_dropout": {
        "data": {"name": "digits"},
        "model": {"name": "mlp_dropout", "hidden": 128, "dropout": 0.2},
    },
    "tiny_transformer": {
        "data": {"name": "synthetic_text", "seq_len": 16, "n": 256, "vocab": 32},
        "model": {"name": "tiny_transformer", "d_model": 32, "heads": 2, "layers": 1, "dropout": 0.1},
    },
}
OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "adamw": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01},
}


def config(
    model: str, opt: str, precision: str = "verifiable", steps: int = 30, overrides: Sequence[str] = ()
):
    """The config of recipe ``model`` of MODELS with optimizer ``opt``; ``overrides`` in ``--set``'s form
    (``model.channels=32``)."""
    return validate(apply_overrides({
        "name": f"{model}-{opt}", "precision": precision, **MODELS[model],
        "optimizer": OPTIMIZERS[opt], "train": {"steps": steps, "batch_size": 16},
        "verify": {"checkpoint_every": 10},
    }, list(overrides)))  # fmt: skip


def record(cfg, run_dir, hardware="native"):
    with Session(
        run_dir,
        mode="record",
        precision=cfg.precision,
        sources=Sources.from_config(cfg.sources),
        hardware=hardware,
        config=cfg.model_dump(mode="json"),
        data_fingerprint=fingerprint(cfg),
    ) as s:
        run(cfg, s)
    return s


def replay(cfg, run_dir, hardware):
    with Session(run_dir, mode="replay", hardware=hardware) as s:
        run(cfg, s)
        s.verify_checkpoints()
    return s


FAST = {("cnn_bn", "sgd")}
MATRIX = [
    pytest.param(m, o, marks=() if (m, o) in FAST else pytest.mark.slow) for m in MODELS for o in OPTIMIZERS
]


@pytest.mark.parametrize(("model", "opt"), MATRIX)
def test_verifiable_run_replicates_on_every_profile(tmp_path, model, opt):
    cfg = config(model, opt)
    rec = record(cfg, tmp_path / "run")
    assert rec.totals.logged > 0  # the log is exercised
    params = {n: p.detach().clone() for n, p in rec.model.named_parameters()}
    for p in params.values():  # the delivered model converts to FP32 without loss
        assert torch.equal(p.float().double(), p)
    for hw in PROFILES:
        rep = replay(cfg, tmp_path / "run", hw)
        assert rep.step_index == 30
        for n, p in rep.model.named_parameters():
            assert torch.equal(p, params[n]), (hw, n)


@pytest.mark.parametrize("model", list(MODELS))
def test_plain_fp32_diverges_across_profiles_in_the_first_step(tmp_path, model):
    cfg = config(model, "sgd", precision="fp32", steps=3)
    record(cfg, tmp_path / "run")
    replay(cfg, tmp_path / "run", "native")  # same profile: bitwise equal
    for hw in PROFILES:
        with pytest.raises(Divergence) as e:  # noqa: PT012
            replay(cfg, tmp_path / "run", hw)
            pytest.fail(f"plain FP32 replicated on {hw}")
        assert e.value.step == 1, hw


def test_profiles_bite_in_fp64_without_rounding(tmp_path):
    # Plain FP64 also differs across profiles (by a few ulps): rounding, not FP64 alone, gives agreement.
    cfg = config("cnn_bn", "sgd", precision="fp64", steps=2)
    record(cfg, tmp_path / "run")
    with pytest.raises(Divergence) as e:
        replay(cfg, tmp_path / "run", "emulated:splitk")
    assert e.value.step == 1


def test_thread_count_changes_fp32_bits_but_not_verifiable_ones(tmp_path):
    import json

    from detrl.cli import main

    roots = {}
    for precision in ("fp32", "verifiable"):
        for threads in (1, 2):
            out = tmp_path / f"{precision}-{threads}"
            args = ["train", "configs/supervised/digits_cnn.yaml", "--out", str(out), "--quiet", "--no-tensorboard",
                    "--set", f"threads={threads}", "--set", f"precision={precision}", "--set", "train.steps=5"]  # fmt: skip
            assert main(args) == 0
            roots[precision, threads] = json.loads((out / "manifest.json").read_text())["durable"][
                "merkle_root"
            ]
    assert roots["verifiable", 1] == roots["verifiable", 2]
    # oneDNN's FP32 convolutions on this CPU split work by thread count
    assert roots["fp32", 1] != roots["fp32", 2]


@pytest.mark.slow
def test_resnet50_step_replicates_on_other_profiles(tmp_path):
    # A ResNet-50 step has results of heavy cancellation that a direction bit cannot name (pinned
    # values): before they existed, this replay diverged at step 1 on pairwise and atomic.
    cfg = validate({
        "name": "resnet50", "precision": "verifiable", "data": {"name": "synthetic_images", "n": 16},
        "model": {"name": "resnet50"}, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train": {"steps": 1, "batch_size": 8}, "verify": {"checkpoint_every": 0},
    })  # fmt: skip
    rec = record(cfg, tmp_path / "run")
    assert rec.totals.logged > 0
    for hw in ("emulated:pairwise", "emulated:atomic"):
        rep = replay(cfg, tmp_path / "run", hw)
        assert rep.step_index == 1 and rep.totals.unlogged_near == 0, hw


# ------------------------------------------------------------------------ script models (no task config)


class TiedLM(nn.Module):
    """Token and position embeddings, one causal self-attention without projections (a softmax), a GELU
    layer and a final layer norm, read out through the token embedding itself (tied, as GPT-2's head is):
    tokens ``(N, T)`` -> logits ``(N, T, vocab)``."""

    def __init__(self, vocab: int = 32, d: int = 32, seq_len: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.mix = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        att = (x @ x.transpose(1, 2) * (1 / math.sqrt(x.shape[-1]))).masked_fill(~causal, float("-inf"))
        x = x + att.softmax(-1) @ x
        return F.linear(self.ln(x + F.gelu(self.mix(x))), self.tok.weight)


#: The character LSTM is the recipe model at one layer of 64 units (tokens (N, T) -> logits (N, T, vocab)).
SCRIPTS = {
    "lstm_lm": functools.partial(LSTMLM, vocab=32, d_model=32, hidden=64, layers=1),
    "tied_embedding": TiedLM,
}


def script(session: Session, model: str, steps: int, overrides: Sequence[str] = ()) -> None:
    """Train script model ``model`` on the synthetic bigram text for ``steps`` AdamW steps in ``session``;
    ``overrides`` set its constructor's arguments (``model.d=128``) and ``train.batch_size`` (16)."""
    settings = apply_overrides({"model": {}, "train": {"batch_size": 16}}, list(overrides))
    tokens = synthetic_text(vocab=32, seq_len=16, n=256)
    net = session.init(functools.partial(SCRIPTS[model], **settings["model"]))
    opt = session.track(torch.optim.AdamW(net.parameters(), lr=0.01))
    for batch in session.loader(tokens, batch_size=settings["train"]["batch_size"], steps=steps):
        with session.step():
            logits = net(batch.x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def record_any(model: str, run_dir, steps: int, overrides: Sequence[str] = ()) -> Session:
    """Record ``model`` (a recipe of MODELS, or a script of SCRIPTS) for ``steps`` steps on native."""
    if model in MODELS:
        return record(config(model, "sgd", steps=steps, overrides=overrides), run_dir)
    with Session(run_dir, mode="record", precision="verifiable", sources=Sources(seed=0)) as s:
        script(s, model, steps, overrides)
    return s


def replay_any(model: str, run_dir, hardware: str, steps: int, overrides: Sequence[str] = ()) -> Session:
    if model in MODELS:
        return replay(config(model, "sgd", steps=steps, overrides=overrides), run_dir, hardware)
    with Session(run_dir, mode="replay", hardware=hardware) as s:
        script(s, model, steps, overrides)
    return s


@pytest.mark.parametrize(
    ("model", "steps"),
    [pytest.param("tied_embedding", 10), pytest.param("lstm_lm", 30, marks=pytest.mark.slow)],
)
def test_script_models_replicate_on_every_profile(tmp_path, model, steps):
    rec = record_any(model, tmp_path / "run", steps)
    assert rec.totals.logged > 0
    params = {n: p.detach().clone() for n, p in rec.model.named_parameters()}
    for hw in PROFILES:
        rep = replay_any(model, tmp_path / "run", hw, steps)
        assert rep.step_index == steps and rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        for n, p in rep.model.named_parameters():
            assert torch.equal(p, params[n]), (hw, n)


# ----------------------------------------------------------------------------------- the log matters

#: Every model of these tests at a size where a profile's replay needs the log, as measured on this CPU:
#: (model, overrides, steps, profile, the step at which the log-emptied bundle diverges there). The replay
#: moves an FP32 rounding the state reads only where its FP64 result and the recorder's fall on two sides
#: of a midpoint. They differ by an FP64 ulp or a few, so that takes many rounded results, from 2.6e6
#: (the tied-embedding model at width 128) to 6e9 (the MLP) as measured: hundreds to thousands of steps at
#: the fast tests' sizes (below), fewer once a model is wider or sees larger batches. The runs and
#: these profiles are deterministic, so the step is exact. (``emulated:atomic`` draws fresh orders.)
NEEDS_LOG = [
    pytest.param("cnn_bn", ("model.channels=32", "train.batch_size=64"), 10, "emulated:pairwise", 8),
    pytest.param("tied_embedding", ("model.d=128",), 4, "emulated:splitk", 3),
    pytest.param(
        "tiny_transformer",
        ("model.d_model=128", "model.heads=4", "data.seq_len=64", "train.batch_size=32"),
        16,
        "emulated:pairwise",
        14,
        marks=pytest.mark.slow,
    ),
    # one element corrected, at step 142 (splitk corrects none in 200 steps); about 70 s on this CPU
    pytest.param("lstm_lm", (), 150, "emulated:pairwise", 142, marks=pytest.mark.slow),
    # the last to need it, after 6e9 rounded results (its first 100 steps correct 4 pinned values near 0
    # in fc2, which the state never reads); about 8 minutes on this CPU
    pytest.param(
        "mlp_dropout",
        ("model.hidden=1024", "train.batch_size=512"),
        611,
        "emulated:pairwise",
        611,
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("model", "overrides", "steps", "hardware", "diverges_here"), NEEDS_LOG)
def test_every_model_needs_its_log_once_it_is_large_enough(
    tmp_path, model, overrides, steps, hardware, diverges_here
):
    """The replay on ``hardware`` replicates bit for bit with the log, on any machine; and where the same
    bundle with its log emptied diverges, the log had corrected the replay (no divergence without a
    rounding the log would have fixed).

    Whether and where the log-emptied bundle diverges depends on the machine's FP64 results (a rounding
    moves only where two machines straddle an FP32 midpoint): ``diverges_here`` is the step measured on
    the project's Intel Xeon, where every case diverges; on an AMD EPYC the MLP did not by step 611. So
    the step is a figure, not an assertion: ``detrl bench nolog`` measures it on the machine at hand."""
    record_any(model, tmp_path / "run", steps, overrides)
    rep = replay_any(model, tmp_path / "run", hardware, steps, overrides)
    assert rep.step_index == steps
    assert rep.totals.unlogged_near == 0 and rep.totals.refused == 0
    strip_log(tmp_path / "run", tmp_path / "nolog")
    try:
        emptied = replay_any(model, tmp_path / "nolog", hardware, steps, overrides)
    except Divergence as e:
        assert 1 <= e.step <= steps
        assert rep.totals.corrected > 0, f"diverged at step {e.step} without the log, which corrected nothing"
    else:
        assert emptied.step_index == steps


#: (model, steps, profiles to try in order): what the log does at the fast tests' sizes.
#: Until layer norm was decomposed (detrl/core/decompose.py), its native Welford mean carried an ulp of error
#: where the profiles' two-pass mean of FP32-grid rows was exact, at exact FP32 ties: the tiny transformer
#: and the tied-embedding model needed hundreds of corrections in 30 steps and, emptied of their logs,
#: diverged at step 1 or 2 on every profile. Now every machine computes layer norm from the same (logged, or
#: provably exact) row sums. Measured on this project's CPU since: the tiny transformer (the recipe of
#: MODELS, sgd) needs no correction in 30 steps on any profile; GPT-2 tiny (``detrl bench replication
#: --models gpt2_tiny --quality-models ''``, 10 steps) none either, and replicates without its log where it
#: diverged before; the tied-embedding model 19-26 corrections in 30 steps from step 1 on every profile,
#: in ``_log_softmax`` (log-probabilities near 0, read only by the loss value) and, on pairwise, GELU (its
#: libm), and its log-emptied bundle replicates. At these sizes no model needs its log within the fast
#: tests' steps; at the sizes of NEEDS_LOG each one does.
LOG_CORRECTS = [
    pytest.param("tied_embedding", 3, ["emulated:reversed", "emulated:atomic", "emulated:splitk"]),
]


def _replay_until_corrected(model: str, run_dir, steps: int, profiles: list[str]) -> tuple[str, Session]:
    """The first of ``profiles`` whose replay of ``run_dir`` corrects logged elements, and that replay."""
    for hw in profiles:
        rep = replay_any(model, run_dir, hw, steps)
        assert rep.step_index == steps and rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        if rep.totals.corrected:
            return hw, rep
    pytest.fail(f"{model}: no correction on {profiles} in {steps} steps: the log did not matter")


@pytest.mark.parametrize(("model", "steps", "profiles"), LOG_CORRECTS)
def test_the_log_corrects_the_replay_in_bits_the_state_never_reads(tmp_path, model, steps, profiles):
    """The model's replay on some profile corrects logged elements (its own nearest rounding differed from
    the recorder's), and, as measured since layer norm's decomposition, the same bundle with its log
    emptied still replicates: the corrected bits (log-probabilities near 0, a few GELU results on
    pairwise) do not move the state. (This
    test used to assert the divergence; see LOG_CORRECTS for what changed.)"""
    record_any(model, tmp_path / "run", steps)
    hw, rep = _replay_until_corrected(model, tmp_path / "run", steps, profiles)
    strip_log(tmp_path / "run", tmp_path / "nolog")
    assert replay_any(model, tmp_path / "nolog", hw, steps).step_index == steps, hw


@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_layer_norm_needs_no_log(tmp_path):
    """The tiny transformer (layer norms, softmax attention, GELU, cross-entropy) replays on every profile
    without a single correction, and its log-emptied bundle replicates: its layer norms, once the bundles'
    main need for a log, are computed from the same row sums everywhere."""
    steps = 10
    rec = record_any("tiny_transformer", tmp_path / "run", steps)
    assert rec.totals.logged > 0
    strip_log(tmp_path / "run", tmp_path / "nolog")
    for hw in PROFILES:
        rep = replay_any("tiny_transformer", tmp_path / "run", hw, steps)
        assert rep.totals.corrected == 0 and rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        assert replay_any("tiny_transformer", tmp_path / "nolog", hw, steps).step_index == steps, hw


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "steps", "profiles"),
    [
        ("cnn_bn", 160, ["emulated:reversed", "emulated:atomic", "emulated:splitk", "emulated:pairwise"]),
        (
            "mlp_dropout",
            320,
            ["emulated:pairwise", "emulated:atomic", "emulated:splitk", "emulated:reversed"],
        ),
    ],
)
def test_without_layer_norm_the_log_corrects_only_bits_the_state_never_reads(
    tmp_path, model, steps, profiles
):
    """What the log does for models without a normalisation over rows, as measured (a finding, not a goal).

    Their replays need corrections once predictions are confident (first on this CPU: the digits CNN at
    step 98, the MLP at 216): log-probabilities near 0, where an ulp of the log-sum-exp is many FP32
    spacings of the result. Only the loss value reads those bits (log-softmax backward rounds ``exp`` of
    them to FP32 first), so the log-emptied bundle still replicates. Every other op of theirs disagrees by
    a few FP64 ulps, which rarely moves an FP32 rounding: none among the 7e7 rounded results of 600 CNN
    steps or the 9e7 of 800 MLP steps. The character LSTM has one by step 142 (NEEDS_LOG).
    """
    record_any(model, tmp_path / "run", steps)
    hw, _ = _replay_until_corrected(model, tmp_path / "run", steps, profiles)
    strip_log(tmp_path / "run", tmp_path / "nolog")
    assert replay_any(model, tmp_path / "nolog", hw, steps).step_index == steps


# ------------------------------------------------------------------------------------------ calibration


def test_calibration_measures_row_ops_and_the_libm_instead_of_the_floor():
    """The profiles compute softmax, log-softmax and GELU their own way and with another libm, and in
    verifiable precision layer norm, its backward and the backward of softmax and log-softmax are
    decomposed into row sums (ordered in the profiles' row chunks) and ``exp`` (another libm on pairwise):
    the calibration step measures their disagreement and sets reduction thresholds from it (elementwise
    ones keep the floor that stands for real libms, measured disagreement x margin being below it). GELU and
    its backward are reductions from rules revision 11, in units of their first argument: their libm's
    disagreement, measured there, sets their thresholds. A calibrator whose only profile computes them
    natively measures nothing: every one gets the floor."""
    from detrl.core.calibrate import (
        CALIBRATION_SEED,
        DEFAULT_MARGIN,
        TAU_CAP,
        TAU_FLOOR,
        TAU_FLOOR_MEASURED,
        Calibrator,
    )
    from detrl.core.hardware import get_profile
    from detrl.core.rounding import RoundingMode, StepRounding, Thresholds

    torch.manual_seed(0)
    model = TiedLM().double()
    tokens, targets = synthetic_text(vocab=32, seq_len=16, n=16)
    # sum: the row sums of the decomposed layer norm, its backward and the backward of (log-)softmax
    reductions = ["sum", "_log_softmax", "gelu", "gelu_backward"]
    elementwise = ["_softmax", "exp"]  # exp: inside log-softmax backward

    def calibrate(profiles: tuple[str, ...]) -> tuple[dict[str, float], dict[str, float]]:
        thresholds = Thresholds(default=TAU_FLOOR * 64)
        calibrator = Calibrator(thresholds, [get_profile(p, seed=CALIBRATION_SEED) for p in profiles])
        mode = RoundingMode(get_profile("native"), thresholds)
        with mode.step_scope(StepRounding(), calibrator):
            logits = model(tokens)
            F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1)).backward()
        model.zero_grad()
        for op in ("native_layer_norm", "native_layer_norm_backward", "_softmax_backward_data"):
            assert op not in calibrator.state(), op  # decomposed: never rounded (or logged) as one op
        return calibrator.state(), thresholds.per_op

    worst, tau = calibrate(("emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"))
    for op in reductions:
        assert worst[op] > 0, op
        assert tau[op] == min(TAU_CAP, max(TAU_FLOOR_MEASURED, DEFAULT_MARGIN * worst[op])) != TAU_FLOOR, op
    for op in elementwise:
        assert worst[op] > 0 and tau[op] == max(TAU_FLOOR, DEFAULT_MARGIN * worst[op]), op
    for op in ("gelu", "gelu_backward", "exp"):  # the libm alone: an FP64 ulp or two, in FP32 spacings
        assert worst[op] <= 2.0**-27, op
    worst, tau = calibrate(("native",))
    for op in reductions + elementwise:
        assert worst[op] == 0 and tau[op] == TAU_FLOOR, op
