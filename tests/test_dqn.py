"""The deterministic DQN: bitwise determinism, one switch at a time, exact resume, the hardware switch,
verifiable runs audited on every profile, tampering caught at its step, and config errors.

Runs use ``configs/dqn/tiny.yaml`` (CartPole, small networks) through :func:`agents.dqn.run` inside a
:class:`detrl.Session`, exactly as ``detrl train`` does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from agents import dqn
from detrl import BundleError, Session, Sources
from detrl.cli import main
from detrl.formats import commit
from detrl.run import config as config_mod
from detrl.run import sessions

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "dqn" / "tiny.yaml"
EMULATED = ["emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"]


def tiny(**overrides: Any) -> dqn.Config:
    """tiny.yaml with dotted-key overrides, e.g. ``tiny(**{"precision": "fp32", "train.steps": 500})``."""
    raw = yaml.safe_load(TINY.read_text())
    return config_mod.validate(config_mod.apply_overrides(raw, [f"{k}={v}" for k, v in overrides.items()]))


class Probe(Session):
    """A Session that also keeps the initial weights (for the one-switch-at-a-time tests)."""

    def init(self, build):  # type: ignore[override]
        model = super().init(build)
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model


class RecordingSources(Sources):
    """Records every value drawn from each numpy stream (explore, replay, env, noop, sticky)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.draws: dict[str, list] = {}

    def numpy(self, name: str) -> Any:
        gen, log = super().numpy(name), self.draws.setdefault(name, [])

        class Recorder:
            def random(self, *a: Any, **kw: Any) -> Any:
                v = gen.random(*a, **kw)
                log.append(np.asarray(v).tolist())
                return v

            def integers(self, *a: Any, **kw: Any) -> Any:
                v = gen.integers(*a, **kw)
                log.append(np.asarray(v).tolist())
                return v

            def __getattr__(self, attr: str) -> Any:
                return getattr(gen, attr)

        return Recorder()


class ResetRecorder(gym.Wrapper):
    """Keeps each episode's first observation."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.firsts: list[np.ndarray] = []

    def reset(self, **kw: Any) -> Any:
        obs, info = self.env.reset(**kw)
        self.firsts.append(np.array(obs))
        return obs, info


def run(
    cfg: dqn.Config,
    mode: str = "off",
    run_dir: Path | None = None,
    sources: Sources | None = None,
    wrap_env: Any = None,
    **session_kw: Any,
) -> tuple[Session, dict[str, Any]]:
    torch.set_num_threads(cfg.threads)
    src = sources if sources is not None else Sources.from_config(cfg.sources)
    s = sessions.session_for(cfg, run_dir, mode, session_type=Probe, sources=src, **session_kw)
    with s:
        result = dqn.run(cfg, s, wrap_env=wrap_env)
    return s, result


def state(s: Session) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in commit.state_tensors(s.model, s.optimizers).items()}


def assert_same_state(a: Session, b: Session) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def differs(a: Session, b: Session) -> bool:
    sa, sb = state(a), state(b)
    return any(not torch.equal(sa[k], sb[k]) for k in sa)


# --- bitwise determinism ------------------------------------------------------------------------


def test_two_fp32_runs_of_5000_steps_are_bitwise_equal():
    cfg = tiny(**{"precision": "fp32", "train.steps": 5000})
    a, ra = run(cfg)
    b, rb = run(cfg)
    assert_same_state(a, b)  # parameters (online and target) and Adam's state
    assert len(ra["returns"]) > 20 and ra["returns"] == rb["returns"] and ra["lengths"] == rb["lengths"]
    assert ra["eval_returns"] == rb["eval_returns"]


@pytest.mark.slow
def test_verifiable_runs_match_across_thread_counts():
    cfg = tiny(**{"train.steps": 2000})
    a, ra = run(cfg.model_copy(update={"threads": 1}))
    b, rb = run(cfg.model_copy(update={"threads": 2}))
    assert_same_state(a, b)
    assert ra["returns"] == rb["returns"]


@pytest.mark.slow
def test_verifiable_nature_cnn_on_breakout_matches_across_thread_counts():
    # Convolutions are where FP32 kernels split work by thread count (oneDNN: see test_replication);
    # in verifiable precision every result is rounded to FP32 from FP64, so the split does not show.
    raw = yaml.safe_load((REPO / "configs" / "dqn" / "breakout.yaml").read_text())
    sets = {"precision": "verifiable", "train.steps": 240, "agent.buffer_size": 1000, "agent.learning_starts": 100,
            "agent.train_frequency": 10, "agent.batch_size": 32, "agent.start_e": 1.0, "agent.end_e": 1.0,
            "eval.episodes": 0}  # fmt: skip
    cfg = config_mod.validate(config_mod.apply_overrides(raw, [f"{k}={v}" for k, v in sets.items()]))
    a, ra = run(cfg.model_copy(update={"threads": 1}))
    b, rb = run(cfg.model_copy(update={"threads": 2}))
    assert_same_state(a, b)
    assert ra["returns"] == rb["returns"]


# --- one switch at a time -----------------------------------------------------------------------

CARTPOLE_STREAMS = ["init", "explore", "replay", "env"]


def _probe_run(cfg: dqn.Config, sources_cfg: dict) -> tuple[Session, RecordingSources, ResetRecorder]:
    src = RecordingSources(**_sources_kwargs(sources_cfg))
    holder: dict[str, ResetRecorder] = {}

    def wrap(env: gym.Env) -> gym.Env:
        holder["env"] = ResetRecorder(env)
        return holder["env"]

    s, _ = run(cfg, sources=src, wrap_env=wrap)
    return s, src, holder["env"]


def _sources_kwargs(c: dict) -> dict:
    c = dict(c)
    streams = {k: v for k, v in c.items() if k not in ("seed", "bitflip")}
    return {"seed": c.get("seed", 0), "bitflip": c.get("bitflip", False), "streams": streams}


def _same_prefix(a: list, b: list) -> bool:
    n = min(len(a), len(b))
    return n > 0 and all(np.array_equal(x, y) for x, y in zip(a[:n], b[:n]))


@pytest.mark.parametrize("varied", [*CARTPOLE_STREAMS, "bitflip"])
def test_each_switch_alone_changes_the_run_and_nothing_else(varied):
    cfg = tiny(**{"precision": "fp32", "train.steps": 1200, "agent.learning_starts": 300})
    base, base_src, base_env = _probe_run(cfg, {"seed": 0})
    change = {"seed": 0, "bitflip": True} if varied == "bitflip" else {"seed": 0, varied: {"seed": 12345}}
    other, other_src, other_env = _probe_run(cfg, change)
    assert differs(base, other), f"varying {varied} did not change the run"
    # Initial weights: changed by init and bitflip only (bitflip: exactly one element).
    moved = [k for k in base.initial if not torch.equal(base.initial[k], other.initial[k])]
    if varied == "init":
        assert moved
    elif varied == "bitflip":
        assert len(moved) >= 1 and sum(int((base.initial[k] != other.initial[k]).sum()) for k in moved) <= 2
    else:
        assert moved == []
    # Every other stream drew the same values (streams consumed per step: the same count too).
    for name in ("explore", "replay", "env"):
        a, b = base_src.draws.get(name, []), other_src.draws.get(name, [])
        if name == varied:
            assert not _same_prefix(a, b)
        elif name in ("explore", "replay"):
            assert a == b, f"varying {varied} moved the {name} stream"
        else:
            assert _same_prefix(a, b), f"varying {varied} moved the {name} stream"
    # The environment's initial states: unchanged unless the env stream varied.
    assert _same_prefix(base_env.firsts, other_env.firsts) == (varied != "env")


def _breakout(**sets: Any) -> dqn.Config:
    raw = yaml.safe_load((REPO / "configs" / "dqn" / "breakout.yaml").read_text())
    base = {"train.steps": 400, "agent.buffer_size": 1000, "agent.learning_starts": 200, "agent.train_frequency": 20,
            "agent.batch_size": 8, "agent.exploration_fraction": 0.5, "eval.episodes": 0, "threads": 1}  # fmt: skip
    return config_mod.validate(
        config_mod.apply_overrides(raw, [f"{k}={v}" for k, v in {**base, **sets}.items()])
    )


@pytest.mark.parametrize("varied", ["noop", "sticky"])
def test_atari_noop_and_sticky_switches_each_change_only_their_source(varied):
    cfg = _breakout()
    base, base_src, base_env = _probe_run(cfg, {"seed": 0})
    other, other_src, other_env = _probe_run(cfg, {"seed": 0, varied: {"seed": 999}})
    assert differs(base, other), f"varying {varied} did not change the run"
    assert all(torch.equal(base.initial[k], other.initial[k]) for k in base.initial)
    for name in ("explore", "replay"):
        assert base_src.draws[name] == other_src.draws[name]
    for name in ("env", "noop", "sticky"):
        a, b = base_src.draws[name], other_src.draws[name]
        assert _same_prefix(a, b) == (name != varied), name


# --- resume -------------------------------------------------------------------------------------


class StopAt(gym.Wrapper):
    """Asks the session to stop after ``k`` environment steps (what Ctrl-C does in `detrl train`)."""

    def __init__(self, env: gym.Env, session_ref: dict, k: int) -> None:
        super().__init__(env)
        self.ref, self.k, self.n = session_ref, k, 0

    def step(self, action: Any) -> Any:
        self.n += 1
        if self.n == self.k:
            self.ref["session"].stop_requested = True
        return self.env.step(action)


def _record_stopped(cfg: dqn.Config, run_dir: Path, k: int) -> None:
    ref: dict = {}

    class Stoppable(Probe):
        def __enter__(self):  # noqa: D401
            ref["session"] = self
            return super().__enter__()

    torch.set_num_threads(cfg.threads)
    s = sessions.session_for(cfg, run_dir, "record", session_type=Stoppable)
    with s:
        dqn.run(cfg, s, wrap_env=lambda env: StopAt(env, ref, k))
    assert s.step_index == k


@pytest.mark.parametrize("precision", ["fp32", pytest.param("verifiable", marks=pytest.mark.slow)])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, precision, capsys):
    steps, k = (3000, 1700) if precision == "fp32" else (1200, 700)
    cfg = tiny(**{"precision": precision, "train.steps": steps, "verify.checkpoint_every": 0})
    full, full_result = run(cfg, mode="record", run_dir=tmp_path / "full")
    _record_stopped(cfg, tmp_path / "resumed", k)
    manifest = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    # A stop records where it stopped and leaves the planned schedule alone (epsilon depends on it).
    assert manifest["status"] == "stopped" and manifest["stopped_at"] == k
    assert manifest["config"]["train"]["steps"] == manifest["planned_steps"] == steps
    rc = main(["train", "--resume", str(tmp_path / "resumed"), "--quiet", "--no-tensorboard"])
    assert rc == 0, capsys.readouterr().err
    a = json.loads((tmp_path / "full" / "manifest.json").read_text())
    b = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert b["status"] == "complete" and b["durable"] == a["durable"]  # every step's state, same bits
    a.pop("created"), b.pop("created")
    assert a == b
    names = ["commitments", *(f"checkpoints/{p.name}" for p in (tmp_path / "full" / "checkpoints").iterdir())]
    if precision == "verifiable":
        names.append("roundlog")
    for name in names:
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == sorted(
        os.listdir(tmp_path / "resumed" / "checkpoints")
    )  # the stop's own checkpoint is gone once the resumed run passed it
    if precision == "verifiable":
        assert main(["audit", str(tmp_path / "resumed"), "--hardware", "emulated:splitk", "--quiet"]) == 0


def test_resume_refuses_a_different_initial_model(tmp_path):
    cfg = tiny(**{"precision": "fp32", "train.steps": 400, "verify.checkpoint_every": 100})
    _record_stopped(cfg, tmp_path / "r", 250)
    before = {p.name: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    # (the switchboard comes from the bundle on resume; a config with other layer widths is another model)
    other = tiny(
        **{"precision": "fp32", "train.steps": 400, "verify.checkpoint_every": 100, "agent.hidden": "[16,16]"}
    )
    with pytest.raises(BundleError, match="different initial model"):
        run(other, mode="record", run_dir=tmp_path / "r", resume=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()} == before


def test_resume_refuses_a_set_that_would_change_recorded_steps(tmp_path, capsys):
    cfg = tiny(**{"precision": "fp32", "train.steps": 400, "verify.checkpoint_every": 100})
    _record_stopped(cfg, tmp_path / "r", 250)
    capsys.readouterr()
    for key in ("train.steps=800", "sources.init.seed=5"):
        rc = main(["train", "--resume", str(tmp_path / "r"), "--set", key, "--quiet", "--no-tensorboard"])
        err = capsys.readouterr().err
        assert rc == 2 and "would change steps already recorded" in err and err.count("\n") == 1, err


# --- the hardware switch ------------------------------------------------------------------------


def test_atomic_hardware_makes_runs_differ_native_does_not():
    # Widths and batch above the atomic profile's 64-element chunks, so its reductions really reorder.
    cfg = tiny(**{"precision": "fp32", "train.steps": 600, "agent.learning_starts": 100,
                  "agent.hidden": "[128,128]", "agent.batch_size": 128})  # fmt: skip
    a, _ = run(cfg)
    b, _ = run(cfg)
    assert not differs(a, b)
    atomic = cfg.model_copy(update={"hardware": "emulated:atomic"})
    c, _ = run(atomic)
    d, _ = run(atomic)
    assert differs(c, d)


# --- verifiable runs, audits and tampering ------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """tiny.yaml as is: a verifiable CartPole run of 2,000 steps."""
    out = tmp_path_factory.mktemp("dqn") / "tiny"
    assert main(["train", str(TINY), "--out", str(out), "--quiet", "--no-tensorboard"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("hardware", EMULATED)
def test_verifiable_dqn_replicates_on_every_profile(recorded, hardware, capsys):
    rc = main(["audit", str(recorded), "--hardware", hardware, "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith(f"REPLICATED on {hardware}") and "2000 step commitments" in out


class Tamper(gym.Wrapper):
    """A dishonest trainer's env: changes the reward (or the observation) returned at env step ``s``."""

    def __init__(self, env: gym.Env, s: int, what: str) -> None:
        super().__init__(env)
        self.s, self.what, self.n = s, what, 0

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.n += 1
        if self.n == self.s:
            if self.what == "reward":
                reward = reward + 1.0
            else:
                obs = obs.copy()
                obs[0] += np.float32(1e-3)
        return obs, reward, terminated, truncated, info


@pytest.mark.parametrize("what", ["reward", "observation"])
def test_tampered_transition_is_caught_at_its_step(tmp_path, what, capsys):
    s = 137
    cfg = tiny(**{"train.steps": 300, "agent.learning_starts": 100})
    run(cfg, mode="record", run_dir=tmp_path / "run", wrap_env=lambda env: Tamper(env, s, what))
    rc = main(["audit", str(tmp_path / "run"), "--hardware", "emulated:pairwise", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"diverged at step {s}" in out and "batch the trainer committed differs" in out


@pytest.mark.slow  # 7-9 s on 2 cores
def test_each_op_sequence_revision_replays_as_it_was_recorded(tmp_path, monkeypatch, capsys):
    """A verifiable update of op-sequence revision 2 takes the shortcuts (revision 1 took autograd and a
    per-tensor clip): the same weights, bit for bit, from other ops in another order. Revision 3 takes
    per-tensor ops for Adam and the target update, which log nothing where revision 2's list ops did. A
    bundle says its revision and replays with its own ops; the native MLP path and the Python one replay
    each other's; a bundle of a revision this detrl does not know is bad input, in one line."""
    from detrl.formats.bundle import MANIFEST, ROUNDLOG

    cfg = tiny(**{"train.steps": 500})
    bundles = [tmp_path / f"revision{r}" for r in (1, 2, 3)]
    run(cfg, mode="record", run_dir=bundles[0], ops_revision=1)
    run(cfg, mode="record", run_dir=bundles[1], ops_revision=2)
    run(cfg, mode="record", run_dir=bundles[2])
    manifests = [json.loads((d / MANIFEST).read_text()) for d in bundles]
    assert [m["ops_revision"] for m in manifests] == [1, 2, dqn.OPS_REVISION] == [1, 2, 3]
    assert manifests[0]["durable"]["merkle_root"] == manifests[1]["durable"]["merkle_root"]
    logs = [(d / ROUNDLOG).read_bytes() for d in bundles]
    assert logs[0] != logs[1]  # other op positions
    assert len(logs[2]) < len(logs[1])  # Adam's and the target's lerps log nothing
    for bundle in bundles:
        assert main(["audit", str(bundle), "--quiet"]) == 0, capsys.readouterr().out
    monkeypatch.setattr(dqn, "mlp_native", lambda: None)  # an auditor without the native extension
    for bundle in bundles[1:]:
        assert main(["audit", str(bundle), "--quiet"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    manifests[2]["ops_revision"] = 4
    (bundles[2] / MANIFEST).write_text(json.dumps(manifests[2]))
    assert main(["audit", str(bundles[2]), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "recorded by a newer detrl (op-sequence revision 4; this one runs revisions 1 to 3)" in err
    assert len(err.strip().splitlines()) == 1
    for bad in (0, True, 2.0, 1 << 16):
        with pytest.raises(ValueError, match="ops_revision must be an integer"):
            Session(None, mode="off", ops_revision=bad)


def test_native_and_python_paths_round_the_same_ops_in_a_verifiable_step():
    """Under verifiable precision the native MLP update and greedy action dispatch the Python shortcut path's
    ops: the rounding mode sees the same ops, in the same order, with the same rounded outputs (so a bundle
    recorded with the extension replays without it). Inference mode would not: linear would reach the mode
    whole instead of as t and addmm."""
    from detrl.core.optrace import OpTrace

    if dqn.mlp_native() is None:
        pytest.skip("the native MLP path is not built here")
    from agents.networks import MLPQNetwork, QNetworks

    cfg = tiny()
    s = sessions.session_for(cfg, None, "off", sources=Sources.from_config(cfg.sources))
    rng = np.random.default_rng(0)
    batch = SimpleNamespace(
        obs=rng.normal(size=(32, 4)).astype(np.float32), next_obs=rng.normal(size=(32, 4)).astype(np.float32),
        actions=rng.integers(0, 2, 32), rewards=rng.normal(size=32).astype(np.float32),
        terminated=(rng.random(32) < 0.2).astype(np.float32),
    )  # fmt: skip
    a = SimpleNamespace(gamma=0.99, double_dqn=True, loss="huber", max_grad_norm=0.05)
    with s:
        nets = s.init(lambda: QNetworks(MLPQNetwork(4, 2, (32, 32))))
        opt = torch.optim.Adam(nets.online.parameters(), lr=1e-3, foreach=True)
        s.track(opt)

        def as_input(x: np.ndarray) -> torch.Tensor:
            return s.precision.cast(torch.from_numpy(x))

        def traced(fn: Any) -> list[tuple[str, bytes]]:
            s.rounding.trace = trace = OpTrace()
            with s.step():
                fn()
            return [(r.op, r.digest) for r in trace.records]

        def update(native: bool) -> None:
            dqn.td_update(nets.online, nets.target, opt, batch, a, as_input, s.precision.cast, True, native)

        steps = []
        for native in (False, True):
            opt.state.clear()  # each path's Adam starts afresh, from the same weights
            weights = [p.detach().clone() for p in nets.parameters()]
            steps.append(traced(functools.partial(update, native)))
            with torch.no_grad():
                for p, w in zip(nets.parameters(), weights):
                    p.copy_(w)
        assert len(steps[0]) > 30 and steps[0] == steps[1]
        python = traced(lambda: torch.no_grad()(nets.online.forward)(as_input(batch.obs[:1])).argmax())
        native = traced(lambda: dqn.greedy_policy(nets.online, as_input)(batch.obs[0]))
        assert [op for op, _ in python] == ["addmm"] * 3 and python == native


# --- config errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("agent.learnin_rate=0.1", "agent.learnin_rate: unknown key"),
        ("agent.batch_size=lots", "agent.batch_size"),
        ("env.id=Pong-v77", "unknown env id"),
        ("sources.explor.seed=3", "sources"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, override, message, capsys):
    rc = main(["train", str(TINY), "--out", str(tmp_path / "x"), "--set", override, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def test_train_cli_writes_tensorboard_scalars_and_evaluates(tmp_path, capsys):
    out = tmp_path / "cp"
    rc = main(["train", str(REPO / "configs" / "dqn" / "cartpole.yaml"), "--out", str(out), "--quiet",
               "--set", "train.steps=1500", "--set", "agent.learning_starts=500", "--set", "eval.episodes=2"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0 and "greedy evaluation: mean return" in text
    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 1000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "charts/episodic_return",
        "charts/episodic_length",
        "losses/td_loss",
        "losses/q_values",
        "charts/epsilon",
        "charts/SPS",
    } <= tags
    losses = acc.Scalars("losses/td_loss")
    # No loss is logged before learning starts (it used to be NaN there), and every one is a number.
    assert losses and min(e.step for e in losses) > 500 and all(math.isfinite(e.value) for e in losses)


def test_a_false_frozen_claim_changes_no_commitment(tmp_path, capsys):
    """``frozen`` is a hint: the digest cache compares bytes, so a recorder that claims an update step
    frozen still commits to the state it computed, and the bundle equals an honest recording's."""

    class Liar(Probe):
        def step(self, batch=None, frozen=False):  # type: ignore[override]
            return super().step(batch, frozen=True if self.step_index + 1 == 250 else frozen)

    cfg = tiny(**{"train.steps": 300, "agent.learning_starts": 100})  # step 250 is an update step
    torch.set_num_threads(cfg.threads)
    runs = {}
    for name, kind in (("liar", Liar), ("honest", Probe)):
        s = sessions.session_for(cfg, tmp_path / name, "record", session_type=kind)
        with s:
            dqn.run(cfg, s)
        runs[name] = s.leaves
    assert runs["liar"] == runs["honest"]
    assert main(["audit", str(tmp_path / "liar"), "--quiet"]) == 0


def test_sb3_bridge_maps_every_hyperparameter_and_refuses_what_sb3_lacks():
    from agents.sb3 import sb3_dqn, sb3_kwargs

    cfg = config_mod.load(REPO / "configs" / "dqn" / "cartpole.yaml")
    kw = sb3_kwargs(cfg)
    a = cfg.agent
    assert (kw["train_freq"], kw["batch_size"], kw["tau"], kw["target_update_interval"]) == (
        a.train_frequency,
        a.batch_size,
        a.tau,
        a.target_update_period,
    )
    assert kw["policy_kwargs"]["net_arch"] == a.hidden
    assert kw["learning_rate"](1.0) == a.learning_rate and kw["learning_rate"](0.0) == a.final_learning_rate
    with pytest.raises(ValueError, match="Double DQN"):
        sb3_dqn(cfg, gym.make("CartPole-v1"), seed=0)


def test_lean_adam_is_torch_fused_adam_bit_for_bit():
    """LeanAdam's fast path (the fused kernel on kept tensor lists) moves weights and state exactly as
    ``torch.optim.Adam(fused=True)``, through an lr schedule and a checkpoint reload."""
    import copy

    from agents.optim import LeanAdam

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    theirs = copy.deepcopy(ours)
    opt_ours = LeanAdam(ours.parameters(), lr=1e-3, eps=1e-6)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=1e-3, eps=1e-6, fused=True)
    for i in range(12):
        x = torch.randn(32, 4)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            opt.step()
            if i == 4:
                opt.param_groups[0]["lr"] = 3e-4
        if i == 7:
            opt_ours.load_state_dict(copy.deepcopy(opt_ours.state_dict()))
    assert opt_ours._lists is not None  # the fast path ran
    for p, r in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, r)
    for s, r in zip(opt_ours.state.values(), opt_theirs.state.values()):
        assert all(torch.equal(s[k], r[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("name", ["ListAdam", "LoopAdam", "LoopAdam, native"])
def test_list_and_loop_adam_are_torch_adam_bit_for_bit(tmp_path, monkeypatch, name):
    """ListAdam's and LoopAdam's fast paths (torch's list ops, or its per-tensor ops from Python or from
    ``agents/mlp_native.cpp``, on kept tensor lists) move weights and state exactly as
    ``torch.optim.Adam(foreach=True)`` and ``(foreach=False)``, through an lr schedule and a checkpoint
    reload; recorded in verifiable precision, each writes the same rounding log and commitments as torch's
    (the same ops, rounded in one order)."""
    import copy

    from agents.optim import ListAdam, LoopAdam

    native = dqn.mlp_native() if name.endswith("native") else None
    if name.endswith("native") and native is None:
        pytest.skip("the native MLP path is not built here")
    foreach, torch_step = (
        (True, "_multi_tensor_adam") if name == "ListAdam" else (False, "_single_tensor_adam")
    )
    from detrl.core.engine import Session
    from detrl.core.rounding import Thresholds
    from detrl.core.sources import Sources
    from detrl.formats import bundle as bundle_mod

    def train(make_opt, precision: str, where) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:  # noqa: ANN001
        session = Session(
            where, mode="record" if where else "off", sources=Sources(seed=3), precision=precision,
            thresholds=Thresholds(default=2.0**-12), planned_steps=12,
        )  # fmt: skip
        with session:
            net = session.init(
                lambda: torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            )
            opt = session.track(make_opt(net.parameters()))
            g = torch.Generator().manual_seed(0)
            for i in range(12):
                x = torch.randn(32, 4, generator=g).to(net[0].weight.dtype)
                with session.step(batch=(x,)):
                    opt.zero_grad(set_to_none=True)
                    net(x).square().mean().backward()
                    opt.step()
                if i == 4:
                    opt.param_groups[0]["lr"] = 3e-4
                if i == 7:
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                if i == 9:  # switched on between steps: torch's own steps from here
                    opt.param_groups[0]["weight_decay"] = 0.1
        return [p.detach().clone() for p in net.parameters()], opt

    if name == "ListAdam":
        ours_opt = lambda p: ListAdam(p, lr=1e-3, eps=1e-6)  # noqa: E731
    else:
        ours_opt = lambda p: LoopAdam(p, native, lr=1e-3, eps=1e-6)  # noqa: E731
    theirs_opt = lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-6, foreach=foreach)  # noqa: E731
    torch_steps = []  # steps torch's Adam took (ours: the first, after the reload, weight decay)
    adam_module = importlib.import_module("torch.optim.adam")  # torch.optim's attribute is the class
    torch_adam = getattr(adam_module, torch_step)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        torch_steps.append(1)
        return torch_adam(*args, **kwargs)

    monkeypatch.setattr(adam_module, torch_step, counted)
    for precision in ("fp32", "fp64"):
        torch_steps.clear()
        ours, _ = train(ours_opt, precision, None)
        assert len(torch_steps) == 4  # steps 1, 9 (after the reload), 11 and 12 (weight decay): 8 its own
        theirs, _ = train(theirs_opt, precision, None)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    train(ours_opt, "verifiable", tmp_path / "ours")
    train(theirs_opt, "verifiable", tmp_path / "theirs")
    for name in (bundle_mod.ROUNDLOG, bundle_mod.COMMITMENTS):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# Not emulated:atomic: it draws a fresh summation order at every call, so two identical updates differ too.
@pytest.mark.parametrize("hardware", ["native", *(h for h in EMULATED if h != "emulated:atomic")])
def test_the_update_shortcuts_give_the_same_bits(dtype, hardware):
    """An fp32/fp64 DQN update takes shortcuts: the MLP's written backward pass and list ops for gradient
    clipping, in Python or as one native call (``agents/mlp_native.cpp``, where built). For both losses,
    with and without Double DQN and on every hardware profile, its loss and every parameter's clipped
    gradient equal those of autograd and per-tensor ops, bit for bit; so does the native greedy action."""
    from agents.networks import MLPQNetwork
    from detrl.core.hardware import HardwareMode, get_profile

    torch.manual_seed(0)
    q = MLPQNetwork(4, 3, (24, 16)).to(dtype)
    target = MLPQNetwork(4, 3, (24, 16)).to(dtype)
    rng = np.random.default_rng(0)
    batch = SimpleNamespace(
        obs=rng.normal(size=(64, 4)).astype(np.float32) * 3, next_obs=rng.normal(size=(64, 4)).astype(np.float32),
        actions=rng.integers(0, 3, 64), rewards=rng.normal(size=64).astype(np.float32),
        terminated=(rng.random(64) < 0.2).astype(np.float32),
    )  # fmt: skip
    mode = HardwareMode(get_profile(hardware)) if hardware != "native" else contextlib.nullcontext()
    paths = [(False, False), (True, False)] + ([(True, True)] if dqn.mlp_native() is not None else [])
    for loss, double_dqn in itertools.product(("huber", "mse"), (False, True)):
        a = SimpleNamespace(gamma=0.99, double_dqn=double_dqn, loss=loss, max_grad_norm=0.05)  # clips
        grads, losses = [], []
        for shortcuts, native in paths:
            opt = torch.optim.SGD(q.parameters(), lr=0.0)  # lr 0: every update starts from the same weights
            with mode:
                losses.append(
                    dqn.td_update(q, target, opt, batch, a, lambda x: torch.from_numpy(x).to(dtype),
                                  lambda t: t.to(dtype), shortcuts, native)
                )  # fmt: skip
            grads.append([p.grad for p in q.parameters()])
        assert len(set(losses)) == 1, losses
        for autograd_grad, *shortcut_grads in zip(*grads):
            for grad in shortcut_grads:
                assert autograd_grad.shape == grad.shape and torch.equal(autograd_grad, grad)
    if dqn.mlp_native() is not None:
        with mode, torch.no_grad():
            for row in range(len(batch.obs)):
                obs = torch.from_numpy(batch.obs[row : row + 1]).to(dtype)
                assert dqn.mlp_native().act(q.flat_parameters(), obs) == int(q.forward(obs).argmax())


def test_lean_adam_steps_unwrapped_yet_runs_step_hooks():
    """torch wraps an optimizer class's step in a profiler scope and hook loops; LeanAdam's stays unwrapped
    (its cost was half the fused kernel's), and still runs its own and global step hooks, in torch's order."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from agents.optim import LeanAdam

    step = LeanAdam.step  # its base class's: torch would wrap it by setting LeanAdam.step
    net = torch.nn.Linear(3, 2)
    opt = LeanAdam(net.parameters(), lr=1e-3)
    assert LeanAdam.step is step  # constructing one did not wrap it
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    handle = register_optimizer_step_post_hook(lambda *_: calls.append("global post"))
    try:
        for _ in range(2):  # the first step is torch's own, the second the fast path
            net(torch.ones(4, 3)).sum().backward()
            opt.step()
    finally:
        handle.remove()
    assert opt._lists is not None
    assert calls == ["pre", "post", "global post"] * 2


def test_bench_dqn_profile_times_each_part_and_restores_what_it_wrapped(capsys):
    from agents import bench
    from agents.buffers import ReplayBuffer
    from agents.networks import MLPQNetwork

    before = (dqn.td_update, dqn.greedy_policy, MLPQNetwork.forward, ReplayBuffer.add, Session.step)
    assert bench.main(["--part", "profile", "--steps", "300"]) == 0
    out = capsys.readouterr().out
    for part in ("greedy action", "env step", "env reset", "Session step", "replay buffer add"):
        row = next(line for line in out.splitlines() if line.strip().startswith(part))
        assert float(row.split()[-4]) > 0  # microseconds a call
    assert (dqn.td_update, dqn.greedy_policy, MLPQNetwork.forward, ReplayBuffer.add, Session.step) == before


def test_bench_dqn_verifiable_breaks_a_recorded_step_down_and_restores_what_it_wrapped(capsys):
    from agents import bench
    from agents.networks import QNetworks
    from detrl.formats.bundle import BundleWriter

    before = (
        dqn.td_update,
        dqn.greedy_policy,
        QNetworks.update_target,
        Session._state_hash,
        BundleWriter.append_step,
    )
    assert bench.main(["--part", "verifiable", "--verifiable-steps", "300", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "verifiable is" in out and "Where a recorded step goes" in out
    for part in ("update", "greedy action", "state commitment", "bundle append", "a step"):
        row = next(line for line in out.splitlines() if line.strip().startswith(part))
        fp32, verifiable = (float(x) for x in row.split()[-3:-1])
        assert fp32 > 0 and verifiable > 0  # microseconds a step, in each precision
    after = (
        dqn.td_update,
        dqn.greedy_policy,
        QNetworks.update_target,
        Session._state_hash,
        BundleWriter.append_step,
    )
    assert after == before
