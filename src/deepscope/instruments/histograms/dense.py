"""The dense counter: histogram classes of materialised per-sample gradients, (rows, D)
tensors counted in cache-sized chunks.

Per-sample gradient elements are overwhelmingly small, and every value strictly between the
nearest negative and the nearest positive edge falls into a bin fixed by its sign alone. So
most elements are only counted by sign, and only the rest ("outer" elements) are binned
individually, in a few vectorised passes per chunk. Where most values are outer, every value
is classed directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from ..rules.base import Part
from .bins import EXTRAS, _Axis, _work_dtype

# elements per chunk: about 4 MB of float32 on CPU keeps each chunk's passes in cache;
# on an accelerator fewer, bigger chunks mean fewer host synchronisations.
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_CHUNK_ELEMENTS_OTHER = 1 << 24
_BLOCK = 128  # values per block when screening a chunk for outer values
# every this many values, one is looked at to tell whether most values are outer; above
# this fraction they are all classed directly
_SAMPLE_STRIDE = 61
_DENSE = 0.25
# up to this many elements on the CPU (a Linear bias: B × out), `_small_counts` in NumPy:
# the sign-counting path's dozen torch ops cost more in per-call overhead than the values
_SMALL_ELEMENTS = 1 << 16


def _outer_positions(flat: Tensor, low: float, high: float, has_nan: bool) -> Tensor | None:
    """Indices into `flat` (n,) of the values outside the open zone (low, high), and NaNs;
    None when they are so many that classing every value directly is cheaper.

    Outer values are usually rare, and locating them element by element is the slow part,
    so blocks of `_BLOCK` values are screened by their min / max first.
    """
    def scan(x: Tensor) -> Tensor:
        outer = ~((x > low) & (x < high)) if has_nan else (x >= high) | (x <= low)
        return outer.nonzero().squeeze(1)

    sample = flat[:: _SAMPLE_STRIDE]
    if bool((~((sample > low) & (sample < high))).sum() > _DENSE * sample.numel()):
        return None
    n_blocks = flat.numel() // _BLOCK
    if has_nan or n_blocks == 0:  # NaN escapes the block min / max screen
        return scan(flat)
    head = flat[: n_blocks * _BLOCK].view(n_blocks, _BLOCK)
    flagged = ((head.amax(1) >= high) | (head.amin(1) <= low)).nonzero().squeeze(1)
    if 4 * flagged.numel() > n_blocks:  # many blocks: one scan of everything is cheaper
        return scan(flat)
    inside = scan(head[flagged].view(-1))
    found = flagged[inside // _BLOCK] * _BLOCK + inside % _BLOCK
    return torch.cat([found, scan(flat[n_blocks * _BLOCK :]) + n_blocks * _BLOCK])


class ColumnSigns:
    """Per-column tallies (D,) of the values a grouped count classes by sign alone, kept
    over every chunk and part of one tensor and folded into the column groups once
    (`fold`): parts of one sample each (a big layer's per-sample gradients) paid the fold,
    an index_add over D, once per sample, more than their counting.

    Args:
        axis: the gradient axis the values were screened on; groups: (D,) each column's
            group in [0, n_groups) (on the gradients' device).
    Attributes:
        signed, nonzero: float64 (D,) Σ sign and Σ |sign| of those values (exact integers).
        rows: rows counted by sign; outer: the columns of the values classed individually
            in those rows (one entry per value).
    """

    def __init__(self, axis: _Axis, groups: Tensor, n_groups: int) -> None:
        self.axis, self.groups, self.n_groups = axis, groups, n_groups
        self.signed = torch.zeros(groups.numel(), dtype=torch.float64, device=groups.device)
        self.nonzero = torch.zeros_like(self.signed)
        self.rows = 0
        self.outer: list[Tensor] = []

    def fold(self) -> Tensor:
        """The tallies as (n_groups, bins + 5) float64 counts in the sign classes."""
        device = self.signed.device
        columns = (torch.cat(self.outer) if self.outer
                   else torch.zeros(0, dtype=torch.long, device=device))
        inner = self.rows - torch.bincount(columns, minlength=self.signed.numel()).double()
        s, a, total = torch.zeros(3, self.n_groups, dtype=torch.float64,
                                  device=device).index_add_(
            1, self.groups, torch.stack([self.signed, self.nonzero, inner]))
        counts = torch.zeros(self.n_groups, self.axis.bins.count + len(EXTRAS),
                             dtype=torch.float64, device=device)
        _add_sign_classes(counts, self.axis, s, a, total)
        return counts


def _grouped_counts(
    grads: Tensor, axis: _Axis, groups: Tensor | None, n_groups: int,
    tally: ColumnSigns | None = None,
) -> Tensor:
    """Class counts of every element of `grads` (rows, D), per group of columns.

    groups: (D,) group index of each column in [0, n_groups), or None for one group.
    tally: with groups (and only then), where the values classed by sign alone are
        tallied (of the same axis and groups), folded into counts by the caller
        (`ColumnSigns.fold`); without groups they are counted here.
    Returns (n_groups, bins + 5) float64 counts on the device (exact integers).
    """
    rows_total, width = grads.shape
    device = grads.device
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_OTHER)
    rows = max(1, min(rows_total, budget // max(width, 1)))
    low, high = axis.zone
    n_classes = axis.bins.count + len(EXTRAS)
    counts = torch.zeros(n_groups * n_classes, dtype=torch.float64, device=device)
    assert (groups is None) == (tally is None), "a tally goes with groups, and only with them"
    # Σ sign and Σ sign² of the inner values: per column when grouped, else in total. Sums of
    # ±1 and 0 are exact in float32 up to 2^24 terms (a chunk, or B per column).
    signed, nonzero = ((tally.signed, tally.nonzero) if tally is not None else
                       torch.zeros(2, dtype=torch.float64, device=device).unbind())
    buffer = torch.empty(rows * width, dtype=grads.dtype, device=device)
    by_sign = 0  # rows counted by sign
    outer_columns = []
    for start in range(0, rows_total, rows):
        chunk = grads[start : start + rows]
        flat = chunk.reshape(-1)
        smallest, largest = (v.item() for v in torch.aminmax(flat))
        where = None
        if not low < smallest <= largest < high:  # some outer value (False with NaN too)
            where = _outer_positions(flat, low, high, math.isnan(smallest))
            values = flat if where is None else flat.index_select(0, where)
            columns = None if where is None else where % width
            key = axis.classify(values)
            if groups is not None:
                key = (key.view(chunk.shape) + groups * n_classes if columns is None
                       else key + groups.index_select(0, columns) * n_classes)
            counts += torch.bincount(key.reshape(-1), minlength=n_groups * n_classes)
            if columns is None:
                continue  # every value classed: none is left to count by sign
            outer_columns.append(columns)
        by_sign += chunk.shape[0]
        signs = torch.sign(flat, out=buffer[: flat.numel()])
        if where is not None:
            signs[where] = 0
        if groups is None:
            signed += signs.sum()
            nonzero += torch.dot(signs, signs)
        else:
            signs = signs.view(chunk.shape)
            signed += signs.sum(0)
            nonzero += signs.abs_().sum(0)

    counts = counts.view(n_groups, n_classes)
    if tally is not None:
        tally.rows += by_sign
        tally.outer += outer_columns
        return counts
    inner = by_sign * width - sum(columns.numel() for columns in outer_columns)
    _add_sign_classes(counts, axis, signed, nonzero,
                      torch.tensor(float(inner), dtype=torch.float64, device=device))
    return counts


def _is_small(grads: Tensor) -> bool:
    """Whether `grads` (rows, D) is counted by `_small_counts`."""
    return (grads.device.type == "cpu" and grads.numel() <= _SMALL_ELEMENTS
            and grads.dtype in (torch.float32, torch.float64))


def _small_counts(grads: Tensor, axis: _Axis, groups: Tensor | None, n_groups: int) -> Tensor:
    """`_grouped_counts` of a small CPU tensor (`_is_small`) in NumPy, the same classes:
    values strictly inside the zone by their sign's class, the others by `axis.classify`.
    Returns (n_groups, bins + 5) float64 counts (exact integers)."""
    values = grads.detach().numpy()
    low, high = axis.zone
    n_classes = axis.bins.count + len(EXTRAS)
    counts = np.zeros((n_groups, n_classes))
    with np.errstate(invalid="ignore"):  # NaN compares False: outer
        inside = (values > low) & (values < high)
    sides = (inside & (values < 0), values == 0, inside & (values > 0))  # 0 is always inside
    columns = groups.numpy() if groups is not None else None
    for cls, side in zip(axis.sign_classes, sides):
        if columns is None:
            counts[0, cls] += np.count_nonzero(side)
        else:
            counts[:, cls] += np.bincount(columns, weights=np.count_nonzero(side, axis=0),
                                          minlength=n_groups)
    outer = ~inside
    if outer.any():
        rows, where = np.nonzero(outer)
        key = axis.classify(torch.from_numpy(values[rows, where])).numpy()
        if columns is not None:
            key = key + columns[where] * n_classes
        counts += np.bincount(key, minlength=n_groups * n_classes).reshape(n_groups, n_classes)
    return torch.from_numpy(counts)


def _add_sign_classes(counts: Tensor, axis: _Axis, signed: Tensor, nonzero: Tensor,
                      total: Tensor) -> None:
    """Add to counts (n_groups, bins + 5) the values classed by sign alone, from their Σ
    sign, Σ |sign| and number per group ((n_groups,) or scalar float64 tensors)."""
    for cls, part in zip(axis.sign_classes, ((nonzero - signed) / 2, total - nonzero,
                                             (nonzero + signed) / 2)):
        counts[:, cls] += part


def _flat_rows(grads: Tensor) -> Tensor:
    """(B, *shape) -> (B, D) in the work dtype, without a copy when possible."""
    return grads.reshape(grads.shape[0], -1).to(_work_dtype(grads.dtype))


def _materialised(part: Part) -> Iterator[Tensor]:
    """A part as (b, D) tensors of consecutive samples, at most a chunk's worth at a time."""
    if isinstance(part, Tensor):
        yield part
        return
    elements = part.left.shape[1] * part.right.shape[1]
    budget = _CHUNK_ELEMENTS.get(part.left.device.type, _CHUNK_ELEMENTS_OTHER)
    rows = max(1, budget // max(elements, 1))
    for lo in range(0, part.samples, rows):
        yield part.materialise(lo, min(lo + rows, part.samples))
