"""Run precision: plain FP32, plain FP64, or verifiable (FP64 compute, every result rounded to FP32)."""

from __future__ import annotations

import dataclasses

import torch

KINDS = ("fp32", "fp64", "verifiable")


def at_width(t: torch.Tensor, real: torch.dtype) -> torch.dtype:
    """``t``'s kind at the width of ``real`` (float32 or float64): that dtype for a floating tensor, complex64
    or complex128 for a complex one, and ``t``'s own dtype for any other."""
    if t.is_complex():
        return torch.complex128 if real == torch.float64 else torch.complex64
    return real if t.is_floating_point() else t.dtype


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a run computes. ``kind`` is ``"fp32"``, ``"fp64"`` or ``"verifiable"``."""

    kind: str = "verifiable"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown precision {self.kind!r}; choose one of {', '.join(KINDS)}")

    @classmethod
    def verifiable(cls) -> Precision:
        return cls("verifiable")

    @classmethod
    def fp64(cls) -> Precision:
        return cls("fp64")

    @classmethod
    def fp32(cls) -> Precision:
        return cls("fp32")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype tensors are held in (verifiable runs hold FP32-grid values in FP64 tensors)."""
        return torch.float32 if self.kind == "fp32" else torch.float64

    @property
    def is_verifiable(self) -> bool:
        return self.kind == "verifiable"

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """Floating input data to this precision; verifiable data is put on the FP32 grid first. Complex data
        goes to the complex dtype of the same width (complex64 or complex128), integers stay as they are."""
        if not (t.is_floating_point() or t.is_complex()):
            return t
        if self.kind == "verifiable":
            return t.to(at_width(t, torch.float32)).to(at_width(t, torch.float64))
        target = at_width(t, self.dtype)
        return t if t.dtype == target else t.to(target)
