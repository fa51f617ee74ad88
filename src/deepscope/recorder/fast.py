"""Fused summaries: every finite float32/64 tensor of a step on one device in a few ops.

The general path (`stats.tensor_stats` + `stats.array_views`) costs ~30 ops per tensor; at
every-step recording rates the fixed cost per op dominates (a step of the MLP benchmark has 24
tensors: ~2 ms of op overhead against well under 1 ms of arithmetic). Here each tensor is a
2-D matrix of rows — a batched tensor's rows are its batch items, another tensor's its neurons
(index along dim 0) — and the rows of all tensors of one width are stacked into one matrix:
per width, nine ops on the tensors' own device (row sum, centred sum of squares, sum of |x|,
nonzero count, min, max) and, for the batched tensors of one batch size, five more for their
per-neuron views (column reductions). Each reduction writes straight into one result buffer,
which comes to the host in one transfer (on the CPU NumPy reads it in place), where NumPy
combines the rows per tensor in float64 (law of total variance: no E[x²] − E[x]²
cancellation). The same shapes arrive every step, so where everything goes (the plan; on the
CPU also the work buffers and every view into them) is worked out once per layout. Same
definitions as the general path; tests compare the two.
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
# Devices whose memory NumPy reads in place (no transfer, no copy).
_HOST = ("cpu",)
_COL = {c: i for i, c in enumerate(STAT_COLUMNS)}

Summary = tuple[np.ndarray, dict[str, np.ndarray]]
Layout = tuple[tuple[tuple[int, ...], int | None], ...]  # (shape, batch_dim) per tensor


def fused_eligible(x: torch.Tensor) -> bool:
    """Whether `fused_summaries` takes `x`: a non-empty float32/64 tensor (any device)."""
    return x.dtype in FUSED_DTYPES and x.numel() > 0


class _Run(NamedTuple):
    """Batched tensors of one width and batch size, adjacent in their width's matrix."""

    batch: int
    rows: slice                 # their rows in the width's matrix
    cols: slice                 # their columns (tensors × width) in the column results


class _Width(NamedTuple):
    """The tensors of one row width, stacked into one matrix."""

    width: int
    blocks: tuple[int, ...]     # the tensors, in stacking order
    as_rows: bool               # all 2-D (rows, width): stacked as they are, else flattened
    size: int                   # elements of the matrix
    rows: slice                 # the matrix's rows in the row results
    runs: tuple[_Run, ...]
    samples: tuple[int, ...]    # the matrix's rows that hold sample values


class _Plan:
    """Where each tensor of a layout goes: its width's matrix, rows, columns, samples, and
    where its views come from (`views`: (name, source, index); source "mean" / "std" /
    "abs_max" per-row views, "col" the (3, columns) column views)."""

    def __init__(self, layout: Layout, max_samples: int, max_neurons: int, max_items: int,
                 max_values: int):
        n_rows = [(s[bd] if bd is not None else s[0] if s else 1) for s, bd in layout]
        n_width = [math.prod(s) // r for (s, _), r in zip(layout, n_rows)]
        batched = [bd is not None for _, bd in layout]
        # one matrix per row width: its non-batched tensors, then its batched ones by batch size
        by_width: dict[int, list[int]] = {}
        for i in sorted(range(len(layout)), key=lambda i: (batched[i], n_rows[i])):
            by_width.setdefault(n_width[i], []).append(i)
        row0 = [0] * len(layout)        # first row of each tensor in the row results
        col0: dict[int, int] = {}       # batched tensor -> first column in the column results
        sample_of: dict[int, tuple[int, int]] = {}  # batched tensor -> (width, first row)
        col_batch: list[np.ndarray] = []
        self.widths: list[_Width] = []
        self.direct = [False] * len(layout)
        done = n_cols = 0
        for width, idx in by_width.items():
            local = np.cumsum([0] + [n_rows[i] for i in idx]).tolist()
            runs = []
            for batch, group in _runs([(j, n_rows[i]) for j, i in enumerate(idx) if batched[i]]):
                runs.append(_Run(batch, slice(local[group[0]], local[group[-1] + 1]),
                                 slice(n_cols, n_cols + len(group) * width)))
                col_batch.append(np.full(len(group) * width, float(batch)))
                for k in group:
                    col0[idx[k]] = n_cols
                    n_cols += width
            samples: list[int] = []
            for j, i in enumerate(idx):
                row0[i] = done + local[j]
                if batched[i] and max_samples > 0:
                    sample_of[i] = (len(self.widths), len(samples))
                    samples += range(local[j], local[j] + min(n_rows[i], max_samples))
            as_rows = all(len(layout[i][0]) == 2 and not layout[i][1] for i in idx)
            for i in idx:  # taken as they are (no reshape op): 2-D ones as rows, 1-D flat
                self.direct[i] = len(layout[i][0]) == (2 if as_rows else 1) and not layout[i][1]
            self.widths.append(_Width(width, tuple(idx), as_rows, local[-1] * width,
                                      slice(done, done + local[-1]), tuple(runs),
                                      tuple(samples)))
            done += local[-1]
        self.n_rows, self.n_cols = done, n_cols
        self.largest = max(w.size for w in self.widths)
        self.sampled = [k for k, w in enumerate(self.widths) if w.samples]
        self.row_len = np.concatenate([np.full(w.rows.stop - w.rows.start, float(w.width))
                                       for w in self.widths])
        # per tensor, its rows combined: tensors in row order, the first row of each
        order = sorted(range(len(layout)), key=row0.__getitem__)
        self.inverse = np.argsort(order)    # tensor -> its place in row order
        self.starts = np.array([row0[i] for i in order])
        self.count = np.diff(np.append(self.starts, done))
        self.numel = np.add.reduceat(self.row_len, self.starts)
        # per batched tensor, its columns (to find the non-finite ones)
        self.col_members = sorted(col0, key=col0.__getitem__)
        self.col_starts = np.array([col0[i] for i in self.col_members], dtype=np.intp)
        self.col_batch = np.concatenate(col_batch) if col_batch else np.empty(0)
        self.views: list[tuple[tuple[str, str, object], ...]] = []
        self.samples: list[tuple[int, slice, tuple[int, ...]] | None] = []
        stats = ("mean", "std", "abs_max")
        for i, (shape, bd) in enumerate(layout):
            r0, rows = row0[i], n_rows[i]
            views: list[tuple[str, str, object]] = []
            if shape and bd is None:
                views = [(f"neuron_{s}", s, slice(r0, r0 + min(rows, max_neurons)))
                         for s in stats]
            elif shape:
                c = slice(col0[i], col0[i] + min(n_width[i], max_neurons))
                views = [(f"neuron_{s}", "col", (q, c)) for q, s in enumerate(stats)]
                views += [(f"sample_{s}", s, slice(r0, r0 + min(rows, max_items)))
                          for s in stats]
            self.views.append(tuple(views))
            sample = None
            if i in sample_of:
                w, s0 = sample_of[i]
                k = min(rows, max_samples)
                sample = (w, slice(s0, s0 + k), (k, max_values) if n_width[i] > max_values
                          else (k, *_item_shape(shape, bd)))
            self.samples.append(sample)
        self._index: dict[torch.device | None, list[torch.Tensor | np.ndarray | None]] = {}

    def sample_index(self, width: int, device: torch.device | None
                     ) -> torch.Tensor | np.ndarray | None:
        """The sample rows of a width's matrix (None: it has none), as a tensor on `device`,
        or for NumPy (None); made once per device (no host-to-device copy per step)."""
        if device not in self._index:
            self._index[device] = [
                None if not w.samples else np.array(w.samples) if device is None else
                torch.tensor(w.samples, device=device) for w in self.widths]
        return self._index[device][width]


@functools.lru_cache(maxsize=16)
def _plan(layout: Layout, max_samples: int, max_neurons: int, max_items: int,
          max_values: int) -> _Plan:
    return _Plan(layout, max_samples, max_neurons, max_items, max_values)


class _WidthWork(NamedTuple):
    """One width's views into the work buffers (see `_Work`)."""

    cat: torch.Tensor           # the matrix, flat: the stacking target
    m: torch.Tensor             # (rows, width) the matrix
    centred: torch.Tensor       # (rows, width) squared deviations from each row's mean
    absolute: torch.Tensor      # (rows, width) |m|, then its signs
    planes: torch.Tensor        # (2, rows, width) centred and absolute
    row_sum: torch.Tensor       # (rows, 1) and the rest: its rows of the row results
    row_mean: torch.Tensor      # (rows, 1)
    row_sums: torch.Tensor      # (2, rows) centred sum of squares, sum of |x|
    row_nonzero: torch.Tensor
    row_min: torch.Tensor
    row_max: torch.Tensor
    # per run: its matrix (tensors, batch, width), squared deviations, |m|, and column
    # sums (tensors, 1, width), means, centred sums of squares, abs maxima
    runs: tuple[tuple[torch.Tensor, ...], ...]
    index: torch.Tensor | np.ndarray | None   # its sample rows
    host: np.ndarray | None     # the matrix, for NumPy (on the host)


class _Work:
    """A plan's work buffers and every view into them, on one device and dtype, for one
    thread: made once per layout, so that a step costs little more than its arithmetic."""

    def __init__(self, plan: _Plan, dtype: torch.dtype, device: torch.device, on_host: bool,
                 old: _Work | None):
        def buffer(size: int, previous: torch.Tensor | None) -> torch.Tensor:
            if previous is not None and previous.numel() >= size:
                return previous  # reused: it stays in cache, no page faults
            return torch.empty(size, dtype=dtype, device=device)

        self.plan = plan
        self.buffers = [buffer(size, old.buffers[k] if old else None)
                        for k, size in enumerate((3 * plan.largest, 6 * plan.n_rows,
                                                  3 * plan.n_cols))]
        # per row: sum, centred sum of squares, sum of |x|, nonzero count, min, max; per
        # column of batched tensors: sum over the batch, centred sum of squares, abs max
        self.row_out = self.buffers[1][:6 * plan.n_rows].view(6, plan.n_rows)
        self.col_out = self.buffers[2][:3 * plan.n_cols].view(3, plan.n_cols)
        self.host = (self.row_out.numpy(), self.col_out.numpy()) if on_host else None
        self.widths = []
        for k, w in enumerate(plan.widths):
            planes = self.buffers[0][:3 * w.size].view(3, -1, w.width)
            m, centred, absolute = planes.unbind()
            r = self.row_out[:, w.rows]
            runs = []
            for run in w.runs:
                shape = ((run.rows.stop - run.rows.start) // run.batch, run.batch, w.width)
                c = self.col_out[:, run.cols].view(3, shape[0], 1, w.width)
                runs.append((m[run.rows].view(shape), centred[run.rows].view(shape),
                             absolute[run.rows].view(shape), c[0], torch.empty_like(c[0]),
                             c[1], c[2]))
            index = plan.sample_index(k, None if on_host else device)
            self.widths.append(_WidthWork(
                m.view(-1), m, centred, absolute, planes[1:], r[0].unsqueeze(1),
                torch.empty((m.shape[0], 1), dtype=dtype, device=device), r[1:3], r[3],
                r[4], r[5], tuple(runs), index, m.numpy() if on_host else None))


_local = threading.local()
WORKS = 4


def _work(plan: _Plan, dtype: torch.dtype, device: torch.device) -> _Work:
    """This thread's `_Work` of `plan` on the host, kept for the last WORKS layouts (the
    writer's groups of 1, 2, 3 steps alternate) and made with the buffers of the last one if
    large enough (a fresh large allocation page-faults on every use); elsewhere a fresh one
    (the caching allocator reuses memory there, and the training may need it back)."""
    if device.type not in _HOST:
        return _Work(plan, dtype, device, False, None)
    works = _local.__dict__.setdefault("works", {}).setdefault((device, dtype), {})
    work = works.pop(plan, None)
    if work is None:
        work = _Work(plan, dtype, device, True, next(reversed(works.values()), None))
        if len(works) >= WORKS:
            del works[next(iter(works))]
    works[plan] = work  # the most recent last
    return work


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
    plan = _plan(tuple((x.shape, bd) for x, bd in tensors), max_samples, max_neurons,
                 max_items, max_values)  # a torch.Size hashes and compares as its tuple
    work = _work(plan, dtype, device)
    inputs = [x if direct else x.reshape(-1) if not bd else x.movedim(bd, 0).reshape(-1)
              for (x, bd), direct in zip(tensors, plan.direct)]
    samples: list[torch.Tensor | np.ndarray] = []   # of the widths with samples
    long_rows: list[slice] = []
    long_nz: list[torch.Tensor] = []
    for w, v in zip(plan.widths, work.widths):
        torch.cat([inputs[i] for i in w.blocks], out=v.m if w.as_rows else v.cat)
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
        if v.host is not None and v.index is not None:
            samples.append(v.host[v.index, :max_values])  # a copy
        elif v.index is not None:
            samples.append(v.m.index_select(0, v.index)[:, :max_values])
    if work.host is not None:
        host = [*work.host, *samples, *(t.numpy() for t in long_nz)]
    else:
        host = _to_host([work.row_out, work.col_out, *samples, *long_nz])
    return _combine(plan, host, long_rows)


def _combine(plan: _Plan, host: list[np.ndarray], long_rows: list[slice]) -> list[Summary | None]:
    """The summaries from the row and column results on the host: [rows (6, rows), columns
    (3, columns), samples per width that has them, nonzero counts of the long rows]."""
    rows = host[0].astype(np.float64)
    for r, counts in zip(long_rows, host[len(host) - len(long_rows):]):
        rows[3, r] = counts
    r_sum, r_sq, r_abs, _, r_mn, r_mx = rows
    r_len = plan.row_len
    r_mean = r_sum / r_len
    starts, n = plan.starts, plan.numel
    total, within, abs_total, nonzero = np.add.reduceat(rows[:4], starts, axis=1)
    mean = total / n
    spread, square = np.add.reduceat(
        [r_len * (r_mean - np.repeat(mean, plan.count)) ** 2, r_len * r_mean * r_mean],
        starts, axis=1)
    lo, hi = np.minimum.reduceat(r_mn, starts), np.maximum.reduceat(r_mx, starts)
    table = np.zeros((len(n), len(STAT_COLUMNS)))  # nan, posinf, neginf: 0
    for column, value in (("numel", n), ("mean", mean),
                          ("std", np.sqrt(np.maximum((within + spread) / n, 0.0))),
                          ("abs_mean", abs_total / n), ("min", lo), ("max", hi),
                          ("abs_max", np.maximum(-lo, hi)), ("norm", np.sqrt(within + square)),
                          ("zero_frac", (n - nonzero) / n), ("sv_max", np.nan)):
        table[:, _COL[column]] = value
    table = table[plan.inverse]
    # sums of float32-range values cannot overflow float64: non-finite sums, non-finite rows
    finite = np.isfinite(total + within + abs_total)[plan.inverse]
    source = {"mean": r_mean.astype(np.float32),
              "std": np.sqrt(r_sq / r_len).astype(np.float32),
              "abs_max": np.maximum(-r_mn, r_mx).astype(np.float32)}
    if plan.n_cols:
        c_sum, c_sq, c_abs = host[1].astype(np.float64)
        # in float64, rounded once to float32 (as the per-row views)
        cols = np.stack([c_sum / plan.col_batch, np.sqrt(c_sq / plan.col_batch), c_abs])
        source["col"] = cols = cols.astype(np.float32)
        # a column's squares can overflow alone
        finite[plan.col_members] &= np.logical_and.reduceat(np.isfinite(cols).all(0),
                                                            plan.col_starts)
    by_width = {k: s.astype(np.float32, copy=False)  # a copy already: float32 now
                for k, s in zip(plan.sampled, host[2:2 + len(plan.sampled)])}
    out: list[Summary | None] = []
    for i, (views, sample) in enumerate(zip(plan.views, plan.samples)):
        if not finite[i]:
            out.append(None)
            continue
        got = {name: source[src][index] for name, src, index in views}  # type: ignore[index]
        if sample is not None:
            w, rows_, shape = sample
            got["samples"] = by_width[w][rows_].reshape(shape)
        out.append((table[i], got))
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


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors as host NumPy arrays, in one transfer (through float64: exact for float32
    and float64 values)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float64).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].reshape(tuple(t.shape)))
        at += t.numel()
    return out
