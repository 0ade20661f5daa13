"""The replication experiment of Srivastava, Arora & Boneh (NeurIPS 2024), on this machine, as one table.

The paper trained the same model from the same seed on three GPUs and compared the weights: plain FP32
diverged, FP64 rounded to FP32 *without* a log diverged later, and FP64 rounded with the threshold log
replicated exactly. Here the GPUs are detrl's hardware profiles (the four emulated ones, and ``cuda`` where
a device exists): the *trainer* records on ``native``, and each *auditor* profile

- ``fp32``: trains the same config in plain FP32 on its own hardware;
- ``rounded``: trains it in verifiable precision on its own hardware, rounding to nearest and never
  reading the trainer's log (the paper's "rounded without log" column);
- ``verifiable``: replays the trainer's bundle with its log (:func:`detrl.apps.audit.audit`).

Each row gives the first step at which the auditor's weights stop being bitwise equal to the trainer's
(from a 64-bit digest of every parameter and buffer after every step), and the L2 distance of the weights
at the end. A ``verifiable`` row that replicates has distance 0 exactly: its final state commitment equals
the trainer's. The model's columns come from the trainer's recordings: logged elements and log bytes per
step, the bytes the paper's dense base-3 encoding would need for the same run (one digit per rounded
element, 5 per byte), and the verifiable step time over plain FP64 and plain FP32 (medians over the steps
after the first, which calibrates the thresholds).

:func:`learning_quality` trains a config in plain FP32 and in verifiable precision and compares test loss
and accuracy: the method must not harm learning. ``detrl bench replication`` prints both tables.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from detrl.apps import metrics
from detrl.apps.metrics import first_divergence
from detrl.formats.roundlog import dense_reference_bytes
from detrl.run import config as config_mod
from detrl.run import sessions, tasks
from detrl.run.traced import TracedSession

MODES = ("fp32", "rounded", "verifiable")
RECORDER = "native"


@dataclasses.dataclass
class Trace:
    """What one traced run left: a digest of the weights after each step (index = step, 0 = initial), the
    final weights, the step times (s) and, for verifiable runs, the log size per step."""

    digests: list[int]
    final: dict[str, np.ndarray]
    step_seconds: list[float]
    logged: list[int]
    rounded: list[int]
    log_bytes: list[int]


@dataclasses.dataclass
class Row:
    """One (model, auditor profile, mode) cell of the table. ``first_divergence`` is None when the weights
    stayed bitwise equal for all ``steps``; ``l2`` is None where it cannot be known (a replay that stopped)."""

    model: str
    auditor: str
    mode: str
    steps: int
    first_divergence: int | None
    l2: float | None
    verdict: str
    corrected: int | None = None


@dataclasses.dataclass
class ModelCosts:
    """The trainer's figures for one model: log size per step (mean over the steps after the first, and
    step 1 alone) and verifiable step time over FP64 and FP32 (medians over the steps after the first)."""

    model: str
    batch: str
    parameters: int
    steps: int
    logged_per_step: float
    log_bytes_per_step: float
    dense_bytes_per_step: float
    log_bytes_step1: int
    vs_fp64: float
    vs_fp32: float
    seconds_verifiable: float


def trace_run(
    cfg: Any, run_dir: Path, progress: bool = False, data: Path | None = None
) -> tuple[Trace, TracedSession]:
    """Record ``cfg`` into ``run_dir`` (its own precision and hardware) and trace its weights."""
    session = sessions.session_for(cfg, run_dir, "record", data=data, force=True, session_type=TracedSession)
    assert isinstance(session, TracedSession)
    task = tasks.get(cfg.task)
    planned = task.planned_steps(cfg)
    session.start_trace([planned], [], None)
    with session:
        task.run(cfg, session, progress=progress, **({"data": data} if data is not None else {}))
    assert session.model is not None
    final = session.params[-1] if session.points and session.points[-1] == planned else {}
    stats = session.step_stats
    trace = Trace(
        digests=list(session.digests),
        final=final,
        step_seconds=list(session.step_seconds),
        logged=[s.logged for s in stats],
        rounded=[s.rounded_elements for s in stats],
        log_bytes=list(session.log_bytes[1:]),  # [0] is the initial state's leaf: no log
    )
    return trace, session


def l2_distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float | None:
    """:func:`detrl.apps.metrics.l2_distance` over the floating tensors both states hold (counters and step
    indices are not weights); None when they share none (a run that stopped keeps no final state)."""

    def weights(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v for k, v in state.items() if v.dtype.kind == "f"}

    wa, wb = weights(a), weights(b)
    return metrics.l2_distance(wa, wb) if wa.keys() & wb.keys() else None


def _median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _mean_after_first(xs: list[int]) -> float:
    return statistics.mean(xs[1:] if len(xs) > 1 else xs) if xs else 0.0


def load_model_config(name: str, steps: int, overrides: Sequence[str] = ()) -> Any:
    """``configs/supervised/NAME.yaml`` with ``train.steps=steps``, no checkpoints, and ``overrides``."""
    path = name if name.endswith((".yaml", ".yml")) else f"configs/supervised/{name}.yaml"
    return config_mod.load(path, [f"train.steps={steps}", "verify.checkpoint_every=0", *overrides])


def _with(cfg: Any, **changes: Any) -> Any:
    return config_mod.validate({**cfg.model_dump(mode="json"), **changes})


def replicate(
    cfg: Any,
    auditors: Sequence[str],
    work: Path,
    log: Callable[[str], None] = lambda _: None,
    progress: bool = False,
    data: Path | None = None,
) -> tuple[ModelCosts, list[Row]]:
    """Run the experiment for one model config: the trainer's three recordings on ``native``, then every
    auditor in every mode. ``data``: the data path for configs that read one."""
    from detrl.apps.audit import audit

    name = cfg.name
    steps = tasks.get(cfg.task).planned_steps(cfg)
    base = _with(cfg, hardware=RECORDER, hardware_seed=None)
    ref: dict[str, Trace] = {}
    parameters = 0
    for precision in ("fp32", "fp64", "verifiable"):
        t0 = time.perf_counter()
        ref[precision], session = trace_run(
            _with(base, precision=precision), work / f"{name}-{RECORDER}-{precision}", progress, data
        )
        assert session.model is not None
        parameters = sum(p.numel() for p in session.model.parameters())
        # A finished run's model and optimizer state must not live on while the next run builds its own:
        # with them, the GPT-2 small rows reached 17 GB resident and were killed for memory on a 23 GB VM.
        del session
        log(f"{name}: recorded {precision} on {RECORDER}, {steps} steps in {time.perf_counter() - t0:.0f} s")
    ref["fp64"].final = {}  # only its step times are read
    v = ref["verifiable"]
    batch = str(cfg.train.batch_size)
    if cfg.data.name in ("synthetic_text", "text_file", "corpus"):
        batch += f" x {cfg.data.seq_len}"
    costs = ModelCosts(
        model=name,
        batch=batch,
        parameters=parameters,
        steps=steps,
        logged_per_step=_mean_after_first(v.logged),
        log_bytes_per_step=_mean_after_first(v.log_bytes),
        dense_bytes_per_step=_mean_after_first([dense_reference_bytes(r) for r in v.rounded]),
        log_bytes_step1=v.log_bytes[0] if v.log_bytes else 0,
        vs_fp64=_median_after_first(v.step_seconds) / _median_after_first(ref["fp64"].step_seconds),
        vs_fp32=_median_after_first(v.step_seconds) / _median_after_first(ref["fp32"].step_seconds),
        seconds_verifiable=_median_after_first(v.step_seconds),
    )
    rows: list[Row] = []
    for auditor in auditors:
        on_auditor = _with(base, hardware=auditor)
        for mode in MODES:
            t0 = time.perf_counter()
            if mode == "verifiable":
                r = audit(work / f"{name}-{RECORDER}-verifiable", auditor, data=data)
                replicated = r.verdict == "replicated"
                rows.append(Row(name, auditor, mode, steps, r.diverged_step, 0.0 if replicated else None,
                                r.verdict, r.corrected))  # fmt: skip
            else:
                precision, reference = ("fp32", ref["fp32"]) if mode == "fp32" else ("verifiable", v)
                trace = trace_run(  # [0]: the session (its model) goes before the next run starts
                    _with(on_auditor, precision=precision), work / f"{name}-{auditor}-{mode}", progress, data
                )[0]
                first = first_divergence(reference.digests, trace.digests)
                rows.append(Row(name, auditor, mode, steps, first, l2_distance(reference.final, trace.final),
                                "replicated" if first is None else "diverged"))  # fmt: skip
            log(f"{name}: {auditor} {mode}: {rows[-1].verdict} ({time.perf_counter() - t0:.0f} s)")
    return costs, rows


@dataclasses.dataclass
class Quality:
    """Test loss and accuracy after training one config in one precision from one seed."""

    model: str
    precision: str
    seed: int
    steps: int
    test_loss: float
    test_accuracy: float
    train_loss: float


def learning_quality(
    cfg: Any,
    holdout: int,
    seeds: Sequence[int] = (0,),
    log: Callable[[str], None] = lambda _: None,
    progress: bool = False,
) -> list[Quality]:
    """Train ``cfg`` on ``native`` in plain FP32 and in verifiable precision (no bundle: ``mode="off"``)
    from each of ``seeds`` (``sources.seed``), holding out ``holdout`` examples, and evaluate each run on
    them: cross-entropy (nats) and accuracy (per token for text). FP32 and verifiable runs part at the
    first step, so a single seed compares two draws, not two methods: compare means over seeds."""
    from torch.nn import functional as F

    from detrl.supervised import train as sup

    out = []
    for seed in seeds:
        for precision in ("fp32", "verifiable"):
            c = _with(cfg, precision=precision, hardware=RECORDER, hardware_seed=None)
            c = config_mod.validate(
                config_mod.apply_overrides(
                    c.model_dump(mode="json"), [f"data.holdout={holdout}", f"sources.seed={seed}"]
                )
            )
            t0 = time.perf_counter()
            session = sessions.session_for(c, None, "off")
            with session:
                result = tasks.get(c.task).run(c, session, progress=progress)
            assert session.model is not None
            test_x, test_y = sup.load_test_data(c)
            logits = sup.predict(c, session.model, session.precision.cast(test_x))
            flat, labels = logits.reshape(-1, logits.shape[-1]), test_y.reshape(-1)
            out.append(
                Quality(
                    model=c.name,
                    precision=precision,
                    seed=seed,
                    steps=int(result["steps"]),
                    test_loss=float(F.cross_entropy(flat, labels)),
                    test_accuracy=float((flat.argmax(-1) == labels).double().mean()),
                    train_loss=float(result["loss"]),
                )
            )
            log(
                f"{c.name}: trained {precision}, seed {seed}, {c.train.steps} steps in "
                f"{time.perf_counter() - t0:.0f} s"
            )
    return out


def auditor_profiles(names: Sequence[str] | None = None) -> list[str]:
    """The auditors: the given names, or the four emulated profiles plus ``cuda`` when a device exists."""
    from detrl.core.hardware import profile_names

    if names:
        return list(names)
    return [name for name in profile_names() if name != RECORDER]


def run_experiment(
    models: Sequence[str],
    steps: int,
    auditors: Sequence[str],
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = lambda _: None,
    progress: bool = False,
    work: Path | None = None,
) -> tuple[list[ModelCosts], list[Row]]:
    """:func:`replicate` for every model (configs by name, see :func:`load_model_config`)."""
    all_costs, all_rows = [], []
    with tempfile.TemporaryDirectory(prefix="detrl-replication-", dir=work) as tmp:
        for name in models:
            cfg = load_model_config(name, steps, overrides)
            data = Path(cfg.data.path) if cfg.data.path else None
            costs, rows = replicate(cfg, auditors, Path(tmp), log, progress, data)
            all_costs.append(costs)
            all_rows.extend(rows)
    return all_costs, all_rows
