"""Values that instruments hand to the recorder for storage (defined in `deepscope.records`,
below the store, so the store need not load the instruments), and how a failure reads in
them."""

from ..records import TOTAL, InstrumentWarning, QuantityValue

__all__ = ["TOTAL", "InstrumentWarning", "QuantityValue", "describe"]


def describe(error: BaseException) -> str:
    """'ErrorType: first line of the message', naming the first public error class."""
    kind = next(c.__name__ for c in type(error).__mro__ if not c.__name__.startswith("_"))
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{kind}: {text}" if text else kind
