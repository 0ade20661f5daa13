"""The demo path through the CLI: train a config, audit it on another profile, JSON report, profiles."""

import json

import pytest

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


def test_version(capsys):
    import pytest

    import detrl

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"detrl {detrl.__version__}" == "detrl 0.1.0"


def test_bench_help_lists_every_benchmark_with_its_description(capsys):
    import pytest

    from detrl import bench

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    listed = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    for name in ("overhead", "roundlog", "nolog", "dqn"):  # dqn comes from agents' entry point
        description = bench.benchmarks()[name][0]
        assert name in listed and description in listed[name], out


def test_unknown_benchmark_is_one_line_listing_the_known(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("detrl: error: unknown benchmark 'nope'")
    assert all(name in err for name in ("overhead", "roundlog", "nolog", "dqn"))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--models", "nope"], "config file not found: configs/supervised/nope.yaml"),
        (
            ["--models", "digits_cnn", "--profiles", "emulated:nope"],
            "unknown hardware profile 'emulated:nope'",
        ),
    ],
)
def test_bench_replication_refuses_bad_names_before_any_work(capsys, args, says):
    assert main(["bench", "replication", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err


def test_profiles_list_cuda_with_its_availability(capsys):
    import torch

    assert main(["profiles"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "cuda" in lines
    expected = "(available here)" if torch.cuda.is_available() else "(not available here)"
    assert lines["cuda"].endswith(expected)


def test_unknown_config_key_suggests_the_nearest(tmp_path, capsys):
    rc = main(["train", "configs/supervised/digits_cnn.yaml", "--set", "optimizer.lrr=0.1", "--quiet",
               "--no-tensorboard", "--out", str(tmp_path / "run")])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert err == "detrl: error: config error: optimizer.lrr: unknown key (did you mean optimizer.lr?)\n"


def test_a_validators_refusal_reads_in_its_own_words(tmp_path, capsys):
    rc = main(["train", "configs/supervised/digits_cnn.yaml", "--set", "hardware=emulated:nope", "--quiet",
               "--no-tensorboard", "--out", str(tmp_path / "run")])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("detrl: error: config error: hardware: unknown hardware profile")
        and "Value error" not in err
    )
    assert not (tmp_path / "run").exists()


def test_packaged_config_resolves_outside_a_checkout(tmp_path, monkeypatch):
    import pytest

    from detrl.run import config

    monkeypatch.chdir(tmp_path)  # no configs/ here: only the package's copy can answer
    assert config.load("configs/dqn/tiny.yaml").name == config.load("dqn/tiny.yaml").name == "tiny"
    assert "dqn/tiny.yaml" in config.packaged_configs()
    with pytest.raises(
        config.ConfigError, match=r"config file not found: configs/nope\.yaml .*dqn/tiny\.yaml"
    ):
        config.load("configs/nope.yaml")


def test_a_config_whose_parts_do_not_fit_is_one_line(tmp_path, capsys):
    """A CNN fed token windows fails inside torch: the user's config error, exit 2, not an internal error."""
    rc = main(["train", "configs/supervised/digits_cnn.yaml", "--set", "data.name=synthetic_text", "--out",
               str(tmp_path / "r"), "--quiet", "--no-tensorboard"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "the run fails" in err and "internal error" not in err, err


def test_bench_perop_prints_every_op_under_every_layer(capsys):
    """``detrl bench perop`` (tiny settings): one row per op and size, a number under each layer, and the
    derived columns are the differences of the measured ones."""
    assert main(["bench", "perop", "--sizes", "64", "--calls", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split(",")[0] in ("add", "exp", "mm", "sum over rows")]
    assert len(rows) == 4, out
    for line in rows:
        cells = line.split(", 64")[1].split()
        plain, any_mode, _, recorded, python_mode, torch_ref, entry, own, beyond = map(float, cells)
        assert min(plain, any_mode, recorded, python_mode, torch_ref) > 0
        assert abs(entry - (any_mode - plain)) < 0.11 and abs(own - (python_mode - any_mode)) < 0.11
        assert abs(beyond - (recorded - plain)) < 0.11


def test_bench_zoo_prints_the_log_a_step_that_the_recording_wrote(tmp_path, capsys):
    """``detrl bench zoo``'s log column: step 1's KB and the later steps' mean, the sizes a recording of the
    same model writes (a log's size is deterministic), and its replay verdict beside them."""
    from detrl.testing import zoo

    name = "layer_norm_then_mean"
    assert main(["bench", "zoo", "--models", name, "--steps", "3", "--profiles", "emulated:splitk"]) == 0
    out = capsys.readouterr().out
    (row,) = [line.split() for line in out.splitlines() if line.startswith(name)]
    per_step = zoo.record(zoo.SPECIMENS[name], tmp_path / "run", steps=3).log_bytes[-3:]
    assert min(per_step) > 0
    assert row[2:5] == [f"{per_step[0] / 1e3:.1f}", "/", f"{(per_step[1] + per_step[2]) / 2e3:.1f}"], out
    assert "replicates" in row, out
