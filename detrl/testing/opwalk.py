"""The op walk: does any floating-point result of a verifiable step escape rounding?

In verifiable precision every floating op of a step must be computed in FP64 under the hardware profile and
rounded to the FP32 grid (with the log), or be one that only moves values (views, copies, max, relu) or a
cast. An op computed natively in float32 or a half type would be machine dependent and unlogged: the replay
of an honest run would diverge. The walk watches a step from both sides:

* :class:`WalkProfile` wraps the hardware profile: every op the rounding mode has the profile compute must
  take and give FP64 floats only (a narrower float there is an op computed outside verifiable precision);
* :class:`WalkedSession` stacks :class:`_GridCheck` above the rounding mode inside each step: every FP64
  result the rounding mode hands back must lie on the FP32 grid.

``WalkProfile.escapes`` and ``WalkedSession.off_grid`` list what was found (op, dtype, module); both empty
means nothing escaped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from detrl.core.engine import Session
from detrl.core.hardware import Profile, get_profile
from detrl.core.oprules import OpKind, classify
from detrl.core.rounding import CASTS

_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


class WalkProfile(Profile):
    """``base`` (a profile name or instance), recording every op it computes on a float narrower than FP64
    (other than ops that only move values, and casts) in ``escapes``."""

    def __init__(self, base: str | Profile = "native") -> None:
        self.base = get_profile(base) if isinstance(base, str) else base
        super().__init__(self.base.name, f"{self.base.description} (op walk)", self.base.device)
        self.deterministic = self.base.deterministic
        self.escapes: list[str] = []
        self.ops = 0

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = self.base(func, args, kwargs)
        self.ops += 1
        if func.is_view or func in CASTS or classify(func, kwargs) is OpKind.KEEP:
            return out
        narrow = {t.dtype for t in _floats((args, kwargs, out)) if t.dtype != torch.float64}
        if narrow:
            self.escapes.append(f"aten.{func.overloadpacket.__name__} computed in {sorted(map(str, narrow))}")
        return out


class OpNames(TorchDispatchMode):
    """A mode that lists the aten ops it sees (``ops``: ``"aten.mm.default"``, ...) and runs each unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _GridCheck(TorchDispatchMode):
    """Above the rounding mode: every FP64 result it returns must be on the FP32 grid (or NaN)."""

    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _UNINITIALISED:  # memory to be written, not a result
            return out
        for t in _floats(out):
            if t.dtype == torch.float64 and t.numel():
                on_grid = (t.to(torch.float32).to(torch.float64) == t) | torch.isnan(t)
                if not bool(on_grid.all()):
                    self.found.append(
                        f"aten.{func.overloadpacket.__name__} left an FP64 result off the FP32 grid"
                    )
        return out


class WalkedSession(Session):
    """A Session whose steps are watched by :class:`_GridCheck`; pass ``hardware=WalkProfile(...)`` too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.off_grid: list[str] = []

    @contextlib.contextmanager
    def step(self, batch: Any = None, frozen: bool = False) -> Iterator[Any]:
        with super().step(batch, frozen) as rounding:
            if rounding is None:  # not verifiable precision: nothing is rounded, nothing to check
                yield rounding
            else:
                with _GridCheck(self.off_grid):
                    yield rounding
