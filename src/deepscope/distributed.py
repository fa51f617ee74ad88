"""deepscope's own collectives across the ranks of a `torch.distributed` job.

Every instrument value of a distributed run means the global batch: each rank computes
additive statistics of its micro-batch and one packed float64 all-reduce sums them (see
DISTRIBUTED.md). The collectives run on a gloo process group of deepscope's own, so they
never interleave with the user's (DDP's buckets, NCCL streams) and a timeout is an
exception deepscope can recover from (NCCL's watchdog would abort the process); on an
accelerator each call copies its packed vector to the host and back.

A collective that fails or times out turns the reducer off for the rest of the run
(`disabled` says why); every later call raises `CollectiveError` at once, without
communicating, so a dead or stuck rank costs one timeout, not one per step.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_TIMEOUT_S = 120.0


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a DTensor, a shard of a tensor sharded across ranks (free when
    DTensor was never imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class CollectiveError(RuntimeError):
    """A collective of deepscope's failed (timeout, dead rank) or the reducer is off."""


class Reducer:
    """Packed float64 collectives on a process group of deepscope's own.

    Create it with `Reducer.create` on every rank at the same point of the program (making
    the group is itself collective).

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        calls: collectives issued so far (each `sum` / `max` / `broadcast_text` is one).
        disabled: why the reducer was turned off, or None while it works.
    """

    def __init__(self, group: object, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.calls = 0
        self.disabled: str | None = None

    @classmethod
    def create(cls, mode: bool | str = "auto",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Reducer | None:
        """A reducer when `mode` asks for one and a process group of world size > 1 is
        initialised, else None (per-rank local values).

        mode: "auto" (on when such a group exists), True (on; raises without a group),
            False (off).
        """
        if mode is False:
            return None
        if mode not in ("auto", True):
            raise ValueError(f"distributed must be 'auto', True or False, got {mode!r}")
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not ready:
            if mode is True:
                raise ValueError("distributed=True needs an initialised torch.distributed "
                                 "process group of world size > 1; call "
                                 "dist.init_process_group(...) first, or pass "
                                 "distributed='auto'")
            return None
        group = dist.new_group(backend="gloo",
                               timeout=datetime.timedelta(seconds=float(timeout_s)))
        return cls(group, dist.get_rank(), dist.get_world_size())

    def _run(self, op: str, flat: Tensor) -> Tensor:
        if self.disabled is not None:
            raise CollectiveError(self.disabled)
        self.calls += 1
        dist = torch.distributed
        try:
            if op == "broadcast":
                dist.broadcast(flat, src=0, group=self.group)
            else:
                reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
                dist.all_reduce(flat, op=reduce_op, group=self.group)
        except Exception as error:  # gloo raises RuntimeError on timeouts and closed peers
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.disabled = (f"a collective across ranks failed ({type(error).__name__}: "
                             f"{first[:200]}); distributed instruments are off for the rest "
                             "of the run")
            raise CollectiveError(self.disabled) from error
        return flat

    def _packed(self, op: str, tensors: Sequence[Tensor]) -> list[Tensor]:
        if not tensors:
            return []
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
        out = self._run(op, flat)
        results, at = [], 0
        for t in tensors:
            n = t.numel()
            results.append(out[at:at + n].reshape(t.shape).to(t.device))
            at += n
        return results

    def sum(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Σ over ranks of each tensor, in ONE all-reduce: float64, same shapes, each on its
        tensor's device. Raises CollectiveError (then the reducer is off)."""
        return self._packed("sum", tensors)

    def max(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Element-wise max over ranks, in one all-reduce (float64, as `sum`)."""
        return self._packed("max", tensors)

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ok (one all-reduce of a flag)."""
        (failed,) = self.max([torch.tensor([0.0 if ok else 1.0])])
        return not bool(failed.item())

    def broadcast_text(self, text: str, length: int = 256) -> str:
        """Rank 0's `text` (ASCII, at most `length` characters) on every rank."""
        data = text.encode("ascii")
        if len(data) > length:
            raise ValueError(f"text longer than {length} characters")
        flat = torch.zeros(length + 1, dtype=torch.float64)
        flat[0] = len(data)
        flat[1:1 + len(data)] = torch.tensor(list(data), dtype=torch.float64)
        out = self._run("broadcast", flat)
        return bytes(int(v) for v in out[1:1 + int(out[0])].tolist()).decode("ascii")
