"""Deterministic DQN (Mnih et al. 2015), readable top to bottom, every random decision from a named stream.

The switchboard (:class:`detrl.Sources`) makes each source of randomness visible and separately seeded,
following Nagarajan, Warnell & Stone (2018):

=========  ==================================================================================
stream     what it decides here
=========  ==================================================================================
init       the Q-network's initial weights (the target starts as an exact copy)
explore    epsilon-greedy: one uniform and one random action drawn every step, used or not
replay     the minibatch rows of every update (``batch_size`` draws per update)
env        each training episode's reset seed (see :mod:`envs`)
noop       the number of no-op actions at each Atari (or MinAtar) episode's start
sticky     whether each emulator frame (MinAtar: step) repeats the previous action (sticky actions)
bitflip    (if on) one initial weight moved to its neighbouring float
hardware   the accumulation order of reductions: the ``hardware`` profile in the config
=========  ==================================================================================

Each stream advances by the same amount every step whatever the others do, so varying one source never
shifts another. With ``precision: verifiable`` every step — action selection, environment step, update —
runs inside a :class:`detrl.Session` step: the rounding mode makes the run replayable bit for bit on other
hardware, and each step's commitment binds the transition and the replay buffer's hash chain.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch.nn import functional as F

import envs
from agents.buffers import FrameReplayBuffer, ReplayBuffer
from agents.networks import MLPQNetwork, QNetworks, build_q_network
from agents.optim import LeanAdam, ListAdam, LoopAdam
from detrl.core import extensions
from detrl.core.engine import Session
from detrl.core.sources import Sources
from detrl.run.config import RunBase, Strict, VerifyConfig
from detrl.run.tasks import Task


# ---------------------------------------------------------------------------------------------- config
class EnvConfig(Strict):
    id: str = Field(
        "CartPole-v1",
        description="CartPole-v1, Acrobot-v1, MountainCar-v0, ALE/<Game>-v5, MinAtar/<Game>-v1",
    )
    sticky_prob: float | None = Field(
        None, ge=0.0, lt=1.0, description="sticky actions (default: 0.25 Atari, 0.1 MinAtar, 0 else)"
    )
    noop_max: int | None = Field(
        None, ge=0, description="max no-ops at an Atari/MinAtar episode start (default 30 Atari, 0 MinAtar)"
    )
    frame_skip: int = Field(4, ge=1, description="Atari: emulator frames per agent step")
    frame_stack: int = Field(4, ge=1, description="Atari: frames per observation")
    screen_size: int = Field(84, ge=8, description="Atari: square grayscale frame side in pixels")
    episodic_life: bool = Field(True, description="Atari: a lost life ends the learner's episode")
    clip_rewards: bool = Field(True, description="Atari: rewards clipped to their sign")
    max_episode_steps: int | None = Field(
        None, ge=1, description="override the env's time limit (agent steps)"
    )

    @field_validator("id")
    @classmethod
    def _known_env(cls, v: str) -> str:
        envs.check_env_id(v)
        return v


class AgentConfig(Strict):
    network: Literal["mlp", "nature_cnn", "minatar_cnn"] = Field(
        "mlp", description="mlp: vectors; nature_cnn: Atari frame stacks; minatar_cnn: MinAtar boards"
    )
    hidden: list[int] = Field([120, 84], description="mlp: hidden layer widths")
    buffer_size: int = Field(10_000, ge=1, description="replay capacity in transitions")
    batch_size: int = Field(128, ge=1, description="transitions per update")
    gamma: float = Field(0.99, ge=0.0, le=1.0, description="discount per agent step")
    learning_rate: float = Field(2.5e-4, gt=0.0, description="Adam step size")
    final_learning_rate: float | None = Field(
        None, ge=0.0, description="if set, decay linearly to it by the end"
    )
    adam_eps: float = Field(1e-8, gt=0.0)
    learning_starts: int = Field(10_000, ge=0, description="env steps before the first update")
    train_frequency: int = Field(10, ge=1, description="env steps between updates")
    gradient_steps: int = Field(1, ge=1, description="updates each time")
    target_update_period: int = Field(500, ge=1, description="env steps between target updates")
    tau: float = Field(1.0, gt=0.0, le=1.0, description="target update weight (1: hard copy)")
    start_e: float = Field(1.0, ge=0.0, le=1.0, description="initial exploration epsilon")
    end_e: float = Field(0.05, ge=0.0, le=1.0, description="final exploration epsilon")
    exploration_fraction: float = Field(0.5, gt=0.0, le=1.0, description="fraction of steps to reach end_e")
    max_grad_norm: float | None = Field(10.0, gt=0.0, description="gradient clipping (None: off)")
    double_dqn: bool = Field(False, description="target actions from the online network (van Hasselt 2016)")
    loss: Literal["huber", "mse"] = "huber"


class DQNTrainConfig(Strict):
    steps: int = Field(50_000, ge=1, description="environment steps")
    log_every: int = Field(1000, ge=1, description="env steps between TensorBoard scalars")


class EvalConfig(Strict):
    episodes: int = Field(10, ge=0, description="greedy evaluation episodes after training")
    seed: int = Field(
        1_000_000, ge=0, description="episode k resets with seed + k: never the training streams"
    )
    epsilon: float = Field(0.0, ge=0.0, le=1.0, description="evaluation epsilon (0.05 is usual for Atari)")


class Config(RunBase):
    """A DQN run (``task: dqn``). Steps are environment steps; a Session step is one environment step."""

    task: Literal["dqn"] = "dqn"
    precision: Literal["verifiable", "fp64", "fp32"] = "fp32"
    env: EnvConfig = Field(default_factory=EnvConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    train: DQNTrainConfig = Field(default_factory=DQNTrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    verify: VerifyConfig = Field(default_factory=lambda: VerifyConfig(checkpoint_every=10_000))


# ---------------------------------------------------------------------------------------------- helpers
#: The op-sequence revision a DQN step records (:attr:`detrl.run.tasks.Task.ops_revision`). 3: a verifiable
#: step's Adam and target update take per-tensor ops (:class:`LoopAdam`, ``lerp_``), which round without log
#: entries; 2: they took list ops, logged (``ListAdam``, ``_foreach_lerp_``); a FP32 midpoint in those
#: lerps is decided by FP64 steps in one and by torch's lerp kernel in the other, so the weights may differ
#: in the last bit. From 2 on, a verifiable update takes :func:`td_update`'s shortcuts, as FP32 and FP64 do
#: (an MLP's written backward pass and list-op clipping, in one native call where built); 1 took autograd
#: and per-tensor clipping: the same weights, bit for bit, from other ops in another order.
OPS_REVISION = 3


def first_update_step(cfg: Config) -> int:
    """The first environment step that runs a TD update."""
    a = cfg.agent
    return (a.learning_starts // a.train_frequency + 1) * a.train_frequency


def session_options(cfg: Config) -> dict[str, Any]:
    """How ``detrl train``/``audit`` set up the Session for a DQN run.

    Calibration runs until the first update has been measured (acting-only steps use only the forward
    ops); DQN draws nothing random inside torch ops, so random-op routing is off.
    """
    return {"calibration_steps": first_update_step(cfg), "route_random_ops": False}


def make_env(cfg: Config, sources: Sources) -> Any:
    e = cfg.env
    return envs.make(
        e.id, sources, sticky_prob=e.sticky_prob, noop_max=e.noop_max, frame_skip=e.frame_skip,
        frame_stack=e.frame_stack, screen_size=e.screen_size, episodic_life=e.episodic_life,
        clip_rewards=e.clip_rewards, max_episode_steps=e.max_episode_steps,
    )  # fmt: skip


def clip_grad_norm(params: Any, max_norm: float, list_ops: bool = False) -> None:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``,
    whose grouping logic cost a quarter of a small network's update).

    ``list_ops``: the per-tensor norms and scalings as two list ops (``_foreach_norm``, ``_foreach_mul_``),
    which on a CPU run the per-tensor kernels, so the bits are the same with 2 ops instead of 12.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads) if list_ops else [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if list_ops:
        torch._foreach_mul_(grads, scale)
    else:
        for g in grads:
            g.mul_(scale)


def td_loss(q_taken: torch.Tensor, td_target: torch.Tensor, kind: str) -> torch.Tensor:
    """The mean TD loss of ``q_taken`` against ``td_target`` (both (batch,)): ``"huber"`` (smooth L1 with
    beta 1) or ``"mse"``."""
    return F.smooth_l1_loss(q_taken, td_target) if kind == "huber" else F.mse_loss(q_taken, td_target)


def td_loss_grad(q_taken: torch.Tensor, td_target: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`td_loss`'s gradient by ``q_taken`` (batch,): the loss's backward op, as ``loss.backward()``
    calls it (from a gradient of one, with the mean reduction, torch's enum 1)."""
    one = torch.ones((), dtype=q_taken.dtype, device=q_taken.device)  # beside the loss, as autograd's seed
    if kind == "huber":
        return torch.ops.aten.smooth_l1_loss_backward(one, q_taken, td_target, 1, 1.0)
    return torch.ops.aten.mse_loss_backward(one, q_taken, td_target, 1)


@functools.cache
def mlp_native() -> Any:
    """An :class:`MLPQNetwork`'s greedy action and shortcut update as single C++ calls that dispatch the
    same aten ops as the Python code below (``agents/mlp_native.cpp``), or None where it is not built."""
    return extensions.load(
        "agents._mlp_native", Path(__file__).with_name("mlp_native.cpp"), "the DQN's MLP path"
    )


def greedy_policy(
    q: torch.nn.Module, as_input: Callable[[np.ndarray], torch.Tensor]
) -> Callable[[np.ndarray], int]:
    """The greedy action ``argmax_a Q(obs, a)`` of one observation ``obs`` (*obs_shape), through ``as_input``.
    An :class:`MLPQNetwork` acts through one call of :func:`mlp_native`, which dispatches the ops of the
    Python forward below, so a verifiable step rounds and logs the same ops either way. The native call is
    for CPU tensors (where it is held to the Python path's bits); a network on a GPU acts in Python."""
    native = mlp_native() if isinstance(q, MLPQNetwork) and q.flat_parameters()[0].is_cpu else None
    if native is not None:
        params, act = q.flat_parameters(), native.act
        return lambda obs: act(params, as_input(obs[None]))

    def greedy(obs: np.ndarray) -> int:
        with torch.no_grad():  # .forward: one observation per step, module-call hooks cost as much
            return int(q.forward(as_input(obs[None])).argmax())

    return greedy


def linear_schedule(start: float, end: float, duration: float, t: int) -> float:
    """``start`` at step 0, ``end`` from step ``duration`` on, linear in between."""
    return start + min(1.0, t / max(duration, 1.0)) * (end - start)


class EnvPart:
    """The environment and the loop's episode bookkeeping, as Session resume state (not committed: the
    transitions it produces are, through the replay buffer's hash chain)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.obs: np.ndarray | None = None
        self.first = True  # obs is an episode's first observation
        self.returns: list[float] = []
        self.lengths: list[int] = []

    def digest(self) -> bytes:
        return b""

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        arrays, meta = envs.get_state(self.env)
        arrays = {f"env.{k}": v for k, v in arrays.items()}
        arrays["obs"] = np.asarray(self.obs)
        return arrays, {"env": meta, "first": self.first, "returns": self.returns, "lengths": self.lengths}

    def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        envs.set_state(self.env, {k[4:]: v for k, v in arrays.items() if k.startswith("env.")}, meta["env"])
        self.obs = np.array(arrays["obs"])
        self.first = bool(meta["first"])
        self.returns = [float(r) for r in meta["returns"]]
        self.lengths = [int(n) for n in meta["lengths"]]


def td_update(
    q: torch.nn.Module,
    target: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    a: Any,
    as_input: Callable[[np.ndarray], torch.Tensor],
    cast: Callable[[torch.Tensor], torch.Tensor],
    shortcuts: bool = True,
    native: bool = True,
) -> tuple[float, float]:
    """One gradient step of the TD loss on a replay batch; returns (loss, mean Q of the taken actions).

    ``batch``: obs and next_obs (batch, *obs_shape), actions (batch,) int64, rewards and terminated
    (batch,). ``a``: the agent config (gamma, double_dqn, loss, max_grad_norm). ``as_input`` turns
    observations into network input, on the networks' device (the batch's other columns follow them there),
    and ``cast`` a float tensor into the run's precision.
    ``shortcuts``: reach the same bits through fewer ops: an :class:`MLPQNetwork`'s gradients through its
    written backward pass instead of autograd (see :meth:`MLPQNetwork.write_gradients`), and gradient
    clipping through list ops. Without them: autograd and per-tensor clipping, the ops a verifiable step
    dispatched at op-sequence revision 1 (see :data:`OPS_REVISION`).
    ``native``: with the shortcuts, an MLP's update (up to the optimizer step) is one call of
    :func:`mlp_native`, which dispatches the same ops in the same order without a Python call per op (on
    CPU tensors only, as :func:`greedy_policy`).
    """
    obs_b, next_b = as_input(batch.obs), as_input(batch.next_obs)
    device = obs_b.device  # as_input put the observations beside the networks: the rest of the batch too
    rewards = cast(torch.from_numpy(batch.rewards).to(device))  # (batch,)
    not_done = cast(1.0 - torch.from_numpy(batch.terminated).to(device))  # (batch,)
    native = native and device.type == "cpu"  # the native update takes CPU tensors (see greedy_policy)
    if shortcuts and native and isinstance(q, MLPQNetwork) and mlp_native() is not None:
        loss_value, q_taken = mlp_native().td_update(
            q.flat_parameters(), target.flat_parameters(), obs_b, next_b, torch.from_numpy(batch.actions),
            rewards, not_done, a.gamma, a.double_dqn, a.loss == "huber", a.max_grad_norm,
        )  # fmt: skip
        optimizer.step()
        return loss_value, float(q_taken.mean())
    with torch.no_grad():
        next_q = target(next_b)  # (batch, n_actions)
        if a.double_dqn:  # the online network picks the action, the target network values it
            best = q(next_b).argmax(dim=1, keepdim=True)
            next_value = next_q.gather(1, best).squeeze(1)
        else:
            next_value = next_q.max(dim=1).values
        td_target = rewards + a.gamma * next_value * not_done  # (batch,)
    actions = torch.from_numpy(batch.actions).to(device)[:, None]  # (batch, 1)
    if shortcuts and isinstance(q, MLPQNetwork):  # by hand: the loss's derivative, gather's, then the MLP's
        with torch.no_grad():
            q_all, inputs = q.forward_keeping_inputs(obs_b)  # (batch, n_actions), each layer's input
            q_taken = q_all.gather(1, actions).squeeze(1)  # (batch,)
            loss = td_loss(q_taken, td_target, a.loss)
            grad_taken = td_loss_grad(q_taken, td_target, a.loss)[:, None]  # (batch, 1)
            q.write_gradients(torch.zeros_like(q_all).scatter_add_(1, actions, grad_taken), inputs)
    else:
        q_taken = q(obs_b).gather(1, actions).squeeze(1)  # (batch,)
        loss = td_loss(q_taken, td_target, a.loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    if a.max_grad_norm is not None:
        clip_grad_norm(q.parameters(), a.max_grad_norm, list_ops=shortcuts)
    optimizer.step()
    return float(loss.detach()), float(q_taken.detach().mean())


# ---------------------------------------------------------------------------------------------- the loop
def run(
    cfg: Config,
    session: Session,
    progress: bool = False,
    writer: Any = None,
    data: Path | None = None,
    wrap_env: Any = None,
) -> dict[str, Any]:
    """Train ``cfg.train.steps`` environment steps inside ``session`` (recording, replaying or off). Stops
    after a whole step once ``session.stop_requested`` is set (Ctrl-C, or the end of a replayed bundle).

    ``data``: unused (DQN generates its data). ``wrap_env``: an optional callable applied to the training
    env (a test uses it to tamper with rewards).
    Returns ``returns``/``lengths`` of finished training episodes, the final ``loss``, ``steps_per_second``
    and, unless replaying, ``eval_returns`` of the greedy evaluation.
    """
    a, sources = cfg.agent, session.sources
    env = make_env(cfg, sources)
    if wrap_env is not None:
        env = wrap_env(env)
    obs_shape, n_actions = env.observation_space.shape, int(env.action_space.n)
    precision = session.precision

    # Networks from the `init` stream; Adam; the replay buffer and env as committed/resumable state.
    qnets: QNetworks = session.init(
        lambda: QNetworks(build_q_network(a.network, obs_shape, n_actions, a.hidden))
    )
    q, target = qnets.online, qnets.target
    # Fused Adam (one kernel for all parameters, called without torch's per-step Python: LeanAdam) is much
    # faster on small networks. Verifiable precision rounds each op, which a fused kernel does not offer:
    # it takes per-tensor ops (LoopAdam, and a lerp_ a tensor for the target), which round with no log
    # entry where the list ops (foreach) are logged; bundles of op-sequence revision 2 replay with the
    # list ops they recorded.
    list_ops = not precision.is_verifiable or session.ops_revision < 3
    device = session.device  # where Session.init put the networks: observations from numpy go there
    if precision.is_verifiable:
        if list_ops:
            optimizer = ListAdam(q.parameters(), lr=a.learning_rate, eps=a.adam_eps)
        else:  # LoopAdam's native step is for CPU tensors: a GPU run needs no extension built
            native = mlp_native() if device.type == "cpu" else None
            optimizer = LoopAdam(q.parameters(), native, lr=a.learning_rate, eps=a.adam_eps)
    else:
        optimizer = LeanAdam(q.parameters(), lr=a.learning_rate, eps=a.adam_eps)
    session.track(optimizer)
    frames = a.network == "nature_cnn"
    chain = session.mode != "off"  # the buffer's hash chain is committed: not needed without a bundle
    # Observations are stored in the env's own dtype: float32 vectors, uint8 MinAtar boards (a quarter of
    # the memory of float32, and the network casts them anyway).
    buffer = (
        FrameReplayBuffer(a.buffer_size, obs_shape, chain=chain)
        if frames
        else ReplayBuffer(a.buffer_size, obs_shape, obs_dtype=env.observation_space.dtype, chain=chain)
    )
    session.attach("replay", buffer)
    episodes = session.attach("env", EnvPart(env))
    start = session.restore()
    if start == 0:
        episodes.obs, _ = env.reset()  # the first episode's seed comes from the `env` stream
    total = cfg.train.steps

    def as_input(x: np.ndarray) -> torch.Tensor:  # observations as network input, in the run's precision
        t = torch.from_numpy(x).to(device)  # on the CPU: the same tensor, no copy
        return precision.cast(t) if t.is_floating_point() else t

    greedy = greedy_policy(q, as_input)
    # Bundles of op-sequence revision 1 took autograd and per-tensor clipping in verifiable precision: a replay
    # dispatches the ops their steps did.
    shortcuts = session.ops_revision >= 2 or not precision.is_verifiable
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=f"{session.mode} {cfg.name}", unit="step", disable=None)
    loss_value = q_mean = float("nan")
    t_start, steps_at_start = time.perf_counter(), start
    for step in range(start + 1, total + 1):
        learn = step > a.learning_starts and step % a.train_frequency == 0
        sync_target = step % a.target_update_period == 0
        with session.step(frozen=not (learn or sync_target)):  # acting-only steps leave the weights alone
            # Act: epsilon-greedy. Both draws happen every step, so `explore` moves the same whatever else varies.
            epsilon = linear_schedule(a.start_e, a.end_e, a.exploration_fraction * total, step - 1)
            rng = sources.numpy("explore")
            u, random_action = rng.random(), int(rng.integers(n_actions))
            action = random_action if u < epsilon else greedy(episodes.obs)
            next_obs, reward, terminated, truncated, info = env.step(action)
            buffer.add(episodes.obs, action, float(reward), next_obs, terminated, episodes.first)
            session.observe(episodes.obs, action, float(reward), next_obs, terminated, truncated)
            episodes.obs, episodes.first = next_obs, False
            if "episode" in info:  # a real game ended (an Atari life loss ends only the learner's episode)
                episodes.returns.append(float(info["episode"]["r"]))
                episodes.lengths.append(int(info["episode"]["l"]))
                if writer is not None:
                    writer.add_scalar("charts/episodic_return", episodes.returns[-1], step)
                    writer.add_scalar("charts/episodic_length", episodes.lengths[-1], step)
            if terminated or truncated:
                episodes.obs, _ = env.reset()
                episodes.first = True

            # Learn: the TD update, every train_frequency steps once the buffer has learning_starts steps.
            if learn:
                if a.final_learning_rate is not None:  # linear over the whole run, like SB3's schedules
                    lr = linear_schedule(a.learning_rate, a.final_learning_rate, total, step)
                    optimizer.param_groups[0]["lr"] = lr
                for _ in range(a.gradient_steps):
                    batch = buffer.sample(sources.numpy("replay"), a.batch_size)
                    loss_value, q_mean = td_update(
                        q, target, optimizer, batch, a, as_input, precision.cast, shortcuts
                    )
            if sync_target:
                qnets.update_target(a.tau, list_ops)

        if bar is not None:
            bar.update(1)
        # Ctrl-C in `detrl train` (or the end of a replayed bundle): end after this step. The planned total
        # stays as it was: the schedules depend on it, and a resume continues to it.
        stopping = session.stop_requested and step < total
        if step % cfg.train.log_every == 0 or step == total or stopping:
            sps = (step - steps_at_start) / max(1e-9, time.perf_counter() - t_start)
            if writer is not None:
                if step > a.learning_starts and not np.isnan(loss_value):  # no loss before learning starts
                    writer.add_scalar("losses/td_loss", loss_value, step)
                    writer.add_scalar("losses/q_values", q_mean, step)
                writer.add_scalar("charts/epsilon", epsilon, step)
                writer.add_scalar("charts/SPS", sps, step)
            if bar is not None:
                recent = episodes.returns[-10:]
                bar.set_postfix(
                    ret=f"{np.mean(recent):.1f}" if recent else "-",
                    eps=f"{epsilon:.2f}",
                    loss=f"{loss_value:.3g}",
                )
        if stopping:
            break
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t_start
    result: dict[str, Any] = {
        "returns": episodes.returns,
        "lengths": episodes.lengths,
        "loss": loss_value,
        "steps": session.step_index,
        "steps_per_second": (session.step_index - start) / max(seconds, 1e-9),
    }
    if session.mode != "replay" and cfg.eval.episodes:
        result["eval_returns"] = evaluate(cfg, q, as_input)
        if writer is not None:
            writer.add_scalar("eval/mean_return", float(np.mean(result["eval_returns"])), total)
    env.close()
    return result


def evaluate(cfg: Config, q: torch.nn.Module, as_input: Callable[[np.ndarray], torch.Tensor]) -> list[float]:
    """Greedy episodes (``cfg.eval``) on a fresh env whose streams are seeded apart from training's;
    ``as_input`` turns observations into network input (on the network's device, in the run's precision)."""
    ev = cfg.eval
    env_sources = Sources(seed=ev.seed)  # the eval env's own sticky/noop streams; episode seeds are explicit
    env = make_env(cfg, env_sources)
    rng = np.random.Generator(np.random.PCG64(ev.seed))
    returns = []
    for k in range(ev.episodes):
        obs, _ = env.reset(seed=ev.seed + k)
        while True:
            if rng.random() < ev.epsilon:
                action = int(rng.integers(env.action_space.n))
            else:
                with torch.no_grad():
                    action = int(q(as_input(obs[None])).argmax(dim=1)[0])
            obs, _, terminated, truncated, info = env.step(action)
            if "episode" in info:
                returns.append(float(info["episode"]["r"]))
                break
            if terminated or truncated:  # an Atari life lost: keep playing the same game
                obs, _ = env.reset()
    env.close()
    return returns


def fingerprint(cfg: Config, data: Path | None = None) -> str | None:
    """DQN generates its data: there is no dataset to fingerprint (the env id and options are in the config)."""
    return None


#: The auditor's default bounds on a bundle's DQN config (``detrl audit --cap KEY=VALUE``): Breakout's
#: full run fits; a hostile bundle cannot make the auditor allocate a giant buffer or network.
CAPS = {
    "agent.hidden": 4096, "agent.buffer_size": 1_000_000, "agent.batch_size": 4096,
    "agent.gradient_steps": 64, "train.steps": 10_000_000, "env.screen_size": 256, "env.frame_stack": 16,
    "env.frame_skip": 16, "env.max_episode_steps": 1_000_000, "env.noop_max": 10_000, "eval.episodes": 1000,
    "threads": 256,
}  # fmt: skip


def size(cfg: Config) -> dict[str, int]:
    """Parameters (online and target, counted on the meta device) and replay-buffer bytes of ``cfg``."""
    env = make_env(cfg, Sources())
    obs_shape, n_actions = env.observation_space.shape, int(env.action_space.n)
    itemsize = np.dtype(env.observation_space.dtype).itemsize
    env.close()
    with torch.device("meta"):
        net = build_q_network(cfg.agent.network, obs_shape, n_actions, cfg.agent.hidden)
    per_obs = int(np.prod(obs_shape)) * itemsize
    # The frame buffer keeps 2 frames per transition; the flat buffer keeps obs and next obs.
    per_transition = 2 * per_obs // (obs_shape[0] if cfg.agent.network == "nature_cnn" else 1) + 16
    return {
        "params": 2 * sum(p.numel() for p in net.parameters()),
        "data_bytes": cfg.agent.buffer_size * per_transition,
    }


TASK = Task(
    name="dqn",
    config=Config,
    run=run,
    planned_steps=lambda cfg: cfg.train.steps,
    fingerprint=fingerprint,
    session_options=session_options,
    # The epsilon and learning-rate schedules depend on train.steps: changing it would change steps
    # already recorded, so a DQN bundle resumes only to its planned total.
    resume_keys=frozenset({"train.log_every", "eval.episodes", "eval.seed", "eval.epsilon"}),
    caps=CAPS,
    size=size,
    ops_revision=OPS_REVISION,
)
