"""Defective bundles (bundle format version 5; rounding log version 4, and 3 where a test says so) to
``detrl audit``: exit code 2, one line naming the file and the problem, no traceback, nothing unpickled.

One small digits_cnn bundle is recorded per module (8 steps, checkpoints at 4 and 8) and copied into
``tmp_path`` for each test before it is damaged. Where a defect sits behind a check that would catch it
first, the test re-signs what that check reads, as a careless or malicious recorder could:
:func:`rehash_checkpoints` (the manifest's SHA-256s), :func:`reseal_merkle` (the durable Merkle root),
:func:`reseal_log_length` (``durable.roundlog_bytes``). So each defect must be caught by the reader of the
damaged file, and each test asserts on that reader's message.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from detrl.cli import main
from detrl.formats import bundle as bundle_mod
from detrl.formats.roundlog import RoundLogReader
from detrl.testing.hostile import read_manifest, set_field, write_manifest
from detrl.testing.logrewrite import rewrite

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/supervised/digits_cnn.yaml"
CKPT4 = "checkpoints/step_00000004.safetensors"
CKPT8 = "checkpoints/step_00000008.safetensors"
TRAIN_ARGS = ["--set", "train.steps=8", "--set", "verify.checkpoint_every=4", "--no-tensorboard", "--quiet"]
HEADER, RECORD = 16, 76  # commitments: header bytes, then records of step u64 | state 32 | batch 32 | crc32


# --- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recorded") / "run"
    assert main(["train", CONFIG, "--out", str(out), *TRAIN_ARGS]) == 0
    return out


DELETE = object()


def edit_manifest(run: Path, dotted: str, value: Any) -> None:
    """Set (or, with value ``DELETE``, remove) the manifest field at the dotted path."""
    m = read_manifest(run)
    node = m
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    write_manifest(run, m)


def rehash_checkpoints(run: Path) -> None:
    """The manifest's checkpoint SHA-256s recomputed from the files that exist."""
    m = read_manifest(run)
    for rel in m["checkpoints"]:
        if (run / rel).is_file():
            m["checkpoints"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    write_manifest(run, m)


def reseal_merkle(run: Path) -> None:
    """The durable Merkle root recomputed from the commitments file as it is now."""
    m = read_manifest(run)
    leaves, _ = bundle_mod.parse_commitments((run / "commitments").read_bytes())
    m["durable"]["merkle_root"] = bundle_mod.merkle_root(leaves[: m["durable"]["step"] + 1])
    write_manifest(run, m)


def reseal_log_length(run: Path) -> None:
    """``durable.roundlog_bytes`` set to where the log's segments through the durable step now end."""
    m = read_manifest(run)
    with RoundLogReader(run / "roundlog") as reader:
        m["durable"]["roundlog_bytes"] = reader.segment_end(m["durable"]["step"])
    write_manifest(run, m)


def flip_byte(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def record_at(run: Path, i: int) -> tuple[int, int]:
    """(start, end) byte offsets of commitment record ``i``."""
    start = HEADER + i * RECORD
    return start, start + RECORD


def rewrite_record(run: Path, i: int, *, step: int | None = None, state: bytes | None = None) -> None:
    """Change record ``i``'s step or state hash and give it a valid CRC again."""
    path = run / "commitments"
    data = bytearray(path.read_bytes())
    start, end = record_at(run, i)
    old_step, old_state, batch, _ = struct.unpack("<Q32s32sI", data[start:end])
    body = struct.pack(
        "<Q32s32s", old_step if step is None else step, old_state if state is None else state, batch
    )
    data[start:end] = body + struct.pack("<I", zlib.crc32(body))
    path.write_bytes(bytes(data))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed earlier
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_bad_input(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 2 with exactly one stderr line ``detrl: error: ...`` containing every needle; no traceback."""
    assert "Traceback" not in out + err
    assert "internal error" not in err
    lines = err.strip().splitlines()
    assert rc == 2, f"exit {rc}, stdout {out!r}, stderr {err!r}"
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith("detrl: error:"), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def audit_bad(capsys: pytest.CaptureFixture[str], run: Path, *needles: str) -> str:
    rc, out, err = cli(capsys, "audit", str(run), "--quiet")
    return assert_bad_input(rc, out, err, *needles)


def test_honest_bundle_replicates(honest: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The undamaged bundle replicates (so the damage is what each test below tests)."""
    rc, out, err = cli(capsys, "audit", str(honest), "--quiet")
    assert rc == 0, out + err
    assert out.startswith("REPLICATED")


def test_reseal_helpers_leave_an_intact_bundle_intact(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The re-signing helpers change nothing on a valid bundle (they only undo what a test changed)."""
    before = read_manifest(bundle)
    rehash_checkpoints(bundle)
    reseal_merkle(bundle)
    reseal_log_length(bundle)
    assert read_manifest(bundle) == before


# --- manifest.json: the file ---------------------------------------------------------------------


def test_manifest_missing(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "manifest.json").unlink()
    audit_bad(capsys, bundle, "manifest.json", "missing")


def test_manifest_not_utf8(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
    audit_bad(capsys, bundle, "manifest.json", "not UTF-8")


@pytest.mark.parametrize("keep", [0, 1, 100, -2])
def test_manifest_truncated(bundle: Path, capsys: pytest.CaptureFixture[str], keep: int) -> None:
    path = bundle / "manifest.json"
    path.write_bytes(path.read_bytes()[:keep])
    audit_bad(capsys, bundle, "manifest.json", "not valid JSON")


@pytest.mark.parametrize(
    "garbage", [b"\x00" * 64, b"{'format': 'detrl-bundle'}", b"{} {}", b'{"a": 1, "a": 2}']
)
def test_manifest_garbled(bundle: Path, capsys: pytest.CaptureFixture[str], garbage: bytes) -> None:
    (bundle / "manifest.json").write_bytes(garbage)
    audit_bad(capsys, bundle, "manifest.json", "not valid JSON")


@pytest.mark.parametrize("value", [[], "detrl-bundle", 3, None, {"hello": "world"}])
def test_manifest_not_a_bundle_manifest(bundle: Path, capsys: pytest.CaptureFixture[str], value: Any) -> None:
    write_manifest(bundle, value)
    audit_bad(capsys, bundle, "manifest.json", "not a detrl bundle manifest")


@pytest.mark.parametrize("fmt", ["detrl-bundle2", "DETRL-BUNDLE", "", None, 3])
def test_manifest_wrong_format(bundle: Path, capsys: pytest.CaptureFixture[str], fmt: Any) -> None:
    edit_manifest(bundle, "format", fmt)
    audit_bad(capsys, bundle, "manifest.json", "format is not 'detrl-bundle'")


@pytest.mark.parametrize("version", [1, 2, 3, 4, 6, 99, -5, "5", None, [5]])
def test_manifest_unsupported_version(bundle: Path, capsys: pytest.CaptureFixture[str], version: Any) -> None:
    edit_manifest(bundle, "version", version)
    line = audit_bad(capsys, bundle, "manifest.json", "unsupported bundle version")
    assert repr(version) in line


def test_manifest_version_as_float(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """5.0 equals 5 in Python but is not the integer the format asks for."""
    edit_manifest(bundle, "version", 5.0)
    audit_bad(capsys, bundle, "manifest.json", "version")


# --- manifest.json: every field, wrong type or out of range ----------------------------------------

WRONG_FIELDS = [
    ("created", 5), ("created", None), ("created", "x" * 65), ("created", "2026-12-07T15:21:07Z\0"),
    ("created", "2026-12-07 15:21:07"),
    ("task", 5), ("task", ["supervised"]), ("task", "x" * 65),
    ("config", [1]), ("config", "digits_cnn"), ("config", 0),
    ("precision", "fp16"), ("precision", 32), ("precision", None),
    ("hardware", 3), ("hardware", None), ("hardware", "x" * 201),
    ("sources", []), ("sources", "seed=0"), ("sources", None),
    ("thresholds", []), ("thresholds", 0.5), ("thresholds", None),
    ("calibration_steps", -1), ("calibration_steps", "1"), ("calibration_steps", 1.5),
    ("calibration_steps", True), ("calibration_steps", 1 << 40), ("calibration_steps", None),
    ("margin", 0.5), ("margin", 1e7), ("margin", "16"), ("margin", None), ("margin", -16.0),
    ("checkpoint_every", -1), ("checkpoint_every", "4"), ("checkpoint_every", 4.5), ("checkpoint_every", 1 << 40),
    ("planned_steps", -1), ("planned_steps", "8"), ("planned_steps", 1 << 40), ("planned_steps", 8.0),
    ("status", "done"), ("status", None), ("status", 1), ("status", "COMPLETE"),
    ("stopped_at", -1), ("stopped_at", "8"), ("stopped_at", 1 << 40),
    ("durable", "x"), ("durable", 5), ("durable", []),
    ("durable.step", -1), ("durable.step", "8"), ("durable.step", 1 << 40), ("durable.step", True),
    ("durable.step", 8.0), ("durable.step", None),
    ("durable.merkle_root", "zz"), ("durable.merkle_root", "0" * 63), ("durable.merkle_root", "A" * 64),
    ("durable.merkle_root", 5), ("durable.merkle_root", None),
    ("durable.roundlog_bytes", -1), ("durable.roundlog_bytes", "1"), ("durable.roundlog_bytes", 1.5),
    ("durable.extra", 1),
    ("checkpoints", []), ("checkpoints", "x"), ("checkpoints", None),
    ("data_fingerprint", "zz"), ("data_fingerprint", 5), ("data_fingerprint", "0" * 65),
    ("stats", {"logged": "many"}), ("stats", []), ("stats", {"logged": 1.5}),
    ("torch", 5), ("torch", None), ("torch", "x" * 65),
    ("unknown_field", 1), ("files", {}),
]  # fmt: skip


@pytest.mark.parametrize("key, value", WRONG_FIELDS, ids=[f"{k}={v!r}"[:40] for k, v in WRONG_FIELDS])
def test_manifest_field_wrong_type_or_range(
    bundle: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any
) -> None:
    edit_manifest(bundle, key, value)
    audit_bad(capsys, bundle, f"manifest.json: {key}")


REQUIRED = ["created", "precision", "hardware", "sources", "thresholds", "calibration_steps", "margin",
            "checkpoint_every", "status", "torch", "durable.step", "durable.merkle_root"]  # fmt: skip


@pytest.mark.parametrize("key", REQUIRED)
def test_manifest_required_field_missing(bundle: Path, capsys: pytest.CaptureFixture[str], key: str) -> None:
    edit_manifest(bundle, key, DELETE)
    audit_bad(capsys, bundle, "manifest.json", key, "required")


@pytest.mark.parametrize(
    "path, value, needle",
    [
        (("thresholds", "default"), "x", "threshold for default"),
        (("thresholds", "default"), 7.0, "threshold for default"),
        (("thresholds", "default"), -1e-9, "threshold for default"),
        (("thresholds", "per_op", "mm"), None, "threshold for mm"),
        (("thresholds", "per_op", "mm"), True, "threshold for mm"),
        (("thresholds", "per_op"), [1], "thresholds must be an object"),
        (("checkpoints", CKPT4), "not-a-sha", "bad SHA-256 for " + CKPT4),
        (("checkpoints", CKPT4), "A" * 64, "bad SHA-256 for " + CKPT4),
        (("checkpoints", CKPT4), "0" * 64 + "\n", "bad SHA-256 for " + CKPT4),
        (("checkpoints", CKPT4), 5, "checkpoints"),
    ],
)
def test_manifest_nested_value_wrong(
    bundle: Path, capsys: pytest.CaptureFixture[str], path: tuple[str, ...], value: Any, needle: str
) -> None:
    set_field(bundle, path, value, validate=False)
    audit_bad(capsys, bundle, "manifest.json", needle)


def test_manifest_stopped_at_differs_from_durable_point(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = read_manifest(bundle)
    m.update(status="stopped", stopped_at=7)
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "stopped_at does not match the durable point")


def test_manifest_checkpoint_beyond_durable_point(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["checkpoints"]["checkpoints/step_00000012.safetensors"] = "0" * 64
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json", "a checkpoint beyond the durable point")


def test_manifest_config_unknown_key(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(bundle, "config.model.bogus", 1)
    audit_bad(capsys, bundle, "manifest.json", "model.bogus")


def test_manifest_config_unknown_hardware(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(bundle, "config.hardware", "tpu:v9")
    audit_bad(capsys, bundle, "manifest.json", "tpu:v9")


def test_manifest_unknown_task(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(bundle, "task", "nope")
    audit_bad(capsys, bundle, "manifest.json", "unknown task 'nope'")


def test_manifest_task_differs_from_config(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(bundle, "task", "dqn")
    audit_bad(capsys, bundle, "manifest.json", "dqn")


def test_manifest_script_bundle(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(bundle, "task", None)
    audit_bad(capsys, bundle, "manifest.json", "recorded by a script")


# --- commitments -----------------------------------------------------------------------------------


def test_commitments_missing(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "commitments").unlink()
    audit_bad(capsys, bundle, "commitments", "missing")


@pytest.mark.parametrize("records", [0, 1, 5, 8])
def test_commitments_truncated_below_durable_point(
    bundle: Path, capsys: pytest.CaptureFixture[str], records: int
) -> None:
    path = bundle / "commitments"
    path.write_bytes(path.read_bytes()[: HEADER + records * RECORD])
    audit_bad(capsys, bundle, "commitments", f"{records} records", "durable point is step 8")


def test_commitments_torn_durable_record(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A durable record cut short is not a torn tail the reader may drop: the durable point needs it."""
    path = bundle / "commitments"
    path.write_bytes(path.read_bytes()[:-3])
    audit_bad(capsys, bundle, "commitments", "8 records", "durable point is step 8")


@pytest.mark.parametrize("keep", [0, 8, 15])
def test_commitments_truncated_header(bundle: Path, capsys: pytest.CaptureFixture[str], keep: int) -> None:
    path = bundle / "commitments"
    path.write_bytes(path.read_bytes()[:keep])
    audit_bad(capsys, bundle, "commitments", f"truncated header ({keep} bytes)")


def test_commitments_bad_magic(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(bundle / "commitments", 2)
    audit_bad(capsys, bundle, "commitments", "bad magic")


@pytest.mark.parametrize("pos", [8, 10, 12])
def test_commitments_unsupported_version(bundle: Path, capsys: pytest.CaptureFixture[str], pos: int) -> None:
    flip_byte(bundle / "commitments", pos)  # version, or a reserved field
    audit_bad(capsys, bundle, "commitments", "unsupported version")


@pytest.mark.parametrize("offset", [0, 8, 40, 72])  # step, state hash, batch hash, the CRC itself
def test_commitments_bad_record_crc(bundle: Path, capsys: pytest.CaptureFixture[str], offset: int) -> None:
    start, _ = record_at(bundle, 3)
    flip_byte(bundle / "commitments", start + offset)
    audit_bad(capsys, bundle, "commitments", "record 3: checksum mismatch")


@pytest.mark.parametrize("step", [6, 4, 0, 2**64 - 1])
def test_commitments_record_for_wrong_step(
    bundle: Path, capsys: pytest.CaptureFixture[str], step: int
) -> None:
    rewrite_record(bundle, 5, step=step)
    audit_bad(capsys, bundle, "commitments", f"record 5 is for step {step}")


def test_commitments_merkle_root_mismatch(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record changed with a valid CRC: only the manifest's Merkle root catches it."""
    rewrite_record(bundle, 5, state=bytes(32))
    audit_bad(capsys, bundle, "commitments", "Merkle root does not match manifest.json")


def test_manifest_merkle_root_changed(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(bundle, "durable.merkle_root", "0" * 64)
    audit_bad(capsys, bundle, "commitments", "Merkle root does not match manifest.json")


def test_commitments_changed_and_resealed_diverges(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Control for the test above: with the Merkle root re-signed, the changed record is a divergence
    at its step, so it was the Merkle check that gave exit 2 there."""
    rewrite_record(bundle, 5, state=bytes(32))
    reseal_merkle(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 1, out + err
    assert "step 5" in out


def test_commitments_records_beyond_a_finished_recording(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = bundle / "commitments"
    body = struct.pack("<Q32s32s", 9, bytes(32), bytes(32))
    path.write_bytes(path.read_bytes() + body + struct.pack("<I", zlib.crc32(body)))
    audit_bad(capsys, bundle, "commitments", "records beyond the end of a finished recording")


# --- roundlog --------------------------------------------------------------------------------------


def test_a_bundle_with_a_version_3_log_still_audits(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bundle recorded before log format 4: its log re-encoded in version 3 (the same entries) replays
    on another profile as it did, and reads as version 3."""
    old = bundle.parent / "v3.rlog"
    rewrite(bundle / "roundlog", old, lambda step, ops: ops, version=3)
    os.replace(old, bundle / "roundlog")
    bundle_mod.reseal(bundle)
    with RoundLogReader(bundle / "roundlog") as r:
        assert r.version == 3 and r.steps == list(range(1, 9))
    assert main(["audit", str(bundle), "--hardware", "emulated:splitk", "--quiet"]) == 0, capsys.readouterr()


def test_roundlog_missing(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "roundlog").unlink()
    audit_bad(capsys, bundle, "roundlog", "missing")


@pytest.mark.parametrize("drop", [1, 5, 8])
def test_roundlog_missing_a_durable_step(bundle: Path, capsys: pytest.CaptureFixture[str], drop: int) -> None:
    """A well-formed log without the segment of one durable step (its length re-signed in the manifest)."""
    log = bundle / "roundlog"
    forged = bundle / "roundlog.new"
    rewrite(log, forged, lambda step, ops: None if step == drop else ops, level=bundle_mod.LOG_ZSTD_LEVEL)
    forged.replace(log)
    m = read_manifest(bundle)
    with RoundLogReader(log) as reader:
        assert drop not in reader.steps
        m["durable"]["roundlog_bytes"] = reader.end_of_segments
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "roundlog", "does not hold one segment for each of steps 1..8")


@pytest.mark.parametrize("cut", [16, 100, -5])
def test_roundlog_torn_inside_the_durable_steps(
    bundle: Path, capsys: pytest.CaptureFixture[str], cut: int
) -> None:
    """A torn tail is tolerated after the durable point, not inside it."""
    log = bundle / "roundlog"
    log.write_bytes(log.read_bytes()[:cut])
    audit_bad(capsys, bundle, "roundlog", "does not hold one segment for each of steps 1..8")


@pytest.mark.parametrize("delta", [-1, 1, 10**6])
def test_roundlog_length_differs_from_manifest(
    bundle: Path, capsys: pytest.CaptureFixture[str], delta: int
) -> None:
    m = read_manifest(bundle)
    m["durable"]["roundlog_bytes"] += delta
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "roundlog", "length through step 8 differs from manifest.json")


def test_roundlog_appended_bytes_after_a_finished_recording(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished recording's writer leaves no torn tail (a resume marks the bundle recording before it
    appends): bytes after its last segment are refused, as extra commitment records are."""
    log = bundle / "roundlog"
    log.write_bytes(log.read_bytes() + b"RSEG\x09")
    audit_bad(capsys, bundle, "roundlog", "beyond the end of a finished recording")


def test_roundlog_torn_tail_of_a_live_recording_is_not_an_error(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Control: while a bundle records (or after a kill), bytes after the durable segments that do not form
    a segment yet are the torn tail of a step in progress, not an error."""
    log = bundle / "roundlog"
    log.write_bytes(log.read_bytes() + b"RSEG\x09")
    edit_manifest(bundle, "status", "recording")
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 3, out + err


@pytest.mark.parametrize(
    "pos, needle",
    [
        (0, "bad magic"),
        (8, "unsupported format version"),
        (10, "unsupported header flags"),
        (16, "bad segment tag"),
        (20, "not greater than previous step"),
    ],
)
def test_roundlog_header_damaged(
    bundle: Path, capsys: pytest.CaptureFixture[str], pos: int, needle: str
) -> None:
    log = bundle / "roundlog"
    data = bytearray(log.read_bytes())
    if pos == 20:  # the second segment's step (u64 after its 4-byte tag) set to 1, the first's step
        with RoundLogReader(log) as reader:
            second = reader.segment_end(1)
        data[second + 4 : second + 12] = (1).to_bytes(8, "little")
    else:
        data[pos] ^= 0xFF
    log.write_bytes(bytes(data))
    audit_bad(capsys, bundle, "roundlog", needle)


def test_roundlog_payload_byte_flipped(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = bundle / "roundlog"
    with RoundLogReader(log) as reader:
        start, end = reader.segment_end(2), reader.segment_end(3)
    flip_byte(log, (start + end) // 2)
    audit_bad(capsys, bundle, "roundlog", "step 3", "checksum mismatch")


# --- checkpoints ------------------------------------------------------------------------------------


# (a byte of the 8-byte header length changes the length: checked first, see test_checkpoint_not_safetensors)
@pytest.mark.parametrize("rel, pos", [(CKPT4, -10), (CKPT8, 100), (CKPT8, 9)])
def test_checkpoint_changed_byte(
    bundle: Path, capsys: pytest.CaptureFixture[str], rel: str, pos: int
) -> None:
    flip_byte(bundle / rel, pos)
    audit_bad(capsys, bundle, rel, "SHA-256 does not match manifest.json")


def test_checkpoint_changed_and_rehashed(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor byte changed and the manifest re-signed: the checkpoint no longer holds the committed
    state of step 4, which the replay's checkpoint check reports as a divergence at that step."""
    flip_byte(bundle / CKPT4, -10)
    rehash_checkpoints(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert "Traceback" not in out + err
    assert rc == 1, out + err
    assert "step 4" in out and CKPT4 in out


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "truncated"),
        (b"1234567", "truncated"),
        (b"this is not a safetensors file", "does not fit"),
        ((1 << 63).to_bytes(8, "little") + b"{}", "does not fit"),
        ((2).to_bytes(8, "little") + b"{}", "no detrl metadata"),
        ((4).to_bytes(8, "little") + b"[1] ", "no detrl metadata"),
        ((5).to_bytes(8, "little") + b'{"a":', "not valid JSON"),
    ],
)
def test_checkpoint_not_safetensors(
    bundle: Path, capsys: pytest.CaptureFixture[str], content: bytes, needle: str
) -> None:
    (bundle / CKPT8).write_bytes(content)
    rehash_checkpoints(bundle)
    audit_bad(capsys, bundle, CKPT8, needle)


def _with_header(data: bytes, edit: Any) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda h: h["__metadata__"].update(detrl="{not json"), "not valid JSON"),
        (lambda h: h["__metadata__"].update(detrl="[1, 2]"), "bad detrl metadata"),
        (lambda h: h.pop("__metadata__"), "no detrl metadata"),
        (
            lambda h: h[next(k for k in h if k != "__metadata__")].update(data_offsets=[0, 1 << 40]),
            "safetensors",
        ),
        (lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype="F99"), "safetensors"),
    ],
)
def test_checkpoint_bad_header(
    bundle: Path, capsys: pytest.CaptureFixture[str], edit: Any, needle: str
) -> None:
    path = bundle / CKPT4
    path.write_bytes(_with_header(path.read_bytes(), edit))
    rehash_checkpoints(bundle)
    audit_bad(capsys, bundle, CKPT4, needle)


class _Plant:
    """Unpickling this object creates ``marker`` (a stand-in for running arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_checkpoint_is_a_pickle(
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
    rehash_checkpoints(bundle)
    audit_bad(capsys, bundle, CKPT4, "safetensors header")
    assert not marker.exists(), "the planted pickle was unpickled"


@pytest.mark.parametrize("rel", [CKPT4, CKPT8])
def test_checkpoint_listed_but_missing(bundle: Path, capsys: pytest.CaptureFixture[str], rel: str) -> None:
    (bundle / rel).unlink()
    audit_bad(capsys, bundle, rel, "missing")


def test_checkpoint_listed_that_was_never_written(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(
        bundle, "checkpoints", {**read_manifest(bundle)["checkpoints"], CKPT4.replace("04", "02"): "0" * 64}
    )
    audit_bad(capsys, bundle, "checkpoints/step_00000002.safetensors", "missing")


def test_checkpoints_folder_missing(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(bundle / "checkpoints")
    audit_bad(capsys, bundle, "checkpoints/step_0000000", "missing")


BAD_NAMES = [
    "checkpoints/step_4.safetensors", "checkpoints/step_000000004.safetensors", "checkpoints/step_0000000a.safetensors",
    "checkpoints/step_00000004.pt", "checkpoints/step_00000004.safetensors.tmp", "step_00000004.safetensors",
    "checkpoints/sub/step_00000004.safetensors", "checkpoints/step_00000004.safetensors/x",
    "Checkpoints/step_00000004.safetensors", "checkpoints//step_00000004.safetensors", "checkpoints/.step_00000004.safetensors",
    "checkpoints/step_00000004.safetensors\n", "checkpoints/step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0664.safetensors",
    "manifest.json", "",
]  # fmt: skip
TRAVERSAL = [
    "../step_00000004.safetensors", "checkpoints/../manifest.json", "../../etc/passwd", "checkpoints/../../etc/passwd",
    "checkpoints/../checkpoints/step_00000004.safetensors", "/etc/passwd", "/checkpoints/step_00000004.safetensors",
    "./checkpoints/step_00000004.safetensors",
]  # fmt: skip


@pytest.mark.parametrize("name", BAD_NAMES + TRAVERSAL)
def test_checkpoint_name_not_the_pattern(bundle: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    m = read_manifest(bundle)
    m["checkpoints"][name] = "0" * 64
    write_manifest(bundle, m)
    line = audit_bad(capsys, bundle, "manifest.json", "checkpoints: unexpected file name")
    assert repr(name[:80]) in line


# --- the bundle directory ---------------------------------------------------------------------------


def test_missing_bundle_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_run"
    audit_bad(capsys, missing, str(missing))


def test_bundle_path_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "run.txt"
    f.write_text("not a bundle")
    audit_bad(capsys, f, str(f), "not a run bundle directory")


# --- the real command line -------------------------------------------------------------------------


def test_subprocess_one_line_no_traceback(bundle: Path) -> None:
    """The installed entry point too: exit 2, one stderr line, no traceback (truncated commitments)."""
    path = bundle / "commitments"
    path.write_bytes(path.read_bytes()[:200])
    env = {k: v for k, v in os.environ.items() if k != "DETRL_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "detrl.cli", "audit", str(bundle), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert_bad_input(proc.returncode, proc.stdout, proc.stderr, "commitments", "durable point")


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
        capsys, "train", CONFIG, "--out", str(out_dir), "--set", override, "--quiet", "--no-tensorboard"
    )
    assert_bad_input(rc, out, err, *needles)
    assert not (out_dir / "manifest.json").exists()
