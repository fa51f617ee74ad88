"""Models whose parameters are sharded across ranks (FSDP2, FSDP, tensor parallel).

Under `torch.distributed.fsdp.fully_shard` (FSDP2) each rank holds a DTensor shard of every
parameter and its gradient; under `FullyShardedDataParallel` (FSDP1) flat shards. An
instrument that reads whole parameters and gradients would, on a shard, compute a value of
that rank's slice, plausible and wrong. FSDP2 models get the quantities that are sums over
elements (instruments/sharded.py); FSDP1 and tensor-parallel DTensor parameters are refused
in one line (docs/LIMITATIONS.md, "FSDP2").
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from ..distributed import Reducer, is_dtensor

_SEE = "see docs/LIMITATIONS.md, 'FSDP2'"


def sharding_of(model: nn.Module) -> str | None:
    """How `model` is sharded across ranks ("FSDP2 (fully_shard) module 'x'", "a DTensor
    parameter 'x.weight'", ...), or None when no parameter is sharded.

    Costs nothing for ordinary models: DTensor and FSDP exist only once their torch
    modules are imported, which sharding imports.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        found = None
        for name, module in model.named_modules():
            if isinstance(module, getattr(fsdp, "FullyShardedDataParallel", ())):
                return f"FullyShardedDataParallel module {name or '<root>'!r}"
            if found is None and isinstance(module, getattr(fsdp, "FSDPModule", ())):
                found = f"FSDP2 (fully_shard) module {name or '<root>'!r}"
        if found is not None:
            return found
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is not None:
        for name, p in model.named_parameters():
            if isinstance(p, tensor.DTensor):
                return f"a DTensor parameter {name!r}"
    return None


def refuse_sharded(model: nn.Module, what: str) -> None:
    """Raise a one-line ValueError if `model`'s parameters are sharded across ranks.

    what: who refuses (e.g. "deepscope's instruments"), the start of the message.
    """
    found = sharding_of(model)
    if found is not None:
        raise ValueError(
            f"{what}: parameters sharded across ranks are not supported yet (the model has "
            f"{found}): each rank would compute its shard's values as if they were the whole "
            f"model's; instrument a DDP run of the model (replicated parameters) instead, {_SEE}")


def fsdp2_model(model: nn.Module, reducer: Reducer | None, what: str) -> bool:
    """Whether `model` is an FSDP2 model the instruments support shard-wise (True), or not
    sharded at all (False). Raises a one-line ValueError for any other sharding: FSDP1, a
    DTensor parameter without fully_shard, an FSDP2 model without a reducer (its values
    would be one rank's shards), parameters that are not DTensors on a mesh of every rank,
    or a Partial placement.
    """
    found = sharding_of(model)
    if found is None:
        return False
    if not found.startswith("FSDP2"):
        refuse_sharded(model, what)
    if reducer is None:
        raise ValueError(
            f"{what}: an FSDP2 model ({found}) needs distributed instruments, which sum its "
            "shards over the ranks: create the Scope with distributed='auto' (the default) "
            f"after dist.init_process_group(...), or pass reducer=Reducer.create(); {_SEE}")
    placements = sys.modules["torch.distributed.tensor"]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not is_dtensor(p):
            why = "is not sharded by fully_shard (its gradient is not reduced across ranks)"
        elif p.device_mesh.size() != reducer.world_size:
            why = (f"is sharded on a mesh of {p.device_mesh.size()} ranks, not all "
                   f"{reducer.world_size}")
        elif not all(isinstance(s, (placements.Shard, placements.Replicate))
                     for s in p.placements):
            why = f"has placements {tuple(p.placements)} (only Shard and Replicate are summed)"
        else:
            continue
        raise ValueError(f"{what}: the FSDP2 model's parameter {name!r} {why}; shard every "
                         f"trainable parameter with fully_shard on one mesh of all ranks, {_SEE}")
    return True


def local_shards(params: list[Tensor]) -> list[Tensor]:
    """Each DTensor's local shard (its elements on this rank, without padding), detached;
    other tensors as they are."""
    return [(p.to_local() if is_dtensor(p) else p).detach() for p in params]


def counted(params: list[Tensor]) -> Tensor:
    """(K,) float64: 1 where this rank's shard of the parameter counts in a sum over ranks,
    0 where another rank holds the same elements (a Replicate mesh dimension, e.g. HSDP:
    only coordinate 0 of it counts), so that every element is summed once."""
    replicate = sys.modules["torch.distributed.tensor"].Replicate
    weights = []
    for p in params:
        mesh = p.device_mesh
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        weights.append(float(all(c == 0 for c, s in zip(coordinate, p.placements)
                                 if isinstance(s, replicate))))
    return torch.tensor(weights, dtype=torch.float64)
