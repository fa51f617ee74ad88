"""Refuse models whose parameters are sharded across ranks (FSDP2, FSDP, tensor parallel).

Under `torch.distributed.fsdp.fully_shard` (FSDP2) each rank holds a DTensor shard of every
parameter and its gradient; under `FullyShardedDataParallel` (FSDP1) flat shards. Every
instrument reads whole parameters and gradients, so on a shard it would compute a value of
that rank's slice, plausible and wrong. Until the instruments reduce shard-wise, they
refuse such a model in one line (docs/LIMITATIONS.md, "FSDP2").
"""

from __future__ import annotations

import sys

from torch import nn


def sharding_of(model: nn.Module) -> str | None:
    """How `model` is sharded across ranks ("FSDP2 (fully_shard) module 'x'", "a DTensor
    parameter 'x.weight'", ...), or None when no parameter is sharded.

    Costs nothing for ordinary models: DTensor and FSDP exist only once their torch
    modules are imported, which sharding imports.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        for name, module in model.named_modules():
            if isinstance(module, getattr(fsdp, "FSDPModule", ())):
                return f"FSDP2 (fully_shard) module {name or '<root>'!r}"
            if isinstance(module, getattr(fsdp, "FullyShardedDataParallel", ())):
                return f"FullyShardedDataParallel module {name or '<root>'!r}"
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
            "model's; instrument a DDP run of the model (replicated parameters) instead, see "
            "docs/LIMITATIONS.md, 'FSDP2'")
