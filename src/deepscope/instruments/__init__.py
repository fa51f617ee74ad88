"""Training-dynamics instruments: Cockpit's quantities, per layer, from per-sample
gradients (`engine`) and matrix-free curvature (`curvature`).

`Instruments` is what the recorder drives; `resolve_quantities` validates a choice of
quantities; `QUANTITY_NAMES` and `CONFIGURATIONS` list what exists. `Instruments` loads on
first use: the names and configurations (which the query API checks names against) do not
import torch.
"""

from ..lazy import lazy_attributes
from .base import TOTAL, QuantityValue
from .config import CONFIGURATIONS, QUANTITY_NAMES, resolve_quantities

__all__ = [
    "CONFIGURATIONS",
    "QUANTITY_NAMES",
    "TOTAL",
    "Instruments",
    "QuantityValue",
    "resolve_quantities",
]

__getattr__, __dir__ = lazy_attributes(__name__, {"Instruments": ".suite"})
