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
from deepscope.instruments.rules.conv import ConvRule
from deepscope.instruments.rules.linear import OuterProductGrads
from deepscope.instruments.rules.norm import NormRule
from deepscope.instruments.suite import Instruments

from .reference import batch_reference, histogram_1d
from .test_suite import assert_counts_match


def _allocated(fn: Callable[[], object]) -> list[int]:
    """CPU bytes torch had allocated above the start after each allocation during fn()."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU)
    current, curve = 0, [0]
    for _, delta in changes:
        current += delta
        curve.append(current)
    return curve


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU bytes torch allocated during fn() above what was allocated before it."""
    return max(_allocated(fn))


def held_bytes(fn: Callable[[], object]) -> int:
    """CPU bytes torch allocated during fn() and still holds after it."""
    return _allocated(fn)[-1]


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


class _ConvBN(nn.Module):
    """Conv + BatchNorm at 16×16, whose captures outweigh their per-sample gradients; the
    second conv is called twice (its gᵢ: the sum over its calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(torch.tanh(self.conv2(h))))


def _conv_bn(train: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = _ConvBN().double()
    with torch.no_grad():  # running statistics with non-trivial values
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return model.train(train)


def test_captures_smaller_as_per_sample_gradients_are_freed_in_the_backward() -> None:
    # BatchNorm: 2·C numbers per sample against its input and output gradient; a conv on
    # 16×16: its kernel per sample against B·(C_in + C_out)·H·W; they were held until finish
    model = _conv_bn()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    engines: list[PerSampleEngine] = []
    held = held_bytes(lambda: engines.append(_captured(model, x, chunk_size=32)))
    captures = 8 * 16 * 16 * 8 * (3 + 4 + 4 + 4 + 2 * (4 + 4) + 4 + 4)  # inputs + grads
    assert held < captures / 8, (held, captures)
    engine = engines[0]
    assert all(call.kept is not None for h in engine._hooked for call in h.calls)
    _check_against_loop(engine, model, x)
    _check_dots_against_loop(engine, model, x)


def _check_dots_against_loop(engine: PerSampleEngine, model: nn.Module, x: torch.Tensor
                             ) -> None:
    ref = batch_reference(model, lambda m: m(x).square().flatten(1).mean(1))
    vectors = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    dots = engine.dots(vectors)
    for name, g in ref.grads.items():
        np.testing.assert_allclose(dots[name].numpy(), g @ vectors[name].reshape(-1).numpy(),
                                   rtol=1e-9, atol=1e-12)


def test_per_sample_gradients_freed_in_each_micro_batchs_backward_are_exact() -> None:
    model = _conv_bn()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    engine = PerSampleEngine(model)
    engine.start()
    for part in x.split(4):  # gradient accumulation: two micro-batches of 4, loss / 2
        losses = model(part).square().flatten(1).mean(1)
        loss = losses.mean() / 2
        engine.add_loss(loss, 8, losses)
        loss.backward()
    engine.stop()
    assert engine.micro_batch_sizes == [4, 4]
    assert all(call.kept is not None for h in engine._hooked for call in h.calls)
    _check_against_loop(engine, model, x)
    _check_dots_against_loop(engine, model, x)


def test_a_failure_while_freeing_captures_leaves_them_for_finish(monkeypatch) -> None:
    grads = NormRule.grads

    def fails_in_backward(self: NormRule, calls: list, ctx: object) -> object:
        if not torch.is_grad_enabled():  # inside the backward pass only
            raise RuntimeError("broken")
        return grads(self, calls, ctx)

    monkeypatch.setattr(NormRule, "grads", fails_in_backward)
    model = _conv_bn()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    engine = _captured(model, x, chunk_size=32)
    kept = {h.label: [c.kept is not None for c in h.calls] for h in engine._hooked}
    assert kept["BatchNorm2d 'bn1'"] == [False] and kept["Conv2d 'conv1'"] == [True]
    _check_against_loop(engine, model, x)


def test_batchnorm_in_train_mode_gives_the_same_shares_freed_early(monkeypatch) -> None:
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    results = []
    for early in (False, True):
        monkeypatch.setattr(NormRule, "early", early)
        monkeypatch.setattr(ConvRule, "early", early)
        engine = _captured(_conv_bn(train=True), x, chunk_size=32)
        assert all((call.kept is not None) == early for h in engine._hooked for call in h.calls)
        results.append((engine.sq_norms(), engine.second_moments(), engine.grad_mean()))
        assert any("train mode" in w for w in engine.warnings)
    for late, early in zip(*results):
        for name, value in late.items():
            torch.testing.assert_close(early[name], value, rtol=1e-12, atol=1e-15)
