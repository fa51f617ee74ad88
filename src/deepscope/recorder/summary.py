"""A recorded step's summary: its captures routed to the fast or general statistics, and
its arrays packed into one part per dtype for the writer."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..records import StepSummary
from ..store import arrays
from ..store.schema import STAT_COLUMNS
from .fast import fused_eligible, fused_summaries
from .stats import array_views, is_wide, small_summaries, tensor_stats, wide_summary

# Tensors the fused path does not take (another device or dtype) up to this many elements are
# summarised together in one batch of segmented reductions: for them the fixed cost of ~20
# separate small ops dominates.
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
    done: list[tuple[torch.Tensor | np.ndarray, dict[str, torch.Tensor | np.ndarray]] | None]
    done = [None] * len(captures)
    small: dict[torch.device, list[int]] = {}
    fused: dict[torch.dtype, list[int]] = {}
    for i, c in enumerate(captures):
        x = c.tensor
        if x.dtype == torch.float64 and is_wide(x):  # beyond float32: its own exact path
            done[i] = wide_summary(x, c.batch_dim, max_samples, max_neurons)
        elif singular_values and c.is_parameter and x.dim() == 2:
            done[i] = (tensor_stats(x, True), array_views(x, None, max_samples, max_neurons))
        elif fused_eligible(x):
            fused.setdefault(x.dtype, []).append(i)
        elif x.numel() <= BATCHED_NUMEL:
            small.setdefault(x.device, []).append(i)
    for idx in fused.values():
        pairs = [(captures[i].tensor, captures[i].batch_dim) for i in idx]
        for i, result in zip(idx, fused_summaries(pairs, max_samples, max_neurons)):
            done[i] = result  # None (non-finite): the general path below
    for idx in small.values():
        pairs = [(captures[i].tensor, captures[i].batch_dim) for i in idx]
        for i, result in zip(idx, small_summaries(pairs, max_samples, max_neurons)):
            done[i] = result
    for i, c in enumerate(captures):
        if done[i] is None:  # the general path: another device or dtype, non-finite values
            done[i] = (tensor_stats(c.tensor),
                       array_views(c.tensor, c.batch_dim, max_samples, max_neurons))
    host_stats = np.empty((len(captures), len(STAT_COLUMNS)), dtype=np.float64)
    on_device = [i for i, d in enumerate(done) if isinstance(d[0], torch.Tensor)]  # type: ignore[index]
    for idx in _by_device([done[i][0] for i in on_device]):  # type: ignore[index,misc]
        rows = [on_device[j] for j in idx]
        host_stats[rows] = torch.stack([done[i][0] for i in rows]).cpu().numpy()  # type: ignore[index,misc]
    for i, d in enumerate(done):
        if not isinstance(d[0], torch.Tensor):  # type: ignore[index]
            host_stats[i] = d[0]  # type: ignore[index]
    zero_frac = host_stats[:, STAT_COLUMNS.index("zero_frac")].tolist()
    # Three kinds of part: aggregated views (bfloat16 unless exact; compressed), full sample
    # values of mostly-zero tensors (float32; compressed: ReLU outputs halve) and of the
    # others (float32; stored raw: zlib gains little on dense floats at a high price). A
    # fourth, float64 and compressed, for the views and samples of tensors beyond float32.
    pending = [(c.name, c.direction, view, c.iteration, arr,
                "wide" if arr.dtype in _WIDE else "views" if view != "samples" else
                "sparse" if zero_frac[i] >= SPARSE else "dense")
               for i, (c, (_, vs)) in enumerate(zip(captures, done)) for view, arr in vs.items()]  # type: ignore[misc]
    entries, parts, compress = [], [], []
    for kind in ("sparse", "dense", "views", "wide"):
        part = [p for p in pending if p[5] == kind]
        if not part:
            continue
        flat = _host_flat([p[4] for p in part])  # one transfer per device
        if kind == "views" and not exact_views:
            flat = flat.to(torch.bfloat16)
        dtype, _, data = arrays.encode(flat)
        itemsize, offset = flat.element_size(), 0
        for name, direction, view, it, arr, _ in part:
            nbytes = _numel(arr) * itemsize
            entries.append((name, direction, view, it, dtype, _shape_text(tuple(arr.shape)),
                            len(parts), offset, nbytes))
            offset += nbytes
        parts.append(data)
        compress.append(kind != "dense")
    return StepSummary(keys, host_stats, entries, parts, compress)


_WIDE = (torch.float64, np.dtype(np.float64))


def _numel(arr: torch.Tensor | np.ndarray) -> int:
    return arr.numel() if isinstance(arr, torch.Tensor) else arr.size


def _host_flat(arrs: list[torch.Tensor | np.ndarray]) -> torch.Tensor:
    """The arrays (host NumPy or device tensors of one dtype) flattened and joined in order,
    as one host tensor: one transfer per device."""
    host: dict[int, np.ndarray] = {}
    tensors = [i for i, a in enumerate(arrs) if isinstance(a, torch.Tensor)]
    for idx in _by_device([arrs[i] for i in tensors]):  # type: ignore[misc]
        joined = torch.cat([arrs[tensors[j]].reshape(-1) for j in idx]).cpu().numpy()  # type: ignore[union-attr]
        at = 0
        for j in idx:
            size = arrs[tensors[j]].numel()  # type: ignore[union-attr]
            host[tensors[j]] = joined[at:at + size]
            at += size
    return torch.from_numpy(np.concatenate([host[i] if i in host else arrs[i].reshape(-1)  # type: ignore[union-attr]
                                            for i in range(len(arrs))]))


@functools.lru_cache(maxsize=1024)
def _shape_text(shape: tuple[int, ...]) -> str:
    return json.dumps(list(shape))


def _by_device(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by device, in order."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return list(groups.values())
