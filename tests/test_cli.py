"""The demo path through the CLI: train a config, audit it on another profile, JSON report, profiles."""

import json

from detrl.cli import main


def test_train_then_audit_on_another_profile(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["train", "configs/supervised/digits_cnn.yaml", "--out", str(out), "--quiet",
               "--set", "train.steps=6", "--set", "model.channels=8"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "rounding log:" in text and "dense reference encoding" in text
    assert (out / "tb").is_dir()  # TensorBoard scalars
    report = tmp_path / "report.json"
    rc = main(
        ["audit", str(out), "--hardware", "emulated:pairwise", "--json", str(report), "--stats", "--quiet"]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.startswith("REPLICATED on emulated:pairwise")
    data = json.loads(report.read_text())
    assert data["verdict"] == "replicated" and len(data["per_step"]) == 6
    assert data["totals"]["dense_reference_bytes"] > data["totals"]["log_bytes"] > 0


def test_fp32_run_audited_on_another_profile_diverges_at_step_1(tmp_path, capsys):
    out = tmp_path / "fp32"
    assert main(["train", "configs/supervised/digits_cnn.yaml", "--out", str(out), "--quiet", "--no-tensorboard",
                 "--set", "precision=fp32", "--set", "train.steps=3"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["audit", str(out), "--hardware", "emulated:reversed", "--quiet"]) == 1
    assert "diverged at step 1" in capsys.readouterr().out


def test_profiles_are_listed(capsys):
    assert main(["profiles"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"native", "emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"} <= set(
        names
    )


def test_unknown_profile_and_benchmark_are_one_line_errors(tmp_path, capsys):
    assert main(["audit", str(tmp_path), "--hardware", "emulated:nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("detrl: error:")
