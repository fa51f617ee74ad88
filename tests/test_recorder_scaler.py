"""A GradScaler's scale is not part of a recorded gradient.

`scaler.scale(loss).backward()` multiplies every gradient by the scale until `unscale_`
divides `.grad`. Given the scaler (`watch(..., scaler=)`), the recorder divides what it keeps
by the scale of each pass — the scale before `update()` changes it — so a parameter's recorded
gradient is the `.grad` the optimiser steps with; without it, one warning names the factor.
References: `.grad` after `unscale_`, cloned in the loop; activation gradients from
`torch.autograd.grad` of the unscaled loss on a copy of the model.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import deepscope
from deepscope.recorder.passes import ScaleCheck


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(tmp_path, run: str, *, give_scaler: bool, micro: int = 1, autocast: bool = False,
           scaler_on: bool = True):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # growth every step: each step's backward runs at a new scale
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1,
                                  enabled=scaler_on)
    refs = []
    with deepscope.Scope(tmp_path, run, schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt, scaler=scaler if give_scaler else None)
        for step in range(3):
            xs = [torch.randn(4, 5) for _ in range(micro)]
            ys = [torch.randn(4, 3) for _ in range(micro)]
            ref = copy.deepcopy(model)
            want = {}
            with scope.step(step) as rec:
                opt.zero_grad()
                for m, (x, y) in enumerate(zip(xs, ys)):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        pre = model[0](x)
                        rec.tensor("pre", pre)
                        out = model[2](model[1](pre))
                    loss = (out.float() - y).pow(2).mean() / micro
                    rec.loss(loss)
                    scaler.scale(loss).backward()
                    r_pre = ref[0](x)
                    r_loss = (ref[2](ref[1](r_pre)) - y).pow(2).mean() / micro
                    want[("pre", m)] = torch.autograd.grad(r_loss, r_pre)[0]
                scaler.unscale_(opt)
                want |= {(n, 0): p.grad.clone() for n, p in model.named_parameters()}
                scaler.step(opt)
                scaler.update()
            refs.append(want)
    return deepscope.open_run(tmp_path / run), refs


def _check(run, refs, rel):
    checked = 0
    for step, want in enumerate(refs):
        for (name, it), g in want.items():
            row = run.stats_wide(name, direction="grad", step=step, iteration=it).iloc[0]
            v = g.double()
            assert row["norm"] == pytest.approx(float(v.norm()), rel=rel), (step, name, it)
            assert row["max"] == pytest.approx(float(v.max()), rel=rel, abs=1e-9), (step, name)
            checked += 1
    return checked


@pytest.mark.parametrize("micro", [1, 2])
def test_recorded_gradients_are_unscaled_with_the_scale_of_their_pass(tmp_path, micro):
    run, refs = _train(tmp_path, "r", give_scaler=True, micro=micro)
    assert _check(run, refs, rel=1e-5) == 3 * (4 + micro)
    # the loss's own gradient: ∂(loss / k)/∂loss of each micro-batch, the scale divided out
    losses = run.stats_wide("loss", direction="grad")
    assert losses["mean"].tolist() == pytest.approx([1.0] * len(losses))


def test_half_precision_gradients_are_unscaled_in_float32(tmp_path):
    """bfloat16 autocast: activation gradients arrive in bfloat16, scaled; divided there they
    could underflow, so they are recorded in float32."""
    run, refs = _train(tmp_path, "r", give_scaler=True, autocast=True)
    assert _check(run, refs, rel=2e-2) == 3 * 5


def test_a_disabled_scaler_scales_nothing(tmp_path):
    run, refs = _train(tmp_path, "r", give_scaler=True, scaler_on=False)
    assert _check(run, refs, rel=1e-5) == 3 * 5


def test_a_scaled_loss_without_the_scaler_is_said_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="deepscope")
    run, refs = _train(tmp_path, "r", give_scaler=False)
    said = [r.getMessage() for r in caplog.records if "GradScaler" in r.getMessage()]
    assert len(said) == 1 and "multiplied by 1024" in said[0] and "scaler=scaler" in said[0]
    row = run.stats_wide("0.weight", direction="grad", step=0).iloc[0]
    assert row["norm"] == pytest.approx(1024 * float(refs[0][("0.weight", 0)].norm()),
                                        rel=1e-5)  # as the warning says


def test_no_warning_for_an_unscaled_or_accumulated_loss(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="deepscope")
    model = _model()
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1)) as scope:
        scope.watch(model)
        for step in range(ScaleCheck.CHECKS):
            with scope.step(step) as rec:
                for _ in range(2):
                    loss = model(torch.randn(4, 5)).pow(2).mean()
                    rec.loss(loss)
                    (loss / 2).backward()  # ∂root/∂loss = 1/2: the loss's own factor
        assert scope._scale_check.done  # judged on the first steps only: later ones pay nothing
    assert not [r for r in caplog.records if "GradScaler" in r.getMessage()]


def test_watch_refuses_what_is_not_a_grad_scaler(tmp_path):
    with deepscope.Scope(tmp_path, "r") as scope:
        with pytest.raises(TypeError, match="needs a torch.amp.GradScaler, got float"):
            scope.watch(_model(), scaler=1024.0)
