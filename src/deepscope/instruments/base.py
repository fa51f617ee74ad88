"""Values that instruments hand to the recorder for storage (defined in `deepscope.records`,
below the store, so the store need not load the instruments)."""

from ..records import TOTAL, InstrumentWarning, QuantityValue

__all__ = ["TOTAL", "InstrumentWarning", "QuantityValue"]
