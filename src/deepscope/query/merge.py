"""Statistics of the global batch from the ranks' records, combined exactly.

A record's statistics are sufficient to combine: with f = numel − nan − posinf − neginf the
finite elements a rank's mean / std / abs_mean are over, the merged mean is Σ f·mean / Σ f,
the merged M2 = Σ f·(std² + (mean − merged mean)²) (Chan et al.'s pairwise update), min / max
/ abs_max the extremes, norm = √Σ norm², zero_frac weighted by numel (it is over all
elements), counts summed. sv_max has no such decomposition: NaN.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..store.schema import STAT_COLUMNS

KEYS = ["step", "iteration", "tensor", "direction"]


def merge(frames: pd.DataFrame, batch_tensors: set[str], expected: int
          ) -> tuple[pd.DataFrame, list[str], list[str]]:
    """One row per record of the global batch from `frames` (stats_wide rows with a `rank`
    column, in rank order).

    Records of `batch_tensors` (those with a batch dimension) are combined over the ranks and
    need one row from each of the `expected` ranks, else their statistics are NaN. Other
    records (parameters and their gradients, the same on every rank after DDP's sync) are the
    lowest rank's row. Returns (one row per record, in order of first appearance; tensors
    whose batch records lack a rank; tensors whose unbatched records differ between ranks).
    """
    if frames.empty:
        return frames[KEYS + list(STAT_COLUMNS)].copy(), [], []
    codes = frames.groupby(KEYS, sort=False).ngroup().to_numpy()
    _, first = np.unique(codes, return_index=True)  # ngroup numbers groups as they appear
    out = frames.iloc[first][KEYS + list(STAT_COLUMNS)].reset_index(drop=True)
    n = len(first)
    col = {c: frames[c].to_numpy(dtype=np.float64) for c in STAT_COLUMNS}
    batched = out["tensor"].isin(batch_tensors).to_numpy()

    # unbatched records: the lowest rank's row (`out` already), flagged if the others differ
    lead = first[codes]
    same = np.ones(len(codes), dtype=bool)
    for v in col.values():
        same &= (v == v[lead]) | (np.isnan(v) & np.isnan(v[lead]))
    differs = np.bincount(codes, weights=(~same).astype(float), minlength=n) > 0
    differing = sorted(set(out.loc[differs & ~batched, "tensor"]))

    merged = _combine(col, codes, n)
    short = np.bincount(codes, minlength=n) < expected  # part of the global batch only
    rows = batched[:, None] & np.ones(len(STAT_COLUMNS), dtype=bool)
    values = np.where(short[:, None], np.nan, np.column_stack([merged[c] for c in STAT_COLUMNS]))
    out[list(STAT_COLUMNS)] = np.where(rows, values, out[list(STAT_COLUMNS)].to_numpy())
    incomplete = sorted(set(out.loc[short & batched, "tensor"]))
    return out, incomplete, differing


def _combine(col: dict[str, np.ndarray], codes: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Every group's statistics combined from its rows (see the module docstring)."""
    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(codes, weights=values, minlength=n)

    f = col["numel"] - col["nan"] - col["posinf"] - col["neginf"]
    has = f > 0  # a rank without finite elements has NaN moments: it adds no weight
    with np.errstate(invalid="ignore", divide="ignore"):
        finite = total(f)
        mean = total(np.where(has, f * col["mean"], 0.0)) / finite
        m2 = total(np.where(has, f * (col["std"] ** 2 + (col["mean"] - mean[codes]) ** 2),
                            0.0))
        numel = total(col["numel"])
        out = {"numel": numel, "mean": mean, "std": np.sqrt(m2 / finite),
               "abs_mean": total(np.where(has, f * col["abs_mean"], 0.0)) / finite,
               "norm": np.sqrt(total(col["norm"] ** 2)),
               "zero_frac": total(col["zero_frac"] * col["numel"]) / np.maximum(numel, 1.0),
               "sv_max": np.full(n, np.nan)}
    for c in ("nan", "posinf", "neginf"):
        out[c] = total(col[c])
    for c, pick, start in (("min", np.fmin, np.inf), ("max", np.fmax, -np.inf),
                           ("abs_max", np.fmax, -np.inf)):
        best = np.full(n, start)
        pick.at(best, codes, col[c])  # fmin / fmax skip NaN (a rank without finite values)
        out[c] = np.where(best == start, np.nan, best)
    return out
