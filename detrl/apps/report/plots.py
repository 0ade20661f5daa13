"""The report's PNG plots: learning curves, diversity metrics, first divergence, one-bit instability and
the distance to the control; a plot whose data the summary lacks is skipped with the reason."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator

from detrl.apps.report.numbers import _diverged
from detrl.apps.report.vocabulary import _SIMILARITY, DPI, METRICS, MetricInfo
from detrl.formats.summary import (
    Series,
    Summary,
)


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
