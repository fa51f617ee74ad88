"""The on-disk format: write path (`writer`), format (`schema`, `arrays`), read path (`reader`).

`StoreWriter` loads on first use: reading a run never imports the write path (nor torch).
"""

from typing import Any

from ..records import StepPayload, TensorInfo
from .layout import rank_file, rank_files
from .reader import StoreReader
from .schema import SCHEMA_VERSION, STAT_COLUMNS

__all__ = ["SCHEMA_VERSION", "STAT_COLUMNS", "StepPayload", "StoreReader", "StoreWriter",
           "TensorInfo", "rank_file", "rank_files"]


def __getattr__(name: str) -> Any:
    if name == "StoreWriter":
        from .writer import StoreWriter
        return StoreWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
