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
from typing import Any, Protocol

import numpy as np
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


class StatePart(Protocol):
    """State beyond the model and optimizers that a run commits to and resumes from (see :meth:`Session.attach`).

    ``digest()`` is hashed into every step's commitment, so it must be cheap (a DQN's replay buffer keeps a
    running hash chain of what was added). ``state()``/``load_state()`` go into checkpoints for resuming.
    """

    def digest(self) -> bytes: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(arrays, meta)``: numpy arrays or tensors, and JSON-serialisable metadata."""
        ...

    def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None: ...


#: Checkpoint tensors under this prefix are resume state of attached parts, outside the state commitment.
RESUME_PREFIX = "resume/"


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
        calibration_steps: with ``thresholds="calibrate"``, measure thresholds during this many first steps
            (a DQN's first update comes after thousands of acting-only steps; its ops must be calibrated).
        route_random_ops: route random aten ops (dropout) inside steps to the ``dropout`` stream. A run
            whose model draws nothing at random may switch this off to save the dispatch-mode overhead;
            torch's global RNG is then seeded from the ``dropout`` stream, so a stray random op is still
            deterministic.
        resume: with ``mode="record"``, continue the finished bundle in ``run_dir`` from its last
            checkpoint instead of starting over (see :meth:`restore`).
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
        calibration_steps: int = 1,
        route_random_ops: bool = True,
        resume: bool = False,
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
                    self.calibration_steps = max(1, int(calibration_steps))
            else:
                raise ValueError(f"thresholds must be a Thresholds or 'calibrate', not {thresholds!r}")
        self._resume: _ResumePoint | None = None
        if resume:
            if mode != "record" or self.dir is None:
                raise ValueError("resume needs mode='record' and the bundle directory")
            self._resume = _ResumePoint.read(self.dir)
            self.precision = Precision(self._resume.bundle_precision)
            self.thresholds = self._resume.thresholds
            self.calibration_steps = self._resume.calibration_steps
            self._calibrator = None
            if self.calibration_steps > self._resume.step:
                raise bundle_mod.BundleError(
                    f"{self.dir}: cannot resume at step {self._resume.step}, inside the calibration "
                    f"steps 1..{self.calibration_steps}"
                )
        self._initial_sources = (
            self._resume.initial_sources if self._resume is not None else self.sources.state_dict()
        )
        self.stop_requested = False  # set from outside (Ctrl-C): a loop may end early after a whole step
        self.route_random_ops = route_random_ops
        self.parts: dict[str, StatePart] = {}
        self._digests = commit.DigestCache() if mode == "record" else None
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
            keep = self._resume.step if self._resume is not None else -1
            for old in (self.dir / bundle_mod.CHECKPOINTS).glob("step_*.safetensors"):
                if int(old.stem.removeprefix("step_")) > keep:
                    old.unlink()
            if self.precision.is_verifiable:
                self._writer = RoundLogWriter(self.dir / bundle_mod.ROUNDLOG, level=LOG_ZSTD_LEVEL)
                for step, ops in self._resume.log_segments if self._resume is not None else []:
                    self.log_bytes.append(self._writer.write_step(step, ops))
        if not self.route_random_ops:
            torch.manual_seed(self.sources.seed_of("dropout"))
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

    def attach(self, name: str, part: StatePart) -> StatePart:
        """Commit ``part.digest()`` with every step and checkpoint its state (a replay buffer, an env)."""
        if not name.isidentifier():
            raise ValueError(f"part name must be an identifier, not {name!r}")
        self.parts[name] = part
        return part

    def restore(self) -> int:
        """Resume: load the last checkpoint into the model, optimizers, switchboard and attached parts.

        Call after :meth:`init`, :meth:`track` and :meth:`attach`. Returns the number of steps already done
        (0 when not resuming). The model built by ``init`` must commit to the bundle's step 0, so a resumed
        run is the run it continues.
        """
        r = self._resume
        if r is None:
            return 0
        assert self.model is not None, "call init() before restore()"
        if self.leaves[0][0] != r.leaves[0][0]:
            raise bundle_mod.BundleError(
                f"{self.dir}: the config builds a different initial model than the bundle it would resume"
            )
        tensors, meta = r.tensors, r.meta
        committed = {k: v for k, v in tensors.items() if not k.startswith(RESUME_PREFIX)}
        _load_state_tensors(self.model, self.optimizers, committed)
        try:
            self.sources.load_state_dict(meta["sources"])
            parts = dict(meta.get("parts", {}))
            for name, part in self.parts.items():
                if name not in parts:
                    raise ValueError(f"the checkpoint has no state for {name!r}")
                prefix = f"{RESUME_PREFIX}{name}/"
                arrays = {k[len(prefix) :]: v.numpy() for k, v in tensors.items() if k.startswith(prefix)}
                part.load_state(arrays, dict(parts[name]["meta"]))
        except (KeyError, TypeError, ValueError) as e:
            raise bundle_mod.BundleError(
                f"{bundle_mod.checkpoint_name(r.step)}: cannot resume: {e}"
            ) from None
        self.leaves = list(r.leaves[: r.step + 1])
        self.step_index = r.step
        # The restored state must be the state the bundle committed to at this step.
        if self._state_hash(commit.state_tensors(self.model, self.optimizers)) != r.leaves[r.step][0]:
            raise bundle_mod.BundleError(
                f"{bundle_mod.checkpoint_name(r.step)}: restored state differs from the step commitment"
            )
        return r.step

    def observe(self, *data: Any) -> None:
        """Bind the data this step consumes (arrays, tensors) into its commitment: an RL transition."""
        if self.mode == "off":  # nothing is committed
            return
        self._batch_hash = commit.hash_batch(*data)

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
    def step(self, batch: Any = None, frozen: bool = False) -> Iterator[StepRounding | None]:
        """One training step: forward, backward and optimizer update go inside. Commits on exit.

        ``batch``: the data the step consumes, if it did not come from :meth:`loader` (hashed into the
        step's commitment).
        ``frozen``: the step writes no model parameter, buffer or optimizer state (a DQN step that only
        acts): the recorder reuses their digests from the previous commitment instead of rehashing. The
        auditor always rehashes, so a false claim is a divergence at this step.
        """
        if self.model is None:
            raise RuntimeError("call Session.init(build_model) before the first step")
        step = self.step_index + 1
        if batch is not None:
            self._batch_hash = commit.hash_batch(*_as_tuple(batch))
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
            if self.route_random_ops:
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
        if rounding is not None:
            stats = rounding.stats
            for name in _STATS_FIELDS:
                setattr(self.totals, name, getattr(self.totals, name) + getattr(stats, name))
        else:
            stats = _NO_STATS  # shared: a DQN takes a step per env step, and most round nothing
        self.step_stats.append(stats)
        if self._writer is not None and rounding is not None:
            self.log_bytes.append(self._writer.write_step(step, rounding.recorded))
        batch_hash, self._batch_hash = self._batch_hash or bytes(32), None
        self._commit(step, batch_hash, rounding, frozen)

    def _commit(
        self, step: int, batch_hash: bytes, rounding: StepRounding | None = None, frozen: bool = False
    ) -> None:
        assert self.model is not None
        if self.mode == "off":  # no bundle: nobody reads a commitment, so don't pay for hashing
            return
        tensors = commit.state_tensors(self.model, self.optimizers)
        state_hash = self._state_hash(tensors, reuse=frozen)
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

    def _state_hash(self, tensors: dict[str, torch.Tensor], reuse: bool = False) -> bytes:
        parts = {name: part.digest() for name, part in self.parts.items()}
        return commit.state_hash(tensors, self.sources.digest_bytes(), parts, self._digests, reuse)

    def _checkpoint(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.dir is not None
        parts: dict[str, Any] = {}
        out = dict(tensors)
        for name, part in self.parts.items():
            arrays, meta = part.state()
            for key, value in arrays.items():
                out[f"{RESUME_PREFIX}{name}/{key}"] = torch.as_tensor(np.ascontiguousarray(value))
            parts[name] = {"digest": part.digest().hex(), "meta": meta}
        meta = {"step": step, "sources": self.sources.state_dict(), "parts": parts}
        bundle_mod.save_checkpoint(self.dir, step, out, meta)

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
            committed = {k: v for k, v in tensors.items() if not k.startswith(RESUME_PREFIX)}
            try:
                parts = {n: bytes.fromhex(p["digest"]) for n, p in dict(meta.get("parts", {})).items()}
            except (TypeError, ValueError, KeyError):
                raise bundle_mod.BundleError(
                    f"{bundle_mod.checkpoint_name(step)}: bad part digests"
                ) from None
            got = commit.state_hash(committed, state_bytes(meta.get("sources", {})), parts)
            if got != self.bundle.leaves[step][0]:
                raise Divergence(
                    step, True, [], f"{bundle_mod.checkpoint_name(step)} differs from the commitment"
                )


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(StepStats))
_NO_STATS = StepStats()


def _load_state_tensors(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], tensors: dict[str, torch.Tensor]
) -> None:
    """Inverse of :func:`commit.state_tensors`: copy parameters, buffers and optimizer state back in."""
    expected = commit.state_tensors(model, optimizers)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            if name.startswith("param.") or name.startswith("buffer."):
                if name not in expected:
                    raise bundle_mod.BundleError(f"checkpoint tensor {name!r} is not in the model")
                target = expected[name]
                if target.shape != t.shape or target.dtype != t.dtype:
                    raise bundle_mod.BundleError(f"checkpoint tensor {name!r}: shape or dtype differs")
                target.copy_(t)
                continue
            i, _, rest = name.partition(".opt.")
            pname, _, key = rest.rpartition(".")
            if not i.isdigit() or int(i) >= len(optimizers) or pname not in params:
                raise bundle_mod.BundleError(f"checkpoint tensor {name!r} is not model or optimizer state")
            optimizers[int(i)].state[params[pname]][key] = t.clone()


@dataclasses.dataclass
class _ResumePoint:
    """What resuming a finished bundle needs: its last checkpoint, commitments and log up to that step."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    leaves: list[tuple[bytes, bytes]]
    bundle_precision: str
    thresholds: Thresholds
    calibration_steps: int
    log_segments: list[tuple[int, list]]
    initial_sources: dict[str, Any]

    @classmethod
    def read(cls, run_dir: Path) -> _ResumePoint:
        b = bundle_mod.Bundle(run_dir)
        try:
            if not b.checkpoint_steps:
                raise bundle_mod.BundleError(f"{run_dir}: no checkpoint to resume from")
            step = b.checkpoint_steps[-1]
            tensors, meta = b.load_checkpoint(step)
            if not isinstance(meta.get("sources"), dict) or not isinstance(meta.get("parts", {}), dict):
                raise bundle_mod.BundleError(f"{bundle_mod.checkpoint_name(step)}: no resume state")
            try:
                thresholds = Thresholds.from_json(b.thresholds)
            except ValueError as e:
                raise bundle_mod.BundleError(f"{bundle_mod.MANIFEST}: {e}") from None
            segments = []
            if b.roundlog is not None:
                for s in b.roundlog.steps:
                    if s <= step:
                        ops = b.read_log_step(s)
                        segments.append((s, [ops[k] for k in sorted(ops)]))
            return cls(
                step, tensors, meta, list(b.leaves), b.precision, thresholds,
                int(b.thresholds.get("calibration_steps", 0)), segments, b.sources,
            )  # fmt: skip
        finally:
            b.close()


def _as_tuple(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
