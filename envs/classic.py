"""Classic control (CartPole, Acrobot, MountainCar) under the switchboard, with its time limit built in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from detrl.core.sources import Sources
from envs.core import SourcedEnv, check_arrays, generator_from_state, meta_int, meta_value
from envs.ids import CLASSIC_CONTROL


class _Actions(gym.spaces.Discrete):
    """gymnasium's ``Discrete``, answering ``contains`` for a Python int without numpy: every classic-control
    ``step`` asserts it, and numpy's version cost a third of a CartPole step's own time."""

    def __init__(self, n: int, start: int) -> None:
        super().__init__(n, start=start)
        self._first, self._end = start, start + n

    def contains(self, x: Any) -> bool:
        if type(x) is int:
            return self._first <= x < self._end
        return super().contains(x)


class ClassicControl(SourcedEnv):
    """A classic-control env: float32 vector observations, optional sticky actions, a step limit.

    The step limit replaces gymnasium's ``TimeLimit`` (it is the same episode-length counter that the
    statistics keep), and the env is stepped unwrapped, with no order or passive checkers in between.
    The initial state is drawn by the env's own ``np_random``, seeded with the episode seed at each reset.

    Step info: ``raw_reward`` (float), and on the step that ends the episode (terminated or truncated)
    ``episode = {"r": return, "l": length in steps}``.

    Args:
        env_id: one of :data:`envs.ids.CLASSIC_CONTROL`.
        sources: the run's switchboard.
        sticky_prob: probability in [0, 1] that a step repeats the previous action (0 = off).
        max_episode_steps: steps before truncation; None keeps the registered limit (CartPole-v1: 500).
    """

    def __init__(
        self, env_id: str, sources: Sources, sticky_prob: float, max_episode_steps: int | None
    ) -> None:
        spec = gym.spec(env_id)
        limit = spec.max_episode_steps if max_episode_steps is None else int(max_episode_steps)
        if limit is None or limit < 1:
            raise ValueError(f"max_episode_steps must be a positive number of steps, got {limit}")
        options = {"sticky_prob": float(sticky_prob), "max_episode_steps": limit}
        env = gym.make(env_id).unwrapped
        env.action_space = _Actions(int(env.action_space.n), int(env.action_space.start))
        super().__init__(env, sources, env_id, options, sticky_prob)
        self.max_episode_steps = limit
        self._state_size = CLASSIC_CONTROL[env_id]

    def _reset(self, seed: int, from_stream: bool) -> tuple[np.ndarray, dict[str, Any]]:
        obs, _ = self.env.reset(seed=seed)
        self._start_episode(seed, from_stream)
        return np.asarray(obs, dtype=np.float32), {"episode_seed": seed}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One env step; ``action`` may stick (see :meth:`SourcedEnv._sticky_action`)."""
        obs, reward, terminated, truncated, _ = self.env.step(self._sticky_action(int(action)))
        reward = float(reward)
        self._ep_return += reward
        self._ep_length += 1
        truncated = bool(truncated) or self._ep_length >= self.max_episode_steps
        info: dict[str, Any] = {"raw_reward": reward}
        if terminated or truncated:
            info["episode"] = {"r": self._ep_return, "l": self._ep_length}
        return np.asarray(obs, dtype=np.float32), reward, bool(terminated), truncated, info

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        env = self.env
        if env.state is None:
            raise ValueError(f"{self.env_id} has no state before its first reset")
        # MountainCar keeps a tuple after its first step, Acrobot float32 after reset and float64 after a
        # step: the type and dtype are part of the state (they change the arithmetic).
        arrays["state"] = np.array(env.state)
        meta["state_is_tuple"] = isinstance(env.state, tuple)
        meta["np_random"] = env.np_random.bit_generator.state
        if hasattr(env, "steps_beyond_terminated"):  # CartPole
            meta["steps_beyond_terminated"] = env.steps_beyond_terminated
        return arrays, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        state = arrays.get("state")
        dtype = state.dtype.name if isinstance(state, np.ndarray) else "float64"
        if dtype not in ("float32", "float64"):
            dtype = "float64"  # what the error message then asks for
        check_arrays(arrays, {"state": ((self._state_size,), dtype)})
        is_tuple = meta_value(meta, "state_is_tuple", bool)
        rng = generator_from_state(meta_value(meta, "np_random", dict), "np_random")
        env = self.env
        has_steps_beyond = hasattr(env, "steps_beyond_terminated")  # CartPole
        steps_beyond = None
        if has_steps_beyond and meta_value(meta, "steps_beyond_terminated", (int, type(None))) is not None:
            steps_beyond = meta_int(meta, "steps_beyond_terminated")
        common = self._check_common(meta)
        # All checked: now change the env.
        env.state = tuple(state.copy()) if is_tuple else state.copy()
        env.np_random = rng
        if has_steps_beyond:
            env.steps_beyond_terminated = steps_beyond
        self._apply_common(common)
