"""Every op in torch's own op database (OpInfo), recorded as a one-op model and replayed.

torch tests each operator on sample inputs it keeps for the purpose (``torch.testing._internal``'s
``op_db``: about 700 entries, with their samples per dtype). Here each sample becomes a model whose
parameters are the sample's floating (or complex) tensors: one verifiable step calls the op, takes a loss
over its outputs, and updates the parameters with SGD. The run is recorded, then replayed on two emulated
profiles, and must replay byte for byte with nothing unlogged, or be refused in one line for a reason the
op's result gives (a sparse or complex result no rule rounds).

This is how a process-killing fault was found (``torch.sgn``'s backward returns a tensor without memory),
and an ``op_db`` sweep is the check of "any aten op" that no list of models gives. ``torch.testing._internal``
is torch's private test support: it needs ``expecttest``, and its samples change between torch versions;
:func:`available` says whether it imports.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from detrl.core.engine import Session
from detrl.core.sources import Sources

#: The profiles every recording is replayed on (a reordering of sums each: see detrl/core/hardware).
PROFILES = ("emulated:splitk", "emulated:atomic")


def available() -> bool:
    """Whether torch's op database imports (it needs the ``expecttest`` package)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db  # noqa: F401
    except Exception:  # ImportError, or torch's test support failing in its own way
        return False
    return True


def ops(dtype: torch.dtype = torch.float64) -> Iterator[tuple[str, Any]]:
    """``(name, OpInfo)`` of every op with a CPU kernel for ``dtype`` and for float64 (verifiable steps
    compute in FP64), named ``op.variant`` as torch's tests name them."""
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if op.supports_dtype(dtype, "cpu") and op.supports_dtype(torch.float64, "cpu"):
            yield op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""), op


class OneOp(nn.Module):
    """``op(sample)`` as a model: the sample's floating and complex tensors are parameters (only its first
    tensor, with ``first_only``: batch norm's running statistics take no gradient), cast to ``narrow`` in
    ``forward`` when given (a float32 or half island); the rest are constants."""

    def __init__(
        self, op: Any, sample: Any, narrow: torch.dtype | None = None, first_only: bool = False
    ) -> None:
        super().__init__()
        leaves, self.spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        self.op, self.narrow = op, narrow
        self.params = nn.ParameterList()
        self.slots: list[tuple[bool, Any]] = []  # (a parameter?, its index or the constant)
        for i, t in enumerate(leaves):
            learnable = (
                isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0
            )
            if learnable and op.supports_autograd and (i == 0 or not first_only):
                self.slots.append((True, len(self.params)))
                self.params.append(nn.Parameter(t.detach().clone()))
            else:
                self.slots.append((False, t.detach().clone() if isinstance(t, torch.Tensor) else t))

    def forward(self) -> Any:
        leaves = []
        for learnable, x in self.slots:
            t = self.params[x] if learnable else x
            if isinstance(t, torch.Tensor) and t.is_floating_point() and self.narrow is not None:
                t = t.to(self.narrow)
            leaves.append(t)
        first, args, kwargs = tree_unflatten(leaves, self.spec)
        return self.op(first, *args, **kwargs)


def loss_of(out: Any) -> torch.Tensor | None:
    """The mean square of every output that carries a gradient (a complex one's parts), summed; None if
    none does."""
    total = None
    for t in tree_flatten(out)[0]:
        if (
            isinstance(t, torch.Tensor)
            and t.requires_grad
            and t.numel()
            and (t.is_floating_point() or t.is_complex())
        ):
            t = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
            term = t.to(torch.float64).square().mean()
            total = term if total is None else total + term
    return total


@dataclasses.dataclass
class Result:
    """What became of one op's sample: ``ok`` (recorded and replayed byte for byte on every profile),
    ``plain`` (the one-op model fails without detrl too: the sample, not detrl), or the exception raised."""

    name: str
    status: str
    error: BaseException | None = None
    logged: int = 0


def _train(model: OneOp, run_dir: Path, mode: str, hardware: str = "native") -> Session:
    kw: dict[str, Any] = (
        {"hardware": hardware} if mode == "replay" else {"sources": Sources(), "planned_steps": 2}
    )
    session = Session(run_dir, mode=mode, checkpoint_every=0, **kw)
    with session:
        m = session.init(lambda: model)
        opt = session.track(torch.optim.SGD(m.parameters(), lr=1e-3)) if len(m.params) else None
        for _ in range(2):
            if session.stop_requested:
                break
            with session.step():
                loss = loss_of(m())
                if loss is not None and opt is not None:
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
    return session


def check(name: str, op: Any, dtype: torch.dtype = torch.float64, sample_index: int = 0) -> Result:
    """Record sample ``sample_index`` of ``op`` (its inputs in ``dtype``: a float32 or half dtype runs as an
    island, a complex one gives complex parameters) for two verifiable steps, and replay it on
    :data:`PROFILES`."""
    narrow = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else None
    sample_dtype = dtype if dtype.is_complex else torch.float64
    samples = list(op.sample_inputs("cpu", sample_dtype, requires_grad=False))
    if sample_index >= len(samples):
        return Result(name, "no sample")
    sample = samples[sample_index]

    def build(first_only: bool) -> OneOp:
        return OneOp(op, sample, narrow, first_only)

    first_only = False
    try:  # the model outside detrl: some samples' extra tensors take no gradient (running statistics)
        loss = loss_of(build(False)())
        if loss is not None:
            loss.backward()
    except Exception:
        first_only = True
        try:
            loss = loss_of(build(True)())
            if loss is not None:
                loss.backward()
        except Exception as e:
            return Result(name, "plain", e)
    with tempfile.TemporaryDirectory(prefix="detrl-opinfo-") as tmp:
        try:
            recorded = _train(build(first_only), Path(tmp), "record")
            want = [p.detach().clone() for p in recorded.model.parameters()]
            for profile in PROFILES:
                replay = _train(build(first_only), Path(tmp), "replay", profile)
                got = list(replay.model.parameters())
                same = len(got) == len(want) and all(
                    a.dtype == b.dtype and a.numpy().tobytes() == b.detach().numpy().tobytes()
                    for a, b in zip(want, got)
                )
                if not same or replay.totals.unlogged_near or replay.totals.refused:
                    raise AssertionError(
                        f"{profile}: same weights {same}, unlogged near {replay.totals.unlogged_near}, "
                        f"refused {replay.totals.refused}"
                    )
        except Exception as e:
            return Result(name, "error", e)
    return Result(name, "ok", logged=recorded.totals.logged)
