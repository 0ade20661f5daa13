"""``summary.json``: what an ablation sweep (``detrl ablate``) summarises, written by the sweep and read by
``detrl report``. One home for its name, its bounds, its writer and its validating reader.

The file is treated as untrusted: read without following a link, at most :data:`MAX_SUMMARY_BYTES`, strict
JSON, every field type-checked and size-bounded; any defect is one :class:`SummaryError` line. Non-finite
numbers are written as null.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detrl.formats import safeio

SUMMARY = "summary.json"
#: Largest summary.json read (bytes): a sweep of 64 conditions x 1000 runs x 1000 curve points fits.
MAX_SUMMARY_BYTES = 64 << 20
MAX_CONDITIONS = 64
#: Most runs per condition, and most points per curve.
MAX_RUNS = 1000
MAX_POINTS = 100_000
#: Longest free-text field kept (characters); longer ones are cut with an ellipsis.
MAX_TEXT = 1000
MAX_OVERRIDES = 200
#: Largest magnitude of a number read: far above any return, loss or L2 distance (FP32 tops out at 3.4e38),
#: and far enough below float64's limit that axis arithmetic in the plots cannot overflow.
MAX_MAGNITUDE = 1e100
#: Condition and metric names: they appear in Markdown and plot text, so nothing that could format there.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+:@-]{0,63}\Z")
RL_SCALARS = ("eval_mean", "eval_sd", "eval_best", "iqm", "iqm_lo", "iqm_hi", "auc")
SUPERVISED_SCALARS = ("accuracy_mean", "cross_entropy_mean")


class SummaryError(ValueError):
    """A ``summary.json`` is missing or malformed (one line naming the field)."""


def finite(x: Any) -> Any:
    """JSON-safe: NaN and infinities become None (recursively)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write(out: str | Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` as ``OUT/summary.json``: canonical JSON (sorted keys), NaN and infinities as null,
    replaced atomically."""
    safeio.write_atomic(Path(out), SUMMARY, safeio.dumps_json(finite(summary)))


@dataclass(frozen=True)
class Interval:
    """A value with an optional interval (``None``: not defined, e.g. a spread of one run)."""

    value: float | None
    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True)
class Series:
    """A quantity over training steps. Arrays are float64 with NaN where the summary has null."""

    steps: np.ndarray  # (points,) training steps (env steps for RL, optimizer steps for supervised)
    mean: np.ndarray  # (points,)
    lo: np.ndarray | None  # (points,) min over runs, or None
    hi: np.ndarray | None  # (points,) max over runs, or None
    runs: tuple[np.ndarray, ...]  # one (points,) array per run
    label: str


@dataclass(frozen=True)
class Row:
    """One condition of the sweep (see the module docstring of :mod:`detrl.apps.ablation` for its meaning)."""

    name: str
    n: int
    identical: bool
    first_divergence: tuple[int | None, ...]
    first_divergence_median: float | None
    l2_to_control: float | None
    curve: Series | None
    distance: Series | None
    overrides: tuple[tuple[str, ...], ...]
    scalars: dict[str, float | None]  # RL: eval_mean ... auc; supervised: accuracy_mean, cross_entropy_mean
    metrics: dict[str, Interval] = field(default_factory=dict)  # supervised diversity metrics
    tta: dict[str, Interval] = field(default_factory=dict)  # the same, under test-time augmentation
    identical_within: bool | None = None  # every run bitwise equal to the condition's own run 0: zero spread


@dataclass(frozen=True)
class Instability:
    """L2 parameter distance between control run 0 and its one-bit twin over training steps."""

    condition: str
    steps: np.ndarray
    l2: np.ndarray


@dataclass(frozen=True)
class Remedies:
    """Single models of ``baseline`` against the remedies (snapshot ensembles, test-time augmentation)."""

    baseline: str
    rows: dict[str, dict[str, Interval]]  # "single", "snapshot", "tta" -> metrics
    reduction: dict[str, dict[str, float | None]]  # remedy -> metric -> (single - remedy) / single


@dataclass(frozen=True)
class Summary:
    """A validated ``summary.json``, conditions in sweep order (control, sources, all, remedies)."""

    protocol: str  # "rl" | "supervised"
    command: str | None
    config: str | None
    base: str | None
    machine: str | None
    spec: dict[str, Any]
    control_identical: bool | None
    rows: dict[str, Row]
    sources: tuple[str, ...]  # the conditions that vary one source each
    spec_set: tuple[str, ...]  # the overrides every run shares
    instability: Instability | None
    remedies: Remedies | None

    @property
    def unit(self) -> str:
        """The x axis of every curve."""
        return "environment step" if self.protocol == "rl" else "optimizer step"


class _Malformed(Exception):
    """A field of summary.json is of the wrong type or size; the message names the field."""


def _obj(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise _Malformed(f"{where}: expected an object, not {safeio.json_kind(x)}")
    return x


def _list(x: Any, where: str, cap: int) -> list[Any]:
    if not isinstance(x, list):
        raise _Malformed(f"{where}: expected a list, not {safeio.json_kind(x)}")
    if len(x) > cap:
        raise _Malformed(f"{where}: {len(x)} entries, more than the cap of {cap}")
    return x


def _real(x: Any, where: str) -> float | None:
    """A finite float, or None for null (loads_json already refused NaN, Infinity and overflow)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _Malformed(f"{where}: expected a number or null, not {safeio.json_kind(x)}")
    v = float(x)
    if not math.isfinite(v) or abs(v) > MAX_MAGNITUDE:
        raise _Malformed(f"{where}: {v:.3g} is beyond the plausible magnitude {MAX_MAGNITUDE:.0e}")
    return v


def _count(x: Any, where: str) -> int:
    """A non-negative integer below 2**62 (steps, run counts)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise _Malformed(f"{where}: expected a non-negative integer, not {safeio.json_kind(x)}")
    if not 0 <= x < 1 << 62:
        raise _Malformed(f"{where}: expected a non-negative integer below 2**62, not {x:.3g}")
    return x


def _count_or_none(x: Any, where: str) -> int | None:
    return None if x is None else _count(x, where)


def _bool(x: Any, where: str) -> bool:
    if not isinstance(x, bool):
        raise _Malformed(f"{where}: expected true or false, not {safeio.json_kind(x)}")
    return x


def _text(x: Any, where: str, cap: int = MAX_TEXT) -> str | None:
    """One line of text: control and format characters dropped, whitespace collapsed, at most ``cap``."""
    if x is None:
        return None
    if not isinstance(x, str):
        raise _Malformed(f"{where}: expected a string, not {safeio.json_kind(x)}")
    if len(x) > 100 * cap:
        raise _Malformed(f"{where}: a string of {len(x)} characters, more than the cap of {100 * cap}")
    # Control characters could end a Markdown line or hide text (bidirectional overrides are category Cf).
    s = " ".join("".join(c for c in x if not unicodedata.category(c).startswith("C") or c in "\t\n").split())
    return s if len(s) <= cap else s[: cap - 1] + "…"


def _name(x: Any, where: str) -> str:
    if not isinstance(x, str) or not _NAME.match(x):
        raise _Malformed(f"{where}: {x!r:.80} is not a condition or metric name (letters, digits, _.+:@-)")
    return x


def _array(x: Any, where: str, n: int | None) -> np.ndarray:
    """A list of numbers and nulls as float64 (null -> NaN), of length ``n`` when given."""
    xs = _list(x, where, MAX_POINTS)
    if n is not None and len(xs) != n:
        raise _Malformed(f"{where}: {len(xs)} points, but steps has {n}")
    values = [_real(v, f"{where}[{i}]") for i, v in enumerate(xs)]
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)


def _steps(x: Any, where: str) -> np.ndarray:
    xs = _list(x, where, MAX_POINTS)
    return np.array([_count(v, f"{where}[{i}]") for i, v in enumerate(xs)], dtype=np.float64)


def _series(x: Any, where: str, default_label: str) -> Series | None:
    if x is None:
        return None
    d = _obj(x, where)
    steps = _steps(d.get("steps"), f"{where}.steps")
    n = len(steps)
    band = {k: _array(d[k], f"{where}.{k}", n) if d.get(k) is not None else None for k in ("lo", "hi")}
    runs = tuple(
        _array(r, f"{where}.runs[{i}]", n)
        for i, r in enumerate(_list(d.get("runs", []), f"{where}.runs", MAX_RUNS))
    )
    label = _text(d.get("label"), f"{where}.label", 200) or default_label
    return Series(steps, _array(d.get("mean"), f"{where}.mean", n), band["lo"], band["hi"], runs, label)


def _metrics(x: Any, where: str) -> dict[str, Interval]:
    if x is None:
        return {}
    d = _obj(x, where)
    if len(d) > 64:
        raise _Malformed(f"{where}: {len(d)} metrics, more than the cap of 64")
    out: dict[str, Interval] = {}
    for k, v in d.items():
        name = _name(k, f"{where} key")
        if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):  # a bare value: no interval
            out[name] = Interval(_real(v, f"{where}.{name}"))
            continue
        m = _obj(v, f"{where}.{name}")
        out[name] = Interval(*(_real(m.get(f), f"{where}.{name}.{f}") for f in ("value", "lo", "hi")))
    return out


def _row(name: str, x: Any, protocol: str) -> Row:
    where = f"conditions.{name}"
    d = _obj(x, where)
    n = _count(d.get("n"), f"{where}.n")
    if n > MAX_RUNS:
        raise _Malformed(f"{where}.n: {n} runs, more than the cap of {MAX_RUNS}")
    identical = _bool(d.get("identical"), f"{where}.identical")
    fd = _list(d.get("first_divergence", []), f"{where}.first_divergence", MAX_RUNS)
    overrides = tuple(
        tuple(
            _text(o, f"{where}.overrides[{i}][{j}]", 300) or ""
            for j, o in enumerate(_list(r, f"{where}.overrides[{i}]", MAX_OVERRIDES))
        )
        for i, r in enumerate(_list(d.get("overrides", []), f"{where}.overrides", MAX_RUNS))
    )
    default_label = "training return" if protocol == "rl" else "training loss"
    keys = RL_SCALARS if protocol == "rl" else SUPERVISED_SCALARS
    return Row(
        name=name,
        n=n,
        identical=identical,
        first_divergence=tuple(_count_or_none(v, f"{where}.first_divergence[{i}]") for i, v in enumerate(fd)),
        first_divergence_median=_real(d.get("first_divergence_median"), f"{where}.first_divergence_median"),
        l2_to_control=_real(d.get("l2_to_control"), f"{where}.l2_to_control"),
        curve=_series(d.get("curve"), f"{where}.curve", default_label),
        distance=_series(d.get("distance"), f"{where}.distance", "L2 to control run 0"),
        overrides=overrides,
        scalars={k: _real(d.get(k), f"{where}.{k}") for k in keys},
        metrics=_metrics(d.get("metrics"), f"{where}.metrics") if protocol == "supervised" else {},
        tta=_metrics(d.get("tta"), f"{where}.tta") if protocol == "supervised" else {},
        identical_within=(
            None
            if d.get("identical_within") is None
            else _bool(d["identical_within"], f"{where}.identical_within")
        ),
    )


def _order(names: Sequence[str], sources: Sequence[str]) -> list[str]:
    """Sweep order: control, the sources in the spec's order, all, then the rest as found.

    summary.json is canonical JSON with sorted keys, so the file's own order is alphabetical: the spec
    restores the order the sweep ran in.
    """
    first = ["control", *sources, "all"]
    return [c for c in first if c in names] + [c for c in names if c not in first]


def _parse(raw: Any) -> Summary:
    top = _obj(raw, "top level")
    protocol = top.get("protocol")
    if protocol not in ("rl", "supervised"):
        raise _Malformed(f'protocol: expected "rl" or "supervised", not {protocol!r:.40}')
    spec = _obj(top.get("spec") or {}, "spec")
    spec_sources = [
        _name(s, f"spec.sources[{i}]")
        for i, s in enumerate(_list(spec.get("sources", []), "spec.sources", MAX_CONDITIONS))
    ]
    spec_set = tuple(
        _text(s, f"spec.set[{i}]", 300) or ""
        for i, s in enumerate(_list(spec.get("set", []), "spec.set", MAX_OVERRIDES))
    )
    conds = _obj(top.get("conditions"), "conditions")
    if len(conds) > MAX_CONDITIONS:
        raise _Malformed(f"conditions: {len(conds)} conditions, more than the cap of {MAX_CONDITIONS}")
    for k in conds:
        _name(k, "conditions key")
    if "control" not in conds:
        raise _Malformed("conditions: no control condition (the reference every other row is compared to)")
    # Without the spec's list, a source is any condition that is neither the control, nor all, nor a remedy.
    sources = [s for s in spec_sources if s in conds] or [
        c for c in conds if c not in ("control", "all") and "+" not in c
    ]
    rows = {c: _row(c, conds[c], protocol) for c in _order(list(conds), sources)}

    inst = None
    if top.get("instability") is not None:
        d = _obj(top["instability"], "instability")
        steps = _steps(d.get("steps"), "instability.steps")
        inst = Instability(
            _name(d.get("condition", "bitflip"), "instability.condition"),
            steps,
            _array(d.get("l2"), "instability.l2", len(steps)),
        )

    remedies = None
    if protocol == "supervised" and top.get("remedies") is not None:
        d = _obj(top["remedies"], "remedies")
        rem_rows = _obj(d.get("rows") or {}, "remedies.rows")
        red = _obj(d.get("reduction") or {}, "remedies.reduction")
        if len(rem_rows) > 16 or len(red) > 16:
            raise _Malformed("remedies: more than 16 remedies")
        order = ["single", "snapshot", "tta"]
        keys = [k for k in order if k in rem_rows] + sorted(k for k in rem_rows if k not in order)
        remedies = Remedies(
            baseline=_name(d.get("baseline", "all"), "remedies.baseline"),
            rows={_name(k, "remedies.rows key"): _metrics(rem_rows[k], f"remedies.rows.{k}") for k in keys},
            reduction={
                _name(k, "remedies.reduction key"): {
                    m: i.value for m, i in _metrics(red[k], f"remedies.reduction.{k}").items()
                }
                for k in [k for k in order if k in red] + sorted(k for k in red if k not in order)
            },
        )
    ci = top.get("control_identical")
    return Summary(
        protocol=protocol,
        command=_text(top.get("command"), "command"),
        config=_text(top.get("config"), "config"),
        base=_text(top.get("base"), "base"),
        machine=_text(top.get("machine"), "machine"),
        spec=spec,
        control_identical=None if ci is None else _bool(ci, "control_identical"),
        rows=rows,
        sources=tuple(sources),
        spec_set=spec_set,
        instability=inst,
        remedies=remedies,
    )


def load_summary(out: str | Path) -> Summary:
    """Read and validate ``out/summary.json``; any defect is one :class:`SummaryError` line."""
    out = Path(out)
    if not out.is_dir():
        raise SummaryError(f"{out}: not a directory (give the --out directory of a `detrl ablate` sweep)")
    path = out / SUMMARY
    if not path.exists() and not path.is_symlink():
        raise SummaryError(
            f"{out}: no {SUMMARY}: not an ablation sweep, or its `detrl ablate` has not finished"
        )
    try:
        data = safeio.read_file(out, SUMMARY, MAX_SUMMARY_BYTES)
        raw = safeio.loads_json(data, SUMMARY, max_depth=16)
    except ValueError as e:  # safeio.UnsafeInput: a link, not a regular file, too large, not JSON
        raise SummaryError(f"{out}: {str(e).splitlines()[0] if str(e) else 'unreadable'}") from None
    try:
        return _parse(raw)
    except _Malformed as e:
        raise SummaryError(f"{path}: malformed: {' '.join(str(e).split())[:300]}") from None
