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


def fast_eligible(x: torch.Tensor, batch_dim: int | None) -> bool:
    """Whether the fast paths can take `x`: a float32/64 CPU tensor with neurons."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.numel() > 0 and x.dim() >= (1 if batch_dim is not None else 2))


Summaries = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]


def fast_parameters(tensors: list[torch.Tensor], max_neurons: int = DEFAULT_MAX_NEURONS
                    ) -> Summaries | None:
    """`tensor_stats` and `array_views` of same-shaped finite `fast_eligible` tensors without
    a batch dimension (neuron = index along dim 0), stacked: the number of ops does not grow
    with their number. The tensors must be private copies: they may be overwritten. None
    when the general path is needed (a non-finite value)."""
    rows = [x.reshape(x.shape[0], -1) for x in tensors]
    g, k, per = len(rows), rows[0].shape[0], rows[0].shape[1]
    m = (rows[0].unsqueeze(0) if g == 1 else
         torch.stack(rows, out=_scratch((g, k, per), rows[0].dtype, "stack")))
    n_sum = m.sum(2)
    if not math.isfinite(float(n_sum.sum())):  # a NaN or Inf anywhere reaches the total
        return None
    centred = torch.sub(m, (n_sum / per).unsqueeze(2),
                        out=_scratch(tuple(m.shape), m.dtype, "centred"))
    device = {"sum": n_sum, "sq": centred.square_().sum(2), "min": m.amin(2), "max": m.amax(2)}
    absm = m.abs_()
    device["abs"] = absm.sum(2)
    device["nonzero"] = absm.sign_().sum(2)
    h = _to_host({key: t.reshape(-1) for key, t in device.items()})
    table, views = _from_neurons(h, np.arange(g) * k, np.full(g, k), per, max_neurons)
    return [(table[i], {key: v[i] for key, v in views.items()}) for i in range(g)]


def fast_batched(tensors: list[tuple[torch.Tensor, int]], max_samples: int,
                 max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                 max_values: int = DEFAULT_MAX_VALUES) -> Summaries | None:
    """`tensor_stats` and `array_views` of finite `fast_eligible` (tensor, batch_dim) pairs with
    one batch size and dtype, whatever their other dimensions: side by side as the columns
    of one (B, neurons) matrix, so the per-neuron work is ~10 ops for a step's activations
    and their gradients together; per-item views take 4 ops per tensor. The tensors must be
    private copies. None when the general path is needed (a non-finite value)."""
    blocks = [x.movedim(bd, 0) for x, bd in tensors]
    rest = [b.shape[1:] for b in blocks]
    blocks = [b.reshape(b.shape[0], -1) for b in blocks]
    widths = [b.shape[1] for b in blocks]
    batch, total, dtype = blocks[0].shape[0], sum(widths), blocks[0].dtype
    m = torch.cat(blocks, 1, out=_scratch((batch, total), dtype, "stack"))
    n_sum = m.sum(0)
    if not math.isfinite(float(n_sum.sum())):  # a NaN or Inf anywhere reaches the total
        return None
    centred = _scratch((batch, total), dtype, "centred")
    device = {"sum": n_sum,
              "sq": torch.sub(m, n_sum / batch, out=centred).square_().sum(0)}
    starts = np.cumsum([0, *widths[:-1]])
    blocks = [(s, s + w) for s, w in zip(starts.tolist(), widths)]
    items = min(batch, max_items)
    # per item, within each tensor's columns: a few ops per tensor (a column-to-tensor
    # matmul or index is ~10x slower on the CPU for these shapes)
    s_sum = [m[:items, a:b].sum(1) for a, b in blocks]
    s_sq = [torch.sub(m[:items, a:b], (t / (b - a)).unsqueeze(1), out=centred[:items, a:b])
            .square_().sum(1) for (a, b), t in zip(blocks, s_sum)]
    sample = {"sum": torch.stack(s_sum, 1), "sq": torch.stack(s_sq, 1)}
    slab = m[:max_samples].to(torch.float32, copy=True) if max_samples > 0 else None
    device["min"], device["max"] = m.amin(0), m.amax(0)
    absm = m.abs_()
    device["abs"] = absm.sum(0)
    sample["abs_max"] = torch.stack([absm[:items, a:b].amax(1) for a, b in blocks], 1)
    device["nonzero"] = absm.sign_().sum(0)
    h = _to_host(device)
    table, views = _from_neurons(h, starts, np.array(widths), batch, max_neurons)
    hs = _to_host(sample)
    per_item = np.array(widths, dtype=np.float64)
    sample_views = {key: torch.from_numpy(np.ascontiguousarray(v.T, dtype=np.float32))
                    for key, v in (("sample_mean", hs["sum"] / per_item),
                                   ("sample_std", np.sqrt(hs["sq"] / per_item)),
                                   ("sample_abs_max", hs["abs_max"]))}
    out = []
    for i, (a, b) in enumerate(blocks):
        vs = {key: v[i] for key, v in views.items()}
        vs.update({key: v[i] for key, v in sample_views.items()})
        if slab is not None:
            values = slab[:, a:min(b, a + max_values)]
            vs["samples"] = values.reshape(-1, *rest[i]) if b - a <= max_values else values
        out.append((table[i], vs))
    return out


def _to_host(device: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Same-length results as float64 NumPy arrays, in one conversion: a torch op per small
    result would cost more than the arithmetic done with them."""
    shapes = [t.shape for t in device.values()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in device.values()]).numpy()
    out, at = {}, 0
    for key, shape in zip(device, shapes):
        size = math.prod(shape)
        out[key] = flat[at:at + size].reshape(shape)
        at += size
    return out


def _from_neurons(h: dict[str, np.ndarray], starts: np.ndarray, counts: np.ndarray, per: int,
                  max_neurons: int) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Statistics rows (T, len(STAT_COLUMNS)) and neuron views of T tensors, from per-neuron
    sums over `per` values each: sum, sq (Σ (x − neuron mean)²), min, max, abs (Σ|x|),
    nonzero; tensor t owns neurons starts[t] .. starts[t] + counts[t]. The tensor's variance
    is the mean within-neuron variance plus the variance of the neuron means (law of total
    variance): no E[x²] − E[x]² cancellation."""
    def seg(a: np.ndarray, ufunc: np.ufunc = np.add) -> np.ndarray:
        return ufunc.reduceat(a, starts)

    n = counts * per
    n_mean, n_var = h["sum"] / per, h["sq"] / per
    mean = seg(h["sum"]) / n
    within = seg(n_var)
    spread = seg((n_mean - np.repeat(mean, counts)) ** 2)
    mn, mx = seg(h["min"], np.minimum), seg(h["max"], np.maximum)
    t = len(starts)
    columns = {"numel": n.astype(np.float64), "mean": mean,
               "std": np.sqrt(np.maximum((within + spread) * per / n, 0.0)),
               "abs_mean": seg(h["abs"]) / n, "min": mn, "max": mx,
               "abs_max": np.maximum(-mn, mx), "norm": np.sqrt((within + seg(n_mean ** 2)) * per),
               "zero_frac": (n - seg(h["nonzero"])) / n, "nan": np.zeros(t),
               "posinf": np.zeros(t), "neginf": np.zeros(t), "sv_max": np.full(t, np.nan)}
    table = torch.from_numpy(np.stack([columns[c] for c in STAT_COLUMNS], axis=1))
    per_neuron = {"neuron_mean": n_mean, "neuron_std": np.sqrt(n_var),
                  "neuron_abs_max": np.maximum(-h["min"], h["max"])}
    views = {}
    for key, values in per_neuron.items():
        v32 = torch.from_numpy(values.astype(np.float32))
        views[key] = [v32[s:s + min(c, max_neurons)]
                      for s, c in zip(starts.tolist(), counts.tolist())]
    return table, views


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
    params: dict[tuple, list[int]] = {}
    batched: dict[tuple, list[int]] = {}
    for i, c in enumerate(captures):
        x = c.tensor
        if singular_values and c.is_parameter and x.dim() == 2:
            done[i] = (tensor_stats(x, True), array_views(x, None, max_samples, max_neurons))
        elif fast_eligible(x, c.batch_dim) and c.batch_dim is not None:
            batched.setdefault((x.shape[c.batch_dim], x.dtype), []).append(i)
        elif x.numel() <= BATCHED_NUMEL:
            small.setdefault(x.device, []).append(i)
        elif fast_eligible(x, c.batch_dim):
            params.setdefault((tuple(x.shape), x.dtype), []).append(i)
    for idx in small.values():
        pairs = [(captures[i].tensor, captures[i].batch_dim) for i in idx]
        for i, result in zip(idx, small_summaries(pairs, max_samples, max_neurons)):
            done[i] = result
    for idx in params.values():
        for i, result in zip(idx, fast_parameters([captures[i].tensor for i in idx],
                                                  max_neurons) or []):
            done[i] = result
    for idx in batched.values():
        pairs = [(captures[i].tensor, captures[i].batch_dim) for i in idx]
        for i, result in zip(idx, fast_batched(pairs, max_samples, max_neurons) or []):  # type: ignore[arg-type]
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
