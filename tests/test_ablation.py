"""``detrl ablate``: the control is bitwise identical, every varied source moves the run, the hardware source
has zero spread in verifiable precision, a sweep resumes, and neither the number of workers nor the executor
(local pool or Ray) changes a number."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from detrl.apps import ablation
from detrl.cli import main

# 1,000 env steps: the first updates run from step 202; 128 inputs to the second layer give emulated:atomic
# a reduction long enough to reorder.
RL_SET = [
    "precision=fp32",
    "train.steps=1000",
    "agent.learning_starts=200",
    "agent.train_frequency=2",
    "agent.learning_rate=2.5e-3",
    "eval.episodes=3",
    "agent.hidden=[128, 64]",
]
# 40 steps of the digits CNN with a held-out test set, crops and dropout.
SUPERVISED_SET = [
    "precision=fp32",
    "data.holdout=360",
    "data.augment=crop",
    "model.channels=8",
    "model.dropout=0.2",
    "train.steps=40",
    "verify.checkpoint_every=0",
]


def rl_spec(sources: list[str], all_: bool = True, runs: int = 2, **kw: object) -> ablation.AblationConfig:
    return ablation.AblationConfig(
        base="configs/dqn/tiny.yaml",
        set=RL_SET,
        runs=runs,
        sources=sources,
        all=all_,
        curve_every=100,
        resamples=500,
        **kw,
    )


def supervised_spec(sources: list[str], runs: int = 2, **kw: object) -> ablation.AblationConfig:
    return ablation.AblationConfig(
        base="configs/supervised/digits_cnn.yaml",
        set=SUPERVISED_SET,
        runs=runs,
        sources=sources,
        curve_every=10,
        resamples=500,
        **kw,
    )


def spread(row: dict) -> float:
    """How far a condition's runs are apart: the widest band of the learning curve plus the L2 spread of the
    parameter distance to the control at the end (zero exactly when the runs are bitwise identical)."""
    band = max((hi - lo) for lo, hi in zip(row["curve"]["lo"], row["curve"]["hi"]) if lo is not None)
    finals = [d[-1] for d in row["distance"]["runs"]]
    return band + (max(finals) - min(finals))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[ablation.AblationConfig, Path, dict]:
    s = rl_spec(["init", "explore"])
    out = tmp_path_factory.mktemp("ablate") / "sweep"
    counts = ablation.run_sweep(s, out, workers=2, progress=False)
    assert counts == {"done": 8, "skipped": 0}
    summary = ablation.summarise(out)
    ablation.write_summary(out, summary)
    return s, out, summary


def test_control_is_identical_and_every_source_moves(sweep: tuple) -> None:
    s, out, summary = sweep
    assert summary["protocol"] == "rl" and summary["control_identical"] is True
    rows = summary["conditions"]
    assert list(rows) == ["control", "init", "explore", "all"]
    control = rows["control"]
    assert control["n"] == 2 and control["eval_sd"] == 0.0 and control["identical"] is True
    assert control["iqm_lo"] == control["iqm_hi"] == control["iqm"] and spread(control) == 0.0
    assert control["first_divergence"] == [None, None] and control["l2_to_control"] == 0.0
    assert control["distance"]["mean"] == [0.0] * 11
    results = [
        json.loads((ablation.run_dir(out, "control", k) / "result.json").read_text()) for k in range(2)
    ]
    assert results[0]["merkle_root"] == results[1]["merkle_root"]
    ref = results[0]["params_sha256"]
    for cond in ("init", "explore", "all"):
        row = rows[cond]
        assert row["identical"] is False and row["identical_within"] is False and spread(row) > 0
        assert row["l2_to_control"] > 0 and row["distance"]["steps"] == list(range(0, 1001, 100))
        for k in range(2):  # run 0 varies too: no run of a varied condition is the control
            r = json.loads((ablation.run_dir(out, cond, k) / "result.json").read_text())
            assert r["params_sha256"] != ref and r["overrides"][: len(RL_SET)] == RL_SET
    # init moves the weights before the first step; explore only from the first update (step 202).
    assert rows["init"]["first_divergence"] == [0, 0]
    assert all(202 <= d <= 1000 for d in rows["explore"]["first_divergence"])
    first = json.loads((ablation.run_dir(out, "explore", 1) / "result.json").read_text())
    assert first["overrides"][-1] == "sources.explore.seed=1001"
    assert first["episode_end_steps"][-1] <= 1000 and len(first["curve"]) == len(first["curve_steps"]) == 10
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("condition,n,eval_mean")
    assert list((ablation.run_dir(out, "init", 0) / "tb").iterdir())  # TensorBoard scalars per run


@pytest.mark.slow
def test_hardware_bitflip_and_hardware_in_verifiable_precision(tmp_path: Path) -> None:
    s = rl_spec(["hardware", "bitflip"], all_=False, runs=2, verifiable_hardware=True)
    assert ablation.source_overrides("bitflip", 3) == [
        "sources.bitflip=true",
        "sources.streams.bitflip.seed=1003",
    ]
    assert ablation.source_overrides("hardware", 3) == ["hardware=emulated:atomic", "hardware_seed=1003"]
    assert ablation.run_sweep(s, tmp_path, workers=2, progress=False) == {"done": 8, "skipped": 0}
    summary = ablation.summarise(tmp_path)
    rows = summary["conditions"]
    assert rows["control"]["identical"] is True
    for cond in ("hardware", "bitflip"):
        assert rows[cond]["identical"] is False and rows[cond]["identical_within"] is False
    assert rows["bitflip"]["first_divergence"] == [0, 0]  # one ulp of a first-layer weight, from the start
    # The same accumulation orders in verifiable precision: every run bitwise the same, zero spread.
    verifiable = rows[ablation.HARDWARE_VERIFIABLE]
    assert (
        verifiable["identical_within"] is True and verifiable["eval_sd"] == 0.0 and spread(verifiable) == 0.0
    )
    assert summary["instability"]["condition"] == "bitflip" and summary["instability"]["l2"][0] > 0


@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_interrupted_sweep_redoes_only_what_is_missing(sweep: tuple, tmp_path: Path) -> None:
    s, out, _ = sweep
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (ablation.run_dir(copy, "explore", 1) / "result.json").unlink()  # killed before it finished
    jobs = ablation.jobs(s)
    assert ablation.run_sweep(s, copy, workers=1, progress=False, only=jobs[:3]) == {"done": 0, "skipped": 3}
    assert ablation.run_sweep(s, copy, workers=1, progress=False) == {"done": 1, "skipped": 7}
    assert ablation.run_sweep(s, copy, workers=1, progress=False) == {"done": 0, "skipped": 8}
    ablation.write_summary(copy, ablation.summarise(copy))
    assert (copy / "summary.json").read_bytes() == (out / "summary.json").read_bytes()
    with pytest.raises(ablation.ConfigError, match="different ablation sweep"):
        ablation.run_sweep(rl_spec(["init"]), copy, workers=1, progress=False)


@pytest.mark.slow  # a second 8-run sweep (19 s); the fast suite keeps the interrupted-sweep case
def test_workers_do_not_change_the_summary(sweep: tuple, tmp_path: Path) -> None:
    s, out, _ = sweep
    assert ablation.run_sweep(s, tmp_path, workers=1, progress=False) == {"done": 8, "skipped": 0}
    ablation.write_summary(tmp_path, ablation.summarise(tmp_path))
    assert (tmp_path / "summary.json").read_bytes() == (out / "summary.json").read_bytes()


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> tuple[ablation.AblationConfig, Path, dict]:
    s = supervised_spec(
        ["init", "bitflip", "hardware"], verifiable_hardware=True, remedies=["snapshot", "tta"]
    )
    s = s.model_copy(update={"snapshot_cycles": 2})
    out = tmp_path_factory.mktemp("ablate") / "supervised"
    assert ablation.run_sweep(s, out, workers=2, progress=False) == {"done": 14, "skipped": 0}
    summary = ablation.summarise(out)
    ablation.write_summary(out, summary)
    return s, out, summary


@pytest.mark.slow  # a 14-run sweep (26 s); the fast suite keeps the tiny supervised sweep
def test_supervised_protocol(supervised: tuple) -> None:
    s, out, summary = supervised
    assert summary["protocol"] == "supervised" and summary["control_identical"] is True
    rows = summary["conditions"]
    assert list(rows) == [
        "control",
        "init",
        "bitflip",
        "hardware",
        "all",
        "hardware@verifiable",
        "all+snapshot",
    ]
    control = rows["control"]["metrics"]
    assert control["accuracy_sd"]["value"] == 0.0 and control["disagreement"]["value"] == 0.0
    assert control["pearson"]["value"] == 1.0 and control["ensemble_gain_accuracy"]["value"] == 0.0
    assert rows["control"]["accuracy_mean"] > 0.5  # 40 steps on digits learn something
    for cond in ("init", "bitflip", "hardware", "all", "all+snapshot"):
        assert (
            rows[cond]["identical_within"] is False and rows[cond]["metrics"]["cross_entropy_sd"]["value"] > 0
        )
    assert rows["init"]["metrics"]["disagreement"]["value"] > 0
    m = rows["init"]["metrics"]["disagreement"]
    assert m["lo"] <= m["value"] <= m["hi"]
    # fp32 hardware orders move the model; in verifiable precision the same orders move nothing.
    verifiable = rows["hardware@verifiable"]
    assert verifiable["identical_within"] is True and verifiable["metrics"]["accuracy_sd"]["value"] == 0.0
    # The test set and its logits: the same 360 examples for every run.
    z = np.load(ablation.run_dir(out, "all+snapshot", 1) / "logits.npz")
    assert (
        z["test"].shape == (360, 10) and z["snapshots"].shape == (2, 360, 10) and z["tta"].shape == (360, 10)
    )
    ctrl = np.load(ablation.run_dir(out, "control", 0) / "logits.npz")
    assert np.array_equal(z["labels"], ctrl["labels"])
    # Instability: control vs its one-ulp twin, from one ulp at step 0 to more later.
    inst = summary["instability"]
    assert (
        inst["steps"] == [0, 10, 20, 30, 40] and 0 < inst["l2"][0] < 1e-6 and inst["l2"][-1] > inst["l2"][0]
    )
    rem = summary["remedies"]
    assert rem["baseline"] == "all" and set(rem["rows"]) == {"single", "snapshot", "tta"}
    assert set(rem["reduction"]) == {"snapshot", "tta"}
    assert (
        rem["rows"]["snapshot"] == rows["all+snapshot"]["metrics"]
        and rem["rows"]["tta"] == rows["all"]["tta"]
    )
    assert "accuracy_sd" in (out / "summary.csv").read_text().splitlines()[0]


@pytest.mark.parametrize("protocol", ["rl", "supervised"])
def test_a_tiny_sweep_of_each_protocol_makes_the_report(
    protocol: str, sweep: tuple, supervised: tuple, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, summary = sweep if protocol == "rl" else supervised
    assert main(["report", str(out)]) == 0
    md = (out / "report" / "report.md").read_text()
    assert "**The control is bitwise identical**" in md
    for cond in summary["conditions"]:
        assert f"| `{cond}` |" in md
    pngs = ["learning_curves.png", "metrics.png", "divergence.png", "distance.png"]
    if protocol == "supervised":
        pngs.append("instability.png")
        assert "all 2 runs are bitwise identical to each other" in md  # hardware@verifiable
        assert "## Remedies" in md
    for name in pngs:
        assert f"]({name})" in md
        assert (out / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    numbers = json.loads((out / "report" / "numbers.json").read_text())
    assert numbers and (out / "report" / "numbers.csv").is_file()


@pytest.mark.slow  # starting Ray takes ~10 s of the 2 cores
def test_local_pool_and_ray_give_the_same_files(supervised: tuple, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    s, out, _ = supervised
    assert ablation.run_sweep(s, tmp_path, workers=2, progress=False, ray="local") == {
        "done": 14,
        "skipped": 0,
    }
    ablation.write_summary(tmp_path, ablation.summarise(tmp_path))
    for name in ("summary.json", "summary.csv"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()
    for cond, k in ablation.jobs(s):
        for name in ("result.json", "params.npz", "logits.npz"):
            assert (ablation.run_dir(tmp_path, cond, k) / name).read_bytes() == (
                ablation.run_dir(out, cond, k) / name
            ).read_bytes(), f"{cond}/{k}/{name}"


@pytest.mark.slow
def test_a_killed_sweep_reruns_only_what_was_missing(tmp_path: Path) -> None:
    cfg = tmp_path / "ab.yaml"
    cfg.write_text(
        "base: configs/supervised/digits_cnn.yaml\n"
        f"set: {json.dumps(SUPERVISED_SET[:-2] + ['train.steps=200', 'verify.checkpoint_every=0'])}\n"
        "runs: 3\nsources: [init, dropout]\ncurve_every: 50\nresamples: 200\n"
    )
    out = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "detrl.cli",
        "ablate",
        str(cfg),
        "--out",
        str(out),
        "--workers",
        "1",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(out.glob("runs/*/*/result.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its worker, mid-sweep
    proc.wait()
    finished = len(list(out.glob("runs/*/*/result.json")))
    assert 2 <= finished < 12
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"ran {12 - finished} runs, skipped {finished} already finished" in done.stdout
    assert len(list(out.glob("runs/*/*/result.json"))) == 12


def test_unknown_source_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "ab.yaml"
    cfg.write_text("base: configs/dqn/tiny.yaml\nruns: 1\nsources: [init]\n")
    assert main(["ablate", str(cfg), "--sources", "init,weather", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown source 'weather'" in err
    cfg.write_text("base: configs/dqn/tiny.yaml\nsources: [init, weather]\n")
    assert main(["ablate", str(cfg), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown source 'weather'" in err
    cfg.write_text("base: configs/dqn/tiny.yaml\nremedies: [tta]\n")
    assert main(["ablate", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "only the supervised protocol has remedies" in capsys.readouterr().err
    cfg.write_text("base: configs/supervised/digits_cnn.yaml\nsources: [init]\n")
    assert main(["ablate", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "needs data.holdout" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any run


def test_a_runs_tensorboard_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    """A run's ``tb/`` that links out of the sweep is refused in one line before the run is touched: no
    event file is written through it, and the run's folder holds only the link."""
    from detrl.run import config as config_mod

    spec = rl_spec(["init"], runs=1)
    where = ablation.run_dir(tmp_path / "sweep", "control", 0)
    where.mkdir(parents=True)
    (where / "result.json").write_text("{}")  # a stale result, which a run that starts removes
    outside = tmp_path / "outside"
    outside.mkdir()
    (where / "tb").symlink_to(outside)
    raw = json.dumps(config_mod.read_raw(spec.base))
    with pytest.raises(config_mod.ConfigError, match=r"tb: is a symbolic link; .* \(remove it\)$"):
        ablation.run_one(spec.model_dump_json(), raw, str(tmp_path / "sweep"), "control", 0)
    assert list(outside.iterdir()) == [] and sorted(p.name for p in where.iterdir()) == ["result.json", "tb"]


def test_default_sources_follow_the_protocol(tmp_path: Path) -> None:
    cfg = tmp_path / "ab.yaml"
    cfg.write_text("base: configs/supervised/digits_cnn.yaml\nset: [data.holdout=100]\n")
    assert ablation.load_spec(cfg).sources == ablation.SUPERVISED_SOURCES
    cfg.write_text("base: configs/dqn/tiny.yaml\n")
    assert ablation.load_spec(cfg).sources == ablation.RL_SOURCES


def test_shipped_ablation_configs_validate() -> None:
    for name in ("dqn_tiny", "dqn_cartpole", "digits_tiny", "digits"):
        spec = ablation.load_spec(f"configs/ablate/{name}.yaml")
        assert "control" in ablation.conditions(spec)
