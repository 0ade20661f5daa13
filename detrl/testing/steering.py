"""A steering trainer: a recorder that uses the freedom the rounding log leaves it, and logs what it chose.

Within its thresholds a verifiable-training recorder may round every *logged* element (one within tau of an
FP32 rounding midpoint) to either FP32 neighbour: the log says which, and an auditor honours an entry
wherever its own FP64 value is also near that midpoint, which it is for either choice. An honest recorder
picks the nearest neighbour. :class:`SteeringMode` picks the one a policy wants instead, writes the log to
say so, and its bundle replicates on every profile: the log cannot stop it (docs/verifiable.md, "What the
log cannot stop: the steering bound"). Each steered element moves by one FP32 spacing (the two neighbours
bracketing its FP64 value); pinned elements are moved to the other bracketing neighbour too (one whose FP64
value is on the grid, to either neighbour), which lies within the replayer's reach (``2 T + spacing``,
``T >= spacing / 4`` for a pinned element).

Policies (:data:`POLICIES`):

* ``nearest`` -- the honest recorder (nothing steered).
* ``other`` -- every logged element to the other neighbour: the most the bundle can disagree with an honest
  recording of the same run.
* ``random`` -- each logged element to either neighbour by a fair coin (a seeded numpy generator).
* ``adversarial`` -- toward a higher held-out loss, to first order. Before each step, outside the step (so
  nothing is rounded or logged), :class:`SteeringSession` computes in plain FP64 the gradient ``h`` of the
  held-out loss (eval mode) with respect to the parameters, and for the step's batch the training gradient
  ``g(a)`` as a function of every leaf module's output ``a``. The step moves the weights by ``-lr g`` (SGD;
  momentum carries the same sign forward), so the held-out loss after it, ``J``, changes by
  ``dJ = -lr h . dg``. A logged element of a parameter's gradient (found from the autograd node running the
  op: the parameter it accumulates into, matched by shape) moves against ``h``; a logged element of a leaf
  module's forward output ``a`` (the op computing it inside that module, matched by shape) moves along
  ``-d(h . g)/da``, both the direction that raises ``J``. Every other logged element (losses, input
  gradients, batch norm's sums, elements whose sensitivity is exactly 0) is rounded to nearest: the
  policy steers only where it has a first-order signal, so what it moves is attributable to the target.

The sensitivities are a first-order guess from the state before the step; the benchmark (``detrl bench
steering``) measures what the policies actually do to the weights and the held-out loss. The shadow passes
restore every buffer they touch (batch norm's running statistics) and never write ``.grad``, so the
committed state is the steered run's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from detrl.core.engine import Batch, Loader, Session, StepRounding
from detrl.core.oprules import OpKind
from detrl.core.rounding import RoundingMode, _put, _take, split_short
from detrl.core.scale import reduction_scale
from detrl.formats.roundlog import OpEntries
from detrl.run import sessions, tasks
from detrl.supervised.train import load_test_data, training_loss

#: The steering policies (see the module docstring); ``nearest`` is the honest recorder.
POLICIES = ("nearest", "other", "random", "adversarial")

#: Autograd nodes that only view or transpose a parameter: the gradient one of their inputs computes is
#: the parameter's (``addmm``'s ``weight.t()`` is a ``TBackward0`` above the weight's accumulator).
_VIEW_NODES = frozenset(
    {"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "PermuteBackward0"}
)


class SteeringMode(RoundingMode):
    """A :class:`RoundingMode` that, while recording, rounds each logged element to the FP32 neighbour
    ``policy`` picks and rewrites the op's log entries to match (direction bits, pinned values, short
    pinned keys); replaying, it is the plain rounding mode.

    ``steered`` counts, per recorded step, the logged elements moved off their nearest neighbour;
    ``logged`` the logged elements it could have moved.
    """

    def __init__(self, base: RoundingMode, policy: str, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown steering policy {policy!r}; known: {', '.join(POLICIES)}")
        super().__init__(base.profile, base.thresholds, base.module_path)
        self.rules_revision = base.rules_revision  # the session's (a resumed bundle's, or a test's)
        self.policy = policy
        self._coins = np.random.Generator(np.random.PCG64(seed))
        self.steered: list[int] = []
        self.logged: list[int] = []
        #: adversarial: dJ/d(leaf module output), by module name, and dJ/d(gradient), by id(parameter)
        self.forward_sensitivity: dict[str, torch.Tensor] = {}
        self.gradient_sensitivity: dict[int, torch.Tensor] = {}
        #: the leaf modules whose forward is running (pushed and popped by SteeringSession's hooks)
        self.module_stack: list[str] = []

    @contextlib.contextmanager
    def step_scope(self, step: StepRounding, *args: Any, **kwargs: Any) -> Iterator[StepRounding]:
        if step.replay is None:
            self.steered.append(0)
            self.logged.append(0)
        with super().step_scope(step, *args, **kwargs) as s:
            yield s

    def _round_logged(self, func: Any, x: torch.Tensor, kind: OpKind, args: tuple, tau: float) -> None:
        step = self.step
        assert step is not None
        if step.replay is not None or self.policy == "nearest":
            super()._round_logged(func, x, kind, args, tau)
            return
        exact = x.detach().clone()  # the FP64 values: which side of its rounding each element lay on
        before = len(step.recorded)
        super()._round_logged(func, x, kind, args, tau)
        if len(step.recorded) > before:
            step.recorded[-1] = self._steer(func, x, exact, kind, args, tau, step.recorded[-1])

    def _steer(
        self,
        func: Any,
        x: torch.Tensor,
        exact: torch.Tensor,
        kind: OpKind,
        args: tuple,
        tau: float,
        e: OpEntries,
    ) -> OpEntries:
        """Move the logged elements of ``x`` (already rounded to nearest) the policy picks to their other
        neighbour, and return ``e`` rewritten to log the values ``x`` now holds."""
        pinned_idx = np.concatenate([e.pinned_indices, e.short_indices]).astype(np.int64)
        idx_np = np.concatenate([e.indices, pinned_idx]).astype(np.int64)
        idx = torch.from_numpy(idx_np).to(x.device)
        xs, rs = _take(exact, idx), _take(x, idx)
        nd = len(e.indices)
        # A pinned value can lie on the grid (a cancellation that came out exact): both its neighbours are
        # within the replayer's reach (2 T + spacing, T >= spacing / 4), and the policy takes one of them.
        on_grid = xs == rs
        on_grid[:nd] = False  # (a direction entry never is: within T < spacing / 4 of a midpoint)
        sens = self._sensitivity(x) if self.policy == "adversarial" else None
        s_i = _take(sens, idx) if sens is not None else None
        toward = torch.where(xs > rs, torch.inf, -torch.inf)  # the other bracketing neighbour
        toward = torch.where(on_grid, torch.copysign(torch.full_like(rs, torch.inf), rs), toward)
        if s_i is not None:  # on the grid: toward the side that raises the target
            toward = torch.where(
                on_grid & (s_i != 0), torch.copysign(torch.full_like(rs, torch.inf), s_i), toward
            )
        other = torch.nextafter(rs.to(torch.float32), toward.to(torch.float32)).double()
        move = torch.isfinite(rs) & ((xs != rs) | on_grid) & self._wanted(idx, rs, other, s_i)
        self.logged[-1] += idx.numel()
        n = int(move.sum())
        if n == 0:
            return e
        self.steered[-1] += n
        new = torch.where(move, other, rs)
        _put(x, idx, new)
        values = new[nd:].to(torch.float32).cpu().numpy()
        order = np.argsort(pinned_idx, kind="stable")
        rewritten = OpEntries(
            op=e.op,
            indices=e.indices,
            up=(new[:nd].abs() > xs[:nd].abs()).cpu().numpy(),
            pinned_indices=pinned_idx[order],
            pinned_values=values[order],
        )
        # Stored short again where the replayer's own rounding names the (moved) value: the same rule, and
        # the same unit and threshold, as the honest recorder's (rounding._round_logged).
        scaled: Any = kind is OpKind.REDUCTION
        if scaled:
            scaled = reduction_scale(func, args, x, self.rules_revision) or True
        return split_short(rewritten, x, tau, scaled)

    def _wanted(
        self, idx: torch.Tensor, rs: torch.Tensor, other: torch.Tensor, sens: torch.Tensor | None
    ) -> torch.Tensor:
        """Bool ``(n,)``: which logged elements (``idx``, now ``rs``) the policy moves to ``other``; ``sens``:
        the adversarial policy's dJ/dx at them (None where it has no signal)."""
        if self.policy == "other":
            return torch.ones_like(idx, dtype=torch.bool)
        if self.policy == "random":
            return torch.from_numpy(self._coins.random(idx.numel()) < 0.5).to(idx.device)
        if sens is None:
            return torch.zeros_like(idx, dtype=torch.bool)
        return (other - rs) * sens > 0  # moving there raises the held-out loss, to first order

    def _sensitivity(self, x: torch.Tensor) -> torch.Tensor | None:
        """dJ/dx (shape of ``x``) for the op now running, where the adversarial policy has one: a parameter's
        gradient in backward, a leaf module's output in forward; None elsewhere."""
        node = torch._C._current_autograd_node()
        if node is not None:
            found = [
                m
                for s in _accumulated(node, self.gradient_sensitivity)
                if (m := _matching(s, x.shape)) is not None
            ]
            return found[0] if len(found) == 1 else None  # two parameters of one shape: no signal
        if self._nested or not self.module_stack:
            return None
        sens = self.forward_sensitivity.get(self.module_stack[-1])
        return sens if sens is not None and sens.shape == x.shape else None


def _accumulated(node: Any, by_param: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The entries of ``by_param`` (by ``id`` of a parameter) for the parameters whose gradient autograd
    ``node`` computes: its inputs that accumulate into a parameter directly or through one view node."""
    found = []
    for child, _ in node.next_functions:
        if child is None:
            continue
        var = getattr(child, "variable", None)
        if var is None and child.name() in _VIEW_NODES:
            var = next((getattr(c, "variable", None) for c, _ in child.next_functions if c is not None), None)
        if var is not None and id(var) in by_param:
            found.append(by_param[id(var)])
    return found


def _matching(sens: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """``sens`` laid out as an output of ``shape``: the parameter's shape, its transpose (a linear layer's
    weight gradient computed as ``(grad.t() @ input).t()``), or the same elements with unit dims."""
    if sens.shape == shape:
        return sens
    if sens.dim() == 2 and sens.t().shape == shape:
        return sens.t()
    if sens.numel() == shape.numel() and [d for d in sens.shape if d != 1] == [d for d in shape if d != 1]:
        return sens.reshape(shape)
    return None


def _push(stack: list[str], name: str) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:  # None: the module's inputs stay as they are
        stack.append(name)

    return hook


def _pop(stack: list[str]) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:  # None: its output stays as it is
        stack.pop()

    return hook


class _Watched:
    """The session's loader, noting each batch it yields (the adversarial policy's shadow pass needs it)."""

    def __init__(self, inner: Loader, session: SteeringSession) -> None:
        self.inner, self.session = inner, session

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.inner:
            self.session.batch = batch
            yield batch


class SteeringSession(Session):
    """A recording :class:`Session` whose rounding mode steers (:class:`SteeringMode`), and which keeps, for
    the benchmark, the parameters (flattened, FP64, name order) and the held-out loss and accuracy after
    every committed step. Build it with :func:`steering_session`; call :meth:`set_heldout` before the run.

    Nothing it keeps enters the bundle; the shadow passes of the adversarial policy run outside the step.
    """

    policy: str = "nearest"
    heldout: tuple[torch.Tensor, torch.Tensor] | None = None

    def start_steering(self, policy: str, seed: int = 0) -> None:
        self.rounding = SteeringMode(self.rounding, policy, seed)
        self.policy = policy
        self.batch: Batch | None = None
        self.params: list[np.ndarray] = []
        self.heldout_loss: list[float] = []
        self.heldout_accuracy: list[float] = []

    def set_heldout(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.heldout = (x, y)

    def init(self, build: Any) -> torch.nn.Module:
        model = super().init(build)
        mode = self.rounding
        assert isinstance(mode, SteeringMode), "call start_steering() first"
        for name, module in model.named_modules():
            if name and not any(True for _ in module.children()):  # leaf modules only
                module.register_forward_pre_hook(_push(mode.module_stack, name))
                module.register_forward_hook(_pop(mode.module_stack))
        return model

    def loader(self, data: Any, batch_size: int, steps: int | None = None, epochs: int | None = None) -> Any:
        return _Watched(super().loader(data, batch_size, steps, epochs), self)

    @contextlib.contextmanager
    def step(self, batch: Any = None, frozen: bool = False) -> Iterator[StepRounding | None]:
        mode = self.rounding
        assert isinstance(mode, SteeringMode)
        if mode.policy == "adversarial" and self.mode == "record":
            self._sensitivities(mode)
        with super().step(batch, frozen) as r:
            yield r

    def _sensitivities(self, mode: SteeringMode) -> None:
        """The adversarial policy's first-order sensitivities for the coming step (module docstring), in plain
        FP64, outside the step; batch norm's running statistics and the model's mode are restored afterwards.
        The batch is the loader's (a run with ``data.augment`` trains on its crops: a weaker guess)."""
        model = self.model
        assert model is not None and self.heldout is not None and self.batch is not None
        params = [p for p in model.parameters() if p.requires_grad]
        saved = {n: b.clone() for n, b in model.named_buffers()}
        outputs: dict[str, torch.Tensor] = {}
        handles = [
            m.register_forward_hook(lambda m, a, o, n=n: outputs.__setitem__(n, o))
            for n, m in model.named_modules()
            if n and not any(True for _ in m.children())
        ]
        stack, was_training = list(mode.module_stack), model.training
        try:
            model.eval()
            x, y = self.heldout
            h = torch.autograd.grad(F.cross_entropy(model(x.to(params[0].dtype)), y), params)
            model.train()
            outputs.clear()
            loss = training_loss(model, self.batch.x, self.batch.y)
            g = torch.autograd.grad(loss, params, create_graph=True)
            s = sum((gi * hi).sum() for gi, hi in zip(g, h, strict=True))
            names = [n for n, o in outputs.items() if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = torch.autograd.grad(s, [outputs[n] for n in names], allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(saved[n])
            mode.module_stack[:] = stack
            model.train(was_training)
        # J = L_held(w - lr g(a)): dJ/da = -lr d(h . g)/da and dJ/dg = -lr h (the sign is what matters)
        mode.forward_sensitivity = {
            n: -d.detach() for n, d in zip(names, grads, strict=True) if d is not None
        }
        mode.gradient_sensitivity = {id(p): -hi.detach() for p, hi in zip(params, h, strict=True)}

    def on_commit(self, step: int, frozen: bool) -> None:
        assert self.model is not None
        with torch.no_grad():
            self.params.append(
                torch.cat([p.detach().reshape(-1) for _, p in sorted(self.model.named_parameters())])
                .double()
                .cpu()
                .numpy()
            )
            if self.heldout is not None:
                was = self.model.training
                self.model.eval()
                x, y = self.heldout
                logits = self.model(x.to(next(self.model.parameters()).dtype)).double()
                self.model.train(was)
                self.heldout_loss.append(float(F.cross_entropy(logits, y)))
                self.heldout_accuracy.append(float((logits.argmax(-1) == y).double().mean()))


def steering_session(
    cfg: Any, run_dir: str | Path, policy: str, seed: int = 0, **overrides: Any
) -> SteeringSession:
    """A :class:`SteeringSession` recording ``cfg`` into ``run_dir`` (replacing a bundle there) with
    ``policy``, through the one config-to-Session path (:func:`detrl.run.sessions.session_for`)."""
    session = sessions.session_for(
        cfg, run_dir, "record", session_type=SteeringSession, force=True, **overrides
    )
    assert isinstance(session, SteeringSession)
    session.start_steering(policy, seed)
    return session


def record_steered(cfg: Any, run_dir: str | Path, policy: str, seed: int = 0) -> SteeringSession:
    """Record the supervised config ``cfg`` (with ``data.holdout > 0``: the held-out set the adversarial
    policy targets and the metrics use) into ``run_dir`` with ``policy``; returns the finished session, its
    ``params``, ``heldout_loss``, ``heldout_accuracy`` (index: step, 0 the initial model) and its mode's
    per-step ``steered`` and ``logged`` counts."""
    session = steering_session(cfg, run_dir, policy, seed)
    session.set_heldout(*load_test_data(cfg))
    with session:
        tasks.get(cfg.task).run(cfg, session)
    return session
