"""Replay buffers: frame stacks rebuilt exactly, sampling from the replay stream, state round trips."""

from __future__ import annotations

import numpy as np
import pytest

import envs
from agents.buffers import FrameReplayBuffer, ReplayBuffer
from detrl import Sources


def _fill_from_breakout(buf: FrameReplayBuffer, steps: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Random play with lives lost and games over; returns slot -> (obs, next_obs) as the env gave them."""
    env = envs.make("ALE/Breakout-v5", Sources(seed=3))
    rng = np.random.default_rng(0)
    truth: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    obs, _ = env.reset()
    first, resets = True, 0
    for _ in range(steps):
        action = int(rng.integers(env.action_space.n))
        nxt, reward, terminated, truncated, _ = env.step(action)
        truth[buf.pos] = (obs.copy(), nxt.copy())
        buf.add(obs, action, float(reward), nxt, terminated, first)
        obs, first = nxt, False
        if terminated or truncated:
            obs, _ = env.reset()
            first, resets = True, resets + 1
    env.close()
    assert resets >= 3  # episode boundaries inside the window
    return truth


def test_frame_buffer_rebuilds_the_stacks_the_env_returned():
    buf = FrameReplayBuffer(300, (4, 84, 84))
    truth = _fill_from_breakout(buf, 700)  # wraps around twice
    usable = [(buf.pos + 3 + u) % buf.capacity for u in range(buf.capacity - 3)]
    idx = np.array(usable)
    got_obs, got_next = buf._stack(idx, False), buf._stack(idx, True)
    for row, slot in enumerate(usable):
        want_obs, want_next = truth[slot]
        assert np.array_equal(got_obs[row], want_obs), slot
        assert np.array_equal(got_next[row], want_next), slot
    assert buf.frames.nbytes + buf.next_frames.nbytes == 2 * 300 * 84 * 84  # 2 frames per transition


def test_sampling_draws_from_the_stream_only_and_never_stale_slots():
    buf = FrameReplayBuffer(300, (4, 84, 84))
    _fill_from_breakout(buf, 350)
    a = buf.sample(np.random.default_rng(5), 4096)
    b = buf.sample(np.random.default_rng(5), 4096)
    assert all(np.array_equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    drawn = buf._draw(np.random.default_rng(1), 20000, unusable=3)
    stale = {buf.pos, (buf.pos + 1) % 300, (buf.pos + 2) % 300}
    assert not stale & set(drawn.tolist()) and len(set(drawn.tolist())) == 297


@pytest.mark.parametrize("kind", ["vector", "frames"])
def test_state_round_trip_keeps_contents_position_and_hash_chain(kind):
    rng = np.random.default_rng(0)
    shape = (4,) if kind == "vector" else (4, 8, 8)
    make = (lambda: ReplayBuffer(50, shape)) if kind == "vector" else (lambda: FrameReplayBuffer(50, shape))
    a, b = make(), make()
    for t in range(80):
        o = (
            rng.random(shape).astype(np.float32)
            if kind == "vector"
            else rng.integers(0, 255, shape, np.uint8)
        )
        n = (
            rng.random(shape).astype(np.float32)
            if kind == "vector"
            else rng.integers(0, 255, shape, np.uint8)
        )
        a.add(o, t % 2, 1.0, n, t % 13 == 0, t % 13 == 1)
    arrays, meta = a.state()
    b.load_state(arrays, meta)
    assert b.digest() == a.digest() and (b.pos, b.size) == (a.pos, a.size)
    sa, sb = a.sample(np.random.default_rng(2), 64), b.sample(np.random.default_rng(2), 64)
    assert all(np.array_equal(x, y) for x, y in zip(vars(sa).values(), vars(sb).values()))
    a.add(o, 0, 0.5, n, False, False)
    assert a.digest() != b.digest()  # the chain binds every transition
    with pytest.raises(ValueError, match="replay buffer"):
        b.load_state({**arrays, "rewards": arrays["rewards"][:-1]}, meta)
