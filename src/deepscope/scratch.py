"""Reused work buffers, one per (thread, slot): on the CPU a fresh large allocation page-faults
on every use (~0.4 ms per 800 kB, more than most passes over the data), a reused one does not.
"""

from __future__ import annotations

import math
import threading

import torch

_local = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, slot: str,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor of `shape` from this thread's buffer `slot` (grown as needed).

    Valid until the next call with the same slot on this thread. Off the CPU a plain
    allocation (the caching allocator already reuses memory there).
    """
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buf = getattr(_local, slot, None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_local, slot, buf)
    return buf[:numel].view(shape)
