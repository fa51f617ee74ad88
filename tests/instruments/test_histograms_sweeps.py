"""GradHist1d / GradHist2d counted on the way by the statistics' sweeps (while they
materialise per-sample gradients anyway, `PerSampleEngine.count_in_sweeps`) equal the
brute-force reference: numpy histograms of per-sample gradients from one autograd.grad per
sample, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepscope.instruments.histograms import per_step
from deepscope.instruments.suite import Instruments

from . import reference as R

BINS, RANGE = 20, (-0.1, 0.1)
BINS_2D, RANGE_2D = (8, 20), ((-0.5, 0.5), (-0.1, 0.1))


class _LSTMHead(nn.Module):
    """An LSTM, whose input and recurrent halves are swept one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class _Sequence(nn.Module):
    """A Linear over sequence positions (T > 1: its statistics sweep gᵢ)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(x)).mean(1))


@pytest.mark.parametrize("quantities", [
    ["GradHist1d", "MeanGSNR"],  # economy's way: the LSTM's GradHist1d was missing
    ["GradHist1d", "GradHist2d", "MeanGSNR"],  # full's: both counted in the sweep
    ["GradHist2d", "NormTest"],
], ids=lambda q: "+".join(q))
@pytest.mark.parametrize("build", [_LSTMHead, _Sequence], ids=lambda b: b.__name__)
def test_histograms_counted_in_sweeps_equal_reference(monkeypatch, build, quantities) -> None:
    torch.manual_seed(0)
    model = build().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 6, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(3, (7,), generator=gen)
    ref = R.batch_reference(model, lambda m: F.cross_entropy(m(x), y, reduction="none"))
    fed = []
    add = per_step.SweptHistograms.add
    monkeypatch.setattr(per_step.SweptHistograms, "add",
                        lambda self, part: fed.append(1) or add(self, part))

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inst = Instruments(model, quantities, optimizer=opt, hist_bins=BINS, hist_range=RANGE,
                       hist2d_bins=BINS_2D, hist2d_range=RANGE_2D, hist2d_per_layer=True)
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    opt.zero_grad()
    losses.mean().backward()
    opt.step()
    values = {(v.name, v.layer): v for v in inst.finish() if v.name.startswith("GradHist")}

    assert fed, "no histogram was counted in a statistics sweep"
    for name in set(quantities) & per_step.HISTOGRAM_NAMES:
        for layer in ["", *ref.names]:
            value = values[name, layer]
            assert "reason" not in value.meta, value.meta["reason"]
            grads = ref.layers()[layer]
            if name == "GradHist1d":
                counts, extras = R.histogram_1d(grads, BINS, *RANGE)
                assert {k: value.meta[k] for k in extras} == extras
            else:
                theta = (np.concatenate([ref.params[n] for n in ref.names]) if layer == ""
                         else ref.params[layer])
                counts = R.histogram_2d(theta, grads, BINS_2D, RANGE_2D)
            np.testing.assert_array_equal(value.array, counts, err_msg=f"{name} {layer!r}")
