"""Instrument values of an FSDP2 (`fully_shard`) model over the global batch.

Each rank holds a shard of every parameter and of its gradient (the gradient already
reduce-scattered: FSDP2 averages the ranks' gradients). The quantities that are sums over
samples or over parameter elements come out exact from ONE packed SUM all-reduce per
instrumented step: Loss (each rank's samples and Σℓᵢ), GradNorm (Σ ḡ² of the gradient
shards), Distance (Σ (θₜ − θ₀)² of the shards, taken at start()) and UpdateSize
(Σ (θₜ₊₁ − θₜ)²). A shard that another rank also holds (a Replicate mesh dimension) counts
on one rank only (`sharding.counted`).

GradNorm is the norm of the FSDP2-reduced `.grad`, (1/W) Σ_r ∇L_r: the global batch's mean
gradient ḡ when every rank has the same number of samples and the backward's loss is the
mean loss given to rec.loss in one call. Otherwise it is missing with the reason. Every
other quantity needs whole per-sample gradients or whole parameters: missing with
`NOT_SHARDED` (one warning).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import QuantityValue
from .global_batch import _N, LOSS_NEEDS_PER_SAMPLE, GlobalStep, _Pack
from .quantities import with_total
from .quantities.norms import squared_norms
from .sharding import counted, local_shards
from .step import StepState, rows

SHARDED_QUANTITIES = frozenset({"Loss", "GradNorm", "Distance", "UpdateSize"})
NOT_SHARDED = ("needs whole per-sample gradients; not supported for sharded parameters "
               "(FSDP2) yet — see docs/LIMITATIONS.md")
GRAD_SOURCE = "the FSDP2-reduced .grad shards"
GRAD_NEEDS_PER_SAMPLE = ("GradNorm of an FSDP2 model needs the per-sample losses on every rank, "
                         "to check that the ranks' batch sizes are equal: "
                         "rec.loss(loss, per_sample=losses)")
_STATS = {"GradNorm": "grad", "Distance": "distance", "UpdateSize": "update"}


def shard_squares(tensors: list[Tensor], params: list[Tensor]) -> Tensor:
    """(K,) float64 Σ t² of each local shard in `tensors`, 0 where the shard of `params`
    (the DTensor parameters) is counted on another rank."""
    return squared_norms(tensors).cpu() * counted(params)


class ShardedStep(GlobalStep):
    """One instrumented step of an FSDP2 model: `values()` as `GlobalStep`'s, from one
    packed call; the local values are the rank's Loss and BatchSize."""

    def __init__(self, inst: Any, state: StepState, update: list[Tensor] | None,
                 no_loss: str) -> None:
        super().__init__(inst, state, None, no_loss, update, no_loss, {})
        self.unsupported = dict.fromkeys(state.due - SHARDED_QUANTITIES, NOT_SHARDED)
        self.items = sorted(state.due & SHARDED_QUANTITIES)
        self.stats = {"moments"}
        if self.unsupported:  # one warning for the run: every chosen one it misses
            chosen = frozenset(inst.quantities) - SHARDED_QUANTITIES
            inst._warn(f"{', '.join(sorted(chosen))}: {NOT_SHARDED}", chosen)

    def _check_local(self) -> None:
        state = self.state
        for item in self.items:
            if item == "Distance" and state.distance is None:
                self.local_failed[item] = "θ₀ was not taken"
            elif item == "UpdateSize" and self.update is None:
                self.local_failed[item] = "θₜ was not taken at start()"
            elif item in ("Distance", "UpdateSize"):
                continue
            elif state.loss is None:
                self.local_failed[item] = self.no_loss
            elif item in state.failed:
                self.local_failed[item] = state.failed[item]
            elif state.losses is None:
                self.local_failed[item] = (LOSS_NEEDS_PER_SAMPLE if item == "Loss" else
                                           GRAD_NEEDS_PER_SAMPLE)
            elif item == "GradNorm":
                self._check_gradient()

    def _check_gradient(self) -> None:
        state, why = self.state, None
        if state.reduction != "mean":
            why = (f"the loss is a {state.reduction} of the per-sample losses; FSDP2's "
                   "reduced .grad is the global mean gradient only for a mean loss")
        elif len(state.counts) > 1:
            why = ("several rec.loss calls in this step (gradient accumulation): the "
                   "factors of the micro-batches' backward cannot be read from the shards")
        else:
            lacking = [n for n, p in zip(self.names, self.params) if p.grad is None]
            if lacking:
                why = f"parameter {lacking[0]!r} has no .grad at finish()"
        if why is not None:
            self.local_failed["GradNorm"] = why

    def _phase_one(self, bound: float | None) -> dict[str, Tensor]:
        pack = _Pack(self.reducer)
        flags = pack.block("flags", len(self.items))
        moments = pack.block("moments", 2)  # samples, Σℓᵢ
        fields = {_STATS[item]: pack.add(_STATS[item], (len(self.names),))
                  for item in self.items if item in _STATS}
        return self._reduce(pack, flags, lambda: self._fill_shards(moments, fields))

    @torch.no_grad()
    def _fill_shards(self, moments: Tensor, fields: dict[str, Tensor]) -> None:
        state, params = self.state, self.params
        if state.losses is not None:
            moments[_N] = state.losses.shape[0]
            moments[1] = state.losses.double().sum()
        for item, stat in _STATS.items():
            if stat not in fields or item in self.local_failed:
                continue
            if stat == "grad":
                fields[stat].copy_(shard_squares(local_shards([p.grad for p in params]),
                                                 params))
            elif stat == "update":
                fields[stat].copy_(shard_squares(self.update, params))
            else:
                fields[stat].copy_(state.distance)

    def _value(self, item: str, reduced: dict[str, Tensor], *_: Any) -> list[QuantityValue]:
        step, counts = self.state.step, reduced["moments"]
        size = int(counts[:, _N].sum())
        if item == "Loss":
            return [QuantityValue("Loss", step, value=float(counts[:, 1].sum()) / size,
                                  meta={"reduction": self.state.reduction, "samples": size})]
        meta: dict[str, Any] = {}
        if item == "GradNorm":
            sizes = [int(n) for n in counts[:, _N].tolist()]
            if len(set(sizes)) > 1:
                raise ValueError(
                    "FSDP2's reduced gradient averages the ranks' mean gradients, which is "
                    f"not the global batch's mean gradient when the ranks' batch sizes differ "
                    f"({', '.join(map(str, sizes))}); give every rank the same batch size")
            meta["source"] = GRAD_SOURCE
        norms = with_total(reduced[_STATS[item]]).sqrt()
        return rows(item, step, self.names, norms, meta)
