"""Modules with parametrizations (torch.nn.utils.parametrizations.weight_norm, spectral_norm,
orthogonal): their parameters are the originals (`parametrizations.weight.original*`), and
their per-sample gradients equal the brute-force per-sample loop's w.r.t. those originals.

The weight such a module's forward uses is computed from the originals at each call, so the
closed form of its layer type does not apply (it gave no value for the originals, with a
cryptic reason); spectral_norm in train mode also advances its power iteration at each call,
so a re-run must use the vectors as that call's forward left them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations as P
from torch.nn.utils import parametrize

from deepscope.instruments.rules import ParametrizedRule, rule_for

from .test_engine import B, ce, check_all, rand, reference, run_engine


def _mlp(parametrization) -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    parametrization(model[0])
    return model


def _cnn() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                          nn.Linear(3 * 16, 3))
    P.weight_norm(model[0])
    return model


CASES = {
    "weight_norm": (lambda: _mlp(P.weight_norm), (B, 5)),
    "spectral_norm": (lambda: _mlp(P.spectral_norm), (B, 5)),
    "orthogonal": (lambda: _mlp(P.orthogonal), (B, 5)),
    "conv_weight_norm": (_cnn, (B, 2, 4, 4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parametrized_layers_match_per_sample_reference(case: str) -> None:
    torch.manual_seed(0)
    build, shape = CASES[case]
    model = build().double().eval()
    assert rule_for(model[0]) is ParametrizedRule
    inputs, target = (rand(*shape),), torch.randint(0, 3, (B,))
    ref = reference(model, inputs, target, ce)
    assert any(".original" in n for n in ref)
    engine = run_engine(model, inputs, target, ce, "mean")
    check_all(engine, ref, dots_first=False)
    assert engine.unavailable == {}


class _Twice(nn.Module):
    """One spectral_norm Linear called twice per forward, in train mode: each call advances
    the power iteration (from a fresh u, far from converged), so the two calls use
    different weights."""

    def __init__(self) -> None:
        super().__init__()
        self.sn = P.spectral_norm(nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.sn(torch.tanh(self.sn(x))))


def test_spectral_norm_in_train_mode_uses_each_calls_power_iteration() -> None:
    torch.manual_seed(0)
    model = _Twice().double()
    x, target = rand(B, 4), torch.randint(0, 3, (B,))
    # the power iteration does not depend on the input: each sample run alone on a copy of
    # the model as it was before the batch's forward meets the u, v the batch met
    before = copy.deepcopy(model)
    named = [n for n, p in model.named_parameters()]
    rows = []
    for i in range(B):
        m = copy.deepcopy(before)
        loss = ce(m(x[i : i + 1]), target[i : i + 1])[0]
        rows.append(torch.autograd.grad(loss, list(m.parameters())))
    ref = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(named)}
    engine = run_engine(model, (x,), target, ce, "mean")
    check_all(engine, ref, dots_first=True)
    assert engine.warnings == []


def test_statistics_inside_parametrize_cached() -> None:
    """Inside the user's `parametrize.cached()` a re-run would read the cached weight, made
    from the real originals rather than the re-run's copies: the originals' per-sample
    gradients came out 0, silently."""
    torch.manual_seed(0)
    model = _mlp(P.weight_norm).double()
    x, target = rand(B, 5), torch.randint(0, 3, (B,))
    ref = reference(model, (x,), target, ce)
    with parametrize.cached():
        engine = run_engine(model, (x,), target, ce, "mean")
        check_all(engine, ref, dots_first=False)
