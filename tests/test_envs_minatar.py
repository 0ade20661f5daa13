"""MinAtar under the switchboard: gymnasium's checker, where each random draw comes from, exact save/restore,
refused corrupt states, and a DQN that trains, resumes and evaluates on MinAtar Breakout."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import minatar
import numpy as np
import pytest
import torch
import yaml
from gymnasium.utils.env_checker import check_env

import envs
from agents import dqn
from agents.networks import MinAtarCNN, build_q_network
from detrl import Session, Sources
from detrl.cli import main
from detrl.run import config as config_mod
from detrl.run import sessions
from envs.ids import MINATAR

BREAKOUT = "MinAtar/Breakout-v1"
GAMES = list(MINATAR)
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "dqn" / "minatar.yaml"
NOOP, LEFT, RIGHT = 0, 1, 2  # Breakout's minimal action set


def play(env: gym.Env, actions: np.ndarray, reset: bool = True) -> list[tuple]:
    """Step through ``actions``, resetting after each episode; every return value, in order."""
    out = [env.reset()] if reset else []
    for a in actions:
        step = env.step(int(a))
        out.append(step)
        if step[2] or step[3]:
            out.append(env.reset())
    return out


def assert_same(xs: list[tuple], ys: list[tuple]) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, np.ndarray):
                assert u.dtype == v.dtype and np.array_equal(u, v)
            else:
                assert type(u) is type(v) and u == v


def random_actions(env: gym.Env, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(env.action_space.n, size=n)


def episodes(sources: Sources, n_steps: int = 300, **options: Any) -> dict[str, Any]:
    """Breakout for ``n_steps`` random actions: each reset's seed, no-op count and first observation, and
    every observation and reward."""
    env = envs.make(BREAKOUT, sources, **options)
    out = play(env, random_actions(env, n_steps))
    resets = [o for o in out if len(o) == 2]
    steps = [o for o in out if len(o) == 5]
    return {
        "seeds": [info["episode_seed"] for _, info in resets],
        "noops": [info["noops"] for _, info in resets],
        "firsts": [obs for obs, _ in resets],
        "obs": np.stack([o[0] for o in out]),
        "rewards": [s[1] for s in steps],
    }


def paddle(obs: np.ndarray) -> int:
    """Breakout's paddle column (channel 0 is the paddle, on the bottom row)."""
    cols = np.flatnonzero(obs[0, 9])
    assert len(cols) == 1
    return int(cols[0])


# ---------------------------------------------------------------------- ids, options, observations
def test_ids_are_known_and_a_typo_is_one_line_listing_them():
    for env_id in GAMES:
        envs.check_env_id(env_id)
        assert envs.is_minatar(env_id) and not envs.is_atari(env_id)
    assert not envs.is_minatar("ALE/Breakout-v5")
    for bad in ["MinAtar/Breakout-v0", "MinAtar/Breakut-v1", "minatar/Breakout-v1", "MinAtar/Pong-v1"]:
        with pytest.raises(ValueError, match=r"^unknown env id .*MinAtar/Breakout-v1") as e:
            envs.check_env_id(bad)
        assert "\n" not in str(e.value) and "MinAtar/SpaceInvaders-v1" in str(e.value)


def test_options_defaults_and_refusals():
    env = envs.make(BREAKOUT, Sources(0))
    assert env.options == {"sticky_prob": 0.1, "noop_max": 0, "max_episode_steps": 10_000}
    assert env.unwrapped.minatar.sticky_action_prob == 0.0  # MinAtar's own sticky actions are off
    with pytest.raises(ValueError, match="sticky_prob"):
        envs.make(BREAKOUT, Sources(0), sticky_prob=1.5)
    with pytest.raises(ValueError, match="noop_max"):
        envs.make(BREAKOUT, Sources(0), noop_max=-1)
    with pytest.raises(ValueError, match="max_episode_steps"):
        envs.make(BREAKOUT, Sources(0), max_episode_steps=0)
    with pytest.raises(ValueError, match=r"seed in \[0, 2\*\*32\)"):
        env.reset(seed=2**32)


def test_observations_are_minatar_boards_channels_first():
    env = envs.make(BREAKOUT, Sources(0))
    assert env.observation_space == gym.spaces.Box(0, 1, (4, 10, 10), np.uint8)
    assert env.action_space == gym.spaces.Discrete(3)
    assert env.unwrapped.get_action_meanings() == ["NOOP", "LEFT", "RIGHT"]
    obs, _ = env.reset()
    for a in random_actions(env, 5):
        board = env.unwrapped.minatar.state()  # (10, 10, 4) bool
        assert obs.dtype == np.uint8 and obs.flags.c_contiguous and obs in env.observation_space
        assert np.array_equal(obs, board.transpose(2, 0, 1).astype(np.uint8))
        obs, *_ = env.step(int(a))
    # Breakout starts with three rows of bricks (channel 3), the paddle in column 4.
    obs, _ = env.reset(seed=0)
    assert obs[3].sum() == 30 and obs[3, 1:4].all() and paddle(obs) == 4


@pytest.mark.parametrize("env_id", GAMES)
def test_check_env_passes_with_no_unexpected_warning(env_id):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(envs.make(env_id, Sources(0), noop_max=3), skip_render_check=True)
    # The one expected notice: check_env is given the wrapper, not the unwrapped game.
    unexpected = [str(w.message) for w in caught if "different from the unwrapped" not in str(w.message)]
    assert unexpected == []


def test_episode_stats_and_time_limit():
    env = envs.make(BREAKOUT, Sources(2), max_episode_steps=10_000)
    env.reset()
    total, n = 0.0, 0
    for a in random_actions(env, 500, seed=1):
        _, reward, term, trunc, info = env.step(int(a))
        assert info["raw_reward"] == reward and type(reward) is float
        total, n = total + reward, n + 1
        if term or trunc:
            assert info["episode"] == {"r": total, "l": n} and term and not trunc
            break
        assert "episode" not in info
    else:
        pytest.fail("a random Breakout episode lasted 500 steps")
    # The paddle follows the ball only by chance: keep the ball in play by truncating first.
    env = envs.make(BREAKOUT, Sources(2), max_episode_steps=3)
    env.reset()
    flags = [env.step(NOOP)[2:] for _ in range(3)]
    assert [f[1] for f in flags] == [False, False, True] and not any(f[0] for f in flags)
    assert flags[-1][2]["episode"] == {"r": 0.0, "l": 3}


# ---------------------------------------------------------------------- determinism and streams
def test_same_sources_same_trajectories():
    a = episodes(Sources(0), sticky_prob=0.25, noop_max=3)
    b = episodes(Sources(0), sticky_prob=0.25, noop_max=3)
    assert a["seeds"] == b["seeds"] and a["noops"] == b["noops"] and a["rewards"] == b["rewards"]
    assert np.array_equal(a["obs"], b["obs"])
    assert len(a["seeds"]) > 5 and sum(a["rewards"]) > 0  # several episodes, some bricks broken


def test_reset_seed_is_minatars_own_episode_and_touches_no_stream():
    sources = Sources(0)
    env = envs.make(BREAKOUT, sources, sticky_prob=0.0)
    env.reset()  # creates the streams, so an unwanted draw would show below
    before = sources.state_dict()
    acts = random_actions(env, 200, seed=4)
    for seed in [0, 5, 12345]:
        runs = []
        for _ in range(2):
            run = [env.reset(seed=seed)]
            for a in acts:
                run.append(env.step(int(a)))
                if run[-1][2]:
                    break
            runs.append(run)
        assert_same(runs[0], runs[1])
        # The same episode as MinAtar's own Environment seeded with the same seed, sticky actions off.
        ref = minatar.Environment("breakout", sticky_action_prob=0.0)
        ref.seed(seed)
        ref.reset()
        action_set = ref.minimal_action_set()
        for (obs, reward, *_), a in zip(runs[0][1:], acts):
            ref_reward, _ = ref.act(action_set[int(a)])
            assert np.array_equal(obs, ref.state().transpose(2, 0, 1)) and reward == ref_reward
    assert sources.state_dict() == before


def test_env_stream_moves_the_game_and_only_the_game():
    base = episodes(Sources(0), sticky_prob=0.25, noop_max=3)
    other = episodes(Sources(0, streams={"env": {"seed": 7}}), sticky_prob=0.25, noop_max=3)
    n = min(len(base["seeds"]), len(other["seeds"]))
    assert n > 5 and not any(x == y for x, y in zip(base["seeds"][:n], other["seeds"][:n]))
    # Breakout's one random choice at reset is the ball's side: some first boards differ, and so the games.
    assert any(not np.array_equal(x, y) for x, y in zip(base["firsts"][:n], other["firsts"][:n]))
    assert base["noops"][:n] == other["noops"][:n]  # the noop stream did not move


def test_sticky_stream_moves_the_path_but_not_the_starts():
    base = episodes(Sources(0), sticky_prob=0.5, noop_max=3)
    other = episodes(Sources(0, streams={"sticky": {"seed": 7}}), sticky_prob=0.5, noop_max=3)
    n = min(len(base["seeds"]), len(other["seeds"]))
    assert n > 5
    assert base["seeds"][:n] == other["seeds"][:n] and base["noops"][:n] == other["noops"][:n]
    assert all(np.array_equal(x, y) for x, y in zip(base["firsts"][:n], other["firsts"][:n]))
    assert not np.array_equal(base["obs"][: len(other["obs"])], other["obs"][: len(base["obs"])])


def test_noop_stream_moves_the_noop_counts_only():
    base = episodes(Sources(0), sticky_prob=0.25, noop_max=5)
    other = episodes(Sources(0, streams={"noop": {"seed": 7}}), sticky_prob=0.25, noop_max=5)
    n = min(len(base["seeds"]), len(other["seeds"]))
    assert n > 5 and base["seeds"][:n] == other["seeds"][:n]
    assert base["noops"][:n] != other["noops"][:n]
    assert set(base["noops"]) <= set(range(1, 6)) and len(set(base["noops"])) > 2
    # No no-op start: zero NOOP steps and the noop stream is never drawn.
    sources = Sources(0)
    off = episodes(sources, sticky_prob=0.25, noop_max=0)
    assert set(off["noops"]) == {0}
    assert sources.numpy("noop").integers(1 << 62) == Sources(0).numpy("noop").integers(1 << 62)


def test_noop_start_draws_no_sticky_uniforms():
    # So varying the noop stream leaves every agent step's sticky draw where it was.
    a = envs.make(BREAKOUT, Sources(0), sticky_prob=0.5, noop_max=5)
    b = envs.make(BREAKOUT, Sources(0, streams={"noop": {"seed": 7}}), sticky_prob=0.5, noop_max=5)
    differ = 0
    for _ in range(10):
        (_, info_a), (_, info_b) = a.reset(), b.reset()
        differ += info_a["noops"] != info_b["noops"]
        assert a._sticky.bit_generator.state == b._sticky.bit_generator.state
    assert differ > 3


def test_noop_start_takes_noop_steps_and_survives_a_game_over():
    # A reset with k no-ops shows the board MinAtar reaches after k NOOPs from the same seed.
    env = envs.make(BREAKOUT, Sources(0), noop_max=5)
    obs, info = env.reset(seed=3)
    ref = minatar.Environment("breakout", sticky_action_prob=0.0)
    ref.seed(3)
    ref.reset()
    for _ in range(info["noops"]):
        ref.act(0)
    assert 1 <= info["noops"] <= 5 and np.array_equal(obs, ref.state().transpose(2, 0, 1))
    # With up to 40 no-ops the serve is often missed (the game ends on its 6th frame): the game restarts
    # and the episode begins in play.
    env = envs.make(BREAKOUT, Sources(0), noop_max=40)
    game = env.unwrapped
    restarts = []
    restart = game.restart
    game.restart = lambda: restarts.append(1) or restart()
    for seed in range(30):
        obs, info = env.reset(seed=seed)
        assert not game.minatar.env.terminal and obs[1].sum() == 1  # one ball on the board
    assert len(restarts) > 5


def test_sticky_prob_zero_never_repeats_and_positive_does():
    # Breakout's paddle moves one column per LEFT/RIGHT, clipped to the board: from the actions alone we
    # know where it must be unless an action stuck (ours, or MinAtar's own if it were on).
    def mismatches(sticky_prob: float) -> int:
        env = envs.make(BREAKOUT, Sources(1), sticky_prob=sticky_prob, max_episode_steps=10_000)
        obs, _ = env.reset()
        pos, bad = paddle(obs), 0
        for a in random_actions(env, 2000, seed=2):
            obs, _, term, trunc, _ = env.step(int(a))
            pos = max(0, pos - 1) if a == LEFT else min(9, pos + 1) if a == RIGHT else pos
            if paddle(obs) != pos:
                bad += 1
                pos = paddle(obs)
            if term or trunc:
                obs, _ = env.reset()
                pos = paddle(obs)
        return bad

    assert mismatches(0.0) == 0
    assert mismatches(0.25) > 100


# ---------------------------------------------------------------------- state
def restored(env_id: str, sources: Sources, arrays: dict, meta: dict, **options: Any) -> gym.Env:
    """A fresh env and switchboard put into a saved state (after a JSON round trip of the meta)."""
    fresh = Sources(123)
    env = envs.make(env_id, fresh, **options)
    env.reset()  # a different game in progress, to be overwritten
    fresh.load_state_dict(json.loads(json.dumps(sources.state_dict())))
    envs.set_state(env, {k: v.copy() for k, v in arrays.items()}, json.loads(json.dumps(meta)))
    return env


@pytest.mark.parametrize("env_id", GAMES)
def test_state_round_trip_continues_bit_exactly(env_id):
    options = {"sticky_prob": 0.2, "noop_max": 3}
    sources = Sources(3)
    a = envs.make(env_id, sources, **options)
    n_before = 7 if env_id == BREAKOUT else 60  # mid-episode: entities on the board
    acts = random_actions(a, n_before + 400)
    play(a, acts[:n_before])
    b = restored(env_id, sources, *envs.get_state(a), **options)
    out_a = play(a, acts[n_before:], reset=False)
    out_b = play(b, acts[n_before:], reset=False)
    assert_same(out_a, out_b)
    if env_id == BREAKOUT:
        assert sum(len(o) == 2 for o in out_a) >= 5  # across episode boundaries
    assert envs.get_state(a)[1] == envs.get_state(b)[1]


def test_restored_game_shares_one_random_state_and_keeps_its_step_count():
    # The restored RandomState is the one both MinAtar's wrapper and its game draw from; the step count
    # (here 2 of a 4-step limit) carries over.
    sources = Sources(4)
    a = envs.make(BREAKOUT, sources, sticky_prob=0.0, max_episode_steps=4)
    play(a, [RIGHT, RIGHT])
    b = restored(BREAKOUT, sources, *envs.get_state(a), sticky_prob=0.0, max_episode_steps=4)
    assert b.unwrapped.minatar.random is b.unwrapped.minatar.env.random
    acts = random_actions(a, 100, seed=9)
    assert_same(play(a, acts, reset=False), play(b, acts, reset=False))


def corruptions(arrays: dict, meta: dict) -> list[tuple[dict, dict, str]]:
    game = meta["game"]
    return [
        ({k: v for k, v in arrays.items() if k != "game.brick_map"}, meta, "arrays"),
        ({**arrays, "game.brick_map": arrays["game.brick_map"][:9]}, meta, "brick_map"),
        ({**arrays, "game.brick_map": arrays["game.brick_map"].astype(np.float32)}, meta, "float32"),
        ({**arrays, "game.brick_map": arrays["game.brick_map"] * 2}, meta, "other than 0 and 1"),
        ({**arrays, "game_rng_key": arrays["game_rng_key"].astype(np.int64)}, meta, "game_rng_key"),
        (arrays, {**meta, "game": {k: v for k, v in game.items() if k != "ball_x"}}, "game has"),
        (arrays, {**meta, "game": {**game, "ball_x": -1}}, r"game.ball_x = -1 is outside \[0, 9\]"),
        (arrays, {**meta, "game": {**game, "ball_x": 3.0}}, "expected an integer"),
        (arrays, {**meta, "game": {**game, "strike": 1}}, "expected true or false"),
        (arrays, {**meta, "game": {**game, "ball_dir": True}}, "expected an integer"),
        (arrays, {**meta, "game": "bricks"}, "meta 'game'"),
        (arrays, {**meta, "game_rng": {**meta["game_rng"], "pos": 700}}, "game_rng.pos"),
        (arrays, {k: v for k, v in meta.items() if k != "game_rng"}, "no 'game_rng'"),
        (arrays, {**meta, "last_action": 9}, "last_action"),
        (arrays, {**meta, "noops": 9}, "noops"),
        (arrays, {**meta, "prev_action": 3}, "prev_action"),
        (arrays, {**meta, "options": {**meta["options"], "noop_max": 4}}, "options"),
        (arrays, {**meta, "env_id": "MinAtar/Asterix-v1"}, "is for 'MinAtar/Asterix-v1'"),
    ]


def test_corrupt_states_are_one_line_errors_and_change_nothing():
    sources = Sources(0)
    env = envs.make(BREAKOUT, sources, noop_max=3)
    play(env, random_actions(env, 5))
    arrays, meta = envs.get_state(env)
    meta = json.loads(json.dumps(meta))
    for arr, m, message in corruptions(arrays, meta):
        target = envs.make(BREAKOUT, Sources(1), noop_max=3)
        target.reset()
        before = envs.get_state(target)
        with pytest.raises(ValueError, match=message) as e:
            envs.set_state(target, arr, m)
        assert "\n" not in str(e.value) and str(e.value).startswith("invalid env state")
        after = envs.get_state(target)
        assert after[1] == before[1] and all(np.array_equal(after[0][k], v) for k, v in before[0].items())
    envs.set_state(env, arrays, meta)  # and the uncorrupted state loads


def test_corrupt_entity_lists_are_refused():
    def state_of(env_id: str, n: int) -> tuple[gym.Env, dict, dict]:
        env = envs.make(env_id, Sources(0))
        play(env, random_actions(env, n))
        arrays, meta = envs.get_state(env)
        return env, arrays, json.loads(json.dumps(meta))

    env, arrays, meta = state_of("MinAtar/Freeway-v1", 20)
    cars = meta["game"]["cars"]
    for bad, message in [
        ([[0, 1, 0, 0], *cars[1:]], "does not render"),  # speed 0: no trail channel
        (cars[:7], "has 7 entries, expected 8"),
        ([[0, 1, 0], *cars[1:]], "expected 4 fields"),
        ([[0, 11, 0, 1], *cars[1:]], r"cars\[0\]\[1\] = 11"),
    ]:
        with pytest.raises(ValueError, match=message):
            envs.set_state(env, arrays, {**meta, "game": {**meta["game"], "cars": bad}})

    env, arrays, meta = state_of("MinAtar/Asterix-v1", 40)
    lanes = meta["game"]["entities"]
    assert any(e is not None for e in lanes) and any(e is None for e in lanes)
    for bad, message in [([None] * 7 + [[0, 8, "yes", False]], "expected true or false"), (None, "list")]:
        with pytest.raises(ValueError, match=message):
            envs.set_state(env, arrays, {**meta, "game": {**meta["game"], "entities": bad}})


# ---------------------------------------------------------------------- the DQN on MinAtar
def minatar_config(**overrides: Any) -> dqn.Config:
    raw = yaml.safe_load(CONFIG.read_text())
    return config_mod.validate(config_mod.apply_overrides(raw, [f"{k}={v}" for k, v in overrides.items()]))


def test_minatar_cnn_is_young_and_tians_and_nature_cnn_is_refused_one_line():
    net = build_q_network("minatar_cnn", (4, 10, 10), 3, [])
    assert isinstance(net, MinAtarCNN)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert shapes == {
        "conv.weight": (16, 4, 3, 3), "conv.bias": (16,), "hidden.weight": (128, 16 * 8 * 8),
        "hidden.bias": (128,), "out.weight": (3, 128), "out.bias": (3,),
    }  # fmt: skip
    boards = torch.randint(0, 2, (5, 4, 10, 10), dtype=torch.uint8)
    q = net(boards)
    assert q.shape == (5, 3) and q.dtype == torch.float32
    # The functional forward is the module-by-module one.
    x = torch.relu(net.conv(boards.float())).flatten(1)
    assert torch.equal(q, net.out(torch.relu(net.hidden(x))))
    with pytest.raises(ValueError, match="at least 36x36.*minatar_cnn"):
        build_q_network("nature_cnn", (4, 10, 10), 3, [])


def test_dqn_trains_on_breakout_and_its_config_validates():
    cfg = minatar_config(**{"train.steps": 400, "agent.learning_starts": 100, "agent.buffer_size": 1000,
                            "agent.train_frequency": 4, "eval.episodes": 2})  # fmt: skip
    assert cfg.env.id == BREAKOUT and cfg.agent.network == "minatar_cnn"
    torch.set_num_threads(1)
    results = []
    for _ in range(2):
        s = sessions.session_for(cfg, None, "off", sources=Sources.from_config(cfg.sources))
        with s:
            results.append(dqn.run(cfg, s))
    a, b = results
    assert len(a["returns"]) > 10 and len(a["eval_returns"]) == 2 and np.isfinite(a["loss"])
    assert a["returns"] == b["returns"] and a["eval_returns"] == b["eval_returns"] and a["loss"] == b["loss"]
    assert dqn.size(cfg)["data_bytes"] == 1000 * (2 * 400 + 16)  # uint8 boards in the replay buffer


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


def test_dqn_resume_on_breakout_is_bitwise_equal(tmp_path, capsys):
    cfg = minatar_config(**{"train.steps": 500, "agent.learning_starts": 100, "agent.buffer_size": 1000,
                            "agent.train_frequency": 4, "eval.episodes": 0, "verify.checkpoint_every": 0})  # fmt: skip
    torch.set_num_threads(1)
    full = sessions.session_for(cfg, tmp_path / "full", "record")
    with full:
        dqn.run(cfg, full)
    ref: dict = {}

    class Stoppable(Session):
        def __enter__(self):  # noqa: D401
            ref["session"] = self
            return super().__enter__()

    stopped = sessions.session_for(cfg, tmp_path / "resumed", "record", session_type=Stoppable)
    with stopped:
        dqn.run(cfg, stopped, wrap_env=lambda env: StopAt(env, ref, 333))  # mid-episode
    assert stopped.step_index == 333
    rc = main(["train", "--resume", str(tmp_path / "resumed"), "--quiet", "--no-tensorboard"])
    assert rc == 0, capsys.readouterr().err
    a = json.loads((tmp_path / "full" / "manifest.json").read_text())
    b = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert b["status"] == "complete" and b["durable"] == a["durable"]
    commitments = [(tmp_path / run / "commitments").read_bytes() for run in ("full", "resumed")]
    assert commitments[0] == commitments[1]
