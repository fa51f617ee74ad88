"""A recorded step's summary: its captures routed to the fast or general statistics, and
its arrays packed into one part per dtype for the writer."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..records import StepSummary
from ..store import arrays
from ..store.schema import STAT_COLUMNS
from .fast import fast_batched, fast_eligible, fast_parameters
from .stats import array_views, is_wide, small_summaries, tensor_stats, wide_summary

# Tensors up to this many elements are summarised together in one batch of segmented
# reductions: for them the fixed cost of ~20 separate small ops dominates.
BATCHED_NUMEL = 4096
# Samples of tensors with at least this fraction of exact zeros are compressed.
SPARSE = 0.3


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

    Aggregated views (neuron_*, sample_*) are bfloat16 (3 significant digits, float32 range:
    enough to draw, half the bytes) unless `exact_views`; full sample values stay float32; the
    statistics are float64 (of a float32 tensor: accurate to ~1e-7 of its scale, as its own
    values are). Captures that share a tensor (one tensor under two names) are summarised and
    stored once. The tensors are overwritten, then handed to `release`; nothing returned
    shares their memory.
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
    return StepSummary(all_keys, summary.stats[rows], entries, summary.parts,
                       summary.compress)


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
        if x.dtype == torch.float64 and is_wide(x):  # beyond float32: its own exact path
            done[i] = wide_summary(x, c.batch_dim, max_samples, max_neurons)
        elif singular_values and c.is_parameter and x.dim() == 2:
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
    zero_frac = host_stats[:, STAT_COLUMNS.index("zero_frac")].tolist()
    # Three kinds of part: aggregated views (bfloat16 unless exact; compressed), full sample
    # values of mostly-zero tensors (float32; compressed: ReLU outputs halve) and of the
    # others (float32; stored raw: zlib gains little on dense floats at a high price). A
    # fourth, float64 and compressed, for the views and samples of tensors beyond float32.
    pending = [(c.name, c.direction, view, c.iteration, arr,
                "wide" if arr.dtype == torch.float64 else "views" if view != "samples" else
                "sparse" if zero_frac[i] >= SPARSE else "dense")
               for i, (c, (_, vs)) in enumerate(zip(captures, done)) for view, arr in vs.items()]
    entries, parts, compress = [], [], []
    for kind in ("sparse", "dense", "views", "wide"):
        part = [p for p in pending if p[5] == kind]
        for idx in _by_device([p[4] for p in part]):  # one transfer per device
            flat = torch.cat([part[i][4].reshape(-1) for i in idx])
            if kind == "views" and not exact_views:
                flat = flat.to(torch.bfloat16)
            dtype, _, data = arrays.encode(flat)
            itemsize, offset = flat.element_size(), 0
            for i in idx:
                name, direction, view, it, arr, _ = part[i]
                nbytes = arr.numel() * itemsize
                entries.append((name, direction, view, it, dtype, _shape_text(arr.shape),
                                len(parts), offset, nbytes))
                offset += nbytes
            parts.append(data)
            compress.append(kind != "dense")
    return StepSummary(keys, host_stats.numpy(), entries, parts, compress)


@functools.lru_cache(maxsize=1024)
def _shape_text(shape: tuple[int, ...]) -> str:
    return json.dumps(list(shape))


def _by_device(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by device, in order."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return list(groups.values())
