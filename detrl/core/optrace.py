"""Per-op digests of one verifiable step, for dispute resolution (``detrl dispute``).

A bundle commits to the state after each step, not to what happened inside it. When two parties disagree
on a step, each can re-execute it with an :class:`OpTrace` set on the rounding mode
(:attr:`detrl.core.rounding.RoundingMode.trace`) and reveal, for every op of the step, a short digest of its
rounded output: the first op whose digests differ is where the two computations parted. Nothing is traced
unless asked (the attribute is ``None`` while recording), and digests never enter a bundle.

Positions count every op of the step whose float output the rounding mode rounded, logged or exact (views
and ops that only move values are not counted; a decomposed op counts once, for its outputs). The digest
of an op is BLAKE3 over its rounded outputs' record digests (:func:`detrl.formats.commit.tensor_digest`:
dtype, shape and the BLAKE3 of the raw bytes), so an op of another shape or dtype never shares a digest.
"""

from __future__ import annotations

import dataclasses
import struct

import blake3
import torch

from detrl.formats import commit

#: The tag every op digest starts with (distinct from the commitment tags in :mod:`detrl.formats.commit`).
OP_TAG = b"detrl/op/v1\0"


@dataclasses.dataclass(frozen=True)
class OpDigest:
    """One traced op: its ``position`` in the step (0-based), aten ``op`` name (``"mm"``), ``module`` path
    (``"conv1"``, ``"fc (backward)"``, ``""`` outside every module) and ``digest`` (32 bytes)."""

    position: int
    op: str
    module: str
    digest: bytes


def op_digest(outputs: list[torch.Tensor], canonical_nans: bool = False) -> bytes:
    """BLAKE3 (32 bytes) of ``OP_TAG``, the output count and each output's canonical record (with
    ``canonical_nans``, rules revision 13's: every NaN as its dtype's one NaN)."""
    h = blake3.blake3(OP_TAG + struct.pack("<I", len(outputs)))
    for i, t in enumerate(outputs):
        h.update(commit.tensor_digest(f"out{i}", t, canonical_nans))
    return h.digest()


class OpTrace:
    """The ops of one step, as the rounding mode rounds them.

    ``keep``: positions whose rounded outputs are also copied (to reveal or compare values element by
    element), or ``True`` for every position, within ``keep_bytes`` in all: outputs past the budget are
    not kept (``kept`` lacks them).
    """

    def __init__(self, keep: frozenset[int] | bool = False, keep_bytes: int = 256 << 20) -> None:
        self.records: list[OpDigest] = []
        self.keep = keep
        self.keep_bytes = keep_bytes
        #: position -> copies of its rounded outputs (FP64 on the FP32 grid, as the step holds them)
        self.kept: dict[int, list[torch.Tensor]] = {}
        self._kept_bytes = 0

    def add(self, op: str, module: str, outputs: list[torch.Tensor], canonical_nans: bool = False) -> None:
        """Record one op's rounded ``outputs`` (floating tensors; called by the rounding mode, which says
        whether the step's rules take every NaN as one: :func:`detrl.core.oprules.canonical_nans`)."""
        position = len(self.records)
        self.records.append(OpDigest(position, op, module, op_digest(outputs, canonical_nans)))
        if self.keep is True or (not isinstance(self.keep, bool) and position in self.keep):
            size = sum(t.numel() * t.element_size() for t in outputs)
            if self._kept_bytes + size <= self.keep_bytes:
                self.kept[position] = [t.detach().to("cpu", copy=True) for t in outputs]
                self._kept_bytes += size
