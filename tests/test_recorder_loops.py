"""Training loops beyond one model and one optimiser step: a GAN step (two models, two
optimisers, two losses in one `scope.step`), a validation forward after `opt.step()`, and a
model changed mid-run (a layer frozen, its head replaced). References: each parameter's
`.grad` as its optimiser steps with and its value, cloned in the loop.
"""

from __future__ import annotations

import copy
import logging

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce

import deepscope
from deepscope.instruments.suite import PARAMETERS_CHANGED, SEVERAL_LOSSES


def _net(d_in: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _seeded_sgd() -> tuple[nn.Sequential, torch.optim.SGD]:
    """The same small net each time, and plain SGD over it."""
    torch.manual_seed(0)
    model = _net(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _gan(d_lr: float) -> tuple[nn.Module, nn.Module, torch.optim.SGD, torch.optim.SGD]:
    """G (3 → 4) and D (4 → 1) with their SGD optimisers (G's rate 0.1)."""
    torch.manual_seed(0)
    gen, disc = _net(3, 4), _net(4, 1)
    return (gen, disc, torch.optim.SGD(gen.parameters(), lr=0.1),
            torch.optim.SGD(disc.parameters(), lr=d_lr))


def _d_losses(disc: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """D's (B,) per-sample losses: real → 1, fake (detached: D's step only) → 0."""
    on_real, on_fake = disc(real), disc(fake.detach())
    return (bce(on_real, torch.ones_like(on_real), reduction="none")
            + bce(on_fake, torch.zeros_like(on_fake), reduction="none"))[:, 0]


def _d_step(rec, disc: nn.Module, opt_d: torch.optim.Optimizer, real: torch.Tensor,
            fake: torch.Tensor) -> dict[str, torch.Tensor]:
    """D's step, its loss given to rec.loss as "d_loss"; returns the .grad it stepped with."""
    opt_d.zero_grad()
    d_losses = _d_losses(disc, real, fake)
    rec.loss(d_losses.mean(), per_sample=d_losses, name="d_loss")
    d_losses.mean().backward()
    grads = {f"D.{n}": p.grad.clone() for n, p in disc.named_parameters()}
    opt_d.step()
    return grads


def test_gan_records_each_models_gradient_as_its_optimizer_steps_with(tmp_path):
    """D's .grad gets G's loss too (after D's step, before the next zero_grad): that part is
    not D's update; before, it was added into D's recorded gradient. The instruments (on G,
    the first watched model) cannot take the two losses: missing with the reason (before,
    Loss was their mean and the gradient quantities missing with a wrong reason)."""
    gen, disc, opt_g, opt_d = _gan(d_lr=0.2)
    refs = []
    with deepscope.Scope(tmp_path, "gan", schedule=deepscope.every(1),
                         instruments="economy") as scope:
        scope.watch(gen, name="G", optimizer=opt_g)
        with pytest.warns(deepscope.DeepscopeWarning, match="first watched model only"):
            scope.watch(disc, name="D", optimizer=opt_d)
        for step in range(2):
            z, real = torch.randn(6, 3), torch.randn(6, 4)
            want = {}
            with scope.step(step) as rec:
                fake = gen(z)
                want |= _d_step(rec, disc, opt_d, real, fake)
                opt_g.zero_grad()
                g_losses = bce(disc(fake), torch.ones(6, 1), reduction="none")[:, 0]
                rec.loss(g_losses.mean(), per_sample=g_losses, name="g_loss")
                g_losses.mean().backward()
                want |= {f"G.{n}": p.grad.clone() for n, p in gen.named_parameters()}
                opt_g.step()
            refs.append(want)
    run = deepscope.open_run(tmp_path / "gan")
    for step, want in enumerate(refs):
        for name, g in want.items():
            row = run.stats_wide(name, direction="grad", step=step).iloc[0]
            assert row["norm"] == pytest.approx(float(g.double().norm()), rel=1e-5), (step, name)
    # the first model's optimiser (before: the last watched one's, D's)
    assert run.kpis("learning_rate")["value"].tolist() == [0.1, 0.1]
    assert run.meta()["optimizer"]["lr"] == 0.1
    q = run.quantities()
    reason = SEVERAL_LOSSES.format(first="d_loss", second="g_loss")
    assert q["value"].isna().all() and (q["reason"] == reason).all()
    assert {"Loss", "GradNorm", "Alpha"} <= set(q["name"])


def test_validation_forward_after_the_step_is_not_a_training_iteration(tmp_path, caplog):
    """model.eval() + no_grad after opt.step(): before, its outputs were recorded as the
    step's iteration 1, passing for training activations."""
    model, opt = _seeded_sgd()
    outs = []
    with deepscope.Scope(tmp_path, "val", schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt, activations=True)
        for step in range(2):
            with scope.step(step) as rec, caplog.at_level(logging.WARNING, "deepscope"):
                model.train()
                out = model(torch.randn(6, 3))
                outs.append(out.detach().clone())
                loss = out.pow(2).mean()
                rec.loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    model(torch.randn(10, 3) * 100)
    stats = deepscope.open_run(tmp_path / "val").stats_wide("model", direction="forward")
    assert stats["iteration"].tolist() == [0, 0]
    assert stats["norm"].tolist() == pytest.approx([float(o.norm()) for o in outs], rel=1e-6)
    assert "validation forward" in caplog.text


def test_a_model_changed_mid_run_is_recorded_as_it_is_and_instruments_say_why(tmp_path):
    """A layer frozen at step 1 (before: the step was not recorded at all, "cannot register a
    hook on a tensor that doesn't require gradient"), its head replaced at step 2 (before:
    the old head's values recorded, GradNorm/UpdateSize 0 for it) and watched again (before:
    every other module's output recorded twice, "0#2")."""
    model, opt = _seeded_sgd()
    refs = []
    with deepscope.Scope(tmp_path, "change", schedule=deepscope.every(1),
                         instruments="economy") as scope:
        scope.watch(model, optimizer=opt, activations=True)
        for step in range(3):
            if step == 1:
                model[0].weight.requires_grad_(False)
            if step == 2:
                model[2] = nn.Linear(8, 2)
                opt.add_param_group({"params": model[2].parameters()})
                scope.watch(model, optimizer=opt, activations=True)
            x = torch.randn(6, 3)
            want = {n: p.detach().clone() for n, p in model.named_parameters()}
            with scope.step(step) as rec:
                losses = model(x).pow(2).mean(1)
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                want |= {f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}
                opt.step()
            refs.append(want)
    run = deepscope.open_run(tmp_path / "change")
    assert not [n for n in run.tensors()["name"] if "#" in n]
    for step, want in enumerate(refs):
        for key, v in want.items():
            direction, _, name = key.rpartition(":")
            row = run.stats_wide(name, direction=direction or "forward", step=step).iloc[0]
            assert row["norm"] == pytest.approx(float(v.double().norm()), rel=1e-5), (step, key)
    q = run.quantities()
    later = q[q["step"] >= 1]
    assert later["value"].isna().all()
    assert set(later["reason"]) == {PARAMETERS_CHANGED.format(name="0.weight")}
    assert q[(q["step"] == 0) & q["name"].isin(["GradNorm", "Loss"])]["value"].notna().all()


def _lbfgs_or_twin(tmp_path, run: str, thetas: list | None):
    """LBFGS with a closure that backpropagates 4 times per step (thetas None: collects
    θ after each step), or its twin: one evaluation per step, then θ set to LBFGS's."""
    torch.manual_seed(0)
    model = _net(3, 2)
    params = list(model.parameters())
    opt = torch.optim.LBFGS(params, lr=0.5, max_iter=4)
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    grads, after = [], []
    # step 1 instrumented, not recorded: rec.loss is counted there too
    with deepscope.Scope(tmp_path, run, schedule=deepscope.at([0]), instruments="economy",
                         instrument_schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt, activations=True)
        for step in range(2):
            evals: list[list[torch.Tensor]] = []
            grads.append(evals)

            def closure():
                opt.zero_grad()
                losses = (model(x) - y).pow(2).mean(1)
                rec.loss(losses.mean(), per_sample=losses)
                losses.mean().backward()
                grads[-1].append([p.grad.clone() for p in params])
                return losses.mean()

            with scope.step(step) as rec:
                if thetas is None:
                    opt.step(closure)
                else:
                    closure()
                    with torch.no_grad():
                        for p, t in zip(params, thetas[step]):
                            p.copy_(t)
            after.append([p.detach().clone() for p in params])
    return deepscope.open_run(tmp_path / run), grads, after


def test_lbfgs_closure_records_the_step_at_its_start(tmp_path):
    """LBFGS evaluates its closure again at moved parameters inside step(): before, the
    recorded gradient was the last evaluation's, the KPI loss the sum of all four, each
    evaluation an iteration, and the instruments took them as micro-batches (Loss their
    mean, GradNorm that of their mean). Now the step is its first evaluation, at the
    recorded parameters: the twin that evaluates once and jumps to LBFGS's θ matches."""
    run, grads, thetas = _lbfgs_or_twin(tmp_path, "lbfgs", None)
    assert all(len(evals) == 4 for evals in grads)
    twin, _, _ = _lbfgs_or_twin(tmp_path, "twin", thetas)
    for (name, _), g in zip(_net(3, 2).named_parameters(), grads[0][0]):
        row = run.stats_wide(name, direction="grad", step=0).iloc[0]
        assert row["norm"] == pytest.approx(float(g.double().norm()), rel=1e-5)
    assert run.stats_wide("model", direction="forward")["iteration"].tolist() == [0]
    kpis = run.kpis("loss")["value"].tolist()
    assert len(kpis) == 2 and kpis == pytest.approx(twin.kpis("loss")["value"].tolist())
    got, want = run.quantities(), twin.quantities()
    assert got["name"].tolist() == want["name"].tolist()
    assert got["value"].tolist() == pytest.approx(want["value"].tolist(), rel=1e-5, nan_ok=True)
    assert got["value"].notna().sum() > 30


def test_cabs_is_missing_once_a_parameter_group_brings_another_learning_rate(tmp_path):
    """CABS is lr · Σ(gᵢ − ḡ)² / (B·L) for one learning rate; it read the first group's for
    every parameter, also after a group with another rate was added (a plausible wrong
    value), and the first optimiser's after the model was watched with a new one. Reference:
    the formula in float64 from a per-sample loop at step 0."""
    torch.manual_seed(0)
    model = _net(3, 2)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    with deepscope.Scope(tmp_path, "cabs", schedule=deepscope.every(1),
                         instruments=["CABS"]) as scope:
        scope.watch(model, optimizer=opt)
        for step in range(3):
            if step == 1:
                opt.add_param_group({"params": model[2].parameters(), "lr": 0.05})
            if step == 2:
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                scope.watch(model, optimizer=opt)
            ref = copy.deepcopy(model).double()
            with scope.step(step) as rec:
                losses = (model(x) - y).pow(2).mean(1)
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
            if step == 0:
                gi = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
                    (ref(x[i:i + 1].double()) - y[i:i + 1].double()).pow(2).mean(),
                    list(ref.parameters()))]) for i in range(6)])
                loss = (ref(x.double()) - y.double()).pow(2).mean().detach()
                want = 0.1 * float((gi - gi.mean(0)).pow(2).sum()) / (6 * float(loss))
    q = deepscope.open_run(tmp_path / "cabs").quantities()
    total = q[(q["name"] == "CABS") & (q["layer"] == "")].set_index("step")
    assert total.loc[0, "value"] == pytest.approx(want, rel=1e-5)
    assert pd.isna(total.loc[1, "value"])
    assert "2 (0.05, 0.1)" in total.loc[1, "reason"]
    assert total.loc[2, "meta"]["lr"] == 0.5


def test_a_step_the_grad_scaler_skips_has_no_update_and_no_unexplained_nan(tmp_path):
    """The loss is inf at step 1: the GradScaler skips the optimiser's step. UpdateSize is 0,
    Distance stays, α is −1 (τ = 0, QUANTITIES.md), the parameters recorded at step 2 are
    step 1's; the gradient quantities are NaN with the reason (before: NaN, no reason)."""
    torch.manual_seed(0)
    model = _net(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    thetas, heads = [], []
    with deepscope.Scope(tmp_path, "skip", schedule=deepscope.every(1),
                         instruments="economy") as scope:
        scope.watch(model, optimizer=opt, scaler=scaler)
        for step in range(3):
            thetas.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
            heads.append(model[2].weight.detach().clone())
            with scope.step(step) as rec:
                losses = model(torch.randn(6, 3)).pow(2).mean(1) * (
                    float("inf") if step == 1 else 1.0)
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                scaler.scale(losses.mean()).backward()
                scaler.step(opt)
                scaler.update()
        thetas.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    run = deepscope.open_run(tmp_path / "skip")
    q = run.quantities()
    total = q[q["layer"] == ""].set_index(["name", "step"])
    for step in range(3):
        assert total.loc[("UpdateSize", step), "value"] == pytest.approx(
            float((thetas[step + 1] - thetas[step]).norm()), rel=1e-5, abs=1e-12)
        assert total.loc[("Distance", step), "value"] == pytest.approx(
            float((thetas[step] - thetas[0]).norm()), rel=1e-5, abs=1e-12)
    assert total.loc[("Alpha", 1), "value"] == -1.0
    assert torch.equal(thetas[1], thetas[2])
    for step in range(3):
        assert run.stats_wide("2.weight", direction="forward", step=step)["norm"].iloc[0] == (
            pytest.approx(float(heads[step].double().norm()), rel=1e-6))
    nan = q[(q["step"] == 1) & q["value"].isna() & ~q["name"].str.startswith("GradHist")]
    assert {"GradNorm", "NormTest", "InnerTest", "OrthoTest"} <= set(nan["name"])
    assert nan["reason"].str.startswith("the loss is not finite at this step (inf)").all()


def test_an_optimizer_step_before_the_backward_ends_no_gradient(tmp_path):
    """A loop that steps with the last step's gradients first: this step's backward, after
    the optimiser's step, is still the recorded gradient."""
    model, opt = _seeded_sgd()
    refs = []
    with deepscope.Scope(tmp_path, "late", schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt, activations=True)
        for step in range(2):
            with scope.step(step) as rec:
                if step:
                    opt.step()
                opt.zero_grad()
                loss = model(torch.randn(6, 3)).pow(2).mean()
                rec.loss(loss)
                loss.backward()
                refs.append({n: p.grad.clone() for n, p in model.named_parameters()})
    run = deepscope.open_run(tmp_path / "late")
    assert run.stats_wide("model", direction="forward")["iteration"].tolist() == [0, 0]
    for step, want in enumerate(refs):
        for name, g in want.items():
            row = run.stats_wide(name, direction="grad", step=step).iloc[0]
            assert row["norm"] == pytest.approx(float(g.double().norm()), rel=1e-5)


def test_gan_discriminator_instrumented_with_its_loss_alone_is_right(tmp_path):
    """The workaround for a GAN: D watched first (instrumented), only D's loss given to
    rec.loss. G's loss reaches D's parameters after D's step and must not count. Reference:
    D's per-sample gradients by a float64 loop, GradNorm = ‖ḡ‖ and NormTest."""
    gen, disc, opt_g, opt_d = _gan(d_lr=0.1)
    refs = []
    with deepscope.Scope(tmp_path, "gan_d", schedule=deepscope.every(1),
                         instruments=["GradNorm", "NormTest"]) as scope:
        scope.watch(disc, name="D", optimizer=opt_d)
        with pytest.warns(deepscope.DeepscopeWarning, match="first watched model only"):
            scope.watch(gen, name="G", optimizer=opt_g)
        for step in range(2):
            z, real = torch.randn(6, 3), torch.randn(6, 4)
            ref = copy.deepcopy(disc).double()
            with scope.step(step) as rec:
                fake = gen(z)
                _d_step(rec, disc, opt_d, real, fake)
                opt_g.zero_grad()
                g_loss = bce(disc(fake), torch.ones(6, 1))
                rec.kpi("g_loss", g_loss)
                g_loss.backward()
                opt_g.step()
            gi = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
                _d_losses(ref, real[i:i + 1].double(), fake[i:i + 1].double()).sum(),
                list(ref.parameters()))]) for i in range(6)])
            mean = gi.mean(0)
            refs.append((float(mean.norm()), float(((gi - mean).pow(2).sum() / (
                6 * 5 * mean.pow(2).sum())).sqrt())))
    q = deepscope.open_run(tmp_path / "gan_d").quantities()
    total = q[q["layer"] == ""].set_index(["name", "step"])["value"]
    for step, (grad_norm, norm_test) in enumerate(refs):
        assert total[("GradNorm", step)] == pytest.approx(grad_norm, rel=1e-5)
        assert total[("NormTest", step)] == pytest.approx(norm_test, rel=1e-5)
