"""A run as Parquet tables: one file per table, readable by pandas, polars, DuckDB, Spark."""

from __future__ import annotations

import json
from pathlib import Path

from ..query.run import Run

TABLES = ("tensors", "stats", "kpis", "quantities", "notes", "anomalies", "steps")


def export_parquet(run: Run, out_dir: str | Path) -> list[Path]:
    """Write `<table>.parquet` for every table in `TABLES` into `out_dir`; returns the paths.

    stats is wide (one column per statistic); quantity metadata is a JSON string column.
    """
    try:
        import pyarrow  # noqa: F401 - pandas needs it for Parquet
    except ModuleNotFoundError:
        raise ValueError("Parquet export needs pyarrow: pip install 'deepscope[export]'") \
            from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    quantities = run.quantities()
    # The flattened metadata columns mix lists, numbers and text: Parquet gets the JSON.
    quantities = quantities[["step", "name", "layer", "value"]].assign(
        meta=[json.dumps(m) for m in quantities["meta"]])
    tensors = run.tensors()
    tensors["shape"] = [json.dumps(s) for s in tensors["shape"]]
    frames = {"tensors": tensors, "stats": run.stats_wide(), "kpis": run.kpis(),
              "quantities": quantities, "notes": run.notes(), "anomalies": run.anomalies(),
              "steps": run.step_table()}
    paths = []
    for name in TABLES:
        path = out / f"{name}.parquet"
        frames[name].to_parquet(path, index=False)
        paths.append(path)
    return paths
