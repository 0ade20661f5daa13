"""Segment-parallel audits (``detrl audit --workers N``) give the sequential audit's report.

The bundle is the digits_cnn recipe, 8 steps with a checkpoint every 2: four segments. Each case damages a
copy of it (a commitment, a log entry, a checkpoint, the commitments file, a killed or stopped recording)
and compares the parallel audit's verdict, diverged step, message, exit code and per-step stats with the
sequential audit's. Most cases replay the segments in this process through the same code path, in
reverse order (the merge must not depend on which segment finishes first), so they stay fast; one test
goes through the process pool and the CLI, and a slow one through a local Ray instance.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detrl.apps import audit as audit_mod
from detrl.cli import main
from detrl.core.engine import Session
from detrl.formats import bundle as bundle_mod
from detrl.formats.bundle import BundleError
from detrl.formats.roundlog import OpEntries
from detrl.run import config as config_mod
from detrl.run import executors, sessions
from detrl.supervised import train as supervised
from detrl.testing.logrewrite import rewrite

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "supervised" / "digits_cnn.yaml"
STEPS, EVERY = 8, 2
SETS = (f"train.steps={STEPS}", f"verify.checkpoint_every={EVERY}", "name=parallel_audit")


# Recorded under rounding-rule revision 2, whose digits CNN log has entries that matter (conftest.py).
pytestmark = pytest.mark.usefixtures("rules_revision_2")


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("honest") / "run"
    argv = ["train", str(CONFIG), "--out", str(run), "--quiet", "--no-tensorboard"]
    for s in SETS:
        argv += ["--set", s]
    assert main(argv) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        f"step_{s:08d}.safetensors" for s in range(EVERY, STEPS + 1, EVERY)
    ]
    return run


# --- tampering -------------------------------------------------------------------------------------


def change_commitment(run: Path, step: int) -> None:
    """Step ``step``'s state hash changed (a valid record, the manifest resealed): a false commitment."""
    raw = bytearray((run / "commitments").read_bytes())
    at = bundle_mod.COMMIT_HEADER.size + step * bundle_mod.COMMIT_RECORD.size
    _, _, batch, _ = bundle_mod.COMMIT_RECORD.unpack_from(raw, at)
    raw[at : at + bundle_mod.COMMIT_RECORD.size] = bundle_mod.commit_record(step, bytes(32), batch)
    (run / "commitments").write_bytes(bytes(raw))
    bundle_mod.reseal(run)


def flip_log_entry(run: Path, step: int) -> None:
    """The direction of the first logged element of ``step`` flipped (a well-formed log, resealed)."""

    def transform(s: int, ops: dict[int, OpEntries]) -> dict[int, OpEntries]:
        if s == step:
            op = min(ops)
            e = ops[op]
            up = e.up.copy()
            up[0] = not up[0]
            ops[op] = OpEntries(op, e.indices, up)
        return ops

    rewrite(run / "roundlog", run / "roundlog.forged", transform)
    (run / "roundlog.forged").replace(run / "roundlog")
    bundle_mod.reseal(run)


def flip_checkpoint(run: Path, step: int, reseal: bool = True) -> None:
    """One byte of the tensor data of ``step``'s checkpoint flipped; ``reseal``: its SHA-256 updated."""
    path = run / bundle_mod.checkpoint_name(step)
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    raw[8 + header + (len(raw) - 8 - header) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    if reseal:
        bundle_mod.reseal(run)


def cut_commitments(run: Path, step: int) -> None:
    """The commitments file cut after step ``step``'s record (the manifest still claims all of them)."""
    raw = (run / "commitments").read_bytes()
    (run / "commitments").write_bytes(
        raw[: bundle_mod.COMMIT_HEADER.size + (step + 1) * bundle_mod.COMMIT_RECORD.size]
    )


class _Interrupt(Exception):
    pass


def record_interrupted(run: Path, at: int, how: str) -> None:
    """Record the run again, ``killed`` after step ``at`` (no finish: the manifest says ``recording``, its
    durable point the last checkpoint) or ``stopped`` there (Ctrl-C: a stopped, resumable bundle)."""

    class Interrupted(Session):
        def on_commit(self, step: int, frozen: bool) -> None:
            if step == at and how == "killed":
                raise _Interrupt
            if step == at:
                self.stop_requested = True

    cfg = _config()
    session = sessions.session_for(cfg, run, "record", session_type=Interrupted, force=True)
    try:
        with session:
            supervised.run(cfg, session)
    except _Interrupt:
        pass


def _config() -> Any:
    return config_mod.load(CONFIG, list(SETS))


CASES: dict[str, Callable[[Path], None]] = {
    "honest": lambda run: None,
    "commitment at 5": lambda run: change_commitment(run, 5),
    "log entry at 5": lambda run: flip_log_entry(run, 5),
    "checkpoint 4 resealed": lambda run: flip_checkpoint(run, 4),
    "checkpoint 4 stale": lambda run: flip_checkpoint(run, 4, reseal=False),
    "last checkpoint resealed": lambda run: flip_checkpoint(run, STEPS),
    "commitments cut short": lambda run: cut_commitments(run, 5),
    # the sequential audit stops at its first failure: a later segment's bad input does not count...
    "commitment at 3, checkpoint 6 stale": lambda run: (change_commitment(run, 3), flip_checkpoint(run, 6, False)),
    # ...and an earlier one's bad input outranks a later divergence
    "checkpoint 2 stale, commitment at 7": lambda run: (change_commitment(run, 7), flip_checkpoint(run, 2, False)),
    "killed after step 5": lambda run: record_interrupted(run, 5, "killed"),
    "stopped after step 5": lambda run: record_interrupted(run, 5, "stopped"),
}  # fmt: skip


# --- audits ----------------------------------------------------------------------------------------


def outcome(run: Path, **kw: Any) -> dict[str, Any]:
    """The audit's whole report as JSON, or its bad input's line."""
    try:
        report = audit_mod.audit(run, **kw)
    except BundleError as e:
        return {"verdict": "bad input", "message": str(e)}
    return report.to_json()


def in_process(fn: Any, jobs: Any, workers: int, on_done: Any, names: Any = None) -> None:
    """``executors.run_local``, but in this process and finishing the last segment first."""
    for i in reversed(range(len(jobs))):
        on_done(i, fn(*jobs[i]))


@pytest.mark.parametrize("case", list(CASES))
def test_segments_merge_into_the_sequential_report(
    case: str, bundle: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    CASES[case](bundle)
    sequential = outcome(bundle)
    monkeypatch.setattr(executors, "run_local", in_process)
    capsys.readouterr()
    parallel = outcome(bundle, workers=2, progress=True)
    assert parallel == sequential
    expected = {
        "honest": ("replicated", None),
        "commitment at 5": ("diverged", 5),
        "checkpoint 4 resealed": ("diverged", 4),
        "last checkpoint resealed": ("diverged", STEPS),
        "checkpoint 4 stale": ("bad input", None),
        "commitments cut short": ("bad input", None),
        "commitment at 3, checkpoint 6 stale": ("diverged", 3),
        "checkpoint 2 stale, commitment at 7": ("bad input", None),
        "killed after step 5": ("incomplete", None),
        "stopped after step 5": ("replicated", None),
    }
    if case in expected:
        assert (sequential["verdict"], sequential.get("diverged_step")) == expected[case], sequential
    else:  # a flipped direction changes the state, or the replay refuses the entry
        assert sequential["verdict"] in ("diverged", "log incomplete"), sequential
    err = capsys.readouterr().err
    if sequential["verdict"] == "replicated":  # every segment reported, in the order they finished
        lines = [line for line in err.splitlines() if line.startswith("segment ")]
        assert lines[0].startswith("segment 4/4 steps 7..8 replicated (") or "stopped" in case, err
        assert len(lines) == (4 if case == "honest" else 3), err


def test_segments_are_cut_at_checkpoints() -> None:
    assert audit_mod.segments(8, [2, 4, 6, 8], 8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert audit_mod.segments(8, [2, 4, 6, 8], 2) == [(0, 4), (4, 8)]
    assert audit_mod.segments(200, list(range(25, 201, 25)), 4) == [
        (0, 50),
        (50, 100),
        (100, 150),
        (150, 200),
    ]
    assert audit_mod.segments(7, [2, 4, 6], 8) == [(0, 2), (2, 4), (4, 6), (6, 7)]  # killed after 7
    assert audit_mod.segments(8, [], 8) == [(0, 8)]
    # 12 intervals for at most 8 segments: the longer ones first, none more than one interval longer
    assert audit_mod.segments(120, list(range(10, 121, 10)), 8) == [
        *((i, i + 20) for i in range(0, 80, 20)),
        *((i, i + 10) for i in range(80, 120, 10)),
    ]
    assert audit_mod.segments(8, [8], 8) == [(0, 8)]


def test_a_replayed_segment_checks_its_own_steps_and_checkpoints(honest: Path) -> None:
    cfg = _config()
    full = sessions.session_for(cfg, honest, "replay")
    with full:
        supervised.run(cfg, full)
        full.verify_checkpoints()
    seg = sessions.session_for(cfg, honest, "replay", start=2, stop=5)
    with seg:
        supervised.run(cfg, seg)
        seg.verify_checkpoints()
    assert seg.step_index == 5 and seg._verified == {2, 4}
    assert seg.step_stats == full.step_stats[2:5]
    assert seg.totals.rounded_elements == sum(s.rounded_elements for s in full.step_stats[2:5]) > 0
    with pytest.raises(BundleError, match="no checkpoint of step 3 to replay from"):
        sessions.session_for(cfg, honest, "replay", start=3)
    with pytest.raises(BundleError, match="a replay to step 9, but the bundle holds 8"):
        sessions.session_for(cfg, honest, "replay", start=2, stop=9)
    with pytest.raises(ValueError, match="0 <= start < stop"):
        sessions.session_for(cfg, honest, "replay", start=4, stop=4)
    with pytest.raises(ValueError, match="need mode='replay'"):
        sessions.session_for(cfg, None, "off", start=2)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow  # starting the two worker processes takes seconds; the merge is tested in-process above
@pytest.mark.parametrize("case", ["honest", "commitment at 5"])
def test_cli_workers_in_a_process_pool(
    case: str, bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    CASES[case](bundle)
    rc1, out1, _ = _cli(capsys, "audit", str(bundle), "--quiet", "--json", str(tmp_path / "1.json"))
    rc2, out2, err2 = _cli(capsys, "audit", str(bundle), "--workers", "2", "--json", str(tmp_path / "2.json"))
    assert (rc2, out2) == (rc1, out1) and rc1 == (0 if case == "honest" else 1)
    assert json.loads((tmp_path / "2.json").read_text()) == json.loads((tmp_path / "1.json").read_text())
    assert "audit: 8 steps in 4 segments between checkpoints, in 2 worker processes" in err2
    assert "segment 3/4 steps 5..6 diverged at step 5 (" in err2 or case == "honest", err2


@pytest.mark.slow  # a fresh `detrl audit --workers 2` for each moment, a few seconds each
@pytest.mark.parametrize("moment", ["workers importing", "segments submitted"])
def test_ctrl_c_to_a_parallel_audit_is_one_line(moment: str, honest: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: the parent, the process the workers fork from
    (still importing torch a second in) and the workers. One line, exit 130, no traceback from anyone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    for _attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "detrl.cli", "audit", str(honest), "--workers", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert proc.stderr is not None
        if moment == "workers importing":
            time.sleep(1.0)
            early = ""
        else:  # the parent has checked the bundle and handed the segments to the pool
            early = proc.stderr.readline()
            assert early.startswith("audit: 8 steps in 4 segments"), early
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        # On a loaded machine this process can wake after the audit is over (it then ignores a late Ctrl-C
        # while it exits): that attempt missed its moment, and a fresh audit tries again.
        if not (proc.returncode == 0 and "segment 4/4 steps 7..8 replicated" in err):
            break
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, early + err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "detrl: interrupted", err


def test_workers_below_one_is_a_usage_error(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli(capsys, "audit", str(bundle), "--workers", "0")
    assert rc == 2 and err.strip() == "detrl: error: --workers must be at least 1, not 0"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["honest", "log entry at 5"])
def test_ray_local_gives_the_sequential_report(case: str, bundle: Path) -> None:
    pytest.importorskip("ray")
    CASES[case](bundle)
    assert outcome(bundle, workers=2, ray="local") == outcome(bundle)


def test_replayed_results_are_small_and_picklable(honest: Path) -> None:
    """What a worker sends back: a few numbers per step, never tensors (Ray and the pool pickle it)."""
    import pickle

    job = audit_mod.SegmentJob(str(honest), "native", _raw_config(honest), None, None, None, 4, 8)
    job = dataclasses.replace(job, fingerprint=_fingerprint(honest))
    r = audit_mod.replay_segment(job)
    assert not r.failed and len(r.step_stats) == 4
    assert len(pickle.dumps(r)) < 4096


def _raw_config(run: Path) -> dict[str, Any]:
    return json.loads((run / "manifest.json").read_text())["config"]


def _fingerprint(run: Path) -> str:
    return json.loads((run / "manifest.json").read_text())["data_fingerprint"]
