"""A bare Atari game on the Arcade Learning Environment, with no randomness of its own.

We drive ``ale_py.ALEInterface`` directly rather than through ``ale_py.env.AtariEnv`` because:

* ``AtariEnv.reset(seed=...)`` reloads the ROM (about 200 ms here, longer than a random-policy game of
  Breakout), and ``AtariEnv()`` seeds the ALE from the operating system;
* with sticky actions off the emulator does not use its seed at all: RAM trajectories of Breakout, Pong,
  Seaquest, Space Invaders, Ms. Pac-Man, Q*bert, Asterix and Enduro are identical for seeds 0, 999 and
  12345. So we seed it once, with a constant, and load the ROM once. All randomness (sticky actions, no-op
  starts) is added by :class:`envs.atari.AtariPreprocessing` from the switchboard.
"""

from __future__ import annotations

from typing import Any

import ale_py
import gymnasium as gym
import numpy as np
from ale_py import roms

#: Emulator frames per game before the ALE truncates it (the ``ALE/*-v5`` default: 30 minutes at 60 Hz).
MAX_FRAMES_PER_GAME = 108_000


class AleGame(gym.Env[np.ndarray, np.int64]):
    """One Atari game: each :meth:`step` is one emulator frame; observations are grayscale screens.

    Args:
        rom: ale-py ROM id, e.g. ``"breakout"``.
        max_frames: emulator frames per game before truncation.

    Observations are uint8 arrays of shape ``(210, 160)``; actions index the game's minimal action set.
    The preprocessing wrapper uses :attr:`ale` and :attr:`action_set` directly on its hot path.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, rom: str, max_frames: int = MAX_FRAMES_PER_GAME) -> None:
        ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # static: also silences the banner
        self.ale = ale_py.ALEInterface()
        self.ale.setFloat("repeat_action_probability", 0.0)  # sticky actions are ours (see envs.atari)
        self.ale.setInt("random_seed", 0)  # unused with sticky actions off; fixed for good measure
        self.ale.setInt("max_num_frames_per_episode", int(max_frames))
        self.ale.loadROM(str(roms.get_rom_path(rom)))
        self.rom = rom
        self.action_set = list(self.ale.getMinimalActionSet())
        height, width = self.ale.getScreenDims()
        self.observation_space = gym.spaces.Box(0, 255, (height, width), np.uint8)
        self.action_space = gym.spaces.Discrete(len(self.action_set))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a new game. ``seed`` only seeds :attr:`np_random` (gymnasium's contract); the game is
        deterministic."""
        super().reset(seed=seed)
        self.ale.reset_game()
        return self.ale.getScreenGrayscale(), {"lives": self.ale.lives()}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One emulator frame with ``action`` (an index into :attr:`action_set`)."""
        reward = float(self.ale.act(self.action_set[int(action)]))
        terminated = self.ale.game_over(with_truncation=False)
        truncated = self.ale.game_truncated()
        return self.ale.getScreenGrayscale(), reward, terminated, truncated, {"lives": self.ale.lives()}

    def get_action_meanings(self) -> list[str]:
        """Names of the actions, e.g. ``["NOOP", "FIRE", "RIGHT", "LEFT"]`` for Breakout."""
        return [a.name for a in self.action_set]
