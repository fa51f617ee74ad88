"""Export a run to the formats the ecosystem reads: TensorBoard event files and Parquet."""

from .parquet import export_parquet
from .tensorboard import export_tensorboard

__all__ = ["export_parquet", "export_tensorboard"]
