"""Peak memory of the engine's statistics above what the step captured, and per-sample
gradients materialised once (#19).

Allocations are counted exactly by the torch profiler on the CPU, so the bounds are
deterministic. Each test also checks the statistics against the per-sample loop, in
the regime whose memory it bounds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from deepscope.instruments.engine import PerSampleEngine
from deepscope.instruments.histograms import GradHistogram
from deepscope.instruments.rules.linear import OuterProductGrads
from deepscope.instruments.suite import Instruments

from .reference import batch_reference, histogram_1d
from .test_suite import assert_counts_match


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU bytes torch allocated during fn() above what was allocated before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU)
    current = peak = 0
    for _, delta in changes:
        current += delta
        peak = max(peak, current)
    return peak


def _captured(model: nn.Module, x: torch.Tensor, chunk_size: int) -> PerSampleEngine:
    """An engine that captured one step of `model` on `x` (loss: mean squared output)."""
    engine = PerSampleEngine(model, chunk_size=chunk_size)
    engine.start()
    losses = model(x).square().flatten(1).mean(1)
    loss = losses.mean()
    engine.add_loss(loss, x.shape[0], losses)
    loss.backward()
    engine.stop()
    return engine


def _check_against_loop(engine: PerSampleEngine, model: nn.Module, x: torch.Tensor) -> None:
    ref = batch_reference(model, lambda m: m(x).square().flatten(1).mean(1))
    sq, mean, m2 = engine.sq_norms(), engine.grad_mean(), engine.second_moments()
    for name, g in ref.grads.items():
        np.testing.assert_allclose(sq[name].numpy(), (g**2).sum(1), rtol=1e-9)
        np.testing.assert_allclose(mean[name].reshape(-1).numpy(), g.mean(0), rtol=1e-9,
                                   atol=1e-12)
        np.testing.assert_allclose(m2[name].reshape(-1).numpy(), (g**2).sum(0), rtol=1e-9)


def test_no_scaled_copy_of_every_layers_output_gradient_is_held() -> None:
    # layers over 4096 positions: output gradients far larger than per-sample gradients,
    # and larger than what is scaled once and held (a quarter of a materialised chunk)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).double()
    x = torch.randn(8, 4096, 16, dtype=torch.float64)
    engine = _captured(model, x, chunk_size=32)
    output_grads = 4 * x.numel() * 8  # bytes of the 4 captured output gradients
    peak = peak_bytes(lambda: (engine.sq_norms(), engine.grad_mean(),
                               engine.second_moments()))
    # one layer's scaled gradient at a time (a quarter), not all four held for the step
    assert peak < output_grads / 2, (peak, output_grads)
    _check_against_loop(engine, model, x)


def test_kept_per_sample_gradients_are_not_held_twice() -> None:
    # 4 chunks of 4 samples, kept for reuse: filled in place, not joined from a list
    torch.manual_seed(0)
    model = nn.Linear(128, 128).double()
    x = torch.randn(16, 4, 128, dtype=torch.float64)
    engine = _captured(model, x, chunk_size=4)
    kept = 16 * (128 * 128 + 128) * 8
    peak = peak_bytes(engine.second_moments)  # a materialising sweep
    # kept + a few chunk-sized temporaries (each kept / 4); joined from a list: 2 × kept + ...
    assert peak < 1.9 * kept, (peak, kept)
    _check_against_loop(engine, model, x)


def _gsnr_and_histogram_step(model: nn.Module, x: torch.Tensor) -> dict:
    """One instrumented step of MeanGSNR and GradHist1d (fixed range); values by (name, layer)."""
    inst = Instruments(model, ["MeanGSNR", "GradHist1d"], hist_range=(-0.5, 0.5))
    inst.start(0, "train")
    losses = model(x).square().flatten(1).mean(1)
    inst.loss(losses.mean(), per_sample=losses)
    losses.mean().backward()
    return {(v.name, v.layer): v for v in inst.finish()}


def test_histogram_is_counted_in_the_statistics_sweep_not_materialised_again(
        monkeypatch) -> None:
    # sequence layers: each layer's gᵢ are materialised by the second moments' sweep; the
    # histogram pass (computed first) materialised them once more
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    x = torch.randn(6, 3, 8, dtype=torch.float64)
    sweeps = []
    per_sample = OuterProductGrads.per_sample

    def counted(self: OuterProductGrads, lo: int, hi: int) -> dict[str, torch.Tensor]:
        sweeps.append((lo, hi))
        return per_sample(self, lo, hi)

    monkeypatch.setattr(OuterProductGrads, "per_sample", counted)
    values = _gsnr_and_histogram_step(model, x)
    assert sweeps == [(0, 6), (0, 6)]  # each layer's gᵢ once
    ref = batch_reference(model, lambda m: m(x).square().flatten(1).mean(1))
    for layer, G in ref.layers().items():
        counts, _ = histogram_1d(G, 100, -0.5, 0.5)
        assert_counts_match(values[("GradHist1d", layer)].array, counts, G,
                            np.linspace(-0.5, 0.5, 101))


def test_a_histogram_failing_in_the_sweep_spares_the_statistics(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    x = torch.randn(6, 3, 8, dtype=torch.float64)

    def broken(self: GradHistogram, part: object) -> None:
        raise RuntimeError("counter broke")

    monkeypatch.setattr(GradHistogram, "add", broken)
    values = _gsnr_and_histogram_step(model, x)
    assert values[("MeanGSNR", "")].value is not None
    assert "counter broke" in values[("GradHist1d", "")].meta["reason"]
