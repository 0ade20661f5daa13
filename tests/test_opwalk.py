"""The op walk: no floating-point result of a verifiable step escapes rounding, for every recipe (each
config shrunk to a size CI walks in seconds: the same code paths; the FP32 DQN configs in verifiable
precision), the DQN configs and every zoo model."""

from __future__ import annotations

from pathlib import Path

import pytest

from detrl.core import islands
from detrl.run import sessions
from detrl.run.config import load
from detrl.testing import zoo
from detrl.testing.opwalk import WalkedSession, WalkProfile

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL_TEXT = ["data.n=64", "data.seq_len=16"]
#: Each recipe config with the overrides that shrink it (the full-size ones run the same code).
RECIPES = {
    "supervised/digits_cnn": [],
    "supervised/digits_mlp_dropout": [],
    "supervised/tiny_transformer": SMALL_TEXT,
    "supervised/lstm_lm": SMALL_TEXT,
    "supervised/resnet50_tiny": ["model.width=4", "data.n=16"],
    "supervised/resnet50": ["model.width=4", "data.n=16"],
    "supervised/resnet50_cifar": ["model.width=4", "data.name=digits32", "data.n=16"],
    "supervised/gpt2_tiny": SMALL_TEXT,
    "supervised/gpt2": [*SMALL_TEXT, "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.vocab_size=512", "data.vocab_size=512"],
    "supervised/llama_tiny": SMALL_TEXT,
    "supervised/llama": [*SMALL_TEXT, "model.n_layer=1", "model.n_embd=32", "model.n_head=4", "model.n_kv_head=2",
                         "model.intermediate=64", "model.vocab_size=512", "data.vocab_size=512"],
    "supervised/vit_tiny": ["data.n=16"],
    "supervised/vit": ["data.n=16", "model.n_layer=1", "model.n_embd=32", "model.n_head=4", "model.intermediate=64"],
    "dqn/tiny": ["train.steps=260", "agent.learning_starts=200"],
    "dqn/cartpole": ["precision=verifiable", "train.steps=1010", "agent.learning_starts=1000"],
    "dqn/minatar": ["precision=verifiable", "train.steps=60", "agent.learning_starts=40", "agent.buffer_size=100"],
    "dqn/breakout": ["precision=verifiable", "train.steps=40", "agent.learning_starts=32", "agent.buffer_size=64",
                     "agent.batch_size=4"],
}  # fmt: skip


#: Configs the walk leaves out, and why (their model is walked under another name above).
NOT_WALKED = {"supervised/gpt2_finetune": "gpt2 from a weights file: the gpt2 recipe's ops"}


def test_every_recipe_config_is_walked():
    shipped = {
        f"{p.parent.name}/{p.stem}" for d in ("supervised", "dqn") for p in (CONFIGS / d).glob("*.yaml")
    }
    missing = shipped - set(RECIPES) - set(NOT_WALKED)
    assert not missing, f"add these configs to RECIPES (with overrides that shrink them): {sorted(missing)}"


def walk_config(path: str, overrides: list[str], tmp_path: Path) -> tuple[WalkProfile, WalkedSession]:
    cfg = load(CONFIGS / f"{path}.yaml", overrides)
    if cfg.task == "supervised":
        cfg = load(CONFIGS / f"{path}.yaml", [*overrides, "train.steps=1", "train.batch_size=4"])
    profile = WalkProfile()
    session = sessions.session_for(
        cfg, tmp_path / "run", "record", hardware=profile, session_type=WalkedSession
    )
    from detrl.run.tasks import get

    with session:
        get(cfg.task).run(cfg, session)
    return profile, session


def _recipe_available(path: str) -> bool:
    if any(name in path for name in ("gpt2", "llama", "vit")):
        try:
            import tokenizers  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            return False
    if "minatar" in path or "breakout" in path:
        try:
            import ale_py  # noqa: F401
            import minatar  # noqa: F401
        except ImportError:
            return False
    return True


#: Walks of several seconds (a DQN's thousands of acting steps before its first update): slow.
SLOW_WALKS = {"dqn/breakout", "dqn/cartpole"}


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_WALKS else p for p in RECIPES]
)
def test_no_float_result_of_a_recipe_escapes_rounding(tmp_path, path):
    if not _recipe_available(path):
        pytest.skip(f"{path} needs an optional dependency")
    profile, session = walk_config(path, RECIPES[path], tmp_path)
    assert profile.ops > 100  # the walk saw the step's ops
    assert profile.escapes == [] and session.off_grid == []


def walk_specimen(s: zoo.Specimen, tmp_path: Path) -> tuple[WalkProfile, WalkedSession]:
    from detrl.core.sources import Sources

    profile = WalkProfile()
    session = WalkedSession(tmp_path / "run", sources=Sources(), hardware=profile, planned_steps=1)
    zoo.train(session, s, 1)
    return profile, session


@pytest.mark.parametrize("name", list(zoo.SPECIMENS))
def test_no_float_result_of_a_zoo_model_escapes_rounding(tmp_path, name):
    s = zoo.SPECIMENS[name]
    if not zoo.available(s):
        pytest.skip(f"transformers has no {s.needs}")
    profile, session = walk_specimen(s, tmp_path)
    assert profile.ops > 50
    assert profile.escapes == [] and session.off_grid == []


def test_the_walk_finds_float32_ops_computed_natively(tmp_path, monkeypatch):
    # The control: with islands off (detrl before them), the upcast MLP's log-softmax escapes.
    monkeypatch.setattr(islands, "narrow_dtype", lambda args, kwargs: None)
    profile, _ = walk_specimen(zoo.SPECIMENS["upcast_mlp"], tmp_path)
    assert any("_log_softmax computed in ['torch.float32']" in e for e in profile.escapes), profile.escapes
