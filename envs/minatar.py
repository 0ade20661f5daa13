"""MinAtar (Young & Tian 2019) under the switchboard: five 10x10 Atari-like games, every random draw routed.

MinAtar's games are pure Python: each keeps its state in plain attributes and draws its randomness (where
the ball starts, when and where enemies spawn, car speeds) from a ``numpy.random.RandomState`` that
``minatar.Environment.seed`` shares between the wrapper and the game. Here:

* the game's ``RandomState`` is reseeded from the *episode seed* at every reset (``Environment.seed``),
  so in training it is the ``env`` stream that decides the game's randomness, and ``reset(seed=s)`` with
  our sticky actions and no-op starts off plays exactly the episode MinAtar itself plays after
  ``Environment.seed(s)`` (a test compares the two);
* MinAtar's own sticky actions are off (``sticky_action_prob=0``); ours repeat the previous action with
  probability ``sticky_prob`` (default 0.1, MinAtar's own default) per agent step, drawn from the
  episode's generator of the ``sticky`` stream (see :mod:`envs.core`);
* optional no-op starts take k ~ Uniform{1..noop_max} NOOP steps at reset, k from the ``noop`` stream.

``minatar.Environment.act`` still draws one uniform from the game's ``RandomState`` per step for its
(disabled) sticky check: that draw is part of MinAtar's episode for a given seed, so it is kept, and it
is saved with the state like every other draw.

The ``-v1`` ids use each game's minimal action set, as minatar's own gymnasium registration does. MinAtar
has no time limit; we truncate at ``max_episode_steps`` agent steps (default
:data:`MAX_EPISODE_STEPS`), since a good Breakout agent could otherwise play forever.

State save/restore writes the game's attributes as checked JSON (plus its 10x10 maps and the Mersenne
Twister key as arrays), never a pickle: a state may come from an untrusted bundle.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from detrl.core.sources import Sources
from envs.core import SourcedEnv, check_arrays, generator_from_state, meta_int, meta_value
from envs.ids import minatar_game

#: Agent steps per episode before truncation, by default (MinAtar itself has no limit).
MAX_EPISODE_STEPS = 10_000
#: Side of MinAtar's square board, in cells.
BOARD = 10
#: Words of the Mersenne Twister state behind ``numpy.random.RandomState``.
MT_WORDS = 624

# Attributes of a game object that never change after construction (not saved): the channel and action
# tables, the difficulty-ramping switch, and the RandomState (saved separately, bit-exactly).
_GAME_CONSTANTS = frozenset({"channels", "action_map", "ramping", "random"})


# ---------------------------------------------------------------------- the schema of a game's state
@dataclasses.dataclass(frozen=True)
class _Int:
    """An integer attribute, optionally bounded (inclusive): board coordinates are checked to lie on the
    board, because a negative index would silently wrap around instead of failing."""

    lo: int | None = None
    hi: int | None = None

    def check(self, v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"invalid env state: {where} is {v!r}, expected an integer")
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise ValueError(f"invalid env state: {where} = {v} is outside [{self.lo}, {self.hi}]")
        return int(v)


@dataclasses.dataclass(frozen=True)
class _Bool:
    def check(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise ValueError(f"invalid env state: {where} is {v!r}, expected true or false")
        return v


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A list of entities, each a fixed-length list of fields (``[x, y, moving_right, ...]``).

    ``length``: exact list length (Asterix's 8 lanes, Freeway's 8 cars), else at most ``max_len``.
    ``nullable``: an entry may be None (an empty Asterix lane).
    """

    fields: tuple[_Int | _Bool, ...]
    length: int | None = None
    max_len: int = 1000
    nullable: bool = False

    def check(self, v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise ValueError(f"invalid env state: {where} is {type(v).__name__}, expected a list")
        if (self.length is not None and len(v) != self.length) or len(v) > self.max_len:
            want = self.length if self.length is not None else f"at most {self.max_len}"
            raise ValueError(f"invalid env state: {where} has {len(v)} entries, expected {want}")
        out: list[Any] = []
        for i, row in enumerate(v):
            if row is None and self.nullable:
                out.append(None)
                continue
            if not isinstance(row, list) or len(row) != len(self.fields):
                raise ValueError(
                    f"invalid env state: {where}[{i}] is {row!r}, expected {len(self.fields)} fields"
                )
            # New lists: the game mutates its entities in place, so they must not alias the input.
            out.append([f.check(x, f"{where}[{i}][{j}]") for j, (f, x) in enumerate(zip(self.fields, row))])
        return out


@dataclasses.dataclass(frozen=True)
class _Map:
    """A 10x10 float64 board of 0s and 1s (bricks, aliens, bullets), saved as an array."""


_XY = (_Int(0, BOARD - 1), _Int(0, BOARD - 1))  # a cell: (x, y)
_Spec = _Int | _Bool | _Rows | _Map

#: Every attribute of each game's state (``minatar`` 1.0.15) and what it may hold. A game object with
#: other attributes is refused at construction, so a changed minatar cannot be saved half-way.
GAME_STATE: dict[str, dict[str, _Spec]] = {
    "asterix": {
        "player_x": _Int(0, 9), "player_y": _Int(0, 9),
        # One lane per row 1..8: None or [x, y, moving_right, is_gold].
        "entities": _Rows((*_XY, _Bool(), _Bool()), length=8, nullable=True),
        "shot_timer": _Int(), "spawn_speed": _Int(), "spawn_timer": _Int(), "move_speed": _Int(),
        "move_timer": _Int(), "ramp_timer": _Int(), "ramp_index": _Int(), "terminal": _Bool(),
    },
    "breakout": {
        "ball_x": _Int(0, 9), "ball_y": _Int(0, 9), "ball_dir": _Int(0, 3), "pos": _Int(0, 9),
        "last_x": _Int(0, 9), "last_y": _Int(0, 9), "strike": _Bool(), "terminal": _Bool(),
        "brick_map": _Map(),
    },
    "freeway": {
        # Eight cars: [x, y, frames until it moves, signed speed (its sign is the direction)].
        "cars": _Rows((*_XY, _Int(0, 5), _Int(-5, 5)), length=8),
        "pos": _Int(0, 9), "move_timer": _Int(), "terminate_timer": _Int(), "terminal": _Bool(),
    },
    "seaquest": {
        "oxygen": _Int(), "diver_count": _Int(), "sub_x": _Int(0, 9), "sub_y": _Int(0, 9),
        "sub_or": _Bool(),
        "f_bullets": _Rows((*_XY, _Bool())), "e_bullets": _Rows((*_XY, _Bool())),
        "e_fish": _Rows((*_XY, _Bool(), _Int())), "e_subs": _Rows((*_XY, _Bool(), _Int(), _Int())),
        "divers": _Rows((*_XY, _Bool(), _Int())),
        "e_spawn_speed": _Int(), "e_spawn_timer": _Int(), "d_spawn_timer": _Int(), "move_speed": _Int(),
        "ramp_index": _Int(), "shot_timer": _Int(), "surface": _Bool(), "terminal": _Bool(),
    },
    "space_invaders": {
        "pos": _Int(0, 9), "f_bullet_map": _Map(), "e_bullet_map": _Map(), "alien_map": _Map(),
        "alien_dir": _Int(-1, 1), "enemy_move_interval": _Int(), "alien_move_timer": _Int(),
        "alien_shot_timer": _Int(), "ramp_index": _Int(), "shot_timer": _Int(), "terminal": _Bool(),
    },
}  # fmt: skip


def _plain(v: Any) -> Any:
    """``v`` with numpy scalars as Python ones (Freeway's car speeds are numpy ints), lists copied."""
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


# ---------------------------------------------------------------------- the bare game
class MinAtarGame(gym.Env[np.ndarray, np.int64]):
    """One MinAtar game, stepped through ``minatar.Environment`` with MinAtar's sticky actions off.

    Args:
        game: the minatar module name, e.g. ``"breakout"``.

    Observations: uint8 ``(channels, 10, 10)`` of 0s and 1s (MinAtar's ``(10, 10, channels)`` bool state,
    channels first). Actions index the game's minimal action set; action 0 is always NOOP.
    ``reset(seed=s)`` reseeds the game's ``RandomState`` with ``s`` (required: the game has no other seed).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, game: str) -> None:
        import minatar  # lazy: it imports matplotlib and seaborn (about 2 s), which only MinAtar users pay

        self.minatar = minatar.Environment(game, sticky_action_prob=0.0, difficulty_ramping=True)
        self.game = game
        self.action_set: list[int] = list(self.minatar.minimal_action_set())
        if self.minatar.env.action_map[self.action_set[0]] != "n":
            raise RuntimeError(f"minatar {game}: minimal action 0 is not NOOP")
        attrs = set(vars(self.minatar.env)) - _GAME_CONSTANTS
        if attrs != set(GAME_STATE[game]):
            raise RuntimeError(
                f"minatar {game}: game attributes {sorted(attrs)} differ from the saved state's "
                f"{sorted(GAME_STATE[game])} (envs.minatar was written for minatar 1.0.15)"
            )
        # Environment() seeds from the OS and its game resets once with that: replace it before anything
        # can be observed.
        self.minatar.seed(0)
        self.minatar.reset()
        channels = self.minatar.n_channels
        self.observation_space = gym.spaces.Box(0, 1, (channels, BOARD, BOARD), np.uint8)
        self.action_space = gym.spaces.Discrete(len(self.action_set))

    def observation(self) -> np.ndarray:
        """The board, uint8 ``(channels, 10, 10)``: a new array."""
        # bool and uint8 share their bytes (0/1), so the channels-first copy is reinterpreted, not converted.
        return np.ascontiguousarray(self.minatar.state().transpose(2, 0, 1)).view(np.uint8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """A new game whose randomness is ``RandomState(seed)``; ``seed`` in ``[0, 2**32)`` is required."""
        if seed is None or not 0 <= seed < 2**32:
            raise ValueError(f"a MinAtar reset needs a seed in [0, 2**32), got {seed}")
        super().reset(seed=seed)  # gymnasium's np_random (unused by the game; check_env looks at it)
        self.minatar.seed(seed)
        self.minatar.reset()
        return self.observation(), {}

    def restart(self) -> np.ndarray:
        """A new game that continues the current ``RandomState`` (after a game over during no-op starts)."""
        self.minatar.reset()
        return self.observation()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One MinAtar frame with ``action`` (an index into :attr:`action_set`). Never truncates."""
        reward, terminal = self.minatar.act(self.action_set[int(action)])
        return self.observation(), float(reward), bool(terminal), False, {}

    def get_action_meanings(self) -> list[str]:
        """Names of the actions, e.g. ``["NOOP", "LEFT", "RIGHT"]`` for Breakout."""
        names = {"n": "NOOP", "l": "LEFT", "u": "UP", "r": "RIGHT", "d": "DOWN", "f": "FIRE"}
        return [names[self.minatar.env.action_map[a]] for a in self.action_set]


# ---------------------------------------------------------------------- the sourced env
class MinAtar(SourcedEnv):
    """A ``MinAtar/<Game>-v1`` game for a DQN-style learner, every random draw from the switchboard.

    Observations: uint8 ``(channels, 10, 10)``, values 0/1 (Breakout: 4 channels: paddle, ball, trail,
    bricks); feed them to ``agent.network: minatar_cnn``. Rewards are MinAtar's, unclipped.

    Step info: ``raw_reward`` (float, the same as the reward); on the step that ends the episode
    (terminated or truncated) ``episode = {"r": return, "l": length in agent steps}``.
    Reset info: ``episode_seed``, ``noops`` (NOOP steps taken by the no-op start).

    Args:
        env_id: one of :data:`envs.ids.MINATAR`.
        sources: the run's switchboard.
        sticky_prob: per-step probability in [0, 1] of repeating the previous action.
        noop_max: most NOOP steps at an episode's start (0: none). Breakout: at most 5 keeps every start
            playable, since an unreturned serve ends the game on its 6th frame.
        max_episode_steps: agent steps before truncation.
    """

    def __init__(
        self, env_id: str, sources: Sources, *, sticky_prob: float, noop_max: int, max_episode_steps: int
    ) -> None:
        for name, value, low in [("noop_max", noop_max, 0), ("max_episode_steps", max_episode_steps, 1)]:
            if int(value) != value or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value}")
        options = {
            "sticky_prob": float(sticky_prob),
            "noop_max": int(noop_max),
            "max_episode_steps": int(max_episode_steps),
        }
        game = MinAtarGame(minatar_game(env_id))
        super().__init__(game, sources, env_id, options, sticky_prob)
        self.noop_max = options["noop_max"]
        self.max_episode_steps = options["max_episode_steps"]
        self.observation_space = game.observation_space
        self.action_space = game.action_space
        self._schema = GAME_STATE[game.game]
        self._maps = sorted(k for k, spec in self._schema.items() if isinstance(spec, _Map))
        self._noops = 0  # NOOP steps at the start of the current episode

    def _reset(self, seed: int, from_stream: bool) -> tuple[np.ndarray, dict[str, Any]]:
        game: MinAtarGame = self.env  # type: ignore[assignment]
        obs, _ = game.reset(seed=seed)
        self._start_episode(seed, from_stream)
        self._noops = 0
        if self.noop_max > 0:
            noop = self._episode_rng("noop", seed, from_stream)
            self._noops = int(noop.integers(1, self.noop_max + 1))
            # NOOP steps draw no sticky uniforms (the previous action is NOOP already, so a stuck one is
            # the same step): the sticky generator then serves the agent's steps only, whatever noop does.
            for _ in range(self._noops):
                obs, reward, terminated, _, _ = game.step(0)
                self._ep_return += reward
                if terminated:  # e.g. Breakout with noop_max > 5: start afresh, as SB3's NoopResetEnv
                    obs = game.restart()
                    self._ep_return = 0.0
        return obs, {"episode_seed": seed, "noops": self._noops}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One agent step (one MinAtar frame); ``action`` may stick (see :meth:`SourcedEnv._sticky_action`)."""
        obs, reward, terminated, _, _ = self.env.step(self._sticky_action(int(action)))
        self._ep_return += reward
        self._ep_length += 1
        truncated = self._ep_length >= self.max_episode_steps
        info: dict[str, Any] = {"raw_reward": reward}
        if terminated or truncated:
            info["episode"] = {"r": self._ep_return, "l": self._ep_length}
        return obs, reward, terminated, truncated, info

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        env = self.env.minatar
        game = env.env
        values: dict[str, Any] = {}
        for name, spec in self._schema.items():
            value = getattr(game, name)
            if isinstance(spec, _Map):
                arrays[f"game.{name}"] = np.array(value)
                continue
            try:
                values[name] = spec.check(_plain(value), name)
            except ValueError as e:  # the game holds something the schema does not know: refuse to save it
                raise RuntimeError(f"{self.env_id}: cannot save the game state ({e})") from None
        rng = env.random.get_state(legacy=False)
        arrays["game_rng_key"] = rng["state"]["key"].copy()
        meta["game"] = values
        meta["game_rng"] = {"pos": int(rng["state"]["pos"]), "has_gauss": int(rng["has_gauss"]),
                            "gauss": float(rng["gauss"])}  # fmt: skip
        meta["last_action"] = int(env.last_action)
        meta["noops"] = self._noops
        meta["np_random"] = self.env.np_random.bit_generator.state
        return arrays, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        expected = {f"game.{m}": ((BOARD, BOARD), "float64") for m in self._maps}
        check_arrays(arrays, {**expected, "game_rng_key": ((MT_WORDS,), "uint32")})
        values: dict[str, Any] = {}
        for m in self._maps:
            board = arrays[f"game.{m}"]
            if not np.isin(board, (0.0, 1.0)).all():
                raise ValueError(f"invalid env state: game.{m} holds values other than 0 and 1")
            values[m] = board.copy()
        saved = meta_value(meta, "game", dict)
        scalars = {k for k, spec in self._schema.items() if not isinstance(spec, _Map)}
        if set(saved) != scalars:
            raise ValueError(f"invalid env state: game has {sorted(saved)}, expected {sorted(scalars)}")
        for name in sorted(scalars):
            values[name] = self._schema[name].check(saved[name], f"game.{name}")
        rng = self._random_state(arrays["game_rng_key"], meta_value(meta, "game_rng", dict))
        last_action = _Int(0, 5).check(meta_value(meta, "last_action", int), "last_action")
        noops = meta_int(meta, "noops")
        if not 0 <= noops <= self.noop_max:
            raise ValueError(f"invalid env state: noops {noops} is outside [0, {self.noop_max}]")
        np_random = generator_from_state(meta_value(meta, "np_random", dict), "np_random")
        common = self._check_common(meta)
        env = self.env.minatar
        # The last check: the board must render (a Freeway car of speed 0 has no trail channel, say).
        scratch = copy.copy(env.env)
        vars(scratch).update(values)
        try:
            scratch.state()
        except Exception as e:
            raise ValueError(
                f"invalid env state: the game does not render ({type(e).__name__}: {e})"
            ) from None
        # All checked: now change the env. Wrapper and game share one RandomState, as Environment.seed sets.
        vars(env.env).update(values)
        env.random = env.env.random = rng
        env.last_action = last_action
        self.env.np_random = np_random
        self._noops = noops
        self._apply_common(common)

    @staticmethod
    def _random_state(key: np.ndarray, meta: Mapping[str, Any]) -> np.random.RandomState:
        """The game's ``RandomState`` from its Mersenne Twister key and position, checked."""
        pos = _Int(0, MT_WORDS).check(meta.get("pos"), "game_rng.pos")
        has_gauss = _Int(0, 1).check(meta.get("has_gauss"), "game_rng.has_gauss")
        gauss = meta_value(meta, "gauss", (int, float))
        rng = np.random.RandomState()
        try:
            rng.set_state(("MT19937", key.copy(), pos, has_gauss, float(gauss)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid env state: game_rng: {e}") from None
        return rng
