"""The numbers the diagnoses compute from stored statistics, against the same numbers computed
directly from the full tensor values (float64)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import deepscope
from deepscope.diagnosis.activations import _one_sided, _pinned
from deepscope.diagnosis.base import Evidence


def _record(path: Path) -> dict[str, np.ndarray]:
    """Three tensors of 8 items, every item kept in full: tanh-, sigmoid-bounded and a
    leaky-ReLU'd one; returns their exact float64 values."""
    gen = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(8, 16, generator=gen, dtype=torch.float64)
    tensors = {"tanh": torch.tanh(z), "sigmoid": torch.sigmoid(z),
               "leaky": F.leaky_relu(z, 0.01)}
    with deepscope.Scope(path, run="r", schedule=deepscope.every(1), max_samples=8,
                         exact_views=True) as scope:
        for step in range(2):
            with scope.step(step) as rec:
                for name, t in tensors.items():
                    rec.tensor(name, t.float())
    return {n: t.float().double().numpy() for n, t in tensors.items()}


def test_saturation_and_one_sidedness_match_the_values(tmp_path: Path) -> None:
    values = _record(tmp_path)
    with deepscope.open_run(tmp_path / "r") as run:
        ev = Evidence(run)
        tanh, sigmoid, leaky = (ev.records(n) for n in ("tanh", "sigmoid", "leaky"))
        assert np.allclose(run.values("tanh", 0, view="samples"), values["tanh"])
    v = values["tanh"]
    np.testing.assert_allclose(_pinned(tanh), np.mean(v ** 2), rtol=1e-5)
    s = values["sigmoid"]
    np.testing.assert_allclose(_pinned(sigmoid), s.var() / (s.mean() * (1 - s.mean())),
                               rtol=1e-5)
    x = values["leaky"]
    pos, neg = x[x > 0], -x[x < 0]
    expected = max(neg.sum() / pos.sum(), neg.max() / pos.max())  # sums: same count n
    np.testing.assert_allclose(_one_sided(leaky), expected, rtol=1e-5)
    assert expected < 0.02  # the leaky ReLU's kink, as the saturation diagnosis reads it
