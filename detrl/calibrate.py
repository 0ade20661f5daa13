"""Threshold calibration: how far apart can two machines' FP64 results of one op be?

During the first recorded step, :class:`Calibrator` reruns every logged op under each emulated hardware
profile on the same inputs and measures the largest FP64 disagreement with the result actually computed,
in the op kind's units (FP32 spacings at the element, or at the output's largest magnitude for
reductions). It keeps the live :class:`~detrl.rounding.Thresholds` up to date as it goes, so each op call
of the calibration step is logged with a threshold covering its own measured disagreement:

    tau(op kind) = clamp(margin x largest disagreement so far, floor, TAU_CAP)

where the floor is TAU_FLOOR_MEASURED for reductions whose disagreement the profiles produce, and
TAU_FLOOR for everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from detrl.hardware import get_profile
from detrl.oprules import OpKind, op_name
from detrl.rounding import Thresholds, snapshot, written_tensors
from detrl.scale import Scale, reduction_scale, scale_spacing, spacing32

DEFAULT_MARGIN = 16.0
#: 128 FP64 ulps: libm and FMA differences of elementwise ops, and every op whose disagreement the emulated
#: profiles cannot show (they compute it natively): there tau cannot come from a measurement.
TAU_FLOOR = 2.0**-22
#: For reductions the profiles do reorder, the measurement (x margin) is the threshold, down to 8 FP64
#: ulps at the output's scale: an FMA-contracted epilogue differs by an ulp or two of terms at that scale.
TAU_FLOOR_MEASURED = 2.0**-26
TAU_CAP = 2.0**-4
#: Seed of the random accumulation orders calibration measures (emulated:atomic), reseeded every step.
CALIBRATION_SEED = 0x5EED_CA1B
PROFILES = ("emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic")


class Calibrator:
    """Measures per-op-kind disagreement between profiles and updates ``thresholds`` in place."""

    def __init__(
        self, thresholds: Thresholds, margin: float = DEFAULT_MARGIN, profiles: Sequence[str] = PROFILES
    ) -> None:
        self.thresholds = thresholds
        self.margin = margin
        # Seeded: the thresholds (and so the log's bytes) must be the same in every recording of a config.
        self.profiles = [get_profile(p, seed=CALIBRATION_SEED) for p in profiles]
        self.worst: dict[str, float] = {}

    def begin_step(self, step: int) -> None:
        """Reseed the random-order profiles for ``step``: a resumed recording calibrates as an uninterrupted
        one does."""
        for prof in self.profiles:
            reseed = getattr(prof, "reseed", None)
            if reseed is not None:
                reseed(CALIBRATION_SEED + step)

    def state(self) -> dict[str, float]:
        """The largest disagreement measured so far per op (checkpointed inside calibration)."""
        return dict(sorted(self.worst.items()))

    def load_state(self, worst: dict[str, float]) -> None:
        self.worst = {str(k): float(v) for k, v in worst.items()}

    def __call__(
        self, func: Any, before: tuple, kwargs: dict, produced: list[torch.Tensor], kind: OpKind
    ) -> None:
        """``before``: the op's inputs as they were before it ran; ``produced``: its unrounded results."""
        if not any(t.dtype == torch.float64 for t in produced):
            return
        name = op_name(func)
        worst = self.worst.get(name, 0.0)
        for prof in self.profiles:
            fresh = snapshot(func, before)  # in-place ops must not touch the snapshot
            alt = written_tensors(func, fresh, kwargs, prof(func, fresh, kwargs))
            for a, b in zip(produced, alt):
                if a.dtype == torch.float64 and b.dtype == torch.float64 and a.shape == b.shape and a.numel():
                    worst = max(worst, _disagreement(a, b, kind, reduction_scale(func, before, a)))
        self.worst[name] = worst
        floor = TAU_FLOOR_MEASURED if kind is OpKind.REDUCTION and worst > 0 else TAU_FLOOR
        self.thresholds.per_op[name] = min(TAU_CAP, max(floor, self.margin * worst))


def _disagreement(a: torch.Tensor, b: torch.Tensor, kind: OpKind, scale: Scale | None = None) -> float:
    """Largest ``|a - b|`` in the units the op is logged in: ``scale`` (an ``mm``), the output's channel
    scale (other reductions) or the element's own spacing."""
    diff = (a - b).abs()
    if scale is not None:
        rel = diff.reshape(scale.outer, scale.channels, scale.inner) / scale.dense()
    else:
        rel = diff / (scale_spacing(a) if kind is OpKind.REDUCTION else spacing32(a))
    rel = rel[torch.isfinite(rel)]
    return float(rel.max()) if rel.numel() else 0.0
