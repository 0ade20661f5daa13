"""``detrl ablate``: which source of randomness moves an RL result, and how far (Nagarajan, Warnell & Stone 2018).

An ablation config names a base run config and the sources to vary::

    base: configs/dqn/tiny.yaml     # a run config (a path, or a packaged name), read with config.read_raw
    set: [precision=fp32]           # KEY=VALUE overrides applied to the base
    runs: 3                         # N runs per condition
    sources: [init, explore, replay, env, bitflip, hardware]
    all: true                       # one more condition that varies every listed source together
    curve_every: 100                # env steps between learning-curve points

Conditions: ``control`` (every source fixed: N runs of the *same* config, which must be bitwise identical),
one per listed source, and ``all``. Run ``k`` of source ``S`` (``k = 0 .. N-1``; run 0 varies too, it is
not the control) sets:

* a stream (``init``, ``explore``, ``replay``, ``env``, ``noop``, ...): ``sources.S.seed = 1000 + k``;
* ``bitflip``: ``sources.bitflip = true`` and the bitflip stream's seed
  ``sources.streams.bitflip.seed = 1000 + k`` (``sources.bitflip`` itself is the on/off switch);
* ``hardware``: ``hardware = emulated:atomic`` and nothing else: its accumulation orders are drawn from
  the OS (``os.urandom``) whenever a run starts, so these runs differ from each other and from any rerun.
  A sweep that lists ``hardware`` therefore reproduces every condition but ``hardware`` and ``all``.

Each run is an ordinary bundle (``detrl audit`` reads it) in ``OUT/runs/<condition>/<k>/`` with a
``result.json`` and ``params.npz`` beside the bundle files. Runs execute in a local process pool (``spawn``),
one torch thread per process; no result depends on the number of workers.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import json
import math
import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, ValidationError, field_validator

from detrl import config as config_mod
from detrl import metrics, safeio
from detrl.config import ConfigError, Strict
from detrl.sources import STREAMS

DEFAULT_SOURCES = ["init", "explore", "replay", "env", "bitflip", "hardware"]
#: What ``sources`` may list: every stream of the switchboard (``hardware`` is the profile, not a stream).
KNOWN_SOURCES = tuple(STREAMS)
SEED_BASE = 1000
#: Episodes averaged at each learning-curve point.
CURVE_WINDOW = 10
RESULT = "result.json"
PARAMS = "params.npz"
SPEC = "ablation.json"


class AblationConfig(Strict):
    """An ablation sweep (``detrl ablate CONFIG``)."""

    base: str = Field(
        description="the run config to ablate (a path, or a packaged name like configs/dqn/tiny.yaml)"
    )
    set: list[str] = Field(default_factory=list, description="KEY=VALUE overrides applied to the base")
    runs: int = Field(3, ge=1, le=10_000, description="runs per condition")
    sources: list[str] = Field(default_factory=lambda: list(DEFAULT_SOURCES), description="sources to vary")
    all: bool = Field(True, description="add a condition that varies every listed source together")
    curve_every: int = Field(100, ge=1, description="env steps between learning-curve points")

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, v: list[str]) -> list[str]:
        for s in v:
            if s not in KNOWN_SOURCES:
                raise ValueError(f"unknown source {s!r}; known: {', '.join(KNOWN_SOURCES)}")
        if len(set(v)) != len(v):
            raise ValueError("a source is listed twice")
        return v


def parse_sources(text: str) -> list[str]:
    """``"init,explore"`` -> ``["init", "explore"]``; an unknown source is one ConfigError line."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names:
        if s not in KNOWN_SOURCES:
            raise ConfigError(f"--sources: unknown source {s!r}; known: {', '.join(KNOWN_SOURCES)}")
    return names


def load_spec(path: str | Path, **overrides: Any) -> AblationConfig:
    """Read and validate an ablation config; ``overrides`` (``runs=5``, ``sources=[...]``) replace its keys.

    A relative ``base`` that exists beside the ablation file is taken from there; otherwise it is resolved
    as :func:`detrl.config.read_raw` resolves it (packaged configs included). The base config, with ``set``
    applied, is validated here so that a bad one fails before any run.
    """
    raw = config_mod.read_raw(path)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        spec = AblationConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(f"ablation config {path}: {where}: {msg}") from None
    beside = Path(path).parent / spec.base
    if not Path(spec.base).is_absolute() and beside.is_file() and Path(path).is_file():
        spec = spec.model_copy(update={"base": str(beside)})
    run_config(spec, "control", 0)  # the base with `set` must be a valid run config
    return spec


# ------------------------------------------------------------------------------------------- conditions
def conditions(spec: AblationConfig) -> list[str]:
    """``control``, each listed source, then ``all`` (when on and more than one source is listed)."""
    extra = ["all"] if spec.all and len(spec.sources) > 1 else []
    return ["control", *spec.sources, *extra]


def source_overrides(source: str, k: int) -> list[str]:
    """The config overrides of run ``k`` varying ``source``."""
    seed = SEED_BASE + k
    if source == "hardware":
        return ["hardware=emulated:atomic"]  # the orders come from the OS: nothing to seed
    if source == "bitflip":
        return ["sources.bitflip=true", f"sources.streams.bitflip.seed={seed}"]
    return [f"sources.{source}.seed={seed}"]


def condition_overrides(spec: AblationConfig, condition: str, k: int) -> list[str]:
    """Every override of run ``k`` of ``condition``: the spec's ``set``, then the varied sources'."""
    if condition == "control":
        varied: list[str] = []
    elif condition == "all":
        varied = [o for s in spec.sources for o in source_overrides(s, k)]
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
    """Learning-curve points: every ``every`` env steps, and the last step."""
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


def run_one(spec_json: str, out: str, condition: str, k: int) -> dict[str, Any]:
    """Record run ``k`` of ``condition`` in ``OUT/runs/<condition>/<k>/`` and write its ``result.json``.

    Takes the spec as JSON so a ``spawn`` worker can run it. Runs with one torch thread.
    """
    import torch

    from detrl import bundle as bundle_mod
    from detrl import commit, tasks

    torch.set_num_threads(1)
    spec = AblationConfig.model_validate_json(spec_json)
    cfg = run_config(spec, condition, k)
    task = tasks.get(cfg.task)
    where = run_dir(out, condition, k)
    where.mkdir(parents=True, exist_ok=True)
    session = tasks.session_for(cfg, where, "record", force=True)
    with session:
        result = task.run(cfg, session)
    manifest = bundle_mod.parse_manifest((where / bundle_mod.MANIFEST).read_bytes())
    tensors = commit.state_tensors(session.model)
    params = {name: t.detach().cpu().numpy() for name, t in sorted(tensors.items())}
    buf = io.BytesIO()
    np.savez(buf, **params)
    safeio.write_atomic(where, PARAMS, buf.getvalue())
    returns = [float(r) for r in result.get("returns", [])]
    ends = episode_end_steps(result.get("lengths", []))
    grid = curve_grid(cfg.train.steps, spec.curve_every)
    evals = [float(r) for r in result.get("eval_returns", [])]
    record = {
        "condition": condition,
        "k": k,
        "overrides": condition_overrides(spec, condition, k),
        "eval_returns": evals,
        "eval_mean": float(np.mean(evals)) if evals else None,
        "episode_returns": returns,
        "episode_end_steps": ends,
        "curve_steps": grid,
        "curve": _nan_to_none(learning_curve(returns, ends, grid)),
        "merkle_root": manifest.durable.merkle_root if manifest.durable is not None else None,
        "params_sha256": commit.hash_tensors(tensors).hex(),
    }
    safeio.write_atomic(where, RESULT, safeio.dumps_json(record))  # last: its presence marks the run done
    return record


def _run_job(spec_json: str, out: str, condition: str, k: int) -> tuple[str, int]:
    run_one(spec_json, out, condition, k)
    return condition, k


# ------------------------------------------------------------------------------------------- the sweep
def run_sweep(
    spec: AblationConfig,
    out: str | Path,
    workers: int | None = None,
    progress: bool = True,
    only: list[tuple[str, int]] | None = None,
) -> dict[str, int]:
    """Run every job of the sweep whose ``result.json`` is missing; return ``{"done": n, "skipped": m}``.

    An interrupted sweep resumes with the same call and redoes only the runs that had not finished. Jobs
    run in a local :class:`concurrent.futures.ProcessPoolExecutor` (``spawn`` context) of ``workers``
    processes (default ``os.cpu_count()``), each with one torch thread; results do not depend on
    ``workers``. ``only``: a subset of :func:`jobs` to run (tests use it to stop a sweep part way).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec_json = spec.model_dump_json()
    spec_file = out / SPEC
    if spec_file.is_file():
        old = AblationConfig.model_validate_json(spec_file.read_text())
        if old != spec:
            raise ConfigError(f"{out}: holds a different ablation sweep ({SPEC}); choose another --out")
    else:
        safeio.write_atomic(out, SPEC, safeio.dumps_json(spec.model_dump(mode="json")))
    todo_all = jobs(spec) if only is None else list(only)
    todo = [(c, k) for c, k in todo_all if not (run_dir(out, c, k) / RESULT).is_file()]
    skipped = len(todo_all) - len(todo)
    workers = max(1, min(workers or os.cpu_count() or 1, max(1, len(todo))))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo_all), initial=skipped, desc="ablate", unit="run", disable=None)
    try:
        if todo:
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = [pool.submit(_run_job, spec_json, str(out), c, k) for c, k in todo]
                try:
                    for fut in concurrent.futures.as_completed(futures):
                        fut.result()
                        if bar is not None:
                            bar.update(1)
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
    finally:
        if bar is not None:
            bar.close()
    return {"done": len(todo), "skipped": skipped}


# ------------------------------------------------------------------------------------------- summary
def _read_result(out: Path, condition: str, k: int) -> dict[str, Any] | None:
    path = run_dir(out, condition, k) / RESULT
    return json.loads(path.read_text()) if path.is_file() else None


def _params(out: Path, condition: str, k: int) -> dict[str, np.ndarray]:
    with np.load(run_dir(out, condition, k) / PARAMS) as z:
        return {name: z[name] for name in z.files}


def _auc(curve: np.ndarray, steps: np.ndarray) -> float:
    """Normalised area under a curve from its first point (NaN only before the first episode ends)."""
    keep = ~np.isnan(curve)
    if keep.sum() < 2:
        return math.nan
    return float(metrics.area_under_curve(curve[keep], steps[keep])[0])


def summarise(out: str | Path) -> dict[str, Any]:
    """Per condition: runs, final greedy return (mean, SD, IQM with a 95% bootstrap interval), mean AUC of
    the learning curve, whether every run is bitwise identical to control run 0 (parameter SHA-256), each
    run's first env step where its learning curve stops being bitwise equal to control run 0's (None: never)
    and their median, and the mean L2 parameter distance to control run 0. Only finished runs count."""
    out = Path(out)
    spec = AblationConfig.model_validate_json((out / SPEC).read_text())
    ref = _read_result(out, "control", 0)
    if ref is None:
        raise ConfigError(f"{out}: control run 0 has not finished; run the sweep first")
    ref_curve = _none_to_nan(ref["curve"])
    ref_steps = np.asarray(ref["curve_steps"])
    ref_params = _params(out, "control", 0)
    rows: dict[str, Any] = {}
    for cond in conditions(spec):
        done = [(k, r) for k in range(spec.runs) if (r := _read_result(out, cond, k)) is not None]
        if not done:
            continue
        finals = [r["eval_mean"] if r["eval_mean"] is not None else math.nan for _, r in done]
        mean, sd = metrics.mean_sd(finals)
        iqm, lo, hi = metrics.iqm_with_interval(finals)
        aucs = [_auc(_none_to_nan(r["curve"]), np.asarray(r["curve_steps"])) for _, r in done]
        divergence = [
            metrics.first_divergence_step(ref_curve, _none_to_nan(r["curve"]), ref_steps) for _, r in done
        ]
        diverged = [d for d in divergence if d is not None]
        l2 = [metrics.l2_distance(ref_params, _params(out, cond, k)) for k, _ in done]
        rows[cond] = {
            "n": len(done),
            "eval_mean": mean,
            "eval_sd": sd,
            "iqm": iqm,
            "iqm_lo": lo,
            "iqm_hi": hi,
            "auc": float(np.mean(aucs)),
            "identical": all(r["params_sha256"] == ref["params_sha256"] for _, r in done),
            "first_divergence": divergence,
            "first_divergence_median": float(np.median(diverged)) if diverged else None,
            "l2_to_control": float(np.mean(l2)),
            "overrides": [r["overrides"] for _, r in done],
        }
    return {"spec": spec.model_dump(mode="json"), "conditions": rows}


def _finite(x: Any) -> Any:
    """JSON-safe: NaN and infinities become None (recursively)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


CSV_COLUMNS = [
    "condition", "n", "eval_mean", "eval_sd", "iqm", "iqm_lo", "iqm_hi", "auc", "identical",
    "first_divergence_median", "l2_to_control",
]  # fmt: skip


def write_summary(out: str | Path, summary: dict[str, Any]) -> None:
    """``OUT/summary.json`` (canonical JSON, NaN as null) and ``OUT/summary.csv`` (one row per condition)."""
    out = Path(out)
    safeio.write_atomic(out, "summary.json", safeio.dumps_json(_finite(summary)))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for cond, row in summary["conditions"].items():
        w.writerow([cond, *(row[c] for c in CSV_COLUMNS[1:])])
    safeio.write_atomic(out, "summary.csv", buf.getvalue().encode())


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a text table."""
    head = (
        f"{'condition':<10} {'N':>3} {'final return':>15} {'IQM [95% CI]':>24} {'AUC':>7} "
        f"{'identical':>9} {'diverges at':>11} {'L2 to control':>13}"
    )
    lines = [head]
    for cond, r in summary["conditions"].items():
        ms = f"{_num(r['eval_mean'])} ± {_num(r['eval_sd'])}"
        iqm = f"{_num(r['iqm'])} [{_num(r['iqm_lo'])}, {_num(r['iqm_hi'])}]"
        div = (
            _num(r["first_divergence_median"], ".0f") if r["first_divergence_median"] is not None else "never"
        )
        lines.append(
            f"{cond:<10} {r['n']:>3} {ms:>15} {iqm:>24} {_num(r['auc']):>7} "
            f"{'yes' if r['identical'] else 'no':>9} {div:>11} {_num(r['l2_to_control'], '.4g'):>13}"
        )
    return "\n".join(lines)
