"""What a `Scope` does differently in a distributed run (see docs/distributed.md, Recording).

Every rank records its own file; the ranks agree, through deepscope's `Reducer`, on what
must be the same everywhere: whether the run could be opened, rank 0's run id, which
dynamic steps are kept. Everything here that communicates is called at points every rank
reaches in the same order (rank-identical decisions only), so no rank waits alone.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import Reducer
from ..records import QuantityValue, TensorInfo


def world_size() -> int:
    """The torch.distributed world size, 1 without an initialised process group."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def unwrap(model: nn.Module) -> nn.Module:
    """The module a user's wrappers hold: `torch.compile`'s `_orig_mod` and
    DistributedDataParallel's `.module`, in any order. The wrappers stay as they are."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def first_failure(reducer: Reducer, error: Exception | None) -> int | None:
    """Whether any rank failed (one MAX all-reduce): the highest failing rank, else None.
    Every rank must call it at the same point."""
    (flag,) = reducer.max([torch.tensor([0.0 if error is None else reducer.rank + 1.0])])
    worst = int(flag.item())
    return worst - 1 if worst else None


def any_rank(reducer: Reducer, flag: bool) -> bool:
    """Whether `flag` holds on some rank (one MAX all-reduce)."""
    return not reducer.agree(not flag)


def run_meta(reducer: Reducer, run_id: str) -> dict:
    """The `distributed` meta key of every rank file; `run_id`: rank 0's (broadcast)."""
    dist = torch.distributed
    return {"world_size": reducer.world_size, "rank": reducer.rank,
            "backend": str(dist.get_backend()), "run_id": run_id}


def agree_run_id(reducer: Reducer, own: str) -> str:
    """Rank 0's run id on every rank (one broadcast)."""
    return reducer.broadcast_text(own)


def local_values(step: int, losses: list[tuple[torch.Tensor, torch.Tensor | None]],
                 infos: list[TensorInfo], iterations: int) -> list[QuantityValue]:
    """This rank's "BatchSize" and "Loss" of a recorded step without instruments, as local
    values (each rank's `local_quantities`).

    losses: (loss, per_sample or None) of each rec.loss call. BatchSize: the samples of the
    per_sample losses of every call, else (one iteration only) the batch dimension of the
    first recorded input (else batched) tensor. Loss: the mean ℓᵢ over those samples when
    every call gave per_sample, else the loss of a single rec.loss call as given (as the
    Loss instrument takes it); missing with the reason otherwise.
    """
    if not losses and not infos:
        return []
    out = []
    samples = None
    if losses and all(ps is not None for _, ps in losses):
        from ..instruments.step import reduce_loss  # the instruments' one definition of ℓᵢ

        per_sample = torch.cat([reduce_loss(loss, ps)[0] for loss, ps in losses])
        samples = int(per_sample.shape[0])
        out.append(QuantityValue("Loss", step, value=float(per_sample.mean()),
                                 meta={"samples": samples}, local=True))
    elif len(losses) == 1:
        out.append(QuantityValue("Loss", step, value=float(losses[0][0].detach().double()),
                                 meta={"estimator": "the loss as passed to rec.loss"},
                                 local=True))
    elif losses:
        out.append(QuantityValue("Loss", step, local=True, meta={
            "reason": "several rec.loss calls without per_sample=: pass per_sample= to weigh "
                      "the micro-batches by their samples"}))
    if samples is None:
        batched = [i for i in infos if i.batch_dim is not None and i.role != "parameter"]
        batched.sort(key=lambda i: i.role != "input")  # inputs first, then in record order
        if batched and iterations == 1:
            first = batched[0]
            samples = int(first.shape[first.batch_dim])
    if samples is not None:
        out.append(QuantityValue("BatchSize", step, value=float(samples), local=True))
    elif losses or infos:
        out.append(QuantityValue("BatchSize", step, local=True, meta={
            "reason": "no per_sample= losses and no single-iteration batched tensor to count "
                      "samples from; pass per_sample= to rec.loss"}))
    return out
