"""The base of detrl's dispatch modes (torch's ``TorchDispatchMode`` without its per-op dynamo guard), and
the decorator that fills their per-op tables (:func:`registrar`).

torch wraps every subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo`` (so that a
``torch.compile`` inside a mode does not trace into it): two extra Python frames and two eval-frame swaps
on every aten op, about 2 µs of the 15-50 µs an op costs under the rounding mode. detrl's modes run eager
steps only, so they opt out through torch's own class hook (``_should_skip_dynamo``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.utils._python_dispatch import TorchDispatchMode

F = TypeVar("F", bound=Callable[..., Any])


class EagerDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` for eager code: its ``__torch_dispatch__`` is called as written."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def registrar(table: dict[Any, F], what: str) -> Callable[..., Callable[[F], F]]:
    """The decorator that fills ``table``, a mode's per-op table: ``@handles(op, ...)`` above a function makes
    it the entry of each op. ``what`` names an entry in the error an op registered twice raises at import
    (a bug in detrl: the later rule would silently replace the earlier)."""

    def handles(*ops: Any) -> Callable[[F], F]:
        def register(fn: F) -> F:
            for op in ops:
                if op in table:
                    raise RuntimeError(f"{what} for {op} registered twice")
                table[op] = fn
            return fn

        return register

    return handles


def bound_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """All arguments of aten op ``func`` in schema order, those passed by keyword and the defaults filled in
    (None where there is none), so a per-op handler or rule need not parse kwargs."""
    bound = []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound.append(args[i])
        elif arg.name in kwargs:
            bound.append(kwargs[arg.name])
        else:
            bound.append(arg.default_value if arg.has_default_value() else None)
    return bound
