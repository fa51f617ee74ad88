"""Typed columns out of a file that may lie: each value is of its column's type, or the read
fails with one `CorruptRunError` line naming the table and column.

SQLite keeps any value in any column (a BLOB in `notes.text`, 'abc' in `kpis.value`, a float
in `steps.iterations`); without these checks they surface later as raw numpy, pandas or HTTP
errors far from their cause.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import CorruptRunError
from ..store import arrays, limits


def _damaged(path: Path, field: str, value: Any, want: str) -> CorruptRunError:
    shown = "".join(c if c.isprintable() else "?" for c in repr(value)[:40])
    return CorruptRunError(f"{path}: stored {field} holds {shown}, not {want}; the file is "
                           "damaged")


def numbers(df: pd.DataFrame, columns: Iterable[str], table: str, path: Path) -> pd.DataFrame:
    """`df` with `columns` as float64 (NULL: NaN); text or blobs there are damage."""
    for column in columns:
        values = df[column]
        if not (pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)):
            numeric(values, table, column, path)
        df[column] = values.astype(float)
    return df


def numeric(values: Iterable[Any], table: str, column: str, path: Path) -> None:
    """Each value a number or NULL."""
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise _damaged(path, f"{table}.{column}", v, "a number")


def integers(values: Iterable[Any], table: str, column: str, path: Path,
             cap: int | None = None) -> None:
    """Each value an int (in [0, cap] when a cap is given), with the field named. A Series
    that pandas already holds as integers is checked without a Python loop."""
    if isinstance(values, pd.Series) and pd.api.types.is_integer_dtype(values) \
            and not pd.api.types.is_bool_dtype(values):
        if cap is not None and len(values):
            outside = values[(values < 0) | (values > cap)]
            if len(outside):
                _capped(int(outside.iloc[0]), cap, f"{table}.{column}", path)
        return
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _damaged(path, f"{table}.{column}", v, "an integer")
        if cap is not None:
            _capped(v, cap, f"{table}.{column}", path)


def _capped(value: Any, cap: int, field: str, path: Path, low: int = 0) -> int:
    """`limits.capped_int`, its message prefixed with the file."""
    try:
        return limits.capped_int(value, cap, field, low=low)
    except CorruptRunError as exc:
        raise CorruptRunError(f"{path}: {exc}") from None


def texts(values: Iterable[Any], table: str, column: str, path: Path) -> list[str]:
    """The values, each checked to be text."""
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise _damaged(path, f"{table}.{column}", v, "text")
    return out


def table(df: pd.DataFrame, name: str, path: Path, *, ints: Iterable[str] = (),
          texts_: Iterable[str] = (), numbers_: Iterable[str] = (),
          counts: dict[str, int] | None = None) -> pd.DataFrame:
    """`df` read from table `name`: `ints` columns checked to hold integers, `counts` integers
    in [0, cap] ({column: cap}), `texts_` text, `numbers_` numbers (returned as float64, NULL
    as NaN)."""
    for column in ints:
        integers(df[column], name, column, path)
    for column, cap in (counts or {}).items():
        integers(df[column], name, column, path, cap)
    for column in texts_:
        texts(df[column], name, column, path)
    return numbers(df, numbers_, name, path)


def shape(value: Any, path: Path) -> list[int]:
    """A recorded tensor's shape: at most MAX_NDIM dims, each and their product under the
    caps."""
    if not (isinstance(value, list) and len(value) <= arrays.MAX_NDIM
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= limits.MAX_DIM
                    for d in value)
            and math.prod(value) <= limits.MAX_TENSOR_NUMEL):
        raise _damaged(path, "tensors.shape", value,
                       f"a shape of at most {arrays.MAX_NDIM} dims and "
                       f"{limits.MAX_TENSOR_NUMEL} elements")
    return value


_HISTOGRAM_COUNTS = ("underflow", "overflow", "nan", "posinf", "neginf", "nonfinite")


def histogram(counts: Any, meta: Any, path: Path, where: str) -> None:
    """Histogram metadata `{"edges": [lo, hi, bins] or one per axis, extras}` agrees with its
    counts: finite lo < hi, 1 <= bins <= MAX_HISTOGRAM_BINS, counts of shape (bins, ...)."""
    edges = meta.get("edges") if isinstance(meta, dict) else None
    axes = edges if isinstance(edges, list) and edges and isinstance(edges[0], list) else [edges]
    bins = []
    for axis in axes:
        if not (isinstance(axis, list) and len(axis) == 3
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in axis)
                and all(math.isfinite(x) for x in axis) and axis[0] < axis[1]):
            raise _damaged(path, f"{where} edges", edges, "[lo, hi, bins] with lo < hi finite")
        bins.append(_capped(axis[2], limits.MAX_HISTOGRAM_BINS, f"{where} edges bins", path,
                            low=1))
    if tuple(counts.shape) != tuple(bins):
        raise CorruptRunError(f"{path}: stored {where} has counts of shape "
                              f"{list(counts.shape)} for edges of {bins} bins; the file is "
                              "damaged")
    for key in (*_HISTOGRAM_COUNTS, *(f"param_{k}" for k in _HISTOGRAM_COUNTS)):
        value = meta.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < math.inf:
            raise _damaged(path, f"{where} {key}", value, "a count >= 0")
