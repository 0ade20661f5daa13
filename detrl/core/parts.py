"""Training state that torch objects carry from step to step, as run parts (:meth:`Session.track`).

An LR scheduler (and the hyperparameters it sets in its optimizer's ``param_groups``: ``lr``, momentum, ...)
and AMP's ``GradScaler`` (its loss scale and growth tracker) hold a run's future as surely as its weights.
Untracked, a resumed run restarts them: the scheduler at its first learning rate, the scaler at its initial
scale. Its bundle then disagrees with any replay from step 0, which rebuilds them afresh and steps them.

:class:`StateDictPart` makes one of them a :class:`~detrl.core.engine.StatePart`: the digest of its
``state_dict()`` is committed with every step, the ``state_dict()`` goes into each checkpoint's metadata
(JSON: a non-finite float, such as ``ReduceLROnPlateau``'s initial ``best``, as ``{"float": "inf"}``), and
on resume it is loaded back. A checkpoint comes from another party: its values are accepted only in the
shape of the live object's own ``state_dict()`` (the same keys, list lengths and kinds of value), so a
bundle can never set an attribute the object does not have, and the restored state must then hash to the
step's commitment like every other part.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from detrl.core.sources import state_bytes
from detrl.formats.safeio import json_kind, shortened

_NON_FINITE = ("inf", "-inf", "nan")


def _encode(value: Any, where: str) -> Any:
    """``value`` as JSON that :func:`_decode_like` reads back: tuples as lists, a non-finite float as
    ``{"float": "inf"}``. TypeError names a value that is no plain number, string, list or dict."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(float(value))}  # numpy's repr differs
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Counter) and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
        return {"counter": [[k, _encode(value[k], f"{where}[{k}]")] for k in sorted(value)]}  # MultiStepLR's
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where} is a {type(value).__name__}, which a run cannot commit")


def _listed(keys: list[Any], n: int = 4) -> str:
    """At most ``n`` of ``keys``, each shortened (a hostile checkpoint may hold a million)."""
    shown = ", ".join(shortened(str(k)) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)})"


def _decode_like(saved: Any, live: Any, where: str) -> Any:
    """``saved`` (a checkpoint's, from :func:`_encode`) in the shape of ``live``, the object's own state:
    the same keys and list lengths, and at each leaf the same kind of value (an int and a float are both
    numbers). ValueError names the first place where it is not."""
    if isinstance(live, Counter):  # int keys, each with its count: a list of pairs (_encode)
        pairs = saved.get("counter") if isinstance(saved, dict) and set(saved) == {"counter"} else None
        if not isinstance(pairs, list) or any(not isinstance(p, list) or len(p) != 2 for p in pairs):
            raise ValueError(f"{where}: holds {json_kind(saved)}, expected a counter's [key, count] pairs")
        if [p[0] for p in pairs] != sorted(live):
            raise ValueError(f"{where}: counts other keys than {_listed(sorted(live))}")
        return Counter({k: _decode_like(c, live[k], f"{where}[{k}]") for k, c in pairs})
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            if not isinstance(saved, dict):
                raise ValueError(f"{where}: holds {json_kind(saved)}, expected an object")
            extra, missing = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
            raise ValueError(f"{where}: unexpected keys {_listed(extra)}, missing keys {_listed(missing)}")
        return {k: _decode_like(saved[k], live[k], f"{where}.{k}") for k in live}
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(live):
            got = f"{len(saved)} values" if isinstance(saved, list) else json_kind(saved)
            raise ValueError(f"{where}: holds {got}, expected {len(live)} values")
        items = [_decode_like(s, v, f"{where}[{i}]") for i, (s, v) in enumerate(zip(saved, live))]
        return tuple(items) if isinstance(live, tuple) else items
    number = isinstance(live, (int, float)) and not isinstance(live, bool)
    if number and isinstance(saved, dict) and set(saved) == {"float"} and saved["float"] in _NON_FINITE:
        return float(saved["float"])
    if json_kind(saved) != json_kind(live):
        raise ValueError(f"{where}: holds {json_kind(saved)}, expected {json_kind(live)}")
    return saved


class StateDictPart:
    """A torch object's ``state_dict()`` as a run part (see the module doc): ``get()`` reads it, ``put(d)``
    loads it. ``what`` names it in errors."""

    def __init__(
        self, what: str, get: Callable[[], dict[str, Any]], put: Callable[[dict[str, Any]], None]
    ) -> None:
        self.what, self._get, self._put = what, get, put
        self._digested: dict[str, Any] = {}
        self.digest()  # a value a run cannot commit is refused here, when it is tracked

    def digest(self) -> bytes:
        """The digest of the state now, which :meth:`state` then returns."""
        self._digested = _encode(self._get(), self.what)
        return hashlib.sha256(state_bytes(self._digested)).digest()

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state of the last :meth:`digest`, the one the last commitment holds: the final checkpoint,
        written when the run ends, must hold it even where the object changed after the last step (a
        scheduler stepped once more after the loop)."""
        return {}, self._digested

    def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        self._put(_decode_like(meta, self._get(), self.what))


def grad_scaler_part(scaler: torch.amp.GradScaler) -> StateDictPart:
    """AMP's loss scaler: its scale, growth tracker and settings (an empty state while it is disabled)."""
    return StateDictPart("grad scaler", scaler.state_dict, scaler.load_state_dict)


def scheduler_part(scheduler: Any) -> StateDictPart:
    """An LR scheduler (``torch.optim.lr_scheduler``'s, ``ReduceLROnPlateau`` included) and the
    hyperparameters of its optimizer's groups, which it sets at each step (a resumed optimizer takes its
    state tensors from the checkpoint, but its groups from the script, at their initial values)."""
    groups = scheduler.optimizer.param_groups

    def get() -> dict[str, Any]:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        return {"scheduler": scheduler.state_dict(), "param_groups": hyper}

    def put(state: dict[str, Any]) -> None:
        scheduler.load_state_dict(state["scheduler"])
        for group, hyper in zip(groups, state["param_groups"]):
            group.update(hyper)

    return StateDictPart("lr scheduler", get, put)
