"""Crash safety end to end: Ctrl-C, SIGKILL at every durable point, a second writer, resumes that never destroy.

Recordings are ``configs/dqn/tiny.yaml`` and ``configs/supervised/digits_cnn.yaml`` shaped as in
:data:`detrl.testing.crashtest.KINDS`; each is recorded once per module, uninterrupted, as the reference every
interrupted and resumed bundle must equal byte for byte (:func:`detrl.testing.crashtest.bundle_files_equal`).
Interrupted runs are real ``detrl`` processes; precise kills go through the driver in
:mod:`detrl.testing.crashtest`. The default run takes the fast cases (about a minute); ``-m slow`` adds Ctrl-C at
wall-clock moments and the SIGKILL matrix (a few minutes on two cores).
"""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from detrl.apps.audit import audit
from detrl.cli import main
from detrl.formats.bundle import BundleError
from detrl.testing import crashtest as ct

STOP_NOTICE = "detrl: stopping after this step (Ctrl-C again to abort)"
#: An interrupted ``detrl`` exits 130; where the Ctrl-C lands inside code torch runs through
#: ``PyRun_String`` while importing, CPython itself ends the process by SIGINT instead (a shell shows 130).
INTERRUPTED = (130, -signal.SIGINT)


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, ct.Reference]:
    """Each kind recorded uninterrupted (in parallel, through the driver, which traces its file calls)."""
    return ct.references(ct.KINDS, tmp_path_factory.mktemp("refs"), jobs=2)


def ref(refs, kind: str) -> Path:
    return refs[kind][0]


def _as_from_a_terminal() -> None:
    # A child inherits ignored and blocked signals across exec: whatever this test process inherited or
    # set up (a library's threads, a parent that ignores SIGINT), the child starts as a shell starts it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def popen(*args: str) -> subprocess.Popen:
    """``detrl ARGS`` in a fresh process (as a user runs it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "detrl.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ct.child_env(),
        preexec_fn=_as_from_a_terminal,
    )


def wait_until(cond, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll ``cond()`` until it holds (True) or ``proc`` exits first (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            return cond()
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the recording")
        time.sleep(0.003)
    return True


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def verdict(run_dir: Path, hardware: str = "native") -> int:
    """``detrl audit``'s exit code, in-process."""
    try:
        return audit(run_dir, hardware=hardware).exit_code
    except BundleError:
        return 2


def cli(capsys, *args: str) -> tuple[int, str]:
    """``detrl ARGS`` in-process: (exit code, stderr)."""
    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_stopped_replicates_and_resumes(run_dir: Path, reference: Path, capsys) -> None:
    """A Ctrl-C-stopped bundle: audits replicated natively and on splitk; a plain resume gives ``reference``."""
    m = ct.read_manifest(run_dir)
    assert m is not None and m["status"] == "stopped", m
    assert m["stopped_at"] == m["durable"]["step"] < m["planned_steps"]
    for hardware in ("native", "emulated:splitk"):
        assert verdict(run_dir, hardware) == 0, hardware
    rc, err = cli(capsys, *ct.resume_cmd(run_dir))
    assert rc == 0, err
    assert ct.bundle_files_equal(run_dir, reference) == []


def kill_at(kind: str, run_dir: Path, spec: str) -> None:
    """Record ``kind`` into ``run_dir`` and SIGKILL it as the driver's ``spec`` says."""
    p = ct.run(ct.child_cmd(ct.train_cmd(kind, run_dir), spec))
    assert p.returncode == -signal.SIGKILL, p.stderr


# ---------------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize(
    "kind, after",
    # each about 15 s on 2 cores: with the slow suite (the fast one stops a run at start-up, below)
    [pytest.param("dqn", 400, marks=pytest.mark.slow), pytest.param("digits", 15, marks=pytest.mark.slow)],
)
def test_ctrl_c_mid_run_stops_a_bundle_that_replicates_and_resumes_to_the_reference(
    tmp_path, refs, capsys, kind, after
):
    d = tmp_path / "run"
    proc = popen(*ct.train_cmd(kind, d))
    assert wait_until(lambda: ct.records_written(d) > after, proc), "finished before the Ctrl-C"
    proc.send_signal(signal.SIGINT)
    rc, err = finish(proc)
    assert rc == 0, err
    assert STOP_NOTICE in err and "Traceback" not in err
    assert ct.durable_step(d) >= after
    assert_stopped_replicates_and_resumes(d, ref(refs, kind), capsys)


@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_ctrl_c_before_the_first_step_stops_at_step_0_and_resumes(tmp_path, refs, capsys):
    d = tmp_path / "run"
    proc = popen(*ct.train_cmd("digits", d))
    wait_until(lambda: (d / "manifest.json").exists(), proc)  # the writer is open: the run has not started
    proc.send_signal(signal.SIGINT)
    rc, err = finish(proc)
    assert rc == 0, err
    assert STOP_NOTICE in err
    assert ct.durable_step(d) <= 1  # the step under way when the signal came, at most
    assert_stopped_replicates_and_resumes(d, ref(refs, "digits"), capsys)


#: Runs ``detrl ARGV`` with an import hook that sends the process a SIGINT the moment torch starts to be
#: imported: start-up, before the run's own Ctrl-C handler exists, on a busy machine as on an idle one.
_CTRL_C_WHILE_IMPORTING_TORCH = """
import os, signal, sys, time

class CtrlCOnTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
            # The handler runs inside this sleep, so the KeyboardInterrupt comes from within torch's import.
            # (Left to whichever later bytecode checks for signals, it was once lost: in a fast suite on a
            # loaded machine, the run went on to the end as if never interrupted.)
            time.sleep(5)
        return None

sys.meta_path.insert(0, CtrlCOnTorch())
from importlib.metadata import entry_points
(detrl,) = entry_points(group="console_scripts", name="detrl")
sys.exit(detrl.load()(sys.argv[1:]))
"""


def test_ctrl_c_during_start_up_is_one_line_and_leaves_nothing(tmp_path):
    d = tmp_path / "run"
    p = ct.run([sys.executable, "-c", _CTRL_C_WHILE_IMPORTING_TORCH, *ct.train_cmd("dqn", d)])
    assert p.returncode in INTERRUPTED, p.stderr
    assert one_line(p.stderr) == "detrl: interrupted"
    assert not d.exists()


@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_a_second_ctrl_c_aborts_with_one_line_and_a_bundle_that_still_audits(tmp_path):
    # Ctrl-C after step 15, then again while the stop's checkpoint is being made durable (the driver sends
    # both at those exact points; write 6 is that checkpoint: after the start, step 0, calibration, step 10)
    d = tmp_path / "run"
    p = ct.run(ct.child_cmd(ct.train_cmd("digits", d), "step:15:sigint,write_atomic:6:sigint"))
    assert p.returncode in INTERRUPTED, p.stderr
    assert one_line(p.stderr.replace(STOP_NOTICE, "")) == "detrl: interrupted"
    assert ct.read_manifest(d)["status"] == "recording" and ct.durable_step(d) == 10
    assert verdict(d) == 3


@pytest.mark.slow
def test_a_second_ctrl_c_from_outside_is_one_line_or_too_late_to_matter(tmp_path):
    d = tmp_path / "run"
    proc = popen(*ct.train_cmd("digits", d))
    assert wait_until(lambda: ct.records_written(d) > 12, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    seen = [proc.stderr.readline() for _ in range(2)]  # "\n", then the notice: the handler ran
    assert seen[1].strip() == STOP_NOTICE
    proc.send_signal(signal.SIGINT)
    rc, err = finish(proc)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if rc == 0:  # the stop was through before the second Ctrl-C: it came too late to abort anything
        assert err.strip() == "" and ct.read_manifest(d)["status"] == "stopped"
    else:
        assert rc in INTERRUPTED and one_line(err) == "detrl: interrupted"
    assert verdict(d) in (0, 3)


@pytest.mark.slow
def test_ctrl_c_at_wall_clock_moments(tmp_path, refs):
    """Ctrl-C 1.5 s, 3 s and 5 s after ``detrl train`` starts: interrupted while starting (nothing left),
    stopped (replicates on two profiles, resumes to the reference), or already finished (the reference)."""

    def one(case: tuple[str, float]) -> list[str]:
        kind, seconds = case
        d = tmp_path / f"{kind}-{seconds}"
        proc = popen(*ct.train_cmd(kind, d))
        time.sleep(seconds)
        proc.send_signal(signal.SIGINT)
        rc, err = finish(proc)
        where = f"{kind} at {seconds} s"
        if rc in INTERRUPTED:  # before the handler: torch was still loading
            return [] if err.strip() == "detrl: interrupted" and not d.exists() else [f"{where}: {rc} {err}"]
        m = ct.read_manifest(d)
        if rc != 0 or m is None:
            return [f"{where}: exit {rc}: {err[-300:]}"]
        problems = []
        if m["status"] == "stopped":
            for hardware in ("native", "emulated:splitk"):
                code, line = ct.audit_code(d, hardware)
                if code != 0:
                    problems.append(f"{where}: audit on {hardware}: {code} {line}")
            p = ct.run(ct.python_cmd("-m", "detrl.cli", *ct.resume_cmd(d)))
            if p.returncode != 0:
                problems.append(f"{where}: resume: {p.returncode} {p.stderr[-300:]}")
        return problems + [f"{where}: {x}" for x in ct.bundle_files_equal(d, ref(refs, kind))]

    cases = [(kind, s) for kind in ct.KINDS for s in (1.5, 3.0, 5.0)]
    with ThreadPoolExecutor(2) as pool:
        problems = [p for ps in pool.map(one, cases) for p in ps]
    assert problems == []


# ---------------------------------------------------------------------------------------------- SIGKILL
@pytest.mark.slow
def test_sigkill_matrix_every_killed_bundle_is_incomplete_and_resumes_to_the_reference(tmp_path, refs):
    """SIGKILL before and after checkpoint writes and manifest replacements, inside them (temp file not
    renamed, records not fsynced), at random steps and times, and in resumes of killed and of stopped
    bundles (see :func:`detrl.testing.crashtest.matrix`): each killed bundle audits incomplete (never bad input),
    its durable step never goes back, a resume killed re-recording held steps changes nothing, and a
    plain resume completes it to the reference."""
    outcomes = ct.run_matrix(ct.KINDS, tmp_path, jobs=2, core_only=True, refs=refs)
    assert len(outcomes) >= 20
    failed = [f"{o.point.kind} {o.point.name}: {o.problems}" for o in outcomes if not o.ok]
    assert failed == []
    verdicts = {v for o in outcomes for v in o.verdicts}
    assert 3 in verdicts and verdicts <= {0, 2, 3}
    # 2 only where a recording was killed before its first manifest (no bundle yet: nothing recorded)
    assert all(o.notes for o in outcomes if 2 in o.verdicts)


# ---------------------------------------------------------------------------------------------- one writer
@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_a_second_writer_is_refused_and_an_existing_bundle_is_left_alone(tmp_path, refs, capsys):
    d = tmp_path / "D"
    first = popen(*ct.train_cmd("dqn", d))
    assert wait_until(lambda: ct.records_written(d) > 1, first)
    for args in (ct.train_cmd("dqn", d), ct.train_cmd("dqn", d, "--force"), ct.resume_cmd(d)):
        rc, err = cli(capsys, *args)
        assert rc == 2 and "another detrl process" in one_line(err), (args, err)
    rc, err = finish(first)
    assert rc == 0, err
    assert ct.bundle_files_equal(d, ref(refs, "dqn")) == []  # the refused writers changed nothing

    before = ct.snapshot(d)
    rc, err = cli(capsys, "train", *ct.KINDS["dqn"], "--out", str(d), "--quiet")  # TensorBoard on
    assert rc == 2 and "already there" in one_line(err) and "--force" in err
    assert ct.snapshot(d) == before and not (d / "tb").exists()

    (d / "checkpoints" / "step_00000250.safetensors").write_bytes(b"an old bundle")
    rc, err = cli(capsys, *ct.train_cmd("dqn", d, "--force"))
    assert rc == 0, err
    assert ct.bundle_files_equal(d, ref(refs, "dqn")) == []  # recorded afresh


def test_resume_refusals_leave_the_bundle_unchanged(tmp_path, refs, capsys):
    rc, err = cli(capsys, "train", "--resume", str(ref(refs, "dqn")), "--out", str(tmp_path / "y"))
    assert rc == 2 and "--out is not allowed" in one_line(err)
    assert not (tmp_path / "y").exists()
    for kind, args, message in (
        ("digits", [], "nothing to resume"),  # complete
        ("dqn", ["--set", "train.steps=1200"], "would change steps already recorded"),  # its schedules
    ):
        d = tmp_path / kind
        shutil.copytree(ref(refs, kind), d)
        before = ct.snapshot(d)
        rc, err = cli(capsys, *ct.resume_cmd(d), *args)
        assert rc == 2 and message in one_line(err), err
        assert ct.snapshot(d) == before


def test_resume_extends_a_supervised_bundle(tmp_path, refs, capsys):
    d = tmp_path / "digits"
    shutil.copytree(ref(refs, "digits"), d)
    rc, err = cli(capsys, *ct.resume_cmd(d), "--set", "train.steps=50")
    assert rc == 0, err
    m = ct.read_manifest(d)
    assert m["status"] == "complete" and m["planned_steps"] == m["durable"]["step"] == 50
    held = (ref(refs, "digits") / "commitments").read_bytes()
    assert (d / "commitments").read_bytes()[: len(held)] == held  # the 40 recorded steps, as they were
    assert verdict(d) == 0


@pytest.fixture
def killed(tmp_path) -> Path:
    """A digits recording SIGKILLed after step 25: durable through the checkpoint at 20, records to 25."""
    d = tmp_path / "killed"
    kill_at("digits", d, "step:25")
    assert ct.durable_step(d) == 20 and ct.records_written(d) == 26
    return d


def test_a_resume_refused_for_a_corrupted_checkpoint_changes_nothing(killed, capsys):
    ckpt = killed / "checkpoints" / "step_00000020.safetensors"
    data = bytearray(ckpt.read_bytes())
    data[-1] ^= 1
    ckpt.write_bytes(bytes(data))
    before = ct.snapshot(killed)
    rc, err = cli(capsys, *ct.resume_cmd(killed))
    assert rc == 2 and "SHA-256 does not match" in one_line(err)
    assert ct.snapshot(killed) == before


def test_a_resume_that_re_records_a_different_step_changes_nothing(killed, capsys):
    # Step 23 lies past the durable point: only the re-recording can tell it was altered.
    path = killed / "commitments"
    data = bytearray(path.read_bytes())
    at = 16 + 23 * 76
    data[at + 8] ^= 1  # the state hash
    data[at + 72 : at + 76] = struct.pack("<I", zlib.crc32(bytes(data[at : at + 72])))
    path.write_bytes(bytes(data))
    before = ct.snapshot(killed)
    rc, err = cli(capsys, *ct.resume_cmd(killed))
    assert rc == 2 and "resumed step 23 differs" in one_line(err) and "unchanged" in err
    assert ct.snapshot(killed) == before


def test_a_refused_resume_leaves_no_tensorboard_files_and_tb_is_never_followed(killed, tmp_path, capsys):
    resume = [a for a in ct.resume_cmd(killed) if a != "--no-tensorboard"]  # TensorBoard on
    # Refused while re-recording the held steps: TensorBoard's events wait in memory and are dropped.
    path = killed / "commitments"
    original = path.read_bytes()
    data = bytearray(original)
    at = 16 + 23 * 76
    data[at + 8] ^= 1
    data[at + 72 : at + 76] = struct.pack("<I", zlib.crc32(bytes(data[at : at + 72])))
    path.write_bytes(bytes(data))
    before = ct.snapshot(killed)
    rc, err = cli(capsys, *resume)
    assert rc == 2 and "resumed step 23 differs" in one_line(err)
    assert ct.snapshot(killed) == before and not (killed / "tb").exists()
    # tb/ a link out of the bundle: refused before anything, and nothing is written through it.
    path.write_bytes(original)
    outside = tmp_path / "outside"
    outside.mkdir()
    (killed / "tb").symlink_to(outside)
    before = ct.snapshot(killed)
    rc, err = cli(capsys, *resume)
    assert rc == 2 and "tb: is a symbolic link" in one_line(err)
    assert ct.snapshot(killed) == before and list(outside.iterdir()) == []
    # A resume that goes on writes its events (those of the re-recorded steps too) into tb/.
    (killed / "tb").unlink()
    rc, err = cli(capsys, *resume)
    assert rc == 0, err
    assert [p.name.startswith("events.out.tfevents.") for p in (killed / "tb").iterdir()] == [True]


@pytest.mark.slow
def test_a_torn_last_record_is_cut_and_the_resume_gives_the_reference(killed, refs, capsys):
    with open(killed / "commitments", "ab") as f:
        f.write(b"\x1a" * 40)  # a record half-written when the process died
    assert verdict(killed) == 3
    rc, err = cli(capsys, *ct.resume_cmd(killed))
    assert rc == 0, err
    assert ct.bundle_files_equal(killed, ref(refs, "digits")) == []


@pytest.mark.slow
def test_an_extended_supervised_bundle_is_the_longer_run(tmp_path, refs, capsys):
    d = tmp_path / "extended"
    shutil.copytree(ref(refs, "digits"), d)
    assert cli(capsys, *ct.resume_cmd(d), "--set", "train.steps=50")[0] == 0
    fresh = tmp_path / "fresh"
    assert cli(capsys, *ct.train_cmd("digits", fresh), "--set", "train.steps=50")[0] == 0
    assert ct.bundle_files_equal(d, fresh) == []


@pytest.mark.slow  # 4-9 s; kept out of the 5-minute fast suite
def test_a_bundle_audited_while_it_records_is_incomplete_not_bad_input(tmp_path):
    """The auditor reads what is durable while the writer appends: never "changed while reading"."""
    d = tmp_path / "live"
    proc = popen(*ct.train_cmd("dqn", d, "--set", "train.steps=3000"))
    try:
        assert wait_until(lambda: (ct.durable_step(d) or 0) > 0, proc)
        codes = []
        while proc.poll() is None and len(codes) < 4:
            try:
                codes.append(audit(d).exit_code)
            except BundleError as e:  # pragma: no cover - the message is the point
                pytest.fail(f"a live bundle was bad input: {e}")
        assert codes and set(codes) <= {0, 3}, codes
    finally:
        proc.kill()
        proc.communicate()
