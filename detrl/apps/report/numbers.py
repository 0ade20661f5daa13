"""Every number of the report's tables, long format (table, condition, metric, value, lo, hi, unit):
``numbers.csv`` and ``numbers.json``, in the summary's own units."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

import numpy as np

from detrl.apps.report.vocabulary import _MISSING, METRICS, NUMBER_COLUMNS
from detrl.formats.summary import (
    Interval,
    Row,
    Summary,
)


def _fmt(x: float | None, decimals: int, scale: float = 1.0) -> str:
    """A table number: ``decimals`` places; a non-zero value that would round to 0 keeps 2 significant
    digits, so a spread never looks like exactly zero unless it is."""
    if x is None or not math.isfinite(x):
        return _MISSING
    v = x * scale
    if v == 0:
        return "0"
    if abs(v) < 0.5 * 10.0**-decimals:
        return f"{v:.2g}"
    if abs(v) >= 1e7:
        return f"{v:.4g}"
    return f"{v:.{decimals}f}"


def _sig(x: float | None, digits: int = 3) -> str:
    """``digits`` significant digits (L2 distances span many orders of magnitude)."""
    if x is None or not math.isfinite(x):
        return _MISSING
    return "0" if x == 0 else f"{x:.{digits}g}"


def _fmt_interval(i: Interval | None, decimals: int, scale: float = 1.0) -> str:
    if i is None or i.value is None:
        return _MISSING
    if i.lo is None or i.hi is None:
        return _fmt(i.value, decimals, scale)
    return f"{_fmt(i.value, decimals, scale)} [{_fmt(i.lo, decimals, scale)}, {_fmt(i.hi, decimals, scale)}]"


def _fmt_step(x: float | None) -> str:
    if x is None:
        return _MISSING
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def _diverged(row: Row) -> tuple[list[int], int]:
    """The first-divergence steps of the runs that diverge, and how many runs never do."""
    steps = [d for d in row.first_divergence if d is not None]
    return steps, len(row.first_divergence) - len(steps)


def _median_divergence(row: Row) -> float | None:
    steps, _ = _diverged(row)
    if row.first_divergence_median is not None:
        return row.first_divergence_median
    return float(np.median(steps)) if steps else None


def _divergence_cell(row: Row) -> str:
    steps, never = _diverged(row)
    if not row.first_divergence:
        return _MISSING
    if not steps:
        return "never"
    median = _fmt_step(_median_divergence(row))
    return median if never == 0 else f"{median} ({never} of {len(row.first_divergence)} never)"


def _spread(s: Summary, row: Row) -> float | None:
    """The spread the findings rank by: SD of the final return (RL) or of test accuracy (supervised)."""
    if s.protocol == "rl":
        return row.scalars.get("eval_sd")
    m = row.metrics.get("accuracy_sd")
    return m.value if m else None


def _spread_text(s: Summary, v: float | None) -> str:
    if s.protocol == "rl":
        return f"SD {_fmt(v, 2)}"
    return f"SD {_fmt(v, 2, 100.0)} pp of accuracy"


def _number_rows(s: Summary) -> list[dict[str, Any]]:
    """Every number of the report's tables in the summary's units, one dict per (table, condition, metric)."""
    rows: list[dict[str, Any]] = []

    def add(
        table: str,
        cond: str,
        metric: str,
        value: float | int | None,
        unit: str,
        lo: float | None = None,
        hi: float | None = None,
    ) -> None:
        rows.append(
            {
                "table": table,
                "condition": cond,
                "metric": metric,
                "value": value,
                "lo": lo,
                "hi": hi,
                "unit": unit,
            }
        )

    for r in s.rows.values():
        steps, never = _diverged(r)
        add("main", r.name, "n", r.n, "runs")
        add("main", r.name, "identical", int(r.identical), "1 = every run bitwise identical to control run 0")
        add("main", r.name, "runs_diverged", len(steps), "runs")
        add("main", r.name, "runs_never_diverged", never, "runs")
        add("main", r.name, "first_divergence_median", _median_divergence(r), s.unit)
        add("main", r.name, "l2_to_control", r.l2_to_control, "L2 parameter distance")
        if s.protocol == "rl":
            sc = r.scalars
            add("main", r.name, "eval_mean", sc["eval_mean"], "return")
            add("main", r.name, "eval_sd", sc["eval_sd"], "return")
            add("main", r.name, "eval_best", sc["eval_best"], "return")
            add("main", r.name, "iqm", sc["iqm"], "return", sc["iqm_lo"], sc["iqm_hi"])
            add("main", r.name, "auc", sc["auc"], "return (mean over training)")
        else:
            add("main", r.name, "accuracy_mean", r.scalars["accuracy_mean"], "fraction")
            add("main", r.name, "cross_entropy_mean", r.scalars["cross_entropy_mean"], "nats")
            for table, ms in (("main", r.metrics), ("tta", r.tta)):
                for m, i in ms.items():
                    add(table, r.name, m, i.value, METRICS[m].raw_unit if m in METRICS else "", i.lo, i.hi)
    if s.remedies is not None:
        for k, ms in s.remedies.rows.items():
            for m, i in ms.items():
                add("remedies", k, m, i.value, METRICS[m].raw_unit if m in METRICS else "", i.lo, i.hi)
        for k, red in s.remedies.reduction.items():
            for m, v in red.items():
                add("reduction", k, m, v, "fraction of the single-model value")
    inst = _instability_numbers(s)
    if inst is not None:
        cond, first_step, first, last_step, last = inst
        add("instability", cond, "l2_first_positive", first, "L2 parameter distance")
        add("instability", cond, "l2_first_positive_step", first_step, s.unit)
        add("instability", cond, "l2_final", last, "L2 parameter distance")
        add("instability", cond, "l2_final_step", last_step, s.unit)
    return rows


def _instability_numbers(s: Summary) -> tuple[str, float, float, float, float] | None:
    """(condition, step and L2 of the first positive point, step and L2 of the last point), or None."""
    inst = s.instability
    if inst is None:
        return None
    ok = np.isfinite(inst.l2)
    pos = ok & (inst.l2 > 0)
    if not pos.any():
        return None
    i0, i1 = int(np.argmax(pos)), int(np.flatnonzero(ok)[-1])
    return (
        inst.condition,
        float(inst.steps[i0]),
        float(inst.l2[i0]),
        float(inst.steps[i1]),
        float(inst.l2[i1]),
    )


def _csv_cell(v: Any) -> str:
    if v is None:
        return ""
    return repr(float(v)) if isinstance(v, float) else str(v)  # repr: the shortest text that round-trips


def _numbers_csv(rows: list[dict[str, Any]]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(NUMBER_COLUMNS)
    for r in rows:
        w.writerow([_csv_cell(r[c]) for c in NUMBER_COLUMNS])
    return buf.getvalue().encode()
