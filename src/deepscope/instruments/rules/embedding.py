"""Closed form for nn.Embedding: per-sample gradients are scatter-adds of output rows.

gᵢ(W)[v] = Σ_{t: idx[i,t] = v} G[i,t]. Only the rows a sample touched are non-zero, so
the rule keeps one summed row per distinct (sample, index) pair — U ≤ B·T rows of size
D — and gets every statistic from those rows without a (B, V, D) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .base import Call, Context, ModuleGrads, Rule, Unsupported, first_input


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
        if self.module.scale_grad_by_freq:
            return (
                "scale_grad_by_freq couples samples through batch word counts (per-sample "
                "gradients scale by each sample's own counts)"
            )
        return None

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        weight = self.params["weight"]
        vocab, dim = weight.shape
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
        if self.module.padding_idx is not None:
            keep = index != self.module.padding_idx
            sample, index, row = sample[keep], index[keep], row[keep]
        # merge repeats of an index within a sample: one row per (sample, index) pair
        keys, inverse = torch.unique(sample * vocab + index, return_inverse=True)
        summed = row.new_zeros(keys.shape[0], dim).index_add_(0, inverse, row)
        return EmbeddingGrads(summed, keys // vocab, keys % vocab, weight.shape, ctx)
