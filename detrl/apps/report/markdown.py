"""``report.md``: provenance, the control, findings computed from the numbers, the tables, the plots with
one sentence each on what to look for, and the references."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from detrl.apps.report.numbers import (
    _diverged,
    _divergence_cell,
    _fmt,
    _fmt_interval,
    _fmt_step,
    _instability_numbers,
    _median_divergence,
    _sig,
    _spread,
    _spread_text,
)
from detrl.apps.report.vocabulary import (
    _MISSING,
    IQM_REFERENCE,
    METRICS,
    NUMBERS_CSV,
    NUMBERS_JSON,
    REFERENCES,
    REMEDY_LABELS,
)
from detrl.formats.summary import (
    Interval,
    Remedies,
    Row,
    Summary,
)


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
