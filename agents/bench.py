"""``detrl bench dqn [--part P] ...``: detrl's DQN beside Stable-Baselines3's, measured in one run.

Parts (``--part all`` runs each in turn):

``speed``
    CartPole-v1 with CleanRL's hyperparameters (batch 128, train every 10 steps, buffer 10k, 120-84 MLP),
    ``--steps`` environment steps (default 50k) at one torch thread: env steps/s of detrl (every source
    seeded, no bundle) and of SB3, interleaved and repeated, and their ratio.
``profile``
    Where a step of the ``speed`` run goes: the update, the greedy action, the env, the replay buffer, the
    Session step and the loop itself, each timed inside the loop; and a greedy action timed alone.
``switches``
    The same run with every stream seeded (base seeds 0, 1, ...) against every stream unseeded (OS seeds):
    the switchboard's cost.
``verifiable``
    ``configs/dqn/cartpole.yaml`` for ``--verifiable-steps`` steps recorded in verifiable precision
    against plain FP32 (both record a bundle): the cost of verifiability. Then one more run of each, timed
    part by part inside the loop: where a recorded step goes in each precision.
``learning``
    ``configs/dqn/cartpole.yaml`` (100k steps) for ``--seeds`` seeds; final greedy evaluation of 10
    episodes for detrl and for SB3 with the same hyperparameters (SB3 has no Double DQN: it runs vanilla).
``breakout``
    Breakout (``configs/dqn/breakout.yaml``, buffer 100k, learning from step 1,000) for ``--atari-steps``
    steps: steps/s and peak resident memory of each, every run in its own process. SB3 runs on the same
    ``envs.make`` environment (its own Atari wrappers need OpenCV), so only the agents differ.

Small networks run fastest on one thread (with two threads on a busy two-core machine an update was
several times slower), so every part pins ``torch.set_num_threads(1)`` for both libraries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrl.bench.common import PartTimer, timed_parts
from detrl.core.sources import STREAMS, Sources
from detrl.run import config as config_mod
from detrl.run import sessions
from detrl.run.fmt import machine_line

REPO = Path(__file__).resolve().parents[1]

#: CleanRL's dqn.py CartPole hyperparameters (measured here before detrl's DQN: SB3 ~1,500 and CleanRL ~1,940 steps/s).
CLEANRL_CARTPOLE = {
    "name": "cleanrl_cartpole", "task": "dqn", "precision": "fp32", "threads": 1,
    "env": {"id": "CartPole-v1"},
    "agent": {
        "network": "mlp", "hidden": [120, 84], "buffer_size": 10000, "batch_size": 128, "gamma": 0.99,
        "learning_rate": 2.5e-4, "learning_starts": 10000, "train_frequency": 10, "target_update_period": 500,
        "tau": 1.0, "start_e": 1.0, "end_e": 0.05, "exploration_fraction": 0.5, "max_grad_norm": 10.0,
        "double_dqn": False, "loss": "huber",
    },
    "eval": {"episodes": 0},
}  # fmt: skip


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(path_or_raw: Any, **sets: Any) -> Any:
    raw = config_mod.read_raw(path_or_raw) if isinstance(path_or_raw, (str, Path)) else path_or_raw
    return config_mod.validate(config_mod.apply_overrides(raw, [f"{k}={v}" for k, v in sets.items()]))


def run_detrl(
    cfg: Any, sources: Sources | None = None, mode: str = "off", run_dir: str | None = None
) -> dict:
    """One detrl DQN run; returns its result dict (with ``steps_per_second``)."""
    from agents import dqn

    torch.set_num_threads(1)
    src = sources if sources is not None else Sources.from_config(cfg.sources)
    session = sessions.session_for(cfg, run_dir, mode, sources=src, checkpoint_every=0, force=True)
    with session:
        t0 = time.perf_counter()
        result = dqn.run(cfg, session)
        result["wall_steps_per_second"] = cfg.train.steps / (time.perf_counter() - t0)
    return result


def run_sb3(cfg: Any, seed: int, env: Any = None) -> dict:
    """SB3's DQN with ``cfg``'s hyperparameters; env steps/s of ``learn`` and, if asked, greedy returns."""
    import gymnasium as gym

    from agents.sb3 import sb3_dqn

    torch.set_num_threads(1)
    model = sb3_dqn(cfg, env if env is not None else gym.make(cfg.env.id), seed, allow_double=True)
    t0 = time.perf_counter()
    model.learn(total_timesteps=cfg.train.steps)
    sps = cfg.train.steps / (time.perf_counter() - t0)
    out: dict[str, Any] = {"steps_per_second": sps}
    if cfg.eval.episodes and env is None:
        ev = gym.make(cfg.env.id)
        returns = []
        for k in range(cfg.eval.episodes):
            obs, _ = ev.reset(seed=cfg.eval.seed + k)
            total, done = 0.0, False
            while not done:
                action, _ = model.predict(obs, deterministic=True)
                obs, r, term, trunc, _ = ev.step(int(action))
                total, done = total + float(r), term or trunc
            returns.append(total)
        out["eval_returns"] = returns
    return out


# ------------------------------------------------------------------------------------------- parts
def _interleaved(what: str, repeats: int, first: Any, second: Any) -> tuple[list[float], list[float]]:
    """Steps/s of ``first()`` and ``second()``, alternated ``repeats`` times: the machine's load hits both."""
    xs: list[float] = []
    ys: list[float] = []
    for r in range(repeats):
        _log(f"{what}: repeat {r + 1}/{repeats}")
        xs.append(first())
        ys.append(second())
    return xs, ys


def _compare(title: str, label_a: str, xs: list[float], label_b: str, ys: list[float], goal: str) -> float:
    """Print medians and bests of two interleaved series; returns the ratio of the bests (the run least
    disturbed by the machine's other load is the closest to each variant's own speed)."""
    print(f"\n{title}, {len(xs)} interleaved repeats:")
    print(f"  {'':<32} {'best':>8} {'median':>8}   steps/s of each repeat")
    for label, v in ((label_a, xs), (label_b, ys)):
        print(f"  {label:<32} {max(v):8.0f} {statistics.median(v):8.0f}   {_spread(v)}")
    ratio = max(xs) / max(ys)
    print(f"  {'ratio':<32} {ratio:8.3f} {statistics.median(xs) / statistics.median(ys):8.3f}   ({goal})")
    return ratio


def part_speed(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load(CLEANRL_CARTPOLE, **{"train.steps": args.steps})
    ours, theirs = _interleaved(
        "speed",
        args.repeats,
        lambda: run_detrl(cfg)["steps_per_second"],
        lambda: run_sb3(cfg, seed=0)["steps_per_second"],
    )
    title = f"CartPole-v1, CleanRL hyperparameters, {args.steps} env steps"
    ratio = _compare(
        title,
        "detrl DQN (all sources seeded)",
        ours,
        "Stable-Baselines3 DQN",
        theirs,
        f"goal >= {SPEED_GOAL:g}x",
    )
    return {"detrl_sps": ours, "sb3_sps": theirs, "ratio": ratio}


def part_switches(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load(CLEANRL_CARTPOLE, **{"train.steps": args.steps})
    # Seeding costs nothing per step (both variants run the same code); what differs is the trajectory, and
    # with it the episode count and the number of resets. So the seeded runs take base seeds 0, 1, 2, ...:
    # both variants then sample trajectories from the same distribution, and only the seeding differs.
    unseeded = {n: {"seed": None} for n in STREAMS}  # OS seeds: a different run each time
    seeds = iter(range(args.repeats))
    seeded, free = _interleaved(
        "switches",
        args.repeats,
        lambda: run_detrl(cfg, Sources(seed=next(seeds)))["steps_per_second"],
        lambda: run_detrl(cfg, Sources(streams=unseeded))["steps_per_second"],
    )
    title = f"Cost of the switches (same code, CleanRL hyperparameters, {args.steps} steps)"
    ratio = _compare(
        title, "every source seeded", seeded, "every source unseeded", free, "goal: within 5% of 1"
    )
    return {"seeded_sps": seeded, "unseeded_sps": free, "ratio": ratio}


def part_verifiable(args: argparse.Namespace) -> dict[str, Any]:
    base = config_mod.read_raw("configs/dqn/cartpole.yaml")
    sets = {
        "train.steps": args.verifiable_steps,
        "agent.learning_starts": args.verifiable_steps // 4,
        "eval.episodes": 0,
    }
    res: dict[str, list[float]] = {"fp32": [], "verifiable": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for precision in ("fp32", "verifiable"):
                _log(f"verifiable: repeat {r + 1}/{args.repeats}: {precision}")
                cfg = load(base, **sets, precision=precision)
                out = run_detrl(cfg, mode="record", run_dir=f"{tmp}/{precision}{r}")
                res[precision].append(out["steps_per_second"])
        breakdown, parts = {}, _recorded_parts()
        for precision in ("fp32", "verifiable"):
            _log(f"verifiable: where a step goes: {precision}")
            timer = PartTimer()
            with timed_parts(timer, parts, returns_timed={"greedy_policy"}):
                cfg = load(base, **sets, precision=precision)
                sps = run_detrl(cfg, mode="record", run_dir=f"{tmp}/{precision}-parts")["steps_per_second"]
            breakdown[precision] = {**timer.seconds, "step": args.verifiable_steps / sps}
    a, b = statistics.median(res["fp32"]), statistics.median(res["verifiable"])
    print(
        f"\nVerifiable DQN (configs/dqn/cartpole.yaml, {args.verifiable_steps} steps, learning from step "
        f"{args.verifiable_steps // 4}, both recording a bundle, median of {args.repeats}):"
    )
    print(f"  fp32        {a:8.0f} steps/s   {_spread(res['fp32'])}")
    print(f"  verifiable  {b:8.0f} steps/s   {_spread(res['verifiable'])}")
    verdict = "MET" if a / b <= VERIFIABLE_GOAL else "MISSED"
    print(f"  verifiable is {a / b:.1f}x slower (goal <= {VERIFIABLE_GOAL:g}x: {verdict})")
    _print_breakdown(breakdown, [label for _, _, label in parts], args.verifiable_steps)
    return {**res, "slowdown": a / b, "breakdown": breakdown}


def _print_breakdown(breakdown: dict[str, dict[str, float]], labels: list[str], steps: int) -> None:
    """Per part, the microseconds a step of each precision spent in it (one more run of each, timed inside
    the loop; the timers cost the loop a little of their own)."""
    fp32, verifiable = breakdown["fp32"], breakdown["verifiable"]
    print(f"\nWhere a recorded step goes, us a step ({steps} steps, one run of each, timed inside the loop):")
    print(f"  {'part':<38} {'fp32':>8} {'verifiable':>11} {'ratio':>6}")
    rest = {p: t["step"] - sum(t.get(label, 0.0) for label in labels) for p, t in breakdown.items()}
    for label, x, y in [
        *((label, fp32.get(label, 0.0), verifiable.get(label, 0.0)) for label in labels),
        ("the rest (loop, env, Session step)", rest["fp32"], rest["verifiable"]),
        ("a step", fp32["step"], verifiable["step"]),
    ]:
        ratio = f"{y / x:6.1f}" if x > 0 else f"{'-':>6}"
        print(f"  {label:<38} {x / steps * 1e6:8.1f} {y / steps * 1e6:11.1f} {ratio}")


def _recorded_parts() -> list[tuple[Any, str, str]]:
    """The parts of a recorded step ``--part verifiable`` times in each precision: (owner, attribute, label)."""
    from agents import dqn
    from agents.buffers import ReplayBuffer
    from agents.networks import QNetworks
    from detrl.core.engine import Session
    from detrl.formats.bundle import BundleWriter

    return [
        (dqn, "td_update", "update (its optimizer step included)"),
        (dqn, "greedy_policy", "greedy action"),
        (QNetworks, "update_target", "target network update"),
        (Session, "_state_hash", "state commitment (digests)"),
        (BundleWriter, "append_step", "bundle append (log segment, record)"),
        (Session, "observe", "transition hash"),
        (ReplayBuffer, "add", "replay buffer add"),
        (ReplayBuffer, "sample", "replay buffer sample"),
    ]


def part_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Where a step of the speed part's run goes: each part timed inside the loop, then a greedy action
    timed alone in a tight loop (the same network shape), to show what the loop's other code costs it."""
    from agents import dqn
    from agents.buffers import ReplayBuffer
    from agents.networks import MLPQNetwork
    from detrl.core.engine import Session

    cfg = load(CLEANRL_CARTPOLE, **{"train.steps": args.steps})
    torch.set_num_threads(1)
    timer = PartTimer()
    parts = [
        (dqn, "td_update", "update"),
        (dqn, "greedy_policy", "greedy action"),
        (ReplayBuffer, "add", "replay buffer add"),
    ]

    def timed_env(env: Any) -> Any:
        env.step = timer.timed(env.step, "env step")
        env.reset = timer.timed(env.reset, "env reset")
        return env

    session_step = Session.step
    try:

        @contextlib.contextmanager
        def step(self: Session, *a: Any, **kw: Any) -> Any:  # times entering and leaving, not the body
            t0 = time.perf_counter()
            scope = session_step(self, *a, **kw)
            rounding = scope.__enter__()
            spent = time.perf_counter() - t0
            exc: BaseException | None = None
            try:
                yield rounding
            except BaseException as e:  # the step leaves as the body did: the error goes to it, then on
                exc = e
                raise
            finally:
                t1 = time.perf_counter()
                scope.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
                timer.seconds["Session step"] = (
                    timer.seconds.get("Session step", 0.0) + spent + time.perf_counter() - t1
                )
                timer.calls["Session step"] = timer.calls.get("Session step", 0) + 1

        Session.step = step  # type: ignore[method-assign]
        session = sessions.session_for(cfg, None, "off", sources=Sources.from_config(cfg.sources), force=True)
        with session, timed_parts(timer, parts, returns_timed={"greedy_policy"}):
            timed_sps = dqn.run(cfg, session, wrap_env=timed_env)["steps_per_second"]
    finally:
        Session.step = session_step  # type: ignore[method-assign]
    # The same run without the timers (which cost the loop some time of their own), and the same greedy
    # action alone: a fresh network of the same shape, one observation, 2,000 times in a row.
    sps = run_detrl(cfg)["steps_per_second"]
    greedy = dqn.greedy_policy(MLPQNetwork(4, 2, cfg.agent.hidden), torch.from_numpy)
    obs = np.zeros(4, np.float32)
    alone = min(timeit.repeat(lambda: greedy(obs), number=2000, repeat=5)) / 2000
    n, step_us = args.steps, 1e6 / timed_sps
    print(f"\nWhere a step goes: the speed part's run ({n} env steps), each part timed inside the loop:")
    print(f"  {'part':<28} {'us a call':>10} {'calls':>7} {'us a step':>10} {'share':>6}")
    for label in sorted(timer.seconds, key=lambda k: -timer.seconds[k]):
        sec, calls = timer.seconds[label], max(timer.calls[label], 1)
        share = sec / n * 1e6 / step_us
        print(f"  {label:<28} {sec / calls * 1e6:10.1f} {calls:7d} {sec / n * 1e6:10.1f} {share:6.0%}")
    rest = step_us - sum(timer.seconds.values()) / n * 1e6
    print(f"  {'the rest (loop, timers)':<28} {'':>10} {'':>7} {rest:10.1f} {rest / step_us:6.0%}")
    print(
        f"  {'a step':<28} {'':>10} {'':>7} {step_us:10.1f}   ({timed_sps:.0f} steps/s; {sps:.0f} in a run "
        "without the timers)"
    )
    print(f"  a greedy action alone, 2,000 in a row: {alone * 1e6:.1f} us")
    return {"seconds": timer.seconds, "calls": timer.calls, "steps_per_second": sps, "greedy_alone": alone}


#: detrl's DQN should take at least this many env steps per second for each of Stable-Baselines3's.
SPEED_GOAL = 3.0
#: A verifiable DQN may run this many times slower than the same run in FP32.
VERIFIABLE_GOAL = 2.0


def part_learning(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load("configs/dqn/cartpole.yaml")
    rows = []
    for seed in range(args.seeds):
        _log(f"learning: seed {seed}: detrl")
        c = cfg.model_copy(update={"sources": {"seed": seed}})
        ours = run_detrl(c)
        _log(f"learning: seed {seed}: SB3")
        theirs = run_sb3(cfg, seed=seed)
        rows.append((seed, float(np.mean(ours["eval_returns"])), float(np.mean(theirs["eval_returns"])),
                     ours["steps_per_second"], theirs["steps_per_second"]))  # fmt: skip
    print(
        f"\nLearning: configs/dqn/cartpole.yaml, {cfg.train.steps} steps, greedy eval of {cfg.eval.episodes} "
        "episodes (SB3: same hyperparameters, vanilla DQN):"
    )
    print(f"  {'seed':>4} {'detrl':>8} {'SB3':>8} {'detrl sps':>10} {'SB3 sps':>9}")
    for seed, a, b, sa, sb in rows:
        print(f"  {seed:>4} {a:8.1f} {b:8.1f} {sa:10.0f} {sb:9.0f}")
    ok_a = sum(r[1] >= 475 for r in rows)
    ok_b = sum(r[2] >= 475 for r in rows)
    print(f"  seeds with eval >= 475: detrl {ok_a}/{len(rows)}, SB3 {ok_b}/{len(rows)}  (goal: >= 4/5)")
    return {"rows": rows, "detrl_ok": ok_a, "sb3_ok": ok_b}


def _breakout_child(which: str, steps: int) -> None:
    """Runs in its own process: one Breakout run, then prints JSON with steps/s and peak RSS."""
    cfg = load("configs/dqn/breakout.yaml", **{"train.steps": steps, "agent.buffer_size": 100000,
               "agent.learning_starts": 1000, "eval.episodes": 0, "threads": 1})  # fmt: skip
    if which == "detrl":
        sps = run_detrl(cfg)["steps_per_second"]
    else:
        import envs

        sps = run_sb3(cfg, seed=0, env=envs.make(cfg.env.id, Sources(seed=0)))["steps_per_second"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"steps_per_second": sps, "peak_rss": peak}))


def part_breakout(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, dict] = {}
    for which in ("detrl", "sb3"):
        _log(f"breakout: {which} ({args.atari_steps} steps, own process)")
        cmd = [
            sys.executable,
            "-m",
            "agents.bench",
            "--child-breakout",
            which,
            "--atari-steps",
            str(args.atari_steps),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
        res[which] = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = res["detrl"], res["sb3"]
    print(
        f"\nBreakout (Nature CNN, buffer 100k, {args.atari_steps} steps, learning from step 1000, 1 thread):"
    )
    print(f"  detrl  {a['steps_per_second']:7.0f} steps/s   peak RSS {a['peak_rss'] / 1e6:7.0f} MB")
    print(f"  SB3    {b['steps_per_second']:7.0f} steps/s   peak RSS {b['peak_rss'] / 1e6:7.0f} MB")
    print(
        f"  ratio detrl / SB3: {a['steps_per_second'] / b['steps_per_second']:.2f}x speed, "
        f"{a['peak_rss'] / b['peak_rss']:.2f}x memory"
    )
    return res


def _spread(xs: list[float]) -> str:
    return "(" + ", ".join(f"{x:.0f}" for x in xs) + ")"


PARTS = {"speed": part_speed, "profile": part_profile, "switches": part_switches,
         "verifiable": part_verifiable, "learning": part_learning, "breakout": part_breakout}  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="detrl bench dqn", description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=[*PARTS, "all"])
    p.add_argument("--steps", type=int, default=50_000, help="speed/switches: env steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, default=5, help="learning: seeds 0..N-1")
    p.add_argument("--verifiable-steps", type=int, default=4000)
    p.add_argument("--atari-steps", type=int, default=20_000)
    p.add_argument("--json", help="also write the numbers as JSON")
    p.add_argument("--child-breakout", choices=["detrl", "sb3"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_breakout:
        _breakout_child(args.child_breakout, args.atari_steps)
        return 0
    print(machine_line(1))
    parts = list(PARTS) if args.part == "all" else [args.part]
    results = {name: PARTS[name](args) for name in parts}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


#: ``detrl bench dqn``: registered with detrl through the ``detrl.benchmarks`` entry point in pyproject.toml
#: (a ``(one-line description, callable(rest) -> exit code)`` pair, see :mod:`detrl.bench`).
BENCHMARK = ("detrl's DQN against Stable-Baselines3: speed, switches, verifiable, learning, Breakout", main)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
