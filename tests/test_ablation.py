"""``detrl ablate``: the control is bitwise identical, every varied source moves the run, a sweep resumes, and
the number of workers changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from detrl import ablation
from detrl.cli import main

# 600 env steps: the first updates run from step 210; 128 inputs to the second layer give emulated:atomic
# a reduction long enough to reorder.
SET = [
    "precision=fp32",
    "train.steps=600",
    "agent.learning_starts=200",
    "eval.episodes=2",
    "agent.hidden=[128, 64]",
]


def spec(sources: list[str], all_: bool = True, runs: int = 2) -> ablation.AblationConfig:
    return ablation.AblationConfig(
        base="configs/dqn/tiny.yaml", set=SET, runs=runs, sources=sources, all=all_, curve_every=50
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[ablation.AblationConfig, Path, dict]:
    s = spec(["init", "explore"])
    out = tmp_path_factory.mktemp("ablate") / "sweep"
    counts = ablation.run_sweep(s, out, workers=2, progress=False)
    assert counts == {"done": 8, "skipped": 0}
    summary = ablation.summarise(out)
    ablation.write_summary(out, summary)
    return s, out, summary


def test_control_is_identical_and_every_source_moves(sweep: tuple) -> None:
    s, out, summary = sweep
    rows = summary["conditions"]
    assert list(rows) == ["control", "init", "explore", "all"]
    control = rows["control"]
    assert control["n"] == 2 and control["eval_sd"] == 0.0 and control["identical"] is True
    assert control["iqm_lo"] == control["iqm_hi"] == control["iqm"]
    assert control["first_divergence"] == [None, None] and control["l2_to_control"] == 0.0
    results = [
        json.loads((ablation.run_dir(out, "control", k) / "result.json").read_text()) for k in range(2)
    ]
    assert results[0]["merkle_root"] == results[1]["merkle_root"]
    ref = results[0]["params_sha256"]
    for cond in ("init", "explore", "all"):
        assert rows[cond]["identical"] is False
        for k in range(2):  # run 0 varies too: no run of a varied condition is the control
            r = json.loads((ablation.run_dir(out, cond, k) / "result.json").read_text())
            assert r["params_sha256"] != ref and r["overrides"][: len(SET)] == SET
        assert rows[cond]["l2_to_control"] > 0
    first = json.loads((ablation.run_dir(out, "explore", 1) / "result.json").read_text())
    assert first["overrides"][-1] == "sources.explore.seed=1001"
    assert first["episode_end_steps"][-1] <= 600 and len(first["curve"]) == len(first["curve_steps"]) == 12
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("condition,n,eval_mean")


def test_hardware_and_bitflip_move_the_run(tmp_path: Path) -> None:
    # Bitflip seed 1000 moves a weight of the *target* network, which the hard target copy at step 100
    # overwrites before any update: that run equals the control. Seed 1001 moves an online weight.
    s = spec(["hardware", "bitflip"], all_=False, runs=2)
    assert ablation.source_overrides("bitflip", 3) == [
        "sources.bitflip=true",
        "sources.streams.bitflip.seed=1003",
    ]
    assert ablation.run_sweep(s, tmp_path, workers=2, progress=False) == {"done": 6, "skipped": 0}
    rows = ablation.summarise(tmp_path)["conditions"]
    assert rows["control"]["identical"] is True
    assert rows["hardware"]["identical"] is False and rows["bitflip"]["identical"] is False


def test_interrupted_sweep_redoes_only_what_is_missing(sweep: tuple, tmp_path: Path) -> None:
    s, out, _ = sweep
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (ablation.run_dir(copy, "explore", 1) / "result.json").unlink()  # killed before it finished
    jobs = ablation.jobs(s)
    assert ablation.run_sweep(s, copy, workers=1, progress=False, only=jobs[:3]) == {"done": 0, "skipped": 3}
    assert ablation.run_sweep(s, copy, workers=1, progress=False) == {"done": 1, "skipped": 7}
    assert ablation.run_sweep(s, copy, workers=1, progress=False) == {"done": 0, "skipped": 8}
    summary = ablation.summarise(copy)
    ablation.write_summary(copy, summary)
    assert (copy / "summary.json").read_bytes() == (out / "summary.json").read_bytes()
    with pytest.raises(ablation.ConfigError, match="different ablation sweep"):
        ablation.run_sweep(spec(["init"]), copy, workers=1, progress=False)


def test_workers_do_not_change_the_summary(sweep: tuple, tmp_path: Path) -> None:
    s, out, _ = sweep
    assert ablation.run_sweep(s, tmp_path, workers=1, progress=False) == {"done": 8, "skipped": 0}
    ablation.write_summary(tmp_path, ablation.summarise(tmp_path))
    assert (tmp_path / "summary.json").read_bytes() == (out / "summary.json").read_bytes()


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
    assert not (tmp_path / "o").exists()  # refused before any run
