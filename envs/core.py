"""What every detrl env shares: episode seeds from the switchboard, per-episode generators, episode stats.

Seeds, one reset at a time:

* ``reset()`` draws the *episode seed* from the ``env`` stream (exactly one draw per reset) and hands it
  to the wrapped env, so the initial state is a function of that stream alone.
* Sticky actions and no-op starts each get a *per-episode generator*, seeded by one draw from their own
  stream (``sticky``, ``noop``). Streams are independent, so changing one stream's seed changes only its
  own source: initial states do not move when ``sticky`` changes, no-op counts do not move when ``env``
  changes, and so on.
* ``reset(seed=s)`` (evaluation, ``check_env``) touches no stream: the wrapped env gets ``s`` and the
  per-episode generators are derived from ``s`` by SHA-256, so ``s`` alone fixes the episode, as gymnasium
  expects.

Generators of the switchboard are looked up at each use (``sources.numpy(name)``), never kept, because
:meth:`detrl.Sources.load_state_dict` replaces them. Per-episode generators are ours and saved with the
env state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from detrl.core.sources import Sources

#: Episode seeds are drawn in ``[0, 2**31)``.
EPISODE_SEED_RANGE = 2**31


def derived_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for source ``name`` of the episode started by ``reset(seed=seed)``."""
    digest = hashlib.sha256(f"detrl/episode/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SourcedEnv(gym.Wrapper):
    """Base of detrl's env wrappers: episode seeding, sticky-action state and episode statistics.

    Subclasses implement :meth:`_reset` (given the episode seed), ``step``, and their part of the state.

    Args:
        env: the wrapped gymnasium env.
        sources: the run's switchboard (streams ``env``, ``sticky``, ``noop``).
        env_id: the id this env was made from (saved with, and checked against, the state).
        options: the :func:`envs.make` options that shape the env (saved and checked likewise).
        sticky_prob: probability in [0, 1] of repeating the previous action instead of the chosen one.
    """

    def __init__(
        self, env: gym.Env, sources: Sources, env_id: str, options: Mapping[str, Any], sticky_prob: float
    ) -> None:
        super().__init__(env)
        if not 0.0 <= sticky_prob <= 1.0:
            raise ValueError(f"sticky_prob must be in [0, 1], got {sticky_prob}")
        self.sources = sources
        self.env_id = env_id
        self.options = dict(options)
        self.sticky_prob = float(sticky_prob)
        self._sticky = np.random.Generator(np.random.PCG64(0))  # replaced at every (real) reset
        self._prev_action = 0  # the action last executed, repeated when an action sticks
        self._ep_return = 0.0  # raw (unclipped) reward summed over the episode (Atari: the whole game)
        self._ep_length = 0  # agent steps in the episode (Atari: the whole game)

    @property
    def spec(self) -> None:  # type: ignore[override]
        """None: this env is not rebuilt from a registry spec (it needs a :class:`~detrl.Sources`), and
        unseeded resets draw from the ``env`` stream, not from a generator seeded by the last
        ``reset(seed=...)``, which gymnasium's checker would otherwise hold against it."""
        return None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode; without ``seed``, its seed is one draw from the ``env`` stream.

        The reset info holds ``episode_seed``.
        """
        from_stream = seed is None
        if from_stream:
            seed = int(self.sources.numpy("env").integers(EPISODE_SEED_RANGE))
        return self._reset(int(seed), from_stream)

    def _reset(self, seed: int, from_stream: bool) -> tuple[np.ndarray, dict[str, Any]]:
        raise NotImplementedError

    def _episode_rng(self, name: str, seed: int, from_stream: bool) -> np.random.Generator:
        """The per-episode generator of source ``name``: seeded by one draw from stream ``name`` during
        training, derived from the explicit ``seed`` otherwise."""
        if from_stream:
            gen_seed = int(self.sources.numpy(name).integers(1 << 63))
        else:
            gen_seed = derived_seed(seed, name)
        return np.random.Generator(np.random.PCG64(gen_seed))

    def _start_episode(self, seed: int, from_stream: bool) -> None:
        """Reset what every env keeps per episode: sticky generator, previous action, statistics."""
        self._sticky = self._episode_rng("sticky", seed, from_stream)
        self._prev_action = 0
        self._ep_return = 0.0
        self._ep_length = 0

    def _sticky_action(self, action: int) -> int:
        """The action to execute this frame: ``action``, or with probability ``sticky_prob`` the previous one.

        Draws exactly one uniform per call, whatever ``sticky_prob`` is, so consumption never varies.
        """
        if self._sticky.random() >= self.sticky_prob:
            self._prev_action = action
        return self._prev_action

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Arrays and JSON-able meta of this wrapper and the env under it (see :func:`envs.get_state`)."""
        meta = {
            "prev_action": self._prev_action,
            "ep_return": self._ep_return,
            "ep_length": self._ep_length,
            "sticky_rng": self._sticky.bit_generator.state,
        }
        return {}, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` saved (subclasses check their part first, then call this)."""
        self._apply_common(self._check_common(meta))

    def _check_common(self, meta: Mapping[str, Any]) -> tuple[int, float, int, np.random.Generator]:
        """The base part of ``meta``, checked: ``(prev_action, ep_return, ep_length, sticky generator)``."""
        prev = meta_int(meta, "prev_action")
        if not 0 <= prev < int(self.action_space.n):
            raise ValueError(f"invalid env state: prev_action {prev} is not an action of {self.env_id}")
        ep_length = meta_int(meta, "ep_length")
        if ep_length < 0:
            raise ValueError(f"invalid env state: ep_length {ep_length} < 0")
        sticky = generator_from_state(meta_value(meta, "sticky_rng", dict), "sticky_rng")
        return prev, meta_float(meta, "ep_return"), ep_length, sticky

    def _apply_common(self, common: tuple[int, float, int, np.random.Generator]) -> None:
        self._prev_action, self._ep_return, self._ep_length, self._sticky = common


# ---------------------------------------------------------------------- checks of untrusted state
def check_arrays(arrays: Mapping[str, Any], expected: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Raise ``ValueError`` unless ``arrays`` has exactly the keys of ``expected``, each an ndarray of
    that shape and dtype. A ``-1`` in a shape matches any length."""
    if set(arrays) != set(expected):
        raise ValueError(f"invalid env state: arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        a = arrays[name]
        if not isinstance(a, np.ndarray):
            raise ValueError(f"invalid env state: array {name!r} is a {type(a).__name__}, not an ndarray")
        ok = a.ndim == len(shape) and all(e in (-1, n) for e, n in zip(shape, a.shape))
        if not ok or a.dtype != np.dtype(dtype):
            want = "x".join("*" if n == -1 else str(n) for n in shape)
            got = "x".join(map(str, a.shape))
            raise ValueError(f"invalid env state: array {name!r} is {a.dtype} {got}, expected {dtype} {want}")


def meta_value(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``meta[key]``, which must exist and be an instance of ``kind`` (else a one-line ``ValueError``)."""
    if key not in meta:
        raise ValueError(f"invalid env state: meta has no {key!r}")
    value = meta[key]
    # bool is an int in Python; a flag where a count belongs (or the reverse) is a corrupt state.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise ValueError(f"invalid env state: meta {key!r} is {value!r}")
    return value


def meta_int(meta: Mapping[str, Any], key: str) -> int:
    return int(meta_value(meta, key, int))


def meta_float(meta: Mapping[str, Any], key: str) -> float:
    return float(meta_value(meta, key, (int, float)))


def generator_from_state(state: Mapping[str, Any], what: str) -> np.random.Generator:
    """A PCG64 ``Generator`` at the position ``state`` (a ``bit_generator.state`` dict), validated."""
    if state.get("bit_generator") != "PCG64":
        raise ValueError(f"invalid env state: {what} is not a PCG64 state")
    bit_generator = np.random.PCG64(0)
    try:
        bit_generator.state = dict(state)
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise ValueError(f"invalid env state: {what}: {e}") from None
    return np.random.Generator(bit_generator)
