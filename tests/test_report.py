"""``detrl report``: hand-written summary.json files of both protocols become a Markdown report, PNGs,
numbers.csv and numbers.json; regenerating gives the same bytes; bad directories are one-line errors."""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest

from detrl.apps import report
from detrl.apps.report import markdown, vocabulary
from detrl.cli import main
from detrl.formats import summary as summary_format
from detrl.formats.summary import SummaryError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = [100, 200, 300, 400]


def _curve(runs: list[list[float | None]], label: str) -> dict[str, Any]:
    """A learning curve as summary.json holds it: mean, min and max over runs, None where none is recorded."""

    def over(f: Any) -> list[float | None]:
        cols = zip(*runs)
        return [None if any(v is None for v in col) else float(f(col)) for col in cols]

    return {"steps": list(STEPS), "mean": over(lambda c: sum(c) / len(c)), "lo": over(min), "hi": over(max),
            "runs": runs, "label": label}  # fmt: skip


def _distance(runs: list[list[float]]) -> dict[str, Any]:
    return {"steps": list(STEPS), "mean": [sum(c) / len(c) for c in zip(*runs)], "runs": runs}


def _rl_row(
    n: int, mean: float, sd: float | None, lo: float | None, hi: float | None, fd: list[int | None],
    l2: float, overrides: list[str], identical: bool = False, auc: float | None = 75.0,
) -> dict[str, Any]:  # fmt: skip
    diverged = sorted(d for d in fd if d is not None)
    offset = 0.0 if identical else 5.0
    returns = [[None, 10.0 + k * offset, 20.0 + k * offset, 30.0 + 2 * k * offset] for k in range(n)]
    distances = [[0.0, 0.0, 0.0, 0.0] if identical else [0.0, 1e-3 * (k + 1), 0.1, l2] for k in range(n)]
    return {
        "n": n, "identical": identical, "first_divergence": fd,
        "first_divergence_median": float(diverged[len(diverged) // 2]) if diverged else None,
        "l2_to_control": l2,
        "curve": _curve(returns, "training return (mean of last 10 episodes)"),
        "distance": _distance(distances),
        "overrides": [["precision=verifiable", *overrides] for _ in range(n)],
        "eval_mean": mean, "eval_sd": sd, "eval_best": mean if sd is None else mean + sd,
        "iqm": mean, "iqm_lo": lo, "iqm_hi": hi, "auc": auc,
    }  # fmt: skip


def rl_summary() -> dict[str, Any]:
    """Control, three sources (``replay`` with a single run), ``hardware`` under verifiable precision, all."""
    return {
        "protocol": "rl",
        "command": "detrl ablate configs/ablate/dqn_tiny.yaml --runs 3 --out runs/x",
        "config": "configs/ablate/dqn_tiny.yaml",
        "base": "configs/dqn/tiny.yaml",
        "machine": "Test CPU | 4 cores <b>bold</b>",
        "spec": {
            "runs": 3,
            "sources": ["init", "replay", "bitflip", "hardware"],
            "all": True,
            "set": ["precision=verifiable"],
        },
        "control_identical": True,
        "conditions": {
            "control": _rl_row(3, 30.0, 0.0, 30.0, 30.0, [None] * 3, 0.0, [], identical=True, auc=20.0),
            "init": _rl_row(3, 100.0, 10.0, 90.0, 110.0, [0, 0, 0], 2.5, ["sources.init.seed=1000"]),
            "replay": _rl_row(1, 95.0, None, None, None, [200], 1.25, ["sources.replay.seed=1000"], auc=None),
            "bitflip": _rl_row(3, 40.0, 5.0, 35.0, 45.0, [0, 0, None], 0.5, ["sources.bitflip=true"]),
            "hardware": _rl_row(
                3,
                30.0,
                0.0,
                30.0,
                30.0,
                [None] * 3,
                0.0,
                ["hardware=emulated:atomic"],
                identical=True,
                auc=20.0,
            ),
            "all": _rl_row(3, 60.0, 20.0, 40.0, 80.0, [0, 0, 0], 3.0, ["sources.init.seed=1000"]),
        },
        "instability": {"condition": "bitflip", "steps": [0, *STEPS], "l2": [0.0, 1e-7, 1e-5, 1e-3, 1e-1]},
        "remedies": None,
    }


def _metrics(acc_sd: float | None, scale: float = 1.0) -> dict[str, Any]:
    def m(v: float | None, width: float = 0.5) -> dict[str, float | None]:
        return {
            "value": v,
            "lo": None if v is None else v * (1 - width),
            "hi": None if v is None else v * (1 + width),
        }

    if acc_sd is None:  # one run: no spread is defined
        return {k: m(None) for k in vocabulary.METRICS}
    return {
        "accuracy_sd": m(acc_sd), "cross_entropy_sd": m(0.01 * scale), "disagreement": m(0.03 * scale, 1 / 3),
        "pearson": {"value": 1 - 0.05 * scale, "lo": 1 - 0.06 * scale, "hi": 1 - 0.04 * scale},
        "spearman": {"value": 1 - 0.06 * scale, "lo": 1 - 0.07 * scale, "hi": 1 - 0.05 * scale},
        "ensemble_gain_accuracy": m(0.006 * scale), "ensemble_gain_cross_entropy": m(0.02 * scale),
    }  # fmt: skip


def _sup_row(
    n: int, acc: float, metrics: dict[str, Any], identical: bool = False, **extra: Any
) -> dict[str, Any]:
    loss = [[2.0, 1.0 + 0.01 * k, 0.5, 0.25] for k in range(n)]
    return {
        "n": n, "identical": identical, "first_divergence": [None] * n if identical else [0] * n,
        "first_divergence_median": None if identical else 0.0, "l2_to_control": 0.0 if identical else 3.0,
        "curve": _curve(loss, "training loss"),
        "distance": _distance([[0.0] * 4 if identical else [1e-6, 1e-3, 0.5, 3.0] for _ in range(n)]),
        "overrides": [[] if identical else ["sources.init.seed=1000"] for _ in range(n)],
        "accuracy_mean": acc, "cross_entropy_mean": 0.3, "metrics": metrics, **extra,
    }  # fmt: skip


def supervised_summary() -> dict[str, Any]:
    """No bitflip (so no instability curve), a one-run ``dropout``, and snapshot ensembles as the remedy."""
    zero = {
        k: {"value": 1.0 if k in ("pearson", "spearman") else 0.0, "lo": None, "hi": None}
        for k in vocabulary.METRICS
    }
    return {
        "protocol": "supervised",
        "command": "detrl ablate configs/ablate/digits.yaml --runs 2",
        "config": "configs/ablate/digits.yaml",
        "base": "configs/supervised/digits_cnn.yaml",
        "machine": "Test CPU",
        "spec": {"runs": 2, "sources": ["init", "dropout"], "all": True},
        "control_identical": True,
        "conditions": {
            "control": _sup_row(2, 0.92, zero, identical=True),
            "init": _sup_row(2, 0.91, _metrics(0.004)),
            "dropout": _sup_row(1, 0.90, _metrics(None)),
            "all": _sup_row(2, 0.93, _metrics(0.005), tta=_metrics(0.0045, 0.9)),
            "all+snapshot": _sup_row(2, 0.94, _metrics(0.003, 0.6)),
        },
        "instability": None,
        "remedies": {
            "baseline": "all",
            "rows": {"single": _metrics(0.005), "snapshot": _metrics(0.003, 0.6)},
            "reduction": {"snapshot": {"accuracy_sd": 0.4, "disagreement": None, "pearson": -0.01}},
        },
    }


def _write(out: Path, summary: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    # Sorted keys, as ablation writes it (canonical JSON): the report must restore the sweep's order itself.
    (out / "summary.json").write_text(json.dumps(summary, sort_keys=True, indent=1))
    return out


@pytest.fixture(scope="module")
def rl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = _write(tmp_path_factory.mktemp("rl") / "sweep", rl_summary())
    assert report.write_report(out) == out / "report" / "report.md"
    return out


@pytest.fixture(scope="module")
def sup_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = _write(tmp_path_factory.mktemp("sup") / "sweep", supervised_summary())
    (out / "report").mkdir()
    (out / "report" / "instability.png").write_bytes(b"from an earlier sweep that had a bitflip condition")
    report.write_report(out)
    return out


def _md(out: Path) -> str:
    return (out / "report" / "report.md").read_text()


def _images(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def test_rl_report_has_the_table_rows_in_sweep_order(rl_dir):
    md = _md(rl_dir)
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    table = rows[-6:]  # the Results table comes after the Conditions table
    assert [r.split("`")[1] for r in table] == ["control", "init", "replay", "bitflip", "hardware", "all"]
    assert table[0] == "| `control` | 3 | 30.0 ± 0 | 30.0 | 30.0 [30.0, 30.0] | 20.0 | yes | never | 0 |"
    assert table[1] == "| `init` | 3 | 100.0 ± 10.0 | 110.0 | 100.0 [90.0, 110.0] | 75.0 | no | 0 | 2.5 |"
    assert (
        table[2] == "| `replay` | 1 | 95.0 ± – | 95.0 | 95.0 | – | no | 200 | 1.25 |"
    )  # n = 1: no SD, no CI
    assert table[3].endswith("| no | 0 (1 of 3 never) | 0.5 |")
    assert "`detrl ablate configs/ablate/dqn_tiny.yaml --runs 3 --out runs/x`" in md
    assert "`configs/dqn/tiny.yaml`" in md and "Nagarajan, Warnell & Stone" in md
    # The machine line is untrusted text: shown, not rendered (no table break, no HTML).
    assert "Test CPU \\| 4 cores \\<b\\>bold\\</b\\>" in md


def test_rl_report_findings(rl_dir):
    md = _md(rl_dir)
    assert "**The control is bitwise identical**" in md and "zero spread" in md.split("## Findings")[0]
    findings = md.split("## Findings")[1].split("## Conditions")[0]
    assert "Bitwise identical to the control (every run, at the end of training): `hardware`." in findings
    assert (
        "Largest spread of the final return: `all` (SD 20.00), then `init` (SD 10.00), then `bitflip`"
        in findings
    )
    assert (
        "Zero spread of the final return: `hardware`; every other varied source (`init` and `bitflip`)"
        in findings
    )
    assert "No spread is defined for `replay`" in findings
    assert "under verifiable precision is bitwise identical to the control: zero spread" in findings
    assert "0.25x (`bitflip`) to 0.50x (`init`)" in findings
    assert (
        "earliest at environment step 0 (`init`, `bitflip` and `all`), latest at environment step 200"
        in findings
    )
    assert "6.0 orders of magnitude" in findings
    assert "outside the 95% IQM interval of `init`, `bitflip` and `all`" in findings


def test_every_plot_is_a_png_linked_from_the_report(rl_dir):
    md = _md(rl_dir)
    images = _images(md)
    assert images == [f for f, _, _ in report.PLOTS] and "Not drawn" not in md
    for name in images:
        data = (rl_dir / "report" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
        assert b"matplotlib" not in data  # no Software tag naming a version


def _number_rows(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with (out / "report" / "numbers.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rows, json.loads((out / "report" / "numbers.json").read_text())


def test_numbers_csv_and_json_round_trip_the_summary(rl_dir):
    rows, doc = _number_rows(rl_dir)
    assert doc["protocol"] == "rl" and list(rows[0]) == doc["columns"] == list(report.NUMBER_COLUMNS)
    assert len(rows) == len(doc["rows"])
    for r, j in zip(rows, doc["rows"]):
        for col in ("table", "condition", "metric", "unit"):
            assert r[col] == j[col]
        for col in ("value", "lo", "hi"):
            assert (float(r[col]) if r[col] else None) == j[col]
    got = {(j["table"], j["condition"], j["metric"]): j for j in doc["rows"]}
    src = rl_summary()["conditions"]
    for cond, row in src.items():
        for metric in ("eval_mean", "eval_sd", "eval_best", "auc", "l2_to_control"):
            assert got["main", cond, metric]["value"] == row[metric]
        assert (got["main", cond, "iqm"]["lo"], got["main", cond, "iqm"]["hi"]) == (
            row["iqm_lo"],
            row["iqm_hi"],
        )
        assert got["main", cond, "identical"]["value"] == int(row["identical"])
    assert got["main", "bitflip", "runs_never_diverged"]["value"] == 1
    assert got["instability", "bitflip", "l2_first_positive"]["value"] == 1e-7
    assert got["instability", "bitflip", "l2_final"]["value"] == 0.1


def test_regenerating_gives_identical_bytes_and_the_cli_lists_the_files(rl_dir, capsys):
    folder = rl_dir / "report"
    before = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    assert main(["report", str(rl_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"report: {folder / 'report.md'}"
    assert sorted(Path(line.strip()).name for line in out[1:]) == sorted(before)
    assert {p.name: p.read_bytes() for p in sorted(folder.iterdir())} == before


def test_supervised_report(sup_dir):
    md = _md(sup_dir)
    assert "Summers & Dinneen" in md and "**The control is bitwise identical**" in md
    init = "| `init` | 2 | 91.00 | 0.40 [0.20, 0.60] | 0.0100 [0.0050, 0.0150] | 3.00 [2.00, 4.00] | 0.9500 |"
    assert f"{init} 0.9400 | 0.60 | 0.0200 |" in md
    assert "| `dropout` | 1 | 90.00 | – | – | – | – | – | – | – |" in md
    results = md.split("## Results")[1].split("### Bitwise identity")[0]
    rows = [line for line in results.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["control", "init", "dropout", "all", "all+snapshot"]
    assert "### Under test-time augmentation" in md
    remedies = md.split("## Remedies")[1].split("## Plots")[0]
    assert "| SD of accuracy (pp) | 0.50 [0.25, 0.75] | 0.30 [0.15, 0.45] | 40.0 % |" in remedies
    assert "| disagreement (%) | 3.00 [2.00, 4.00] | 1.80 [1.20, 2.40] | – |" in remedies
    assert "Remedy `snapshot` (snapshot ensembles) reduces the SD of accuracy by 40.0 %" in md
    assert "Every varied source with 2 or more runs has non-zero spread of test accuracy" in md
    assert "Not drawn: summary.json has no instability curve (the sweep has no bitflip condition)." in md
    images = _images(md)
    assert "instability.png" not in images and len(images) == 4
    for name in images:
        assert (sup_dir / "report" / name).read_bytes().startswith(PNG_SIGNATURE)
    assert not (sup_dir / "report" / "instability.png").exists()  # the earlier report's plot is gone
    _, doc = _number_rows(sup_dir)
    got = {(j["table"], j["condition"], j["metric"]): j for j in doc["rows"]}
    assert got["main", "init", "accuracy_sd"] == {
        "table": "main", "condition": "init", "metric": "accuracy_sd",
        "value": 0.004, "lo": 0.002, "hi": 0.006, "unit": "fraction",
    }  # fmt: skip
    assert got["main", "dropout", "disagreement"]["value"] is None
    assert got["reduction", "snapshot", "accuracy_sd"]["value"] == 0.4
    assert got["tta", "all", "accuracy_sd"]["value"] == 0.0045


def _findings_of(tmp_path: Path, summary: dict[str, Any]) -> str:
    s = report.load_summary(_write(tmp_path / "s", summary))
    return "\n".join(markdown._control_text(s) + markdown._findings(s))


def test_findings_say_when_the_control_or_hardware_is_not_identical(tmp_path):
    summary = rl_summary()
    summary["control_identical"] = False
    summary["conditions"]["control"]["identical"] = False
    summary["conditions"]["control"]["first_divergence"] = [None, 300, 300]
    hw = summary["conditions"]["hardware"]
    hw["identical"], hw["first_divergence"], hw["first_divergence_median"] = False, [100, 100, 200], 100.0
    text = _findings_of(tmp_path, summary)
    assert (
        "**The control is NOT bitwise identical**" in text and "median first divergence at step 300" in text
    )
    assert (
        "**`hardware` (accumulation orders of `emulated:atomic` drawn at random) is NOT bitwise identical"
        in text
    )
    for row in summary["conditions"].values():
        row["overrides"] = [
            [o.replace("precision=verifiable", "precision=fp32") for o in r] for r in row["overrides"]
        ]
    text = _findings_of(tmp_path / "fp32", summary)
    assert (
        "differs from the control under `fp32` precision (median first divergence at environment step 100"
        in text
    )


MALFORMED = {
    "not JSON": b"{not json",
    "truncated": json.dumps(rl_summary())[:-40].encode(),
    "NaN literal": b'{"protocol": "rl", "conditions": {"control": {"n": NaN}}}',
    "a list": b"[1, 2, 3]",
    "unknown protocol": json.dumps({**rl_summary(), "protocol": "unsupervised"}).encode(),
    "no control": json.dumps(
        {**rl_summary(), "conditions": {"init": rl_summary()["conditions"]["init"]}}
    ).encode(),
    "n a string": None,
    "bad condition name": None,
    "curve length": None,
    "too many conditions": None,
}


def _malformed(case: str) -> bytes:
    data = MALFORMED[case]
    if data is not None:
        return data
    s = rl_summary()
    if case == "n a string":
        s["conditions"]["init"]["n"] = "3"
    elif case == "bad condition name":
        s["conditions"]["a|b <x>"] = copy.deepcopy(s["conditions"]["init"])
    elif case == "curve length":
        s["conditions"]["init"]["curve"]["mean"].append(1.0)
    else:
        s["conditions"].update(
            {f"c{i}": s["conditions"]["init"] for i in range(summary_format.MAX_CONDITIONS)}
        )
    return json.dumps(s).encode()


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_summary_is_one_error_line(tmp_path, case):
    (tmp_path / "summary.json").write_bytes(_malformed(case))
    with pytest.raises(SummaryError) as exc:
        report.write_report(tmp_path)
    assert "\n" not in str(exc.value) and "summary.json" in str(exc.value)
    assert not (tmp_path / "report").exists()  # nothing written for bad input


def test_missing_linked_or_oversized_summary(tmp_path, monkeypatch):
    with pytest.raises(SummaryError, match="not a directory"):
        report.write_report(tmp_path / "nope")
    with pytest.raises(SummaryError, match="no summary.json"):
        report.write_report(tmp_path)
    real = _write(tmp_path / "real", rl_summary())
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "summary.json").symlink_to(real / "summary.json")
    with pytest.raises(SummaryError, match="symbolic link"):
        report.write_report(linked)
    monkeypatch.setattr(summary_format, "MAX_SUMMARY_BYTES", 1000)
    with pytest.raises(SummaryError, match="larger than the cap"):
        report.write_report(real)


def test_cli_bad_directory_is_exit_2_with_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("detrl: error:") and "no summary.json" in err
    (tmp_path / "summary.json").write_text('{"protocol": "rl"}')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "conditions: expected an object, not null" in err


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``, links not followed: name -> the file's bytes, a link's target, or "dir"."""
    got: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        got[rel] = f"-> {p.readlink()}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return got


@pytest.mark.parametrize(
    "plant",
    [
        "report_is_a_link",
        "report_md_is_a_link",
        "tmp_file_is_a_link",
        "stale_plot_is_a_link",
        "plot_is_a_dir",
    ],
)
def test_a_report_that_would_write_or_delete_through_a_link_is_refused_and_changes_nothing(
    tmp_path, capsys, plant
):
    # The sweep directory comes from another party: report/ (or a file in it) leading elsewhere is refused.
    summary = rl_summary()
    summary["instability"] = None  # instability.png is "not drawn": a stale one would be deleted
    out = _write(tmp_path / "sweep", summary)
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("report.md", "instability.png", "numbers.csv"):
        (victim / name).write_bytes(b"precious")
    dest = out / "report"
    if plant == "report_is_a_link":
        dest.symlink_to(victim)
    else:
        dest.mkdir()
        (dest / "numbers.csv").write_bytes(b"an earlier report's")
        if plant == "plot_is_a_dir":
            (dest / "metrics.png").mkdir()
        else:
            name = {"report_md_is_a_link": "report.md", "tmp_file_is_a_link": ".report.md.tmp"}.get(
                plant, "instability.png"
            )
            (dest / name).symlink_to(victim / name.strip(".").removesuffix(".tmp"))
    before, outside = _tree(out), _tree(victim)
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("detrl: error:") and "nothing was changed" in err, err
    assert ("not a regular file" if plant == "plot_is_a_dir" else "is a symbolic link") in err
    assert _tree(out) == before and _tree(victim) == outside
