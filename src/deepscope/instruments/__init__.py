"""Training-dynamics instruments: Cockpit's quantities, per layer, from per-sample
gradients (`engine`) and matrix-free curvature (`curvature`).

`Instruments` is what the recorder drives; `resolve_quantities` validates a choice of
quantities; `QUANTITY_NAMES` and `CONFIGURATIONS` list what exists.
"""

from .base import TOTAL, QuantityValue
from .config import CONFIGURATIONS, QUANTITY_NAMES, resolve_quantities
from .suite import Instruments

__all__ = [
    "CONFIGURATIONS",
    "QUANTITY_NAMES",
    "TOTAL",
    "Instruments",
    "QuantityValue",
    "resolve_quantities",
]
