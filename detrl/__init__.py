"""detrl: deterministic and verifiable training.

The core knows nothing of particular agents or models: :class:`Session` records or replays a training
loop, :class:`Sources` is the switchboard of random streams, :class:`Precision` picks fp32, fp64 or
verifiable (FP64 compute, FP32 rounding, sparse rounding log).
"""

from detrl.bundle import BundleError
from detrl.engine import Batch, Divergence, Session
from detrl.precision import Precision
from detrl.rounding import Thresholds
from detrl.sources import STREAMS, Sources

__all__ = ["STREAMS", "Batch", "BundleError", "Divergence", "Precision", "Session", "Sources", "Thresholds"]
__version__ = "0.1.0"
