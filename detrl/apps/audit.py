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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from detrl.core.engine import Divergence, Session
from detrl.core.sources import Sources
from detrl.formats import bundle as bundle_mod
from detrl.formats.bundle import BundleError
from detrl.formats.roundlog import RoundLogError, dense_reference_bytes
from detrl.run import config as config_mod
from detrl.run import sessions, tasks

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
) -> AuditReport:
    """Replay ``run_dir`` on ``hardware`` and give a verdict. Bad input raises :class:`BundleError`.

    ``data``: the auditor's copy of the training data where the task reads a file (a bundle never names a
    path the auditor opens). ``init_from``: likewise, its copy of the weights file a run starts from
    (``model.init_from``). ``caps``: overrides of the task's default caps on config values.
    ``require_log=False`` leaves log compliance out of the verdict (the ``nolog`` benchmark measures
    whether a run replicates with an emptied log).
    """
    run_dir = Path(run_dir)
    probe = bundle_mod.Bundle(run_dir)  # validate everything before doing any work
    m = probe.manifest
    probe.close()
    task, cfg = _validated_config(m, run_dir, caps, data, init_from)
    extra = {"init_from": init_from} if init_from is not None else {}
    torch.set_num_threads(max(1, min(cfg.threads, os.cpu_count() or 1)))
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
    ours = task.fingerprint(cfg, data, **extra)
    if m.data_fingerprint != ours:  # a bundle that drops its fingerprint claims other data than ours
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
    session = _replay(cfg, task, run_dir, hardware, ours, report, progress, data, extra)
    return _verdict(report, session, m, require_log)


def _validated_config(
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
    # the config through the same path): planned steps, checkpoint spacing, calibration margin.
    for field, claimed, given in (
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
) -> Session:
    """Replay the run on ``hardware``; a divergence fills ``report`` (step, message, anomalies, decisive
    first). A config no recorder could have run is bad input. Returns the finished session."""
    session = sessions.session_for(cfg, run_dir, "replay", hardware=hardware, fingerprint=fingerprint)
    try:
        with session:
            task.run(cfg, session, progress=progress, data=data, **extra)
            session.verify_checkpoints()
    except (BundleError, RoundLogError):
        raise
    except (RuntimeError, TypeError, IndexError, ValueError) as e:
        # A config no recorder could have run (a CNN fed text, a batch larger than the data) fails in the
        # task's code or in torch: bad input naming the manifest, not exit 70 or a line naming nothing.
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        raise BundleError(
            f"{bundle_mod.MANIFEST}: config: its run fails to replay ({type(e).__name__}: {msg})"
        ) from e
    except Divergence as d:
        report.verdict = "diverged"
        report.diverged_step = d.step
        report.message = d.describe()
        if not session.precision.is_verifiable and d.batch_matches and not d.detail:
            report.message = (
                f"diverged at step {d.step}; a {session.precision.kind} run has no rounding log, so hardware "
                "whose arithmetic differs from the recorder's diverges at the first step that computes"
            )
        decisive = d.decisive
        ordered = ([decisive] if decisive else []) + [a for a in d.anomalies if a is not decisive]
        report.anomalies = [{**dataclasses.asdict(a), "violation": a.violation} for a in ordered]
    return session


def _verdict(report: AuditReport, session: Session, m: Any, require_log: bool) -> AuditReport:
    """The per-step sizes and totals, then the verdict of a replay that did not diverge: log incomplete,
    incomplete (the recording did not finish), or replicated (stopped or complete)."""
    reader = session.bundle.roundlog if session.bundle is not None else None
    for i, st in enumerate(session.step_stats, start=1):
        log_bytes = reader.segment_bytes(i) if reader is not None else 0
        report.per_step.append(StepSize(i, st.rounded_elements, st.logged, log_bytes))
    t = session.totals
    report.unlogged_near, report.refused, report.corrected = t.unlogged_near, t.refused, t.corrected
    if report.verdict == "diverged":
        return report
    violations = t.unlogged_near + t.refused
    if require_log and session.precision.is_verifiable and violations > LOG_TOLERANCE:
        step, a = session.first_violation  # type: ignore[misc]
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
