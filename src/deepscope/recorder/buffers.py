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
        return self.copy_all([tensor])[0]

    def copy_all(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`copy` of each of `tensors`, in one batched copy (a torch op costs ~10 µs of
        overhead on the CPU, more than copying a small tensor)."""
        if not tensors:
            return []
        keys = [(tuple(t.shape), t.dtype, t.device) for t in tensors]
        with self._lock:
            bufs = []
            for key in keys:
                spare = self._free.get(key)
                bufs.append(spare.pop() if spare else None)
        bufs = [torch.empty(key[0], dtype=key[1], device=key[2]) if buf is None else buf
                for key, buf in zip(keys, bufs)]
        with torch.no_grad():  # the copies are not part of the user's graph
            torch._foreach_copy_(bufs, tensors)
        return bufs

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
