"""Replay buffers: uniform sampling with indices drawn from the run's ``replay`` stream.

Both buffers keep a running SHA-256 *hash chain* of every transition added; its 32 bytes go into each
step's commitment (``Session.attach``), so the commitment binds the buffer's whole history — and with it
its contents — at the cost of hashing one transition per step.

:class:`ReplayBuffer` stores vector observations as they are. :class:`FrameReplayBuffer` stores Atari
frame stacks as single uint8 frames: the newest frame of ``obs`` and of ``next_obs`` per transition, and
rebuilds the ``(stack, H, W)`` stacks when sampling (older frames are the previous transitions' newest
ones; before an episode's first frame they are zeros, as the frame-stack wrapper leaves them). That is 2 frames per
transition instead of the 2 x stack frames of storing both stacks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Any

import numpy as np


@dataclasses.dataclass
class Transitions:
    """A sampled minibatch; leading dimension ``batch``."""

    obs: np.ndarray  # (batch, *obs_shape)
    actions: np.ndarray  # (batch,) int64
    rewards: np.ndarray  # (batch,) float32
    next_obs: np.ndarray  # (batch, *obs_shape)
    terminated: np.ndarray  # (batch,) float32: 1.0 where the episode ended in a terminal state


class _Base:
    """Ring storage of actions, rewards, termination flags, with the hash chain and (re)storing."""

    def __init__(self, capacity: int, chain: bool = True) -> None:
        if capacity < 1:
            raise ValueError("buffer capacity must be at least 1")
        self.capacity = capacity
        self.actions = np.zeros(capacity, np.int64)
        self.rewards = np.zeros(capacity, np.float32)
        self.terminated = np.zeros(capacity, np.float32)
        self.pos = 0  # next slot to write
        self.size = 0
        self._chain = bytes(32)
        self.chain = chain  # off when nothing is committed (Session mode "off"): saves a hash per step

    def __len__(self) -> int:
        return self.size

    def _record(self, action: int, reward: float, terminated: bool, *stored: np.ndarray) -> None:
        """Write the scalars at ``pos``, extend the hash chain with them and the ``stored`` arrays, advance."""
        i = self.pos
        self.actions[i] = action
        self.rewards[i] = reward
        self.terminated[i] = float(terminated)
        if self.chain:
            h = hashlib.sha256(self._chain)
            for a in stored:
                h.update(a)  # contiguous rows of the storage arrays: hashed without a copy
            h.update(struct.pack("<qf?", int(action), float(self.rewards[i]), bool(terminated)))
            self._chain = h.digest()
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def digest(self) -> bytes:
        """The hash chain over every transition added so far (32 bytes)."""
        return self._chain

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"actions": self.actions, "rewards": self.rewards, "terminated": self.terminated}

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        n = self.size
        arrays = {k: v[:n] for k, v in self._arrays().items()}
        return arrays, {"pos": self.pos, "size": n, "capacity": self.capacity, "chain": self._chain.hex()}

    def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        n, pos = int(meta["size"]), int(meta["pos"])
        if int(meta["capacity"]) != self.capacity or not (
            0 <= n <= self.capacity and 0 <= pos < self.capacity
        ):
            raise ValueError("replay buffer: capacity, size or position does not fit this config")
        for k, v in self._arrays().items():
            if k not in arrays:
                raise ValueError(f"replay buffer: missing array {k!r}")
            a = np.asarray(arrays[k])
            if a.shape != (n, *v.shape[1:]) or a.dtype != v.dtype:
                raise ValueError(f"replay buffer: array {k!r} has shape {a.shape} {a.dtype}")
            v[:n] = a
        chain = bytes.fromhex(str(meta["chain"]))
        if len(chain) != 32:
            raise ValueError("replay buffer: hash chain must be 32 bytes")
        self.size, self.pos, self._chain = n, pos, chain

    def _draw(self, rng: np.random.Generator, batch_size: int, unusable: int = 0) -> np.ndarray:
        """``batch_size`` slots drawn uniformly (with replacement), skipping the ``unusable`` oldest ones."""
        usable = self.size - (unusable if self.size == self.capacity else 0)
        if usable < 1:
            raise ValueError("cannot sample from an empty replay buffer")
        u = rng.integers(0, usable, batch_size)  # one draw per row: the stream moves the same every update
        return (
            (u + (self.pos + unusable) % self.capacity) % self.capacity if self.size == self.capacity else u
        )


class ReplayBuffer(_Base):
    """Transitions with vector observations of ``obs_shape`` (stored as ``obs_dtype``)."""

    def __init__(
        self, capacity: int, obs_shape: tuple[int, ...], obs_dtype: Any = np.float32, chain: bool = True
    ) -> None:
        super().__init__(capacity, chain)
        self.obs = np.zeros((capacity, *obs_shape), obs_dtype)
        self.next_obs = np.zeros((capacity, *obs_shape), obs_dtype)

    def add(
        self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, terminated: bool, first: bool
    ) -> None:
        """Store one transition. ``first``: ``obs`` is the first observation of an episode (unused here)."""
        self.obs[self.pos] = obs
        self.next_obs[self.pos] = next_obs
        self._record(action, reward, terminated, self.obs[self.pos], self.next_obs[self.pos])

    def sample(self, rng: np.random.Generator, batch_size: int) -> Transitions:
        i = self._draw(rng, batch_size)
        return Transitions(
            self.obs[i], self.actions[i], self.rewards[i], self.next_obs[i], self.terminated[i]
        )

    def _arrays(self) -> dict[str, np.ndarray]:
        return {**super()._arrays(), "obs": self.obs, "next_obs": self.next_obs}


class FrameReplayBuffer(_Base):
    """Transitions of uint8 frame stacks ``(stack, H, W)``, stored as single frames (see module docstring)."""

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], chain: bool = True) -> None:
        if capacity <= obs_shape[0]:
            raise ValueError(f"a frame buffer needs more than {obs_shape[0]} slots")
        super().__init__(capacity, chain)
        self.stack = obs_shape[0]
        self.frames = np.zeros((capacity, *obs_shape[1:]), np.uint8)  # newest frame of obs
        self.next_frames = np.zeros((capacity, *obs_shape[1:]), np.uint8)  # newest frame of next_obs
        self.age = np.zeros(capacity, np.int64)  # frames of this episode before obs's newest, capped
        self._age = 0

    def add(
        self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, terminated: bool, first: bool
    ) -> None:
        """Store one transition; ``first`` says ``obs`` is an episode's first observation (after reset)."""
        self._age = 0 if first else min(self._age + 1, self.stack - 1)
        i = self.pos
        self.frames[i] = obs[-1]
        self.next_frames[i] = next_obs[-1]
        self.age[i] = self._age
        self._record(action, reward, terminated, self.frames[i], self.next_frames[i], self.age[i : i + 1])

    def sample(self, rng: np.random.Generator, batch_size: int) -> Transitions:
        # When full, the oldest stack-1 slots may need frames already overwritten: they are not drawn.
        i = self._draw(rng, batch_size, unusable=self.stack - 1)
        return Transitions(
            self._stack(i, False), self.actions[i], self.rewards[i], self._stack(i, True), self.terminated[i]
        )

    def _stack(self, i: np.ndarray, nxt: bool) -> np.ndarray:
        """Rebuild ``(batch, stack, H, W)``, column ``k`` counted back from the newest frame; columns from
        before the episode's first frame are zeros, as the frame-stack wrapper leaves them."""
        age = self.age[i]
        out = np.zeros((len(i), self.stack, *self.frames.shape[1:]), np.uint8)
        for k in range(self.stack):  # k = 0 is the newest frame
            if nxt and k == 0:
                out[:, -1] = self.next_frames[i]
                continue
            back = k - 1 if nxt else k  # how many transitions back the frame was the newest of obs
            rows = np.nonzero(back <= age)[0]
            out[rows, self.stack - 1 - k] = self.frames[(i[rows] - back) % self.capacity]
        return out

    def _arrays(self) -> dict[str, np.ndarray]:
        return {**super()._arrays(), "frames": self.frames, "next_frames": self.next_frames, "age": self.age}

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        arrays, meta = super().state()
        return arrays, {**meta, "episode_age": self._age}

    def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        super().load_state(arrays, meta)
        self._age = int(meta["episode_age"])
