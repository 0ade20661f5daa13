"""Audit a run bundle: rebuild the run from its manifest, replay it on a hardware profile, give a verdict.

Verdicts and ``detrl audit`` exit codes:

==============  ====  =================================================================================
verdict         exit  meaning
==============  ====  =================================================================================
replicated      0     every durable commitment and checkpoint matched bit for bit, and the rounding log
                      kept its own thresholds (a run stopped early with Ctrl-C replicates its steps)
diverged        1     a commitment differs at step s: the report names the step, whether the data
                      differed, and the decisive log anomaly (op, module, element) where there is one
bad input       2     the bundle is malformed or asks for more than the auditor's caps: one line naming
                      the file and the problem (also a script bundle, a missing ``--data``)
incomplete      3     the recording stopped without finishing (killed, or still running): its durable
                      prefix, steps 0..s of the planned N, was replayed and matched
log incomplete  4     the replay matched, but the log omits near-midpoint elements within its own declared
                      thresholds or carries entries this machine refuses: the bundle breaks its claim
==============  ====  =================================================================================

A diverged verdict outranks a log that is incomplete, which outranks an incomplete recording.

With ``workers > 1`` (``detrl audit --workers N``, or on Ray with ``--ray``) the durable steps are cut at
checkpoints into segments that replay at once, each from its starting checkpoint (see
:func:`segments`); their outcomes merge into the verdict, message and exit code the sequential audit gives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from detrl.core import oprules
from detrl.core.engine import Divergence, Session
from detrl.core.hardware import get_profile
from detrl.core.rounding import Anomaly, StepStats
from detrl.core.sources import Sources
from detrl.formats import bundle as bundle_mod
from detrl.formats.bundle import BundleError
from detrl.formats.roundlog import RoundLogError, RoundLogReader, dense_reference_bytes
from detrl.run import config as config_mod
from detrl.run import executors, sessions, tasks

EXIT_CODES = {"replicated": 0, "diverged": 1, "bad input": 2, "incomplete": 3, "log incomplete": 4}
#: The verdict an audit's exit code stands for (the inverse of :data:`EXIT_CODES`).
VERDICT_OF_EXIT = {code: verdict for verdict, code in EXIT_CODES.items()}
#: Unlogged near-midpoint elements (seen within tau/2 here) and refused entries an honest log may show.
#: An honest recorder logs every element within tau of a midpoint; the auditor counts those within tau/2
#: of its own values, which differ from the recorder's by far less than tau/2 (tau is 16x the largest
#: disagreement calibration measured). So an honest bundle shows none, and the tolerance is zero.
LOG_TOLERANCE = 0


@dataclasses.dataclass
class StepSize:
    step: int
    rounded: int
    logged: int
    log_bytes: int
    #: logged elements whose logged neighbour differed from this machine's own nearest rounding
    corrected: int = 0

    @property
    def dense_bytes(self) -> int:
        return dense_reference_bytes(self.rounded)


@dataclasses.dataclass
class AuditReport:
    """What ``detrl audit`` prints and writes with ``--json``."""

    run_dir: str
    hardware: str
    verdict: str  # a key of EXIT_CODES
    steps: int  # durable steps replayed
    message: str
    planned_steps: int | None = None
    status: str = "complete"  # the recording's own status: recording | stopped | complete
    diverged_step: int | None = None
    precision: str = "verifiable"
    anomalies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unlogged_near: int = 0
    refused: int = 0
    corrected: int = 0
    per_step: list[StepSize] = dataclasses.field(default_factory=list)
    #: corrections on the recorder's own deterministic profile (see :func:`_flag_steering`); no exit code
    steering_suspected: bool = False
    steering_first_step: int | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def totals(self) -> dict[str, int]:
        return {
            "rounded_elements": sum(s.rounded for s in self.per_step),
            "logged_elements": sum(s.logged for s in self.per_step),
            "log_bytes": sum(s.log_bytes for s in self.per_step),
            "dense_reference_bytes": sum(s.dense_bytes for s in self.per_step),
        }

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exit_code"] = self.exit_code
        d["per_step"] = [{**dataclasses.asdict(s), "dense_bytes": s.dense_bytes} for s in self.per_step]
        d["totals"] = self.totals()
        return d


def check_caps(raw: Mapping[str, Any], caps: Mapping[str, float]) -> None:
    """Refuse a bundle config whose values exceed the auditor's caps (before anything is built)."""
    for key, cap in caps.items():
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        values = node if isinstance(node, list) else [node]
        for v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:
                raise BundleError(
                    f"{bundle_mod.MANIFEST}: config {key}={v} exceeds the auditor's cap {cap:g} "
                    f"(raise it with --cap {key}=N)"
                )


def parse_caps(items: list[str]) -> dict[str, float]:
    """``["model.channels=4096"]`` -> ``{"model.channels": 4096.0}`` (``--cap`` options)."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        try:
            out[key.strip()] = float(text)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise config_mod.ConfigError(f"--cap expects KEY=NUMBER, got {item!r}")
    return out


def audit(
    run_dir: str | Path,
    hardware: str = "native",
    progress: bool = False,
    data: Path | None = None,
    caps: Mapping[str, float] | None = None,
    require_log: bool = True,
    init_from: Path | None = None,
    workers: int = 1,
    ray: str | None = None,
) -> AuditReport:
    """Replay ``run_dir`` on ``hardware`` and give a verdict. Bad input raises :class:`BundleError`.

    ``data``: the auditor's copy of the training data where the task reads a file (a bundle never names a
    path the auditor opens). ``init_from``: likewise, its copy of the weights file a run starts from
    (``model.init_from``). ``caps``: overrides of the task's default caps on config values.
    ``require_log=False`` leaves log compliance out of the verdict (the ``nolog`` benchmark measures
    whether a run replicates with an emptied log).

    ``workers > 1``: replay the segments between checkpoints in that many processes (one torch thread
    each), or with ``ray`` (``auto``, ``local`` or a cluster address) as Ray tasks; the report is the one
    the sequential replay (``workers=1``, no ``ray``) gives. ``progress`` then prints a line per segment.
    """
    if workers < 1:
        raise config_mod.ConfigError(f"--workers must be at least 1, not {workers}")
    if workers > 1 and ray is None:
        executors.prestart()  # the workers' parent imports while this process checks the bundle
    run_dir = Path(run_dir)
    plan = prepare_replay(run_dir, caps, data, init_from)
    probe, m = plan.bundle, plan.bundle.manifest
    task, cfg, extra, ours = plan.task, plan.cfg, plan.extra, plan.ours
    report = AuditReport(
        str(run_dir),
        hardware,
        "replicated",
        probe.steps,
        "",
        planned_steps=m.planned_steps,
        status=m.status,
        precision=m.precision,
    )
    if not plan.same_data:  # a bundle that drops its fingerprint claims other data than ours
        report.verdict, report.diverged_step, report.steps = "diverged", 0, 0
        report.message = "the bundle's data fingerprint differs from the auditor's copy of the data" + (
            " or of the init weights (--init-from)" if init_from is not None else ""
        )
        return report
    if probe.steps == 0:
        report.verdict = "incomplete" if m.status == "recording" else "replicated"
        report.message = (
            f"incomplete at step 0 of {m.planned_steps}: nothing after the initial state is durable"
        )
        return report
    cuts = segments(probe.steps, probe.checkpoint_steps, SEGMENTS_PER_WORKER * workers)
    if (workers > 1 and len(cuts) > 1) or ray is not None:  # one segment: no process to start for it
        # What a replay checks before its first step (the bundle's claims about its log), once here.
        sessions.session_for(cfg, run_dir, "replay", hardware=hardware, fingerprint=ours).bundle.close()  # type: ignore[union-attr]
        jobs = [SegmentJob(str(run_dir), hardware, m.config, ours, data, init_from, a, b) for a, b in cuts]
        replayed = _replay_segments(jobs, workers, ray, progress)
        if replayed.error is not None:  # bad input found by the first segment that failed
            kind, line = replayed.error
            raise _ERRORS.get(kind, BundleError)(line)
        reader = probe.roundlog  # closed, but its index (each step's segment size) stays readable
    else:
        t0 = time.perf_counter()
        session = _replay(cfg, task, run_dir, hardware, ours, report, progress, data, extra)
        replayed = _replayed(session, report, 0, probe.steps, time.perf_counter() - t0)
        reader = session.bundle.roundlog if session.bundle is not None else None
    return _flag_steering(_verdict(report, replayed, m, require_log, reader), m, cfg.threads)


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """What a replay of a bundle needs before its first step, every check that needs no replay done.

    ``bundle``: the bundle as validated, closed (its manifest, durable steps, checkpoint steps and the log's
    index stay readable). ``task``, ``cfg``: its task and validated config. ``extra``: the task's keyword
    arguments for the auditor's own files (``init_from``). ``data``: the auditor's copy of the data.
    """

    bundle: bundle_mod.Bundle
    task: tasks.Task
    cfg: Any
    extra: dict[str, Any]
    data: Path | None

    @functools.cached_property
    def ours(self) -> str | None:
        """The data fingerprint of the auditor's copy of the data (and init weights), computed on first use:
        a caller refuses what it can check cheaply first. A config error found only with the data (more
        examples held out than there are) is the manifest's."""
        try:
            return self.task.fingerprint(self.cfg, self.data, **self.extra)
        except config_mod.ConfigError as e:
            raise BundleError(f"{bundle_mod.MANIFEST}: {e}") from None

    @property
    def same_data(self) -> bool:
        """The bundle's data fingerprint is the auditor's: only then does a replay mean anything."""
        return self.bundle.manifest.data_fingerprint == self.ours


def prepare_replay(
    run_dir: Path, caps: Mapping[str, float] | None, data: Path | None, init_from: Path | None
) -> ReplayPlan:
    """Validate the bundle in ``run_dir`` and its config (:func:`validated_config`) and set this process's
    torch threads to the run's: the prologue of an audit and of a referee's replay of one step (the data's
    fingerprint follows on first use of :attr:`ReplayPlan.ours`). Raises :class:`BundleError` for bad input."""
    probe = bundle_mod.Bundle(run_dir)  # validate everything before doing any work
    probe.close()
    task, cfg = validated_config(probe.manifest, run_dir, caps, data, init_from)
    extra: dict[str, Any] = {"init_from": init_from} if init_from is not None else {}
    torch.set_num_threads(max(1, min(cfg.threads, os.cpu_count() or 1)))
    return ReplayPlan(probe, task, cfg, extra, data)


def validated_config(
    m: Any, run_dir: Path, caps: Mapping[str, float] | None, data: Path | None, init_from: Path | None
) -> tuple[tasks.Task, Any]:
    """The bundle's task and validated config, after every check that needs no replay: a task config (not
    a script), within the caps (raw, validated and in the totals they multiply into), the seeds its config
    gives, and the auditor's copies of the files the run reads. Raises :class:`BundleError`."""
    if m.task is None or m.config is None:
        raise BundleError(
            f"{bundle_mod.MANIFEST}: recorded by a script, not a task config: replay it by running the "
            "same script with Session(..., mode='replay')"
        )
    try:
        task = tasks.get(m.task)
        check_caps(m.config, {**task.caps, **(caps or {})})
        cfg = config_mod.validate(m.config)
        if cfg.task != m.task:
            raise BundleError(f"{bundle_mod.MANIFEST}: task {m.task!r} but a {cfg.task!r} config")
        # again on the validated values: validation turns "20000" into 20000, which the check above skips
        check_caps(cfg.model_dump(mode="json"), {**task.caps, **(caps or {})})
        # and on the totals they multiply into (parameters, data and buffer bytes), computed unallocated
        check_caps({"size": task.size(cfg)}, {**tasks.SIZE_CAPS, **(caps or {})})
    except (config_mod.ConfigError, tasks.UnknownTask) as e:
        raise BundleError(f"{bundle_mod.MANIFEST}: {e}") from None
    # The run shape the manifest claims is the one its config gives (the recorder built its Session from
    # the config through the same path): precision, the recorder's profile, planned steps, checkpoint
    # spacing, calibration margin.
    for field, claimed, given in (
        ("precision", m.precision, cfg.precision),
        ("hardware", m.hardware, cfg.hardware),
        ("planned_steps", m.planned_steps, task.planned_steps(cfg)),
        ("checkpoint_every", m.checkpoint_every, cfg.verify.checkpoint_every),
        ("margin", m.margin, cfg.verify.margin),
    ):
        if claimed != given:
            raise BundleError(f"{bundle_mod.MANIFEST}: {field}: {claimed!r}, but its config gives {given!r}")
    # The switchboard the manifest claims is the one its config gives (but for unseeded streams' OS-drawn
    # seeds): edited seeds are bad input, not a divergence at step 0.
    want, got = Sources.from_config(cfg.sources).state_dict(), m.sources.get("seeds")
    if (
        m.sources.get("seed") != want["seed"]
        or not isinstance(got, dict)
        or any(got.get(n) != s for n, s in want["seeds"].items() if n not in want["unseeded"])
    ):
        raise BundleError(f"{bundle_mod.MANIFEST}: sources: seeds other than those its config gives")
    needed, given = task.inputs(cfg), {"data": data, "init_from": init_from}
    for name, why in needed.items():
        if given.get(name) is None:
            raise BundleError(
                f"{bundle_mod.MANIFEST}: {why}: give the auditor's copy with --{name.replace('_', '-')} PATH "
                "(a bundle never names a file the auditor opens)"
            )
    if init_from is not None and "init_from" not in needed:
        raise config_mod.ConfigError(
            f"--init-from: the run in {run_dir} does not start from a weights file (no model.init_from)"
        )
    return task, cfg


@contextlib.contextmanager
def config_failures_are_bad_input() -> Iterator[None]:
    """Around a replay of a bundle's config: a config no recorder could have run (a CNN fed text, a batch
    larger than the data) fails in the task's code or in torch, and that is bad input naming the manifest
    (:class:`BundleError`), not exit 70 or a line naming nothing. The bundle's own errors pass through."""
    try:
        yield
    except (BundleError, RoundLogError):
        raise
    except (RuntimeError, TypeError, IndexError, ValueError) as e:
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        raise BundleError(
            f"{bundle_mod.MANIFEST}: config: its run fails to replay ({type(e).__name__}: {msg})"
        ) from e


def _replay(
    cfg: Any,
    task: tasks.Task,
    run_dir: Path,
    hardware: str,
    fingerprint: str | None,
    report: AuditReport,
    progress: bool,
    data: Path | None,
    extra: dict[str, Any],
    start: int = 0,
    stop: int | None = None,
) -> Session:
    """Replay the run (steps ``start+1..stop``, by default all) on ``hardware``; a divergence fills
    ``report`` (step, message, anomalies, decisive first). A config no recorder could have run is bad
    input. Returns the finished session."""
    segment = {"start": start, "stop": stop} if start or stop is not None else {}
    session = sessions.session_for(
        cfg, run_dir, "replay", hardware=hardware, fingerprint=fingerprint, **segment
    )
    try:
        with config_failures_are_bad_input(), session:
            task.run(cfg, session, progress=progress, data=data, **extra)
            session.verify_checkpoints()
    except Divergence as d:
        report.verdict = "diverged"
        report.diverged_step = d.step
        report.message = d.describe()
        if not session.precision.is_verifiable and d.batch_matches and not d.detail:
            report.message = (
                f"diverged at step {d.step}; a {session.precision.kind} run has no rounding log, so hardware "
                "whose arithmetic differs from the recorder's diverges at the first step that computes"
            )
        if session.precision.is_verifiable and d.batch_matches and session.bundle is not None:
            report.message += _older_rules(session.bundle.manifest, report.hardware)
        decisive = d.decisive
        ordered = ([decisive] if decisive else []) + [a for a in d.anomalies if a is not decisive]
        report.anomalies = [{**dataclasses.asdict(a), "violation": a.violation} for a in ordered]
    return session


def _older_rules(m: Any, hardware: str) -> str:
    """What to add to a state divergence on ``hardware`` of a bundle of an older rules revision than this
    detrl's: the replication hazards fixed since (an honest replay on hardware unlike the recorder's could
    diverge under them, :data:`detrl.core.oprules.REPLICATION_FIXES`), and how to tell. Empty where none was
    fixed since, or on the recorder's own profile."""
    fixed = [f"{r}: {what}" for r, what in oprules.REPLICATION_FIXES.items() if r > m.rules_revision]
    if not fixed or hardware == m.hardware:
        return ""
    return (
        f"; note: the bundle follows rounding-rule revision {m.rules_revision}, and later revisions fixed where "
        f"honest hardware was found to disagree under it ({'; '.join(fixed)}), so on hardware unlike the "
        f"recorder's this may be the old rules' divergence: a replay on the recorder's own profile "
        f"({m.hardware}) tells them apart"
    )


def _verdict(
    report: AuditReport, replayed: Replayed, m: Any, require_log: bool, reader: RoundLogReader | None
) -> AuditReport:
    """The per-step sizes and totals, then the verdict: diverged, or for a replay that did not diverge,
    log incomplete, incomplete (the recording did not finish), or replicated (stopped or complete)."""
    for i, st in enumerate(replayed.step_stats, start=1):
        log_bytes = reader.segment_bytes(i) if reader is not None else 0
        report.per_step.append(StepSize(i, st.rounded_elements, st.logged, log_bytes, st.corrected))
    t = replayed.totals
    report.unlogged_near, report.refused, report.corrected = t.unlogged_near, t.refused, t.corrected
    if replayed.diverged_step is not None:
        report.verdict, report.diverged_step = "diverged", replayed.diverged_step
        report.message, report.anomalies = replayed.message, replayed.anomalies
        return report
    violations = t.unlogged_near + t.refused
    if require_log and replayed.verifiable and violations > LOG_TOLERANCE:
        step, a = replayed.first_violation  # type: ignore[misc]
        report.verdict = "log incomplete"
        report.message = (
            f"the commitments match, but the rounding log breaks its own thresholds: {t.unlogged_near} "
            f"near-midpoint elements unlogged, {t.refused} entries refused; first at step {step}: "
            f"{a.kind}, {a.where()}"
        )
        report.anomalies = [{**dataclasses.asdict(a), "violation": True, "step": step}]
        return report
    n = report.steps
    if m.status == "recording":
        report.verdict = "incomplete"
        report.message = (
            f"incomplete at step {n} of {m.planned_steps}: the recording did not finish; its {n} durable "
            "steps replicated bit for bit"
        )
    elif m.status == "stopped":
        report.message = (
            f"replicated: all {n} recorded steps match bit for bit (stopped at step {n} of the planned "
            f"{m.planned_steps}; continue it with detrl train --resume)"
        )
    else:
        report.message = f"replicated: all {n} step commitments and checkpoints match bit for bit"
    return report


def _flag_steering(report: AuditReport, m: Any, threads: int) -> AuditReport:
    """Flag corrections on the recorder's own arithmetic as evidence of steering (docs/verifiable.md, "What
    the log cannot stop: the steering bound").

    Replaying on the manifest's own deterministic profile, with the recorder's thread count, the auditor
    computes the recorder's FP64 values, and an honest recorder logged each element's nearest neighbour:
    its log corrects nothing there. A correction is a logged neighbour that was not the nearest one. The
    verdict and its exit code stay as they are, deliberately: the commitments matched, a steered run is a
    run the log's claim allows (either neighbour of a logged element), and a CPU whose FP64 kernels differ
    from the recorder's under the same profile name (``native``) could, rarely, need an honest correction.
    So this is evidence to weigh (the count and the first step), not a verdict. ``emulated:atomic`` and
    ``cuda`` (atomics) recompute sums in another order on every run and are never flagged."""
    corrected = [s for s in report.per_step if s.corrected]
    if not corrected or report.hardware != m.hardware or m.precision != "verifiable":
        return report
    if report.hardware == "cuda" or threads > (os.cpu_count() or 1):
        return report  # another summation order (atomics, or fewer threads here) may correct honestly
    if not get_profile(report.hardware).deterministic:
        return report
    report.steering_suspected, report.steering_first_step = True, corrected[0].step
    report.message += (
        f"; steering suspected: on the recorder's own profile ({m.hardware}) the log corrected "
        f"{report.corrected:,} elements of this machine's nearest rounding, first at step {corrected[0].step} "
        "(an honest recorder logs the nearest neighbour, which this machine computes alike)"
    )
    return report


# ---------------------------------------------------------------------------------------------- segments
#: Segments per worker: many, so that a worker whose segments replay slower (a shared machine's second core
#: comes and goes) leaves at most a short segment's tail while the other idles; not unboundedly many, since
#: each segment rebuilds the run and loads a checkpoint (for the digits CNN that costs nothing measurable:
#: steps 101..120 replayed as one segment or as two took the same time, within 0.2 s, three times).
SEGMENTS_PER_WORKER = 8
#: The bad-input errors a segment sends back by name, raised again in the parent as the same class.
_ERRORS: dict[str, type[Exception]] = {
    "BundleError": BundleError,
    "RoundLogError": RoundLogError,
    "ConfigError": config_mod.ConfigError,
}


@dataclasses.dataclass
class Replayed:
    """What a replay of steps ``start+1..stop`` found: all the verdict needs, small and picklable (a
    segment replayed in a worker process or a Ray task sends it back to the parent).

    ``step_stats``: one per step replayed (through the diverging step, if one diverged); ``totals``: their
    sum; ``first_violation``: ``(step, anomaly)`` of the first log entry that broke its claim.
    ``diverged_step``, ``message``, ``anomalies``: the divergence, as :class:`AuditReport` carries it.
    ``error``: bad input, as ``(exception class name, its one line)``. ``seconds``: wall time, for progress.
    """

    start: int
    stop: int
    step_stats: list[StepStats]
    totals: StepStats
    first_violation: tuple[int, Anomaly] | None
    verifiable: bool
    diverged_step: int | None = None
    message: str = ""
    anomalies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: tuple[str, str] | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        """It diverged or found bad input: a sequential replay would have stopped in this segment."""
        return self.error is not None or self.diverged_step is not None


def _replayed(session: Session, report: AuditReport, start: int, stop: int, seconds: float) -> Replayed:
    """A finished replay's :class:`Replayed` (its divergence, if any, as :func:`_replay` put it in ``report``)."""
    diverged = report.verdict == "diverged"
    return Replayed(
        start,
        stop,
        list(session.step_stats),
        dataclasses.replace(session.totals),
        session.first_violation,
        session.precision.is_verifiable,
        report.diverged_step if diverged else None,
        report.message if diverged else "",
        list(report.anomalies) if diverged else [],
        seconds=seconds,
    )


def segments(steps: int, checkpoints: list[int], most: int) -> list[tuple[int, int]]:
    """Steps ``1..steps`` cut at checkpoints into at most ``most`` segments, each as ``(start, stop)``: it
    replays steps ``start+1..stop`` from the checkpoint of ``start`` (0: the initial state the config
    builds). The checkpoint intervals are shared out as evenly as they go, the longer segments first (a
    pool takes jobs in order: the short ones fill in at the end). Without checkpoints between, one
    segment: the whole replay."""
    bounds = [0, *sorted(c for c in checkpoints if 0 < c < steps), steps]
    n = len(bounds) - 1  # checkpoint intervals
    k = max(1, min(n, most))
    cuts = [0]
    for i in range(k):  # the first n % k segments take one interval more
        cuts.append(cuts[-1] + n // k + (i < n % k))
    return [(bounds[a], bounds[b]) for a, b in zip(cuts, cuts[1:], strict=False)]


@dataclasses.dataclass(frozen=True)
class SegmentJob:
    """One segment's replay, as a worker receives it: the bundle, the profile, the bundle's config (already
    validated by the parent, with everything else a sequential audit checks before replaying), the data
    fingerprint the parent computed, the auditor's files, and the steps ``start+1..stop``."""

    run_dir: str
    hardware: str
    config: dict[str, Any]
    fingerprint: str | None
    data: Path | None
    init_from: Path | None
    start: int
    stop: int


def replay_segment(job: SegmentJob) -> Replayed:
    """Replay one segment in this process with one torch thread (a worker's job; see :func:`audit`). Bad
    input comes back in :attr:`Replayed.error`, so the parent raises it as the one line it is."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    task, cfg = tasks.get(job.config["task"]), config_mod.validate(job.config)
    extra = {"init_from": job.init_from} if job.init_from is not None else {}
    report = AuditReport(job.run_dir, job.hardware, "replicated", 0, "")
    try:
        session = _replay(
            cfg, task, Path(job.run_dir), job.hardware, job.fingerprint, report, False, job.data, extra,
            job.start, job.stop,
        )  # fmt: skip
    except (BundleError, RoundLogError, config_mod.ConfigError) as e:
        error = (type(e).__name__, str(e))
        seconds = time.perf_counter() - t0
        return Replayed(job.start, job.stop, [], StepStats(), None, True, error=error, seconds=seconds)
    return _replayed(session, report, job.start, job.stop, time.perf_counter() - t0)


def _replay_segments(jobs: list[SegmentJob], workers: int, ray: str | None, progress: bool) -> Replayed:
    """Replay ``jobs`` (the segments, in step order) in ``workers`` processes or on Ray, and merge them."""
    n = len(jobs)
    names = [f"segment {i + 1}/{n} steps {j.start + 1}..{j.stop}" for i, j in enumerate(jobs)]
    results: list[Replayed | None] = [None] * n
    if progress:
        where = f"on Ray ({ray})" if ray is not None else f"in {min(workers, n)} worker processes"
        print(f"audit: {jobs[-1].stop} steps in {n} segments between checkpoints, {where}", file=sys.stderr)

    def done(i: int, r: Replayed) -> None:
        results[i] = r
        if progress:
            if r.error is not None:
                outcome = "bad input"
            elif r.diverged_step is not None:
                outcome = f"diverged at step {r.diverged_step}"
            else:
                outcome = "replicated"
                broken = r.totals.unlogged_near + r.totals.refused
                outcome += f", the log breaks its thresholds {broken} times" if broken else ""
            print(f"{names[i]} {outcome} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)

    job_args = [(j,) for j in jobs]
    if ray is None:
        executors.run_local(replay_segment, job_args, min(workers, n), done, names)
    else:
        executors.run_ray(replay_segment, job_args, ray, workers, done, names)
    return _merge([r for r in results if r is not None])


def _merge(results: list[Replayed]) -> Replayed:
    """The segments' results (in step order) as the one replay of their steps: the sequential replay stops
    in the first segment that fails (diverged, or bad input), so that one decides and later ones are
    ignored; stats are those of the steps up to there."""
    merged = Replayed(results[0].start, results[-1].stop, [], StepStats(), None, results[0].verifiable)
    for r in results:
        merged.step_stats += r.step_stats
        for f in dataclasses.fields(StepStats):
            setattr(merged.totals, f.name, getattr(merged.totals, f.name) + getattr(r.totals, f.name))
        if merged.first_violation is None:
            merged.first_violation = r.first_violation
        merged.seconds += r.seconds
        if r.failed:
            merged.diverged_step, merged.message, merged.anomalies = r.diverged_step, r.message, r.anomalies
            merged.error = r.error
            break
    return merged
