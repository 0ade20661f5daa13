"""Verifiable runs cross between a CPU and a real GPU: a CPU recording replicates on the ``cuda`` profile, and
a recording made on the GPU replicates on the CPU profiles, bit for bit.

Every test here needs a CUDA device and is skipped without one (CI has none). On a machine with one:
``python -m pytest -q tests/test_cuda.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detrl.apps.audit import audit
from detrl.core.engine import Session
from detrl.run import sessions, tasks
from detrl.run.config import load
from detrl.testing import zoo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Every supervised family: convolution with batch norm, dropout, attention, recurrence, and the two recipes.
MODELS = ["digits_cnn", "digits_mlp_dropout", "tiny_transformer", "lstm_lm", "resnet50_tiny", "gpt2_tiny"]
STEPS = ["train.steps=6", "verify.checkpoint_every=3"]


def record(cfg, out: Path) -> None:
    task = tasks.get(cfg.task)
    with sessions.session_for(cfg, out, "record") as session:
        task.run(cfg, session)


def replicated(run: Path, hardware: str) -> None:
    report = audit(run, hardware=hardware)
    assert report.verdict == "replicated", f"{hardware}: {report.message}"


def test_the_cuda_profile_trains_on_the_gpu() -> None:
    with Session(None, mode="off", precision="verifiable", hardware="cuda") as s:
        model = s.init(lambda: torch.nn.Linear(3, 2))
        assert s.device.type == "cuda" and all(p.device.type == "cuda" for p in model.parameters())
        assert all(p.dtype == torch.float64 for p in model.parameters())
        opt = s.track(torch.optim.Adam(model.parameters(), lr=0.1))
        with s.step(batch=torch.zeros(1)):
            loss = model(torch.ones(4, 3, dtype=torch.float64, device="cuda")).square().mean()
            loss.backward()
            opt.step()
        # the update ran on the FP32 grid: every weight is an FP32 number held in FP64
        for p in model.parameters():
            assert torch.equal(p, p.float().double())


@pytest.mark.parametrize("name", MODELS)
def test_a_cpu_recording_replicates_on_the_gpu(tmp_path: Path, name: str) -> None:
    cfg = load(f"configs/supervised/{name}.yaml", STEPS)
    record(cfg, tmp_path / "run")
    replicated(tmp_path / "run", "cuda")


@pytest.mark.parametrize("name", MODELS)
def test_a_gpu_recording_replicates_on_the_cpu(tmp_path: Path, name: str) -> None:
    cfg = load(f"configs/supervised/{name}.yaml", [*STEPS, "hardware=cuda"])
    record(cfg, tmp_path / "run")
    for hardware in ("native", "emulated:splitk", "cuda"):
        replicated(tmp_path / "run", hardware)


def test_a_dqn_crosses_both_ways(tmp_path: Path) -> None:
    for recorder, auditors in (("native", ("cuda",)), ("cuda", ("native", "emulated:pairwise"))):
        cfg = load(
            "configs/dqn/tiny.yaml",
            ["train.steps=400", "verify.checkpoint_every=200", f"hardware={recorder}"],
        )
        record(cfg, tmp_path / recorder)
        for hardware in auditors:
            replicated(tmp_path / recorder, hardware)


@pytest.mark.parametrize("name", [n for n, s in zoo.SPECIMENS.items() if zoo.available(s)])
def test_every_zoo_model_crosses_between_cpu_and_gpu(tmp_path: Path, name: str) -> None:
    """Hugging Face GPT-2, Llama (eager and SDPA), Qwen2, Mistral, Mixtral, BERT, ViT, T5, torch's
    TransformerEncoder, an LSTM, batch norm, float32 and bf16 islands, complex weights: recorded on each
    side, replayed on the other (raises Divergence if a commitment differs)."""
    specimen = zoo.SPECIMENS[name]
    zoo.record(specimen, tmp_path / "cpu", steps=2)
    zoo.replay(specimen, tmp_path / "cpu", "cuda", steps=2)
    zoo.record(specimen, tmp_path / "gpu", steps=2, hardware="cuda")
    zoo.replay(specimen, tmp_path / "gpu", "native", steps=2)
