"""Reused buffers for the private copies the recorder takes of the user's tensors.

A fresh allocation of a large tensor page-faults on every recorded step (on the CPU ~0.4 ms for
800 kB, as much as the copy itself ten times over); copying into a buffer that the writer handed
back after summarising costs only the copy.
"""

from __future__ import annotations

import sys
import threading

import torch

_PER_KEY = 4       # spare buffers kept per (shape, dtype, device)
_MAX_KEYS = 512    # distinct shapes kept; more means shapes change every step: keep none


def is_private(tensor: torch.Tensor, refs: int) -> bool:
    """Whether nobody but the caller can reach `tensor` or its memory, so that it can be kept
    as it is instead of copied: the caller holds `refs` Python references to it, no other
    tensor shares its storage (a view's base only through the view, e.g. a gradient that
    autograd produced as a view), it needs no autograd graph, and it is contiguous (as the
    copies are). False when any of this cannot be told: the caller then copies."""
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return False  # free-threaded Python: reference counts are not exact
    try:
        # this frame's argument and getrefcount's own add two references
        if (tensor.requires_grad or not tensor.is_contiguous()
                or sys.getrefcount(tensor) != refs + 2 or tensor._use_count() != 1):
            return False
        storage_refs = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
        if not tensor._is_view():
            return storage_refs == 2  # the tensor and the storage object made here
        base = tensor._base
        # the view, its base and the storage object made here; the base held only by the
        # view (and the Python object made here)
        return (storage_refs == 3 and base._use_count() == 2
                and sys.getrefcount(base) == 3)
    except (AttributeError, RuntimeError, TypeError):  # another torch: those calls changed
        return False


class BufferPool:
    """Copies tensors into reused buffers; thread-safe (the writer thread releases)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous private copy of `tensor` (detached), from the pool when one fits."""
        key = (tensor.shape, tensor.dtype, tensor.device)
        with self._lock:
            spare = self._free.get(key)
            buf = spare.pop() if spare else None
        if buf is None:
            buf = torch.empty(key[0], dtype=key[1], device=key[2])
        # detached: the copy is not part of the user's graph (cheaper than a no_grad block)
        return buf.copy_(tensor.detach())

    def copy_all(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`copy` of each of `tensors`, in one batched copy (a torch op costs ~10 µs of
        overhead on the CPU, more than copying a small tensor)."""
        if len(tensors) < 2:
            return [self.copy(t) for t in tensors]
        keys = [(t.shape, t.dtype, t.device) for t in tensors]
        with self._lock:
            bufs = []
            for key in keys:
                spare = self._free.get(key)
                bufs.append(spare.pop() if spare else None)
        bufs = [torch.empty(key[0], dtype=key[1], device=key[2]) if buf is None else buf
                for key, buf in zip(keys, bufs)]
        torch._foreach_copy_(bufs, [t.detach() for t in tensors])
        return bufs

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Hand buffers back once nothing reads them any more."""
        with self._lock:
            for buf in buffers:
                key = (buf.shape, buf.dtype, buf.device)
                spare = self._free.get(key)
                if spare is None:
                    if len(self._free) >= _MAX_KEYS:
                        continue
                    spare = self._free[key] = []
                if len(spare) < _PER_KEY:
                    spare.append(buf)
