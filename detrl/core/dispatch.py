"""The base of detrl's dispatch modes: torch's ``TorchDispatchMode`` without its per-op dynamo guard.

torch wraps every subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo`` (so that a
``torch.compile`` inside a mode does not trace into it): two extra Python frames and two eval-frame swaps
on every aten op, about 2 µs of the 15-50 µs an op costs under the rounding mode. detrl's modes run eager
steps only, so they opt out through torch's own class hook (``_should_skip_dynamo``).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class EagerDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` for eager code: its ``__torch_dispatch__`` is called as written."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
