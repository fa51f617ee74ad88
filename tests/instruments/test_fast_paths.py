"""The closed forms added for real models, against the brute-force per-sample loop
(float64, each sample run alone): every engine statistic (`test_engine.check_all`) and the
GradHist1d / GradHist2d counts of the suite on the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from deepscope.instruments.histograms import Bins, histogram_1d, histogram_2d
from deepscope.instruments.rules import Conv1DRule, LSTMRule, base, rule_for

from . import reference as R
from .test_engine import B, ce, check_all, rand, reference, run_engine
from .test_engine import cases as engine_cases


class DeepLSTM(nn.Module):
    """Two bidirectional batch-first layers, a given (h₀, c₀), and a loss that also reads
    h_n and c_n: every gradient route into the LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.h0 = nn.Parameter(torch.zeros(1))  # keeps the states' batch dim 1 honest
        self.head = nn.Linear(8 + 4, 2)

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor) -> Tensor:
        out, (h_n, c_n) = self.lstm(x, (h0.transpose(0, 1), c0.transpose(0, 1)))
        return self.head(torch.cat([out.mean(1), (h_n[-1] + c_n[0]) * (1 + self.h0)], 1))


def lstm_case() -> tuple[nn.Module, tuple, Tensor]:
    torch.manual_seed(0)
    return (DeepLSTM().double(), (rand(B, 5, 3), rand(B, 4, 4), rand(B, 4, 4)),
            torch.randint(0, 2, (B,)))


def conv1d_case() -> tuple[nn.Module, tuple, Tensor]:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    model = nn.Sequential(pytorch_utils.Conv1D(6, 4), nn.Tanh(), pytorch_utils.Conv1D(3, 6),
                          nn.Flatten(), pytorch_utils.Conv1D(2, 9)).double()
    return model, (rand(B, 3, 4),), torch.randint(0, 2, (B,))  # 3 positions, then one


CASES = {"lstm": lstm_case, "conv1d": conv1d_case}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_closed_forms_match_the_per_sample_loop(case: str, reduction: str) -> None:
    model, inputs, target = CASES[case]()
    assert {"lstm": LSTMRule, "conv1d": Conv1DRule}[case] in {rule_for(m) for m in
                                                              model.modules()}
    ref = reference(model, inputs, target, ce)
    kwargs = {"chunk_size": 2, "cache_bytes": 0} if reduction == "mean" else {}
    engine = run_engine(model, inputs, target, ce, reduction, **kwargs)
    check_all(engine, ref, dots_first=reduction == "mean")
    assert engine.warnings == [] and engine.unavailable == {}


@pytest.mark.parametrize("case", list(CASES))
def test_histograms_of_closed_forms_count_every_per_sample_element(case: str) -> None:
    model, inputs, target = CASES[case]()
    ref = reference(model, inputs, target, ce)
    engine = run_engine(model, inputs, target, ce, "mean")
    grad_bins, param_bins = Bins(50, -0.3, 0.3), Bins(8, -1.0, 1.0)  # many outer values
    params = dict(model.named_parameters())
    for name, g in ref.items():
        parts = [part for n, part in engine.per_sample_parts() if n == name]
        values = g.numpy().reshape(B, -1)
        counts, _ = R.histogram_1d(values.ravel(), 50, -0.3, 0.3)
        np.testing.assert_array_equal(histogram_1d(parts, grad_bins).counts, counts)
        theta = params[name].detach()
        counts_2d = R.histogram_2d(theta.numpy().ravel(), values, (8, 50),
                                   ((-1.0, 1.0), (-0.3, 0.3)))
        np.testing.assert_array_equal(histogram_2d(theta, parts, param_bins, grad_bins).counts,
                                      counts_2d)


@pytest.mark.parametrize("case", ["shared", "sequence", "cnn"])
def test_chunks_cut_to_the_element_cap_give_the_same_statistics(monkeypatch, case: str) -> None:
    # a cap of 40 elements: every large layer's chunks hold one or a few samples
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", 40)
    model, inputs, target, loss = engine_cases()[case]()
    model = model.double()
    ref = reference(model, inputs, target, loss)
    engine = run_engine(model, inputs, target, loss, "mean", cache_bytes=0)
    check_all(engine, ref, dots_first=False)
