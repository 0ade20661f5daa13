"""Dishonest trainers, for the dispute tests and ``detrl bench dispute``: a run whose loss is scaled at one
step (recorded with the cheat, and re-executed with it when a referee asks for per-op digests), and a
bundle with one commitment overwritten (a state no execution gives)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from detrl.apps.dispute import StepReplay, replay_step
from detrl.formats import bundle as bundle_mod
from detrl.supervised import train


@contextlib.contextmanager
def scaled_loss(step: int, factor: float = 1.001, on: str = "loss") -> Iterator[None]:
    """While active, the supervised train loop (:func:`detrl.supervised.train.run`) multiplies the loss of
    session step ``step`` by ``factor`` (``on="logits"``: the model's output, before the loss), inside the
    step: the scaling is one more op of it (an exact ``mul``), and everything after it (the loss, its
    backward, the update) computes from the scaled value.

    The step is read from the loop's own ``session`` (the caller's frame), so the cheat holds in a
    recording and in a replay from any checkpoint alike.
    """
    if on not in ("loss", "logits"):
        raise ValueError(f"on must be 'loss' or 'logits', not {on!r}")
    original = train.training_loss

    def cheat(model: Any, x: Any, y: Any) -> Any:
        session = sys._getframe(1).f_locals.get("session")
        if session is None or session.step_index + 1 != step:
            return original(model, x, y)
        if on == "logits":
            return train.loss_fn(model(x) * factor, y)
        return original(model, x, y) * factor

    train.training_loss = cheat
    try:
        yield
    finally:
        train.training_loss = original


def cheating_reexecute(step: int, factor: float = 1.001, on: str = "loss") -> Any:
    """A :class:`detrl.apps.dispute.Party` ``reexecute`` that re-executes with :func:`scaled_loss` on: the
    dishonest trainer answering a referee with the computation it really did."""

    def reexecute(*args: Any, **kwargs: Any) -> StepReplay:
        with scaled_loss(step, factor, on):
            return replay_step(*args, **kwargs)

    return reexecute


def overwrite_commitment(run_dir: str | Path, step: int) -> None:
    """Replace the state hash committed at ``step`` with one no execution gives (its bytes inverted), fix
    the record's checksum and reseal the manifest: a bundle that passes every structural check."""
    path = Path(run_dir) / bundle_mod.COMMITMENTS
    data = bytearray(path.read_bytes())
    leaves, _ = bundle_mod.parse_commitments(bytes(data))
    state, batch = leaves[step]
    at = bundle_mod.COMMIT_HEADER.size + step * bundle_mod.COMMIT_RECORD.size
    forged = bytes(b ^ 0xFF for b in state)
    data[at : at + bundle_mod.COMMIT_RECORD.size] = bundle_mod.commit_record(step, forged, batch)
    path.write_bytes(bytes(data))
    bundle_mod.reseal(run_dir)
