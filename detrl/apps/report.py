"""``detrl report DIR``: an ablation sweep (``detrl ablate``) as a Markdown report, PNG plots, CSV and JSON.

The report reads only ``DIR/summary.json`` (the runs themselves are not needed) and writes ``DIR/report/``:

* ``report.md``: provenance (command, configs, machine), whether the control was bitwise identical, findings
  computed from the numbers, the main table (and, for the supervised protocol, the remedies), the plots with
  one sentence each on what to look for, and the references;
* ``learning_curves.png``, ``metrics.png``, ``divergence.png``, ``instability.png``, ``distance.png``: a plot
  whose data the summary lacks is skipped, and the report says why;
* ``numbers.csv`` and ``numbers.json``: every number of the tables, long format
  ``table, condition, metric, value, lo, hi, unit``, in the summary's own units (fractions, not percent).

Everything is a pure function of ``summary.json``: no date, path of DIR or software version is written, and
the PNGs carry no ``Software`` tag, so regenerating from the same file gives the same bytes (with the same
matplotlib). ``summary.json`` is treated as untrusted: read without following a link, at most
:data:`detrl.formats.summary.MAX_SUMMARY_BYTES`, strict JSON, every field type-checked and size-bounded; any defect is one
:class:`~detrl.formats.summary.SummaryError` line (its reader is :mod:`detrl.formats.summary`).
"""

from __future__ import annotations

import csv
import io
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator

from detrl.formats import safeio
from detrl.formats.summary import (
    Interval,
    Remedies,
    Row,
    Series,
    Summary,
    load_summary,
)
from detrl.run.config import ConfigError

__all__ = ["Report", "Summary", "load_summary", "make_report", "write_report"]

REPORT_DIR = "report"
MARKDOWN = "report.md"
NUMBERS_CSV = "numbers.csv"
NUMBERS_JSON = "numbers.json"
#: PNG resolution (dots per inch): 120 keeps 9-point text crisp at a moderate file size.
DPI = 120
NUMBER_COLUMNS = ("table", "condition", "metric", "value", "lo", "hi", "unit")
_MISSING = "–"

REFERENCES = {
    "rl": (
        "Nagarajan, P., Warnell, G. & Stone, P. (2018). *Deterministic Implementations for Reproducibility "
        "in Deep Reinforcement Learning.* 2nd Reproducibility in Machine Learning Workshop at ICML 2018. "
        "arXiv:1809.05676."
    ),
    "supervised": (
        "Summers, C. & Dinneen, M. J. (2021). *Nondeterminism and Instability in Neural Network "
        "Optimization.* Proceedings of the 38th International Conference on Machine Learning (ICML), "
        "PMLR 139. arXiv:2103.04514."
    ),
}
IQM_REFERENCE = (
    "Agarwal, R., Schwarzer, M., Castro, P. S., Courville, A. & Bellemare, M. G. (2021). *Deep "
    "Reinforcement Learning at the Edge of the Statistical Precipice.* NeurIPS 2021. arXiv:2108.13264."
)


@dataclass(frozen=True)
class MetricInfo:
    """How a supervised diversity metric is shown: its label, display unit and the factor to that unit."""

    label: str
    unit: str  # display unit in the tables and plots
    scale: float  # summary value x scale = displayed value
    decimals: int
    raw_unit: str  # unit of the value in summary.json and numbers.csv


#: The diversity metrics of Summers & Dinneen (2021), in table order.
METRICS: dict[str, MetricInfo] = {
    "accuracy_sd": MetricInfo("SD of accuracy", "pp", 100.0, 2, "fraction"),
    "cross_entropy_sd": MetricInfo("SD of cross-entropy", "nats", 1.0, 4, "nats"),
    "disagreement": MetricInfo("disagreement", "%", 100.0, 2, "fraction"),
    "pearson": MetricInfo("Pearson r of logits", "", 1.0, 4, ""),
    "spearman": MetricInfo("Spearman ρ of logits", "", 1.0, 4, ""),
    "ensemble_gain_accuracy": MetricInfo("ensemble gain, accuracy", "pp", 100.0, 2, "fraction"),
    "ensemble_gain_cross_entropy": MetricInfo("ensemble gain, cross-entropy", "nats", 1.0, 4, "nats"),
}
#: Correlations measure similarity (near 1 when models agree): drawn as points with intervals, not bars.
_SIMILARITY = ("pearson", "spearman")
REMEDY_LABELS = {
    "single": "single models",
    "snapshot": "snapshot ensembles",
    "tta": "test-time augmentation",
}


# ---------------------------------------------------------------------------------------------- numbers
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


# ------------------------------------------------------------------------------------------------ plots
class _Skip(Exception):
    """A plot whose data the summary does not have; the message says what is missing."""


def _colours(names: Sequence[str]) -> dict[str, Any]:
    """One colour per condition, the same in every plot: control black, the others tab10 (tab20 past 9)."""
    palette = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]  # tab10's grey reads as control
    others = [n for n in names if n != "control"]
    if len(others) > len(palette):
        palette = list(colormaps["tab20"].colors)
    out: dict[str, Any] = {"control": "black"}
    for i, n in enumerate(others):
        out[n] = palette[i % len(palette)]
    return out


def _plain(s: str) -> str:
    """Text for matplotlib: a ``$`` would start mathtext, which can fail to parse at draw time."""
    return s.replace("$", r"\$")


_RC = {
    "font.family": "DejaVu Sans",  # shipped with matplotlib: the same glyphs (and PNG bytes) everywhere
    "font.size": 9.5,
    "axes.titlesize": 10,
    "axes.labelsize": 9.5,
    "legend.fontsize": 8.5,
    "xtick.labelsize": 8.5,
    "ytick.labelsize": 8.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.25,
    "grid.linewidth": 0.6,
    "legend.frameon": False,
}


def _step_text(top: float) -> Callable[[float], str]:
    """Tick text for steps: 20000 -> 20k once steps reach 10k (one style per axis, never 900 beside 1k)."""
    eng = EngFormatter(sep="")
    return (lambda t: eng(t)) if top >= 10_000 else (lambda t: f"{t:g}")


def _steps_axis(ax: Axes, top: float) -> None:
    text = _step_text(top)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda t, _: text(t)))


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # No Software tag (it names the matplotlib version); Agg writes no date: the bytes depend on the data.
    fig.savefig(
        buf, format="png", dpi=DPI, metadata={"Software": None}
    )  # constrained layout fits the legends
    return buf.getvalue()


def _grid(n: int) -> tuple[int, int]:
    """(rows, columns) of at most 4 columns for ``n`` panels: fewest rows plus empty panels, then widest."""
    best = min(range(1, min(4, n) + 1), key=lambda c: (math.ceil(n / c) + math.ceil(n / c) * c - n, -c))
    return math.ceil(n / best), best


def _plot_learning_curves(s: Summary, colours: dict[str, Any]) -> tuple[Figure, str]:
    curves = {
        c: r.curve for c, r in s.rows.items() if r.curve is not None and np.isfinite(r.curve.mean).any()
    }
    if not curves:
        raise _Skip("no condition has a learning curve in summary.json")
    names = list(curves)
    nrows, ncols = _grid(len(names))
    fig = Figure(figsize=(3.3 * ncols, 2.5 * nrows + 0.9), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    ref = curves.get("control")
    for i, ax in enumerate(axes.flat):
        if i >= len(names):
            ax.remove()
            continue
        c = names[i]
        cv, col = curves[c], colours[c]
        for run in cv.runs:
            ax.plot(cv.steps, run, color=col, lw=0.7, alpha=0.35)
        if cv.lo is not None and cv.hi is not None:
            ax.fill_between(cv.steps, cv.lo, cv.hi, color=col, alpha=0.18, lw=0)
        if ref is not None and c != "control":
            ax.plot(ref.steps, ref.mean, color="0.35", lw=1.0, ls="--")
        ax.plot(cv.steps, cv.mean, color=col, lw=1.8)
        ax.set_title(f"{c}  (N = {s.rows[c].n})", color=col if c != "control" else "black")
        _steps_axis(ax, max(float(np.max(v.steps, initial=0)) for v in curves.values()))
        if i + ncols >= len(names):  # the lowest panel of its column: ticks and label (the one below is gone)
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel(s.unit)
    handles = [
        Line2D([], [], color="0.2", lw=1.8, label="mean over runs"),
        Patch(color="0.2", alpha=0.18, label="min–max over runs"),
        Line2D([], [], color="0.2", lw=0.7, alpha=0.35, label="individual runs"),
    ]
    if ref is not None:
        handles.append(Line2D([], [], color="0.35", lw=1.0, ls="--", label="control mean"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    label = next(iter(curves.values())).label
    fig.supylabel(_plain(label))
    fig.suptitle(f"Learning curves per condition: {_plain(label)}")
    return fig, (
        "Look for how far each panel's band (min–max over runs) opens around its mean and away from the "
        "dashed "
        "control mean: a panel whose runs all lie on the control line is a source that does not move "
        "training."
    )


def _hbars(
    ax: Axes,
    names: list[str],
    colours: dict[str, Any],
    values: list[float | None],
    err: list[tuple[float, float] | None],
    *,
    points: bool = False,
    scale: float = 1.0,
) -> None:
    """Horizontal bars (or points) per condition with interval whiskers; n/a where a value is undefined."""
    y = np.arange(len(names))

    def note(k: int, text: str) -> None:  # at the left edge of the axes, whatever its data range
        ax.text(0.01, y[k], text, transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="0.35")

    for k, (c, v, e) in enumerate(zip(names, values, err)):
        if v is None:
            note(k, "n/a")
            continue
        xerr = None if e is None else np.array([[max(0.0, v - e[0]) * scale], [max(0.0, e[1] - v) * scale]])
        if points:
            ax.errorbar(v * scale, y[k], xerr=xerr, fmt="o", color=colours[c], ms=5, capsize=3, lw=1.2)
        else:
            ax.barh(y[k], v * scale, color=colours[c], alpha=0.85, height=0.65)
            if xerr is not None:
                ax.errorbar(v * scale, y[k], xerr=xerr, fmt="none", ecolor="0.15", capsize=3, lw=1.0)
            if v == 0:  # a zero bar is invisible: say it
                note(k, "0")
    ax.set_yticks(y, names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # first condition on top, as in the table
    ax.grid(axis="y", visible=False)
    if not points:
        ax.axvline(0, color="0.3", lw=0.8)


def _plot_metrics(s: Summary, colours: dict[str, Any]) -> tuple[Figure, str]:
    names = list(s.rows)
    h = 0.32 * len(names) + 1.3
    if s.protocol == "rl":
        sc = {c: s.rows[c].scalars for c in names}
        if all(sc[c]["eval_mean"] is None and sc[c]["iqm"] is None for c in names):
            raise _Skip("no condition has a final return in summary.json")
        fig = Figure(figsize=(10.5, h + 0.6), layout="constrained")
        ax1, ax2 = fig.subplots(1, 2, sharey=True)

        def sd_err(c: str) -> tuple[float, float] | None:
            m, sd = sc[c]["eval_mean"], sc[c]["eval_sd"]
            return None if m is None or sd is None else (m - sd, m + sd)

        def ci_err(c: str) -> tuple[float, float] | None:
            lo, hi = sc[c]["iqm_lo"], sc[c]["iqm_hi"]
            return None if lo is None or hi is None else (lo, hi)

        _hbars(ax1, names, colours, [sc[c]["eval_mean"] for c in names], [sd_err(c) for c in names])
        for k, c in enumerate(names):
            if sc[c]["eval_best"] is not None:
                ax1.plot(sc[c]["eval_best"], k, marker="D", ms=5, color="0.1", mfc="white", ls="none")
        whisker = "whisker: ± 1 SD over runs (left), 95% CI (right)"
        handles = [
            Line2D([], [], color="0.15", marker="|", ms=8, ls="none", label=whisker),
            Line2D([], [], color="0.1", marker="D", mfc="white", ms=5, ls="none", label="best run"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncols=2)
        ax1.set_title("Final greedy return: mean ± SD")
        ax1.set_xlabel("return (per episode)")
        _hbars(ax2, names, colours, [sc[c]["iqm"] for c in names], [ci_err(c) for c in names])
        ax2.set_title("IQM of final return [95% stratified-bootstrap CI]")
        ax2.set_xlabel("return (per episode)")
        for ax in (ax1, ax2):
            lo, hi = ax.get_xlim()
            ax.set_xlim(min(lo, 0), hi + 0.08 * (hi - min(lo, 0)))  # room for the whiskers' caps
        return fig, (
            "Compare each bar and whisker with the control's (black): a source whose interval sits far from "
            "the "
            "control's value moves the final result, and a wide whisker means that source alone spreads the "
            "runs."
        )
    panels = [("accuracy_mean", MetricInfo("mean accuracy", "%", 100.0, 2, "fraction"))] + [
        (m, info) for m, info in METRICS.items()
    ]
    have = [m for m, _ in panels[1:] if any(m in s.rows[c].metrics for c in names)]
    if not have:
        raise _Skip("no condition has diversity metrics in summary.json")
    nrows, ncols = 2, 4
    fig = Figure(figsize=(14, 2 * h + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False)
    for ax, (m, info) in zip(axes.flat, panels):
        if m == "accuracy_mean":
            vals = [s.rows[c].scalars["accuracy_mean"] for c in names]
            errs: list[tuple[float, float] | None] = [None] * len(names)
        else:
            ivs = [s.rows[c].metrics.get(m) for c in names]
            vals = [i.value if i else None for i in ivs]
            errs = [
                (i.lo, i.hi) if i and i.value is not None and i.lo is not None and i.hi is not None else None
                for i in ivs
            ]
        # Values near 1 (or 100 %) as points on a zoomed axis: bars from 0 would hide the differences.
        points = m in _SIMILARITY or m == "accuracy_mean"
        _hbars(ax, names, colours, vals, errs, points=points, scale=info.scale)
        ax.set_title(info.label, fontsize=9.5)
        ax.set_xlabel(info.unit or "correlation")
        ax.xaxis.set_major_locator(MaxNLocator(4))
    fig.suptitle("Diversity of the trained models per condition (whiskers: 95% bootstrap intervals)")
    return fig, (
        "Read each panel across conditions: Summers & Dinneen's finding is that every single source gives "
        "nearly the same diversity as `all`; a bar near zero marks a source that barely changes the models."
    )


def _plot_divergence(s: Summary, colours: dict[str, Any]) -> tuple[Figure, str]:
    data = {c: _diverged(r) for c, r in s.rows.items() if r.first_divergence}
    if not data:
        raise _Skip("no condition lists per-run first divergence steps")
    steps_all = [d for steps, _ in data.values() for d in steps]
    never_total = sum(never for _, never in data.values())
    runs_total = sum(len(steps) + never for steps, never in data.values())
    ends = [float(r.curve.steps[-1]) for r in s.rows.values() if r.curve is not None and len(r.curve.steps)]
    ends += [
        float(r.distance.steps[-1])
        for r in s.rows.values()
        if r.distance is not None and len(r.distance.steps)
    ]
    top = max([*steps_all, *ends, 1.0])
    bins = 20
    width = top / bins
    edges = np.linspace(0.0, top, bins + 1)
    never_x = top + width  # a separate bin right of the step axis, one bin's gap away
    fig = Figure(figsize=(9.5, 4.0), layout="constrained")
    ax = fig.subplots()
    bottom = np.zeros(bins)
    never_bottom = 0
    for c, (steps, never) in data.items():
        counts = np.histogram(np.minimum(steps, top), bins=edges)[0] if steps else np.zeros(bins, dtype=int)
        label = f"{c}: {len(steps)} diverge, {never} never"
        ax.bar(
            edges[:-1],
            counts,
            width=width,
            bottom=bottom,
            align="edge",
            color=colours[c],
            edgecolor="white",
            lw=0.5,
            label=label,
        )
        if never:
            ax.bar(
                never_x,
                never,
                width=width,
                bottom=never_bottom,
                align="edge",
                color=colours[c],
                edgecolor="white",
                lw=0.5,
                hatch="//",
            )
        bottom = bottom + counts
        never_bottom += never
    ax.axvline(top + 0.5 * width, color="0.4", lw=0.8, ls=":")
    ax.set_xlim(-0.5 * width, never_x + 1.5 * width)
    ticks = [t for t in MaxNLocator(6).tick_values(0, top) if 0 <= t <= top]
    text = _step_text(top)
    ax.set_xticks([*ticks, never_x + 0.5 * width], [text(t) for t in ticks] + ["never"])
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(
        f"first {s.unit} at which a run's parameters differ from control run 0 (bins of "
        f"{text(width) if width >= 10 else f'{width:.3g}'})"
    )
    ax.set_ylabel("runs")
    ax.grid(axis="x", visible=False)
    ax.set_title(
        f"First divergence from control run 0: {runs_total - never_total} of {runs_total} runs diverge, "
        f"{never_total} never (hatched)"
    )
    fig.legend(loc="outside right upper")
    return fig, (
        "Look at where each colour's mass lies: sources that change the very first step (initialisation, a "
        "flipped bit) pile up at the left, sources that act later (exploration after learning starts) "
        "further "
        "right, and the `never` bin holds the runs still bitwise equal to the control at the end."
    )


def _plot_instability(s: Summary, colours: dict[str, Any]) -> tuple[Figure, str]:
    inst = s.instability
    if inst is None:
        why = "" if "bitflip" in s.rows else " (the sweep has no bitflip condition)"
        raise _Skip(f"summary.json has no instability curve{why}")
    ok = np.isfinite(inst.l2)
    pos = ok & (inst.l2 > 0)
    if not ok.any():
        raise _Skip("the instability curve has no recorded point")
    fig = Figure(figsize=(7.5, 4.0), layout="constrained")
    ax = fig.subplots()
    col = colours.get(inst.condition, "tab:red")
    dropped = int((ok & ~pos).sum())
    if pos.any():
        ax.plot(inst.steps[pos], inst.l2[pos], color=col, lw=1.8, marker="o", ms=3.5)
        # The distance grows geometrically: on a log axis exponential growth is a straight line.
        ax.set_yscale("log")
        ax.set_ylim(float(inst.l2[pos].min()) / 4, float(inst.l2[pos].max()) * 4)  # room for the end labels
        first, last = int(np.argmax(pos)), int(np.flatnonzero(pos)[-1])
        # First point labelled below-right and last above-left: the side a rising curve leaves free.
        for i, xy, ha, va in ((first, (6, -4), "left", "top"), (last, (-6, 4), "right", "bottom")):
            ax.annotate(
                f"L2 = {inst.l2[i]:.2g}",
                (inst.steps[i], inst.l2[i]),
                textcoords="offset points",
                xytext=xy,
                ha=ha,
                va=va,
                fontsize=8.5,
            )
        ylabel = "L2 parameter distance (log scale)"
    else:  # nothing positive to draw on a log axis: the twin never left the control
        ax.plot(inst.steps[ok], inst.l2[ok], color=col, lw=1.8, marker="o", ms=3.5)
        ylabel = "L2 parameter distance"
    _steps_axis(ax, float(np.max(inst.steps, initial=0)))
    ax.set_xlabel(s.unit)
    ax.set_ylabel(ylabel)
    note = (
        f"\n({dropped} point{'s' if dropped != 1 else ''} with L2 = 0 not drawn on the log axis)"
        if dropped and pos.any()
        else ""
    )
    ax.set_title(f"Instability: control run 0 vs its one-bit twin ({inst.condition} run 0){note}")
    return fig, (
        "Look at the slope: a one-bit change to one initial weight that grows by orders of magnitude (a "
        "rising "
        "straight line on this log axis is exponential growth) shows training itself amplifies any "
        "perturbation."
    )


def _plot_distance(s: Summary, colours: dict[str, Any]) -> tuple[Figure, str]:
    dists = {c: r.distance for c, r in s.rows.items() if r.distance is not None and len(r.distance.steps)}
    if not dists:
        raise _Skip("no condition has an L2-to-control curve in summary.json")

    def positive(d: Series) -> bool:
        return bool(np.any(np.nan_to_num(d.mean) > 0) or any(np.any(np.nan_to_num(r) > 0) for r in d.runs))

    drawn = [c for c, d in dists.items() if positive(d)]
    zero = [c for c in dists if c not in drawn]
    fig = Figure(figsize=(9.5, 4.3), layout="constrained")
    ax = fig.subplots()
    for c in drawn if drawn else zero:
        d = dists[c]
        mask = (
            (lambda y: np.where(y > 0, y, np.nan)) if drawn else (lambda y: y)
        )  # log axis: zeros leave a gap
        for run in d.runs:
            ax.plot(d.steps, mask(run), color=colours[c], lw=0.7, alpha=0.3)
        ax.plot(d.steps, mask(d.mean), color=colours[c], lw=1.8, label=f"{c} (N = {s.rows[c].n})")
    if drawn:
        ax.set_yscale("log")
    handles, labels = ax.get_legend_handles_labels()  # thick lines: the mean over runs
    handles.append(Line2D([], [], color="0.3", lw=0.7, alpha=0.5))
    labels.append("thin lines: individual runs")
    if zero and drawn:  # said in the legend, not drawn: zero has no place on a log axis
        handles.append(Line2D([], [], ls="none"))
        labels.append("L2 = 0 throughout (identical to\ncontrol run 0), not drawn:\n" + ", ".join(zero))
    _steps_axis(ax, max(float(np.max(d.steps, initial=0)) for d in dists.values()))
    ax.set_xlabel(s.unit)
    ax.set_ylabel("L2 parameter distance to control run 0" + (" (log scale)" if drawn else ""))
    ax.set_title("L2 distance of each condition's parameters to control run 0")
    fig.legend(handles, labels, loc="outside right upper")
    return fig, (
        "Look at when each line leaves zero and how fast it climbs: sources whose distance rises to the "
        "level "
        "of `all` end in as different a model as varying everything at once."
    )


PLOTS: tuple[tuple[str, str, Callable[[Summary, dict[str, Any]], tuple[Figure, str]]], ...] = (
    ("learning_curves.png", "Learning curves", _plot_learning_curves),
    ("metrics.png", "Metrics by condition", _plot_metrics),
    ("divergence.png", "First divergence step", _plot_divergence),
    ("instability.png", "Instability of a one-bit change", _plot_instability),
    ("distance.png", "L2 distance to the control over training", _plot_distance),
)


# --------------------------------------------------------------------------------------------- markdown
def _md(s: str) -> str:
    """Plain text that Markdown shows as written (no emphasis, links, HTML or table breaks)."""
    return re.sub(r"([\\`*_\[\]{}<>#|!~])", r"\\\1", s)


def _code(s: str) -> str:
    """An inline code span that holds ``s`` whatever backticks it contains; pipes escaped for tables."""
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s.replace('|', chr(92) + '|')}{pad}{ticks}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """A GitHub-flavoured Markdown table; ``align`` has one of l, r per column."""
    sep = ["---:" if a == "r" else ":---" for a in align]
    return [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(sep) + " |",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _names(xs: Sequence[str]) -> str:
    """`a`, `b` and `c`."""
    q = [f"`{x}`" for x in xs]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " and " + q[-1]


def _precision(row: Row, spec_set: Sequence[str]) -> str | None:
    """The precision every run of ``row`` uses, from its overrides (the last ``precision=`` wins)."""
    found: set[str | None] = set()
    for run in row.overrides or (tuple(spec_set),):
        value = None
        for o in run:
            if o.startswith("precision="):
                value = o.split("=", 1)[1].strip()
        found.add(value)
    return found.pop() if len(found) == 1 else None


def _control_text(s: Summary) -> list[str]:
    ctrl = s.rows["control"]
    same = s.control_identical if s.control_identical is not None else ctrl.identical
    spread = _spread(s, ctrl)
    if ctrl.n < 2:
        return [
            f"The control has only {ctrl.n} run, so its bitwise reproducibility is untested: "
            "rerun the sweep with `--runs 2` or more before trusting any difference below."
        ]
    if same and spread in (0.0, None) and not ctrl.l2_to_control:
        return [
            f"**The control is bitwise identical**: all {ctrl.n} runs of the unchanged config produced the "
            "same "
            "parameters as control run 0, so its row has zero spread (SD 0, L2 0 to control run 0) by "
            "construction. Every spread in the other rows is therefore caused by the source that row varies, "
            "nothing else."
        ]
    if same:  # identical parameters cannot give different results: the summary contradicts itself
        return [
            f"**summary.json contradicts itself**: it says the {ctrl.n} control runs are bitwise identical, "
            "yet "
            f"their row has {_spread_text(s, spread)} and mean L2 {_sig(ctrl.l2_to_control)} to control run "
            "0. "
            "Regenerate the summary (`detrl ablate` again on the same --out) before reading further."
        ]
    return [
        f"**The control is NOT bitwise identical**: the {ctrl.n} runs of one unchanged config differ "
        f"(median first divergence at step {_fmt_step(_median_divergence(ctrl))}, mean L2 "
        f"{_sig(ctrl.l2_to_control)} "
        f"to control run 0; {_spread_text(s, spread)}). Training is not deterministic here, so every other "
        "row "
        "mixes its source with this uncontrolled one: find the unseeded or order-dependent operation first."
    ]


@dataclass(frozen=True)
class _Facts:
    """What several findings read: the varied conditions, the varied sources, the main metric's name and
    each varied condition's spread of it (None where undefined)."""

    varied: list[str]
    srcs: list[str]
    what: str
    spread: dict[str, float | None]


def _findings(s: Summary) -> list[str]:
    """Bullets computed from the numbers: each finding function in :data:`_FINDINGS` adds zero or more."""
    varied = [c for c in s.rows if c != "control"]
    facts = _Facts(
        varied=varied,
        srcs=[c for c in s.sources if c in s.rows],
        what="the final return" if s.protocol == "rl" else "test accuracy",
        spread={c: _spread(s, s.rows[c]) for c in varied},
    )
    return [line for finding in _FINDINGS for line in finding(s, facts)]


def _finding_identical(s: Summary, f: _Facts) -> list[str]:
    """Which conditions stayed bitwise identical to the control."""
    out: list[str] = []
    varied = f.varied
    same = [c for c in varied if s.rows[c].identical]
    if same:
        out.append(f"Bitwise identical to the control (every run, at the end of training): {_names(same)}.")
    elif varied:
        out.append(
            "No varied condition is bitwise identical to the control: every one changes the trained "
            "parameters."
        )
    return out


def _finding_largest_spread(s: Summary, f: _Facts) -> list[str]:
    """The three conditions with the largest spread of the main metric."""
    out: list[str] = []
    what, spread = f.what, f.spread
    ranked = sorted(((c, v) for c, v in spread.items() if v is not None and v > 0), key=lambda cv: -cv[1])
    if ranked:
        top = ", then ".join(f"`{c}` ({_spread_text(s, v)})" for c, v in ranked[:3])
        out.append(f"Largest spread of {what}: {top}.")
    return out


def _finding_zero_spread(s: Summary, f: _Facts) -> list[str]:
    """Sources with zero spread (harmless alone?), and conditions with no spread defined."""
    out: list[str] = []
    varied, srcs, what, spread = f.varied, f.srcs, f.what, f.spread
    unknown = [c for c in varied if spread[c] is None]
    zero = [c for c in srcs if spread[c] == 0]
    measured_srcs = [c for c in srcs if spread[c] is not None]
    if measured_srcs and not zero:
        every = (
            "Every varied source"
            if len(measured_srcs) == len(srcs)
            else "Every varied source with 2 or more runs"
        )
        out.append(f"{every} has non-zero spread of {what}: none of them is harmless on its own.")
    elif zero:
        rest = [c for c in measured_srcs if c not in zero]
        out.append(
            f"Zero spread of {what}: {_names(zero)}"
            + (f"; every other varied source ({_names(rest)}) has non-zero spread." if rest else ".")
        )
    for c in zero:
        r = s.rows[c]
        if not r.identical:  # identical ones are named above; these differ where the metric does not look
            out.append(
                f"`{c}` has zero spread of {what}, but its parameters differ from the control (mean L2 "
                f"{_sig(r.l2_to_control)}): the change did not reach the metric in these runs."
            )
    if unknown:
        out.append(
            f"No spread is defined for {_names(unknown)} (fewer than 2 runs, or not recorded): shown as "
            f"{_MISSING}."
        )
    return out


def _finding_hardware(s: Summary, f: _Facts) -> list[str]:
    """What the fp32 hardware source did."""
    out: list[str] = []
    if "hardware" in s.rows:
        out.append(_hardware_finding(s, s.rows["hardware"]))
    return out


def _finding_verifiable(s: Summary, f: _Facts) -> list[str]:
    """Whether verifiable precision removed the hardware source."""
    out: list[str] = []
    hv = s.rows.get("hardware@verifiable")
    if hv is not None and hv.identical_within is not None:
        if hv.identical_within:
            out.append(
                f"`hardware@verifiable` (the same random accumulation orders, in verifiable precision): all "
                f"{hv.n} runs are bitwise identical to each other, so every spread in its row is exactly 0; "
                "the engine removed the source. (They differ from the fp32 control, a different computation.)"
            )
        else:
            out.append(
                "**`hardware@verifiable` runs are NOT bitwise identical to each other**: verifiable precision "
                "should make the accumulation order irrelevant; audit one of them with `detrl audit "
                "DIR/runs/hardware@verifiable/0 --hardware emulated:splitk`."
            )
    return out


def _finding_identical_within(s: Summary, f: _Facts) -> list[str]:
    """Conditions whose runs agree with each other but not with the control."""
    out: list[str] = []
    varied = f.varied
    within = [
        c
        for c in varied
        if s.rows[c].identical_within and not s.rows[c].identical and c != "hardware@verifiable"
    ]
    if within:
        out.append(f"Bitwise identical to each other but not to the control (zero spread): {_names(within)}.")
    return out


def _finding_against_all(s: Summary, f: _Facts) -> list[str]:
    """Each source's spread against that of varying every source at once."""
    out: list[str] = []
    srcs, spread = f.srcs, f.spread
    v_all = spread.get("all")
    ratios = (
        [(c, v / v_all) for c in srcs if (v := spread[c]) is not None and not s.rows[c].identical]
        if v_all
        else []
    )
    if ratios:
        lo, hi = min(ratios, key=lambda cr: cr[1]), max(ratios, key=lambda cr: cr[1])
        out.append(
            f"Against varying every source at once (`all`, {_spread_text(s, v_all)}), the sources that "
            "change the "
            f"model reach {lo[1]:.2f}x (`{lo[0]}`) to {hi[1]:.2f}x (`{hi[0]}`) of that spread"
            + (": each one alone already gives most of the variability." if lo[1] >= 0.5 else ".")
        )
    return out


def _finding_summers_dinneen(s: Summary, f: _Facts) -> list[str]:
    """Summers & Dinneen's expected finding, for the supervised protocol."""
    srcs = f.srcs
    if s.protocol == "supervised":
        return _summers_dinneen_finding(s, srcs)
    return []


def _finding_divergence(s: Summary, f: _Facts) -> list[str]:
    """The earliest and latest median first divergence from control run 0."""
    out: list[str] = []
    varied = f.varied
    med = {c: m for c in varied if (m := _median_divergence(s.rows[c])) is not None}
    if med:
        first, last = min(med.values()), max(med.values())
        at = lambda v: _names([c for c, m in med.items() if m == v])  # every condition at that step
        text = f"Median first divergence from control run 0: earliest at {s.unit} {_fmt_step(first)} "
        text += f"({at(first)})"
        if last != first:
            text += f", latest at {s.unit} {_fmt_step(last)} ({at(last)})"
        never = [c for c in varied if s.rows[c].first_divergence and not _diverged(s.rows[c])[0]]
        out.append(text + (f"; never for {_names(never)}." if never else "."))
    return out


def _finding_instability(s: Summary, f: _Facts) -> list[str]:
    """How far the one-bit twin grows away from the control."""
    out: list[str] = []
    inst = _instability_numbers(s)
    if inst is not None:
        cond, s0, l0, s1, l1 = inst
        if l1 > l0:
            out.append(
                f"Instability: the one-bit twin (`{cond}` run 0) is at L2 {l0:.2g} from control run 0 at "
                f"{s.unit} "
                f"{_fmt_step(s0)} and {l1:.2g} at {s.unit} {_fmt_step(s1)}: {math.log10(l1 / l0):.1f} "
                "orders of "
                "magnitude of growth from a one-bit change."
            )
        else:
            out.append(
                f"Instability: the one-bit twin (`{cond}` run 0) does not grow away from the control "
                f"(L2 {l0:.2g} at {s.unit} {_fmt_step(s0)}, {l1:.2g} at {s.unit} {_fmt_step(s1)})."
            )
    elif s.instability is not None:
        out.append(
            f"Instability: the one-bit twin (`{s.instability.condition}` run 0) stays at L2 0 from control "
            "run 0."
        )
    return out


def _finding_control_outside(s: Summary, f: _Facts) -> list[str]:
    """Whether the control's return is a typical draw of the varied sources (RL)."""
    out: list[str] = []
    varied = f.varied
    if s.protocol == "rl" and (ref := s.rows["control"].scalars.get("eval_mean")) is not None:
        outside = []
        for c in varied:
            lo_, hi_ = s.rows[c].scalars.get("iqm_lo"), s.rows[c].scalars.get("iqm_hi")
            if lo_ is not None and hi_ is not None and not lo_ <= ref <= hi_:
                outside.append(c)
        if outside:
            out.append(
                f"The control's final return ({_fmt(ref, 1)}) lies outside the 95% IQM interval of "
                f"{_names(outside)}: "
                "the control run is not a typical draw of those sources."
            )
    return out


def _finding_remedies(s: Summary, f: _Facts) -> list[str]:
    """How much each remedy reduces the spread (supervised)."""
    out: list[str] = []
    if s.remedies is not None:
        for k, red in s.remedies.reduction.items():
            parts = [
                f"{'reduces' if v >= 0 else 'increases'} the {METRICS[m].label} by {abs(v) * 100:.1f} %"
                for m in ("accuracy_sd", "disagreement")
                if (v := red.get(m)) is not None
            ]
            if parts:
                out.append(
                    f"Remedy `{k}` ({REMEDY_LABELS.get(k, k)}) {' and '.join(parts)} relative to single "
                    "models "
                    f"of `{s.remedies.baseline}`."
                )
    return out


def _finding_few_runs(s: Summary, f: _Facts) -> list[str]:
    """How rough the spreads are at few runs per condition."""
    out: list[str] = []
    n = min(r.n for r in s.rows.values())
    if 2 <= n < 10:
        out.append(
            f"With as few as {n} runs per condition these spreads are rough: the sample SD of n runs has a "
            f"relative standard error of about 1/√(2(n−1)) ({100 / math.sqrt(2 * (n - 1)):.0f} % at n = {n}) "
            "for normally distributed results, so differences in spread within a factor of 2 are not "
            "resolved."
        )
    return out


#: The findings of the report, in the order they are listed.
_FINDINGS: tuple[Callable[[Summary, _Facts], list[str]], ...] = (
    _finding_identical,
    _finding_largest_spread,
    _finding_zero_spread,
    _finding_hardware,
    _finding_verifiable,
    _finding_identical_within,
    _finding_against_all,
    _finding_summers_dinneen,
    _finding_divergence,
    _finding_instability,
    _finding_control_outside,
    _finding_remedies,
    _finding_few_runs,
)


def _summers_dinneen_finding(s: Summary, srcs: list[str]) -> list[str]:
    """The paper's expected finding, tested: does every source, even one bit, give about the diversity of
    all sources together? Measured by mean pairwise disagreement; explained by the parameter distance when
    it does not hold (a perturbation still growing at the end of training has not reached full diversity)."""
    ref = s.rows.get("all")
    d_all = (
        ref.metrics.get("disagreement").value if ref is not None and "disagreement" in ref.metrics else None
    )
    if not d_all:
        return []
    ratios = {}
    for c in srcs:
        m = s.rows[c].metrics.get("disagreement")
        if m is not None and m.value is not None and not s.rows[c].identical_within:
            ratios[c] = m.value / d_all
    if not ratios:
        return []
    close = [c for c, r in ratios.items() if r >= 0.5]
    far = [c for c, r in ratios.items() if r < 0.5]
    listed = ", ".join(f"`{c}` {r:.2f}x" for c, r in ratios.items())
    text = (
        f"Summers & Dinneen's finding, that every source alone gives about the diversity of all together: "
        f"mean disagreement relative to `all` is {listed}."
    )
    if not far:
        return [
            text + " Every source, the one-bit flip included, is within a factor of 2 of `all`: reproduced."
        ]
    text += f" Within a factor of 2: {_names(close) if close else 'none'}; below: {_names(far)}."
    l2_all = ref.l2_to_control if ref is not None else None
    grow = []
    for c in far:
        d = s.rows[c].distance
        if d is not None and len(d.mean) >= 3 and l2_all:
            last, before = float(d.mean[-1]), float(d.mean[len(d.mean) * 3 // 4 - 1])
            if before > 0 and last > before:
                grow.append(
                    f"`{c}` at {last / l2_all:.2f}x of `all`'s L2 and still growing ({last / before:.2f}x over the last quarter)"
                )
    if grow:
        text += (
            " Not reproduced at this training length: their distance to the control is "
            + "; ".join(grow)
            + ". The paper trains to convergence; a small perturbation needs time to be amplified to full "
            "diversity (see the instability curve)."
        )
    return [text]


def _hardware_finding(s: Summary, r: Row) -> str:
    """Whether accumulation order alone moves training, read against the precision the runs used."""
    prec = _precision(r, s.spec_set)
    profile = next(
        (o.split("=", 1)[1] for run in r.overrides for o in run if o.startswith("hardware=")),
        "emulated:atomic",
    )
    src = f"`hardware` (accumulation orders of {_code(profile)} drawn at random)"
    div = _fmt_step(_median_divergence(r))
    if prec == "verifiable":
        if r.identical:
            return (
                f"{src} under verifiable precision is bitwise identical to the control: zero spread; the "
                "accumulation "
                "order did not change a single bit of the trained parameters."
            )
        return (
            f"**{src} is NOT bitwise identical to the control under verifiable precision** (median first "
            "divergence "
            f"at {s.unit} {div}): verifiable training is meant to make the order irrelevant; audit one of "
            "these runs with "
            "`detrl audit DIR/runs/hardware/0 --hardware emulated:splitk`."
        )
    named = (
        f"{_code(prec)} precision" if prec else "the base config's precision (the overrides do not set it)"
    )
    if r.identical:
        extra = (
            ": its reductions may be too short for the profile to reorder"
            if prec in ("fp32", "float32")
            else ""
        )
        return f"{src} is bitwise identical to the control under {named}{extra}; zero spread."
    return (
        f"{src} differs from the control under {named} (median first divergence at {s.unit} {div}, mean L2 "
        f"{_sig(r.l2_to_control)}): the order of floating-point accumulation alone moves training, since "
        "rounded "
        "addition is not associative."
    )


def _main_table(s: Summary) -> list[str]:
    if s.protocol == "rl":
        head = [
            "condition",
            "N",
            "final return (mean ± SD)",
            "best",
            "IQM [95% CI]",
            "AUC",
            "identical",
            "first divergence (median step)",
            "L2 to control",
        ]
        rows = []
        for r in s.rows.values():
            sc = r.scalars
            iqm = Interval(sc["iqm"], sc["iqm_lo"], sc["iqm_hi"])
            rows.append([
                f"`{r.name}`", str(r.n), f"{_fmt(sc['eval_mean'], 1)} ± {_fmt(sc['eval_sd'], 1)}",
                _fmt(sc["eval_best"], 1), _fmt_interval(iqm, 1), _fmt(sc["auc"], 1),
                "yes" if r.identical else "no", _divergence_cell(r),
                _sig(r.l2_to_control),
            ])  # fmt: skip
        return _table(head, rows, "lrrrrrlrr")
    head = ["condition", "N", "accuracy (%)"] + [
        f"{METRICS[m].label} ({METRICS[m].unit})"
        + (" [95% CI]" if m in ("accuracy_sd", "cross_entropy_sd", "disagreement") else "")
        if METRICS[m].unit
        else METRICS[m].label
        for m in METRICS
    ]
    rows = []
    for r in s.rows.values():
        cells = [f"`{r.name}`", str(r.n), _fmt(r.scalars["accuracy_mean"], 2, 100.0)]
        for m, info in METRICS.items():
            i = r.metrics.get(m)
            if m in ("accuracy_sd", "cross_entropy_sd", "disagreement"):
                cells.append(_fmt_interval(i, info.decimals, info.scale))
            else:
                cells.append(_fmt(i.value if i else None, info.decimals, info.scale))
        rows.append(cells)
    return _table(head, rows, "lr" + "r" * (1 + len(METRICS)))


def _identity_table(s: Summary) -> list[str]:
    head = [
        "condition",
        "N",
        "cross-entropy (nats)",
        "identical",
        "first divergence (median step)",
        "L2 to control",
    ]
    rows = [
        [
            f"`{r.name}`",
            str(r.n),
            _fmt(r.scalars["cross_entropy_mean"], 4),
            "yes" if r.identical else "no",
            _divergence_cell(r),
            _sig(r.l2_to_control),
        ]
        for r in s.rows.values()
    ]
    return _table(head, rows, "lrrlrr")


def _metrics_table(label: str, rows_in: dict[str, dict[str, Interval]]) -> list[str]:
    head = [label] + [f"{i.label} ({i.unit})" if i.unit else i.label for i in METRICS.values()]
    rows = [
        [f"`{k}`"] + [_fmt_interval(ms.get(m), i.decimals, i.scale) for m, i in METRICS.items()]
        for k, ms in rows_in.items()
    ]
    return _table(head, rows, "l" + "r" * len(METRICS))


def _remedies_table(rem: Remedies) -> list[str]:
    kinds = list(rem.rows)
    head = ["metric"]
    for k in kinds:
        head.append(f"{REMEDY_LABELS.get(k, k)}" + (f" of `{rem.baseline}`" if k == "single" else ""))
        if k in rem.reduction:
            head.append("reduction")
    rows = []
    for m, info in METRICS.items():
        if not any(m in rem.rows[k] for k in kinds):
            continue
        cells = [f"{info.label} ({info.unit})" if info.unit else info.label]
        for k in kinds:
            cells.append(_fmt_interval(rem.rows[k].get(m), info.decimals, info.scale))
            if k in rem.reduction:
                v = rem.reduction[k].get(m)
                cells.append(_MISSING if v is None else f"{v * 100:.1f} %")
        rows.append(cells)
    return _table(head, rows, "l" + "r" * (len(head) - 1))


def _conditions_table(s: Summary) -> list[str]:
    shared = set(s.spec_set)
    rows = []
    for r in s.rows.values():
        own = [o for o in (r.overrides[0] if r.overrides else ()) if o not in shared]
        if r.name == "control":
            what = "nothing: every source fixed (the reference)"
        else:
            what = (
                ", ".join(_code(o) for o in own)
                if own
                else (_MISSING if not r.overrides else "nothing beyond the shared overrides")
            )
        rows.append([f"`{r.name}`", str(r.n), what])
    return _table(["condition", "runs", "what run 0 sets beyond the shared overrides"], rows, "lrl")


def _markdown(s: Summary, plots: list[tuple[str, str, str | None, str]]) -> str:
    proto = "reinforcement learning" if s.protocol == "rl" else "supervised learning"
    cite = "Nagarajan, Warnell & Stone (2018)" if s.protocol == "rl" else "Summers & Dinneen (2021)"
    title = f"Ablation of {s.base}" if s.base else "Ablation sweep"
    L: list[str] = [f"# {_md(title)}: which source of randomness moves the result?", ""]
    prov = [
        ["command", _code(s.command) if s.command else _MISSING],
        ["ablation config", _code(s.config) if s.config else _MISSING],
        ["base run config", _code(s.base) if s.base else _MISSING],
        ["shared overrides", ", ".join(_code(o) for o in s.spec_set) or "none"],
        ["protocol", f"{proto}, after {cite}"],
        ["machine", _md(s.machine) if s.machine else _MISSING],
        [
            "conditions",
            f"{len(s.rows)} ({', '.join(f'`{c}`' for c in s.rows)}); {sum(r.n for r in s.rows.values())} "
            "runs",
        ],
    ]
    L += _table(["", ""], prov, "ll") + [""]
    L += [
        "Generated by `detrl report` from `../summary.json`; every number in the tables is also in "
        f"[`{NUMBERS_CSV}`]({NUMBERS_CSV}) and [`{NUMBERS_JSON}`]({NUMBERS_JSON}).",
        "",
        "## Control",
        "",
        *_control_text(s),
        "",
        "## Findings",
        "",
        *(f"- {f}" for f in _findings(s)),
        "",
        "## Conditions",
        "",
        "`control` runs the config with every source of randomness fixed; each other condition varies one "
        "source "
        "(`all`: every listed source together). The table shows what run 0 of each condition sets, from the "
        "overrides recorded in summary.json.",
        "",
        *_conditions_table(s),
        "",
        "## Results",
        "",
        *_main_table(s),
        "",
    ]
    if s.protocol == "rl":
        L += [
            "Final return: undiscounted return of the greedy evaluation episodes after training, mean ± "
            "sample SD "
            "(ddof 1) over runs; best: the best run. IQM: interquartile mean over runs with a 95% "
            "stratified-bootstrap percentile interval (Agarwal et al., 2021). AUC: area under the learning "
            "curve divided by its step range, i.e. the mean training return over training. Identical: every "
            "run's parameters bitwise equal to control run 0's. First divergence: median over the runs that "
            "diverge of the first step whose parameters differ from control run 0's (never: equal to the "
            "end). "
            "L2 to control: mean over runs of the final L2 distance of all parameters to control run 0's. "
            f"{_MISSING}: "
            "undefined (one run) or not recorded.",
            "",
        ]
    else:
        L += [
            "Accuracy: test accuracy, mean over runs. SD of accuracy (percentage points) and of "
            "cross-entropy (nats): "
            "sample SD over runs. Disagreement: fraction of test examples whose predicted class differs, "
            "mean "
            "over pairs of runs. Pearson and Spearman: correlation of test logits, mean over pairs. "
            "Ensemble gain: "
            "how much a two-model ensemble (averaged softmax) beats its two members, mean over pairs; "
            "positive = "
            "the ensemble is better (accuracy in percentage points, cross-entropy in nats). Brackets: 95% "
            "bootstrap intervals over runs. "
            f"{_MISSING}: undefined (one run) or not recorded.",
            "",
            "### Bitwise identity and distance to the control",
            "",
            *_identity_table(s),
            "",
        ]
        tta = {r.name: r.tta for r in s.rows.values() if r.tta}
        if tta:
            L += ["### Under test-time augmentation", "", *_metrics_table("condition", tta), ""]
        if s.remedies is not None and s.remedies.rows:
            L += [
                "## Remedies",
                "",
                f"Single models of `{s.remedies.baseline}` against the remedies Summers & Dinneen propose. "
                "Reduction "
                "= (single − remedy) / single: positive when the remedy lowers the variability. Pearson and "
                "Spearman measure similarity, so their reduction is that of the dissimilarity 1 − ρ: "
                "positive when the remedy makes the models more alike.",
                "",
                *_remedies_table(s.remedies),
                "",
            ]
    L += ["## Plots", ""]
    for i, (file, heading, skipped, look) in enumerate(plots, 1):
        L += [f"### {i}. {heading}", ""]
        if skipped is not None:
            L += [f"Not drawn: {skipped}.", ""]
        else:
            L += [f"![{heading}]({file})", "", look, ""]
    refs = [REFERENCES[s.protocol]] + ([IQM_REFERENCE] if s.protocol == "rl" else [])
    L += ["## References", "", *(f"- {r}" for r in refs), ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------------ write
@dataclass(frozen=True)
class Report:
    """What :func:`make_report` wrote: the Markdown file, every file in ``report/``, the plots it skipped."""

    markdown: Path
    files: tuple[Path, ...]
    skipped: dict[str, str]  # plot file name -> why it was not drawn


def make_report(out: str | Path) -> Report:
    """Write ``out/report/`` from ``out/summary.json`` (see the module docstring); ConfigError if bad."""
    out = Path(out)
    s = load_summary(out)
    dest = out / REPORT_DIR
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest}: exists and is not a directory")
    dest.mkdir(exist_ok=True)
    colours = _colours(list(s.rows))
    written: list[Path] = []
    plots: list[tuple[str, str, str | None, str]] = []
    skipped: dict[str, str] = {}
    # Extreme but valid numbers (1e-90 on a log axis) can make numpy warn inside matplotlib's tick
    # arithmetic; the plot is still right, and the warning would only be noise on the CLI's stderr.
    with rc_context(_RC), warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        for file, heading, build in PLOTS:
            try:
                fig, look = build(s, colours)
            except _Skip as e:
                skipped[file] = str(e)
                plots.append((file, heading, str(e), ""))
                stale = dest / file
                if stale.is_file() and not stale.is_symlink():  # an earlier report's plot no longer true
                    stale.unlink()
                continue
            safeio.write_atomic(dest, file, _png(fig))
            written.append(dest / file)
            plots.append((file, heading, None, look))
    numbers = _number_rows(s)
    safeio.write_atomic(dest, NUMBERS_CSV, _numbers_csv(numbers))
    doc = {"protocol": s.protocol, "columns": list(NUMBER_COLUMNS), "rows": numbers}
    safeio.write_atomic(dest, NUMBERS_JSON, safeio.dumps_json(doc))
    safeio.write_atomic(dest, MARKDOWN, _markdown(s, plots).encode())
    files = (dest / MARKDOWN, dest / NUMBERS_CSV, dest / NUMBERS_JSON, *written)
    return Report(dest / MARKDOWN, files, skipped)


def write_report(out: str | Path) -> Path:
    """Turn the ablation sweep directory ``out`` into ``out/report/report.md`` with its plots and numbers.

    Returns the path of ``report.md``. Raises :class:`~detrl.run.config.ConfigError` (one line) when ``out`` has
    no ``summary.json`` or it is malformed.
    """
    return make_report(out).markdown
