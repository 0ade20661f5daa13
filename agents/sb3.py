"""Stable-Baselines3 bridge: the same DQN hyperparameters as a detrl config, for side-by-side benchmarks.

SB3's DQN has no Double DQN and no MSE option; :func:`sb3_dqn` refuses a config that asks for them rather
than silently running something else.
"""

from __future__ import annotations

from typing import Any

from agents.dqn import Config


def sb3_kwargs(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of ``stable_baselines3.DQN`` equal to ``cfg.agent`` (steps are env steps in both)."""
    a = cfg.agent
    if a.loss != "huber":
        raise ValueError("SB3's DQN only has the Huber loss")
    lr: Any = a.learning_rate
    if a.final_learning_rate is not None:
        start, end = a.learning_rate, a.final_learning_rate
        lr = lambda progress_remaining: end + (start - end) * progress_remaining  # linear over the run
    kw: dict[str, Any] = dict(
        learning_rate=lr, buffer_size=a.buffer_size, learning_starts=a.learning_starts,
        batch_size=a.batch_size, tau=a.tau, gamma=a.gamma, train_freq=a.train_frequency,
        gradient_steps=a.gradient_steps, target_update_interval=a.target_update_period,
        exploration_fraction=a.exploration_fraction, exploration_initial_eps=a.start_e,
        exploration_final_eps=a.end_e, max_grad_norm=a.max_grad_norm if a.max_grad_norm is not None else 1e30,
        policy_kwargs={"optimizer_kwargs": {"eps": a.adam_eps}},
    )  # fmt: skip
    if a.network == "mlp":
        kw["policy_kwargs"]["net_arch"] = list(a.hidden)
    return kw


def sb3_dqn(cfg: Config, env: Any, seed: int, allow_double: bool = False) -> Any:
    """An SB3 DQN on ``env`` with ``cfg``'s hyperparameters. ``allow_double``: run a Double DQN config as
    vanilla DQN (SB3 has none) instead of refusing."""
    from stable_baselines3 import DQN

    if cfg.agent.double_dqn and not allow_double:
        raise ValueError("SB3's DQN has no Double DQN (pass allow_double=True to run it as vanilla DQN)")
    if cfg.agent.network == "minatar_cnn":
        raise ValueError("SB3 has no MinAtar CNN: its CnnPolicy is the Nature CNN, too big for 10x10 boards")
    kw = sb3_kwargs(cfg)
    policy = "CnnPolicy" if cfg.agent.network == "nature_cnn" else "MlpPolicy"
    return DQN(policy, env, seed=seed, verbose=0, device="cpu", **kw)
