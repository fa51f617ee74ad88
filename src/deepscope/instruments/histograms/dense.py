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


def _grouped_counts(
    grads: Tensor, axis: _Axis, groups: Tensor | None, n_groups: int
) -> Tensor:
    """Class counts of every element of `grads` (rows, D), per group of columns.

    groups: (D,) group index of each column in [0, n_groups), or None for one group.
    Returns (n_groups, bins + 5) float64 counts on the device (exact integers).
    """
    rows_total, width = grads.shape
    device = grads.device
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_OTHER)
    rows = max(1, min(rows_total, budget // max(width, 1)))
    low, high = axis.zone
    n_classes = axis.bins.count + len(EXTRAS)
    counts = torch.zeros(n_groups * n_classes, dtype=torch.float64, device=device)
    # Σ sign and Σ sign² of the inner values: per column when grouped, else in total. Sums of
    # ±1 and 0 are exact in float32 up to 2^24 terms (a chunk, or B per column).
    shape = (width,) if groups is not None else ()
    signed = torch.zeros(shape, dtype=torch.float64, device=device)
    nonzero = torch.zeros(shape, dtype=torch.float64, device=device)
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
    columns = (torch.cat(outer_columns) if outer_columns
               else torch.zeros(0, dtype=torch.long, device=device))
    if groups is None:
        inner = torch.tensor(float(by_sign * width - columns.numel()), dtype=torch.float64,
                             device=device)
        s, a, total = (t.reshape(1) for t in (signed, nonzero, inner))
    else:
        inner = by_sign - torch.bincount(columns, minlength=width).double()
        s, a, total = torch.zeros(3, n_groups, dtype=torch.float64, device=device).index_add_(
            1, groups, torch.stack([signed, nonzero, inner]))
    negative, zero, positive = (a - s) / 2, total - a, (a + s) / 2
    for cls, part in zip(axis.sign_classes, (negative, zero, positive)):
        counts[:, cls] += part
    return counts


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
