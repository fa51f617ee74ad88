"""Per-tensor statistics, computed on the tensor's own device without a host sync.

Every statistic ignores non-finite elements and the NaN/+Inf/-Inf counts are kept beside it, so
one NaN never hides the rest of a tensor. Results stay on the device; the step recorder stacks
them and the writer copies them to the host once per step.
"""

from __future__ import annotations

import torch

from ..store.schema import STAT_COLUMNS

DEFAULT_MAX_NEURONS = 4096   # per-neuron views keep the first this-many neurons
DEFAULT_MAX_ITEMS = 4096     # per-sample statistics keep the first this-many batch items
DEFAULT_MAX_VALUES = 65536   # full values of one stored sample are cut to this many elements


def tensor_stats(x: torch.Tensor, singular_value: bool = False) -> torch.Tensor:
    """Return a float64 vector of `STAT_COLUMNS` for `x`, on x's device.

    mean/std/min/max/abs_* /norm are over the finite elements (std is population, ddof=0);
    zero_frac is over all elements; sv_max is NaN unless `singular_value` and x is 2-D.
    """
    x = x.detach()
    flat = x.reshape(-1)
    n = flat.numel()
    x64 = flat.to(torch.float64)
    finite = torch.isfinite(x64)
    nan = torch.isnan(x64).sum()
    posinf = (x64 == float("inf")).sum()
    neginf = (x64 == float("-inf")).sum()
    count = finite.sum()
    z = torch.where(finite, x64, 0.0)
    mean = z.sum() / count
    centred = torch.where(finite, x64 - mean, 0.0)
    std = (centred.square().sum() / count).sqrt()
    absz = z.abs()
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    if n:
        mn = torch.where(finite, x64, inf).min()
        mx = torch.where(finite, x64, -inf).max()
        abs_max = absz.max()
    else:
        mn = mx = abs_max = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    # min/max of a tensor with no finite element are undefined, not +-inf.
    nan_t = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    mn = torch.where(count > 0, mn, nan_t)
    mx = torch.where(count > 0, mx, nan_t)
    sv = nan_t
    if singular_value and x.dim() == 2 and n:
        sv = torch.linalg.matrix_norm(z.reshape(x.shape), ord=2)
    values = {
        "numel": torch.tensor(float(n), dtype=torch.float64, device=x.device),
        "mean": mean, "std": std, "abs_mean": absz.sum() / count, "min": mn, "max": mx,
        "abs_max": abs_max, "norm": z.square().sum().sqrt(),
        "zero_frac": (x64 == 0).sum() / max(n, 1),
        "nan": nan, "posinf": posinf, "neginf": neginf, "sv_max": sv,
    }
    return torch.stack([values[c].to(torch.float64) for c in STAT_COLUMNS])


def _masked_rows(rows: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
    """mean / std / abs_max over `dim` of a 2-D float tensor, ignoring non-finite elements."""
    finite = torch.isfinite(rows)
    count = finite.sum(dim).clamp_min(1)
    z = torch.where(finite, rows, 0.0)
    mean = z.sum(dim) / count
    centred = torch.where(finite, rows - mean.unsqueeze(dim), 0.0)
    std = (centred.square().sum(dim) / count).sqrt()
    return {"mean": mean, "std": std, "abs_max": z.abs().amax(dim)}


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
    if x.dim() == 0:
        return {}
    xf = x.to(torch.float32)
    views: dict[str, torch.Tensor] = {}
    if batch_dim is None:
        rows = xf.reshape(x.shape[0], -1)[:max_neurons]
        for stat, v in _masked_rows(rows, 1).items():
            views[f"neuron_{stat}"] = v
        return views
    xb = xf.movedim(batch_dim, 0)
    flat = xb.reshape(xb.shape[0], -1)
    for stat, v in _masked_rows(flat[:, :max_neurons], 0).items():
        views[f"neuron_{stat}"] = v
    for stat, v in _masked_rows(flat[:max_items], 1).items():
        views[f"sample_{stat}"] = v
    if max_samples > 0:
        keep = xb[:max_samples]
        if flat.shape[1] > max_values:
            keep = flat[:max_samples, :max_values]
        views["samples"] = keep.contiguous()
    return views
