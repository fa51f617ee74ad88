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

# Tensors the fused path does not take (float16, bfloat16, integers, bools) up to this many
# elements are summarised together in one batch of segmented reductions: for them the fixed
# cost of ~20 separate small ops dominates.
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


class SummarySettings(NamedTuple):
    """How a step's captures are summarised; steps with equal settings are summarised
    together (see `StepCaptures.together`)."""

    max_samples: int
    max_neurons: int
    singular_values: bool
    exact_views: bool


class StepCaptures(NamedTuple):
    """A recorded step's summary job, run on the writer thread: its captures, its settings,
    and where its tensors go once summarised (`release`). Call it for the step's
    `StepSummary`; `together` summarises several steps of equal `key` in one pass."""

    captures: list[Capture]
    settings: SummarySettings
    release: Callable[[list[torch.Tensor]], None] | None = None

    @property
    def key(self) -> SummarySettings:
        return self.settings

    def __call__(self) -> StepSummary:
        return summarise_steps([self])[0]

    @staticmethod
    def together(jobs: list[StepCaptures]) -> list[StepSummary]:
        return summarise_steps(jobs)


def summarise_steps(steps: list[StepCaptures]) -> list[StepSummary]:
    """Statistics and array views of each step's captures, copied to the host in one transfer
    each; the steps' tensors are summarised together (the fused path's ops are then shared
    by them), each result the same as the step's alone. All steps have equal settings.

    Aggregated views (neuron_*, sample_*) are bfloat16 (3 significant digits, float32 range:
    enough to draw, half the bytes) unless `exact_views`; full sample values stay float32; the
    statistics are float64 (of a float32 tensor: accurate to ~1e-7 of its scale, as its own
    values are). Captures of a step that share a tensor (one tensor under two names) are
    summarised and stored once. The tensors are read only, then handed to each step's
    `release` once every step is done (a failure leaves them all to summarise again);
    nothing returned shares their memory.
    """
    settings = steps[0].settings
    if any(s.settings != settings for s in steps):
        raise ValueError("summarise_steps: the steps' summary settings differ; summarise "
                         "them apart")
    firsts = []  # per step: id(tensor) -> index of its first capture
    for s in steps:
        first: dict[int, int] = {}
        for i, c in enumerate(s.captures):
            first.setdefault(id(c.tensor), i)
        firsts.append(first)
    unique = [s.captures[i] for s, first in zip(steps, firsts) for i in first.values()]
    views_of, host_stats = _summarise_unique(unique, settings)
    zero_frac = host_stats[:, STAT_COLUMNS.index("zero_frac")].tolist()
    out, at = [], 0
    for s, first in zip(steps, firsts):
        own = slice(at, at + len(first))
        at = own.stop
        entries, parts, compress = _pack(unique[own], views_of[own], zero_frac[own],
                                         settings.exact_views)
        summary = StepSummary([(c.name, c.direction, c.iteration) for c in unique[own]],
                              host_stats[own], entries, parts, compress)
        out.append(summary if len(first) == len(s.captures) else
                   _shared(s.captures, first, summary))
    for s, first in zip(steps, firsts):  # all packed: nothing left reads them (and a
        if s.release is not None:        # failure before here leaves every step's intact)
            s.release([s.captures[i].tensor for i in first.values()])
    return out


def _shared(captures: list[Capture], first: dict[int, int], summary: StepSummary
            ) -> StepSummary:
    """The summary of a step whose captures share tensors, from that of its unique ones
    (`first`: id(tensor) -> index of its first capture)."""
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
    return StepSummary([(c.name, c.direction, c.iteration) for c in captures],
                       summary.stats[rows], entries, summary.parts, summary.compress)


def _summarise_unique(captures: list[Capture], settings: SummarySettings
                      ) -> tuple[list[dict[str, torch.Tensor | np.ndarray]], np.ndarray]:
    """(array views, float64 stats rows of `STAT_COLUMNS`) of captures that share no
    tensor."""
    max_samples, max_neurons, singular_values, _ = settings
    done: list[tuple[torch.Tensor | np.ndarray, dict[str, torch.Tensor | np.ndarray]] | None]
    done = [None] * len(captures)
    small: dict[torch.device, list[int]] = {}
    fused: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, c in enumerate(captures):
        x = c.tensor
        if x.dtype == torch.float64 and is_wide(x):  # beyond float32: its own exact path
            done[i] = wide_summary(x, c.batch_dim, max_samples, max_neurons)
        elif singular_values and c.is_parameter and x.dim() == 2:
            done[i] = (tensor_stats(x, True), array_views(x, None, max_samples, max_neurons))
        elif fused_eligible(x):
            fused.setdefault((x.device, x.dtype), []).append(i)
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
        if done[i] is None:  # the general path: larger tensors of other dtypes, non-finite
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
    return [d[1] for d in done], host_stats  # type: ignore[index]


def _pack(captures: list[Capture], views_of: list[dict[str, torch.Tensor | np.ndarray]],
          zero_frac: list[float], exact_views: bool) -> tuple[list[tuple], list[bytes],
                                                              list[bool]]:
    """The captures' array views packed into parts: (entries, parts, compress) of a
    `StepSummary`. The entries list is shared by the steps of one layout: read it only."""
    arrs = [arr for vs in views_of for arr in vs.values()]
    key = (exact_views, tuple(f >= SPARSE for f in zero_frac),
           tuple((c.name, c.direction, c.iteration) for c in captures),
           tuple((view, arr.shape, arr.dtype) for vs in views_of for view, arr in vs.items()))
    host = _to_host(arrs)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(captures, views_of, host, zero_frac, exact_views)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    entries, members, compress = plan
    parts = []
    for dtype, idx in members:  # little-endian bytes, as arrays.encode makes them
        flat = np.concatenate([host[j] for j in idx], axis=None)
        if dtype == arrays.BFLOAT16:
            bits = torch.from_numpy(flat).to(torch.bfloat16).view(torch.int16).numpy()
            parts.append(bits.astype("<i2", copy=False).tobytes())
        else:
            parts.append(flat.astype(arrays.DTYPES[dtype], copy=False).tobytes())
    return entries, parts, compress


# Packing plans by step layout (names, views, shapes, dtypes, which captures are sparse): a
# steady run's steps all have one, so the entries are built once.
_plans: dict[tuple, tuple[list[tuple], list[tuple[str, list[int]]], list[bool]]] = {}
MAX_PLANS = 64


def _plan(captures: list[Capture], views_of: list[dict[str, torch.Tensor | np.ndarray]],
          host: list[np.ndarray], zero_frac: list[float], exact_views: bool
          ) -> tuple[list[tuple], list[tuple[str, list[int]]], list[bool]]:
    """(entries, [(dtype, indices into `host`: the arrays of `views_of` in order)] per part,
    compress)."""
    # Three kinds of part: aggregated views (bfloat16 unless exact; compressed), full sample
    # values of mostly-zero tensors (float32; compressed: ReLU outputs halve) and of the
    # others (float32; stored raw: zlib gains little on dense floats at a high price). A
    # fourth, float64 and compressed, for the views and samples of tensors beyond float32.
    kinds: dict[str, list[tuple]] = {"sparse": [], "dense": [], "views": [], "wide": []}
    j = 0
    for i, vs in enumerate(views_of):
        c = captures[i]
        for view in vs:
            arr = host[j]
            kind = ("wide" if arr.dtype == np.float64 else "views" if view != "samples" else
                    "sparse" if zero_frac[i] >= SPARSE else "dense")
            kinds[kind].append((c.name, c.direction, view, c.iteration, arr, j))
            j += 1
    entries, members, compress = [], [], []
    for kind, part in kinds.items():
        if not part:
            continue
        if kind == "views" and not exact_views:
            dtype, itemsize = arrays.BFLOAT16, 2
        else:  # the dtype np.concatenate gives the part
            common = np.result_type(*(p[4].dtype for p in part))
            dtype, itemsize = common.name, common.itemsize
        offset = 0
        for name, direction, view, it, arr, _ in part:
            nbytes = arr.size * itemsize
            entries.append((name, direction, view, it, dtype, _shape_text(arr.shape),
                            len(members), offset, nbytes))
            offset += nbytes
        members.append((dtype, [p[5] for p in part]))
        compress.append(kind != "dense")
    return entries, members, compress


def _to_host(arrs: list[torch.Tensor | np.ndarray]) -> list[np.ndarray]:
    """The arrays as host NumPy arrays, in order: device tensors in one transfer per device
    and dtype."""
    out: list = list(arrs)
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(arrs):
        if isinstance(a, torch.Tensor):
            groups.setdefault((a.device, a.dtype), []).append(i)
    for idx in groups.values():
        joined = torch.cat([arrs[i].reshape(-1) for i in idx]).cpu().numpy()  # type: ignore[union-attr]
        at = 0
        for i in idx:
            size = arrs[i].numel()  # type: ignore[union-attr]
            out[i] = joined[at:at + size].reshape(tuple(arrs[i].shape))
            at += size
    return out


@functools.lru_cache(maxsize=1024)
def _shape_text(shape: tuple[int, ...]) -> str:
    return json.dumps(list(shape))


def _by_device(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by device, in order."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return list(groups.values())
