"""Fused summaries: every finite float32/64 tensor of a step on one device in a few ops.

The general path (`stats.tensor_stats` + `stats.array_views`) costs ~30 ops per tensor; at
every-step recording rates the fixed cost per op dominates (a step of the MLP benchmark has 24
tensors: ~2 ms of op overhead against well under 1 ms of arithmetic). Here each tensor is a
2-D matrix of rows — a batched tensor's rows are its batch items, another tensor's its neurons
(index along dim 0) — and the rows of all tensors of one width are stacked into one matrix:
per width, a dozen row reductions on the tensors' own device (sum, centred sum of squares,
sum of |x|, nonzero count, min, max) and, for the batched tensors of one batch size, their
per-neuron views as column reductions. The per-row results come to the host in one transfer,
where NumPy combines them per tensor in float64 (law of total variance: no E[x²] − E[x]²
cancellation). Same definitions as the general path; tests compare the two.
"""

from __future__ import annotations

import numpy as np
import torch

from ..scratch import scratch
from ..store.schema import STAT_COLUMNS
from .stats import DEFAULT_MAX_ITEMS, DEFAULT_MAX_NEURONS, DEFAULT_MAX_VALUES

FUSED_DTYPES = (torch.float32, torch.float64)
# Rows at least this long count their nonzero elements in float64 (exact beyond float32's 2^24).
_LONG_ROW = 2 ** 24

Summary = tuple[np.ndarray, dict[str, np.ndarray]]


def fused_eligible(x: torch.Tensor) -> bool:
    """Whether `fused_summaries` takes `x`: a non-empty float32/64 tensor (any device)."""
    return x.dtype in FUSED_DTYPES and x.numel() > 0


@np.errstate(all="ignore")  # non-finite tensors are found and left to the general path
def fused_summaries(tensors: list[tuple[torch.Tensor, int | None]], max_samples: int,
                    max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                    max_values: int = DEFAULT_MAX_VALUES) -> list[Summary | None]:
    """`tensor_stats` and `array_views` of `fused_eligible` (tensor, batch_dim) pairs of one
    dtype and device, in a number of ops that grows with their distinct row widths, not
    their number, and one device-to-host transfer.

    Returns, in order, (float64 stats row of `STAT_COLUMNS`, views as float32 NumPy arrays),
    or None for a tensor this path cannot summarise exactly (a non-finite value, or sums that
    overflow its dtype): the general path takes those. Nothing returned shares memory with the
    inputs or with a work buffer.
    """
    x0 = tensors[0][0]
    dtype, device = x0.dtype, x0.device
    blocks = [_rows_of(x, bd) for x, bd in tensors]
    # one matrix per row width: its non-batched tensors, then its batched ones by batch size
    by_width: dict[int, list[int]] = {}
    for i in sorted(range(len(tensors)),
                    key=lambda i: (tensors[i][1] is not None, blocks[i].shape[0])):
        by_width.setdefault(blocks[i].shape[1], []).append(i)
    # work buffers for one width at a time: reused, so they stay in cache
    largest = max(sum(blocks[i].numel() for i in idx) for idx in by_width.values())
    buf, absd, work = (scratch((largest,), dtype, slot, device)
                       for slot in ("fused", "fused_abs", "fused_work"))
    row0 = [0] * len(tensors)        # first row of each tensor in the stacked row results
    lengths: list[np.ndarray] = []
    # what goes to the host: per width (6, rows): sum, sq, abs, nonzero, min, max of each
    # row; then per batch-size run (3, tensors, width) neuron mean, std, abs max; then samples
    per_row: list[torch.Tensor] = []
    columns: list[torch.Tensor] = []
    samples: list[torch.Tensor] = []
    col_of: dict[int, tuple[int, int, int]] = {}  # batched tensor -> (run, index, width)
    done = 0
    for width, idx in by_width.items():
        local = np.cumsum([0] + [blocks[i].shape[0] for i in idx])
        rows = int(local[-1])
        span = slice(0, rows * width)
        m = torch.cat([blocks[i] for i in idx], out=buf[span].view(rows, width))
        a = torch.abs(m, out=absd[span].view(rows, width))
        w = work[span].view(rows, width)
        r_sum = m.sum(1)
        stats = [r_sum, torch.sub(m, (r_sum / width).unsqueeze(1), out=w).square_().sum(1),
                 a.sum(1)]
        # neuron views of batched tensors, over the batch: all of one batch size at once
        for batch, group in _runs([(j, blocks[i].shape[0]) for j, i in enumerate(idx)
                                   if tensors[i][1] is not None]):
            rs = slice(int(local[group[0]]), int(local[group[-1] + 1]))
            v = m[rs].view(len(group), batch, width)
            c_mean = v.sum(1).div_(batch)
            centred = torch.sub(v, c_mean.unsqueeze(1), out=w[rs].view(len(group), batch, width))
            c_std = centred.square_().sum(1).div_(batch).sqrt_()
            c_abs = a[rs].view(len(group), batch, width).amax(1)
            for j, i in enumerate(idx[k] for k in group):
                col_of[i] = (len(columns), j, width)
            columns.append(torch.stack([c_mean, c_std, c_abs]))
        long = width >= _LONG_ROW  # counts exact beyond float32's 2^24 too
        stats += [a.sign_().sum(1, dtype=torch.float64 if long else None), m.amin(1),
                  m.amax(1)]
        per_row.append(torch.stack([s.double() for s in stats] if long else stats))
        lengths.append(np.full(rows, float(width)))
        for j, i in enumerate(idx):
            row0[i] = done + int(local[j])
        done += rows
    if max_samples > 0:
        samples = [blocks[i][:max_samples, :max_values] for i, (_, bd) in enumerate(tensors)
                   if bd is not None]
    host = _to_host(per_row + columns + samples)
    r_sum, r_sq, r_abs, r_nz, r_mn, r_mx = np.concatenate(host[:len(per_row)], axis=1)
    col_host = host[len(per_row):len(per_row) + len(columns)]
    sample_host = iter(host[len(per_row) + len(columns):])
    r_len = np.concatenate(lengths)
    r_mean = r_sum / r_len

    # per tensor, its rows combined
    order = sorted(range(len(tensors)), key=row0.__getitem__)
    starts = np.array([row0[i] for i in order])
    count = np.diff(np.append(starts, done))

    def seg(v: np.ndarray, ufunc: np.ufunc = np.add) -> np.ndarray:
        return ufunc.reduceat(v, starts)

    n = seg(r_len)
    mean = seg(r_sum) / n
    within = seg(r_sq)
    spread = seg(r_len * (r_mean - np.repeat(mean, count)) ** 2)
    lo, hi = seg(r_mn, np.minimum), seg(r_mx, np.maximum)
    t = len(tensors)
    cols = {"numel": n, "mean": mean, "std": np.sqrt(np.maximum((within + spread) / n, 0.0)),
            "abs_mean": seg(r_abs) / n, "min": lo, "max": hi, "abs_max": np.maximum(-lo, hi),
            "norm": np.sqrt(within + seg(r_len * r_mean * r_mean)),
            "zero_frac": (n - seg(r_nz)) / n, "nan": np.zeros(t), "posinf": np.zeros(t),
            "neginf": np.zeros(t), "sv_max": np.full(t, np.nan)}
    table = np.empty((t, len(STAT_COLUMNS)))
    table[order] = np.stack([cols[c] for c in STAT_COLUMNS], axis=1)
    finite = np.empty(t, dtype=bool)
    finite[order] = seg(np.isfinite(r_sum + r_sq + r_abs), np.logical_and)
    row_views = {"mean": r_mean.astype(np.float32),
                 "std": np.sqrt(r_sq / r_len).astype(np.float32),
                 "abs_max": np.maximum(-r_mn, r_mx).astype(np.float32)}

    out: list[Summary | None] = []
    for i, (x, bd) in enumerate(tensors):
        views: dict[str, np.ndarray] = {}
        r0, rows = row0[i], blocks[i].shape[0]
        if x.dim() and bd is None:
            k = min(rows, max_neurons)
            for stat, v in row_views.items():
                views[f"neuron_{stat}"] = v[r0:r0 + k]
        elif x.dim():
            run, j, width = col_of[i]
            c = col_host[run][:, j, :min(width, max_neurons)].astype(np.float32)
            finite[i] &= bool(np.isfinite(c).all())  # a column's squares can overflow alone
            views.update(neuron_mean=c[0], neuron_std=c[1], neuron_abs_max=c[2])
            k = min(rows, max_items)
            for stat, v in row_views.items():
                views[f"sample_{stat}"] = v[r0:r0 + k]
            if max_samples > 0:
                values = next(sample_host).astype(np.float32)  # its own copy
                views["samples"] = (values if width > max_values else
                                    values.reshape(-1, *_item_shape(x, bd)))
        out.append((table[i], views) if finite[i] else None)
    return out


def _rows_of(x: torch.Tensor, batch_dim: int | None) -> torch.Tensor:
    """`x` as a 2-D (rows, width) tensor: a batched tensor's rows are its batch items, another
    tensor's its neurons (index along dim 0; one row for a 0-d tensor)."""
    if batch_dim:
        x = x.movedim(batch_dim, 0)
    return x.reshape(x.shape[0] if x.dim() else 1, -1)


def _item_shape(x: torch.Tensor, batch_dim: int) -> tuple[int, ...]:
    shape = list(x.shape)
    del shape[batch_dim]
    return tuple(shape)


def _runs(items: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """(key, [position, ...]) for the runs of equal keys in (position, key) pairs."""
    out: list[tuple[int, list[int]]] = []
    for j, key in items:
        if out and out[-1][0] == key:
            out[-1][1].append(j)
        else:
            out.append((key, [j]))
    return out


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors as host NumPy arrays, in one transfer (through float64: exact for float32
    and float64 values)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float64).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].reshape(tuple(t.shape)))
        at += t.numel()
    return out
