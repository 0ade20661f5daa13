"""Bad input to ``detrl audit`` / ``detrl train``: exit code 2, one clear line, no traceback, nothing unpickled.

One small digits_cnn bundle is recorded per module (``detrl train``, 8 steps, checkpoints at 4 and 8) and
copied into ``tmp_path`` for each test before it is damaged. ``rehash`` plays the careless or malicious
party who recomputes the manifest's file hashes after editing a file, so that the damage must be caught
by the reader of that file rather than by the manifest's SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from detrl.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "supervised" / "digits_cnn.yaml"
CKPT4 = "checkpoints/step_00000004.safetensors"
CKPT8 = "checkpoints/step_00000008.safetensors"
TRAIN_ARGS = ["--set", "train.steps=8", "--set", "verify.checkpoint_every=4", "--no-tensorboard", "--quiet"]


# --- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recorded") / "run"
    assert main(["train", str(CONFIG), "--out", str(out), *TRAIN_ARGS]) == 0
    return out


@pytest.fixture
def bundle(recorded: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(recorded, dst)
    return dst


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(run: Path) -> dict[str, Any]:
    return json.loads((run / "manifest.json").read_text())


def write_manifest(run: Path, manifest: dict[str, Any]) -> None:
    (run / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def rehash(run: Path) -> None:
    """Rewrite manifest.json's "files" entries with fresh SHA-256s (of the files that exist)."""
    m = read_manifest(run)
    m["files"] = {rel: sha256(run / rel) if (run / rel).is_file() else d for rel, d in m["files"].items()}
    write_manifest(run, m)


def flip_byte(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed earlier
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_bad_input(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 2 with exactly one stderr line ``detrl: error: ...`` containing every needle; no traceback."""
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert rc == 2, f"exit {rc}, stdout {out!r}, stderr {err!r}"
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith("detrl: error:"), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def audit_bad(capsys: pytest.CaptureFixture[str], run: Path, *needles: str, hardware: str = "native") -> str:
    rc, out, err = cli(capsys, "audit", str(run), "--hardware", hardware, "--quiet")
    return assert_bad_input(rc, out, err, *needles)


def test_recorded_bundle_replicates(recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Sanity check of the fixture: the undamaged bundle is replicated (so damage is what we test)."""
    rc, out, err = cli(capsys, "audit", str(recorded), "--quiet")
    assert rc == 0, out + err
    assert out.startswith("REPLICATED")


# --- roundlog --------------------------------------------------------------------------------------


def _cut_points(size: int) -> list[int]:
    # empty, inside the file header, just after it, mid-file, inside the index, inside / just before the trailer
    return [0, 5, 16, size // 2, size - 40, size - 32, size - 1]


@pytest.mark.parametrize("which", range(7))
def test_roundlog_truncated_stale_manifest(
    bundle: Path, capsys: pytest.CaptureFixture[str], which: int
) -> None:
    log = bundle / "roundlog"
    cut = _cut_points(log.stat().st_size)[which]
    log.write_bytes(log.read_bytes()[:cut])
    line = audit_bad(capsys, bundle, "roundlog")
    assert "manifest.json" in line  # caught by the file hash


@pytest.mark.parametrize("which", range(7))
def test_roundlog_truncated_rehashed(bundle: Path, capsys: pytest.CaptureFixture[str], which: int) -> None:
    log = bundle / "roundlog"
    cut = _cut_points(log.stat().st_size)[which]
    log.write_bytes(log.read_bytes()[:cut])
    rehash(bundle)
    line = audit_bad(capsys, bundle, "roundlog")
    assert "SHA-256" not in line  # the roundlog reader caught it, not the manifest


def test_roundlog_byte_flipped_stale_manifest(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = bundle / "roundlog"
    flip_byte(log, log.stat().st_size // 2)
    line = audit_bad(capsys, bundle, "roundlog", "manifest.json")
    assert "SHA-256" in line


@pytest.mark.parametrize("where", ["middle", "magic", "version", "late-payload", "index", "trailer"])
def test_roundlog_byte_flipped_rehashed(bundle: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    log = bundle / "roundlog"
    size = log.stat().st_size
    pos = {
        "middle": size // 2,
        "magic": 3,
        "version": 8,
        "late-payload": size - 32 - 8 * 16 - 5,  # a few bytes before the index (8 steps x 16 bytes)
        "index": size - 32 - 10,
        "trailer": size - 20,
    }[where]
    flip_byte(log, pos)
    rehash(bundle)
    line = audit_bad(capsys, bundle, "roundlog")
    assert "SHA-256" not in line


# --- manifest.json ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", ["roundlog", "commitments.json", CKPT4])
def test_manifest_wrong_file_hash(bundle: Path, capsys: pytest.CaptureFixture[str], rel: str) -> None:
    m = read_manifest(bundle)
    m["files"][rel] = "0" * 64
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, rel, "manifest.json")


def test_manifest_not_json(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "manifest.json").write_text('{"format": "detrl-bundle", "version": 1,')
    audit_bad(capsys, bundle, "manifest.json", "JSON")


def test_manifest_not_utf8(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
    audit_bad(capsys, bundle, "manifest.json")


@pytest.mark.parametrize(
    "key", ["config", "precision", "sources", "steps", "merkle_root", "thresholds", "files"]
)
def test_manifest_missing_key(bundle: Path, capsys: pytest.CaptureFixture[str], key: str) -> None:
    m = read_manifest(bundle)
    del m[key]
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", key)


@pytest.mark.parametrize("key, value", [("steps", "8"), ("steps", True), ("files", []), ("config", [1])])
def test_manifest_key_wrong_type(
    bundle: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any
) -> None:
    m = read_manifest(bundle)
    m[key] = value
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", key)


@pytest.mark.parametrize("version", [99, 0, 1, "2", None])
def test_manifest_unknown_version(bundle: Path, capsys: pytest.CaptureFixture[str], version: Any) -> None:
    m = read_manifest(bundle)
    m["version"] = version
    write_manifest(bundle, m)
    line = audit_bad(capsys, bundle, "manifest.json", "version")
    assert repr(version) in line


def test_manifest_not_a_bundle(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_manifest(bundle, {"hello": "world"})
    audit_bad(capsys, bundle, "manifest.json")


def test_manifest_unexpected_file_name(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["files"]["../../etc/passwd"] = "0" * 64
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "../../etc/passwd")


def test_manifest_config_unknown_key(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["config"]["model"]["bogus"] = 1
    write_manifest(bundle, m)
    rehash(bundle)
    audit_bad(capsys, bundle, "bogus")


def test_manifest_config_error_names_manifest(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["config"]["model"]["bogus"] = 1
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "bogus", "manifest.json")


def test_manifest_config_unknown_hardware(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["config"]["hardware"] = "tpu:v9"
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "tpu:v9")


def test_manifest_thresholds_null(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["thresholds"]["per_op"]["mm"] = None
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "mm")


def test_manifest_thresholds_out_of_range(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["thresholds"]["default"] = 7.0
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "default")


def test_manifest_calibration_steps_wrong_type(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["thresholds"]["calibration_steps"] = [1]
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "calibration_steps")


def test_manifest_sources_invalid_names_manifest(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["sources"] = {}
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "sources")


def test_manifest_unknown_precision(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["precision"] = "fp16"
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "fp16")


def test_manifest_unknown_precision_names_manifest(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["precision"] = "fp16"
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "fp16", "manifest.json")


# --- missing files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", ["commitments.json", CKPT4, CKPT8, "roundlog"])
def test_missing_file(bundle: Path, capsys: pytest.CaptureFixture[str], rel: str) -> None:
    (bundle / rel).unlink()
    audit_bad(capsys, bundle, rel, "missing")


def test_missing_manifest(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "manifest.json").unlink()
    audit_bad(capsys, bundle, "manifest.json", "missing")


def test_missing_bundle_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_run"
    audit_bad(capsys, missing, str(missing))


def test_bundle_path_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "run.txt"
    f.write_text("not a bundle")
    audit_bad(capsys, f, str(f))


# --- checkpoints: nothing is unpickled -----------------------------------------------------------


class _Plant:
    """Unpickling this object creates ``marker`` (a stand-in for running arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_pickle_planted_as_checkpoint(
    bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    marker = tmp_path / "PWNED"
    target = bundle / CKPT4
    payload = {"state": _Plant(marker), "w": torch.zeros(3)}
    if how == "torch.save":
        torch.save(payload, target)
    else:
        target.write_bytes(pickle.dumps(payload))
    assert not marker.exists()
    rehash(bundle)
    audit_bad(capsys, bundle, CKPT4)
    assert not marker.exists(), "the planted pickle was unpickled"


def test_checkpoint_garbage_header(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A safetensors header length of 2**63: must be refused, not allocated."""
    target = bundle / CKPT8
    data = bytearray(target.read_bytes())
    data[:8] = (1 << 63).to_bytes(8, "little")
    target.write_bytes(bytes(data))
    rehash(bundle)
    audit_bad(capsys, bundle, CKPT8)


# --- commitments.json ------------------------------------------------------------------------------


def _edit_commitments(run: Path, edit: Any) -> None:
    obj = json.loads((run / "commitments.json").read_text())
    edit(obj)
    (run / "commitments.json").write_text(json.dumps(obj))
    rehash(run)


def test_commitments_non_hex(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_commitments(bundle, lambda o: o["steps"][3].update(state="zz" * 32))
    audit_bad(capsys, bundle, "commitments.json", "hex")


def test_commitments_short_hash(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_commitments(bundle, lambda o: o["steps"][2].update(batch="ab" * 16))
    audit_bad(capsys, bundle, "commitments.json")


@pytest.mark.parametrize("change", ["drop-last", "add-one"])
def test_commitments_wrong_number_of_steps(
    bundle: Path, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    def edit(o: dict[str, Any]) -> None:
        if change == "drop-last":
            o["steps"].pop()
        else:
            o["steps"].append(dict(o["steps"][-1]))

    _edit_commitments(bundle, edit)
    audit_bad(capsys, bundle, "commitments.json", "steps")


def test_commitments_wrong_shape(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_commitments(bundle, lambda o: o.update(steps={"0": "x"}))
    audit_bad(capsys, bundle, "commitments.json", "steps")


def test_commitments_changed_hash_breaks_merkle_root(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _edit_commitments(bundle, lambda o: o["steps"][5].update(state="0" * 64))
    audit_bad(capsys, bundle, "commitments.json", "Merkle")


# --- the real command line -------------------------------------------------------------------------


def test_subprocess_one_line_no_traceback(bundle: Path) -> None:
    """The installed entry point too: exit 2, one stderr line, no traceback (truncated roundlog, rehashed)."""
    log = bundle / "roundlog"
    log.write_bytes(log.read_bytes()[:1000])
    rehash(bundle)
    env = {k: v for k, v in os.environ.items() if k != "DETRL_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "detrl.cli", "audit", str(bundle), "--quiet"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    assert_bad_input(proc.returncode, proc.stdout, proc.stderr, "roundlog")


# --- detrl train: bad arguments --------------------------------------------------------------------


def test_train_missing_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    rc, out, err = cli(
        capsys, "train", str(missing), "--out", str(tmp_path / "o"), "--quiet", "--no-tensorboard"
    )
    assert_bad_input(rc, out, err, "nope.yaml")


def test_train_config_not_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n  - x: : :\n")
    rc, out, err = cli(capsys, "train", str(bad), "--out", str(tmp_path / "o"), "--quiet", "--no-tensorboard")
    assert_bad_input(rc, out, err, "bad.yaml")


@pytest.mark.parametrize(
    "override, needles",
    [
        ("model.bogus=1", ("model.bogus", "unknown key")),
        ("bogus=1", ("bogus", "unknown key")),
        ("train.steps=abc", ("train.steps",)),
        ("train.steps=0", ("train.steps",)),
        ("hardware=tpu:v9", ("tpu:v9",)),
        ("precision=fp16", ("precision",)),
        ("noequals", ("noequals",)),
    ],
)
def test_train_bad_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, needles: tuple[str, ...]
) -> None:
    out_dir = tmp_path / "o"
    rc, out, err = cli(
        capsys, "train", str(CONFIG), "--out", str(out_dir), "--set", override, "--quiet", "--no-tensorboard"
    )
    assert_bad_input(rc, out, err, *needles)
    assert not (out_dir / "manifest.json").exists()
