"""Reused buffers for the private copies the recorder takes of the user's tensors.

A fresh allocation of a large tensor page-faults on every recorded step (on the CPU ~0.4 ms for
800 kB, as much as the copy itself ten times over); copying into a buffer that the writer handed
back after summarising costs only the copy.
"""

from __future__ import annotations

import threading

import torch

_PER_KEY = 4       # spare buffers kept per (shape, dtype, device)
_MAX_KEYS = 512    # distinct shapes kept; more means shapes change every step: keep none


class BufferPool:
    """Copies tensors into reused buffers; thread-safe (the writer thread releases)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous private copy of `tensor` (detached), from the pool when one fits."""
        key = (tuple(tensor.shape), tensor.dtype, tensor.device)
        with self._lock:
            spare = self._free.get(key)
            buf = spare.pop() if spare else None
        if buf is None:
            buf = torch.empty(key[0], dtype=tensor.dtype, device=tensor.device)
        return buf.copy_(tensor.detach())

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Hand buffers back once nothing reads them any more."""
        with self._lock:
            for buf in buffers:
                key = (tuple(buf.shape), buf.dtype, buf.device)
                spare = self._free.get(key)
                if spare is None:
                    if len(self._free) >= _MAX_KEYS:
                        continue
                    spare = self._free[key] = []
                if len(spare) < _PER_KEY:
                    spare.append(buf)
