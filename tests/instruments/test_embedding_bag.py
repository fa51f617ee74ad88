"""nn.EmbeddingBag against a per-bag brute-force loop: each bag is a sample, whether the
input is (B, T) or 1-D with offsets (B bags, not the input's dim 0). Before, a 1-D input
with offsets made the input's length the batch size: every layer's per-sample values were
NaN ("the batch must be dim 0"), and where the lengths agreed the generic rule split the
offsets as if they were samples.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from .test_engine import B, ce, check_all, run_engine

VOCAB = 9


class _Bags(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 3, **kwargs)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor, offsets: Tensor | None = None,
                weights: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.bag(x, offsets, per_sample_weights=weights)))


def _reference(model: nn.Module, bags: list[tuple[Tensor, Tensor | None]], y: Tensor
               ) -> dict[str, Tensor]:
    """name -> (B, *shape): each bag (its tokens, their weights) run alone as a (1, T) input
    (an empty bag: as 1-D with offsets of one empty bag)."""
    named = list(model.named_parameters())
    rows = []
    for i, (tokens, weights) in enumerate(bags):
        if tokens.numel():
            out = model(tokens[None], None, None if weights is None else weights[None])
        else:
            last = model.bag.include_last_offset
            out = model(tokens, torch.tensor([0, 0] if last else [0]), weights)
        grads = torch.autograd.grad(ce(out, y[i : i + 1])[0], [p for _, p in named],
                                    allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)])
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


CASES = {  # name: (EmbeddingBag kwargs, 1-D with offsets, per_sample_weights)
    "sum_2d": ({"mode": "sum"}, False, False),
    "mean_2d_padding": ({"mode": "mean", "padding_idx": 0}, False, False),
    "max_2d": ({"mode": "max"}, False, False),
    "sum_offsets_weights": ({"mode": "sum"}, True, True),
    "mean_offsets_padding": ({"mode": "mean", "padding_idx": 0}, True, False),
    "mean_last_offset": ({"mode": "mean", "include_last_offset": True}, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_embedding_bag_matches_per_bag_reference(case: str) -> None:
    kwargs, flat, weighted = CASES[case]
    torch.manual_seed(0)
    model = _Bags(**kwargs).double()
    y = torch.randint(0, 2, (B,))
    if flat:  # bags of 2, 0 (empty), 3, 1, 2 tokens: 8 tokens for 5 bags
        sizes = [2, 0, 3, 1, 2]
        x = torch.randint(0, VOCAB, (sum(sizes),))
        x[1] = 0  # a padding token where padding_idx=0
        ends = torch.tensor(sizes).cumsum(0)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), ends])
        if not kwargs.get("include_last_offset"):
            offsets = offsets[:-1]
        weights = torch.rand(x.shape[0], dtype=torch.float64) if weighted else None
        bags = [(x[e - s : e], None if weights is None else weights[e - s : e])
                for s, e in zip(sizes, ends.tolist())]
        inputs = (x, offsets, weights)
    else:
        x = torch.randint(0, VOCAB, (B, 4))
        x[0, 1] = 0
        bags = [(row, None) for row in x]
        inputs = (x,)
    ref = _reference(model, bags, y)
    engine = run_engine(model, inputs, y, ce, "mean")
    check_all(engine, ref, dots_first=flat)
    assert engine.unavailable == {}


def test_embedding_bag_max_with_offsets_is_missing_with_the_reason() -> None:
    model = _Bags(mode="max").double()
    x, offsets = torch.randint(0, VOCAB, (B,)), torch.arange(B)  # as many tokens as bags
    engine = run_engine(model, (x, offsets), torch.randint(0, 2, (B,)), ce, "mean")
    assert engine.sq_norms()["head.weight"].isfinite().all()
    assert "mode='max' with a 1-D input" in engine.unavailable["bag.weight"]
