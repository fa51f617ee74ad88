"""missing_zero_grad reads the optimiser the run stored: momentum SGD's growing steps are
healthy, an adaptive optimiser's steps say nothing about accumulated gradients."""

from __future__ import annotations

import torch

from deepscope.diagnosis.report import diagnosis_text
from tests.diagnosis.zoo import MLP, RNN, Loop, _adam, _mlp, _sgd, train


def _codes(run) -> set[str]:
    return set(run.diagnoses(threshold=0.0)["code"])


def test_momentum_sgd_is_not_missing_zero_grad(tmp_path):
    torch.manual_seed(0)
    with train(tmp_path, "momentum", Loop(_mlp(MLP), _sgd(0.01, momentum=0.9))) as run:
        settings = run.meta()["optimizer"]
        assert settings["type"] == "SGD" and settings["momentum"] == 0.9
        assert settings["lr"] == 0.01
        assert "missing_zero_grad" not in _codes(run)


def test_missing_zero_grad_still_found_with_momentum(tmp_path):
    torch.manual_seed(0)
    loop = Loop(RNN(), _sgd(0.01, momentum=0.5), data="sequences", zero_grad=False)
    with train(tmp_path, "accumulating", loop) as run:
        assert "missing_zero_grad" in _codes(run)


def test_adaptive_optimiser_is_not_checked(tmp_path):
    torch.manual_seed(0)
    with train(tmp_path, "adam", Loop(_mlp(MLP), _adam(), steps=50)) as run:
        assert run.meta()["optimizer"]["type"] == "Adam"
        assert "missing_zero_grad" not in _codes(run)
        assert "missing_zero_grad: no SGD steps (Adam's steps" in diagnosis_text(run)
