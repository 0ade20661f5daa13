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
step, whether the batch differed, and the decisive rounding anomaly (op, module, element).

The Session drives; :mod:`detrl.formats.bundle` owns the files (:class:`~detrl.formats.bundle.BundleWriter` while
recording, :class:`~detrl.formats.bundle.Bundle` when replaying or resuming).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, overload

import numpy as np
import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from detrl.core import calibrate, extensions, native, portable
from detrl.core.calibrate import DEFAULT_MARGIN, Calibrator
from detrl.core.hardware import HardwareMode, Profile, get_profile
from detrl.core.oprules import RULES_REVISION, canonical_nans
from detrl.core.parts import StateDictPart, grad_scaler_part, scheduler_part
from detrl.core.portable import portable_kernels
from detrl.core.precision import Precision, at_width
from detrl.core.randomness import StreamRandomMode
from detrl.core.rounding import (
    TAU_FLOOR,
    TAU_FLOOR_MEASURED,
    UNREACHED,
    Anomaly,
    LogOutOfRange,
    RoundingMode,
    StepRounding,
    StepStats,
    Thresholds,
)
from detrl.core.sources import Sources, state_bytes
from detrl.formats import bundle as bundle_mod
from detrl.formats import commit
from detrl.formats.bundle import RESUME_PREFIX, BundleError
from detrl.formats.roundlog import RoundLogError

__all__ = ["RESUME_PREFIX", "Batch", "Divergence", "Loader", "Session", "StatePart"]


class Divergence(Exception):
    """Replay produced a state whose commitment differs from the recorded one."""

    def __init__(self, step: int, batch_matches: bool, anomalies: list[Anomaly], detail: str = "") -> None:
        self.step = step
        self.batch_matches = batch_matches
        self.anomalies = anomalies
        self.detail = detail
        super().__init__(self.describe())

    @property
    def decisive(self) -> Anomaly | None:
        """The first anomaly where the log breaks its claim (a missing or refused entry): the one that
        explains the mismatch, never an honest correction on hardware that needs them."""
        return next((a for a in self.anomalies if a.violation), None)

    def describe(self) -> str:
        parts = [f"diverged at step {self.step}"]
        if self.detail:
            parts.append(self.detail)
        if not self.batch_matches:
            parts.append("the batch the trainer committed differs from the auditor's data at this step")
        a = self.decisive
        if a is not None:
            parts.append(f"rounding log {a.kind}: {a.where()}")
            parts.append(a.blame())
        elif self.batch_matches and self.anomalies:
            c = self.anomalies[0]
            parts.append(
                "no log entry breaks its thresholds; the log's first correction of this machine's rounding: "
                f"{c.where()} ({c.kind})"
            )
        elif self.batch_matches and not self.detail:
            parts.append(
                "no rounding-log anomaly in this step: the update itself differs (e.g. a skipped step)"
            )
        return "; ".join(parts)


#: The LR schedulers :meth:`Session.track` takes (``ReduceLROnPlateau`` is no ``LRScheduler`` before torch 2.2).
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_Scheduler = torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau


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


@dataclasses.dataclass
class Batch:
    """One minibatch: ``x`` inputs, ``y`` targets (shape ``(batch, ...)``), ``index`` dataset rows used."""

    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor


class _OrderedTracker(ModuleTracker):
    """torch's ModuleTracker, plus the order modules were entered in. Its ``parents`` is a set, and in
    backward several modules can be in it at once (one whose inputs need no gradient never leaves): the
    deepest of them was whichever the set iterated first, and string hashes are salted per process, so
    one ``convolution_backward`` was named after ``conv2`` in one audit and ``dropout`` in another. An
    op belongs to the module entered last that has not left: the innermost one running."""

    def __init__(self) -> None:
        super().__init__()
        self._order: dict[str, None] = {}  # insertion-ordered: the last entry is the latest entered

    def _get_append_fn(self, name: str, is_bw: bool) -> Callable[..., None]:
        enter = super()._get_append_fn(name, is_bw)

        def append(*args: Any) -> None:
            self._order.pop(name, None)
            self._order[name] = None
            enter(*args)

        return append

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:  # noqa: A002 (torch's name)
        """torch's, except that a leaf input (a tensor the step made ``requires_grad_()`` for a gradient
        penalty's ``autograd.grad``) gets no backward hook: torch refuses a multi-grad hook on a leaf while
        ``autograd.grad`` runs, and the replay of such a step crashed. Such a module leaves in backward as
        one whose inputs need no gradient does: never (the innermost one still running names the op)."""
        name = self._get_mod_name(mod)
        self._get_append_fn(name, False)()
        args, _ = tree_flatten(input)
        tensors = [
            a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is not None
        ]
        if tensors:
            self._hooks.append(register_multi_grad_hook(tensors, self._get_pop_fn(name, True)))

    def current(self) -> str:
        """The module path of the op running now ("" outside every module)."""
        return next((n for n in reversed(self._order) if n in self.parents and n != "Global"), "")


def _check_claims(
    thresholds: Thresholds, calibration_steps: int, calibrates: int | None, from_config: bool
) -> None:
    """Raise ValueError (naming the manifest field) for thresholds or calibration steps no honest recorder
    writes: a threshold below :data:`TAU_FLOOR_MEASURED` (calibration's least), a default below
    :data:`TAU_FLOOR` (what an op calibration never measured gets), no calibration step where the run
    calibrates, or for a task config other calibration steps than it gives."""
    for name, tau in sorted(thresholds.per_op.items()):
        if tau < TAU_FLOOR_MEASURED:
            raise ValueError(
                f"thresholds.per_op.{name[:64]}: {tau:g} is below 2**-26, the least threshold calibration writes"
            )
    for key, tau in sorted(thresholds.per_class.items()):
        op = thresholds.per_op.get(key.partition("(")[0])
        if op is None:
            raise ValueError(f"thresholds.per_class.{key[:64]}: a class of an op with no per_op threshold")
        if tau < TAU_FLOOR_MEASURED:
            raise ValueError(
                f"thresholds.per_class.{key[:64]}: {tau:g} is below 2**-26, the least threshold calibration writes"
            )
        if tau > op:
            raise ValueError(f"thresholds.per_class.{key[:64]}: {tau:g} is above its op's {op:g}")
    if thresholds.default < TAU_FLOOR:
        raise ValueError(
            f"thresholds.default: {thresholds.default:g} is below 2**-22, the least a run declares"
        )
    if calibrates is not None and calibration_steps < 1:
        raise ValueError("calibration_steps: 0, but the run calibrates its thresholds in its first steps")
    if calibrates is not None and from_config and calibration_steps != calibrates:
        raise ValueError(f"calibration_steps: {calibration_steps}, but its config calibrates in {calibrates}")


def _calibrator(thresholds: Thresholds, margin: float, rules_revision: int) -> Calibrator:
    """A calibration that measures against :data:`calibrate.PROFILES`, seeded so that every recording of a
    config measures (and so logs) the same."""
    profiles = [get_profile(p, seed=calibrate.CALIBRATION_SEED) for p in calibrate.PROFILES]
    return Calibrator(
        thresholds, profiles, margin, per_output=rules_revision >= 4, rules_revision=rules_revision
    )


def _weakly(method: Callable[[], str]) -> Callable[[], str]:
    """``method``, bound to a session, through a weak reference (``""`` once the session is gone): the
    session holds what it is given to, and must not be kept alive by it (see :class:`Loader`)."""
    ref = weakref.WeakMethod(method)

    def call() -> str:
        bound = ref()
        return bound() if bound is not None else ""

    return call


class Loader:
    """Minibatches of ``data = (x, y)`` in an order drawn from the ``data_order`` stream (see
    :meth:`Session.loader`). Its position is resume state: a resumed run continues mid-epoch."""

    def __init__(
        self,
        session: Session,
        data: tuple[torch.Tensor, torch.Tensor],
        batch_size: int,
        steps: int | None,
        epochs: int | None,
    ) -> None:
        x, _ = data
        if len(x) < batch_size:
            raise ValueError(f"dataset has {len(x)} examples, fewer than batch_size={batch_size}")
        if steps is None and epochs is None:
            raise ValueError("loader needs steps or epochs")
        # Weakly: the session holds its loader as resume state, and a cycle would keep the run's model and
        # optimizer state alive until Python's cyclic collector next runs, which with few but huge tensors
        # can be runs later (the GPT-2 small replication rows were killed for memory that way).
        self.session: Session = weakref.proxy(session)
        self.data, self.batch_size = data, batch_size
        self.steps, self.epochs = steps, epochs
        self.done, self.epoch, self.pos = 0, 0, 0
        self.order: np.ndarray | None = None  # the current epoch's permutation, once drawn

    def digest(self) -> bytes:
        return b""  # each batch is committed as the step's batch hash

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        arrays = {"order": self.order} if self.order is not None else {}
        return arrays, {"done": self.done, "epoch": self.epoch, "pos": self.pos}

    def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        self.done, self.epoch, self.pos = int(meta["done"]), int(meta["epoch"]), int(meta["pos"])
        order = arrays.get("order")
        self.order = None if order is None else np.asarray(order, dtype=np.int64)
        if self.order is not None and sorted(self.order.tolist()) != list(range(len(self.data[0]))):
            raise ValueError("loader order is not a permutation of the dataset")

    def __iter__(self) -> Iterator[Batch]:
        x, y = self.data
        n, s = len(x), self.session
        while (self.steps is None or self.done < self.steps) and (
            self.epochs is None or self.epoch < self.epochs
        ):
            if self.order is None:
                self.order = s.sources.permutation("data_order", n).numpy()
            if self.pos + self.batch_size > n:  # the last incomplete batch is dropped
                self.order, self.pos, self.epoch = None, 0, self.epoch + 1
                continue
            idx = torch.from_numpy(self.order[self.pos : self.pos + self.batch_size])
            self.pos += self.batch_size
            self.done += 1
            bx, by = x[idx], y[idx]
            s._batch_hash = commit.hash_batch(bx, by)
            yield Batch(s.precision.cast(bx).to(s.device), by.to(s.device), idx)


class Session:
    """Record or replay one training run.

    Args:
        run_dir: the bundle directory (written when recording, read when replaying; None for ``mode="off"``).
        mode: ``"record"``, ``"replay"`` or ``"off"`` (train without a bundle, e.g. for ablations).
        precision: ``fp32``, ``fp64`` or ``verifiable``. Replay and resume take it from the bundle.
        sources: the switchboard. Replay takes it from the bundle.
        hardware: profile name (``native``, ``emulated:splitk``, ...; see :mod:`detrl.core.hardware`) or a
            :class:`~detrl.core.hardware.Profile` instance (a machine of your own).
        checkpoint_every: save a checkpoint every this many steps (0: only the last). Each is a durable point.
        thresholds: a :class:`Thresholds`, or ``"calibrate"`` to measure them during the first steps.
        margin: calibrated threshold = margin x the largest disagreement measured between profiles.
        task: the registered task whose config this is (``detrl audit`` replays it); None: a script, which
            is replayed by running the script with ``mode="replay"``.
        config: the task's config, stored in the manifest so ``detrl audit`` can rebuild the run.
        planned_steps: the steps the run means to take (a run that ends before is ``stopped``, resumable).
        data_fingerprint: SHA-256 hex of the training data, stored in the manifest and checked on replay.
        device: torch device for model and data (default: ``cuda`` on the ``cuda`` profile, else ``cpu``).
        track_modules: name module paths in rounding anomalies (default: when replaying).
        calibration_steps: with ``thresholds="calibrate"``, measure thresholds during this many first steps
            (a DQN's first update comes after thousands of acting-only steps; its ops must be calibrated).
        route_random_ops: route random aten ops (dropout) inside steps to the ``dropout`` stream. A run
            whose model draws nothing at random may switch this off to save the dispatch-mode overhead;
            torch's global RNG is then seeded from the ``dropout`` stream, so a stray random op is still
            deterministic. Either way, Python's ``random`` and NumPy's global RNG are seeded from that
            stream: at every step when routing (:meth:`Sources.seed_host_rngs`), else once here. The
            session leaves those two as it found them.
        resume: with ``mode="record"``, continue the bundle in ``run_dir`` from its last checkpoint (see
            :meth:`restore`); the bundle is unchanged until the run goes past the steps it holds.
        force: with ``mode="record"``, replace a bundle already in ``run_dir`` (otherwise refused).
        caps: the reader's bounds when replaying or resuming (:class:`detrl.formats.bundle.Caps`).
        start: with ``mode="replay"``, replay a segment from the checkpoint of step ``start`` instead of from
            step 0: the task builds its state as always (``init`` still checks step 0's commitment), then
            :meth:`restore` loads that checkpoint's model, optimizer, switchboard and part state, after
            checking it against the step's commitment as the full replay does when it reaches it. The
            bundle must hold a checkpoint of that step (bad input otherwise).
        stop: with ``mode="replay"``, end the replay after step ``stop`` (None: the bundle's last durable
            step); must be above ``start`` and at most the durable steps (bad input beyond them). The loop
            stops there as at the end of a bundle, and on exit the replay must have reached ``stop``.
            Checkpoints of steps ``start..stop`` are checked, and :attr:`step_stats`, :attr:`totals` and
            :attr:`first_violation` cover steps ``start+1..stop`` only. So a bundle's steps can be audited
            in segments between checkpoints (``detrl audit --workers``), or one disputed step replayed::

                with Session(run_dir, mode="replay", start=20, stop=23) as s:   # steps 21..23
                    task.run(cfg, s)          # calls s.restore() after building its state
                    s.verify_checkpoints()

            The default (``start=0, stop=None``) is the whole replay.
        ops_revision: the op-sequence revision of the code that runs the steps (a task's
            :attr:`~detrl.run.tasks.Task.ops_revision`). A fresh recording writes it in the manifest; replay
            and resume take the bundle's instead (1 where the manifest has none), so the code can dispatch the
            ops those steps dispatched, and refuse a bundle of a revision above this one as bad input.
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
        task: str | None = None,
        config: dict[str, Any] | None = None,
        planned_steps: int | None = None,
        data_fingerprint: str | None = None,
        device: str | torch.device | None = None,
        track_modules: bool | None = None,
        calibration_steps: int = 1,
        route_random_ops: bool = True,
        resume: bool = False,
        force: bool = False,
        caps: bundle_mod.Caps | None = None,
        start: int = 0,
        stop: int | None = None,
        ops_revision: int = 1,
    ) -> None:
        if mode not in ("record", "replay", "off"):
            raise ValueError(f"mode must be record, replay or off, not {mode!r}")
        if mode != "replay" and (start or stop is not None):
            raise ValueError("start and stop select a segment of a replay: they need mode='replay'")
        if start < 0 or (stop is not None and stop <= start):
            raise ValueError(f"a replayed segment needs 0 <= start < stop, not start={start}, stop={stop}")
        if mode != "off" and run_dir is None:
            raise ValueError(f"mode={mode!r} needs the bundle directory")
        if (
            isinstance(ops_revision, bool)
            or not isinstance(ops_revision, int)
            or not 1 <= ops_revision < 1 << 16
        ):
            raise ValueError(f"ops_revision must be an integer in [1, 65536), not {ops_revision!r}")
        self.mode = mode
        self.dir = Path(run_dir) if run_dir is not None else None
        self.profile = hardware if isinstance(hardware, Profile) else get_profile(hardware)
        self.hardware = self.profile.name
        # The ``cuda`` profile is a real GPU: a recording made there, or a replay on it, computes on it.
        self.device = torch.device(device if device is not None else self.profile.device)
        self.checkpoint_every = int(checkpoint_every)
        self.task = task
        self.config = None if config is None else dict(config)
        self.planned_steps = planned_steps
        self.data_fingerprint = data_fingerprint
        self.margin = margin
        self.force = force
        self.bundle: bundle_mod.Bundle | None = None
        self._writer: bundle_mod.BundleWriter | None = None
        self._calibrator: Calibrator | None = None
        self._resume: bundle_mod.ResumePoint | None = None
        self.calibration_steps = 0
        #: replay: the segment's first and last step (see ``start`` and ``stop`` above)
        self.start, self.stop = start, stop
        #: the op-sequence revision the steps run: the argument's, or the bundle's when replaying or resuming
        self.ops_revision = ops_revision
        #: the rounding rules the steps follow (oprules.RULES_REVISION): the bundle's when replaying or resuming
        self.rules_revision = RULES_REVISION
        if mode == "replay" or resume:  # precision, sources and thresholds come from the bundle
            if resume and mode != "record":
                raise ValueError("resume needs mode='record'")
            calibrates = max(1, int(calibration_steps)) if isinstance(thresholds, str) else None
            self._open_bundle(caps, resume, data_fingerprint, calibrates)
        else:  # a fresh recording, or a run without a bundle: they come from the arguments
            self._set_up_fresh(precision, sources, thresholds, margin, calibration_steps)
        self.stop_requested = False  # set from outside (Ctrl-C): a loop may end early after a whole step
        self.route_random_ops = route_random_ops
        self.parts: dict[str, StatePart] = {}
        # Recorder and auditor alike: the cache reuses a digest only for bytes it has compared equal.
        #: commitments take every NaN as one (rules revision 13): the bundle's revision decides, as for the rules
        self.canonical_nans = canonical_nans(self.rules_revision)
        self._digests = (
            commit.DigestCache(steady=extensions.steady_records(), canonical_nans=self.canonical_nans)
            if mode != "off"
            else None
        )
        # the per-step commitment's tensor list
        self._state_list = commit.StateTensorCache(extensions.same_listing() if mode != "off" else None)
        self._committed_parts: dict[str, bytes] = {}  # each part's digest in the last commitment
        self._tracker: _OrderedTracker | None = None
        if track_modules if track_modules is not None else mode == "replay":
            self._tracker = _OrderedTracker()
        self.rounding = RoundingMode(self.profile, self.thresholds, _weakly(self._module_path))
        self.rounding.rules_revision = self.rules_revision
        # The native route computes CPU tensors' ops; off the CPU the mode computes each as a CPU would.
        self.rounding.native_route = not portable.off_cpu(self.device)
        if self.precision.is_verifiable and self.rounding.native_route:
            native.available()  # load the native route now, with the Session: setup, not the first step's time
        self.model: torch.nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.step_index = 0
        self.leaves = bundle_mod.Leaves()  # (state hash, batch hash) of each step, 64 bytes a step
        self.totals = StepStats()
        self.step_stats: list[StepStats] = []
        self.log_bytes: list[int] = []
        self.step_seconds: list[float] = []
        #: replay: the first anomaly where the log broke its claim, with its step (for the verdict)
        self.first_violation: tuple[int, Anomaly] | None = None
        self._verified: set[int] = set()  # replay: checkpoints checked so far
        self._batch_hash: bytes | None = None
        self._stack = contextlib.ExitStack()

    def _open_bundle(
        self,
        caps: bundle_mod.Caps | None,
        resume: bool,
        data_fingerprint: str | None,
        calibrates: int | None,
    ) -> None:
        """Replay or resume: read the bundle and take precision, sources and thresholds from it.
        ``calibrates``: the calibration steps this Session's arguments give (None: fixed thresholds)."""
        self.bundle = bundle_mod.Bundle(self.dir, caps)  # type: ignore[arg-type]
        try:
            self._from_bundle(self.bundle, data_fingerprint, calibrates)
            if self.mode == "replay":
                self._replay_segment(self.bundle)
            if resume:
                self._resume = self.bundle.resume_point()
                self._resume_calibration(self._resume)
        except BaseException:
            self.bundle.close()
            raise
        if resume:
            self.bundle = None  # the writer owns it now (it compares re-recorded steps with it)

    def _set_up_fresh(
        self,
        precision: Precision | str,
        sources: Sources | None,
        thresholds: Thresholds | str,
        margin: float,
        calibration_steps: int,
    ) -> None:
        """A fresh recording (or ``mode="off"``): precision, sources and thresholds from the arguments; a
        verifiable run with ``thresholds="calibrate"`` measures its thresholds in its first steps."""
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        self.sources = sources if sources is not None else Sources()
        if isinstance(thresholds, Thresholds):
            self.thresholds = thresholds
        elif thresholds == "calibrate":
            self.thresholds = Thresholds(default=TAU_FLOOR * 64)
            if self.precision.is_verifiable:
                self._calibrator = _calibrator(self.thresholds, margin, self.rules_revision)
                self.calibration_steps = max(1, int(calibration_steps))
        else:
            raise ValueError(f"thresholds must be a Thresholds or 'calibrate', not {thresholds!r}")
        self._initial_sources = self.sources.state_dict()

    def _from_bundle(
        self, b: bundle_mod.Bundle, data_fingerprint: str | None, calibrates: int | None
    ) -> None:
        """Take precision, switchboard, thresholds and run shape from a bundle (every field checked).

        The thresholds and calibration steps are the trainer's claims about its own log: a verifiable
        bundle whose thresholds fall below what any honest calibration writes, or that calibrated in no
        step (or, for a task config, in other steps than its config gives) is bad input."""
        m = b.manifest
        not_ours = "sources: not a switchboard state as detrl writes it (a wrong type or key)"
        try:
            self.precision = Precision(m.precision)
            self.sources = Sources()
            try:
                self.sources.load_state_dict(m.sources)
                # load_state_dict coerces (int("7"), bool("x")) and ignores unknown keys: only a state
                # that reads back byte for byte is the switchboard the commitments hashed
                same = state_bytes(self.sources.state_dict()) == state_bytes(m.sources)
                seeds = list(m.sources["seeds"].values())
            except (TypeError, KeyError, AttributeError, ValueError, OverflowError):
                raise ValueError(not_ours) from None
            if not same:
                raise ValueError(not_ours)
            if not all(isinstance(s, int) and 0 <= s < 1 << 64 for s in seeds):
                raise ValueError("sources: a stream seed outside [0, 2**64)")
            if self.precision.is_verifiable and "default" not in m.thresholds:
                # from_json would fill in the class default: a threshold the trainer never claimed
                raise ValueError("thresholds.default: missing (the threshold of every op not in per_op)")
            self.thresholds = Thresholds.from_json(m.thresholds)
            if self.precision.is_verifiable:
                _check_claims(self.thresholds, m.calibration_steps, calibrates, m.task is not None)
            if m.ops_revision > self.ops_revision:
                raise ValueError(
                    f"ops_revision: recorded by a newer detrl (op-sequence revision {m.ops_revision}; this one "
                    f"runs revisions 1 to {self.ops_revision})"
                )
            if m.rules_revision > RULES_REVISION:
                raise ValueError(
                    f"rules_revision: recorded by a newer detrl (rounding-rule revision {m.rules_revision}; "
                    f"this one applies revisions 1 to {RULES_REVISION})"
                )
        except ValueError as e:
            raise BundleError(f"{bundle_mod.MANIFEST}: {e}") from None
        self._initial_sources = m.sources
        self.ops_revision = m.ops_revision
        self.rules_revision = m.rules_revision
        self.calibration_steps = m.calibration_steps
        self.margin = m.margin
        self.checkpoint_every = m.checkpoint_every
        if self.mode == "replay":
            self.task, self.config, self.planned_steps = m.task, m.config, m.planned_steps
        fp = m.data_fingerprint
        if data_fingerprint is not None and fp is not None and fp != data_fingerprint:
            raise BundleError(
                f"{bundle_mod.MANIFEST}: data fingerprint {fp[:16]}... differs from the auditor's data "
                f"{data_fingerprint[:16]}..."
            )

    def _resume_calibration(self, r: bundle_mod.ResumePoint) -> None:
        """Resuming inside the calibration steps continues the measurement where the checkpoint left it."""
        if not self.precision.is_verifiable or r.step >= self.calibration_steps:
            return
        if r.step == 0:  # nothing measured yet: calibrate from the start, as a fresh recording does
            self.thresholds = Thresholds(default=TAU_FLOOR * 64)
            self._calibrator = _calibrator(self.thresholds, self.margin, self.rules_revision)
            return
        try:
            self.thresholds = Thresholds.from_json(r.meta.get("thresholds", {}))
            self._calibrator = _calibrator(self.thresholds, self.margin, self.rules_revision)
            self._calibrator.load_state(dict(r.meta.get("calibration", {})))
        except (TypeError, ValueError) as e:
            raise BundleError(f"{bundle_mod.checkpoint_name(r.step)}: bad calibration state ({e})") from None

    def _replay_segment(self, b: bundle_mod.Bundle) -> None:
        """Replay: the segment's last step (the bundle's last durable one by default) and, from a checkpoint,
        the state :meth:`restore` loads (read now, so a missing or unreadable one fails before any work)."""
        if self.stop is None:
            self.stop = b.steps
        elif self.stop > b.steps:
            raise BundleError(
                f"{bundle_mod.MANIFEST}: a replay to step {self.stop}, but the bundle holds {b.steps} "
                "durable steps"
            )
        if not self.start:
            return
        if self.start not in b.checkpoint_steps:
            raise BundleError(
                f"{bundle_mod.checkpoint_name(self.start)}: the bundle has no checkpoint of step "
                f"{self.start} to replay from"
            )
        tensors, meta = b.load_checkpoint(self.start)
        self._resume = bundle_mod.ResumePoint(self.start, tensors, meta, b.leaves, b)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Session:
        if self.mode == "record":
            self._writer = bundle_mod.BundleWriter(
                self.dir,  # type: ignore[arg-type]
                self._manifest_header(),
                force=self.force,
                resume=self._resume,
            )
            # one copy of a recording's leaves (64 bytes a step), which the writer appends to
            self.leaves = self._writer.leaves
        if self._tracker is not None:
            self._stack.enter_context(self._tracker)
        # The steps own the host's global RNGs (each seeds them, see Sources.seed_host_rngs): they are left
        # as the session found them.
        self._stack.callback(_restore_host_rngs, random.getstate(), np.random.get_state())
        if not self.route_random_ops:
            torch.manual_seed(self.sources.seed_of("dropout"))
            self.sources.seed_host_rngs(0)  # no step seeds them: they draw on from here, as torch's does
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self.mode == "record" and exc_type is None:
                self._finish_record()
            elif self.mode == "replay" and exc_type is None and self.step_index != self.stop:
                steps = self.bundle.steps  # type: ignore[union-attr]
                short = f"the bundle has {steps}" if self.stop == steps else f"not to step {self.stop}"
                raise Divergence(
                    self.step_index + 1, True, [], f"the replay ran {self.step_index} steps, {short}"
                )
        finally:
            if self._writer is not None:
                self._writer.close()
            if self.bundle is not None:
                self.bundle.close()
            self._stack.close()

    @property
    def rerecording(self) -> bool:
        """A resumed recording still re-recording the steps its bundle holds: nothing has been written yet,
        and a step that differs refuses the resume with the bundle unchanged (so output beside the bundle,
        such as TensorBoard's, waits until this is False)."""
        return self._writer is not None and self._writer.unchanged

    def _manifest_header(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "config": self.config,
            "precision": self.precision.kind,
            "hardware": self.hardware,
            "sources": self._initial_sources,
            "thresholds": self.thresholds.to_json(),
            "calibration_steps": self.calibration_steps,
            "margin": float(self.margin),
            "checkpoint_every": self.checkpoint_every,
            "planned_steps": self.planned_steps,
            "data_fingerprint": self.data_fingerprint,
            "torch": torch.__version__,
            "ops_revision": self.ops_revision,
            "rules_revision": self.rules_revision,
        }

    # ------------------------------------------------------------------ building the run
    def init(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Build the model with the ``init`` stream, apply the bitflip switch, cast, commit step 0."""
        with self.sources.global_torch_rng("init"):
            model = build()
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.layout != torch.strided:
                raise ValueError(
                    f"Session.init: {name} is a {str(t.layout).removeprefix('torch.')} tensor; a run commits "
                    "and rounds dense tensors: densify it"
                )
        if self.precision.kind == "verifiable":
            _refuse_sparse_gradients(model)
        model = _cast_floats(model, torch.float32)  # weights start on the FP32 grid whatever the precision
        self.sources.apply_bitflip(model)
        model = _cast_floats(model.to(device=self.device), self.precision.dtype)
        self.model = model
        self._commit(0, bytes(32))
        if self.mode == "replay" and self.bundle is not None and self.bundle.steps == 0:
            self.stop_requested = True  # nothing after the initial state is durable
        return model

    @overload
    def track(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...
    @overload
    def track(self, optimizer: torch.amp.GradScaler) -> torch.amp.GradScaler: ...
    @overload
    def track(self, optimizer: _Scheduler) -> _Scheduler: ...

    def track(self, optimizer: Any) -> Any:
        """Include ``optimizer``'s state in commitments and checkpoints; returns it.

        An LR scheduler (``torch.optim.lr_scheduler``'s) and a ``torch.amp.GradScaler`` are tracked the
        same way, as the parts ``lr_scheduler`` and ``grad_scaler`` (a second one ``lr_scheduler2``, ...;
        :mod:`detrl.core.parts`): the scheduler with the hyperparameters it sets in its optimizer's groups,
        the scaler with its loss scale. A run that uses one must track it: a resumed run would otherwise
        restart it, and disagree with a replay from step 0. A state a run cannot commit (a tensor, an
        object) is refused with a ValueError.

        In verifiable precision an optimizer left to pick its implementation (``foreach=None``, torch's
        default) is pinned to the per-tensor loop: torch picks the ``_foreach`` ops on a GPU and the loop on
        a CPU, two op sequences, and a replay must dispatch the recorder's ops in the recorder's order (an
        explicit ``foreach=True`` is the same on every device, and stays). A fused optimizer (one kernel for
        the whole update, nothing to round op by op) is refused with a ValueError, and so is L-BFGS in any
        precision: its state holds lists (the curvature history), which a run cannot commit or resume.
        """
        if isinstance(optimizer, torch.amp.GradScaler):
            return self._track_state("grad_scaler", grad_scaler_part, optimizer)
        if isinstance(optimizer, _SCHEDULERS):
            return self._track_state("lr_scheduler", scheduler_part, optimizer)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS keeps its curvature history as lists of tensors, which a run cannot commit or resume: "
                "use an optimizer whose state is tensors and numbers (SGD, Adam, ...)"
            )
        if self.precision.is_verifiable:
            for group in optimizer.param_groups:
                if group.get("fused"):
                    raise ValueError(
                        f"{type(optimizer).__name__}(fused=True) updates in one kernel that verifiable precision "
                        "cannot round op by op: use fused=False"
                    )
                if "foreach" in group and group["foreach"] is None:
                    group["foreach"] = False
        self.optimizers.append(optimizer)
        return optimizer

    def _track_state(self, kind: str, make_part: Callable[[Any], StateDictPart], obj: Any) -> Any:
        """Attach ``obj``'s state as the part ``kind`` (``kind2``, ... if taken); returns ``obj``."""
        try:
            part = make_part(obj)
        except TypeError as e:
            raise ValueError(f"{type(obj).__name__}: {e}") from None
        name, n = kind, 1
        while name in self.parts:
            n += 1
            name = f"{kind}{n}"
        self.attach(name, part)
        return obj

    def attach(self, name: str, part: StatePart) -> StatePart:
        """Commit ``part.digest()`` with every step and checkpoint its state (a replay buffer, an env)."""
        if not name.isidentifier():
            raise ValueError(f"part name must be an identifier, not {name!r}")
        if name in self.parts:
            raise ValueError(f"a state part named {name!r} is already attached")
        self.parts[name] = part
        return part

    def restore(self) -> int:
        """Resume: load the last checkpoint into the model, optimizers, switchboard and attached parts.

        Call after :meth:`init`, :meth:`track`, :meth:`attach` and :meth:`loader`. Returns the number of
        steps already done (0 when not resuming). The model built by ``init`` must commit to the bundle's
        step 0, so a resumed run is the run it continues. A replay from ``start`` loads the checkpoint of
        that step instead, checked first as the full replay checks it when it gets there (a checkpoint
        that differs from its commitment diverges at its step); its stats count from zero.
        """
        r = self._resume
        if r is None or r.step == 0:
            return 0
        assert self.model is not None, "call init() before restore()"
        rel = bundle_mod.checkpoint_name(r.step)
        replay = self.mode == "replay"
        if replay:
            self._check_checkpoint(r.step, r.tensors, r.meta)
        committed = {k: v for k, v in r.tensors.items() if not k.startswith(RESUME_PREFIX)}
        _load_state_tensors(self.model, self.optimizers, committed)
        try:
            self.sources.load_state_dict(r.meta["sources"])
            parts = dict(r.meta.get("parts", {}))
            for name, part in self.parts.items():
                if name not in parts:
                    raise ValueError(f"the checkpoint has no state for {name!r}")
                prefix = f"{RESUME_PREFIX}{name}/"
                arrays = {k[len(prefix) :]: v.numpy() for k, v in r.tensors.items() if k.startswith(prefix)}
                part.load_state(arrays, dict(parts[name]["meta"]))
            totals = dict(r.meta.get("stats", {}))
            for name in _STATS_FIELDS:  # the recorder's counts, continued; a replay counts its own
                setattr(self.totals, name, 0 if replay else int(totals.get(name, 0)))
            self.log_bytes = [] if replay else [int(r.meta.get("log_bytes", 0))]
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{rel}: cannot {'replay from it' if replay else 'resume'}: {e}") from None
        self.leaves = self._writer.leaves if self._writer is not None else r.written[: r.step + 1]
        self.step_index = r.step
        # The restored state must be the state the bundle committed to at this step.
        if self._state_hash(commit.state_tensors(self.model, self.optimizers)) != self.leaves[r.step][0]:
            if replay:  # its committed tensors matched: the resume state beside them is not that state
                raise Divergence(r.step, True, [], f"{rel}: its resume state is not the committed state")
            raise BundleError(f"{rel}: restored state differs from the step commitment")
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
    ) -> Loader:
        """Minibatches of ``data = (x, y)`` in an order drawn from the ``data_order`` stream.

        Each epoch is a fresh permutation; the last incomplete batch is dropped. Stops after ``steps``
        batches or ``epochs`` epochs (one of them is required). Inputs are cast to the run's precision.
        The loader is attached as resume state (``loader``): create it before :meth:`restore`.
        """
        loader = Loader(self, data, batch_size, steps, epochs)
        self.attach("loader", loader)
        return loader

    # ------------------------------------------------------------------ steps
    def step(
        self, batch: Any = None, frozen: bool = False
    ) -> contextlib.AbstractContextManager[StepRounding | None]:
        """One training step: forward, backward and optimizer update go inside. Commits on exit.

        ``batch``: the data the step consumes, if it did not come from :meth:`loader` (hashed into the
        step's commitment): tensors, arrays or numbers, or dicts, lists and tuples of them, such as a
        Hugging Face batch (:func:`detrl.formats.commit.hash_batch`).
        ``frozen``: the step writes no model parameter, buffer or optimizer state (a DQN step that only
        acts). A hint only, kept for compatibility: commitments never depend on it, since the digest
        cache finds unchanged tensors by comparing their bytes (a false claim changes nothing).
        """
        if self.model is None:
            raise RuntimeError("call Session.init(build_model) before the first step")
        self._check_unchanged_since_commit()
        if batch is not None:
            self._batch_hash = commit.hash_batch(*_as_tuple(batch))
        # A plain step (FP32 or FP64 on native hardware, random ops left to torch) needs no mode but the
        # portable kernels: a small context object, not a generator, since a DQN takes a step per env step.
        if not self.precision.is_verifiable and self.hardware == "native" and not self.route_random_ops:
            return _PlainStep(self, frozen)
        return self._modes_step(frozen)

    @contextlib.contextmanager
    def _modes_step(self, frozen: bool) -> Iterator[StepRounding | None]:
        """A step under the modes its precision and hardware need (see :meth:`step`)."""
        step = self.step_index + 1
        rounding = None
        t0 = time.perf_counter()
        if self.route_random_ops:  # model code drawing from random or np.random replays too
            self.sources.seed_host_rngs(step)
        # Attention is its math decomposition: the same aten ops on every device, its dropout mask from the
        # dropout stream (see detrl/core/portable.py).
        with contextlib.ExitStack() as modes:
            modes.enter_context(portable_kernels())
            # A compiled model's generated kernels would compute outside every mode: inside a step it runs
            # as written (torch 2.6+; until torch._dynamo is loaded, nothing can have been compiled).
            if "torch._dynamo" in sys.modules and hasattr(torch.compiler, "set_stance"):
                modes.enter_context(torch.compiler.set_stance("force_eager"))
            # Innermost first: random ops are drawn from their stream before a profile sees them.
            if not self.precision.is_verifiable and self.hardware != "native":
                modes.enter_context(HardwareMode(self.profile))
            if self.precision.is_verifiable and portable.off_cpu(self.device):
                # a CPU's aten ops where a composite picks by device
                modes.enter_context(portable.cpu_op_sequence())
            if self.precision.is_verifiable:
                cursor = self.bundle.log_cursor(step) if self.bundle is not None else None
                rounding = StepRounding(replay=cursor if self.mode == "replay" else None)
                in_calibration = step <= self.calibration_steps
                calibrate = self._calibrator if in_calibration and self.mode == "record" else None
                if calibrate is not None:
                    calibrate.begin_step(step)
                # During calibration the recorder's thresholds grew as it went, each at least the lowest
                # floor: half of that is the sound threshold for counting unlogged near-midpoint elements.
                check = Thresholds(default=TAU_FLOOR_MEASURED / 2) if in_calibration else None
                # An op kind's threshold can also fall during calibration: from TAU_FLOOR, while every call
                # measured agreed exactly, to its measured value. Entries of those steps were logged at
                # most at max(final tau, TAU_FLOOR); the replayer honours them within that.
                honour = TAU_FLOOR if in_calibration else 0.0
                # The rounding mode routes random ops itself: one dispatch mode per op, not two.
                stream = self.sources.torch("dropout") if self.route_random_ops else None
                modes.enter_context(self.rounding.step_scope(rounding, calibrate, check, stream, honour))
            elif self.route_random_ops:
                modes.enter_context(StreamRandomMode(self.sources.torch("dropout")))
                if self.hardware == "native":  # the mode alone on the stack: its other ops run natively
                    modes.enter_context(native.random_route(self.profile))
            try:
                yield rounding
            except LogOutOfRange as e:
                raise BundleError(f"{bundle_mod.ROUNDLOG}: step {step}: {e}") from None
            except RoundLogError as e:
                raise BundleError(str(e)) from None
            except RuntimeError as e:
                _note_float32_data(e, self.precision)
                raise
        if rounding is not None and rounding.replay is not None:
            try:
                rounding.replay.finish()
            except RoundLogError as e:
                raise BundleError(str(e)) from None
            # Entries for op positions this replay never rounded: an honest recorder logs none of those.
            skipped = rounding.replay.skipped_records
            if skipped:
                rounding.stats.refused += skipped
                op = rounding.replay.first_skipped_op
                rounding.anomalies.append(Anomaly(op if op is not None else -1, "", "", -1, UNREACHED))
        self._end_step(step, rounding, t0, frozen)

    def _end_step(self, step: int, rounding: StepRounding | None, t0: float, frozen: bool) -> None:
        """A step's accounting and commitment, once its body returned."""
        self.step_seconds.append(time.perf_counter() - t0)
        self.step_index = step
        if rounding is not None:
            if self.first_violation is None:
                violation = next((a for a in rounding.anomalies if a.violation), None)
                if violation is not None:
                    self.first_violation = (step, violation)
            stats = rounding.stats
            for name in _STATS_FIELDS:
                setattr(self.totals, name, getattr(self.totals, name) + getattr(stats, name))
        else:
            stats = _NO_STATS  # shared: a DQN takes a step per env step, and most round nothing
        self.step_stats.append(stats)
        batch_hash, self._batch_hash = self._batch_hash or bytes(32), None
        self._commit(step, batch_hash, rounding, frozen)

    def on_commit(self, step: int, frozen: bool) -> None:
        """Called once step ``step``'s state is committed (recorded, or checked against the bundle); step 0
        is the initial model. ``frozen``: the step wrote no parameter. A subclass may observe the model
        here (see :class:`detrl.run.traced.TracedSession`); it must change nothing that is committed."""

    def _commit(
        self, step: int, batch_hash: bytes, rounding: StepRounding | None = None, frozen: bool = False
    ) -> None:
        self._commit_state(step, batch_hash, rounding)
        self.on_commit(step, frozen)

    def _commit_state(self, step: int, batch_hash: bytes, rounding: StepRounding | None) -> None:
        assert self.model is not None
        if self.mode == "off":  # no bundle: nobody reads a commitment, so don't pay for hashing
            return
        tensors = self._state_list(self.model, self.optimizers)
        state_hash = self._state_hash(tensors)
        if self.mode == "replay":
            assert self.bundle is not None
            if step >= len(self.bundle.leaves):
                raise Divergence(step, True, [], f"the bundle has only {self.bundle.steps} steps")
            want_state, want_batch = self.bundle.leaves[step]
            if state_hash != want_state:
                anomalies = rounding.anomalies if rounding is not None else []
                raise Divergence(step, batch_hash == want_batch, anomalies)
            if batch_hash != want_batch:  # the same state from other data: the commitment is still false
                raise Divergence(step, False, [], "the state matches, but the step's batch hash does not")
            self.leaves.append((state_hash, batch_hash))
            if step in self.bundle.checkpoint_steps:
                self._verify_checkpoint(step)
            if step >= self.stop:  # type: ignore[operator]
                # the rest of the recording is not durable (or not this segment's): stop the loop here
                self.stop_requested = True
            return
        if self._resume is not None and step == 0 and self._resume.written:
            if state_hash != self._resume.written[0][0]:
                raise BundleError(
                    f"{self.dir}: the config builds a different initial model than the bundle it would resume"
                )
            return  # restore() takes the leaves from the bundle
        assert self._writer is not None and self.leaves is self._writer.leaves
        ops = rounding.recorded if rounding is not None else None
        self.log_bytes.append(self._writer.append_step(step, state_hash, batch_hash, ops))  # appends the leaf
        if step == 0:
            self._writer.make_durable()  # the initial state: an audit can say "incomplete at step 0"
            return
        calibrated = self.precision.is_verifiable and step == self.calibration_steps
        if calibrated:  # the thresholds are final now: the manifest must say so from here on
            self._writer.update_header(thresholds=self.thresholds.to_json())
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            self._checkpoint(step, tensors)
        elif calibrated:
            self._sync()

    def _state_hash(self, tensors: dict[str, torch.Tensor]) -> bytes:
        parts = {name: part.digest() for name, part in self.parts.items()}
        self._committed_parts = parts
        return commit.state_hash(
            tensors, self.sources.digest_bytes(), parts, self._digests, canonical_nans=self.canonical_nans
        )

    def _committed_digest(self, name: str, part: StatePart) -> bytes | None:
        """A tracked scheduler's or scaler's digest in the last commitment (None for other parts, or before
        a commitment held it)."""
        return self._committed_parts.get(name) if isinstance(part, StateDictPart) else None

    def _check_unchanged_since_commit(self) -> None:
        """A tracked scheduler or scaler (:mod:`detrl.core.parts`) must change inside steps only: one stepped
        between two (after the commitment) is checkpointed before its change, and a run resumed there
        would skip that change. RuntimeError names it."""
        for name, part in self.parts.items():
            committed = self._committed_digest(name, part)
            if committed is not None and part.digest() != committed:
                raise RuntimeError(
                    f"the run's {name} changed after step {self.step_index} was committed: step it (and set "
                    "its optimizer's hyperparameters) inside `with session.step():`, so that each step's "
                    "commitment and checkpoint hold it, or a resumed run would not be the run it continues"
                )

    def _stats(self) -> dict[str, int]:
        return {**dataclasses.asdict(self.totals), "log_bytes": sum(self.log_bytes)}

    def _sync(self, status: str = "recording", stopped_at: int | None = None) -> None:
        assert self._writer is not None
        self._writer.stats = self._stats()
        self._writer.make_durable(status, stopped_at)

    def _checkpoint(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        status: str = "recording",
        stopped_at: int | None = None,
    ) -> None:
        assert self._writer is not None
        resume, parts = self._resume_state()
        out = {**tensors, **resume}
        meta: dict[str, Any] = {
            "step": step, "sources": self.sources.state_dict(), "parts": parts,
            "stats": dataclasses.asdict(self.totals), "log_bytes": sum(self.log_bytes),
        }  # fmt: skip
        if self._calibrator is not None and step < self.calibration_steps:
            meta["thresholds"] = self.thresholds.to_json()
            meta["calibration"] = self._calibrator.state()
        self._writer.stats = self._stats()
        self._writer.checkpoint(step, out, meta, status, stopped_at)

    def _resume_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a checkpoint carries beyond the committed state: every attached part's arrays (under
        ``resume/PART/KEY``) and its digest and metadata."""
        arrays: dict[str, torch.Tensor] = {}
        parts: dict[str, Any] = {}
        for name, part in self.parts.items():
            # a scheduler or scaler: its digest as committed, and the state its state() keeps from then
            committed = self._committed_digest(name, part)
            digest = committed if committed is not None else part.digest()
            values, meta = part.state()
            for key, value in values.items():
                arrays[f"{RESUME_PREFIX}{name}/{key}"] = torch.as_tensor(np.ascontiguousarray(value))
            parts[name] = {"digest": digest.hex(), "meta": meta}
        return arrays, parts

    def _finish_record(self) -> None:
        if self.model is None:
            raise RuntimeError("Session closed before init(): nothing was recorded")
        planned = self.planned_steps
        stopped = planned is not None and self.step_index < planned
        status, stopped_at = ("stopped", self.step_index) if stopped else ("complete", None)
        if self.step_index and (not self.checkpoint_every or self.step_index % self.checkpoint_every):
            self._checkpoint(
                self.step_index, commit.state_tensors(self.model, self.optimizers), status, stopped_at
            )
        else:
            self._sync(status, stopped_at)

    # ------------------------------------------------------------------ helpers
    def _module_path(self) -> str:
        if self._tracker is None:  # recording: found only when asked (a refused op), from the Python stack
            return _module_on_stack(self.model)
        where = self._tracker.current()
        if where and self._tracker.is_bw:
            return f"{where} (backward)"
        return where

    def verify_checkpoints(self) -> None:
        """Check that each checkpoint in the replayed bundle (or segment: steps ``start..stop``) holds the
        committed state of its step (the replay checked those of the steps it reached as it went, resume
        state included)."""
        assert self.bundle is not None
        for step in self.bundle.checkpoint_steps:
            if self.start <= step <= self.stop and step not in self._verified:  # type: ignore[operator]
                self._verify_checkpoint(step, resume=False)

    def _verify_checkpoint(self, step: int, resume: bool = True) -> None:
        """The checkpoint of ``step`` holds the committed state (its hash is the step's commitment) and,
        with ``resume`` (the replay stands at that step), the resume state this replay holds there: the
        switchboard and every part's arrays and metadata, byte for byte. So nothing a resumed recording
        or a replay from the checkpoint starts from is only the trainer's word."""
        assert self.bundle is not None
        tensors, meta = self.bundle.load_checkpoint(step)
        self._check_checkpoint(step, tensors, meta)
        if resume:
            self._check_resume_state(step, tensors, meta)

    def _check_checkpoint(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The checkpoint of ``step`` (its ``tensors`` and ``meta``) holds the state committed at ``step``."""
        assert self.bundle is not None
        rel = bundle_mod.checkpoint_name(step)
        committed = {k: v for k, v in tensors.items() if not k.startswith(RESUME_PREFIX)}
        try:
            parts = {n: bytes.fromhex(p["digest"]) for n, p in dict(meta.get("parts", {})).items()}
            sources = state_bytes(dict(meta.get("sources", {})))
        except (TypeError, ValueError, KeyError, AttributeError):
            raise BundleError(f"{rel}: bad part digests or switchboard state") from None
        state_hash = commit.state_hash(committed, sources, parts, canonical_nans=self.canonical_nans)
        if state_hash != self.bundle.leaves[step][0]:
            raise Divergence(step, True, [], f"{rel} differs from the commitment")
        if meta.get("step") != step:
            raise BundleError(f"{rel}: its metadata names step {str(meta.get('step'))[:20]}, not {step}")
        self._verified.add(step)

    def _check_resume_state(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The checkpoint of ``step`` holds the resume state this replay holds there."""
        rel = bundle_mod.checkpoint_name(step)
        arrays, own_parts = self._resume_state()
        theirs = {k: v for k, v in tensors.items() if k.startswith(RESUME_PREFIX)}
        differ = sorted(
            k for k in theirs.keys() | arrays.keys() if not _same_tensor(theirs.get(k), arrays.get(k))
        )
        if differ:
            raise Divergence(step, True, [], f"{rel}: resume state {differ[0]} differs from the replay's")
        if state_bytes({"parts": meta.get("parts"), "sources": meta.get("sources")}) != state_bytes(
            {"parts": own_parts, "sources": self.sources.state_dict()}
        ):
            raise Divergence(
                step, True, [], f"{rel}: its switchboard or part metadata differs from the replay's"
            )


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(StepStats))
_NO_STATS = StepStats()


class _PlainStep:
    """The context of a plain step (see :meth:`Session.step`): the portable kernels, then the commit."""

    __slots__ = ("_session", "_frozen", "_t0", "_kernels")

    def __init__(self, session: Session, frozen: bool) -> None:
        self._session, self._frozen, self._kernels = session, frozen, portable_kernels()

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()
        self._kernels.__enter__()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, *exc: object) -> None:
        self._kernels.__exit__()
        if kind is None:
            session = self._session
            session._end_step(session.step_index + 1, None, self._t0, self._frozen)
        elif isinstance(error, RuntimeError):
            _note_float32_data(error, self._session.precision)


#: How torch words an op given float32 data and FP64 weights: a convolution and an RNN check the dtypes
#: before any dispatch mode sees the op, and in FP64 precision nothing widens the data.
_MIXED_DTYPES = re.compile(
    r"mixed dtype|(float\b|float32|FloatTensor).*(double|float64|DoubleTensor)|(double|float64).*(float\b|float32)",
    re.IGNORECASE,
)


def _note_float32_data(error: RuntimeError, precision: Precision) -> None:
    """Add to ``error`` (raised inside a step) what it most likely means where the run holds its model in FP64
    and torch complains of mixed float dtypes: data the script brought itself, still in float32."""
    if precision.dtype == torch.float64 and _MIXED_DTYPES.search(str(error)) and hasattr(error, "add_note"):
        error.add_note(
            f"detrl: a run in {precision.kind} precision holds its model in FP64; cast the data you pass in "
            "yourself with session.precision.cast(x) (Session.loader casts its batches)"
        )


def _restore_host_rngs(python_state: Any, numpy_state: Any) -> None:
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def _refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """Refuse, before step 1, a module that makes sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``): verifiable precision rounds dense results only, and would refuse its
    first backward (:class:`detrl.core.islands.UnroundableResult`) after calibration's work. A functional
    ``F.embedding(..., sparse=True)`` is still refused there, naming the op."""
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and any(True for _ in module.parameters(recurse=False)):
            kind = type(module).__name__
            raise ValueError(
                f"Session.init: {name or 'the model'} ({kind}) makes sparse gradients (sparse=True); verifiable "
                f"precision rounds dense tensors: use nn.{kind}(..., sparse=False)"
            )


def _module_on_stack(model: torch.nn.Module | None) -> str:
    """The path in ``model`` of the innermost module whose ``forward`` is running (found on the Python stack,
    so tracking modules costs nothing until asked); ``(backward of NODE)`` inside autograd's backward."""
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()} if model is not None else {}
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            return names[id(owner)]
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return f"(backward of {node.name()})" if node is not None else ""


def _cast_floats(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)``, except that complex parameters and buffers become the complex dtype of ``dtype``'s
    width (``Module.to`` would drop their imaginary parts): complex64 for float32, complex128 for float64."""
    return model._apply(lambda t: t.to(at_width(t, dtype)))


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
                    raise BundleError(f"checkpoint tensor {name!r} is not in the model")
                target = expected[name]
                if target.shape != t.shape or target.dtype != t.dtype:
                    raise BundleError(f"checkpoint tensor {name!r}: shape or dtype differs")
                target.copy_(t)
                continue
            i, _, rest = name.partition(".opt.")
            pname, _, key = rest.rpartition(".")
            if not i.isdigit() or int(i) >= len(optimizers) or pname not in params:
                raise BundleError(f"checkpoint tensor {name!r} is not model or optimizer state")
            opt, param = optimizers[int(i)], params[pname]
            opt.state[param][key] = t.to(_state_device(opt, param, key), copy=True)


def _state_device(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.device:
    """Where torch keeps ``optimizer``'s state ``key`` of ``param``: beside the parameter, except the step
    count of a group that is neither fused nor capturable, which stays on the CPU (as torch's own
    ``load_state_dict`` places it)."""
    if key == "step":
        group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
        if not (group.get("fused") or group.get("capturable")):
            return torch.device("cpu")
    return param.device


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both present, of one dtype and shape, and equal byte for byte (NaNs included)."""
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()


def _as_tuple(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
