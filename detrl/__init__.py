"""detrl: deterministic and verifiable training.

The core knows nothing of particular agents or models: :class:`Session` records or replays a training
loop, :class:`Sources` is the switchboard of random streams, :class:`Precision` picks fp32, fp64 or
verifiable (FP64 compute, FP32 rounding, sparse rounding log).

The names below are imported on first use, so ``detrl --help`` (and a Ctrl-C during start-up) never waits
for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "STREAMS": "detrl.core.sources",
    "Sources": "detrl.core.sources",
    "Batch": "detrl.core.engine",
    "Divergence": "detrl.core.engine",
    "Session": "detrl.core.engine",
    "BundleError": "detrl.formats.bundle",
    "Precision": "detrl.core.precision",
    "Thresholds": "detrl.core.rounding",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'detrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
