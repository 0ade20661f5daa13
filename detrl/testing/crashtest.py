"""Kill and resume recordings on purpose: the driver behind ``tests/test_crash.py`` and ``detrl bench crash``.

A *child* runs ``detrl`` with the bundle's file operations patched so that it kills itself at an exact
moment: the k-th call of :func:`detrl.formats.safeio.write_atomic` (a checkpoint or the manifest), of
``os.replace`` (the rename inside it) or of ``os.fsync``, before or after the call, or when the writer
appends a given step::

    python -m detrl.testing.crashtest --kill write_atomic:5:after -- train configs/dqn/tiny.yaml --out D --quiet
    python -m detrl.testing.crashtest --kill step:700:sigint -- train ...         # Ctrl-C after step 700
    python -m detrl.testing.crashtest --trace calls.txt -- train ...              # list the calls, kill nothing

A kill spec is ``FUNC:K[:WHEN]``: FUNC one of ``write_atomic``, ``replace``, ``fsync`` (K counts its calls
from 1) or ``step`` (K is the step number; the signal comes when the writer has appended it); WHEN one of
``before``, ``after`` (SIGKILL, default ``before``; ``after`` for ``step``) or ``sigint`` (Ctrl-C after
the call). Several specs: ``--kill`` again, or commas. ``--trace FILE`` appends one line per patched
call: ``FUNC K WHAT``.

The *parent* side (:func:`run_point`) runs a :class:`Point` (a list of stages: the recording, then
resumes, each killed or not), checks the bundle after every kill (``detrl audit`` says incomplete, never
bad input; its durable step never goes backwards; a resume killed while it re-records steps the bundle
holds leaves the bundle byte-identical), resumes it to the end and compares it with an uninterrupted
reference (:func:`bundle_files_equal`). :func:`matrix` lists the points of a recording from its trace,
:func:`run_matrix` runs them in parallel. Each command is a process of its own, by default a child
forked from a warm ``--serve`` process (:class:`Runner`), which saves the interpreter and torch start-up
of several hundred commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from detrl.apps.audit import VERDICT_OF_EXIT
from detrl.run import fmt
from detrl.testing.program import detrl_program

#: The recordings the matrix kills: name -> the ``detrl train`` arguments (config and ``--set``s).
KINDS: dict[str, list[str]] = {
    # tiny.yaml at half length: calibration ends at step 210, between the checkpoints at 0 and 250
    "dqn": ["configs/dqn/tiny.yaml", "--set", "train.steps=1000", "--set", "verify.checkpoint_every=250"],
    "digits": [
        "configs/supervised/digits_cnn.yaml",
        "--set",
        "train.steps=40",
        "--set",
        "verify.checkpoint_every=10",
    ],
}
TRAIN_FLAGS = ["--quiet", "--no-tensorboard"]
FUNCS = ("write_atomic", "replace", "fsync", "step")
WHENS = ("before", "after", "sigint")

_COMMIT_HEADER_BYTES = 16
_COMMIT_RECORD_BYTES = 76


# ------------------------------------------------------------------------------------------ bundle files
def snapshot(run_dir: str | os.PathLike) -> dict[str, tuple[int, str]]:
    """Every file under ``run_dir`` (``tb/`` too): relative name -> (size, SHA-256)."""
    root = Path(run_dir)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() or p.is_symlink():
            data = p.read_bytes() if p.is_file() else os.readlink(p).encode()
            out[p.relative_to(root).as_posix()] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def _bundle_files(run_dir: Path) -> set[str]:
    return {rel for rel in snapshot(run_dir) if not rel.startswith("tb/")}


def bundle_files_equal(a: str | os.PathLike, b: str | os.PathLike) -> list[str]:
    """What differs between bundles ``a`` and ``b`` (empty: identical).

    Identical means: ``commitments``, ``roundlog`` and every checkpoint byte-identical, the same set of
    files (a stray temporary file or an orphaned checkpoint counts), and ``manifest.json`` equal apart
    from its ``created`` field. ``tb/`` (TensorBoard logs beside the bundle) is not part of it.
    """
    a, b = Path(a), Path(b)
    diffs = []
    fa, fb = _bundle_files(a), _bundle_files(b)
    for rel in sorted(fa - fb):
        diffs.append(f"{rel}: only in {a}")
    for rel in sorted(fb - fa):
        diffs.append(f"{rel}: only in {b}")
    for rel in sorted(fa & fb):
        da, db = (a / rel).read_bytes(), (b / rel).read_bytes()
        if rel == "manifest.json":
            try:
                ma, mb = json.loads(da), json.loads(db)
            except ValueError:
                diffs.append(f"{rel}: not JSON")
                continue
            ma.pop("created", None), mb.pop("created", None)
            keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
            if keys:
                diffs.append(f"{rel}: differs in {', '.join(keys)}")
        elif da != db:
            diffs.append(f"{rel}: differs ({len(da)} and {len(db)} bytes)")
    return diffs


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``manifest.json`` as JSON, or None where there is none (or it does not parse)."""
    try:
        return json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def durable_step(run_dir: str | os.PathLike) -> int | None:
    """The manifest's durable step (None: no manifest, or nothing durable yet)."""
    m = read_manifest(run_dir)
    d = m.get("durable") if m else None
    return d["step"] if isinstance(d, dict) else None


def records_written(run_dir: str | os.PathLike) -> int:
    """How many complete step records the commitments file holds (a recording's progress, durable or not)."""
    try:
        size = (Path(run_dir) / "commitments").stat().st_size
    except OSError:
        return 0
    return max(0, (size - _COMMIT_HEADER_BYTES) // _COMMIT_RECORD_BYTES)


# ---------------------------------------------------------------------------------------------- commands
def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]


def train_cmd(kind: str, out: str | os.PathLike, *extra: str) -> list[str]:
    """The ``detrl train`` arguments (without the program) that record ``kind`` into ``out``."""
    return ["train", *KINDS[kind], "--out", str(out), *TRAIN_FLAGS, *extra]


def resume_cmd(run_dir: str | os.PathLike) -> list[str]:
    return ["train", "--resume", str(run_dir), *TRAIN_FLAGS]


def child_cmd(
    cli_args: list[str], kill: str | None = None, trace: str | os.PathLike | None = None
) -> list[str]:
    """The command line that runs ``detrl CLI_ARGS`` through the driver (killed as ``kill`` says)."""
    cmd = python_cmd("-m", "detrl.testing.crashtest")
    if kill:
        cmd += ["--kill", kill]
    if trace:
        cmd += ["--trace", str(trace)]
    return [*cmd, "--", *cli_args]


def child_env() -> dict[str, str]:
    """The environment for children: one thread each (as the configs say), so parallel runs don't fight."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=timeout, check=False)


def audit_code(run_dir: str | os.PathLike, hardware: str = "native") -> tuple[int, str]:
    """``detrl audit RUN_DIR --hardware HW`` in a fresh process: (exit code, first line of its output)."""
    p = run(python_cmd("-m", "detrl.cli", "audit", str(run_dir), "--hardware", hardware, "--quiet"))
    return p.returncode, _first_line(p)


def _first_line(p: subprocess.CompletedProcess) -> str:
    text = ((p.stdout or "") + (p.stderr or "")).strip().splitlines()
    return text[0] if text else ""


class Runner:
    """Runs ``detrl`` commands through the driver, each in a process of its own: a fresh interpreter
    (``warm=False``), or a child forked from a warm server that imported torch and the tasks once (the
    matrix runs hundreds of commands; start-up is most of a small one's time). Either way the command
    is ``detrl.cli.main`` in a process that can be killed, and its exit code is a process's: negative
    for a signal, as :mod:`subprocess` reports it.

    ``after_s``: SIGKILL the command this long after it appended its first record to ``watch``.
    """

    def __init__(self, warm: bool = True) -> None:
        self.warm = warm
        self._server: subprocess.Popen | None = None
        self._tmp: Path | None = None

    def __call__(
        self,
        cli_args: list[str],
        kill: str | None = None,
        after_s: float | None = None,
        watch: str | os.PathLike | None = None,
        trace: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        if not self.warm:
            return _fresh(child_cmd(cli_args, kill, trace), after_s, watch)
        if self._server is None or self._server.poll() is not None:
            import tempfile

            self._tmp = Path(tempfile.mkdtemp(prefix="detrl-crashtest-"))
            self._server = subprocess.Popen(
                python_cmd("-m", "detrl.testing.crashtest", "--serve"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=child_env(),
            )
        assert self._server.stdin is not None and self._server.stdout is not None and self._tmp is not None
        out = self._tmp / "out"
        request = {
            "argv": cli_args,
            "kill": kill,
            "after_s": after_s,
            "watch": watch,
            "trace": trace,
            "out": out,
        }
        self._server.stdin.write(json.dumps(request, default=str) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError("crashtest server died")
        rc = int(json.loads(line)["rc"])
        read = lambda suffix: Path(f"{out}.{suffix}").read_text(errors="replace")  # noqa: E731
        return subprocess.CompletedProcess(cli_args, rc, read("stdout"), read("stderr"))

    def close(self) -> None:
        if self._server is not None:
            if self._server.stdin is not None:
                self._server.stdin.close()
            self._server.wait(timeout=60)
            self._server = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fresh(
    cmd: list[str], after_s: float | None, watch: str | os.PathLike | None
) -> subprocess.CompletedProcess:
    if after_s is None:
        return run(cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    _kill_later(proc.pid, lambda: proc.poll() is not None, after_s, watch)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _wait_for_record(run_dir: str | os.PathLike, start: int, stop: Callable[[], bool]) -> bool:
    """Poll until ``run_dir`` holds more than ``start`` records (True), or ``stop()`` or 600 s came first."""
    deadline = time.monotonic() + 600
    while records_written(run_dir) <= start:
        if stop() or time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _kill_later(
    pid: int, exited: Callable[[], bool], after_s: float, watch: str | os.PathLike | None
) -> None:
    """SIGKILL ``pid`` ``after_s`` seconds after ``watch`` gained its first new record (unless it exited)."""
    if watch is not None:
        _wait_for_record(watch, records_written(watch), exited)
    end = time.monotonic() + after_s
    while not exited() and time.monotonic() < end:
        time.sleep(0.005)
    if not exited():
        os.kill(pid, signal.SIGKILL)


def record_reference(
    kind: str, out: str | os.PathLike, trace: str | os.PathLike, runner: Runner | None = None
) -> list[tuple[str, int, str]]:
    """Record ``kind`` uninterrupted into ``out`` through the driver; return its trace of patched calls."""
    Path(trace).unlink(missing_ok=True)
    p = (runner or Runner(warm=False))(train_cmd(kind, out), trace=trace)
    if p.returncode != 0:
        raise RuntimeError(f"reference {kind} failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    return read_trace(trace)


def read_trace(path: str | os.PathLike) -> list[tuple[str, int, str]]:
    out = []
    for line in Path(path).read_text().splitlines():
        func, k, what = line.split(" ", 2)
        out.append((func, int(k), what))
    return out


# ------------------------------------------------------------------------------------------ the matrix
@dataclasses.dataclass
class Stage:
    """One process: ``record`` (the first) or ``resume``; killed by ``kill`` (a driver spec), by the parent
    ``after_s`` seconds after it recorded its first new step, or not at all."""

    command: str
    kill: str | None = None
    after_s: float | None = None

    def label(self) -> str:
        how = self.kill or (f"SIGKILL at +{self.after_s:.2f}s" if self.after_s is not None else "to the end")
        return f"{self.command}: {how}"


@dataclasses.dataclass
class Point:
    """A kill point: what to run on ``kind``'s bundle, stage after stage; a final plain resume follows."""

    kind: str
    stages: list[Stage]
    note: str = ""
    core: bool = True

    @property
    def name(self) -> str:
        return " | ".join(s.label() for s in self.stages)


@dataclasses.dataclass
class Outcome:
    """What became of a :class:`Point`: per killed stage the durable step and the audit verdict."""

    point: Point
    durable: list[int | None] = dataclasses.field(default_factory=list)
    verdicts: list[int] = dataclasses.field(default_factory=list)
    identical: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.identical and not self.problems


def run_point(
    point: Point, run_dir: str | os.PathLike, reference: str | os.PathLike, runner: Runner | None = None
) -> Outcome:
    """Run ``point`` in ``run_dir`` (emptied first), check every killed state, resume, compare.

    After each stage: the durable step never goes back; ``detrl audit`` gives 3 (incomplete) for a
    recording bundle and 0 for a stopped or complete one, never 2; a resume killed (or stopped with
    Ctrl-C) while it re-records steps the bundle holds leaves every file as it was. A recording killed
    before it wrote its first manifest left no bundle (nothing was recorded): that is noted, and it is
    recorded afresh with ``--force``. Then a plain ``--resume`` must give the reference's bundle.
    """
    t0 = time.perf_counter()
    runner = runner or Runner(warm=False)
    run_dir, res = Path(run_dir), Outcome(point)
    shutil.rmtree(run_dir, ignore_errors=True)
    before: int | None = None
    for i, stage in enumerate(point.stages):
        where = f"stage {i + 1} ({stage.label()})"
        held, durable0 = records_written(run_dir) - 1, durable_step(run_dir)
        snap = snapshot(run_dir) if stage.command == "resume" else None
        cli = train_cmd(point.kind, run_dir) if stage.command == "record" else resume_cmd(run_dir)
        p = runner(cli, stage.kill, stage.after_s, run_dir)
        err = p.stderr.strip().splitlines()[-1:]
        sigint = bool(stage.kill and stage.kill.endswith(":sigint"))
        if (p.returncode != 0) if sigint else (p.returncode != -signal.SIGKILL):
            res.problems.append(f"{where}: exit {p.returncode}, not {'0' if sigint else 'killed'} {err}")
        step = durable_step(run_dir)
        res.durable.append(step)
        if before is not None and (step is None or step < before):
            res.problems.append(f"{where}: the durable step went back from {before} to {step}")
        before = step if step is not None else before
        at = _kill_step(stage.kill) if stage.kill else None
        inside = at is not None and (
            at < (durable0 if durable0 is not None else -1) if sigint else at <= held
        )
        if snap is not None and inside and snapshot(run_dir) != snap:
            res.problems.append(
                f"{where}: stopped while re-recording steps the bundle holds, yet files changed"
            )
        manifest = read_manifest(run_dir)
        a = runner(["audit", str(run_dir), "--quiet"])
        code, line = a.returncode, _first_line(a)
        res.verdicts.append(code)
        if manifest is None and stage.command == "record" and records_written(run_dir) == 0:
            res.notes.append("killed before its first manifest: no bundle yet")
            if code != 2:
                res.problems.append(f"{where}: no manifest, yet audit exit {code}: {line}")
            continue
        want = {"recording": 3, "stopped": 0, "complete": 0}.get((manifest or {}).get("status"), 3)
        if code != want:
            res.problems.append(f"{where}: audit exit {code}, expected {want}: {line}")
    manifest = read_manifest(run_dir)
    if manifest is None:  # nothing recorded: record it afresh (the directory is not a bundle)
        p: subprocess.CompletedProcess | None = runner(train_cmd(point.kind, run_dir, "--force"))
    elif manifest.get("status") != "complete":
        p = runner(resume_cmd(run_dir))
    else:
        p = None
    if p is not None and p.returncode != 0:
        res.problems.append(f"final resume: exit {p.returncode} {p.stderr.strip().splitlines()[-1:]}")
    diffs = bundle_files_equal(run_dir, reference)
    res.identical = not diffs
    res.problems += diffs[:5]
    res.seconds = time.perf_counter() - t0
    return res


def _kill_step(spec: str) -> int | None:
    func, k, *_ = spec.split(":")
    return int(k) if func == "step" else None


def matrix(
    kind: str,
    trace: list[tuple[str, int, str]],
    manifest: dict[str, Any],
    seed: int = 0,
    seconds: float | None = None,
) -> list[Point]:
    """The kill points for ``kind``, from the trace, the manifest and the wall time (``seconds``; None: the
    timed point falls 0.2-2 s after the first record) of its uninterrupted recording.

    Points with ``core=False`` repeat a state another point reaches already in a slightly different
    place (the middle checkpoints, a second random step): the slow test leaves them out, the benchmark
    runs them.
    """
    rng = random.Random(seed)
    planned, every = int(manifest["planned_steps"]), int(manifest["checkpoint_every"])
    calibration = int(manifest["calibration_steps"])
    pts: list[Point] = []

    def add(stages: list[Stage], note: str, core: bool = True) -> None:
        pts.append(Point(kind, stages, note, core))

    # (a) every checkpoint write and manifest replacement, killed before the call (the old file stays)
    # and after it (renamed and fsynced, the next step not yet taken). A checkpoint written is the state
    # its manifest's "before" sees, so the middle ones are killed once each: a checkpoint before, a
    # manifest after.
    writes = [(k, what) for f, k, what in trace if f == "write_atomic"]
    first_ckpt = next((k for k, what in writes if what.endswith(".safetensors")), None)
    for i, (k, what) in enumerate(writes):
        natural, other = ("before", "after") if what.endswith(".safetensors") else ("after", "before")
        first, last = i < 3 or k == first_ckpt, i >= len(writes) - 3
        note = f"{what} (write {k} of {len(writes)})"
        add([Stage("record", f"write_atomic:{k}:{natural}")], note, first or last)
        if first or last:
            add([Stage("record", f"write_atomic:{k}:{other}")], note, first)
    # inside write_atomic: the temp file written and fsynced, not renamed (a checkpoint, then a manifest)
    replaces = [(k, what) for f, k, what in trace if f == "replace"]
    for j, (k, what) in enumerate(replaces[len(replaces) // 2 - 1 : len(replaces) // 2 + 1]):
        add([Stage("record", f"replace:{k}:before")], f"{what}: temp file not renamed", j == 0)
    # before the fsync of the appended records at a durable point
    syncs = [(k, what) for f, k, what in trace if f == "fsync" and what in ("commitments", "roundlog")]
    if syncs:
        k, what = syncs[len(syncs) // 2]
        add([Stage("record", f"fsync:{k}:before")], f"before the fsync of {what}")
    # (b) at random moments: random steps (the tail past the durable point is lost), and a timer
    for j, step in enumerate(sorted(rng.sample(range(1, planned), 2))):
        add([Stage("record", f"step:{step}")], "random step", j == 0)
    # a moment inside the recording, whatever this machine's speed: a fixed 0.2-2 s outlasted a verifiable
    # DQN once its steps got faster. The timer starts at the first record, after start-up: within the
    # first half of the wall time after that is inside it.
    after = rng.uniform(0.2, 2.0) if seconds is None else rng.uniform(0.1, 0.5) * seconds
    add([Stage("record", after_s=round(after, 2))], "random time")
    # (c) killed resumes. Of a killed bundle: while it re-records steps the bundle holds (nothing may
    # change), and once it went past them.
    mid = every + every // 2 + 1  # a kill here leaves records past the checkpoint at `every`
    held = Stage("record", f"step:{mid}")
    add([held, Stage("resume", f"step:{mid - 2}")], "resume killed re-recording the held steps")
    add([held, Stage("resume", f"step:{mid + every // 4}")], "resume killed past the held steps")
    if 2 < calibration < every:  # durable (calibration) past the last checkpoint (0): re-recorded from 0
        stages = [
            Stage("record", f"step:{calibration + 20}"),
            Stage("resume", f"step:{calibration // 2}:sigint"),
        ]
        add(stages, "resume stopped with Ctrl-C before the durable point")
    # Of a stopped bundle (Ctrl-C off the checkpoint grid): a resume writes a manifest that says
    # "recording" again (before its first record past the stop), the next checkpoint, the manifest that
    # drops the stop's checkpoint, then removes its file.
    stopped = Stage("record", f"step:{2 * every + every // 3}:sigint")
    add([stopped, Stage("resume", "write_atomic:1:after")], "resume of a stopped bundle: recording again")
    add(
        [stopped, Stage("resume", "write_atomic:2:before")],
        "resume of a stopped bundle: its first checkpoint",
    )
    add(
        [stopped, Stage("resume", "write_atomic:3:after")],
        "resume of a stopped bundle: stop checkpoint unlisted",
    )
    twice = [stopped, Stage("resume", f"step:{3 * every - 1}"), Stage("resume", "write_atomic:1:before")]
    add(twice, "resume of a stopped bundle killed, then its resume killed")
    return pts


class Reference(NamedTuple):
    """A kind recorded uninterrupted: its bundle, the trace of its patched calls, and its wall time in
    seconds from its first record to its end (a timed kill point falls inside the first half of it)."""

    bundle: Path
    trace: list[tuple[str, int, str]]
    seconds: float


def references(
    kinds: Iterable[str], workdir: str | os.PathLike, jobs: int = 2, warm: bool = True
) -> dict[str, Reference]:
    """Record each kind uninterrupted (``jobs`` at a time): kind -> its :class:`Reference`."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)

    def one(kind: str) -> Reference:
        ref = work / f"ref-{kind}"
        shutil.rmtree(ref, ignore_errors=True)
        # The timed kill point's clock starts at the first record, so the reference's time does too: timed
        # from the start, a loaded machine's start-up put the point past the end of a quick recording.
        first_record: list[float] = []
        done = threading.Event()

        def watch() -> None:
            if _wait_for_record(ref, 0, done.is_set):
                first_record.append(time.perf_counter())

        watcher = threading.Thread(target=watch, daemon=True)
        t0 = time.perf_counter()
        watcher.start()
        try:
            with Runner(warm) as runner:
                trace = record_reference(kind, ref, work / f"trace-{kind}.txt", runner)
        finally:
            done.set()
            watcher.join()
        end = time.perf_counter()
        return Reference(ref, trace, end - (first_record[0] if first_record else t0))

    kinds = list(kinds)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return dict(zip(kinds, pool.map(one, kinds)))


def run_matrix(
    kinds: Iterable[str],
    workdir: str | os.PathLike,
    points: int | None = None,
    jobs: int = 2,
    core_only: bool = False,
    refs: dict[str, Reference] | None = None,
    warm: bool = True,
    on_done: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Run the kill points of ``kinds`` (``core_only``: the core ones; ``points``: at most this many,
    spread over the matrix), ``jobs`` at a time, against ``refs`` (:func:`references`; recorded here
    when None), each job with a :class:`Runner` of its own (``warm``: a forking server). Returns the
    outcomes in matrix order; a point's directory is kept only if it failed."""
    work = Path(workdir)
    kinds = list(kinds)
    refs = refs if refs is not None else references(kinds, work, jobs, warm)
    todo: list[Point] = []
    for kind in kinds:
        ref = refs[kind]
        points_of = matrix(kind, ref.trace, read_manifest(ref.bundle) or {}, seconds=ref.seconds)
        todo += [p for p in points_of if p.core or not core_only]
    if points is not None and points < len(todo):
        todo = [todo[int(i * len(todo) / max(1, points))] for i in range(points)]
    runners: queue.Queue[Runner] = queue.Queue()
    for _ in range(max(1, jobs)):
        runners.put(Runner(warm))

    def one(i: int) -> Outcome:
        pt, runner = todo[i], runners.get()
        try:
            out = run_point(pt, work / f"point-{i:03d}", refs[pt.kind].bundle, runner)
        finally:
            runners.put(runner)
        if out.ok:
            shutil.rmtree(work / f"point-{i:03d}", ignore_errors=True)
        if on_done is not None:
            on_done(out)
        return out

    order = sorted(range(len(todo)), key=lambda i: -len(todo[i].stages))  # the long ones first
    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            done = dict(zip(order, pool.map(one, order)))
    finally:
        while not runners.empty():
            runners.get().close()
    return [done[i] for i in range(len(todo))]


# ------------------------------------------------------------------------------------------ the child
def _describe(func: str, args: tuple) -> str:
    try:
        if func == "write_atomic":
            return str(args[1])
        if func == "replace":
            return Path(args[1]).name
        if func == "fsync":
            return Path(os.readlink(f"/proc/self/fd/{args[0]}")).name
        if func == "step":
            return str(args[0])
    except (OSError, IndexError, TypeError):
        pass
    return "?"


def install(specs: list[str], trace: str | None) -> None:
    """Patch the bundle's file operations in this process so that ``specs`` fire (see the module doc)."""
    import detrl.formats.bundle
    import detrl.formats.safeio

    wanted: dict[tuple[str, int], list[str]] = {}
    for spec in (part for group in specs for part in group.split(",") if part):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in FUNCS or not parts[1].isdigit():
            raise SystemExit(f"crashtest: bad kill spec {spec!r} (FUNC:K[:WHEN], FUNC one of {FUNCS})")
        when = parts[2] if len(parts) == 3 else ("after" if parts[0] == "step" else "before")
        if when not in WHENS:
            raise SystemExit(f"crashtest: bad kill spec {spec!r}: WHEN is one of {WHENS}")
        wanted.setdefault((parts[0], int(parts[1])), []).append(when)
    counts: dict[str, int] = {}
    log = open(trace, "a") if trace else None  # noqa: SIM115 - lives as long as the process

    def fire(key: tuple[str, int], when: str) -> None:
        for w in wanted.get(key, ()):
            if w == when:
                os.kill(os.getpid(), signal.SIGKILL)
            elif w == "sigint" and when == "after":
                os.kill(os.getpid(), signal.SIGINT)

    def wrap(func: str, fn: Callable[..., Any], skip_self: bool = False) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            args_ = args[1:] if skip_self else args
            n = counts[func] = counts.get(func, 0) + 1
            key = (func, int(args_[0]) if func == "step" else n)
            if log is not None:
                log.write(f"{func} {n} {_describe(func, args_)}\n")
                log.flush()
            fire(key, "before")
            result = fn(*args, **kwargs)
            fire(key, "after")
            return result

        return patched

    detrl.formats.safeio.write_atomic = wrap("write_atomic", detrl.formats.safeio.write_atomic)
    os.replace = wrap("replace", os.replace)
    os.fsync = wrap("fsync", os.fsync)
    writer = detrl.formats.bundle.BundleWriter
    writer.append_step = wrap("step", writer.append_step, skip_self=True)  # type: ignore[method-assign]


def _serve() -> int:
    """``--serve``: import what ``detrl`` needs once, then fork a child per request read from stdin.

    A request is one JSON line ``{"argv", "kill", "after_s", "watch", "trace", "out"}``; the child runs
    ``detrl ARGV`` through the driver with its stdout and stderr in ``OUT.stdout`` / ``OUT.stderr``; the
    answer is one JSON line ``{"rc"}`` once the child is gone. Nothing runs a torch op here, so the
    children start with no thread pools to inherit.
    """
    import detrl.apps.audit  # noqa: F401 - imported to be inherited by the children

    detrl_main = detrl_program()
    from detrl.run import tasks

    for name in tasks.names():
        tasks.get(name)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the loop
            rc = 70
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                for fd, suffix in ((1, "stdout"), (2, "stderr")):
                    out = os.open(f"{req['out']}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(out, fd)
                    os.close(out)
                install([req["kill"]] if req.get("kill") else [], req.get("trace"))
                rc = detrl_main(list(req["argv"]))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 2
            except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then gone
                import traceback

                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        if req.get("after_s") is not None:
            _kill_later(pid, lambda pid=pid: _reaped(pid), float(req["after_s"]), req.get("watch"))
        status = _statuses.pop(pid, None)
        if status is None:
            _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)
    return 0


_statuses: dict[int, int] = {}


def _reaped(pid: int) -> bool:
    """Whether child ``pid`` exited (reaping it; its status is kept for the server loop)."""
    if pid in _statuses:
        return True
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        _statuses[pid] = status
    return bool(done)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m detrl.testing.crashtest", description="run detrl, killed on purpose"
    )
    p.add_argument("--kill", action="append", default=[], metavar="FUNC:K[:WHEN]")
    p.add_argument("--trace", metavar="FILE", help="append one line per patched call")
    p.add_argument("--serve", action="store_true", help="fork a child per JSON request on stdin (Runner)")
    p.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the detrl command line")
    args = p.parse_args(argv)
    if args.serve:
        return _serve()
    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    install(args.kill, args.trace)
    return detrl_program()(cli)


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------------------------- benchmark
# `detrl bench crash` lives here, beside the matrix it runs, and reaches the registry through the
# `detrl.benchmarks` entry point: detrl.bench never imports this driver, which drives detrl.cli.
def bench_crash(rest: list[str]) -> int:
    """Run the kill/resume matrix of :mod:`detrl.testing.crashtest` (the slow test's driver): every kill point, the
    durable step it left, the audit verdict, and whether a plain ``--resume`` gave the uninterrupted
    bundle byte for byte. Exits 1 if any point failed."""
    ct = sys.modules[__name__]

    p = argparse.ArgumentParser(prog="detrl bench crash", description=bench_crash.__doc__)
    p.add_argument("--points", type=int, default=None, help="at most N points, spread over the matrix")
    p.add_argument("--kinds", default=",".join(ct.KINDS), help="comma list of " + ",".join(ct.KINDS))
    p.add_argument("--core", action="store_true", help="only the core points (what the slow test runs)")
    p.add_argument("--jobs", type=int, default=2, help="points run at a time")
    p.add_argument("--fresh", action="store_true", help="a fresh interpreter per command (not a warm fork)")
    p.add_argument("--keep", metavar="DIR", help="work here and keep failed points (default: a temp dir)")
    args = p.parse_args(rest)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in ct.KINDS:
            raise ValueError(f"unknown kind {k!r}; known: {', '.join(ct.KINDS)}")
    print(fmt.machine_line(1))
    print("recordings: " + "; ".join(f"{k}: {' '.join(ct.KINDS[k])}" for k in kinds))
    t0 = time.perf_counter()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="detrl-bench-crash-"))
    done = [0]

    def progress(o: Any) -> None:
        done[0] += 1
        print(
            f"[bench] {done[0]} {o.point.kind} {o.point.name}: {'ok' if o.ok else 'FAILED'} ({o.seconds:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    try:
        outcomes = ct.run_matrix(
            kinds,
            work,
            points=args.points,
            jobs=args.jobs,
            core_only=args.core,
            warm=not args.fresh,
            on_done=progress,
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    for o in outcomes:
        durable = " -> ".join("-" if d is None else str(d) for d in o.durable)
        verdicts = " -> ".join(VERDICT_OF_EXIT.get(v, str(v)) for v in o.verdicts)
        rows.append([o.point.name, o.point.kind, durable, verdicts, "yes" if o.identical else "NO",
                     "ok" if o.ok else "; ".join(o.problems)[:120], o.point.note])  # fmt: skip
    headers = ["kill point", "kind", "durable step", "verdict", "resumed identical", "checks", "where"]
    print(fmt.table(headers, rows))
    bad = [o for o in outcomes if not o.ok]
    no_bundle = sum(1 for o in outcomes if o.notes)
    print(
        f"points tried: {len(outcomes)}; resumed identical: {sum(o.identical for o in outcomes)}/{len(outcomes)}; "
        f"all identical: {'yes' if all(o.identical for o in outcomes) else 'NO'}; "
        f"failed checks: {len(bad)}; {time.perf_counter() - t0:.0f} s with {args.jobs} jobs"
    )
    if no_bundle:
        print(
            f"note: {no_bundle} point(s) killed the recording before it wrote its first manifest: no bundle yet "
            "(nothing was recorded; audit says bad input: manifest.json missing); recorded afresh with --force"
        )
    return 1 if bad else 0


BENCHMARK = (
    "kill a recording at each durable point (and its resumes); resumed bundles identical?",
    bench_crash,
)
