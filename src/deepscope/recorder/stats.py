"""Per-tensor statistics, computed on the tensor's own device without a host sync.

Every statistic ignores non-finite elements and the NaN/+Inf/-Inf counts are kept beside it, so
one NaN never hides the rest of a tensor. Results stay on the device; `summary` stacks them
and copies them to the host once per step. This is the general path (any device and dtype,
non-finite values); `fast` is the CPU fast path, tested against it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..store.schema import SAMPLE_MAX_VALUES as DEFAULT_MAX_VALUES
from ..store.schema import STAT_COLUMNS

DEFAULT_MAX_NEURONS = 4096   # per-neuron views keep the first this-many neurons
DEFAULT_MAX_ITEMS = 4096     # per-sample statistics keep the first this-many batch items
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
    # integers and bools through float64: -min of an unsigned or bool tensor wraps or fails
    mn, mx = torch.aminmax(flat if flat.is_floating_point() else x64)
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
             max_values: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Full values of the first `max_samples` batch items, `dtype`, each cut to `max_values`
    elements (flattened) if larger; a new tensor."""
    xb = x.movedim(batch_dim, 0)[:max_samples]
    if xb[0].numel() > max_values:
        xb = xb.reshape(xb.shape[0], -1)[:, :max_values]
    return xb.to(dtype, copy=True)


def _rows(rows: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
    """mean / std / abs_max over `dim` of a 2-D float tensor, ignoring non-finite elements.

    float64 rows are divided by their largest finite magnitude first (and the results
    multiplied back): squares of values beyond ~1e154 would overflow.
    """
    wide = rows.dtype == torch.float64
    if not wide and rows.device.type == "cpu" and bool(torch.isfinite(rows.sum())):
        r64 = rows.to(torch.float64)
        mean = r64.mean(dim)
        sq = (r64 * r64).mean(dim)
        # abs().amax is ~10x faster than aminmax along a dim on the CPU
        return {"mean": mean.float(), "std": (sq - mean * mean).clamp_min(0.0).sqrt().float(),
                "abs_max": rows.abs().amax(dim)}
    finite = torch.isfinite(rows)
    count = finite.sum(dim)
    if wide:
        scale = torch.where(finite, rows, 0.0).abs().amax(dim, keepdim=True)
        scale = torch.where(scale > 0, scale, 1.0)
        rows = rows / scale
    z = torch.where(finite, rows, 0.0)
    mean = z.sum(dim) / count  # 0 / 0 = NaN: a neuron with no finite value is not shown as 0
    centred = torch.where(finite, rows - mean.unsqueeze(dim), 0.0)
    std = (centred.square().sum(dim) / count).sqrt()
    abs_max = torch.where(count > 0, z.abs().amax(dim), float("nan"))
    out = {"mean": mean, "std": std, "abs_max": abs_max}
    return {k: v * scale.squeeze(dim) for k, v in out.items()} if wide else out


def array_views(x: torch.Tensor, batch_dim: int | None, max_samples: int,
                max_neurons: int = DEFAULT_MAX_NEURONS, max_items: int = DEFAULT_MAX_ITEMS,
                max_values: int = DEFAULT_MAX_VALUES, dtype: torch.dtype = torch.float32
                ) -> dict[str, torch.Tensor]:
    """Array views of one tensor record, `dtype` (float32, or float64 for `is_wide` tensors)
    on x's device.

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
    xf = x.to(dtype)
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
        views["samples"] = _samples(x, batch_dim, max_samples, max_values, dtype)
    return views


def is_wide(x: torch.Tensor) -> bool:
    """A float64 tensor with finite values beyond float32's range (one host sync): its views
    would saturate to ±inf in float32 and its squares may overflow float64."""
    return (x.dtype == torch.float64 and x.numel() > 0
            and float(torch.where(torch.isfinite(x), x, 0.0).abs().max()) > FLOAT32_MAX)


def wide_summary(x: torch.Tensor, batch_dim: int | None, max_samples: int,
                 max_neurons: int = DEFAULT_MAX_NEURONS) -> tuple[torch.Tensor,
                                                                  dict[str, torch.Tensor]]:
    """`tensor_stats` and `array_views` of an `is_wide` tensor, exact: the moments are taken
    of x·2⁻ᵏ (k: the binary exponent of its largest finite magnitude, so the rescaling is
    exact) and scaled back; min/max/counts of x itself; views and samples in float64."""
    x = x.detach()
    largest = float(torch.where(torch.isfinite(x), x, 0.0).abs().max())
    scale = 2.0 ** -math.frexp(largest)[1]
    row = tensor_stats(x)
    moments = [_COL[c] for c in ("mean", "std", "abs_mean", "norm")]
    row[moments] = tensor_stats(x * scale)[moments] / scale
    return row, array_views(x, batch_dim, max_samples, max_neurons, dtype=torch.float64)


