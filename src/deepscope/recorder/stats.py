"""Per-tensor statistics, computed on the tensor's own device without a host sync.

Every statistic ignores non-finite elements and the NaN/+Inf/-Inf counts are kept beside it, so
one NaN never hides the rest of a tensor. Results stay on the device; the step recorder stacks
them and the writer copies them to the host once per step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..store.schema import STAT_COLUMNS

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


def batched_stats(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensor_stats` of many (small) tensors on one device at once: (K, len(STAT_COLUMNS)).

    sv_max is NaN. Same definitions as `tensor_stats`, computed with segmented reductions over
    the concatenation, so the cost is a few passes over all elements instead of ~20 ops per
    tensor.
    """
    flats = [t.detach().reshape(-1).to(torch.float64) for t in tensors]
    device = flats[0].device
    numel = torch.tensor([f.numel() for f in flats], dtype=torch.float64, device=device)
    lengths = numel.to(torch.int64)
    data = torch.cat(flats)
    finite = torch.isfinite(data)
    z = torch.where(finite, data, 0.0)
    inf = float("inf")

    def seg(values: torch.Tensor, how: str = "sum") -> torch.Tensor:
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
        keep = xb[:max_samples]
        if flat.shape[1] > max_values:
            keep = flat[:max_samples, :max_values]
        views["samples"] = keep.contiguous()
    return views


class Capture(NamedTuple):
    """A private copy of one tensor record, summarised later on the writer thread."""

    name: str
    direction: str
    iteration: int
    tensor: torch.Tensor
    batch_dim: int | None
    is_parameter: bool


Summary = tuple[list[tuple[str, str, int]], torch.Tensor,
                list[tuple[str, str, str, int, torch.Tensor]]]


def summarise_captures(captures: list[Capture], max_samples: int, max_neurons: int,
                       singular_values: bool, exact_views: bool) -> Summary:
    """Statistics and array views of a step's captures, copied to the host in one transfer each.

    Returns (keys, stats (R, len(STAT_COLUMNS)) float64 on the host, arrays as
    (name, direction, view, iteration, host tensor)). Aggregated views (neuron_*, sample_*)
    are bfloat16 (3 significant digits, float32 range: enough to draw, half the bytes) unless
    `exact_views`; full sample values stay float32; the statistics are exact float64.
    """
    keys = [(c.name, c.direction, c.iteration) for c in captures]
    rows: list[torch.Tensor | None] = [None] * len(captures)
    small: dict[torch.device, list[int]] = {}
    for i, c in enumerate(captures):
        sv = singular_values and c.is_parameter and c.tensor.dim() == 2
        if c.tensor.numel() <= BATCHED_NUMEL and not sv:
            small.setdefault(c.tensor.device, []).append(i)
        else:
            rows[i] = tensor_stats(c.tensor, sv)
    for device, idx in small.items():
        for i, row in zip(idx, batched_stats([captures[i].tensor for i in idx])):
            rows[i] = row.to(device)
    pending = []
    for c in captures:
        for view, arr in array_views(c.tensor, c.batch_dim, max_samples, max_neurons).items():
            pending.append((c.name, c.direction, view, c.iteration, arr))
    host_stats = (torch.stack(rows).cpu() if rows  # type: ignore[arg-type]
                  else torch.zeros(0, len(STAT_COLUMNS)))
    arrays = []
    # One transfer for full sample values (float32) and one for aggregated views (bfloat16
    # unless exact), converted in one go.
    for exact in (True, False):
        part = [p for p in pending if (p[2] == "samples") == exact]
        if not part:
            continue
        flat = torch.cat([a.reshape(-1) for *_, a in part])
        if not (exact or exact_views):
            flat = flat.to(torch.bfloat16)
        flat = flat.cpu()
        offset = 0
        for name, direction, view, it, arr in part:
            arrays.append((name, direction, view, it,
                           flat[offset:offset + arr.numel()].reshape(arr.shape)))
            offset += arr.numel()
    return keys, host_stats, arrays
