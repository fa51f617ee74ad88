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

import functools
import math
import threading
from typing import NamedTuple

import numpy as np
import torch

from ..store.schema import STAT_COLUMNS
from .stats import DEFAULT_MAX_ITEMS, DEFAULT_MAX_NEURONS, DEFAULT_MAX_VALUES

FUSED_DTYPES = (torch.float32, torch.float64)
# Rows at least this long count their nonzero elements in float64 (exact beyond float32's 2^24).
_LONG_ROW = 2 ** 24

# Devices whose tensors NumPy reads in place (no transfer)
_HOST = ("cpu",)

Summary = tuple[np.ndarray, dict[str, np.ndarray]]


def fused_eligible(x: torch.Tensor) -> bool:
    """Whether `fused_summaries` takes `x`: a non-empty float32/64 tensor (any device)."""
    return x.dtype in FUSED_DTYPES and x.numel() > 0


class _Run(NamedTuple):
    """Batched tensors of one width and batch size, adjacent in their width's matrix."""

    batch: int
    rows: slice                 # their rows in the width's matrix
    cols: slice                 # their (3, tensors, width) block in the column results


class _Width(NamedTuple):
    """The tensors of one row width, stacked into one matrix."""

    width: int
    blocks: tuple[int, ...]     # the tensors, in stacking order
    ends: tuple[int, ...]       # 0, then where each ends in the matrix (elements)
    rows: slice                 # the matrix's rows in the row results
    runs: tuple[_Run, ...]
    samples: tuple[int, ...]    # the matrix's rows that hold sample values


# A view of one tensor: (name, source, index, shape or None) — source "mean" / "std" /
# "abs_max" (per-row views), ("col", run) or ("samples", width) — see `_Plan.views`.
_View = tuple[str, object, object, tuple[int, ...] | None]


class _Plan:
    """Where each tensor of a step goes (its width's matrix, rows, columns, samples): the
    same shapes arrive every step, so this bookkeeping runs once per layout."""

    def __init__(self, layout: tuple[tuple[tuple[int, ...], int | None], ...],
                 max_samples: int, max_neurons: int, max_items: int, max_values: int):
        n_rows = [(s[bd] if bd is not None else s[0] if s else 1) for s, bd in layout]
        n_width = [math.prod(s) // r for (s, _), r in zip(layout, n_rows)]
        batched = [bd is not None for _, bd in layout]
        # one matrix per row width: its non-batched tensors, then its batched ones by batch size
        by_width: dict[int, list[int]] = {}
        for i in sorted(range(len(layout)), key=lambda i: (batched[i], n_rows[i])):
            by_width.setdefault(n_width[i], []).append(i)
        row0 = [0] * len(layout)        # first row of each tensor in the row results
        col_of: dict[int, tuple[int, int]] = {}  # batched tensor -> (run, index in run)
        sample_of: dict[int, tuple[int, int]] = {}  # batched tensor -> (width, first row)
        self.widths: list[_Width] = []
        self.runs: list[tuple[_Run, int]] = []      # (run, width)
        self.run_members: list[tuple[int, ...]] = []
        done = n_cols = 0
        for width, idx in by_width.items():
            local = np.cumsum([0] + [n_rows[i] for i in idx]).tolist()
            runs = []
            for batch, group in _runs([(j, n_rows[i]) for j, i in enumerate(idx) if batched[i]]):
                size = 3 * len(group) * width
                runs.append(_Run(batch, slice(local[group[0]], local[group[-1] + 1]),
                                 slice(n_cols, n_cols + size)))
                n_cols += size
                self.run_members.append(tuple(idx[k] for k in group))
                for j, k in enumerate(group):
                    col_of[idx[k]] = (len(self.run_members) - 1, j)
            samples: list[int] = []
            for j, i in enumerate(idx):
                row0[i] = done + local[j]
                if batched[i] and max_samples > 0:
                    sample_of[i] = (len(self.widths), len(samples))
                    samples += range(local[j], local[j] + min(n_rows[i], max_samples))
            self.widths.append(_Width(width, tuple(idx), tuple(k * width for k in local),
                                      slice(done, done + local[-1]),
                                      tuple(runs), tuple(samples)))
            self.runs += [(run, width) for run in runs]
            done += local[-1]
        self.n_rows, self.n_cols = done, n_cols
        self.largest = max(w.ends[-1] for w in self.widths)
        self.row_len = np.concatenate([np.full(w.rows.stop - w.rows.start, float(w.width))
                                       for w in self.widths])
        # per tensor, its rows combined: tensors in row order, the first row of each
        self.order = sorted(range(len(layout)), key=row0.__getitem__)
        self.starts = np.array([row0[i] for i in self.order])
        self.count = np.diff(np.append(self.starts, done))
        self.sampled = [k for k, w in enumerate(self.widths) if w.samples]
        self.views: list[list[_View]] = []
        for i, (shape, bd) in enumerate(layout):
            r0, rows = row0[i], n_rows[i]
            stats = ("mean", "std", "abs_max")
            if not shape:
                views: list[_View] = []
            elif bd is None:
                views = [(f"neuron_{s}", s, slice(r0, r0 + min(rows, max_neurons)), None)
                         for s in stats]
            else:
                run, j = col_of[i]
                views = [(f"neuron_{s}", ("col", run), (q, j), None) for q, s in enumerate(stats)]
                views += [(f"sample_{s}", s, slice(r0, r0 + min(rows, max_items)), None)
                          for s in stats]
                if i in sample_of:
                    w, s0 = sample_of[i]
                    k = min(rows, max_samples)
                    views.append(("samples", ("samples", w), slice(s0, s0 + k),
                                  (k, max_values) if n_width[i] > max_values
                                  else (k, *_item_shape(shape, bd))))
            self.views.append(views)
        self.index: dict[torch.device, list[torch.Tensor | None]] = {}

    def sample_index(self, device: torch.device) -> list[torch.Tensor | None]:
        """Per width, its sample rows as an index tensor on `device` (None: no samples)."""
        if device not in self.index:
            self.index[device] = [torch.tensor(w.samples, device=device) if w.samples else None
                                  for w in self.widths]
        return self.index[device]


@functools.lru_cache(maxsize=16)
def _plan(layout: tuple[tuple[tuple[int, ...], int | None], ...], max_samples: int,
          max_neurons: int, max_items: int, max_values: int) -> _Plan:
    return _Plan(layout, max_samples, max_neurons, max_items, max_values)


class _WidthWork(NamedTuple):
    """One width's views into the work buffers (see `_Work`)."""

    cat: torch.Tensor           # the matrix, flat: stacking target
    m: torch.Tensor             # (rows, width) the matrix
    centred: torch.Tensor       # (rows, width) squared deviations from each row's mean
    absolute: torch.Tensor      # (rows, width) |m|, then its signs
    planes: torch.Tensor        # (2, rows, width) centred and absolute
    row_sum: torch.Tensor       # (rows, 1) of the row results ...
    row_mean: torch.Tensor      # (rows, 1)
    row_sums: torch.Tensor      # (2, rows): centred sum of squares, sum of |x|
    row_nonzero: torch.Tensor
    row_min: torch.Tensor
    row_max: torch.Tensor
    # per run: (its matrix (tensors, batch, width), its squared deviations, its |m|, column
    # sums (tensors, 1, width), column means, centred sums of squares, abs maxima)
    runs: tuple[tuple[torch.Tensor, ...], ...]


class _Work:
    """A plan's work buffers and all views into them, on one device and dtype, for one thread:
    made once per layout, so that a step costs little more than its arithmetic."""

    def __init__(self, plan: _Plan, dtype: torch.dtype, device: torch.device,
                 old: _Work | None):
        def buffer(size: int, previous: torch.Tensor | None) -> torch.Tensor:
            if previous is not None and previous.numel() >= size:
                return previous  # reused, so that it stays in cache (no page faults)
            return torch.empty(size, dtype=dtype, device=device)

        self.plan = plan
        self.buffers = [buffer(size, old.buffers[k] if old else None)
                        for k, size in enumerate((3 * plan.largest, 6 * plan.n_rows,
                                                  plan.n_cols))]
        # per row: sum, centred sum of squares, sum of |x|, nonzero count, min, max; per run
        # of batched tensors (3, tensors, width): per-neuron sum, centred sum of squares,
        # abs max
        self.row_out = self.buffers[1][:6 * plan.n_rows].view(6, plan.n_rows)
        self.col_out = self.buffers[2][:plan.n_cols]
        self.index = [torch.tensor(w.samples, device=device) if w.samples else None
                      for w in plan.widths]
        self.widths = []
        for w in plan.widths:
            width, size = w.width, w.ends[-1]
            planes = self.buffers[0][:3 * size].view(3, -1, width)
            m, centred, absolute = planes.unbind()
            r = self.row_out[:, w.rows]
            runs = []
            for run in w.runs:
                shape = ((run.rows.stop - run.rows.start) // run.batch, run.batch, width)
                c = self.col_out[run.cols].view(3, shape[0], 1, width)
                runs.append((m[run.rows].view(shape), centred[run.rows].view(shape),
                             absolute[run.rows].view(shape), c[0], torch.empty_like(c[0]),
                             c[1], c[2]))
            self.widths.append(_WidthWork(
                m.view(-1), m, centred, absolute, planes[1:], r[0].unsqueeze(1),
                torch.empty((m.shape[0], 1), dtype=dtype, device=device), r[1:3], r[3],
                r[4], r[5], tuple(runs)))


_local = threading.local()


def _work(plan: _Plan, dtype: torch.dtype, device: torch.device) -> _Work:
    """This thread's `_Work` of `plan` (its buffers kept from the last layout if large
    enough)."""
    works = _local.__dict__.setdefault("works", {})
    old = works.get((device, dtype))
    if old is None or old.plan is not plan:
        works[device, dtype] = old = _Work(plan, dtype, device, old)
    return old


@np.errstate(all="ignore")  # non-finite tensors are found and left to the general path
def fused_summaries(tensors: list[tuple[torch.Tensor, int | None]], max_samples: int,
                    max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                    max_values: int = DEFAULT_MAX_VALUES) -> list[Summary | None]:
    """`tensor_stats` and `array_views` of `fused_eligible` (tensor, batch_dim) pairs of one
    dtype and device, in a number of ops that grows with their distinct row widths, not
    their number, and one device-to-host transfer (none on the CPU).

    Returns, in order, (float64 stats row of `STAT_COLUMNS`, views as float32 NumPy arrays),
    or None for a tensor this path cannot summarise exactly (a non-finite value, or sums that
    overflow its dtype): the general path takes those. Nothing returned shares memory with the
    inputs or with a work buffer.
    """
    x0 = tensors[0][0]
    dtype, device = x0.dtype, x0.device
    plan = _plan(tuple((tuple(x.shape), bd) for x, bd in tensors), max_samples, max_neurons,
                 max_items, max_values)
    work = _work(plan, dtype, device)
    flat = [x.reshape(-1) if not bd else x.movedim(bd, 0).reshape(-1) for x, bd in tensors]
    samples: list[torch.Tensor] = []    # of the widths with samples
    long_rows: list[slice] = []
    long_nz: list[torch.Tensor] = []
    for w, v, index in zip(plan.widths, work.widths, work.index):
        torch.cat([flat[i] for i in w.blocks], out=v.cat)
        torch.sum(v.m, 1, keepdim=True, out=v.row_sum)
        _squared_deviation(v.m, torch.div(v.row_sum, w.width, out=v.row_mean), v.centred)
        torch.abs(v.m, out=v.absolute)
        torch.sum(v.planes, 2, out=v.row_sums)
        # neuron views of batched tensors, over the batch: all of one batch size at once
        for run, (x, centred, absolute, c_sum, c_mean, c_sq, c_abs) in zip(w.runs, v.runs):
            torch.sum(x, 1, keepdim=True, out=c_sum)
            torch.sum(_squared_deviation(x, torch.div(c_sum, run.batch, out=c_mean), centred),
                      1, keepdim=True, out=c_sq)
            torch.amax(absolute, 1, keepdim=True, out=c_abs)
        torch.amin(v.m, 1, out=v.row_min)
        torch.amax(v.m, 1, out=v.row_max)
        if w.width >= _LONG_ROW:  # counts exact beyond float32's 2^24 too
            long_rows.append(w.rows)
            long_nz.append(v.absolute.sign_().sum(1, dtype=torch.float64))
        else:
            torch.sum(v.absolute.sign_(), 1, out=v.row_nonzero)
        if index is not None:
            samples.append(v.m.index_select(0, index)[:, :max_values])
    host = _to_host([work.row_out, work.col_out, *samples, *long_nz], device.type in _HOST)
    r_sum, r_sq, r_abs, r_nz, r_mn, r_mx = host[0].astype(np.float64)
    for rows, counts in zip(long_rows, host[2 + len(samples):]):
        r_nz[rows] = counts
    r_len = plan.row_len
    r_mean = r_sum / r_len
    starts, t = plan.starts, len(tensors)

    def seg(v: np.ndarray, ufunc: np.ufunc = np.add) -> np.ndarray:
        return ufunc.reduceat(v, starts)

    n = seg(r_len)
    mean = seg(r_sum) / n
    within = seg(r_sq)
    spread = seg(r_len * (r_mean - np.repeat(mean, plan.count)) ** 2)
    lo, hi = seg(r_mn, np.minimum), seg(r_mx, np.maximum)
    cols = {"numel": n, "mean": mean, "std": np.sqrt(np.maximum((within + spread) / n, 0.0)),
            "abs_mean": seg(r_abs) / n, "min": lo, "max": hi, "abs_max": np.maximum(-lo, hi),
            "norm": np.sqrt(within + seg(r_len * r_mean * r_mean)),
            "zero_frac": (n - seg(r_nz)) / n,
            "nan": np.zeros(t), "posinf": np.zeros(t), "neginf": np.zeros(t),
            "sv_max": np.full(t, np.nan)}
    table = np.empty((t, len(STAT_COLUMNS)))
    table[plan.order] = np.stack([cols[c] for c in STAT_COLUMNS], axis=1)
    finite = np.empty(t, dtype=bool)
    finite[plan.order] = seg(np.isfinite(r_sum + r_sq + r_abs), np.logical_and)
    source: dict[object, np.ndarray] = {
        "mean": r_mean.astype(np.float32), "std": np.sqrt(r_sq / r_len).astype(np.float32),
        "abs_max": np.maximum(-r_mn, r_mx).astype(np.float32)}
    for k, s in zip(plan.sampled, host[2:2 + len(samples)]):
        source["samples", k] = s.astype(np.float32, copy=s.dtype != np.float32)
    col_host = host[1].astype(np.float64)
    for k, (run, width) in enumerate(plan.runs):
        g = (run.rows.stop - run.rows.start) // run.batch
        c = col_host[run.cols].reshape(3, g, width)[:, :, :max_neurons]
        c[0] /= run.batch
        c[1] = np.sqrt(c[1] / run.batch)
        c = source["col", k] = c.astype(np.float32)
        # a column's squares can overflow alone
        finite[list(plan.run_members[k])] &= np.isfinite(c).all(axis=(0, 2))
    out: list[Summary | None] = []
    for i, views in enumerate(plan.views):
        got: dict[str, np.ndarray] = {}
        for name, src, index, shape in views:
            v = source[src][index]
            got[name] = v if shape is None else v.reshape(shape)
        out.append((table[i], got) if finite[i] else None)
    return out


def _squared_deviation(x: torch.Tensor, mean: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(x - mean)² into `out`, `mean` broadcast (one pass: sub then square_ is two)."""
    return torch.ops.aten.mse_loss.out(x, mean, 0, out=out)


def _item_shape(shape: tuple[int, ...], batch_dim: int) -> tuple[int, ...]:
    item = list(shape)
    del item[batch_dim]
    return tuple(item)


def _runs(items: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """(key, [position, ...]) for the runs of equal keys in (position, key) pairs."""
    out: list[tuple[int, list[int]]] = []
    for j, key in items:
        if out and out[-1][0] == key:
            out[-1][1].append(j)
        else:
            out.append((key, [j]))
    return out


def _to_host(tensors: list[torch.Tensor], in_place: bool) -> list[np.ndarray]:
    """The tensors as host NumPy arrays: `in_place` their own memory, else copies in one
    transfer (through float64: exact for float32 and float64 values)."""
    if in_place:
        return [t.numpy() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float64).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].reshape(tuple(t.shape)))
        at += t.numel()
    return out
