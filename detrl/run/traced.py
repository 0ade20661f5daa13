"""A Session that keeps what an experiment compares across runs: a parameter digest after every step, the
model at trace points and the test-set predictions at snapshot points.

Shared by the ablation sweep and the replication table. It observes through :meth:`Session.on_commit`,
the engine's public hook, so nothing it keeps enters the bundle, the commitments or any random stream.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from detrl.core.engine import Session
from detrl.formats import commit


def _param_digest(tensors: dict[str, Any]) -> int:
    """A 64-bit digest of parameter and buffer bytes: equal digests mean (up to 2^-64) bitwise equal."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(commit.tensor_bytes(tensors[name]))  # a view that leaves the storage resizable
    return int.from_bytes(h.digest(), "little")


class TracedSession(Session):
    """A Session that also keeps, for the ablation and the replication table, a digest of the model after every step (to find the
    first step where a run stops being bitwise equal to the control), the model at every trace point (the
    parameter distance over time), and at trace and snapshot points the test-set predictions (supervised).

    It observes only: nothing it does enters the bundle, the commitments or any random stream.
    """

    trace_steps: frozenset[int] = frozenset()
    snapshot_steps: frozenset[int] = frozenset()
    evaluate: Any = None  # supervised: (model, step) -> (test logits, tta logits or None)

    def start_trace(self, trace_steps: list[int], snapshot_steps: list[int], evaluate: Any) -> None:
        self.trace_steps, self.snapshot_steps, self.evaluate = (
            frozenset(trace_steps),
            frozenset(snapshot_steps),
            evaluate,
        )
        self.digests: list[int] = []
        self.points: list[int] = []
        self.params: list[dict[str, np.ndarray]] = []
        self.test_logits: dict[int, Any] = {}

    def on_commit(self, step: int, frozen: bool) -> None:
        assert self.model is not None
        model_state = commit.state_tensors(self.model)
        # A step that writes no parameter (a DQN step that only acts) keeps the last digest.
        self.digests.append(self.digests[-1] if frozen and self.digests else _param_digest(model_state))
        if step == 0 or step in self.trace_steps:
            self.points.append(step)
            # a copy's numpy(): the model's own storages stay resizable (commit.tensor_bytes)
            self.params.append({n: t.detach().cpu().clone().numpy() for n, t in sorted(model_state.items())})
        if self.evaluate is not None and (step in self.trace_steps or step in self.snapshot_steps):
            self.test_logits[step] = self.evaluate(self.model, step)
