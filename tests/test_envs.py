"""Environments under the switchboard: gymnasium's checker, stream independence, exact save/restore."""

import json
import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from detrl import Sources
from envs.resize import AreaResize

CLASSIC = ["CartPole-v1", "Acrobot-v1", "MountainCar-v0"]
BREAKOUT = "ALE/Breakout-v5"


def play(env, actions, reset=True):
    """Step through ``actions``, resetting after each episode; every return value, in order."""
    out = [env.reset()] if reset else []
    for a in actions:
        step = env.step(int(a))
        out.append(step)
        if step[2] or step[3]:
            out.append(env.reset())
    return out


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, np.ndarray):
                assert u.dtype == v.dtype and np.array_equal(u, v)
            else:
                assert type(u) is type(v) and u == v


def observations(out):
    return np.stack([o[0] for o in out])


def actions(env, n, seed=0):
    return np.random.default_rng(seed).integers(env.action_space.n, size=n)


# ---------------------------------------------------------------------- ids and options
def test_ids_are_checked_cheaply_with_a_one_line_error():
    for env_id in [*CLASSIC, BREAKOUT, "ALE/SpaceInvaders-v5"]:
        envs.check_env_id(env_id)
    assert envs.is_atari(BREAKOUT) and not envs.is_atari("CartPole-v1")
    for bad in ["Foo-v9", "ALE/NotAGame-v5", "ALE/Breakout-v4", "BreakoutNoFrameskip-v4", "CartPole-v0"]:
        with pytest.raises(ValueError, match=r"^unknown env id .*supported: CartPole-v1") as e:
            envs.check_env_id(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown env id 'Foo-v9'"):
        envs.make("Foo-v9", Sources(0))


def test_noop_starts_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="no-op starts are for Atari"):
        envs.make("CartPole-v1", Sources(0), noop_max=30)
    envs.make("CartPole-v1", Sources(0), noop_max=0)  # 0 means none: allowed
    with pytest.raises(ValueError, match="sticky_prob"):
        envs.make("CartPole-v1", Sources(0), sticky_prob=1.5)
    with pytest.raises(ValueError, match="frame_skip"):
        envs.make(BREAKOUT, Sources(0), frame_skip=0)


# ---------------------------------------------------------------------- gymnasium's checker
@pytest.mark.parametrize("env_id", [*CLASSIC, BREAKOUT])
def test_check_env_passes(env_id):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "wrapped env" and infinite-bounds notices
        check_env(envs.make(env_id, Sources(0)), skip_render_check=True)


# ---------------------------------------------------------------------- determinism and streams
def test_classic_same_sources_same_trajectory_and_env_stream_moves_initial_states():
    runs = {}
    for name, sources in [
        ("a", Sources(0)),
        ("b", Sources(0)),
        ("env", Sources(0, streams={"env": {"seed": 7}})),
    ]:
        env = envs.make("CartPole-v1", sources, sticky_prob=0.25)
        runs[name] = play(env, actions(env, 200))
    assert_same(runs["a"], runs["b"])
    first = [o[0] for o in runs["a"] if len(o) == 2]
    other = [o[0] for o in runs["env"] if len(o) == 2]
    assert len(first) > 3 and not any(np.array_equal(x, y) for x, y in zip(first, other))
    assert all(o[0].dtype == np.float32 for o in runs["a"])


def test_classic_sticky_stream_changes_the_path_but_not_the_initial_states():
    def run(sources):
        env = envs.make("CartPole-v1", sources, sticky_prob=0.5)
        acts = actions(env, 150)
        starts = [env.reset()[0]]
        path = []
        for a in acts:
            obs, _, term, trunc, _ = env.step(int(a))
            path.append(obs)
            if term or trunc:
                starts.append(env.reset()[0])
        return starts, np.stack(path)

    starts_a, path_a = run(Sources(0))
    starts_b, path_b = run(Sources(0, streams={"sticky": {"seed": 7}}))
    n = min(len(starts_a), len(starts_b))
    assert n > 3 and all(np.array_equal(x, y) for x, y in zip(starts_a[:n], starts_b[:n]))
    assert not np.array_equal(path_a, path_b)


def test_classic_time_limit_truncates_and_reports_the_episode():
    env = envs.make("CartPole-v1", Sources(0), max_episode_steps=5)
    env.reset(seed=0)
    for t in range(5):
        _, _, term, trunc, info = env.step(t % 2)  # alternate: the pole stays up for 5 steps
        assert not term and trunc == (t == 4)
    assert info["episode"] == {"r": 5.0, "l": 5}


def breakout_games(sources, n_steps=120):
    """Short Breakout games (truncated at 25 agent steps): the no-op count of each game, the seed of each
    reset, all observations."""
    env = envs.make(BREAKOUT, sources, max_episode_steps=25)
    out = play(env, actions(env, n_steps))
    resets = [o[1] for o in out if len(o) == 2]
    noops = [r["noops"] for r in resets if "noops" in r]
    return noops, [r["episode_seed"] for r in resets], observations(out)


def test_breakout_same_sources_same_trajectory():
    noops, seeds, obs = breakout_games(Sources(0))
    noops_b, seeds_b, obs_b = breakout_games(Sources(0))
    assert (noops, seeds) == (noops_b, seeds_b) and np.array_equal(obs, obs_b)
    assert len(set(noops)) > 1


def test_breakout_each_stream_moves_only_its_own_source():
    # Lives are lost at other times on other paths, so the runs see different numbers of resets within
    # the same steps: compare the k-th game's no-op count and the k-th reset's seed.
    def same_prefix(xs, ys):
        n = min(len(xs), len(ys))
        return n >= 3 and xs[:n] == ys[:n]

    noops, seeds, obs = breakout_games(Sources(0))

    # sticky: same no-op counts and episode seeds, another path.
    noops_s, seeds_s, obs_s = breakout_games(Sources(0, streams={"sticky": {"seed": 7}}))
    assert same_prefix(noops_s, noops) and same_prefix(seeds_s, seeds)
    assert not np.array_equal(obs_s, obs)

    # noop: other no-op counts, same episode seeds.
    noops_n, seeds_n, _ = breakout_games(Sources(0, streams={"noop": {"seed": 7}}))
    assert not same_prefix(noops_n, noops) and same_prefix(seeds_n, seeds)

    # env: other episode seeds, same no-op counts; and as the ALE ignores its seed (see envs.ale), with
    # the same sticky and no-op draws the games are identical.
    noops_e, seeds_e, obs_e = breakout_games(Sources(0, streams={"env": {"seed": 7}}))
    assert noops_e == noops and not same_prefix(seeds_e, seeds)
    assert np.array_equal(obs_e, obs)


def test_explicit_seed_touches_no_stream_and_fixes_the_episode():
    for env_id in ["CartPole-v1", BREAKOUT]:
        sources = Sources(0)
        env = envs.make(env_id, sources, sticky_prob=0.5)
        env.reset()  # creates the env stream, so an unwanted draw would show below
        before = sources.state_dict()
        acts = actions(env, 40)
        runs = []
        for _ in range(2):
            obs, info = env.reset(seed=5)
            run = [(obs, info)]
            for a in acts[:30]:
                run.append(env.step(int(a)))
                if run[-1][2] or run[-1][3]:
                    break
            runs.append(run)
        assert_same(runs[0], runs[1])
        assert sources.state_dict() == before, env_id


# ---------------------------------------------------------------------- Atari preprocessing
def test_breakout_observations_rewards_and_game_score():
    env = envs.make(BREAKOUT, Sources(1))
    obs, info = env.reset()
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and obs in env.observation_space
    assert not obs[:3].any() and obs[3].any()  # zeros before the episode's first frame
    raw_total, lengths, episode = 0.0, 0, None
    for a in actions(env, 3000, seed=3):
        obs, reward, term, trunc, info = env.step(int(a))
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        assert reward in (-1.0, 0.0, 1.0) and reward == np.sign(info["raw_reward"])
        raw_total += info["raw_reward"]
        lengths += 1
        if "episode" in info:
            episode = info["episode"]
            break
        if term or trunc:  # a lost life: the game goes on
            assert info["lives"] > 0
            env.reset()
    assert episode == {"r": raw_total, "l": lengths} and raw_total > 0


def test_area_resize_is_the_exact_area_mean():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (210, 160), dtype=np.uint8)

    # Reference: each output pixel is the mean over its (fractional) input area, in exact rationals scaled
    # to integers: 210 -> 84 in steps of 2.5 rows, 160 -> 84 in steps of 40/21 columns.
    def weights(n_in, n_out):
        w = np.zeros((n_out, n_in), np.int64)
        for j in range(n_out):
            for i in range(n_in):
                w[j, i] = max(0, min(n_in * (j + 1), n_out * (i + 1)) - max(n_in * j, n_out * i))
        return w

    total = weights(210, 84) @ img.astype(np.int64) @ weights(160, 84).T
    norm = 210 * 160
    expected = (total + norm // 2) // norm
    assert np.array_equal(AreaResize(210, 160, 84, 84)(img), expected.astype(np.uint8))


# ---------------------------------------------------------------------- state
def restored(env_id, sources, arrays, meta, **options):
    """A fresh env and switchboard put into a saved state (after a JSON round trip of the meta)."""
    fresh = Sources(123)
    fresh.load_state_dict(json.loads(json.dumps(sources.state_dict())))
    env = envs.make(env_id, fresh, **options)
    envs.set_state(env, {k: v.copy() for k, v in arrays.items()}, json.loads(json.dumps(meta)))
    return env


@pytest.mark.parametrize(
    "env_id, options, n_before",
    [
        ("CartPole-v1", {"sticky_prob": 0.3}, 17),
        ("Acrobot-v1", {"max_episode_steps": 40}, 0),  # right after reset: a float32 state
        ("MountainCar-v0", {"sticky_prob": 0.3, "max_episode_steps": 50}, 30),  # a tuple state
        (BREAKOUT, {"max_episode_steps": 100}, 60),
    ],
)
def test_state_round_trip_continues_bit_exactly(env_id, options, n_before):
    sources = Sources(3)
    a = envs.make(env_id, sources, **options)
    acts = actions(a, n_before + 300)
    play(a, acts[:n_before])
    b = restored(env_id, sources, *envs.get_state(a), **options)
    out_a = play(a, acts[n_before:], reset=False)
    out_b = play(b, acts[n_before:], reset=False)
    assert sum(len(o) == 2 for o in out_a) >= 2  # across episode boundaries
    assert_same(out_a, out_b)


def test_bad_states_are_one_line_errors():
    sources = Sources(0)
    cart = envs.make("CartPole-v1", sources)
    cart.reset()
    arrays, meta = envs.get_state(cart)
    bad = [
        ({}, meta, "arrays"),
        ({"state": arrays["state"].astype(np.int64)}, meta, "int64"),
        ({"state": arrays["state"][:3]}, meta, "expected float64 4"),
        (arrays, {**meta, "env_id": "Acrobot-v1"}, "is for 'Acrobot-v1'"),
        (arrays, {**meta, "options": {**meta["options"], "sticky_prob": 0.5}}, "options"),
        (arrays, {k: v for k, v in meta.items() if k != "ep_length"}, "no 'ep_length'"),
        (arrays, {**meta, "prev_action": 9}, "prev_action"),
        (arrays, {**meta, "sticky_rng": {"bit_generator": "MT19937"}}, "PCG64"),
    ]
    for arr, m, message in bad:
        with pytest.raises(ValueError, match=message) as e:
            envs.set_state(envs.make("CartPole-v1", Sources(0)), arr, m)
        assert "\n" not in str(e.value)

    breakout = envs.make(BREAKOUT, sources)
    breakout.reset()
    arrays, meta = envs.get_state(breakout)
    for arr, message in [
        ({**arrays, "ale": arrays["ale"][:100]}, "emulator state"),
        ({**arrays, "frames": arrays["frames"][:, :80]}, "frames"),
    ]:
        with pytest.raises(ValueError, match=message):
            envs.set_state(breakout, arr, meta)
