"""Audit a run bundle: rebuild the run from its manifest, replay it on a hardware profile, give a verdict."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from detrl import bundle as bundle_mod
from detrl import config as config_mod
from detrl.engine import Divergence, Session
from detrl.roundlog import dense_reference_bytes


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
    verdict: str  # "replicated" | "diverged"
    steps: int
    message: str
    diverged_step: int | None = None
    precision: str = "verifiable"
    anomalies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unlogged_near: int = 0
    corrected: int = 0
    per_step: list[StepSize] = dataclasses.field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "replicated" else 1

    def totals(self) -> dict[str, int]:
        return {
            "rounded_elements": sum(s.rounded for s in self.per_step),
            "logged_elements": sum(s.logged for s in self.per_step),
            "log_bytes": sum(s.log_bytes for s in self.per_step),
            "dense_reference_bytes": sum(s.dense_bytes for s in self.per_step),
        }

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["per_step"] = [{**dataclasses.asdict(s), "dense_bytes": s.dense_bytes} for s in self.per_step]
        d["totals"] = self.totals()
        return d


def audit(run_dir: str | Path, hardware: str = "native", progress: bool = False) -> AuditReport:
    """Replay ``run_dir`` on ``hardware``. Bad input raises BundleError/ConfigError; divergence is a verdict."""
    run_dir = Path(run_dir)
    probe = bundle_mod.Bundle(run_dir)  # validate everything before doing any work
    try:
        cfg = config_mod.validate(probe.config)
        task = config_mod.recipe(cfg.task)
        claimed = probe.manifest.get("data_fingerprint")
    except config_mod.ConfigError as e:
        raise bundle_mod.BundleError(f"{bundle_mod.MANIFEST}: {e}") from None
    finally:
        probe.close()
    torch.set_num_threads(cfg.threads)
    ours = task.fingerprint(cfg)
    if claimed is not None and claimed != ours:
        return AuditReport(
            str(run_dir), hardware, "diverged", 0,
            "the bundle's data fingerprint differs from the auditor's copy of the data", diverged_step=0,
        )  # fmt: skip
    options = task.session_options(cfg) if hasattr(task, "session_options") else {}
    session = Session(run_dir, mode="replay", hardware=hardware, data_fingerprint=ours, **options)
    report = AuditReport(
        str(run_dir), hardware, "replicated", session.bundle.steps if session.bundle else 0, ""
    )
    report.precision = session.precision.kind
    try:
        with session:
            task.run(cfg, session, progress=progress)
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
        report.anomalies = [dataclasses.asdict(a) for a in d.anomalies]
    reader = session.bundle.roundlog if session.bundle is not None else None
    for i, st in enumerate(session.step_stats, start=1):
        log_bytes = reader.segment_bytes(i) if reader is not None else 0  # 0 for a step without a segment
        report.per_step.append(StepSize(i, st.rounded_elements, st.logged, log_bytes))
    report.unlogged_near = session.totals.unlogged_near
    report.corrected = session.totals.corrected
    if report.verdict == "replicated":
        report.message = f"replicated: all {report.steps} step commitments and checkpoints match bit for bit"
    return report
