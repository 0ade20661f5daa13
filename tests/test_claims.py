"""The auditor trusts no claim of the trainer's: a bundle that lowers its own thresholds or calibration,
a forged batch commitment, a forged checkpoint resume state and a log record for an op the replay never
reaches each end in a verdict; ``--force`` never deletes what is not a detrl bundle.

Every forgery is consistent (CRCs, checkpoint SHA-256s, Merkle root and log length resealed), as a
dishonest trainer can make it, so it reaches the replay rather than the parsers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from detrl.cli import main
from detrl.formats import bundle as bundle_mod
from detrl.formats.roundlog import OpEntries
from detrl.testing.hostile import (
    EXPECTED_EXIT,
    audit_subprocess,
    hostile_cases,
    read_manifest,
    rehash_checkpoints,
    rewrite_checkpoint,
    write_commitments,
    write_manifest,
)
from detrl.testing.logrewrite import rewrite

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "supervised" / "digits_cnn.yaml")
SETS = ["--set", "train.steps=6", "--set", "verify.checkpoint_every=3"]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("claims") / "run"
    assert main(["train", CONFIG, *SETS, "--out", str(run), "--quiet"]) == 0
    return run


def empty_log(run: Path) -> None:
    rewrite(run / "roundlog", run / "roundlog.new", lambda step, ops: {})
    (run / "roundlog.new").replace(run / "roundlog")
    bundle_mod.reseal(run)


@pytest.mark.parametrize("hardware", ["native", "emulated:splitk"])
def test_a_bundle_that_lowers_its_own_thresholds_is_bad_input(
    bundle: Path, hardware: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The log emptied, every threshold and the calibration steps set to 0: it replicated (exit 0) while
    the replayer took the declared thresholds as the measure of compliance."""
    empty_log(bundle)
    m = read_manifest(bundle)
    m["thresholds"] = {"default": 0.0, "per_op": {name: 0.0 for name in m["thresholds"]["per_op"]}}
    m["calibration_steps"] = 0
    write_manifest(bundle, m)
    rc, out, err = cli(capsys, "audit", str(bundle), "--hardware", hardware, "--quiet")
    assert rc == 2, out + err
    assert "manifest.json: thresholds.per_op." in err and "below 2**-26" in err


def test_thresholds_at_the_floor_still_need_their_log(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Thresholds lowered to exactly what calibration may write pass the check, but the auditor holds the
    emptied log to its own floor (2**-22 for every op that is not a reduction): log incomplete."""
    empty_log(bundle)
    m = read_manifest(bundle)
    m["thresholds"] = {"default": 2.0**-22, "per_op": {name: 2.0**-26 for name in m["thresholds"]["per_op"]}}
    write_manifest(bundle, m)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 4, out + err
    assert out.startswith("LOG INCOMPLETE") and "unlogged-near" in out


@pytest.mark.parametrize("steps", [0, 2])
def test_calibration_steps_other_than_the_config_gives_are_bad_input(
    bundle: Path, steps: int, capsys: pytest.CaptureFixture[str]
) -> None:
    m = read_manifest(bundle)
    m["calibration_steps"] = steps
    write_manifest(bundle, m)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 2 and "manifest.json: calibration_steps:" in err, out + err


def test_a_forged_batch_commitment_diverges_at_its_step(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One bit of step 3's batch hash flipped, its CRC and the Merkle root fixed: the replay compares the
    batch hash of every step, not only the state hash."""
    leaves, _ = bundle_mod.parse_commitments((bundle / "commitments").read_bytes())
    state, batch = leaves[3]
    leaves[3] = (state, bytes([batch[0] ^ 1]) + batch[1:])
    write_commitments(bundle, leaves)
    bundle_mod.reseal(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 1, out + err
    assert out.startswith("DIVERGED") and "diverged at step 3" in out and "batch hash" in out


@pytest.mark.parametrize("revision", [10, None])
def test_a_divergence_of_an_older_revision_on_other_hardware_names_the_hazards_fixed_since(
    bundle: Path, revision: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle of rules revision 10 (the digits CNN's log is the same under 10 and 11) whose state after step 3
    was changed: on a profile unlike the recorder's the verdict adds that revisions 11 to 13 fixed hazards
    where honest hardware disagreed, and that a replay on the recorder's profile tells the two apart. On the
    recorder's profile, for a bundle of the current revision, or for a changed batch (no rule changes a
    batch), the verdict is the divergence alone."""
    if revision is not None:
        m = read_manifest(bundle)
        m["rules_revision"] = revision
        write_manifest(bundle, m)
    leaves, _ = bundle_mod.parse_commitments((bundle / "commitments").read_bytes())
    state, batch = leaves[3]
    leaves[3] = (bytes([state[0] ^ 1]) + state[1:], batch)
    write_commitments(bundle, leaves)
    bundle_mod.reseal(bundle)
    note = "the bundle follows rounding-rule revision 10, and later revisions fixed where honest hardware"
    for hardware, noted in (("emulated:splitk", revision is not None), ("native", False)):
        rc, out, err = cli(capsys, "audit", str(bundle), "--quiet", "--hardware", hardware)
        assert rc == 1 and "diverged at step 3" in out, out + err
        assert (note in out) is noted, out
        if noted:
            assert "11: GELU and the activation backwards" in out and "12: FP64's extremes" in out
            assert "13: every NaN committed as one NaN" in out
            assert "5: sums" not in out
            assert "a replay on the recorder's own profile (native) tells them apart" in out
    leaves[3] = (state, bytes([batch[0] ^ 1]) + batch[1:])
    write_commitments(bundle, leaves)
    bundle_mod.reseal(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet", "--hardware", "emulated:splitk")
    assert rc == 1 and "batch hash" in out and note not in out, out + err


def test_a_forged_resume_state_in_a_checkpoint_diverges(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The data order a resume (or a replay from the checkpoint) would continue with, swapped and
    resealed: the replay compares every resume tensor with its own at that step."""

    def swap(tensors: dict[str, torch.Tensor]) -> None:
        order = tensors["resume/loader/order"].clone()
        order[[0, 1]] = order[[1, 0]]
        tensors["resume/loader/order"] = order

    rewrite_checkpoint(bundle, 3, swap)
    rehash_checkpoints(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 1, out + err
    assert "diverged at step 3" in out and "resume state resume/loader/order" in out


def test_a_record_for_an_op_never_reached_is_a_log_violation(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A well-formed record for op position 2**32 - 1 at step 2: an internal error (exit 70) before, now
    a log that breaks its claim (exit 4) naming the op position."""

    def plant(step: int, ops: dict[int, OpEntries]) -> dict[int, OpEntries]:
        if step == 2:
            ops[2**32 - 1] = OpEntries(2**32 - 1, np.array([0], dtype=np.int64), np.array([True]))
        return ops

    rewrite(bundle / "roundlog", bundle / "roundlog.new", plant)
    (bundle / "roundlog.new").replace(bundle / "roundlog")
    bundle_mod.reseal(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 4, out + err
    assert "refused" in out and "op #4294967295 (never reached by this replay)" in out


def test_force_refuses_a_directory_that_is_not_a_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's directory holding a ``checkpoints/`` folder and a file named ``roundlog``: --force used
    to delete both. It is refused, and nothing in it changes."""
    out_dir = tmp_path / "mine"
    (out_dir / "checkpoints").mkdir(parents=True)
    (out_dir / "checkpoints" / "my_model_weights.pt").write_bytes(b"weights")
    (out_dir / "roundlog").write_text("my notes")
    before = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*"))
    rc, out, err = cli(capsys, "train", CONFIG, *SETS, "--out", str(out_dir), "--force", "--quiet")
    assert rc == 2 and "--force replaces only a detrl bundle" in err, out + err
    assert sorted(p.relative_to(out_dir) for p in out_dir.rglob("*")) == before
    assert (out_dir / "checkpoints" / "my_model_weights.pt").read_bytes() == b"weights"


def test_force_keeps_a_users_file_inside_a_bundles_checkpoints(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (bundle / "checkpoints" / "notes.txt").write_text("mine")
    rc, out, err = cli(capsys, "train", CONFIG, *SETS, "--out", str(bundle), "--force", "--quiet")
    assert rc == 2 and "'checkpoints/notes.txt' is not a checkpoint detrl wrote" in err, out + err
    assert (bundle / "checkpoints" / "notes.txt").read_text() == "mine"


def test_force_replaces_a_bundle(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(
        capsys, "train", CONFIG, "--set", "train.steps=2", "--out", str(bundle), "--force", "--quiet"
    )
    assert rc == 0, out + err
    assert read_manifest(bundle)["planned_steps"] == 2


def test_a_json_report_nobody_can_write_is_refused_before_the_replay(
    honest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "audit", str(honest), "--json", str(tmp_path / "no_such_dir" / "r.json"))
    assert rc == 2 and "--json" in err and out == "", out + err


def test_a_newline_in_a_path_stays_in_the_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "audit", str(tmp_path / "first\nsecond"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "second" in err, err


@pytest.mark.parametrize(
    "case",
    [
        "commitments: 10**9 zero bytes",
        "checkpoint: a 2 GiB sparse file",
        # planting 600,000 tensors takes 15 s: the slow suite
        pytest.param("checkpoint: 600,000 empty tensors", marks=pytest.mark.slow),
    ],
)
def test_cheap_checks_come_before_whole_file_reads(bundle: Path, tmp_path: Path, case: str) -> None:
    """Each cost gigabytes (2.1 GB, 4.5 GB and 1.6 GB RSS): the header, size and tensor count are
    checked first, and a checkpoint is hashed while streaming. Bad input, under 1 GB, in seconds."""
    plant = dict(hostile_cases())[case]
    plant(bundle, tmp_path)
    rc, out, err, rss, wall = audit_subprocess(bundle, timeout=120)
    assert rc == EXPECTED_EXIT[case] == 2, out + err
    assert err.startswith("detrl: error: ") and len(err.strip().splitlines()) == 1, err
    assert rss is not None and rss < 10**9, f"peak RSS {rss / 1e6:.0f} MB"
    assert wall < 30, wall


@pytest.mark.parametrize(
    "field, value",
    [("planned_steps", 10**6), ("checkpoint_every", 1), ("margin", 15.0), ("data_fingerprint", None)],
)
def test_run_shape_claims_other_than_the_config_gives_are_refused(
    bundle: Path, field: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the production-path fuzzer: each of these was accepted (exit 0). A dropped fingerprint
    claims other data than the auditor's (diverged at step 0); the others are bad input."""
    m = read_manifest(bundle)
    m[field] = value
    write_manifest(bundle, m)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    if field == "data_fingerprint":
        assert rc == 1 and "data fingerprint differs" in out, out + err
    else:
        assert rc == 2 and f"manifest.json: {field}:" in err, out + err


_BACKWARD_PATHS = """
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from detrl.core.engine import _OrderedTracker
from detrl.supervised.models import DigitsCNN

tracker, seen = _OrderedTracker(), []

class Spy(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default:
            seen.append(tracker.current())
        return func(*args, **(kwargs or {}))

net = DigitsCNN().double()
with tracker, Spy():
    net(torch.randn(4, 1, 8, 8, dtype=torch.float64)).sum().backward()
print(",".join(seen))
"""


@pytest.mark.parametrize("hash_seed", ["1", "3"])
def test_backward_ops_are_named_after_their_module_in_every_process(hash_seed: str) -> None:
    """The digits CNN's dropout is an Identity, which never leaves the tracker's set in backward: the
    deepest name in the set was picked in set order (string hashes are salted per process), so conv2's
    backward was named after dropout in some audits. Under two hash seeds that picked differently, each
    convolution's backward is named after its own module."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _BACKWARD_PATHS], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "DigitsCNN.conv2,DigitsCNN.conv1", out.stdout + out.stderr


def test_a_missing_default_threshold_is_bad_input(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``default`` every op not in ``per_op`` would get a threshold the trainer never claimed."""
    m = read_manifest(bundle)
    del m["thresholds"]["default"]
    write_manifest(bundle, m)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 2 and "manifest.json: thresholds.default: missing" in err, out + err


@pytest.mark.parametrize(
    "case, message",
    [
        ("below the floor", "below 2**-26"),
        ("above its op", "is above its op's"),
        ("an op with no threshold", "a class of an op with no per_op threshold"),
        ("not a number", "is '0.1', not a number"),
        ("not a class", "is not a call class"),
    ],
)
def test_class_thresholds_no_recorder_writes_are_bad_input(
    bundle: Path, case: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A class's threshold is a claim like an op's: below calibration's floor, above its op's (the op's is
    the largest of its classes'), for an op the bundle claims nothing of, or malformed: exit 2, one line."""
    m = read_manifest(bundle)
    per_class = m["thresholds"]["per_class"]  # the digits CNN's calibration measures classes
    key = next(iter(per_class))
    op = key.partition("(")[0]
    if case == "below the floor":
        per_class[key] = 2.0**-27
    elif case == "above its op":
        per_class[key] = m["thresholds"]["per_op"][op] * 2
    elif case == "an op with no threshold":
        per_class["nosuchop" + key[len(op) :]] = per_class[key]
    elif case == "not a number":
        per_class[key] = "0.1"
    else:
        per_class["mm"] = per_class[key]
    write_manifest(bundle, m)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 2, out + err
    assert message in err and err.count("\n") == 1, err
