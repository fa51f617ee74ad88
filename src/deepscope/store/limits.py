"""Caps on what a stored file can make a reader allocate or compute (docs/LIMITATIONS.md).

A run file is data from elsewhere: every size it declares (an array's shape, a step's
iteration count, a histogram's bins, a graph's node count, a JSON text) is checked against a
cap here *before* anything of that size is allocated, and a value above its cap is a
`CorruptRunError` naming the field. The caps sit far above what recording writes, so they
only ever refuse crafted or damaged files.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CorruptRunError

MiB = 2**20

# --- arrays ---------------------------------------------------------------------------------
MAX_DIM = 2**36            # one dimension of a stored array or tensor shape
MAX_TENSOR_NUMEL = 2**40   # elements of a recorded tensor (tensors.shape); 2 TB of bfloat16
# A step part (the bytes of a step's arrays of one dtype) inflates to at most
# max(MIN_PART_CAP, PART_FILE_RATIO x the rank file's size with its write-ahead log): a
# compressed "bomb" cannot make a small file cost more than a fixed amount of memory, while
# recorded data (which compresses 1-4x, not 1000x) always fits. A trusted small file of
# mostly zeros can be read with a larger DEEPSCOPE_MIN_PART_CAP_MB.
MIN_PART_CAP = int(os.environ.get("DEEPSCOPE_MIN_PART_CAP_MB", "16")) * MiB
PART_FILE_RATIO = 4
PART_CACHE_BYTES = 64 * MiB  # decoded parts a reader keeps (the last few steps read)


def part_cap(file_bytes: int) -> int:
    """Bytes one decoded step part of a rank file of `file_bytes` (with its log) may have."""
    return max(MIN_PART_CAP, PART_FILE_RATIO * file_bytes)


def read_peak_cap(file_bytes: int) -> int:
    """The documented bound on the memory one read of a rank file may add: the parts a reader
    caches, plus one part being decoded and the float32 array made of it (3 parts)."""
    return PART_CACHE_BYTES + 3 * part_cap(file_bytes)

# --- metadata -------------------------------------------------------------------------------
MAX_JSON_CHARS = 16 * MiB       # any stored JSON text: graph body, metadata, shapes
MAX_ITERATIONS = 10_000         # steps.iterations: iterations of one step
MAX_SAMPLES = 4_096             # meta max_samples: batch items stored per tensor record
MAX_HISTOGRAM_BINS = 2**20      # bins per axis of a stored histogram
MAX_GRAPH_TENSORS = 20_000      # tensors of one stored dependency graph
MAX_GRAPH_EDGES = 200_000       # edges of one stored dependency graph
MAX_WORLD_SIZE = 2**17          # meta distributed.world_size: ranks a reader lists


def capped_int(value: Any, cap: int, field: str, *, low: int = 0) -> int:
    """`value` as an int in [low, cap]; else a one-line CorruptRunError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptRunError(f"stored {field} is {_show(value)}, not an integer; the file is "
                              "damaged")
    if not low <= value <= cap:
        raise CorruptRunError(f"stored {field} is {value}, outside [{low}, {cap}] (the "
                              "documented cap); the file is damaged or crafted")
    return value


def _show(value: Any) -> str:
    """A short, printable rendering of a stored value for an error message."""
    text = repr(value)[:40]
    return "".join(c if c.isprintable() else "?" for c in text)
