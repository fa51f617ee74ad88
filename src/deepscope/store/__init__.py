"""The on-disk format: write path (`writer`), format (`schema`, `arrays`), read path (`reader`)."""

from .layout import rank_file, rank_files
from .reader import StoreReader
from .schema import SCHEMA_VERSION, STAT_COLUMNS
from .writer import StepPayload, StoreWriter, TensorInfo

__all__ = ["SCHEMA_VERSION", "STAT_COLUMNS", "StepPayload", "StoreReader", "StoreWriter",
           "TensorInfo", "rank_file", "rank_files"]
