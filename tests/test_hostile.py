"""Hostile bundles: a recorder that tries to make the auditor read its own files, hang, or run out of memory.

Every case ends in a verdict or in exit 2 with one line (``detrl: error: <file>: <problem>``), never a
traceback, an internal error (70), a hang or a large allocation. Where a case could hang or allocate,
the audit runs in a fresh process with a timeout, and its peak RSS is the child's own ``ru_maxrss``
(read with ``os.wait4``, so children of other tests do not count). Bundles are recorded once per module
and copied for each test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from detrl.cli import main
from detrl.formats import bundle as bundle_mod
from detrl.formats import commit
from detrl.formats.roundlog import RoundLogReader
from detrl.testing.hostile import (
    audit_subprocess,
    plant_bomb,
    read_manifest,
    rehash_checkpoints,
    set_field,
    set_literal,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[1]
CKPT4 = "checkpoints/step_00000004.safetensors"
SUPERVISED = [
    "configs/supervised/digits_cnn.yaml",
    "--set",
    "train.steps=8",
    "--set",
    "verify.checkpoint_every=4",
]
DQN = ["configs/dqn/tiny.yaml", "--set", "train.steps=300", "--set", "agent.learning_starts=100",
       "--set", "verify.checkpoint_every=100"]  # fmt: skip
GB = 1 << 30


# --- fixtures and helpers ------------------------------------------------------------------------


def _record(tmp_path_factory: pytest.TempPathFactory, argv: list[str]) -> Path:
    out = tmp_path_factory.mktemp("recorded") / "run"
    assert main(["train", *argv, "--out", str(out), "--no-tensorboard", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, SUPERVISED)


@pytest.fixture(scope="module")
def recorded_dqn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, DQN)


@pytest.fixture
def bundle(recorded: Path, tmp_path: Path) -> Path:
    shutil.copytree(recorded, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def dqn_bundle(recorded_dqn: Path, tmp_path: Path) -> Path:
    shutil.copytree(recorded_dqn, tmp_path / "dqn")
    return tmp_path / "dqn"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc: int, out: str, err: str, *needles: str, code: int = 2) -> str:
    """Exit ``code`` with one stderr line ``detrl: error: ...`` holding every needle; no traceback."""
    for bad in ("Traceback", "internal error", "RecursionError", "MemoryError"):
        assert bad not in out + err, f"{bad} in {out + err!r}"
    assert rc == code, f"exit {rc}, stdout {out!r}, stderr {err!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("detrl: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def audit_bad(
    capsys: pytest.CaptureFixture[str], run: Path, *needles: str, args: tuple[str, ...] = ()
) -> str:
    rc, out, err = cli(capsys, "audit", str(run), "--quiet", *args)
    return assert_one_line(rc, out, err, *needles)


class Hung(BaseException):
    """Raised by :func:`deadline` (a BaseException, so the CLI's own error handling cannot swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail a block that takes longer than ``seconds`` (in-process: a blocking open or read is interrupted)."""

    def fire(signum: int, frame: object) -> None:
        raise Hung(f"still running after {seconds} s: the auditor blocked")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def audit_process(run: Path, *args: str, timeout: float = 120) -> tuple[int, str, str, int]:
    """``python -m detrl.cli audit RUN --quiet ARGS`` in a fresh process: (exit code, stdout, stderr, peak
    RSS in bytes, the child's own ``ru_maxrss``), by :func:`detrl.testing.hostile.audit_subprocess`; a child still
    running after ``timeout`` s is killed and the test fails (it hung)."""
    rc, out, err, rss, _ = audit_subprocess(run, *args, timeout=timeout, cwd=REPO)
    if rc is None:
        pytest.fail(f"audit still running after {timeout} s (hung): {run}")
    if rss is None:
        pytest.fail(f"the audit's launcher failed (exit {rc}): {err}")
    return rc, out, err, rss


def test_recorded_bundles_replicate(
    recorded: Path, recorded_dqn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Control: both undamaged bundles replicate, so what each test changes is what it tests."""
    for run in (recorded, recorded_dqn):
        rc, out, err = cli(capsys, "audit", str(run), "--quiet")
        assert rc == 0, out + err


# --- the bundle names a file for the auditor to read --------------------------------------------------


def _text_file_config(run: Path, path: str) -> None:
    m = read_manifest(run)
    m["config"]["data"].update(name="text_file", path=path)
    write_manifest(run, m)
    bundle_mod.parse_manifest((run / "manifest.json").read_bytes())


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text("the auditor's own copy of a corpus. " * 400)
    return p


def test_text_file_config_without_data_is_refused(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _text_file_config(bundle, "/etc/passwd")
    audit_bad(capsys, bundle, "manifest.json", "--data PATH", "never names a file the auditor opens")


def test_text_file_config_reads_the_auditors_data_not_the_bundles_path(
    bundle: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.path names a decoy whose fingerprint the manifest claims: were the decoy read, the data would
    match. The auditor reads its own --data instead, so the data differs: diverged at step 0."""
    from detrl.supervised import data as datasets

    decoy = tmp_path / "decoy.txt"
    decoy.write_text("a file the recorder wants the auditor to read. " * 300)
    _text_file_config(bundle, str(decoy))
    d = read_manifest(bundle)["config"]["data"]
    set_field(
        bundle,
        ("data_fingerprint",),
        datasets.fingerprint(*datasets.text_file(str(decoy), d["seq_len"], d["n"])),
    )
    report = tmp_path / "report.json"
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet", "--data", str(corpus), "--json", str(report))
    assert rc == 1, out + err
    assert "data fingerprint differs" in out
    assert json.loads(report.read_text())["diverged_step"] == 0
    # control: given the decoy as --data, the fingerprint matches and the replay starts, where the digits
    # CNN cannot take text: a config no recorder could have run is bad input (it was once exit 70)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet", "--data", str(decoy))
    assert_one_line(rc, out, err, "manifest.json: config: its run fails to replay", "conv2d")


def test_text_file_config_path_is_never_opened(bundle: Path, corpus: Path, tmp_path: Path) -> None:
    """data.path names a FIFO: opening it would block, reading it would fail ("not found"); the audit
    instead compares the fingerprint of --data, and diverges at step 0 without touching the FIFO."""
    fifo = tmp_path / "trap.fifo"
    os.mkfifo(fifo)
    _text_file_config(bundle, str(fifo))
    report = tmp_path / "report.json"
    rc, out, err, _ = audit_process(bundle, "--data", str(corpus), "--json", str(report), timeout=60)
    assert "Traceback" not in out + err
    assert rc == 1, out + err
    assert "DIVERGED" in out and "data fingerprint" in out
    assert json.loads(report.read_text())["diverged_step"] == 0
    assert "trap.fifo" not in out + err


# --- a commitments file: parsed in about its own size ---------------------------------------------------


def test_parsing_commitments_costs_their_hashes_and_the_root_next_to_nothing() -> None:
    """20,000 records (1.5 MB): the parsed leaves hold their 64 hash bytes a step, no more (a list of
    tuples of two bytes held about 200 a step, so a file near the 1 GiB cap cost an auditor about 4 GiB),
    and the Merkle root, folded leaf by leaf, holds a few kilobytes beside them: not the whole tree, nor
    even a level of it (a level of 10,000 nodes is 730 KB)."""
    import tracemalloc

    n = 20_000
    pairs = [(i.to_bytes(32, "little"), (n + i).to_bytes(32, "little")) for i in range(n)]
    data = bundle_mod.COMMIT_HEADER.pack(bundle_mod.COMMIT_MAGIC, 1, 0, 0) + b"".join(
        bundle_mod.commit_record(i, s, b) for i, (s, b) in enumerate(pairs)
    )
    tracemalloc.start()
    try:
        leaves, torn = bundle_mod.parse_commitments(data)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        root = bundle_mod.merkle_root(leaves)
        _, merkle_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torn == 0 and len(leaves) == n and leaves == pairs and leaves[-1] == pairs[-1]
    assert held < 64 * n * 1.05 and peak < 64 * n * 1.1
    assert merkle_peak < held + 64 * 1024
    leaf_hashes = [commit.leaf(i, s, b) for i, (s, b) in enumerate(pairs)]
    assert root == commit.merkle_levels(leaf_hashes)[-1][0].hex()  # the whole tree's root


# --- configs that would make the auditor allocate without bound ----------------------------------------


@pytest.mark.parametrize(
    "kind, path, value, shown",
    [
        ("supervised", ("config", "model", "channels"), 20000, "model.channels=20000"),
        # (each case is a child process of about 3 s: half of them run with the slow suite)
        pytest.param(
            "supervised", ("config", "data", "n"), 10_000_000, "data.n=10000000", marks=pytest.mark.slow
        ),
        ("dqn", ("config", "agent", "buffer_size"), 10**9, "agent.buffer_size=1000000000"),
        pytest.param(
            "dqn", ("config", "agent", "hidden"), [100000], "agent.hidden=100000", marks=pytest.mark.slow
        ),
        # strings that config validation turns into numbers: the caps apply to the validated values
        pytest.param(
            "supervised",
            ("config", "model", "channels"),
            "20000",
            "model.channels=20000",
            marks=pytest.mark.slow,
        ),
        ("dqn", ("config", "agent", "hidden"), ["100000"], "agent.hidden=100000"),
    ],
)
def test_config_over_the_caps_is_refused_with_small_rss(
    request: pytest.FixtureRequest, kind: str, path: tuple[str, ...], value: Any, shown: str
) -> None:
    run = request.getfixturevalue("bundle" if kind == "supervised" else "dqn_bundle")
    set_field(run, path, value)
    rc, out, err, rss = audit_process(run, timeout=120)
    key = shown.split("=")[0]
    assert_one_line(rc, out, err, "manifest.json", shown, f"--cap {key}=N")
    assert rss < GB, f"peak RSS {rss / 2**20:.0f} MiB"


def test_cap_option_lowers_a_cap(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audit_bad(capsys, bundle, "model.channels=16", "cap 8", args=("--cap", "model.channels=8"))


def test_a_config_error_found_only_with_the_data_names_the_manifest(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Holding out every example passes config validation (the data's size is not known there) and fails
    when the data is loaded for the fingerprint: that is the manifest's error, and the line says so."""
    m = read_manifest(bundle)
    m["config"]["data"]["holdout"] = 1797  # the digits: 1797 examples
    write_manifest(bundle, m)
    audit_bad(capsys, bundle, "manifest.json: config error: data.holdout=1797: must leave training examples")


@pytest.mark.parametrize(
    "path, value, needle",
    [
        (("config", "precision"), "fp32", "precision: 'verifiable', but its config gives 'fp32'"),
        (("precision",), "fp64", "precision: 'fp64', but its config gives 'verifiable'"),
        (("hardware",), "zzz", "hardware: 'zzz', but its config gives 'native'"),
    ],
)
def test_a_manifest_claiming_another_precision_or_profile_than_its_config_is_refused(
    bundle: Path, capsys: pytest.CaptureFixture[str], path: tuple[str, ...], value: str, needle: str
) -> None:
    """The recorder wrote both from one config: a verifiable manifest over an fp32 config had replicated,
    read as verifiable, with the config still saying fp32."""
    set_field(bundle, path, value)
    audit_bad(capsys, bundle, f"manifest.json: {needle}")


# --- links, FIFOs and devices in the bundle -------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, target, needle",
    [
        ("manifest.json", "file", "manifest.json: is a symbolic link"),
        ("manifest.json", "dir", "manifest.json: is a symbolic link"),
        ("commitments", "file", "commitments: is a symbolic link"),
        ("commitments", "relative", "commitments: is a symbolic link"),
        ("roundlog", "file", "roundlog: is a symbolic link"),
        ("roundlog", "dir", "roundlog: is a symbolic link"),
        ("checkpoints", "dir", "checkpoints is a symbolic link"),
        (CKPT4, "file", f"{CKPT4}: is a symbolic link"),
    ],
)
def test_symlink_out_of_the_bundle_is_refused(
    bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str, target: str, needle: str
) -> None:
    """Each link points at a faithful copy of what it replaces: only being a link is wrong with it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    src = bundle / entry
    copy = outside / src.name
    if src.is_dir():
        shutil.copytree(src, copy)
        shutil.rmtree(src)
    else:
        shutil.copy(src, copy)
        src.unlink()
    if target == "dir" and not copy.is_dir():
        copy = outside
    src.symlink_to(os.path.relpath(copy, src.parent) if target == "relative" else copy)
    with deadline(60):
        audit_bad(capsys, bundle, needle)


def test_bundle_directory_itself_may_be_a_link(
    bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Control: the directory the auditor names is the auditor's choice; links are refused below it."""
    link = tmp_path / "link_to_run"
    link.symlink_to(bundle)
    rc, out, err = cli(capsys, "audit", str(link), "--quiet")
    assert rc == 0, out + err


def test_fifo_as_manifest_is_refused_without_hanging(bundle: Path) -> None:
    (bundle / "manifest.json").unlink()
    os.mkfifo(bundle / "manifest.json")
    t0 = time.monotonic()
    rc, out, err, _ = audit_process(bundle, timeout=60)
    assert_one_line(rc, out, err, "manifest.json: not a regular file")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("entry", ["commitments", "roundlog", CKPT4])
def test_fifo_as_bundle_file_is_refused(bundle: Path, capsys: pytest.CaptureFixture[str], entry: str) -> None:
    (bundle / entry).unlink()
    os.mkfifo(bundle / entry)
    with deadline(60):
        audit_bad(capsys, bundle, f"{entry}: not a regular file")


@pytest.mark.parametrize("entry", ["manifest.json", "commitments"])
def test_link_to_dev_zero_is_refused(bundle: Path, capsys: pytest.CaptureFixture[str], entry: str) -> None:
    (bundle / entry).unlink()
    (bundle / entry).symlink_to("/dev/zero")
    with deadline(60):
        audit_bad(capsys, bundle, f"{entry}: is a symbolic link")


@pytest.mark.parametrize("entry", ["roundlog", CKPT4])
def test_link_to_dev_zero_is_refused_without_a_big_read(bundle: Path, entry: str) -> None:
    """The files whose caps are gigabytes: in a fresh process, with its peak RSS."""
    (bundle / entry).unlink()
    (bundle / entry).symlink_to("/dev/zero")
    rc, out, err, rss = audit_process(bundle, timeout=60)
    assert_one_line(rc, out, err, f"{entry}: is a symbolic link")
    assert rss < GB, f"peak RSS {rss / 2**20:.0f} MiB"


# --- a decompression bomb in the rounding log --------------------------------------------------------------


@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_zstd_bomb_in_a_durable_segment(bundle: Path) -> None:
    bomb = plant_bomb(bundle, 1, 512 << 20)
    assert len(bomb) < 64 << 10  # ~20 KB on disk ...
    assert struct.unpack_from("<Q", bomb, 16)[0] > 500 << 20  # ... 512 MiB once decompressed
    with RoundLogReader(bundle / "roundlog") as reader:  # the bomb is well formed: a reader goes through it
        cursor = reader.cursor(1)
        cursor.finish()
        assert cursor.skipped_records == 1
    rc, out, err, rss = audit_process(bundle, timeout=300)
    assert "Traceback" not in out + err and "internal error" not in err
    assert rc in (1, 2, 3, 4), out + err
    assert rss < GB, f"peak RSS {rss / 2**20:.0f} MiB"


def test_segment_declaring_more_than_the_limit_is_refused(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = bundle / "roundlog"
    data = bytearray(log.read_bytes())
    head = struct.pack("<4sQIQQ", b"RSEG", 1, 1, 1 << 40, 9)
    data[16:52] = head + struct.pack("<I", 0)
    log.write_bytes(bytes(data))
    audit_bad(capsys, bundle, "roundlog", "raw length 1099511627776 exceeds limit")


# --- deep JSON -----------------------------------------------------------------------------------------------


def test_manifest_config_nested_1000_deep(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    set_literal(bundle, ("config", "model", "deep"), b"[" * 1000 + b"]" * 1000)
    audit_bad(capsys, bundle, "manifest.json", "levels deep, more than 32")


def test_manifest_objects_nested_1000_deep(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    set_literal(bundle, ("sources", "deep"), b'{"a":' * 1000 + b"0" + b"}" * 1000)
    audit_bad(capsys, bundle, "manifest.json", "levels deep, more than 32")


@pytest.mark.parametrize("where", ["metadata", "header"])
def test_checkpoint_json_nested_1000_deep(
    bundle: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    from safetensors.torch import load, save

    path = bundle / CKPT4
    tensors = load(path.read_bytes())
    deep = "[" * 1000 + "]" * 1000
    if where == "metadata":  # the detrl metadata string
        path.write_bytes(save(tensors, metadata={"detrl": deep}))
    else:  # the safetensors header itself
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = data[8 : 8 + n].rstrip()
        header = header[:-1] + b', "deep": ' + deep.encode() + b"}"
        header += b" " * (-len(header) % 8)
        path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])
    rehash_checkpoints(bundle)
    audit_bad(capsys, bundle, CKPT4, "nested 100")


# --- the switchboard state in the manifest ----------------------------------------------------------------

BAD_SOURCES = [
    (("sources",), {}),
    (("sources", "seed"), {}), (("sources", "seed"), "0"), (("sources", "seed"), "x"), (("sources", "seed"), 10**30),
    (("sources", "seed"), -1), (("sources", "seed"), True), (("sources", "seed"), 0.0), (("sources", "seed"), None),
    (("sources", "seeds"), []), (("sources", "seeds"), "init"),
    (("sources", "seeds", "init"), "x"), (("sources", "seeds", "init"), 10**30), (("sources", "seeds", "init"), -5),
    (("sources", "seeds", "init"), 2**64), (("sources", "seeds", "init"), 1.5), (("sources", "seeds", "init"), {}),
    (("sources", "seeds", "bogus"), 1),
    (("sources", "bitflip"), "x"), (("sources", "bitflip"), 1), (("sources", "bitflip"), None),
    (("sources", "unseeded"), 5), (("sources", "unseeded"), [5]), (("sources", "unseeded"), "init"),
    (("sources", "torch"), [1]), (("sources", "torch"), {"init": "!!"}), (("sources", "torch"), {"init": "AAAA"}),
    (("sources", "numpy"), 5), (("sources", "numpy"), {"init": {"a": 1}}),
    (("sources", "extra"), 1),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, value", BAD_SOURCES, ids=[f"{'.'.join(p)}={v!r}"[:50] for p, v in BAD_SOURCES]
)
def test_manifest_sources_wrong(
    bundle: Path, capsys: pytest.CaptureFixture[str], path: tuple[str, ...], value: Any
) -> None:
    set_field(bundle, path, value)
    audit_bad(capsys, bundle, "manifest.json", "sources")


# --- numbers JSON or a float cannot hold --------------------------------------------------------------------

HUGE_AT = [("margin",), ("durable", "step"), ("config", "optimizer", "lr"), ("stats", "logged"), ("sources", "seed"),
           ("thresholds", "default"), ("thresholds", "per_op", "mm"), ("config", "train", "steps"), ("calibration_steps",)]  # fmt: skip
LITERALS = [
    b"1" + b"0" * 400,
    b"-1" + b"0" * 400,
    b"1e999",
    b"-1e999",
    b"1E+400",
    b"NaN",
    b"Infinity",
    b"1" * 41,
]


@pytest.mark.parametrize("path", HUGE_AT, ids=[".".join(p) for p in HUGE_AT])
@pytest.mark.parametrize("literal", LITERALS, ids=[lit[:8].decode() for lit in LITERALS])
def test_manifest_huge_number(
    bundle: Path, capsys: pytest.CaptureFixture[str], path: tuple, literal: bytes
) -> None:
    set_literal(bundle, path, literal)
    audit_bad(capsys, bundle, "manifest.json", "not valid JSON")


def test_manifest_huge_number_in_a_list(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = read_manifest(bundle)
    m["config"]["optimizer"]["betas"] = ["__LITERAL__", 0.999]
    write_manifest(bundle, m)
    p = bundle / "manifest.json"
    p.write_bytes(p.read_bytes().replace(b'"__LITERAL__"', b"1e999"))
    audit_bad(capsys, bundle, "manifest.json", "1e999 is not finite")


# --- detrl train -------------------------------------------------------------------------------------------------


def test_train_out_is_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("not a bundle")
    rc, out, err = cli(capsys, "train", *SUPERVISED, "--out", str(target), "--no-tensorboard", "--quiet")
    assert_one_line(rc, out, err, str(target), "not a directory")
    assert target.read_text() == "not a bundle"
