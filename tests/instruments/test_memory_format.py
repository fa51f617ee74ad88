"""A channels_last CNN (model and inputs `.to(memory_format=torch.channels_last)`): the conv
closed forms read patches and output gradients by their strides, so the per-sample
statistics are checked against the per-sample loop in that layout too (a run compared with
its contiguous twin, "full" instruments and recorder, agreed to float32 round-off)."""

from __future__ import annotations

import torch
from torch import nn

from .test_engine import B, ce, check_all, rand, reference, run_engine


def test_channels_last_cnn_matches_per_sample_reference() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Tanh(),  # 6x6 -> 2x2
        nn.Conv2d(4, 3, 1), nn.Flatten(), nn.Linear(12, 3),
    ).double().to(memory_format=torch.channels_last)
    x = rand(B, 2, 6, 6).to(memory_format=torch.channels_last)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 3, (B,))
    ref = reference(model, (x,), target, ce)
    engine = run_engine(model, (x,), target, ce, "mean", chunk_size=2, cache_bytes=0)
    check_all(engine, ref, dots_first=True)
    assert engine.warnings == [] and engine.unavailable == {}
