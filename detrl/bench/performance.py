"""Performance benchmarks: ``overhead`` (step time and peak memory of verifiable precision), ``roundlog``
(log bytes per step), ``fsync`` (the cost of the durable points), ``sweep`` (ablation throughput) and
``audit-parallel`` (a segment-parallel audit against the sequential one)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from detrl.apps import ablation
from detrl.apps import audit as audit_mod
from detrl.bench.common import (
    BIG_MODELS,
    LOG_GOAL_FACTOR,
    MODEL_CONFIGS,
    PAPER_LOG_BYTES_PER_STEP,
    PartTimer,
    make_config,
    model_list,
    progress,
    record,
    reset_peak_rss,
    status_kb,
    timed_parts,
)
from detrl.bench.registry import benchmark
from detrl.core import kernel, native
from detrl.core.calibrate import Calibrator
from detrl.core.engine import Session
from detrl.core.hardware import get_profile
from detrl.core.hardware.profiles import EmulatedProfile
from detrl.core.rounding import Thresholds
from detrl.formats import bundle as bundle_mod
from detrl.formats import commit
from detrl.formats.roundlog import dense_reference_bytes
from detrl.run import config as config_mod
from detrl.run import sessions, tasks
from detrl.run.fmt import format_bytes, machine_line, table
from detrl.supervised import train

#: variant -> (Session mode, precision, native rounding kernel on, native dispatch route on)
VARIANTS: dict[str, tuple[str, str, bool, bool]] = {
    "verifiable record": ("record", "verifiable", True, True),
    "verifiable record, Python mode": ("record", "verifiable", True, False),
    "verifiable record, torch rounding": ("record", "verifiable", False, False),
    "verifiable off": ("off", "verifiable", True, True),
    "fp64": ("off", "fp64", True, True),
    "fp32": ("off", "fp32", True, True),
}
#: The step-time goals of verifiable recording over plain FP64, per model: what FP64 itself costs, and 30 %.
OVERHEAD_GOALS = {
    "resnet50": 1.3, "gpt2": 1.3, "digits_cnn": 1.3, "tiny_transformer": 1.3, "mlp_dropout": 1.3, "lstm_lm": 1.3,
}  # fmt: skip
#: The calibration step (step 1) may take this many times a later step of the same recording.
CALIBRATION_GOAL = 2.0
#: Rounding-log goals per step after calibration, in bytes: ResNet-50 and GPT-2 small at least 1000x below
#: the paper's logs (26.2 MB and 42.2 MB per step); the LSTM flat and small.
LOG_GOALS = {"resnet50": 26_200, "gpt2": 42_200, "lstm_lm": 5_000}
#: The phases of a timed step, in loop order (``--breakdown``): each measured between two clock reads.
PHASES = [
    "batch",
    "step entry",
    "forward and loss",
    "backward",
    "optimizer step",
    "step exit",
    "loss readout",
]
#: What ``--breakdown`` times inside a step's exit (its commitment): (owner, attribute, label).
COMMIT_PARTS = [
    (commit.StateTensorCache, "__call__", "step exit: the state's tensor list"),
    (Session, "_state_hash", "step exit: the state hash (switchboard bytes included)"),
    (bundle_mod.BundleWriter, "append_step", "step exit: the log segment and commitment record"),
]
#: What the calibration step adds (``--breakdown``, timed in the warm-up steps): the calibrator, and inside it
#: its reruns of the measured calls under the emulated profiles (timed only where the run itself is not on an
#: emulated profile, whose every op would count). Two timers, since one timer's parts do not nest.
CALIBRATOR, RERUNS = "the calibrator", "reruns under the profiles"
CALIBRATOR_PART = [(Calibrator, "__call__", CALIBRATOR)]
RERUN_PART = [(EmulatedProfile, "__call__", RERUNS)]


@dataclasses.dataclass
class _Loop:
    """A benchmark's training loop (:func:`_training_loop`): ``step(clock)`` runs the next training step and
    appends a clock read after each phase (:data:`PHASES`) to ``clock``, which holds the read before it."""

    session: Session
    baseline_kb: int  # VmRSS with torch imported and the data loaded, before the model is built
    step: Callable[[list[float]], None]


@contextlib.contextmanager
def _training_loop(spec: dict[str, Any], variant: str, steps: int) -> Iterator[_Loop]:
    """A Session of ``variant`` for ``spec``'s model, set up for ``steps`` steps. The bundle's directory, where
    it records, goes on exit."""
    mode, precision, _, _ = VARIANTS[variant]
    cfg = make_config(spec["model"], precision, steps, spec["threads"])
    x, y = train.load_data(cfg)
    thresholds: Any = "calibrate" if spec["tau"] is None else Thresholds(default=spec["tau"])
    tmp = tempfile.mkdtemp(prefix="detrl-bench-") if mode == "record" else None
    hardware = spec.get("hardware", "native")
    baseline_kb = status_kb("VmRSS")
    try:
        session = sessions.session_for(
            cfg, tmp, mode, hardware=hardware, checkpoint_every=0, thresholds=thresholds, force=True
        )
        with session:
            model = session.init(train.model_builder(cfg, x))
            opt = session.track(train.make_optimizer(cfg, model))
            model.train()
            batches = iter(session.loader((x, y), batch_size=cfg.train.batch_size, steps=steps))

            def step(clock: list[float]) -> None:
                batch = next(batches)
                clock.append(time.perf_counter())
                with session.step():
                    clock.append(time.perf_counter())
                    loss = train.training_loss(model, batch.x, batch.y)
                    clock.append(time.perf_counter())
                    loss.backward()
                    clock.append(time.perf_counter())
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    clock.append(time.perf_counter())
                clock.append(time.perf_counter())  # the exit: the commit and the log write
                float(loss.detach())
                clock.append(time.perf_counter())

            yield _Loop(session, baseline_kb, step)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _overhead_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``warmup + steps`` training steps of one variant in this (fresh) process; time and measure it."""
    torch.set_num_threads(spec["threads"])
    _, _, kernel_on, native_on = VARIANTS[spec["variant"]]
    kernel.set_enabled(kernel_on)  # this process is this variant's alone
    native.set_enabled(native_on)
    warmup, steps = spec["warmup"], spec["steps"]
    times: list[float] = []
    phases = dict.fromkeys(PHASES, 0.0)  # seconds over the timed steps
    timer = PartTimer()
    reset_ok, first_peak_kb = False, 0
    breakdown = bool(spec.get("breakdown"))
    calibrator, reruns = PartTimer(), PartTimer()
    calibration: dict[str, tuple[float, int]] = {}  # label -> (seconds, calls) in the warm-up steps
    with contextlib.ExitStack() as timers:
        timers.enter_context(timed_parts(timer, COMMIT_PARTS if breakdown else []))
        timers.enter_context(timed_parts(calibrator, CALIBRATOR_PART if breakdown else []))
        emulated = isinstance(get_profile(spec.get("hardware", "native")), EmulatedProfile)  # see RERUN_PART
        timers.enter_context(timed_parts(reruns, RERUN_PART if breakdown and not emulated else []))
        loop = timers.enter_context(_training_loop(spec, spec["variant"], warmup + steps))
        for i in range(warmup + steps):
            if i == warmup:
                first_peak_kb = status_kb("VmHWM")
                reset_ok = reset_peak_rss()
                timer.seconds = dict.fromkeys(timer.seconds, 0.0)  # the timed steps' only
                # the warm-up steps' calibration (a recording calibrates in its first step only)
                calibration = {
                    label: (part.seconds[label], part.calls[label])
                    for part, label in ((calibrator, CALIBRATOR), (reruns, RERUNS))
                    if label in part.seconds
                }
            clock = [time.perf_counter()]
            loop.step(clock)
            times.append(clock[-1] - clock[0])
            if i >= warmup:
                for name, a, b in zip(PHASES, clock, clock[1:]):
                    phases[name] += b - a
        peak_kb = status_kb("VmHWM")
    return {
        "phases": {name: t / max(1, steps) for name, t in {**phases, **timer.seconds}.items()},
        "calibration": calibration,
        "times": times[warmup:],
        "first": times[:warmup],
        "baseline_kb": loop.baseline_kb,
        "peak_kb": peak_kb,
        "first_peak_kb": first_peak_kb,
        "reset_ok": reset_ok,
        "logged": [s.logged for s in loop.session.step_stats[warmup:]],
        "log_bytes": loop.session.log_bytes[-steps:]
        if steps
        else [],  # the timed steps' (the list starts at step 0)
    }


#: The variants a step-by-step process runs side by side (:func:`_interleaved_worker`): fp64 and the recording.
INTERLEAVED = ("fp64", "verifiable record")


def _interleaved_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run :data:`INTERLEAVED`'s two variants in this one process, a training step of each in turn (which of
    the two goes first alternates from step to step), after ``warmup`` steps of each: a shared machine's
    drift, which moves separate processes' medians by 10-40 %, then reaches both alike, and each step pairs
    with the other's next to it. Returns each variant's timed steps (seconds) and the order they ran in."""
    torch.set_num_threads(spec["threads"])
    flags = {VARIANTS[v][2:] for v in INTERLEAVED}
    assert len(flags) == 1, "step by step, the variants must share the process's kernel and route settings"
    ((kernel_on, native_on),) = flags
    kernel.set_enabled(kernel_on)
    native.set_enabled(native_on)
    warmup, steps = spec["warmup"], spec["steps"]
    times: dict[str, list[float]] = {v: [] for v in INTERLEAVED}
    order: list[str] = []
    with contextlib.ExitStack() as stack:
        loops = {v: stack.enter_context(_training_loop(spec, v, warmup + steps)) for v in INTERLEAVED}
        for v in INTERLEAVED:  # each variant's warm-up (the recording's calibrates) before any timed step
            for _ in range(warmup):
                loops[v].step([time.perf_counter()])
        for i in range(steps):
            for v in INTERLEAVED if i % 2 == 0 else reversed(INTERLEAVED):
                clock = [time.perf_counter()]
                loops[v].step(clock)
                times[v].append(clock[-1] - clock[0])
                order.append(v)
    return {"times": times, "order": order}


def _worker_main() -> None:
    spec = json.loads(sys.argv[1])
    worker = _interleaved_worker if spec["variant"] == "interleaved" else _overhead_worker
    print("RESULT " + json.dumps(worker(spec)), flush=True)


def _spawn_worker(spec: dict[str, Any]) -> dict[str, Any]:
    code = "from detrl.bench.performance import _worker_main; _worker_main()"
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    what = f"benchmark worker for {spec['model']} ({spec['variant']})"
    if proc.returncode < 0:  # SIGKILL with no output: most often the kernel's out-of-memory killer
        signame = signal.Signals(-proc.returncode).name
        raise ChildProcessError(f"{what} was killed by {signame} (out of memory?)")
    last = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}, no output"]
    raise ChildProcessError(f"{what} failed: {last[0]}")


@benchmark("overhead", "step time and peak memory of verifiable precision against plain FP64 and FP32")
def bench_overhead(rest: list[str]) -> int:
    """Step time and peak memory of verifiable precision (recording, and ``mode="off"`` to separate the
    log and commitment I/O) against plain FP64 and plain FP32, per model; each (model, variant, repeat)
    runs in a fresh subprocess so that its peak RSS is its own."""
    args = _overhead_arguments(rest)
    models = model_list(args.models)
    get_profile(args.hardware)  # a bad or absent profile fails here, in one line, before any work
    print(machine_line(args.threads) + ("" if args.hardware == "native" else f" | hardware {args.hardware}"))
    print(
        "step time: wall time of a whole loop iteration (batch, forward, backward, optimizer, commit, log "
        "write), first step(s) excluded; peak memory: VmHWM (peak RSS) of a fresh process per variant, "
        "reset via /proc/self/clear_refs after the warm-up step, minus its RSS before the model was built (abs.: the whole process)"
    )
    rows: list[list[str]] = []
    notes: list[str] = []
    breakdowns: list[str] = []
    for model in models:
        big = model in BIG_MODELS
        steps = args.big_steps if big else args.steps
        repeats = args.big_repeats if big else args.repeats
        tau = args.resnet_tau if model == "resnet50" and args.resnet_tau > 0 else None
        if tau is not None:
            notes.append(
                f"{model}: verifiable variants use a fixed threshold tau={tau:g} for every op instead of "
                "calibrating in step 1 (same rounding work per step; at least as many logged elements as "
                "a calibrated run)"
            )
        res, step_by_step = _measure_model(model, args, steps, repeats, tau)
        if args.breakdown:
            breakdowns.append(_breakdown_table(model, res))
            if args.warmup >= 1 and tau is None:
                breakdowns.append(_calibration_table(model, res))
        model_rows, model_notes = _model_rows(model, args, steps, tau, res, step_by_step)
        rows += model_rows
        notes += model_notes
    print(table(_OVERHEAD_HEADERS, rows))
    for n in notes:
        print("note: " + n)
    _print_overhead_legend()
    for b in breakdowns:
        print(b)
    return 0


def _overhead_arguments(rest: list[str]) -> argparse.Namespace:
    """``detrl bench overhead``'s arguments."""
    p = argparse.ArgumentParser(prog="detrl bench overhead", description=bench_overhead.__doc__)
    p.add_argument(
        "--models",
        default="digits_cnn,tiny_transformer,resnet50",
        help="comma list of " + ",".join(MODEL_CONFIGS),
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per process (small models)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (small models)")
    p.add_argument(
        "--big-steps",
        "--resnet-steps",
        type=int,
        default=2,
        help="timed steps per process for resnet50, gpt2",
    )
    p.add_argument(
        "--big-repeats",
        "--resnet-repeats",
        type=int,
        default=1,
        help="fresh processes per variant (resnet50, gpt2)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (step 1 calibrates)")
    p.add_argument(
        "--resnet-tau",
        type=float,
        default=0.0,
        help="fixed threshold for resnet50's verifiable variants, to skip the ~1 min calibration step "
        "(logs more than a calibrated run); 0 or negative (default): calibrate as a real run does",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--no-step-by-step",
        action="store_true",
        help="skip the process per repeat that runs fp64 and verifiable record a step of each in turn (the "
        "verdict's ratio; small models only: resnet50 and gpt2 are judged by their processes' medians)",
    )
    p.add_argument(
        "--hardware",
        default="native",
        help="the profile every variant runs on (cuda: the GPU, where torch sees one; see `detrl profiles`); "
        "peak memory is the host's either way",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also print where a step goes: each phase of the loop, and the parts of the commitment, timed "
        "inside the loop (the commitment's timers cost it a few microseconds of their own); and where the "
        "first step goes: the calibrator, its reruns under the emulated profiles, the rest of the step",
    )
    return p.parse_args(rest)


def _measure_model(
    model: str, args: argparse.Namespace, steps: int, repeats: int, tau: float | None
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Each variant's processes for ``model`` (a fresh one per variant and repeat, in :func:`run_order`),
    and the step-by-step processes (small models, unless ``--no-step-by-step``)."""
    big = model in BIG_MODELS
    res: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    step_by_step: list[dict[str, Any]] = []  # the repeats' interleaved processes (small models)
    for r in range(repeats):
        spec = {"model": model, "steps": steps, "warmup": args.warmup, "threads": args.threads, "tau": tau,
                "breakdown": args.breakdown, "hardware": args.hardware}  # fmt: skip
        for v in run_order(r):
            t0 = time.perf_counter()
            out = _spawn_worker({**spec, "variant": v})
            res[v].append(out)
            progress(
                f"{model} repeat {r + 1}/{repeats} {v}: median "
                f"{statistics.median(out['times']) * 1e3:.1f} ms/step ({time.perf_counter() - t0:.0f} s)"
            )
        if not big and not args.no_step_by_step:
            t0 = time.perf_counter()
            out = _spawn_worker({**spec, "variant": "interleaved"})
            step_by_step.append(out)
            progress(
                f"{model} repeat {r + 1}/{repeats} {' and '.join(INTERLEAVED)} step by step: median ratio "
                f"{statistics.median(_step_ratios([out])):.2f}x ({time.perf_counter() - t0:.0f} s)"
            )
    return res, step_by_step


def _model_rows(
    model: str,
    args: argparse.Namespace,
    steps: int,
    tau: float | None,
    res: dict[str, list[dict[str, Any]]],
    step_by_step: list[dict[str, Any]],
) -> tuple[list[list[str]], list[str]]:
    """The table's rows for ``model``, one per variant, and the notes they need."""
    rows: list[list[str]] = []
    notes: list[str] = []
    med = {v: statistics.median([t for o in res[v] for t in o["times"]]) for v in VARIANTS}
    mem = {v: statistics.median([(o["peak_kb"] - o["baseline_kb"]) / 1024 for o in res[v]]) for v in VARIANTS}
    mem1 = {
        v: statistics.median(
            [(max(o["first_peak_kb"], o["peak_kb"]) - o["baseline_kb"]) / 1024 for o in res[v]]
        )
        for v in VARIANTS
    }
    absmem = {v: statistics.median([o["peak_kb"] / 1024 for o in res[v]]) for v in VARIANTS}
    if not all(o["reset_ok"] for v in VARIANTS for o in res[v]):
        notes.append(f"{model}: could not reset peak RSS; steady-state peak includes the warm-up step")
    for v in VARIANTS:
        logged = [n for o in res[v] for n in o["logged"]]
        recording = v == "verifiable record"
        goal = OVERHEAD_GOALS.get(model) if recording else None
        # the verdict is the step-by-step ratio's, where it was measured
        by_step = v == PAIRED and bool(step_by_step)
        calibration, own, log = "-", "-", "-"
        if args.warmup >= 1 and all(o["times"] for o in res[v]):
            # step 1 against the same process's later steps: one-off costs (lazy imports, first calls)
            # in every variant, plus the calibration in verifiable record (when it calibrates)
            ratio = statistics.median([o["first"][0] / statistics.median(o["times"]) for o in res[v]])
            calibrates = recording and tau is None
            calibration = f"{ratio:.1f}x{_verdict(ratio, CALIBRATION_GOAL if calibrates else None)}"
            if calibrates:
                own = f"{_calibration_own(res[v], res['verifiable off']):.1f}"
        if mode_records(v):
            log = _log_column(model, [b for o in res[v] for b in o["log_bytes"]])
        rows.append([
            model, v, str(len(res[v]) * steps), f"{med[v] * 1e3:.1f}",
            f"{med[v] / med['fp64']:.2f}x{_verdict(med[v] / med['fp64'], None if by_step else goal)}",
            _step_by_step_column(step_by_step, goal) if by_step else "-",
            _paired_column(res[v], res["fp64"]) if v == PAIRED else "-", f"{med[v] / med['fp32']:.2f}x",
            f"{mem[v]:.0f}", f"{mem[v] / mem['fp64']:.2f}x" if mem["fp64"] > 0 else "-",
            f"{mem1[v]:.0f}", f"{absmem[v]:.0f}", f"{statistics.median(logged):.0f}" if logged else "-",
            calibration, own, log,
        ])  # fmt: skip
    return rows, notes


_OVERHEAD_HEADERS = [
    "model", "variant", "steps", "median ms/step", "/fp64", "/fp64 step by step: median (q1..q3)",
    "/fp64 per repeat: median (min..max)", "/fp32", "peak MB", "peak /fp64", "peak MB incl. step 1",
    "abs. peak RSS MB", "logged/step", "step 1 / later", "calibration's own, in later steps",
    "log KB/step (first..last)",
]  # fmt: skip


def _print_overhead_legend() -> None:
    """What the table's columns mean, and the goals."""
    print(
        "/fp64: the median step of every process of the variant over fp64's; step by step (the verdict where "
        f"shown): each repeat also runs fp64 and {PAIRED} in one process, a step of each in turn, and this is "
        "the median and quartiles of every step's ratio to the fp64 step beside it, which a drifting machine "
        f"moves far less than separate processes; per repeat: each repeat runs {PAIRED} and fp64 back to back, "
        "and its ratio is theirs alone, so its spread is the machine's drift between repeats"
    )
    print(
        "calibration's own: (step 1 of verifiable record - step 1 of verifiable off) / a later step of verifiable "
        "record, median over the repeats paired in order: what calibrating (and the durable point that "
        "publishes the thresholds) adds to the first step beyond the one-off costs of the first step every "
        "variant pays (see their step 1 / later); step 1 / later is the whole cost"
    )
    print(
        "goal: verifiable recording within the goal beside it of plain FP64 step time, and within 1.2x its peak "
        f"memory (paper's hooks: 3.9x, 1.8x); its calibration step within {CALIBRATION_GOAL:g}x a later step; "
        "its log per step (after step 1) within the goal beside it: ResNet-50 and GPT-2 small 1000x below the "
        "paper's 26.2 MB and 42.2 MB, the LSTM 5 KB, flat; 'Python mode': every op through the Python rounding "
        "mode (the native dispatch route off); 'torch rounding': that, and the native rounding kernel off too"
    )


def _breakdown_table(model: str, res: dict[str, list[dict[str, Any]]]) -> str:
    """Where a step of ``model`` goes, in ms: each phase of the loop and each part of the commitment, per
    variant (median over its processes of their mean over the timed steps), and verifiable recording's
    excess over plain FP64 phase by phase."""
    shown = ["fp64", "verifiable off", "verifiable record"]
    commit_labels = [label for _, _, label in COMMIT_PARTS]
    exit_rest = "step exit: the rest (stats, Session)"
    med = {
        v: {
            k: statistics.median([o["phases"].get(k, 0.0) for o in res[v]]) for k in [*PHASES, *commit_labels]
        }
        for v in shown
    }
    for v in shown:  # the commitment's parts are inside the exit: the rest of it is its own row
        med[v][exit_rest] = med[v]["step exit"] - sum(med[v][label] for label in commit_labels)
        med[v]["a step"] = statistics.median([statistics.median(o["times"]) for o in res[v]])
    exit_at = PHASES.index("step exit")
    rows_order = [*PHASES[:exit_at], *commit_labels, exit_rest, *PHASES[exit_at + 1 :], "a step"]
    rows = [
        [label, *(f"{med[v][label] * 1e3:.3f}" for v in shown),
         f"{(med['verifiable record'][label] - med['fp64'][label]) * 1e3:+.3f}"]
        for label in rows_order
    ]  # fmt: skip
    head = (
        f"\n{model}: where a step goes, ms (each phase between two clock reads inside the loop; median over "
        "the processes of each one's mean over its timed steps; 'a step' is the median step)"
    )
    return head + "\n" + table(["part", *shown, "record - fp64"], rows)


def _calibration_table(model: str, res: dict[str, list[dict[str, Any]]]) -> str:
    """Where the first step of ``model`` goes, in ms and in later steps of the same variant (medians over its
    processes): in verifiable record, the calibrator, its reruns under the emulated profiles, and the rest
    of the step; fp64 and verifiable off, which do not calibrate, for the first step's one-off costs."""
    rows = []
    for v in ("fp64", "verifiable off", "verifiable record"):
        later = statistics.median([statistics.median(o["times"]) for o in res[v]])
        first = [o["first"][0] for o in res[v]]
        if v != "verifiable record":
            rows.append(
                [v, f"{later * 1e3:.1f}", _in_steps(first, later), "-", "-", "-", _in_steps(first, later)]
            )
            continue
        called = [o["calibration"].get(CALIBRATOR, (0.0, 0)) for o in res[v]]
        spent = [s for s, _ in called]
        rerun = [o["calibration"].get(RERUNS) for o in res[v]]
        timed = all(r is not None for r in rerun)  # not on an emulated profile
        rows.append([
            v, f"{later * 1e3:.1f}", _in_steps(first, later), _in_steps(spent, later, [n for _, n in called]),
            _in_steps([r[0] for r in rerun], later, [r[1] for r in rerun]) if timed else "-",
            _in_steps([s - r[0] for s, r in zip(spent, rerun)], later) if timed else "-",
            _in_steps([f - s for f, s in zip(first, spent)], later),
        ])  # fmt: skip
    head = (
        f"\n{model}: the first step (the calibration step of verifiable record), ms (and in later steps of the "
        "same variant); the calibrator measures each new class of logged calls twice: it reruns them under "
        "the emulated profiles that can change their bits, and takes the units, samples and disagreements "
        "(the rest)"
    )
    headers = ["variant", "a later step", "step 1", "the calibrator", "its reruns under the profiles",
               "the calibrator's rest", "step 1 outside the calibrator"]  # fmt: skip
    return head + "\n" + table(headers, rows)


def _in_steps(seconds: list[float], later: float, calls: list[int] | None = None) -> str:
    """The median of ``seconds`` in ms and in steps of ``later`` seconds (and the median of ``calls``)."""
    s = statistics.median(seconds)
    n = f", {statistics.median(calls):.0f} calls" if calls is not None else ""
    return f"{s * 1e3:.1f} ({s / later:.1f} steps{n})"


#: The variant that runs beside fp64 in every repeat, for its per-repeat ratio.
PAIRED = "verifiable record"


def run_order(repeat: int) -> list[str]:
    """The variants' order in repeat ``repeat``: rotated by one each repeat to spread a drifting machine's
    slow spells, with fp64 moved beside :data:`PAIRED`, before it in odd repeats and after it in even ones."""
    names = list(VARIANTS)
    order = names[repeat % len(names) :] + names[: repeat % len(names)]
    order.remove("fp64")
    at = order.index(PAIRED)
    order.insert(at if repeat % 2 else at + 1, "fp64")
    return order


def _paired_column(paired: list[dict[str, Any]], fp64: list[dict[str, Any]]) -> str:
    """``median (min..max)`` over the repeats of the paired variant's median step over fp64's in the same
    repeat (the two ran back to back)."""
    ratios = [statistics.median(p["times"]) / statistics.median(f["times"]) for p, f in zip(paired, fp64)]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f})"


def _step_ratios(step_by_step: list[dict[str, Any]]) -> list[float]:
    """Each timed step's ratio of :data:`INTERLEAVED`'s second variant to its first, over every process of
    :func:`_interleaved_worker` (step i of one beside step i of the other)."""
    first, second = INTERLEAVED
    return [b / a for out in step_by_step for a, b in zip(out["times"][first], out["times"][second])]


def _step_by_step_column(step_by_step: list[dict[str, Any]], goal: float | None) -> str:
    """``median (q1..q3)`` of :func:`_step_ratios`, with the verdict against ``goal``."""
    ratios = _step_ratios(step_by_step)
    if not ratios:
        return "-"
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    median = statistics.median(ratios)
    return f"{median:.2f}x ({q1:.2f}..{q3:.2f}){_verdict(median, goal)}"


def _calibration_own(recorded: list[dict[str, Any]], off: list[dict[str, Any]]) -> float:
    """Median over paired processes of (recording's step 1 - unrecorded step 1) / the recording's later step."""
    pairs = zip(recorded, off)  # the same repeat index: neighbours in time on a machine that drifts
    return statistics.median(
        [(r["first"][0] - o["first"][0]) / statistics.median(r["times"]) for r, o in pairs]
    )


def mode_records(variant: str) -> bool:
    """Whether ``variant`` writes a bundle (and so a log)."""
    return VARIANTS[variant][0] == "record"


def _verdict(value: float, goal: float | None) -> str:
    return "" if goal is None else f" (goal <= {goal:g}x: {'MET' if value <= goal else 'MISSED'})"


def _log_column(model: str, per_step: list[int]) -> str:
    """Median log KB per step after calibration, the first and last timed steps' sizes, and its goal."""
    if not per_step:
        return "-"
    median = statistics.median(per_step)
    text = f"{median / 1e3:.1f} ({per_step[0] / 1e3:.1f}..{per_step[-1] / 1e3:.1f})"
    goal = LOG_GOALS.get(model)
    if goal is not None:
        text += f" (goal <= {goal / 1e3:g} KB: {'MET' if median <= goal else 'MISSED'})"
    return text


@benchmark("roundlog", "rounding-log bytes per step against the dense encoding and the paper's 26.2 MB")
def bench_roundlog(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="detrl bench roundlog")
    p.add_argument("--models", default="digits_cnn,mlp_dropout,tiny_transformer,resnet50")
    p.add_argument("--steps", type=int, default=30, help="steps for the small models")
    p.add_argument("--resnet-steps", type=int, default=3, help="steps for resnet50 (step 1 takes ~1 min)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(rest)
    torch.set_num_threads(args.threads)
    models = model_list(args.models)
    print(machine_line(args.threads))
    print(
        "step 1 calibrates the thresholds (every logged op reruns under the emulated profiles), so it is "
        "reported separately; "
        "'steps 2..N' are per-step means. dense = one base-3 digit per rounded element, 5 per byte"
    )
    rows = []
    resnet_bytes: float | None = None
    with tempfile.TemporaryDirectory(prefix="detrl-bench-") as tmp:
        for model in models:
            steps = args.resnet_steps if model == "resnet50" else args.steps
            t0 = time.perf_counter()
            progress(f"recording {model}, {steps} steps ...")
            s = record(make_config(model, "verifiable", steps, args.threads), Path(tmp) / model)
            progress(f"{model}: {time.perf_counter() - t0:.0f} s")
            per_step = s.log_bytes[-steps:]  # log_bytes starts with the initial state's leaf (no log)
            parts = [("step 1", [0])]
            if steps > 1:
                parts.append((f"steps 2..{steps}", list(range(1, steps))))
            for label, idx in parts:
                logged = statistics.mean(s.step_stats[i].logged for i in idx)
                rounded = statistics.mean(s.step_stats[i].rounded_elements for i in idx)
                lb = statistics.mean(per_step[i] for i in idx)
                dense = statistics.mean(dense_reference_bytes(s.step_stats[i].rounded_elements) for i in idx)
                if model == "resnet50" and label != "step 1":
                    resnet_bytes = lb
                rows.append([
                    model, label, f"{logged:,.0f}", f"{lb:,.0f}", f"{rounded:,.0f}", f"{dense:,.0f}",
                    f"{dense / max(lb, 1):,.0f}x", f"{PAPER_LOG_BYTES_PER_STEP / max(lb, 1):,.1f}x",
                ])  # fmt: skip
    headers = ["model", "steps", "logged el./step", "log B/step", "rounded el./step", "dense B/step",
               "dense/log", "26.2MB/log"]  # fmt: skip
    print(table(headers, rows))
    print(
        f"paper: its code writes {format_bytes(PAPER_LOG_BYTES_PER_STEP)} of log per ResNet-50 step at batch 8; "
        f"goal >= {LOG_GOAL_FACTOR}x smaller, i.e. <= {format_bytes(PAPER_LOG_BYTES_PER_STEP / LOG_GOAL_FACTOR)}/step"
    )
    if resnet_bytes is not None:
        factor = PAPER_LOG_BYTES_PER_STEP / max(resnet_bytes, 1)
        verdict = "MET" if factor >= LOG_GOAL_FACTOR else "MISSED"
        print(
            f"ours (resnet50, steps after calibration): {format_bytes(resnet_bytes)}/step = {factor:,.1f}x smaller "
            f"than the paper's -> goal {verdict}"
            + ("" if factor >= LOG_GOAL_FACTOR else f" by {LOG_GOAL_FACTOR / factor:.1f}x")
        )
    return 0


def _fsync_run(cfg: Any, run_dir: Path, fsync: bool) -> dict[str, float]:
    """Record ``cfg`` in-process, timing the durable points (checkpoint write, fsyncs, manifest replacement)."""
    writer = bundle_mod.BundleWriter
    real_fsync, real_ckpt, real_durable = os.fsync, writer.checkpoint, writer.make_durable
    acc = {"durable_s": 0.0, "fsync_s": 0.0, "points": 0, "checkpoints": 0, "fsyncs": 0}
    depth = [0]

    def timed(fn: Callable[..., Any], is_checkpoint: bool) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # checkpoint() calls make_durable(): time the outer call only
                    acc["durable_s"] += time.perf_counter() - t
                    acc["points"] += 1
                acc["checkpoints"] += is_checkpoint

        return wrapper

    def timed_fsync(fd: int) -> None:
        t = time.perf_counter()
        if fsync:
            real_fsync(fd)
        acc["fsync_s"] += time.perf_counter() - t
        acc["fsyncs"] += 1

    shutil.rmtree(run_dir, ignore_errors=True)
    session = sessions.session_for(cfg, run_dir, "record")
    task = tasks.get(cfg.task)
    os.fsync = timed_fsync
    writer.checkpoint = timed(real_ckpt, True)  # type: ignore[method-assign]
    writer.make_durable = timed(real_durable, False)  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        with session:
            task.run(cfg, session)
        acc["run_s"] = time.perf_counter() - t0
    finally:
        os.fsync, writer.checkpoint, writer.make_durable = real_fsync, real_ckpt, real_durable  # type: ignore[method-assign]
    acc["steps"] = session.step_index
    acc["bytes"] = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    return acc


@benchmark("fsync", "cost of the durable points (checkpoint write, fsync, manifest) as a share of run time")
def bench_fsync(rest: list[str]) -> int:
    """Record configs/dqn/cartpole.yaml (fp32) in-process with the bundle writer's durable points timed,
    interleaved with the same run with ``os.fsync`` a no-op; reports their share of the run time."""
    p = argparse.ArgumentParser(prog="detrl bench fsync", description=bench_fsync.__doc__)
    p.add_argument("--config", default="configs/dqn/cartpole.yaml")
    p.add_argument("--steps", type=int, default=20_000, help="environment steps per run")
    p.add_argument("--checkpoint-every", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved (ABBA...)")
    p.add_argument("--dir", help="where to write the bundles (default: a temp dir; the disk matters)")
    args = p.parse_args(rest)
    cfg = config_mod.load(
        args.config,
        [
            f"train.steps={args.steps}",
            f"verify.checkpoint_every={args.checkpoint_every}",
            "eval.episodes=0",
        ],
    )
    torch.set_num_threads(cfg.threads)
    print(machine_line(cfg.threads))
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="detrl-bench-fsync-"))
    print(
        f"{args.config}: precision {cfg.precision}, {args.steps} steps, checkpoint every {args.checkpoint_every}, "
        f"bundles in {work}; a durable point = checkpoint write (temp file, fsync, rename, fsync of the "
        "directory) + fsync of commitments (and log) + manifest replacement"
    )
    res: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for r in range(args.repeats):
            for fsync in (True, False) if r % 2 == 0 else (False, True):
                out = _fsync_run(cfg, work / f"run-{r}-{int(fsync)}", fsync)
                res[fsync].append(out)
                progress(
                    f"repeat {r + 1}/{args.repeats} fsync={'on' if fsync else 'off'}: {out['run_s']:.1f} s"
                )
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    med = lambda xs: statistics.median(xs)  # noqa: E731
    for fsync in (True, False):
        rs = res[fsync]
        run_s, durable_s = med([o["run_s"] for o in rs]), med([o["durable_s"] for o in rs])
        points, ckpts = rs[0]["points"], rs[0]["checkpoints"]
        rows.append([
            "fsync on" if fsync else "fsync off (no-op)", str(len(rs)), f"{run_s:.2f}", f"{durable_s:.3f}",
            f"{med([o['fsync_s'] for o in rs]):.3f}", f"{100 * durable_s / run_s:.2f}%", str(int(points)),
            str(int(ckpts)), f"{durable_s / max(1, ckpts):.3f}", format_bytes(rs[0]["bytes"]),
            f"{1e3 * run_s / max(1, rs[0]['steps']):.3f}",
        ])  # fmt: skip
    headers = ["variant", "runs", "run s", "durable-point s", "in fsync s", "share of run", "durable points",
               "checkpoints", "s/checkpoint", "bundle", "ms/step"]  # fmt: skip
    print(table(headers, rows))
    on, off = (med([o["run_s"] for o in res[v]]) for v in (True, False))
    share = med([o["durable_s"] / o["run_s"] for o in res[True]])
    cost = med([o["durable_s"] for o in res[True]]) - med([o["durable_s"] for o in res[False]])
    print(
        f"run time fsync on / off: {on / off:.3f}x (medians of {args.repeats} interleaved runs each; on a shared "
        f"machine mostly noise); fsync's own cost, durable-point seconds on - off: {cost:.3f} s "
        f"({100 * cost / on:.2f}% of the run)"
    )
    verdict = "MET" if share < 0.02 else "MISSED"
    print(f"goal: durable points under 2% of run time (fsync on): {100 * share:.2f}% -> {verdict}")
    return 0


@benchmark("sweep", "ablation sweep throughput: 1 worker against N on this machine, side by side")
def bench_sweep(rest: list[str]) -> int:
    """Run the same ablation sweep with 1 worker and with ``--workers`` workers (local process pool, one
    torch thread each), interleaved (1, N, N, 1, ...), each into a fresh directory: wall time per sweep,
    runs per second and the speed-up. Also checks that both give byte-identical ``summary.json``."""
    p = argparse.ArgumentParser(prog="detrl bench sweep", description=bench_sweep.__doc__)
    p.add_argument(
        "--config",
        default="configs/ablate/digits.yaml",
        help="the ablation config (default: the supervised table's own, at its own run length)",
    )
    p.add_argument("--sources", default="", help="sources to vary (default: the config's)")
    p.add_argument("--runs", type=int, default=3, help="runs per condition")
    p.add_argument("--workers", type=int, default=2, help="workers of the parallel variant")
    p.add_argument("--repeats", type=int, default=2, help="sweeps per variant, interleaved")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train.steps per run (default: the config's); short runs measure the pool's start, not the sweep",
    )
    args = p.parse_args(rest)
    sources = ablation.parse_sources(args.sources) if args.sources else None
    # The fp32 conditions only: the verifiable-precision and remedy conditions are other workloads.
    spec = ablation.load_spec(
        args.config, runs=args.runs, sources=sources, verifiable_hardware=False, remedies=[]
    )
    steps = [f"train.steps={args.steps}"] if args.steps is not None else []
    spec = spec.model_copy(update={"set": [*spec.set, *steps]})
    planned = config_mod.validate(config_mod.apply_overrides(config_mod.read_raw(spec.base), spec.set))
    n = len(ablation.jobs(spec))
    print(machine_line(1))
    print(
        f"{args.config}: {n} runs per sweep ({', '.join(ablation.conditions(spec))}; {spec.runs} runs each, "
        f"{planned.train.steps} steps a run); the times include starting the worker processes"
    )
    work = Path(tempfile.mkdtemp(prefix="detrl-bench-sweep-"))
    times: dict[int, list[float]] = {1: [], args.workers: []}
    summaries: dict[int, bytes] = {}
    try:
        for r in range(args.repeats):
            for w in (1, args.workers) if r % 2 == 0 else (args.workers, 1):
                out = work / f"sweep-{r}-{w}"
                t0 = time.perf_counter()
                ablation.run_sweep(spec, out, workers=w, progress=False)
                times[w].append(time.perf_counter() - t0)
                ablation.write_summary(out, ablation.summarise(out))
                summaries[w] = (out / "summary.json").read_bytes()
                progress(f"repeat {r + 1}/{args.repeats}, {w} worker(s): {times[w][-1]:.1f} s")
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for w, ts in times.items():
        med = statistics.median(ts)
        rows.append([str(w), str(len(ts)), f"{med:.1f}", f"{n / med:.3f}"])
    print(table(["workers", "sweeps", "median s", "runs/s"], rows))
    speedup = statistics.median(times[1]) / statistics.median(times[args.workers])
    same = len(set(summaries.values())) == 1
    print(
        f"speed-up {args.workers} workers / 1: {speedup:.2f}x; summaries byte-identical: {'yes' if same else 'NO'}"
    )
    verdict = "MET" if speedup >= 0.9 * args.workers else "MISSED"
    print(f"goal: at least {0.9 * args.workers:.1f}x -> {verdict}")
    return 0 if same else 1


@benchmark(
    "audit-parallel", "audit wall time: 1 worker against N segment workers on this machine, side by side"
)
def bench_audit_parallel(rest: list[str]) -> int:
    """Record a digits CNN run with a checkpoint every few steps, then time ``detrl audit`` on it end to end
    (a fresh process each, as a user runs it) with 1 worker (the sequential replay) and with ``--workers``
    segment workers (the local process pool, one torch thread each), interleaved (1, N, N, 1, ...): median wall
    time of each, the speed-up, and that both write the same JSON report. Also times one process's start
    (a fresh Python importing what a replay imports: the auditor, the digits, torch's dynamo that the
    optimizer pulls in): the parallel audit's workers fork from a process that imports it beside the
    auditor's own start, instead of after it. Between repeats
    it measures the machine's own ceiling (:func:`machine_ceiling`): the same number of fixed CPU-bound jobs
    side by side against one after another."""
    p = argparse.ArgumentParser(prog="detrl bench audit-parallel", description=bench_audit_parallel.__doc__)
    p.add_argument("--steps", type=int, default=240, help="steps of the recorded run (its audit: 80 s here)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="its checkpoint spacing (segment length)")
    p.add_argument("--channels", type=int, default=64, help="the CNN's channels (the step's cost)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2, help="workers of the parallel audit")
    p.add_argument("--repeats", type=int, default=3, help="audits per variant, interleaved")
    p.add_argument("--hardware", default="native", help="the profile both audits replay on")
    args = p.parse_args(rest)
    config = "configs/supervised/digits_cnn.yaml"
    cfg = config_mod.load(
        config,
        [f"train.steps={args.steps}", f"verify.checkpoint_every={args.checkpoint_every}",
         f"model.channels={args.channels}", f"train.batch_size={args.batch_size}", "name=bench_audit_parallel"],
    )  # fmt: skip
    checkpoints = list(range(args.checkpoint_every, args.steps + 1, args.checkpoint_every))
    cuts = audit_mod.segments(args.steps, checkpoints, audit_mod.SEGMENTS_PER_WORKER * args.workers)
    print(machine_line(1))
    print(
        f"{config} (channels {args.channels}, batch {args.batch_size}): {args.steps} steps, a checkpoint every "
        f"{args.checkpoint_every}: {len(cuts)} segments; audited on {args.hardware}, 1 torch thread per process; "
        "each audit is a fresh `detrl audit --quiet` process, its time end to end"
    )
    work = Path(tempfile.mkdtemp(prefix="detrl-bench-audit-parallel-"))
    times: dict[int, list[float]] = {1: [], args.workers: []}
    reports: dict[int, str] = {}
    ceilings: list[float] = []
    try:
        run = work / "run"
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        record(cfg, run)
        progress(f"recorded {args.steps} steps in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        warm = "import detrl.apps.audit, torch._dynamo; from detrl.supervised import data; data.digits()"
        subprocess.run([sys.executable, "-c", warm], check=True)
        start = time.perf_counter() - t0
        for r in range(args.repeats):
            for w in (1, args.workers) if r % 2 == 0 else (args.workers, 1):
                out = work / f"report-{w}.json"
                cmd = ["-m", "detrl.cli", "audit", str(run), "--quiet", "--hardware", args.hardware]
                t0 = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, *cmd, "--workers", str(w), "--json", str(out)], stdout=subprocess.DEVNULL
                )
                times[w].append(time.perf_counter() - t0)
                reports[w] = out.read_text() if done.returncode == 0 else f"exit {done.returncode}"
                progress(
                    f"repeat {r + 1}/{args.repeats}, {w} worker(s): exit {done.returncode}, {times[w][-1]:.1f} s"
                )
            ceilings.append(machine_ceiling(args.workers))
            progress(f"repeat {r + 1}/{args.repeats}: the machine's ceiling {ceilings[-1]:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [str(w), str(len(ts)), f"{statistics.median(ts):.1f}", f"{min(ts):.1f}"] for w, ts in times.items()
    ]
    print(table(["workers", "audits", "median s", "best s"], rows))
    seq, par = statistics.median(times[1]), statistics.median(times[args.workers])
    speedup = seq / par
    same = len(set(reports.values())) == 1
    print(
        f"speed-up {args.workers} workers / 1: {speedup:.2f}x; reports identical: {'yes' if same else 'NO'}; "
        f"one process's start (a fresh python importing torch, detrl, dynamo, the digits): {start:.1f} s"
    )
    ceiling = statistics.median(ceilings)
    print(
        f"this machine's ceiling, measured between the audits: {args.workers} CPU-bound torch processes "
        f"(FP64 matrix products, 1 thread each) side by side finish {ceiling:.2f}x faster than one after "
        f"another; the audit reaches {speedup / ceiling:.0%} of it"
    )
    goal = 0.9 * args.workers
    print(f"goal: at least {goal:.1f}x -> {'MET' if speedup >= goal else 'MISSED'}")
    return 0 if same else 1


#: A fixed CPU-bound job in a fresh process: FP64 matrix products on one torch thread (about 4 s here).
_CEILING_JOB = (
    "import torch; torch.set_num_threads(1); a = torch.rand(384, 384, dtype=torch.float64)\n"
    "for _ in range(300): a = (a @ a).clamp_(0, 1)"
)


def machine_ceiling(workers: int) -> float:
    """How much faster ``workers`` copies of a CPU-bound job finish side by side than one after another on
    this machine, now: the speed-up no parallel audit can beat (a shared VM's cores are not all ours)."""
    cmd = [sys.executable, "-c", _CEILING_JOB]
    t0 = time.perf_counter()
    for _ in range(workers):
        subprocess.run(cmd, check=True)
    one_by_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    jobs = [subprocess.Popen(cmd) for _ in range(workers)]
    if any(job.wait() != 0 for job in jobs):
        raise RuntimeError("the ceiling's reference job failed")
    return one_by_one / (time.perf_counter() - t0)
