"""``detrl ablate``: which source of randomness moves a trained model, and how far.

Two published protocols, chosen by the base config's task:

* **RL** (any task whose run returns episode returns; the DQN): Nagarajan, Warnell & Stone 2018,
  "Deterministic Implementations for Reproducibility in Deep RL". Metrics: final greedy evaluation return
  (mean, SD, best run), interquartile mean with a stratified-bootstrap interval (rliable), area under the
  learning curve, first diverging step, parameter distance to the control over time.
* **Supervised** (task ``supervised``, with ``data.holdout`` test examples): Summers & Dinneen 2021,
  "Nondeterminism and Instability in Neural Network Optimization". Metrics on the held-out test set: SD of
  accuracy and of cross-entropy, mean pairwise disagreement, mean pairwise Pearson and Spearman correlation
  of logits, two-model ensemble gains, each with a bootstrap interval over runs; the instability curve (L2
  between the control and its one-bit twin over training); two remedies, snapshot ensembles over a cyclic
  learning rate and test-time augmentation, against single models of equal training cost.

An ablation config names a base run config and the sources to vary::

    base: configs/dqn/tiny.yaml     # a run config (a path, or a packaged name), read with config.read_raw
    set: [precision=fp32]           # KEY=VALUE overrides applied to the base
    runs: 3                         # N runs per condition
    sources: [init, explore, replay, env, bitflip, hardware]
    all: true                       # one more condition that varies every listed source together
    verifiable_hardware: true       # one more: the hardware source again, in verifiable precision
    curve_every: 100                # steps between trace points (learning curve, parameter distance)
    remedies: [snapshot, tta]       # supervised only
    snapshot_cycles: 4
    resamples: 10000                # bootstrap resamples of every interval

Conditions: ``control`` (every source fixed: N runs of the *same* config, which must be bitwise identical),
one per listed source, ``all``, ``hardware@verifiable`` and ``<remedy_condition>+snapshot``. Run ``k`` of
a source ``S`` (``k = 0 .. N-1``; run 0 varies too, it is not the control) sets:

* a stream (``init``, ``explore``, ``data_order``, ...): ``sources.S.seed = 1000 + k``;
* ``bitflip``: ``sources.bitflip = true`` and the bitflip stream's seed ``sources.streams.bitflip.seed =
  1000 + k`` (the stream picks the element of the first layer's weight that moves by one ulp);
* ``hardware``: ``hardware = emulated:atomic`` (a fresh random accumulation order at every reduction, as
  GPU atomics give) with ``hardware_seed = 1000 + k``, so that the sweep itself is reproducible.
* ``hardware@verifiable``: the same, with ``precision = verifiable``: its runs must be bitwise identical to
  each other, since verifiable precision removes the accumulation order from the result.
* ``X+snapshot``: condition ``X`` with ``optimizer.schedule = cyclic`` and ``snapshot_cycles`` cycles; the
  model's prediction is the ensemble of the cycle ends (mean softmax), at the training cost of one model.

Each run is an ordinary bundle (``detrl audit`` reads it) in ``OUT/runs/<condition>/<k>/`` with, beside the
bundle files, ``result.json`` (written last: its presence marks the run done), ``params.npz`` (final
parameters), ``trajectory.npz`` (a hash of the parameters after every step, and the parameters at every
trace point), ``logits.npz`` (supervised: test logits) and ``tb/`` (TensorBoard scalars). Runs execute in
a local process pool or on Ray (:mod:`detrl.run.executors`), one torch thread each; no number depends on the
executor or the number of workers.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, field_validator

from detrl.apps import metrics
from detrl.core.sources import STREAMS
from detrl.formats import safeio
from detrl.formats import summary as summary_format
from detrl.run import config as config_mod
from detrl.run.config import ConfigError, Strict
from detrl.run.traced import TracedSession

RL_SOURCES = ["init", "explore", "replay", "env", "bitflip", "hardware"]
SUPERVISED_SOURCES = ["init", "data_order", "augment", "dropout", "hardware", "bitflip"]
#: What ``sources`` may list: every stream of the switchboard (``hardware`` is the profile, not a stream).
KNOWN_SOURCES = tuple(STREAMS)
SEED_BASE = 1000
#: Episodes averaged at each learning-curve point (RL).
CURVE_WINDOW = 10
RESULT = "result.json"
PARAMS = "params.npz"
TRAJECTORY = "trajectory.npz"
LOGITS = "logits.npz"
SPEC = "ablation.json"
HARDWARE_VERIFIABLE = "hardware@verifiable"
SNAPSHOT = "+snapshot"


class AblationConfig(Strict):
    """An ablation sweep (``detrl ablate CONFIG``)."""

    base: str = Field(
        description="the run config to ablate (a path, or a packaged name like configs/dqn/tiny.yaml)"
    )
    set: list[str] = Field(default_factory=list, description="KEY=VALUE overrides applied to the base")
    runs: int = Field(3, ge=1, le=10_000, description="runs per condition")
    sources: list[str] | None = Field(None, description="sources to vary (default: the protocol's)")
    all: bool = Field(True, description="add a condition that varies every listed source together")
    verifiable_hardware: bool = Field(False, description="add the hardware source in verifiable precision")
    curve_every: int = Field(100, ge=1, description="steps between trace points")
    remedies: list[Literal["snapshot", "tta"]] = Field(default_factory=list, description="supervised only")
    snapshot_cycles: int = Field(4, ge=2, le=1000, description="cycles (ensemble members) of snapshot")
    remedy_condition: str = Field("all", description="the condition the remedies are applied to")
    resamples: int = Field(10_000, ge=100, le=1_000_000, description="bootstrap resamples per interval")

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, v: list[str] | None) -> list[str] | None:
        for s in v or []:
            if s not in KNOWN_SOURCES:
                raise ValueError(f"unknown source {s!r}; known: {', '.join(KNOWN_SOURCES)}")
        if v is not None and len(set(v)) != len(v):
            raise ValueError("a source is listed twice")
        return v

    @property
    def listed(self) -> list[str]:
        """The sources to vary (resolved by :func:`load_spec`)."""
        return list(self.sources or [])


def parse_sources(text: str) -> list[str]:
    """``"init,explore"`` -> ``["init", "explore"]``; an unknown source is one ConfigError line."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names:
        if s not in KNOWN_SOURCES:
            raise ConfigError(f"--sources: unknown source {s!r}; known: {', '.join(KNOWN_SOURCES)}")
    return names


def _validate(raw: dict[str, Any], where: str) -> AblationConfig:
    try:
        return AblationConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = safeio.error_location(err["loc"], "config")
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(f"ablation config {where}: {loc}: {msg}") from None


def load_spec(path: str | Path, **overrides: Any) -> AblationConfig:
    """Read and validate an ablation config; ``overrides`` (``runs=5``, ``sources=[...]``) replace its keys.

    A relative ``base`` that exists beside the ablation file is taken from there; otherwise it is resolved
    as :func:`detrl.run.config.read_raw` resolves it (packaged configs included). Default sources follow the
    protocol. Every condition's run config is validated here, so that a bad one fails before any run.
    """
    raw = config_mod.read_raw(path)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    spec = _validate(raw, str(path))
    beside = Path(path).parent / spec.base
    if not Path(spec.base).is_absolute() and beside.is_file() and Path(path).is_file():
        spec = spec.model_copy(update={"base": str(beside)})
    protocol = protocol_of(run_config(spec, "control", 0))
    if spec.sources is None:
        spec = spec.model_copy(
            update={"sources": SUPERVISED_SOURCES if protocol == "supervised" else RL_SOURCES}
        )
    spec = _validate(spec.model_dump(mode="json"), str(path))
    if spec.remedies and protocol != "supervised":
        raise ConfigError(f"ablation config {path}: remedies: only the supervised protocol has remedies")
    if spec.remedies and spec.remedy_condition not in conditions(spec, with_remedies=False):
        raise ConfigError(
            f"ablation config {path}: remedy_condition: {spec.remedy_condition!r} is not a condition of "
            f"this sweep ({', '.join(conditions(spec, with_remedies=False))})"
        )
    for cond in conditions(spec):
        cfg = run_config(spec, cond, 0)
        if protocol == "supervised" and cfg.data.holdout < 2:
            raise ConfigError(
                f"ablation config {path}: the supervised protocol needs data.holdout test examples"
            )
    return spec


def protocol_of(cfg: Any) -> str:
    """``supervised`` for the supervised task, ``rl`` for any other (tasks that return episode returns)."""
    return "supervised" if cfg.task == "supervised" else "rl"


# ------------------------------------------------------------------------------------------- conditions
def conditions(spec: AblationConfig, with_remedies: bool = True) -> list[str]:
    """``control``, each listed source, ``all`` (when on and more than one source is listed),
    ``hardware@verifiable`` (when on), then ``<remedy_condition>+snapshot`` (when that remedy is on)."""
    out = ["control", *spec.listed]
    if spec.all and len(spec.listed) > 1:
        out.append("all")
    if spec.verifiable_hardware:
        out.append(HARDWARE_VERIFIABLE)
    if with_remedies and "snapshot" in spec.remedies:
        out.append(spec.remedy_condition + SNAPSHOT)
    return out


def source_overrides(source: str, k: int) -> list[str]:
    """The config overrides of run ``k`` varying ``source``."""
    seed = SEED_BASE + k
    if source == "hardware":
        return ["hardware=emulated:atomic", f"hardware_seed={seed}"]
    if source == "bitflip":
        return ["sources.bitflip=true", f"sources.streams.bitflip.seed={seed}"]
    return [f"sources.{source}.seed={seed}"]


def condition_overrides(spec: AblationConfig, condition: str, k: int) -> list[str]:
    """Every override of run ``k`` of ``condition``: the spec's ``set``, then the condition's."""
    if condition.endswith(SNAPSHOT):
        inner = condition_overrides(spec, condition[: -len(SNAPSHOT)], k)
        return [*inner, "optimizer.schedule=cyclic", f"optimizer.cycles={spec.snapshot_cycles}"]
    if condition == "control":
        varied: list[str] = []
    elif condition == "all":
        varied = [o for s in spec.listed for o in source_overrides(s, k)]
    elif condition == HARDWARE_VERIFIABLE:
        varied = [*source_overrides("hardware", k), "precision=verifiable"]
    else:
        varied = source_overrides(condition, k)
    return [*spec.set, *varied]


def run_config(spec: AblationConfig, condition: str, k: int) -> Any:
    """The validated run config of run ``k`` of ``condition``."""
    raw = config_mod.read_raw(spec.base)
    return config_mod.validate(config_mod.apply_overrides(raw, condition_overrides(spec, condition, k)))


def jobs(spec: AblationConfig) -> list[tuple[str, int]]:
    """Every (condition, k) of the sweep, in a fixed order."""
    return [(c, k) for c in conditions(spec) for k in range(spec.runs)]


def run_dir(out: str | Path, condition: str, k: int) -> Path:
    return Path(out) / "runs" / condition / str(k)


# ------------------------------------------------------------------------------------------- one run
def episode_end_steps(lengths: list[int]) -> list[int]:
    """The env step at which each training episode ended (cumulative sums of the episode lengths)."""
    return [int(s) for s in np.cumsum(np.asarray(lengths, dtype=np.int64))]


def curve_grid(steps: int, every: int) -> list[int]:
    """Trace points: every ``every`` steps, and the last step."""
    grid = list(range(every, steps + 1, every))
    if not grid or grid[-1] != steps:
        grid.append(steps)
    return grid


def learning_curve(returns: list[float], ends: list[int], grid: list[int]) -> list[float]:
    """At each grid step: the mean return of the last :data:`CURVE_WINDOW` episodes finished by then (NaN
    before the first)."""
    r = np.asarray(returns, dtype=np.float64)
    finished = np.searchsorted(np.asarray(ends, dtype=np.int64), np.asarray(grid), side="right")
    return [float(r[max(0, n - CURVE_WINDOW) : n].mean()) if n else math.nan for n in finished]


def _nan_to_none(xs: list[float]) -> list[float | None]:
    return [None if math.isnan(x) else x for x in xs]


def _none_to_nan(xs: list[float | None]) -> np.ndarray:
    return np.array([math.nan if x is None else x for x in xs], dtype=np.float64)


def _save_npz(where: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    safeio.write_atomic(where, name, buf.getvalue())


def _log_mean_softmax(logits: np.ndarray) -> np.ndarray:
    """The ensemble's logits: log of the mean softmax over the first axis (members)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    return np.log(p.mean(axis=0))


def run_one(spec_json: str, base_raw_json: str, out: str, condition: str, k: int) -> dict[str, Any]:
    """Record run ``k`` of ``condition`` in ``OUT/runs/<condition>/<k>/`` and write its result files.

    Takes the spec and the base config as JSON (read by the driver), so that a local worker or a Ray
    worker on another machine needs neither the driver's working directory nor its config files. Runs with
    one torch thread.
    """
    import torch

    from detrl.formats import bundle as bundle_mod
    from detrl.formats import commit
    from detrl.run import sessions, tasks

    torch.set_num_threads(1)
    spec = AblationConfig.model_validate_json(spec_json)
    raw = json.loads(base_raw_json)
    cfg = config_mod.validate(config_mod.apply_overrides(raw, condition_overrides(spec, condition, k)))
    task = tasks.get(cfg.task)
    protocol = protocol_of(cfg)
    where = run_dir(out, condition, k)
    config_mod.check_tensorboard_dir(where / "tb", "remove it")  # before this run's files are touched
    where.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT, PARAMS, TRAJECTORY, LOGITS):  # a run killed before its result is redone whole
        (where / stale).unlink(missing_ok=True)
    session = sessions.session_for(cfg, where, "record", force=True, session_type=TracedSession)
    assert isinstance(session, TracedSession)
    planned = task.planned_steps(cfg)
    grid = curve_grid(planned, spec.curve_every)
    evaluate, snapshots, test_y = None, [], None
    if protocol == "supervised":
        evaluate, snapshots, test_y = _supervised_evaluation(cfg, session, "tta" in spec.remedies, planned)
    session.start_trace(grid, snapshots, evaluate)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(where / "tb"))
    try:
        with session:
            result = task.run(cfg, session, writer=writer)
        if protocol == "supervised":
            for step in grid:
                logits = session.test_logits[step][0]
                writer.add_scalar(
                    "ablate/test_accuracy", float(metrics.accuracy(logits[None], test_y)[0]), step
                )
    finally:
        writer.close()
    manifest = bundle_mod.parse_manifest((where / bundle_mod.MANIFEST).read_bytes())
    tensors = _save_trajectory(where, session)
    record: dict[str, Any] = {
        "condition": condition,
        "k": k,
        "overrides": condition_overrides(spec, condition, k),
        "curve_steps": grid,
        "merkle_root": manifest.durable.merkle_root if manifest.durable is not None else None,
        "params_sha256": commit.hash_tensors(tensors).hex(),
    }
    if protocol == "rl":
        record.update(_rl_record(result, grid))
    else:
        assert test_y is not None
        record.update(_supervised_record(where, session, result, test_y.numpy(), planned, snapshots, grid))
    safeio.write_atomic(
        where, RESULT, safeio.dumps_json(summary_format.finite(record))
    )  # last: marks the run done
    return record


def _supervised_evaluation(
    cfg: Any, session: TracedSession, use_tta: bool, planned: int
) -> tuple[Callable[[Any, int], tuple[np.ndarray, np.ndarray | None]], list[int], Any]:
    """``(evaluate, snapshot steps, test labels)`` for a supervised run: ``evaluate(model, step)`` gives the
    test-set logits (N, classes) and, at the final step with ``use_tta``, the test-time-augmented ones."""
    from detrl.supervised import train as sup

    test_x, test_y = sup.load_test_data(cfg)

    def evaluate(model: Any, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        x = session.precision.cast(test_x)
        # Test-time augmentation is reported for the final model only: at the other points it would
        # cost tta_views forward passes of the test set for nothing.
        tta = sup.predict(cfg, model, x, tta=True).numpy() if use_tta and step == planned else None
        return sup.predict(cfg, model, x).numpy(), tta

    snapshots = []
    if cfg.optimizer.schedule == "cyclic":
        snapshots = sup.cycle_ends(cfg.train.steps, cfg.optimizer.cycles)
    return evaluate, snapshots, test_y


def _save_trajectory(where: Path, session: TracedSession) -> dict[str, Any]:
    """Write the final parameters (PARAMS) and the trajectory (TRAJECTORY: steps, per-step digests, the
    parameters at each trace point); returns the final state tensors."""
    from detrl.formats import commit

    tensors = commit.state_tensors(session.model)
    _save_npz(where, PARAMS, {name: t.detach().cpu().clone().numpy() for name, t in sorted(tensors.items())})
    traj = {
        "steps": np.asarray(session.points, dtype=np.int64),
        "digests": np.asarray(session.digests, dtype=np.uint64),
    }
    for i, params in enumerate(session.params):
        traj.update({f"{i}/{name}": a for name, a in params.items()})
    _save_npz(where, TRAJECTORY, traj)
    return tensors


def _rl_record(result: dict[str, Any], grid: list[int]) -> dict[str, Any]:
    """An RL run's result fields: evaluation returns, training episodes and the learning curve on ``grid``."""
    returns = [float(r) for r in result.get("returns", [])]
    ends = episode_end_steps(result.get("lengths", []))
    evals = [float(r) for r in result.get("eval_returns", [])]
    return {
        "eval_returns": evals,
        "eval_mean": float(np.mean(evals)) if evals else None,
        "episode_returns": returns,
        "episode_end_steps": ends,
        "curve": _nan_to_none(learning_curve(returns, ends, grid)),
    }


def _supervised_record(
    where: Path,
    session: TracedSession,
    result: dict[str, Any],
    y: np.ndarray,
    planned: int,
    snapshots: list[int],
    grid: list[int],
) -> dict[str, Any]:
    """Write a supervised run's test logits (LOGITS: labels, final, tta, snapshots and their ensemble) and
    return its result fields: accuracy, cross-entropy, the accuracy curve on ``grid``, the final loss."""
    logits = {"labels": y, "test": session.test_logits[planned][0]}
    if session.test_logits[planned][1] is not None:
        logits["tta"] = session.test_logits[planned][1]
    if snapshots:
        logits["snapshots"] = np.stack([session.test_logits[s][0] for s in snapshots])
        logits["ensemble"] = _log_mean_softmax(logits["snapshots"])
    _save_npz(where, LOGITS, logits)
    predicted = logits["ensemble"] if snapshots else logits["test"]
    return {
        "accuracy": float(metrics.accuracy(predicted[None], y)[0]),
        "cross_entropy": float(metrics.cross_entropy(predicted[None], y)[0]),
        "curve": [float(metrics.accuracy(session.test_logits[s][0][None], y)[0]) for s in grid],
        "final_train_loss": float(result.get("loss", math.nan)),
    }


def _run_job(spec_json: str, base_raw_json: str, out: str, condition: str, k: int) -> tuple[str, int]:
    run_one(spec_json, base_raw_json, out, condition, k)
    return condition, k


# ------------------------------------------------------------------------------------------- the sweep
def run_sweep(
    spec: AblationConfig,
    out: str | Path,
    workers: int | None = None,
    progress: bool = True,
    only: list[tuple[str, int]] | None = None,
    ray: str | None = None,
) -> dict[str, int]:
    """Run every job of the sweep whose ``result.json`` is missing; return ``{"done": n, "skipped": m}``.

    An interrupted sweep (Ctrl-C, SIGKILL, a lost machine) resumes with the same call and redoes only the
    runs that had not finished. Jobs run in a local process pool of ``workers`` processes (default
    ``os.cpu_count()``), or on Ray when ``ray`` is ``auto``, ``local`` or a cluster address (see
    :func:`detrl.run.executors.run_ray`); each run has one torch thread, and no result depends on the
    executor or on ``workers``. ``only``: a subset of :func:`jobs` to run (tests use it to stop a sweep
    part way).
    """
    from detrl.run import executors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec_json = spec.model_dump_json()
    spec_file = out / SPEC
    if spec_file.is_file():
        try:
            old = AblationConfig.model_validate_json(spec_file.read_text())
        except ValidationError:
            raise ConfigError(f"{out}: {SPEC} is not an ablation spec; choose another --out") from None
        if old != spec:
            raise ConfigError(f"{out}: holds a different ablation sweep ({SPEC}); choose another --out")
    else:
        safeio.write_atomic(out, SPEC, safeio.dumps_json(spec.model_dump(mode="json")))
    base_raw_json = json.dumps(config_mod.read_raw(spec.base))
    todo_all = jobs(spec) if only is None else list(only)
    todo = [(c, k) for c, k in todo_all if not (run_dir(out, c, k) / RESULT).is_file()]
    skipped = len(todo_all) - len(todo)
    workers = max(1, min(workers or os.cpu_count() or 1, max(1, len(todo))))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo_all), initial=skipped, desc="ablate", unit="run", disable=None)

    def done(i: int, _: Any) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"last: {todo[i][0]}/{todo[i][1]}")

    payloads = [(spec_json, base_raw_json, str(out), c, k) for c, k in todo]
    names = [f"run {c}/{k}" for c, k in todo]
    try:
        if todo and ray is not None:
            executors.run_ray(_run_job, payloads, ray, workers, done, names)
        elif todo:
            executors.run_local(_run_job, payloads, workers, done, names)
    except executors.JobFailed as e:
        raise ConfigError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    return {"done": len(todo), "skipped": skipped}


# ------------------------------------------------------------------------------------------- summary
def _read_result(out: Path, condition: str, k: int) -> dict[str, Any] | None:
    path = run_dir(out, condition, k) / RESULT
    return json.loads(path.read_text()) if path.is_file() else None


def _npz(out: Path, condition: str, k: int, name: str) -> dict[str, np.ndarray]:
    # Our own files, written by run_one in this sweep directory: no pickled objects are allowed in them.
    with np.load(run_dir(out, condition, k) / name, allow_pickle=False) as z:
        return {key: z[key] for key in z.files}


def _trajectory(
    out: Path, condition: str, k: int
) -> tuple[np.ndarray, np.ndarray, list[dict[str, np.ndarray]]]:
    """``(steps, per-step digests, parameters at each of steps)`` of one run."""
    z = _npz(out, condition, k, TRAJECTORY)
    steps, digests = z.pop("steps"), z.pop("digests")
    params: list[dict[str, np.ndarray]] = [{} for _ in steps]
    for key, a in z.items():
        i, _, name = key.partition("/")
        params[int(i)][name] = a
    return steps, digests, params


def _auc(curve: np.ndarray, steps: np.ndarray) -> float:
    """Normalised area under a curve from its first point (NaN only before the first episode ends)."""
    keep = ~np.isnan(curve)
    if keep.sum() < 2:
        return math.nan
    return float(metrics.area_under_curve(curve[keep], steps[keep])[0])


def _band(curves: list[list[float | None]], steps: list[int], label: str) -> dict[str, Any]:
    """Mean and min-max band over runs of curves sampled at ``steps`` (NaN-aware: None before data)."""
    c = np.array([_none_to_nan(x) for x in curves], dtype=np.float64)
    with warnings.catch_warnings():  # an all-NaN column (no episode finished yet) is NaN, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, lo, hi = np.nanmean(c, axis=0), np.nanmin(c, axis=0), np.nanmax(c, axis=0)
    return {
        "steps": steps,
        "label": label,
        "mean": _nan_to_none(mean.tolist()),
        "lo": _nan_to_none(lo.tolist()),
        "hi": _nan_to_none(hi.tolist()),
        "runs": [_nan_to_none(x.tolist()) for x in c],
    }


def _metrics_or_null(
    logits: np.ndarray, labels: np.ndarray, resamples: int
) -> dict[str, dict[str, float | None]]:
    """:func:`metrics.diversity_summary`, or nulls with fewer than two runs (no pair, no spread)."""
    if logits.shape[0] >= 2:
        return metrics.diversity_summary(logits, labels, resamples=resamples)
    names = ["accuracy_sd", "cross_entropy_sd", "disagreement", "pearson", "spearman"]
    names += ["ensemble_gain_accuracy", "ensemble_gain_cross_entropy"]
    return {n: {"value": None, "lo": None, "hi": None} for n in names}


#: Variability metrics a remedy should lower, and how: correlations as 1 - rho (lower = less variable).
REMEDY_METRICS = {
    "accuracy_sd": lambda v: v,
    "cross_entropy_sd": lambda v: v,
    "disagreement": lambda v: v,
    "pearson": lambda v: 1.0 - v,
    "spearman": lambda v: 1.0 - v,
    "ensemble_gain_accuracy": lambda v: v,
    "ensemble_gain_cross_entropy": lambda v: v,
}


def _reduction(single: dict[str, Any], remedy: dict[str, Any]) -> dict[str, float | None]:
    """Per metric: (single - remedy) / single of the variability (``1 - rho`` for correlations)."""
    out: dict[str, float | None] = {}
    for name, variability in REMEDY_METRICS.items():
        a, b = single[name]["value"], remedy[name]["value"]
        if a is None or b is None or variability(a) == 0:
            out[name] = None
        else:
            out[name] = (variability(a) - variability(b)) / variability(a)
    return out


def summarise(out: str | Path, command: str | None = None, config: str | None = None) -> dict[str, Any]:
    """Every number of the sweep: per condition and for the whole (see ``docs/ablation.md`` for the keys).

    Per condition, over its finished runs: whether every run is bitwise identical to control run 0
    (``identical``) and to its own run 0 (``identical_within``: zero spread), each run's first step whose
    parameters differ from control run 0's (None: never), the L2 parameter distance to control run 0 at the
    end and over training, the learning curve with a min-max band, and the protocol's metrics. ``command``
    and ``config``: what made the sweep, for the report.
    """
    from detrl.run import fmt

    out = Path(out)
    spec = AblationConfig.model_validate_json((out / SPEC).read_text())
    protocol = protocol_of(run_config(spec, "control", 0))
    supervised = protocol == "supervised"
    # The control's runs are read once: run 0 is every condition's reference, and they are a row too.
    control = _read_runs(out, "control", spec.runs, supervised)
    if control is None or control.results[0]["k"] != 0:
        raise ConfigError(f"{out}: control run 0 has not finished; run the sweep first")
    steps = control.results[0]["curve_steps"]
    rows: dict[str, Any] = {}
    for cond in conditions(spec):
        runs = control if cond == "control" else _read_runs(out, cond, spec.runs, supervised)
        if runs is None:
            continue
        row = _identity_and_distance(control, runs)
        row.update(_rl_row(runs, steps, spec) if protocol == "rl" else _supervised_row(runs, steps, spec))
        rows[cond] = row
    return {
        "protocol": protocol,
        "command": command,
        "config": config,
        "base": spec.base,
        "machine": fmt.machine_line(1).removeprefix("machine: "),
        "spec": spec.model_dump(mode="json"),
        "control_identical": bool(rows["control"]["identical"]),
        "conditions": rows,
        "instability": _instability(rows),
        "remedies": _remedies(spec, rows),
    }


@dataclasses.dataclass
class _Runs:
    """A condition's finished runs as read from the sweep directory (the I/O half of :func:`summarise`)."""

    results: list[dict[str, Any]]  # each run's result.json
    traces: list[tuple[np.ndarray, np.ndarray, list[dict[str, np.ndarray]]]]  # (steps, digests, params)
    finals: list[dict[str, np.ndarray]]  # each run's final parameters
    logits: list[dict[str, np.ndarray]]  # supervised: each run's test logits (and labels, tta); else []


def _read_runs(out: Path, cond: str, runs: int, supervised: bool) -> _Runs | None:
    """The finished runs among ``cond``'s first ``runs`` (None: none has finished)."""
    done = [(k, r) for k in range(runs) if (r := _read_result(out, cond, k)) is not None]
    if not done:
        return None
    return _Runs(
        results=[r for _, r in done],
        traces=[_trajectory(out, cond, k) for k, _ in done],
        finals=[_npz(out, cond, k, PARAMS) for k, _ in done],
        logits=[_npz(out, cond, k, LOGITS) for k, _ in done] if supervised else [],
    )


def _identity_and_distance(control: _Runs, runs: _Runs) -> dict[str, Any]:
    """What every protocol reports: bitwise identity with control run 0 and within the condition, the first
    divergence of each run, and the L2 distance to control run 0 at the end and over training."""
    ref, (ref_steps, ref_digests, ref_params) = control.results[0], control.traces[0]
    distance_runs = [
        [metrics.l2_distance(a, b) for a, b in zip(ref_params, params)] for *_, params in runs.traces
    ]
    first = [metrics.first_divergence(ref_digests, digests) for _, digests, _ in runs.traces]
    diverged = [d for d in first if d is not None]
    return {
        "n": len(runs.results),
        "identical": all(r["params_sha256"] == ref["params_sha256"] for r in runs.results),
        "identical_within": all(r["params_sha256"] == runs.results[0]["params_sha256"] for r in runs.results),
        "first_divergence": first,
        "l2_to_control": float(np.mean([metrics.l2_distance(control.finals[0], f) for f in runs.finals])),
        "distance": {
            "steps": [int(t) for t in ref_steps],
            "mean": np.mean(np.array(distance_runs), axis=0).tolist(),
            "runs": distance_runs,
        },
        "overrides": [r["overrides"] for r in runs.results],
        "first_divergence_median": float(np.median(diverged)) if diverged else None,
    }


def _rl_row(runs: _Runs, steps: list[int], spec: AblationConfig) -> dict[str, Any]:
    """The RL protocol's statistics (Nagarajan et al.): final return, its IQM interval, AUC, curve."""
    finals = [r["eval_mean"] if r["eval_mean"] is not None else math.nan for r in runs.results]
    mean, sd = metrics.mean_sd(finals)
    iqm, lo, hi = metrics.iqm_with_interval(finals, resamples=spec.resamples)
    return {
        "eval_mean": mean,
        "eval_sd": sd,
        "eval_best": float(np.max(finals)),
        "iqm": iqm,
        "iqm_lo": lo,
        "iqm_hi": hi,
        "auc": float(np.mean([_auc(_none_to_nan(r["curve"]), np.asarray(steps)) for r in runs.results])),
        "curve": _band(
            [r["curve"] for r in runs.results],
            steps,
            f"training return (mean of last {CURVE_WINDOW} episodes)",
        ),
    }


def _supervised_row(runs: _Runs, steps: list[int], spec: AblationConfig) -> dict[str, Any]:
    """The supervised protocol's statistics (Summers & Dinneen): accuracy, cross-entropy, the diversity
    metrics of the test logits, and of the test-time-augmented logits where the runs have them."""
    files = runs.logits
    labels = files[0]["labels"]
    key = "ensemble" if "ensemble" in files[0] else "test"
    logits = np.stack([f[key] for f in files])  # (runs, examples, classes)
    row: dict[str, Any] = {
        "accuracy_mean": float(np.mean([r["accuracy"] for r in runs.results])),
        "cross_entropy_mean": float(np.mean([r["cross_entropy"] for r in runs.results])),
        "metrics": _metrics_or_null(logits, labels, spec.resamples),
        "curve": _band([r["curve"] for r in runs.results], steps, "test accuracy"),
    }
    if "tta" in files[0]:
        tta = np.stack([f["tta"] for f in files])
        row["tta"] = _metrics_or_null(tta, labels, spec.resamples)
        row["tta_accuracy_mean"] = float(metrics.accuracy(tta, labels).mean())
    return row


def _instability(rows: dict[str, Any]) -> dict[str, Any] | None:
    """The one-bit twin's L2 distance from control run 0 over training (None without a bitflip condition)."""
    if "bitflip" not in rows:
        return None
    d = rows["bitflip"]["distance"]
    return {"condition": "bitflip", "steps": d["steps"], "l2": d["runs"][0]}


def _remedies(spec: AblationConfig, rows: dict[str, Any]) -> dict[str, Any] | None:
    """Each remedy's diversity metrics beside single models of the remedy condition, and the reduction."""
    base = spec.remedy_condition
    if not spec.remedies or base not in rows:
        return None
    table = {"single": rows[base]["metrics"]}
    if "tta" in spec.remedies and "tta" in rows[base]:
        table["tta"] = rows[base]["tta"]
    if "snapshot" in spec.remedies and base + SNAPSHOT in rows:
        table["snapshot"] = rows[base + SNAPSHOT]["metrics"]
    return {
        "baseline": base,
        "rows": table,
        "reduction": {name: _reduction(table["single"], m) for name, m in table.items() if name != "single"},
    }


RL_COLUMNS = [
    "condition", "n", "eval_mean", "eval_sd", "eval_best", "iqm", "iqm_lo", "iqm_hi", "auc", "identical",
    "identical_within", "first_divergence_median", "l2_to_control",
]  # fmt: skip
SUPERVISED_METRICS = [
    "accuracy_sd", "cross_entropy_sd", "disagreement", "pearson", "spearman", "ensemble_gain_accuracy",
    "ensemble_gain_cross_entropy",
]  # fmt: skip
SUPERVISED_COLUMNS = [
    "condition", "n", "accuracy_mean", "cross_entropy_mean", "identical", "identical_within",
    "first_divergence_median", "l2_to_control",
    *(f"{m}{part}" for m in SUPERVISED_METRICS for part in ("", "_lo", "_hi")),
]  # fmt: skip


def _csv_row(cond: str, row: dict[str, Any], columns: list[str]) -> list[Any]:
    values: list[Any] = [cond]
    for c in columns[1:]:
        if c in row:
            values.append(row[c])
            continue
        for part, key in (("_lo", "lo"), ("_hi", "hi"), ("", "value")):
            if c.endswith(part) and c[: len(c) - len(part)] in row.get("metrics", {}):
                values.append(row["metrics"][c[: len(c) - len(part)]][key])
                break
        else:
            values.append(None)
    return ["" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v for v in values]


def write_summary(out: str | Path, summary: dict[str, Any]) -> None:
    """``OUT/summary.json`` (canonical JSON, NaN as null) and ``OUT/summary.csv`` (one row per condition)."""
    out = Path(out)
    summary_format.write(out, summary)
    columns = RL_COLUMNS if summary["protocol"] == "rl" else SUPERVISED_COLUMNS
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for cond, row in summary["conditions"].items():
        w.writerow(_csv_row(cond, row, columns))
    safeio.write_atomic(out, "summary.csv", buf.getvalue().encode())


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _divergence(row: dict[str, Any]) -> str:
    d = row["first_divergence_median"]
    return "never" if d is None else _num(d, ".0f")


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a text table (the report, ``detrl report``, has the rest)."""
    if summary["protocol"] == "rl":
        lines = [
            f"{'condition':<20} {'N':>3} {'final return':>15} {'best':>6} {'IQM [95% CI]':>24} {'AUC':>7} "
            f"{'identical':>9} {'diverges at':>11} {'L2 to control':>13}"
        ]
        for cond, r in summary["conditions"].items():
            ms = f"{_num(r['eval_mean'])} ± {_num(r['eval_sd'])}"
            iqm = f"{_num(r['iqm'])} [{_num(r['iqm_lo'])}, {_num(r['iqm_hi'])}]"
            lines.append(
                f"{cond:<20} {r['n']:>3} {ms:>15} {_num(r['eval_best']):>6} {iqm:>24} {_num(r['auc']):>7} "
                f"{'yes' if r['identical'] else 'no':>9} {_divergence(r):>11} {_num(r['l2_to_control'], '.4g'):>13}"
            )
        return "\n".join(lines)
    lines = [
        f"{'condition':<20} {'N':>3} {'accuracy':>8} {'SD acc':>7} {'SD CE':>7} {'disagree':>8} {'pearson':>7} "
        f"{'spearman':>8} {'ens. gain':>9} {'identical':>9} {'diverges at':>11} {'L2 to control':>13}"
    ]
    for cond, r in summary["conditions"].items():
        m = {k: v["value"] for k, v in r["metrics"].items()}
        lines.append(
            f"{cond:<20} {r['n']:>3} {_num(r['accuracy_mean'], '.4f'):>8} {_num(m['accuracy_sd'], '.4f'):>7} "
            f"{_num(m['cross_entropy_sd'], '.4f'):>7} {_num(m['disagreement'], '.4f'):>8} "
            f"{_num(m['pearson'], '.4f'):>7} {_num(m['spearman'], '.4f'):>8} "
            f"{_num(m['ensemble_gain_accuracy'], '.4f'):>9} {'yes' if r['identical'] else 'no':>9} "
            f"{_divergence(r):>11} {_num(r['l2_to_control'], '.4g'):>13}"
        )
    if summary.get("remedies"):
        rem = summary["remedies"]
        lines.append(f"remedies against single models of {rem['baseline']!r} (reduction of variability):")
        for name, red in rem["reduction"].items():
            parts = [f"{k} {_num(None if v is None else 100 * v, '.0f')}%" for k, v in red.items()]
            lines.append(f"  {name}: " + ", ".join(parts))
    return "\n".join(lines)
