"""Arrays as raw little-endian bytes with a dtype name and a JSON shape — never pickle."""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CorruptRunError
from .limits import MAX_DIM

if TYPE_CHECKING:
    import torch

# Only plain numeric dtypes can be stored or read back; anything else in a file is corrupt.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                 "bool")
}
# bfloat16 (numpy has no such dtype) is stored as its raw 16 bits and widened to float32 on read.
BFLOAT16 = "bfloat16"
# numpy 1 reshapes to at most 32 dims; torch records more only in contrived cases.
MAX_NDIM = 32
# A shape of MAX_NDIM 20-digit dims fits; longer text is crafted, and is refused unparsed.
MAX_SHAPE_CHARS = 24 * MAX_NDIM


def itemsize(dtype: str) -> int:
    """Bytes per element of a stored dtype name (bfloat16: 2)."""
    return 2 if dtype == BFLOAT16 else DTYPES[dtype].itemsize


def encode(array: np.ndarray | torch.Tensor) -> tuple[str, str, bytes]:
    """Return (dtype name, JSON shape, little-endian bytes) for a numeric array or host tensor."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded: readers
    if torch is not None and isinstance(array, torch.Tensor):  # never load it
        t = array.detach().cpu()
        if t.dtype == torch.bfloat16:
            bits = t.contiguous().view(torch.int16).numpy().astype("<i2")
            return BFLOAT16, json.dumps(list(t.shape)), bits.tobytes()
        array = t.numpy()
    arr = np.asarray(array)
    name = arr.dtype.name
    if name not in DTYPES:
        raise TypeError(f"cannot store arrays of dtype {name}; convert to float32 or int64 first")
    data = np.ascontiguousarray(arr, dtype=DTYPES[name]).tobytes()
    return name, json.dumps(list(arr.shape)), data


def decode(dtype: str, shape: str, data: bytes | memoryview) -> np.ndarray:
    """Inverse of `encode`; validates everything, so a crafted file cannot make us allocate.

    The result is the only allocation: `data` (bytes, or a view into a step's part) is read in
    place, and bfloat16 bits are written straight into the high halves of float32 words.
    """
    if dtype == BFLOAT16:
        bits = _checked("int16", shape, data)
        out = np.zeros(bits.size, np.dtype("<u4"))
        out.view("<u2")[1::2] = bits.reshape(-1).view("<u2")  # little-endian: high half 2nd
        return out.view("<f4").reshape(bits.shape).astype(np.float32, copy=False)
    return _checked(dtype, shape, data).astype(DTYPES[dtype].newbyteorder("="))


def _checked(dtype: str, shape: str, data: bytes | memoryview) -> np.ndarray:
    """A read-only little-endian view of `data` with the declared shape, all checked."""
    if dtype not in DTYPES:
        raise CorruptRunError(f"stored array has unknown dtype {str(dtype)[:32]!r}; the file is "
                              "corrupt")
    if not isinstance(shape, str) or len(shape) > MAX_SHAPE_CHARS:
        raise CorruptRunError("stored array has an overlong or non-text shape; the file is "
                              "corrupt")
    try:
        dims = json.loads(shape)
    except ValueError:
        raise CorruptRunError(
            f"stored array has unreadable shape {shape!r}; the file is corrupt") from None
    if (not isinstance(dims, list) or len(dims) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM
                       for d in dims)):
        raise CorruptRunError(f"stored array has invalid shape {shape!r}; the file is corrupt")
    if not isinstance(data, (bytes, memoryview)):
        raise CorruptRunError("stored array data is not a blob; the file is corrupt")
    expected = math.prod(dims) * DTYPES[dtype].itemsize
    if expected != len(data):
        raise CorruptRunError(
            f"stored array declares shape {dims} ({expected} bytes) but holds {len(data)} bytes;"
            " the file is corrupt")
    return np.frombuffer(data, dtype=DTYPES[dtype]).reshape(dims)
