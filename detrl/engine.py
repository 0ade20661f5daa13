"""Session: record or replay a training loop, step by step, with one code path.

::

    with detrl.Session("runs/r1", mode="record", precision=detrl.Precision.verifiable(),
                       sources=detrl.Sources(seed=0), hardware="native") as s:
        model = s.init(build_model)              # init from the `init` stream, commits step 0
        opt = s.track(torch.optim.SGD(model.parameters(), lr=0.1))
        for batch in s.loader((x, y), batch_size=64, steps=100):   # order from `data_order`
            with s.step():                       # rounding mode on; commits on exit
                loss = loss_fn(model(batch.x), batch.y)
                loss.backward(); opt.step(); opt.zero_grad()

The same script with ``mode="replay"`` re-executes the run on another hardware profile, applies the
rounding log, and compares every commitment; the first mismatch raises :class:`Divergence`, which names the
step, whether the batch differed, and the rounding anomalies seen in that step (op, module, element).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.module_tracker import ModuleTracker

from detrl import bundle as bundle_mod
from detrl import commit
from detrl.calibrate import DEFAULT_MARGIN, TAU_FLOOR, TAU_FLOOR_MEASURED, Calibrator
from detrl.hardware import HardwareMode, Profile, get_profile
from detrl.precision import Precision
from detrl.randomness import StreamRandomMode
from detrl.rounding import (
    Anomaly,
    LogOutOfRange,
    RoundingMode,
    StepRounding,
    StepStats,
    Thresholds,
)
from detrl.roundlog import RoundLogWriter
from detrl.sources import Sources, state_bytes

#: zstd level of the rounding log: 9 costs well under a millisecond per step and is a few % smaller than 3.
LOG_ZSTD_LEVEL = 9


class Divergence(Exception):
    """Replay produced a state whose commitment differs from the recorded one."""

    def __init__(self, step: int, batch_matches: bool, anomalies: list[Anomaly], detail: str = "") -> None:
        self.step = step
        self.batch_matches = batch_matches
        self.anomalies = anomalies
        self.detail = detail
        super().__init__(self.describe())

    def describe(self) -> str:
        parts = [f"diverged at step {self.step}"]
        if self.detail:
            parts.append(self.detail)
        if not self.batch_matches:
            parts.append("the batch the trainer committed differs from the auditor's data at this step")
        if self.anomalies:
            a = self.anomalies[0]
            where = f" in {a.module}" if a.module else ""
            parts.append(
                f"first rounding anomaly: op #{a.op} aten.{a.name}{where}, element {a.index} ({a.kind})"
            )
        elif self.batch_matches and not self.detail:
            parts.append(
                "no rounding-log anomaly in this step: the update itself differs (e.g. a skipped step)"
            )
        return "; ".join(parts)


@dataclasses.dataclass
class Batch:
    """One minibatch: ``x`` inputs, ``y`` targets (shape ``(batch, ...)``), ``index`` dataset rows used."""

    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor


@dataclasses.dataclass
class ReplayReport:
    steps: int
    replicated: bool
    stats: StepStats
    divergence: Divergence | None = None


class Session:
    """Record or replay one training run.

    Args:
        run_dir: the bundle directory (written when recording, read when replaying; None for ``mode="off"``).
        mode: ``"record"``, ``"replay"`` or ``"off"`` (train without a bundle, e.g. for ablations).
        precision: ``fp32``, ``fp64`` or ``verifiable``. Replay takes it from the bundle.
        sources: the switchboard. Replay takes it from the bundle.
        hardware: profile name (``native``, ``emulated:splitk``, ...; see :mod:`detrl.hardware`) or a
            :class:`~detrl.hardware.Profile` instance (a machine of your own).
        checkpoint_every: save a safetensors checkpoint every this many steps (0: only the last).
        thresholds: a :class:`Thresholds`, or ``"calibrate"`` to measure them during the first step.
        margin: calibrated threshold = margin x the largest disagreement measured between profiles.
        config: the run's config, stored in the manifest so ``detrl audit`` can rebuild the run.
        data_fingerprint: SHA-256 hex of the training data, stored in the manifest and checked on replay.
        device: torch device for model and data.
        track_modules: name module paths in rounding anomalies (default: when replaying).
    """

    def __init__(
        self,
        run_dir: str | Path | None,
        mode: str = "record",
        precision: Precision | str = "verifiable",
        sources: Sources | None = None,
        hardware: str | Profile = "native",
        checkpoint_every: int = 10,
        thresholds: Thresholds | str = "calibrate",
        margin: float = DEFAULT_MARGIN,
        config: dict[str, Any] | None = None,
        data_fingerprint: str | None = None,
        device: str | torch.device = "cpu",
        track_modules: bool | None = None,
    ) -> None:
        if mode not in ("record", "replay", "off"):
            raise ValueError(f"mode must be record, replay or off, not {mode!r}")
        self.mode = mode
        self.dir = Path(run_dir) if run_dir is not None else None
        self.profile = hardware if isinstance(hardware, Profile) else get_profile(hardware)
        self.hardware = self.profile.name
        self.device = torch.device(device)
        self.checkpoint_every = int(checkpoint_every)
        self.config = dict(config or {})
        self.data_fingerprint = data_fingerprint
        self.margin = margin
        self.bundle: bundle_mod.Bundle | None = None
        self._writer: RoundLogWriter | None = None
        self._calibrator: Calibrator | None = None
        if mode == "replay":
            if self.dir is None:
                raise ValueError("replay needs the bundle directory")
            self.bundle = bundle_mod.Bundle(self.dir)
            try:  # the manifest is untrusted: every field that shapes the replay is checked
                self.precision = Precision(self.bundle.precision)
                self.sources = Sources()
                self.sources.load_state_dict(self.bundle.sources)
                self.thresholds = Thresholds.from_json(self.bundle.thresholds)
                self.calibration_steps = self.bundle.thresholds.get("calibration_steps", 0)
                if not isinstance(self.calibration_steps, int) or self.calibration_steps < 0:
                    raise ValueError("thresholds.calibration_steps must be a non-negative integer")
            except ValueError as e:
                raise bundle_mod.BundleError(f"{bundle_mod.MANIFEST}: {e}") from None
            self.config = self.bundle.config
            fp = self.bundle.manifest.get("data_fingerprint")
            if data_fingerprint is not None and fp is not None and fp != data_fingerprint:
                raise bundle_mod.BundleError(
                    f"manifest.json: data fingerprint {str(fp)[:16]}... differs from the auditor's data "
                    f"{data_fingerprint[:16]}..."
                )
        else:
            self.precision = precision if isinstance(precision, Precision) else Precision(precision)
            self.sources = sources if sources is not None else Sources()
            self.calibration_steps = 0
            if isinstance(thresholds, Thresholds):
                self.thresholds = thresholds
            elif thresholds == "calibrate":
                self.thresholds = Thresholds(default=TAU_FLOOR * 64)
                if self.precision.is_verifiable:
                    self._calibrator = Calibrator(self.thresholds, margin)
                    self.calibration_steps = 1
            else:
                raise ValueError(f"thresholds must be a Thresholds or 'calibrate', not {thresholds!r}")
        self._initial_sources = self.sources.state_dict()
        self._tracker: ModuleTracker | None = None
        if track_modules if track_modules is not None else mode == "replay":
            self._tracker = ModuleTracker()
        self.rounding = RoundingMode(self.profile, self.thresholds, self._module_path)
        self.model: torch.nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.step_index = 0
        self.leaves: list[tuple[bytes, bytes]] = []
        self.totals = StepStats()
        self.step_stats: list[StepStats] = []
        self.log_bytes: list[int] = []
        self.step_seconds: list[float] = []
        self._batch_hash: bytes | None = None
        self._stack = contextlib.ExitStack()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Session:
        if self._tracker is not None:
            self._stack.enter_context(self._tracker)
        if self.mode == "record":
            assert self.dir is not None
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in [bundle_mod.MANIFEST, bundle_mod.COMMITMENTS, bundle_mod.ROUNDLOG]:
                (self.dir / stale).unlink(missing_ok=True)
            for old in (self.dir / bundle_mod.CHECKPOINTS).glob("step_*.safetensors"):
                old.unlink()
            if self.precision.is_verifiable:
                self._writer = RoundLogWriter(self.dir / bundle_mod.ROUNDLOG, level=LOG_ZSTD_LEVEL)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self.mode == "record" and exc_type is None:
                self._finish_record()
            replayed_short = self.bundle is not None and self.step_index != self.bundle.steps
            if self.mode == "replay" and exc_type is None and replayed_short:
                raise Divergence(
                    self.step_index + 1,
                    True,
                    [],
                    f"the replay ran {self.step_index} steps, the bundle has {self.bundle.steps}",
                )
        finally:
            if self._writer is not None:
                self._writer.close()
            if self.bundle is not None:
                self.bundle.close()
            self._stack.close()

    # ------------------------------------------------------------------ building the run
    def init(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Build the model with the ``init`` stream, apply the bitflip switch, cast, commit step 0."""
        with self.sources.global_torch_rng("init"):
            model = build()
        model = model.to(torch.float32)  # weights start on the FP32 grid whatever the precision
        self.sources.apply_bitflip(model)
        model = model.to(device=self.device, dtype=self.precision.dtype)
        self.model = model
        self._commit(0, bytes(32))
        return model

    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Include ``optimizer``'s state in commitments and checkpoints; returns it."""
        self.optimizers.append(optimizer)
        return optimizer

    def loader(
        self,
        data: tuple[torch.Tensor, torch.Tensor],
        batch_size: int,
        steps: int | None = None,
        epochs: int | None = None,
    ) -> Iterator[Batch]:
        """Minibatches of ``data = (x, y)`` in an order drawn from the ``data_order`` stream.

        Each epoch is a fresh permutation; the last incomplete batch is dropped. Stops after ``steps``
        batches or ``epochs`` epochs (one of them is required). Inputs are cast to the run's precision.
        """
        x, y = data
        n = len(x)
        if n < batch_size:
            raise ValueError(f"dataset has {n} examples, fewer than batch_size={batch_size}")
        if steps is None and epochs is None:
            raise ValueError("loader needs steps or epochs")
        done, epoch = 0, 0
        while (steps is None or done < steps) and (epochs is None or epoch < epochs):
            order = self.sources.permutation("data_order", n)
            for i in range(0, n - batch_size + 1, batch_size):
                if steps is not None and done >= steps:
                    return
                idx = order[i : i + batch_size]
                bx, by = x[idx], y[idx]
                self._batch_hash = commit.hash_batch(bx, by)
                yield Batch(self.precision.cast(bx).to(self.device), by.to(self.device), idx)
                done += 1
            epoch += 1

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self, batch: Any = None) -> Iterator[StepRounding | None]:
        """One training step: forward, backward and optimizer update go inside. Commits on exit.

        ``batch``: the data the step consumes, if it did not come from :meth:`loader` (hashed into the
        step's commitment).
        """
        if self.model is None:
            raise RuntimeError("call Session.init(build_model) before the first step")
        step = self.step_index + 1
        batch_hash = (
            commit.hash_batch(*_as_tuple(batch)) if batch is not None else (self._batch_hash or bytes(32))
        )
        self._batch_hash = None
        rounding = None
        t0 = time.perf_counter()
        with contextlib.ExitStack() as modes:
            # Innermost first: the rounding mode's own work must not pass through the random-op mode,
            # and random ops must reach the rounding mode already drawn from their stream.
            if not self.precision.is_verifiable and self.hardware != "native":
                modes.enter_context(HardwareMode(self.profile))
            if self.precision.is_verifiable:
                replay = self.bundle.read_log_step(step) if self.bundle is not None else None
                rounding = StepRounding(replay=replay)
                self.rounding.step = rounding
                in_calibration = step <= self.calibration_steps
                self.rounding.calibrate = self._calibrator if in_calibration else None
                if in_calibration and self.mode == "replay":
                    # The recorder's thresholds grew during this step, each at least the lowest floor: half
                    # of that is the sound threshold for counting unlogged near-midpoint elements.
                    self.rounding.check_thresholds = Thresholds(default=TAU_FLOOR_MEASURED / 2)
                modes.enter_context(self.rounding)
            modes.enter_context(StreamRandomMode(self.sources.torch("dropout")))
            try:
                yield rounding
            except LogOutOfRange as e:
                raise bundle_mod.BundleError(f"{bundle_mod.ROUNDLOG}: step {step}: {e}") from None
            finally:
                self.rounding.step = None
                self.rounding.calibrate = None
                self.rounding.check_thresholds = None
        self.step_seconds.append(time.perf_counter() - t0)
        self.step_index = step
        stats = rounding.stats if rounding is not None else StepStats()
        self.step_stats.append(stats)
        for f in dataclasses.fields(StepStats):
            setattr(self.totals, f.name, getattr(self.totals, f.name) + getattr(stats, f.name))
        if self._writer is not None and rounding is not None:
            self.log_bytes.append(self._writer.write_step(step, rounding.recorded))
        self._commit(step, batch_hash, rounding)

    def _commit(self, step: int, batch_hash: bytes, rounding: StepRounding | None = None) -> None:
        assert self.model is not None
        if self.mode == "off":  # no bundle: nobody reads a commitment, so don't pay for hashing
            return
        tensors = commit.state_tensors(self.model, self.optimizers)
        state_hash = commit.hash_tensors(tensors, [("sources", self.sources.digest_bytes())])
        if self.mode == "replay":
            assert self.bundle is not None
            if step >= len(self.bundle.leaves):
                raise Divergence(step, True, [], f"the bundle has only {self.bundle.steps} steps")
            want_state, want_batch = self.bundle.leaves[step]
            if state_hash != want_state:
                anomalies = rounding.anomalies if rounding is not None else []
                raise Divergence(step, batch_hash == want_batch, anomalies)
        self.leaves.append((state_hash, batch_hash))
        if self.mode == "record" and self.checkpoint_every and step and step % self.checkpoint_every == 0:
            self._checkpoint(step, tensors)

    def _checkpoint(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.dir is not None
        meta = {"step": step, "sources": self.sources.state_dict()}
        bundle_mod.save_checkpoint(self.dir, step, tensors, meta)

    def _finish_record(self) -> None:
        assert self.dir is not None
        if self.model is None:
            raise RuntimeError("Session closed before init(): nothing was recorded")
        if self.step_index and (not self.checkpoint_every or self.step_index % self.checkpoint_every):
            self._checkpoint(self.step_index, commit.state_tensors(self.model, self.optimizers))
        if self._writer is not None:
            self._writer.close()
        bundle_mod.write_commitments(self.dir, self.leaves)
        root = commit.merkle_root([commit.leaf(i, s, b) for i, (s, b) in enumerate(self.leaves)])
        thresholds = {
            **self.thresholds.to_json(),
            "calibration_steps": self.calibration_steps,
            "margin": self.margin,
        }
        manifest = {
            "config": self.config,
            "precision": self.precision.kind,
            "hardware": self.hardware,
            "sources": self._initial_sources,
            "thresholds": thresholds,
            "steps": self.step_index,
            "checkpoint_every": self.checkpoint_every,
            "merkle_root": root.hex(),
            "data_fingerprint": self.data_fingerprint,
            "stats": {**dataclasses.asdict(self.totals), "log_bytes": sum(self.log_bytes)},
            "torch": torch.__version__,
        }
        bundle_mod.write_manifest(self.dir, manifest)

    # ------------------------------------------------------------------ helpers
    def _module_path(self) -> str:
        if self._tracker is None:
            return ""
        names = [p for p in self._tracker.parents if p != "Global"]
        where = max(names, key=lambda n: n.count("."), default="")
        if where and self._tracker.is_bw:
            return f"{where} (backward)"
        return where

    def verify_checkpoints(self) -> None:
        """Check that each checkpoint in the replayed bundle holds the committed state of its step."""
        assert self.bundle is not None
        for step in self.bundle.checkpoint_steps:
            if step >= len(self.bundle.leaves):
                raise bundle_mod.BundleError(f"{bundle_mod.checkpoint_name(step)}: step beyond the run")
            tensors, meta = self.bundle.load_checkpoint(step)
            src = state_bytes(meta.get("sources", {}))
            got = commit.hash_tensors(tensors, [("sources", src)])
            if got != self.bundle.leaves[step][0]:
                raise Divergence(
                    step, True, [], f"{bundle_mod.checkpoint_name(step)} differs from the commitment"
                )


def _as_tuple(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
