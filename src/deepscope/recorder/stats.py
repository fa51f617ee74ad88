"""Per-tensor statistics, computed on the tensor's own device without a host sync.

Every statistic ignores non-finite elements and the NaN/+Inf/-Inf counts are kept beside it, so
one NaN never hides the rest of a tensor. Results stay on the device; the step recorder stacks
them and the writer copies them to the host once per step.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..store import arrays
from ..store.schema import STAT_COLUMNS
from ..store.writer import StepSummary

DEFAULT_MAX_NEURONS = 4096   # per-neuron views keep the first this-many neurons
DEFAULT_MAX_ITEMS = 4096     # per-sample statistics keep the first this-many batch items
DEFAULT_MAX_VALUES = 65536   # full values of one stored sample are cut to this many elements
# Tensors up to this many elements are summarised together in one batch of segmented
# reductions: for them the fixed cost of ~20 separate small ops dominates.
BATCHED_NUMEL = 4096


def tensor_stats(x: torch.Tensor, singular_value: bool = False) -> torch.Tensor:
    """Return a float64 vector of `STAT_COLUMNS` for `x`, on x's device.

    mean/std/min/max/abs_* /norm are over the finite elements (std is population, ddof=0);
    zero_frac is over all elements; sv_max is NaN unless `singular_value` and x is 2-D.
    """
    flat = x.detach().reshape(-1)
    x64 = flat.to(torch.float64)
    n = x64.numel()
    total = x64.sum()
    # On the CPU a branch costs nothing, so the common all-finite case takes a lean path; on an
    # accelerator the masked path avoids a host sync per tensor.
    if n and x64.device.type == "cpu" and bool(torch.isfinite(total)):
        values = _finite_stats(flat, x64, total)
    else:
        values = _masked_stats(x64)
    values["numel"] = torch.tensor(float(n), dtype=torch.float64, device=x.device)
    values["zero_frac"] = (n - torch.count_nonzero(flat)).to(torch.float64) / max(n, 1)
    values["sv_max"] = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    if singular_value and x.dim() == 2 and n:
        w = torch.nan_to_num(x64.reshape(x.shape), nan=0.0, posinf=0.0, neginf=0.0)
        values["sv_max"] = torch.linalg.matrix_norm(w, ord=2)
    return torch.stack([values[c].to(torch.float64) for c in STAT_COLUMNS])


def _finite_stats(flat: torch.Tensor, x64: torch.Tensor,
                  total: torch.Tensor) -> dict[str, torch.Tensor]:
    """Statistics of a 1-D tensor known to hold only finite values (`x64` its float64 copy).

    The cheapest reductions on the CPU (sum, dot, aminmax); Welford-style var_mean, the
    inf-norm and float64-accumulating norms of float32 input are several times slower. The
    variance E[x²] − E[x]² in float64 loses precision only when |mean| / std exceeds ~1e6.
    """
    n = x64.numel()
    mean = total / n
    sq = torch.dot(x64, x64)
    mn, mx = torch.aminmax(flat)
    zero = torch.zeros((), dtype=torch.int64, device=flat.device)
    return {"mean": mean, "std": (sq / n - mean * mean).clamp_min(0.0).sqrt(),
            "abs_mean": x64.abs().sum() / n, "min": mn, "max": mx,
            "abs_max": torch.maximum(-mn, mx), "norm": sq.sqrt(),
            "nan": zero, "posinf": zero, "neginf": zero}


def _masked_stats(x64: torch.Tensor) -> dict[str, torch.Tensor]:
    """Statistics over the finite elements of a 1-D float64 tensor, with non-finite counts."""
    finite = torch.isfinite(x64)
    count = finite.sum()
    z = torch.where(finite, x64, 0.0)
    mean = z.sum() / count
    std = (torch.where(finite, x64 - mean, 0.0).square().sum() / count).sqrt()
    absz = z.abs()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=x64.device)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x64.device)
    if x64.numel():
        mn = torch.where(finite, x64, inf).min()
        mx = torch.where(finite, x64, -inf).max()
        abs_max = absz.max()
    else:
        mn = mx = abs_max = nan
    # min/max of a tensor with no finite element are undefined, not +-inf.
    return {"mean": mean, "std": std, "abs_mean": absz.sum() / count,
            "min": torch.where(count > 0, mn, nan), "max": torch.where(count > 0, mx, nan),
            "abs_max": torch.where(count > 0, abs_max, nan), "norm": z.square().sum().sqrt(),
            "nan": torch.isnan(x64).sum(), "posinf": (x64 == float("inf")).sum(),
            "neginf": (x64 == float("-inf")).sum()}


def _segment_stats(data: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`tensor_stats` of consecutive segments of a 1-D float64 tensor: (S, len(STAT_COLUMNS)).

    sv_max is NaN. Segmented reductions: a few passes over all elements instead of ~20 ops
    per segment.
    """
    finite = torch.isfinite(data)
    z = torch.where(finite, data, 0.0)
    inf = float("inf")
    numel = lengths.to(torch.float64)

    # NumPy's reduceat is ~5x faster than torch.segment_reduce on the CPU; it needs every
    # segment non-empty.
    host = data.device.type == "cpu" and bool((lengths > 0).all())
    starts = (torch.cumsum(lengths, 0) - lengths).numpy() if host else None

    def seg(values: torch.Tensor, how: str = "sum") -> torch.Tensor:
        if host:
            ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[how]
            return torch.from_numpy(ufunc.reduceat(values.numpy(), starts))
        # `initial` takes part in every segment's reduction: the neutral element of each
        start = {"sum": 0.0, "min": inf, "max": -inf}[how]
        return torch.segment_reduce(values, how, lengths=lengths, unsafe=True, initial=start)

    count = seg(finite.to(torch.float64))
    s1, s2 = seg(z), seg(z * z)
    nan = torch.full_like(count, float("nan"))
    has = count > 0
    mn = torch.where(has, seg(torch.where(finite, data, inf), "min"), nan)
    mx = torch.where(has, seg(torch.where(finite, data, -inf), "max"), nan)
    mean = s1 / count
    values = {
        "numel": numel, "mean": mean, "std": (s2 / count - mean * mean).clamp_min(0.0).sqrt(),
        "abs_mean": seg(z.abs()) / count, "min": mn, "max": mx,
        "abs_max": torch.maximum(-mn, mx), "norm": s2.sqrt(),
        "zero_frac": seg((data == 0).to(torch.float64)) / numel.clamp_min(1.0),
        "nan": seg(torch.isnan(data).to(torch.float64)),
        "posinf": seg((data == inf).to(torch.float64)),
        "neginf": seg((data == -inf).to(torch.float64)), "sv_max": nan,
    }
    return torch.stack([values[c] for c in STAT_COLUMNS], dim=1)


def batched_stats(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensor_stats` of many (small) tensors on one device at once: (K, len(STAT_COLUMNS))."""
    flats = [t.detach().reshape(-1).to(torch.float64) for t in tensors]
    lengths = torch.tensor([f.numel() for f in flats], device=flats[0].device)
    return _segment_stats(torch.cat(flats), lengths)


_COL = {c: i for i, c in enumerate(STAT_COLUMNS)}


def small_summaries(tensors: list[tuple[torch.Tensor, int | None]], max_samples: int,
                    max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                    max_values: int = DEFAULT_MAX_VALUES
                    ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """`tensor_stats` and `array_views` of many small tensors on one device, all at once.

    Every neuron and batch item is a segment of one concatenation, so the cost is a few
    segmented reductions instead of ~30 ops per tensor. (tensor, batch_dim) pairs in,
    (stats row, views) pairs out, in order.
    """
    pieces: list[torch.Tensor] = []
    lengths: list[np.ndarray] = []
    layout: list[list[tuple[str, int]]] = []
    for x, batch_dim in tensors:
        x64 = x.detach().to(torch.float64)
        pieces.append(x64.reshape(-1))
        lengths.append(np.array([x64.numel()]))
        groups: list[tuple[str, torch.Tensor]] = []
        if x64.dim() and x64.numel():  # a 0-d or empty tensor has no array views
            if batch_dim is None:
                groups = [("neuron", x64.reshape(x64.shape[0], -1)[:max_neurons])]
            else:
                m = x64.movedim(batch_dim, 0)
                m = m.reshape(m.shape[0], -1)
                groups = [("neuron", m[:, :max_neurons].t()), ("sample", m[:max_items])]
        for _, rows in groups:
            pieces.append(rows.reshape(-1))
            lengths.append(np.full(rows.shape[0], rows.shape[1]))
        layout.append([(prefix, rows.shape[0]) for prefix, rows in groups])
    device = pieces[0].device
    table = _segment_stats(torch.cat(pieces),
                           torch.from_numpy(np.concatenate(lengths)).to(device))
    per_view = {stat: table[:, _COL[stat]].float() for stat in ("mean", "std", "abs_max")}
    out = []
    at = 0
    for (x, batch_dim), groups in zip(tensors, layout):
        row, at = table[at], at + 1
        views: dict[str, torch.Tensor] = {}
        for prefix, count in groups:
            for stat, column in per_view.items():
                views[f"{prefix}_{stat}"] = column[at:at + count]
            at += count
        if batch_dim is not None and groups and max_samples > 0:
            views["samples"] = _samples(x.detach(), batch_dim, max_samples, max_values)
        out.append((row, views))
    return out


def _samples(x: torch.Tensor, batch_dim: int, max_samples: int,
             max_values: int) -> torch.Tensor:
    """Full values of the first `max_samples` batch items, float32, each cut to `max_values`
    elements (flattened) if larger; a new tensor."""
    xb = x.movedim(batch_dim, 0)[:max_samples]
    if xb[0].numel() > max_values:
        xb = xb.reshape(xb.shape[0], -1)[:, :max_values]
    return xb.to(torch.float32, copy=True)


def _rows(rows: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
    """mean / std / abs_max over `dim` of a 2-D float tensor, ignoring non-finite elements."""
    if rows.device.type == "cpu" and bool(torch.isfinite(rows.sum())):
        r64 = rows.to(torch.float64)
        mean = r64.mean(dim)
        sq = (r64 * r64).mean(dim)
        # abs().amax is ~10x faster than aminmax along a dim on the CPU
        return {"mean": mean.float(), "std": (sq - mean * mean).clamp_min(0.0).sqrt().float(),
                "abs_max": rows.abs().amax(dim)}
    finite = torch.isfinite(rows)
    count = finite.sum(dim)
    z = torch.where(finite, rows, 0.0)
    mean = z.sum(dim) / count  # 0 / 0 = NaN: a neuron with no finite value is not shown as 0
    centred = torch.where(finite, rows - mean.unsqueeze(dim), 0.0)
    std = (centred.square().sum(dim) / count).sqrt()
    abs_max = torch.where(count > 0, z.abs().amax(dim), float("nan"))
    return {"mean": mean, "std": std, "abs_max": abs_max}


def array_views(x: torch.Tensor, batch_dim: int | None, max_samples: int,
                max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                max_values: int = DEFAULT_MAX_VALUES) -> dict[str, torch.Tensor]:
    """Array views of one tensor record, float32 on x's device.

    With a batch dimension (size B, the rest flattened to N "neurons"):
      neuron_mean / neuron_std / neuron_abs_max: (min(N, max_neurons),) over the batch;
      sample_mean / sample_std / sample_abs_max: (min(B, max_items),) over the neurons;
      samples: (min(B, max_samples), *rest) full values (flattened and cut to max_values
      elements per sample if larger).
    Without one (parameters): neuron = index along dim 0, statistics over the other dims;
    a 0-d tensor has no array views.
    """
    x = x.detach()
    if x.dim() == 0 or x.numel() == 0:  # no values, no views (and reshape(0, -1) fails)
        return {}
    xf = x.to(torch.float32)
    views: dict[str, torch.Tensor] = {}
    if batch_dim is None:
        rows = xf.reshape(x.shape[0], -1)[:max_neurons]
        for stat, v in _rows(rows, 1).items():
            views[f"neuron_{stat}"] = v
        return views
    xb = xf.movedim(batch_dim, 0)
    flat = xb.reshape(xb.shape[0], -1)
    for stat, v in _rows(flat[:, :max_neurons], 0).items():
        views[f"neuron_{stat}"] = v
    for stat, v in _rows(flat[:max_items], 1).items():
        views[f"sample_{stat}"] = v
    if max_samples > 0:
        views["samples"] = _samples(x, batch_dim, max_samples, max_values)
    return views


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, slot: str) -> torch.Tensor:
    """A reused CPU buffer of this thread: a fresh large allocation page-faults on every step
    (~0.4 ms per 800 kB), a reused one does not. One buffer per `slot`, grown as needed."""
    numel = math.prod(shape)
    buf = getattr(_local, slot, None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_local, slot, buf)
    return buf[:numel].view(shape)


_local = threading.local()


def _centred_square_sum(m: torch.Tensor, total: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ (x − mean)² of 3-D `m` along `dim`, given the sums `total` along it.

    Centred on the mean first: no E[x²] − E[x]² cancellation. Sums accumulate in m's dtype:
    float64 accumulation costs 3–6× on the CPU, and float32 sums of a few thousand values
    keep ~7 significant digits.
    """
    centred = torch.sub(m, (total / m.shape[dim]).unsqueeze(dim),
                        out=_scratch(tuple(m.shape), m.dtype, "centred"))
    return centred.square_().sum(dim)


def fast_eligible(x: torch.Tensor, batch_dim: int | None) -> bool:
    """Whether `fast_summaries` can take `x`: a float32/64 CPU tensor with neurons."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.numel() > 0 and x.dim() >= (1 if batch_dim is not None else 2))


def fast_summaries(tensors: list[torch.Tensor], batch_dim: int | None, max_samples: int,
                   max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                   max_values: int = DEFAULT_MAX_VALUES
                   ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]] | None:
    """`tensor_stats` and `array_views` of same-shaped finite `fast_eligible` tensors at once.

    The tensors are stacked, so the number of ops does not grow with their number; about
    a third of the passes over the data of the general path and no float64 copy: the totals
    come from per-neuron moments (law of total variance), combined on the host in NumPy.
    The tensors must be private copies: they may be overwritten. None when the general path
    is needed (a non-finite value).
    """
    if batch_dim is None:   # neuron = index along dim 0
        ms = [x.reshape(x.shape[0], -1) for x in tensors]
        nd = 2
    else:                   # neuron = everything but the batch dimension
        ms = [x.movedim(batch_dim, 0) for x in tensors]
        ms = [x.reshape(x.shape[0], -1) for x in ms]
        nd = 1
    if len(ms) == 1:
        m = ms[0].unsqueeze(0)  # (G, rows, columns)
    else:
        m = torch.stack(ms, out=_scratch((len(ms), *ms[0].shape), ms[0].dtype, "stack"))
    g, per, n = m.shape[0], m.shape[nd], m.shape[1] * m.shape[2]
    n_sum = m.sum(nd)
    if not math.isfinite(float(n_sum.sum())):  # a NaN or Inf anywhere reaches the total
        return None
    n_sq = _centred_square_sum(m, n_sum, nd)
    device: dict[str, torch.Tensor] = {"n_sum": n_sum, "n_sq": n_sq}
    slab = None
    if batch_dim is not None:
        items = m[:, :max_items]
        device["s_sum"] = items.sum(2)
        device["s_sq"] = _centred_square_sum(items, device["s_sum"], 2)
        if max_samples > 0:  # before `m` is overwritten below
            slab = m[:, :max_samples, :max_values].to(torch.float32, copy=True)
    device["n_min"], device["n_max"] = m.amin(nd), m.amax(nd)
    absm = m.abs_()
    device["abs_sum"] = absm.sum((1, 2), keepdim=True).reshape(g, 1)
    if batch_dim is not None:
        device["s_abs_max"] = absm[:, :max_items].amax(2)
    # a float32 count of ones is exact below 2**24
    device["nonzero"] = absm.sign_().sum((1, 2), dtype=torch.float64 if n >= 2**24 else None,
                                         keepdim=True).reshape(g, 1)
    # One conversion to float64 on the host, then NumPy views: a torch op per small
    # result would cost more than the arithmetic.
    flat = torch.cat([t.reshape(g, -1).to(torch.float64) for t in device.values()], 1).numpy()
    h, at = {}, 0
    for key, t in device.items():
        h[key] = flat[:, at:at + t.shape[1]]
        at += t.shape[1]
    n_mean, n_var = h["n_sum"] / per, h["n_sq"] / per
    mean = h["n_sum"].sum(1) / n
    within = n_var.sum(1)
    mn, mx = h["n_min"].min(1), h["n_max"].max(1)
    columns = {"numel": np.full(g, float(n)), "mean": mean,
               "std": np.sqrt(np.maximum((within + ((n_mean - mean[:, None]) ** 2).sum(1))
                                         * per / n, 0.0)),
               "abs_mean": h["abs_sum"][:, 0] / n, "min": mn, "max": mx,
               "abs_max": np.maximum(-mn, mx),
               "norm": np.sqrt((within + (n_mean ** 2).sum(1)) * per),
               "zero_frac": (n - h["nonzero"][:, 0]) / n, "nan": np.zeros(g),
               "posinf": np.zeros(g), "neginf": np.zeros(g), "sv_max": np.full(g, np.nan)}
    table = torch.from_numpy(np.stack([columns[c] for c in STAT_COLUMNS], axis=1))
    views = {"neuron_mean": n_mean[:, :max_neurons], "neuron_std": np.sqrt(n_var[:, :max_neurons]),
             "neuron_abs_max": np.maximum(-h["n_min"], h["n_max"])[:, :max_neurons]}
    if batch_dim is not None:
        items_n = m.shape[2]
        views.update(sample_mean=h["s_sum"] / items_n, sample_std=np.sqrt(h["s_sq"] / items_n),
                     sample_abs_max=h["s_abs_max"])
    views32 = {k: torch.from_numpy(v.astype(np.float32)) for k, v in views.items()}
    out = []
    for i, x in enumerate(tensors):
        vs = {k: v[i] for k, v in views32.items()}
        if slab is not None:
            rest = x.movedim(batch_dim, 0).shape[1:]
            vs["samples"] = slab[i] if m.shape[2] > max_values else slab[i].view(-1, *rest)
        out.append((table[i], vs))
    return out


class Capture(NamedTuple):
    """A private copy of one tensor record, summarised later on the writer thread."""

    name: str
    direction: str
    iteration: int
    tensor: torch.Tensor
    batch_dim: int | None
    is_parameter: bool


def summarise_captures(captures: list[Capture], max_samples: int, max_neurons: int,
                       singular_values: bool, exact_views: bool,
                       release: Callable[[list[torch.Tensor]], None] | None = None
                       ) -> StepSummary:
    """Statistics and array views of a step's captures, copied to the host in one transfer each.

    Aggregated views (neuron_*, sample_*)
    are bfloat16 (3 significant digits, float32 range: enough to draw, half the bytes) unless
    `exact_views`; full sample values stay float32; the statistics are float64 (of a float32
    tensor: accurate to ~1e-7 of its scale, as its own values are). Captures that
    share a tensor (one tensor under two names) are summarised and stored once. The tensors
    are overwritten, then handed to `release`; nothing returned shares their memory.
    """
    all_keys = [(c.name, c.direction, c.iteration) for c in captures]
    first: dict[int, int] = {}  # id(tensor) -> index of its first capture
    for i, c in enumerate(captures):
        first.setdefault(id(c.tensor), i)
    summary = _summarise_unique([captures[i] for i in first.values()], max_samples,
                                max_neurons, singular_values, exact_views)
    if release is not None:
        release([captures[i].tensor for i in first.values()])
    if len(first) == len(captures):
        return summary
    row_of = {id(captures[i].tensor): r for r, i in enumerate(first.values())}
    by_key = {}
    for entry in summary.arrays:
        by_key.setdefault(entry[:2] + entry[3:4], []).append(entry)
    entries = []
    for c in captures:
        source = captures[first[id(c.tensor)]]
        for entry in by_key.get((source.name, source.direction, source.iteration), []):
            entries.append((c.name, c.direction, entry[2], c.iteration, *entry[4:]))
    rows = [row_of[id(c.tensor)] for c in captures]
    return StepSummary(all_keys, summary.stats[rows], entries, summary.parts)


def _summarise_unique(captures: list[Capture], max_samples: int, max_neurons: int,
                      singular_values: bool, exact_views: bool) -> StepSummary:
    """`summarise_captures` of captures that share no tensor."""
    keys = [(c.name, c.direction, c.iteration) for c in captures]
    done: list[tuple[torch.Tensor, dict[str, torch.Tensor]] | None] = [None] * len(captures)
    small: dict[torch.device, list[int]] = {}
    same: dict[tuple, list[int]] = {}
    for i, c in enumerate(captures):
        x = c.tensor
        if singular_values and c.is_parameter and x.dim() == 2:
            done[i] = (tensor_stats(x, True), array_views(x, None, max_samples, max_neurons))
        elif x.numel() <= BATCHED_NUMEL:
            small.setdefault(x.device, []).append(i)
        elif fast_eligible(x, c.batch_dim):
            same.setdefault((tuple(x.shape), x.dtype, c.batch_dim), []).append(i)
    for idx in small.values():
        pairs = [(captures[i].tensor, captures[i].batch_dim) for i in idx]
        for i, result in zip(idx, small_summaries(pairs, max_samples, max_neurons)):
            done[i] = result
    for (_, _, batch_dim), idx in same.items():
        results = fast_summaries([captures[i].tensor for i in idx], batch_dim, max_samples,
                                 max_neurons)
        for i, result in zip(idx, results or []):
            done[i] = result
    for i, c in enumerate(captures):
        if done[i] is None:  # the general path: another device or dtype, non-finite values
            done[i] = (tensor_stats(c.tensor),
                       array_views(c.tensor, c.batch_dim, max_samples, max_neurons))
    host_stats = torch.empty(len(captures), len(STAT_COLUMNS), dtype=torch.float64)
    for idx in _by_device([row for row, _ in done]):  # type: ignore[misc]
        host_stats[idx] = torch.stack([done[i][0] for i in idx]).cpu()  # type: ignore[index]
    pending = [(c.name, c.direction, view, c.iteration, arr)
               for c, (_, vs) in zip(captures, done) for view, arr in vs.items()]
    entries, parts = [], []
    # One part per kind of array — full sample values (float32), aggregated views (bfloat16
    # unless exact) — and device: one transfer each, converted in one go.
    for exact in (True, False):
        part = [p for p in pending if (p[2] == "samples") == exact]
        for idx in _by_device([p[4] for p in part]):
            flat = torch.cat([part[i][4].reshape(-1) for i in idx])
            if not (exact or exact_views):
                flat = flat.to(torch.bfloat16)
            dtype, _, data = arrays.encode(flat)
            itemsize, offset = flat.element_size(), 0
            for i in idx:
                name, direction, view, it, arr = part[i]
                nbytes = arr.numel() * itemsize
                entries.append((name, direction, view, it, dtype, _shape_text(arr.shape),
                                len(parts), offset, nbytes))
                offset += nbytes
            parts.append(data)
    return StepSummary(keys, host_stats.numpy(), entries, parts)


@functools.lru_cache(maxsize=1024)
def _shape_text(shape: tuple[int, ...]) -> str:
    return json.dumps(list(shape))


def _by_device(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by device, in order."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return list(groups.values())
