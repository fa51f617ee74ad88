"""Closed forms for nn.Embedding and nn.EmbeddingBag: per-sample gradients are scatter-adds
of output rows.

Embedding: gᵢ(W)[v] = Σ_{t: idx[i,t] = v} G[i,t]; EmbeddingBag (modes sum and mean):
gᵢ(W)[v] = Σ_{t in bag i: idx[t] = v} cₜ G[i], cₜ the token's per_sample_weight (or 1), or
1 / (the bag's non-padding tokens) for mean. Only the rows a sample touched are non-zero, so
the rules keep one summed row per distinct (sample, index) pair — U ≤ B·T rows of size D —
and get every statistic from those rows without a (B, V, D) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .base import Call, Context, ModuleGrads, Rule, Unsupported, first_input
from .generic import GenericRule


class EmbeddingGrads(ModuleGrads):
    """Statistics from rows (U, D) with their sample (U,) and vocabulary index (U,)."""

    def __init__(
        self, rows: Tensor, sample: Tensor, index: Tensor, shape: torch.Size, ctx: Context
    ) -> None:
        super().__init__({"weight": shape}, rows.dtype, ctx)
        self.rows, self.sample, self.index = rows, sample, index

    def _per_sample_sum(self, values: Tensor) -> Tensor:
        out = values.new_zeros(self.ctx.batch_size)
        return out.index_add_(0, self.sample, values)

    def _per_row_sum(self, values: Tensor) -> Tensor:
        out = values.new_zeros(self.shapes["weight"])
        return out.index_add_(0, self.index, values)

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        out = self.rows.new_zeros(hi - lo, *self.shapes["weight"])
        keep = (self.sample >= lo) & (self.sample < hi)
        out[self.sample[keep] - lo, self.index[keep]] = self.rows[keep]
        return {"weight": out}

    def sq_norms(self) -> dict[str, Tensor]:
        return {"weight": self._per_sample_sum(self.rows.square().sum(1))}

    def grad_sum(self, observed: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        return {"weight": self._per_row_sum(self.rows)}  # as cheap as checking `observed`

    def second_moments(self) -> dict[str, Tensor]:
        return {"weight": self._per_row_sum(self.rows.square())}

    def dots(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        return [
            {"weight": self._per_sample_sum((self.rows * v["weight"][self.index]).sum(1))}
            if "weight" in v else {}
            for v in vector_sets
        ]


class EmbeddingRule(Rule):
    """nn.Embedding (indices (B, …)); padding_idx rows get no gradient, as in PyTorch."""

    def unsupported(self) -> str | None:
        return _scale_grad_reason(self.module)

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        weight = self.params["weight"]
        dim = weight.shape[1]
        samples, indices, rows = [], [], []
        for call in calls:
            idx = first_input(call)
            if idx.dim() == 0:
                raise Unsupported("its input is a 0-d index without a batch dimension")
            g = self._grad(call, ctx, weight.dtype).reshape(-1, dim)
            sample = torch.arange(idx.shape[0], device=idx.device).repeat_interleave(idx[0].numel())
            samples.append(sample)
            indices.append(idx.reshape(-1))
            rows.append(g)
        sample, index, row = torch.cat(samples), torch.cat(indices), torch.cat(rows)
        return _merged(sample, index, row, self.module.padding_idx, weight.shape, ctx)


def _merged(sample: Tensor, index: Tensor, row: Tensor, padding_idx: int | None,
            shape: torch.Size, ctx: Context) -> EmbeddingGrads:
    """Rows (N, D) of samples (N,) at vocabulary indices (N,), padding dropped, summed into
    one row per (sample, index) pair."""
    vocab, dim = shape
    if padding_idx is not None:
        keep = index != padding_idx
        sample, index, row = sample[keep], index[keep], row[keep]
    keys, inverse = torch.unique(sample * vocab + index, return_inverse=True)
    summed = row.new_zeros(keys.shape[0], dim).index_add_(0, inverse, row)
    return EmbeddingGrads(summed, keys // vocab, keys % vocab, shape, ctx)


def _scale_grad_reason(module: nn.Module) -> str | None:
    if module.scale_grad_by_freq:
        return ("scale_grad_by_freq couples samples through batch word counts (per-sample "
                "gradients scale by each sample's own counts)")
    return None


class EmbeddingBagRule(GenericRule):
    """nn.EmbeddingBag: input (B, T), or 1-D with offsets (bag i is a sample: B bags, not
    the input's dim 0). Modes sum and mean by the closed form; mode max by the generic rule
    (torch.func re-runs), for a (B, T) input only."""

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
        super().__init__(module, params)
        self.keeps_outputs = module.mode == "max"  # only the generic re-run checks them

    def unsupported(self) -> str | None:
        return _scale_grad_reason(self.module)

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return super().capture(args, kwargs) if self.module.mode == "max" else None

    def _inputs(self, call: Call) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(input, offsets, per_sample_weights) of a call."""
        names = ("input", "offsets", "per_sample_weights")
        values = [call.args[k] if len(call.args) > k else call.kwargs.get(n)
                  for k, n in enumerate(names)]
        if not isinstance(values[0], Tensor):
            raise Unsupported(f"its first input is {type(values[0]).__name__}, not a tensor")
        return values[0], values[1], values[2]

    def batch_size(self, call: Call) -> int:
        x, offsets, _ = self._inputs(call)
        if x.dim() == 2:
            return int(x.shape[0])
        if x.dim() == 1 and offsets is not None:
            return offsets.numel() - int(self.module.include_last_offset)
        raise Unsupported("its input is neither (B, T) nor 1-D with offsets")

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        if self.module.mode == "max":
            if any(self._inputs(c)[0].dim() != 2 for c in calls):
                raise Unsupported("mode='max' with a 1-D input and offsets has no per-sample "
                                  "rule; pass a (B, T) input")
            return super().grads(calls, ctx)
        weight = self.params["weight"]
        samples, indices, rows = [], [], []
        for call in calls:
            x, offsets, weights = self._inputs(call)
            g = self._grad(call, ctx, weight.dtype)  # (B, D)
            bags = g.shape[0]
            if x.dim() == 2:
                sizes = torch.full((bags,), x.shape[1], device=x.device)
            else:
                bounds = torch.cat([offsets[:bags], offsets.new_tensor([x.numel()])])
                if self.module.include_last_offset:
                    bounds = offsets
                sizes = bounds[1:] - bounds[:-1]
            index = x.reshape(-1)
            sample = torch.arange(bags, device=x.device).repeat_interleave(sizes)
            coef = (g.new_ones(index.shape[0]) if weights is None
                    else weights.reshape(-1).to(g.dtype))
            if self.module.mode == "mean":  # padding is left out of a bag's count
                real = (index != self.module.padding_idx if self.module.padding_idx is not None
                        else torch.ones_like(index, dtype=torch.bool))
                counts = g.new_zeros(bags).index_add_(0, sample, real.to(g.dtype))
                coef = coef / counts.clamp(min=1)[sample]
            samples.append(sample)
            indices.append(index)
            rows.append(g[sample] * coef[:, None])
        return _merged(torch.cat(samples), torch.cat(indices), torch.cat(rows),
                       self.module.padding_idx, weight.shape, ctx)
