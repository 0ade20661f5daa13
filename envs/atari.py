"""Atari preprocessing (Mnih et al. 2015; Machado et al. 2018) with every random draw from the switchboard.

The pipeline, innermost first, as in Stable-Baselines3's ``AtariWrapper`` plus sticky actions:

1. sticky actions, per emulator frame: with probability ``sticky_prob`` the previous action is repeated;
2. no-op starts: a new game begins with k ~ Uniform{1..noop_max} NOOP frames;
3. frame skip: an agent step is ``frame_skip`` frames, rewards summed, the last two screens max-pooled;
4. episodic life: losing a life ends the learner's episode (``terminated``); the game goes on, and only
   game over (or truncation) makes the next ``reset`` start a new game;
5. fire on reset: games whose action 1 is FIRE get FIRE then action 2 after every reset (to serve the ball);
6. grayscale (from the ALE) resized to ``screen_size`` squared by exact area averaging;
7. reward clipped to its sign; the raw reward stays in ``info["raw_reward"]``;
8. the last ``frame_stack`` frames stacked channel-first, zeros before the episode's first frame.

It is one wrapper, not eight: the per-frame loop calls the ALE directly, the frame stack is one
preallocated array shifted in place, and no layer builds an info dict it does not need.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ale_py
import gymnasium as gym
import numpy as np

from detrl.core.sources import Sources
from envs.ale import AleGame
from envs.core import SourcedEnv, check_arrays, generator_from_state, meta_int, meta_value
from envs.ids import ale_rom
from envs.resize import AreaResize


class AtariPreprocessing(SourcedEnv):
    """An ``ALE/<Game>-v5`` game, preprocessed for a DQN-style learner.

    Observations: uint8 ``(frame_stack, screen_size, screen_size)``, oldest frame first. Each is a new
    array the learner may keep.

    Step info: ``raw_reward`` (float, unclipped), ``lives``; on the step that ends the *game* (game over
    or truncation, not a lost life) ``episode = {"r": game score, "l": game length in agent steps}``.
    Reset info: ``episode_seed``, ``lives``, and after a new game ``noops`` (NOOP frames taken).

    Args:
        env_id: ``ALE/<Game>-v5``.
        sources: the run's switchboard.
        sticky_prob: per-frame probability in [0, 1] of repeating the previous action.
        noop_max: most NOOP frames at the start of a game; 0 disables no-op starts.
        frame_skip: emulator frames per agent step.
        frame_stack: frames per observation.
        screen_size: side of the resized square frame, in pixels.
        episodic_life: end the learner's episode at each lost life.
        clip_rewards: return the sign of the reward.
        max_episode_steps: agent steps per game before truncation; None keeps the ALE's 108,000 frames.

    ``reset(seed=s)`` always starts a new game (so that ``s`` alone fixes the episode); an unseeded reset
    after a lost life continues the game.
    """

    def __init__(
        self,
        env_id: str,
        sources: Sources,
        *,
        sticky_prob: float,
        noop_max: int,
        frame_skip: int,
        frame_stack: int,
        screen_size: int,
        episodic_life: bool,
        clip_rewards: bool,
        max_episode_steps: int | None,
    ) -> None:
        for name, value, low in [
            ("noop_max", noop_max, 0),
            ("frame_skip", frame_skip, 1),
            ("frame_stack", frame_stack, 1),
            ("screen_size", screen_size, 1),
            ("max_episode_steps", 1 if max_episode_steps is None else max_episode_steps, 1),
        ]:
            if int(value) != value or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value}")
        options = {
            "sticky_prob": float(sticky_prob),
            "noop_max": int(noop_max),
            "frame_skip": int(frame_skip),
            "frame_stack": int(frame_stack),
            "screen_size": int(screen_size),
            "episodic_life": bool(episodic_life),
            "clip_rewards": bool(clip_rewards),
            "max_episode_steps": None if max_episode_steps is None else int(max_episode_steps),
        }
        game = AleGame(ale_rom(env_id))
        super().__init__(game, sources, env_id, options, sticky_prob)
        self.noop_max = options["noop_max"]
        self.frame_skip = options["frame_skip"]
        self.episodic_life = options["episodic_life"]
        self.clip_rewards = options["clip_rewards"]
        self.max_episode_steps = options["max_episode_steps"]

        self._ale = game.ale
        self._action_set = game.action_set
        meanings = game.get_action_meanings()
        if meanings[0] != "NOOP":
            raise ValueError(f"{env_id}: action 0 is {meanings[0]}, not NOOP; no-op starts need it")
        self._fire_reset = len(meanings) >= 3 and meanings[1] == "FIRE"

        height, width = game.observation_space.shape
        self._resize = AreaResize(height, width, screen_size, screen_size)
        self._screens = np.zeros((2, height, width), np.uint8)  # the last two frames of a step, max-pooled
        self._frames = np.zeros((frame_stack, screen_size, screen_size), np.uint8)
        self.observation_space = gym.spaces.Box(0, 255, self._frames.shape, np.uint8)
        self.action_space = gym.spaces.Discrete(len(self._action_set))

        self._lives = 0  # lives at the last step, to see one lost
        self._game_over = True  # the next reset starts a new game
        self._noops = 0  # NOOP frames at the start of the current game

    # ------------------------------------------------------------------ emulator frames
    def _frame(self, action: int) -> float:
        """One emulator frame: ``action``, or the previous action if it sticks. Returns the raw reward."""
        return self._ale.act(self._action_set[self._sticky_action(action)])

    def _skip(self, action: int) -> tuple[np.ndarray, float]:
        """``frame_skip`` frames of ``action`` (fewer if the game ends): ``(resized frame, raw reward)``.

        The frame is the max over the last two screens (Atari sprites flicker between frames), or, when
        the game ended early, the last screen.
        """
        ale, screens, skip = self._ale, self._screens, self.frame_skip
        first_pooled = max(skip - 2, 0)
        reward = 0.0
        for i in range(skip):
            reward += self._frame(action)
            if ale.game_over():
                ale.getScreenGrayscale(screens[0])
                return self._resize(screens[0]), reward
            if i >= first_pooled:
                ale.getScreenGrayscale(screens[i - first_pooled])
        if skip >= 2:
            np.maximum(screens[0], screens[1], out=screens[0])
        return self._resize(screens[0]), reward

    # ------------------------------------------------------------------ reset
    def _reset(self, seed: int, from_stream: bool) -> tuple[np.ndarray, dict[str, Any]]:
        info: dict[str, Any] = {"episode_seed": seed}
        if self._game_over or not from_stream:
            self._new_game(seed, from_stream, info)
            frame = self._resize(self._ale.getScreenGrayscale())
        else:
            # After a lost life: one NOOP step moves past the death animation (as SB3's EpisodicLifeEnv).
            frame = self._reset_step(0, seed, from_stream, info)
        if self._fire_reset:
            self._reset_step(1, seed, from_stream, info)
            frame = self._reset_step(2, seed, from_stream, info)
        self._lives = self._ale.lives()
        info["lives"] = self._lives
        self._frames[:] = 0
        self._frames[-1] = frame
        return self._frames.copy(), info

    def _new_game(self, seed: int, from_stream: bool, info: dict[str, Any]) -> None:
        """Reset the emulator, then take the game's no-op start (its length goes to ``info["noops"]``)."""
        self.env.reset(seed=seed)
        self._start_episode(seed, from_stream)
        self._game_over = False
        self._noops = 0
        if self.noop_max > 0:
            noop = self._episode_rng("noop", seed, from_stream)
            self._noops = int(noop.integers(1, self.noop_max + 1))
            for _ in range(self._noops):
                self._ep_return += self._frame(0)
                if self._ale.game_over():  # only in degenerate games; start afresh, as SB3 does
                    self._ale.reset_game()
        info["noops"] = self._noops

    def _reset_step(self, action: int, seed: int, from_stream: bool, info: dict[str, Any]) -> np.ndarray:
        """An agent step taken by ``reset`` (NOOP after a lost life, FIRE): its reward counts toward the
        game score. A game that ends here (rare: the agent never acted) is reported in ``info["episode"]``
        and replaced by a new one."""
        frame, reward = self._skip(action)
        self._ep_return += reward
        if self._ale.game_over():
            info["episode"] = {"r": self._ep_return, "l": self._ep_length}
            self._new_game(seed, from_stream, info)
            frame, reward = self._skip(action)
            self._ep_return += reward
        return frame

    # ------------------------------------------------------------------ step
    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One agent step (``frame_skip`` emulator frames); see the class docstring for the info keys."""
        frame, raw = self._skip(int(action))
        ale = self._ale
        self._ep_return += raw
        self._ep_length += 1

        lives = ale.lives()
        game_over = ale.game_over(with_truncation=False)
        truncated = ale.game_truncated() or (
            self.max_episode_steps is not None and self._ep_length >= self.max_episode_steps
        )
        life_lost = self.episodic_life and 0 < lives < self._lives
        self._lives = lives
        terminated = game_over or life_lost
        info: dict[str, Any] = {"raw_reward": raw, "lives": lives}
        if game_over or truncated:
            self._game_over = True
            info["episode"] = {"r": self._ep_return, "l": self._ep_length}

        frames = self._frames
        frames[:-1] = frames[1:]
        frames[-1] = frame
        reward = float((raw > 0) - (raw < 0)) if self.clip_rewards else raw
        return frames.copy(), reward, terminated, truncated, info

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        # The emulator's own serialisation (no pickle), with its RNG for completeness.
        raw = self._ale.cloneState(include_rng=True).serialize()
        arrays["ale"] = np.frombuffer(raw, dtype=np.uint8).copy()
        arrays["frames"] = self._frames.copy()
        meta.update(lives=self._lives, game_over=self._game_over, noops=self._noops)
        meta["np_random"] = self.env.np_random.bit_generator.state
        return arrays, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        check_arrays(arrays, {"ale": ((-1,), "uint8"), "frames": (self._frames.shape, "uint8")})
        lives, noops = meta_int(meta, "lives"), meta_int(meta, "noops")
        game_over = meta_value(meta, "game_over", bool)
        np_random = generator_from_state(meta_value(meta, "np_random", dict), "np_random")
        common = self._check_common(meta)
        try:
            ale_state = ale_py.ALEState(arrays["ale"].tobytes())
        except Exception as e:  # nanobind reports malformed bytes as SystemError
            raise ValueError(
                f"invalid env state: emulator state does not decode ({type(e).__name__})"
            ) from None
        try:
            self._ale.restoreState(ale_state)  # the last check (the ALE refuses another game's state) ...
        except Exception as e:
            raise ValueError(f"invalid env state: emulator state rejected ({type(e).__name__})") from None
        # ... and the first change.
        self.env.np_random = np_random
        self._frames[:] = arrays["frames"]
        self._lives, self._game_over, self._noops = lives, game_over, noops
        self._apply_common(common)
