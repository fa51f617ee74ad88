"""Fast summaries on the CPU: many finite float tensors in a few large ops.

The general path (`stats.tensor_stats` + `stats.array_views`) costs ~30 ops per tensor; at
every-step recording rates the fixed cost per op dominates. Here a step's batched tensors sit
side by side in one (B, neurons) matrix and same-shaped parameters are stacked; statistics are
combined from per-neuron sums on the host in NumPy. Same definitions as the general path;
tests compare the two.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..scratch import scratch
from ..store.schema import STAT_COLUMNS
from .stats import DEFAULT_MAX_ITEMS, DEFAULT_MAX_NEURONS, DEFAULT_MAX_VALUES


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
         torch.stack(rows, out=scratch((g, k, per), rows[0].dtype, "stack")))
    n_sum = m.sum(2)
    if not math.isfinite(float(n_sum.sum())):  # a NaN or Inf anywhere reaches the total
        return None
    centred = torch.sub(m, (n_sum / per).unsqueeze(2),
                        out=scratch(tuple(m.shape), m.dtype, "centred"))
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
    m = torch.cat(blocks, 1, out=scratch((batch, total), dtype, "stack"))
    n_sum = m.sum(0)
    if not math.isfinite(float(n_sum.sum())):  # a NaN or Inf anywhere reaches the total
        return None
    centred = scratch((batch, total), dtype, "centred")
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
