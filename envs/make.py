"""``make``: the one way to build an environment under the switchboard."""

from __future__ import annotations

import gymnasium as gym

from detrl.core.sources import Sources
from envs.atari import AtariPreprocessing
from envs.classic import ClassicControl
from envs.ids import check_env_id, is_atari, is_minatar
from envs.minatar import MAX_EPISODE_STEPS as MINATAR_MAX_EPISODE_STEPS
from envs.minatar import MinAtar

#: Machado et al. (2018)'s sticky-action probability, the ``ALE/*-v5`` default.
ATARI_STICKY_PROB = 0.25
#: Most NOOP frames at the start of an Atari game (Mnih et al. 2015).
ATARI_NOOP_MAX = 30
#: MinAtar's own default sticky-action probability (``minatar.Environment``), applied per agent step.
MINATAR_STICKY_PROB = 0.1


def make(
    env_id: str,
    sources: Sources,
    *,
    sticky_prob: float | None = None,
    noop_max: int | None = None,
    frame_skip: int = 4,
    frame_stack: int = 4,
    screen_size: int = 84,
    episodic_life: bool = True,
    clip_rewards: bool = True,
    max_episode_steps: int | None = None,
) -> gym.Env:
    """An environment whose every random decision comes from ``sources`` (streams env, sticky, noop).

    Args:
        env_id: ``CartPole-v1``, ``Acrobot-v1``, ``MountainCar-v0``, ``ALE/<Game>-v5`` or
            ``MinAtar/<Game>-v1`` (Asterix, Breakout, Freeway, Seaquest, SpaceInvaders).
        sources: the run's switchboard.
        sticky_prob: probability in [0, 1] of repeating the previous action, per emulator frame (Atari) or
            per step (classic control, MinAtar). Default 0.25 for Atari, 0.1 for MinAtar, 0 for classic
            control.
        noop_max: most NOOP frames (Atari) or steps (MinAtar) at the start of a game: default 30 for
            Atari, 0 for MinAtar; 0 = none. Classic control has no no-op starts: a positive value is an
            error there.
        frame_skip: emulator frames per agent step (Atari only).
        frame_stack: frames per observation (Atari only).
        screen_size: side of the square observation frames, in pixels (Atari only).
        episodic_life: a lost life ends the learner's episode (Atari only).
        clip_rewards: rewards clipped to their sign, raw reward in ``info["raw_reward"]`` (Atari only).
        max_episode_steps: agent steps before truncation: per episode for classic control (default: the
            registered limit) and MinAtar (default 10,000; MinAtar has no limit of its own), per game for
            Atari (default: the ALE's 108,000 frames).

    Returns:
        Classic control: float32 vector observations. Atari: uint8 observations of shape
        ``(frame_stack, screen_size, screen_size)``. MinAtar: uint8 observations of 0s and 1s, shape
        ``(channels, 10, 10)``, unclipped rewards. On the step that ends an episode (Atari: a game),
        ``info["episode"] = {"r": raw return, "l": length in agent steps}``.
    """
    check_env_id(env_id)
    if is_atari(env_id):
        return AtariPreprocessing(
            env_id,
            sources,
            sticky_prob=ATARI_STICKY_PROB if sticky_prob is None else sticky_prob,
            noop_max=ATARI_NOOP_MAX if noop_max is None else noop_max,
            frame_skip=frame_skip,
            frame_stack=frame_stack,
            screen_size=screen_size,
            episodic_life=episodic_life,
            clip_rewards=clip_rewards,
            max_episode_steps=max_episode_steps,
        )
    if is_minatar(env_id):
        return MinAtar(
            env_id,
            sources,
            sticky_prob=MINATAR_STICKY_PROB if sticky_prob is None else sticky_prob,
            noop_max=0 if noop_max is None else noop_max,
            max_episode_steps=MINATAR_MAX_EPISODE_STEPS if max_episode_steps is None else max_episode_steps,
        )
    if noop_max:
        raise ValueError(f"noop_max={noop_max}: no-op starts are for Atari and MinAtar games, not {env_id}")
    return ClassicControl(env_id, sources, 0.0 if sticky_prob is None else sticky_prob, max_episode_steps)
