"""Only backward passes that reach `.grad` make a step's recorded gradients.

A `torch.autograd.grad` pass in the step (a gradient norm read for logging, a gradient
penalty on the parameters or on the input) fires the recorder's hooks too; before, its
gradients were added in and a parameter's recorded gradient was about twice the `.grad` the
optimiser used. A second backward after `zero_grad()` (SAM) starts a parameter's gradient
over. References: each parameter's `.grad` as the optimiser sees it, cloned in the loop, and
each activation's gradient of the passes that count, by `torch.autograd.grad` on a copy of
the model replaying the step out of place.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import deepscope
from deepscope.backward import accumulates

CASES = ("inspect", "penalty", "input_penalty", "sam", "two_losses")


def _forward(model: nn.Sequential, x: torch.Tensor):
    pre = model[0](x)
    out = model[2](model[1](pre))
    return pre, out


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def _activation_reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                          case: str) -> dict[str, torch.Tensor]:
    """d(the loss of the passes that count)/d(pre, out), on a copy, out of place."""
    ref = copy.deepcopy(model)
    x = x.clone().requires_grad_(case == "input_penalty")
    pre, out = _forward(ref, x)
    loss = _loss(out, y)
    params = list(ref.parameters())
    if case == "penalty":
        g = torch.autograd.grad(loss, params, create_graph=True)
        loss = loss + 0.1 * sum(gi.pow(2).sum() for gi in g)
    elif case == "input_penalty":
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = loss + (gx.norm() - 1).pow(2)
    elif case == "two_losses":
        loss = loss + out.abs().mean()
    g_pre, g_out = torch.autograd.grad(loss, [pre, out])
    return {"pre": g_pre, "out": g_out}


def _train(tmp_path, case: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = []
    with deepscope.Scope(tmp_path, case, schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt)
        for step in range(3):
            x, y = torch.randn(6, 5), torch.randn(6, 3)
            want = _activation_reference(model, x, y, case)
            with scope.step(step) as rec:
                opt.zero_grad()
                x.requires_grad_(case == "input_penalty")
                pre, out = _forward(model, x)
                rec.tensor("pre", pre)
                rec.tensor("out", out, role="output")
                loss = _loss(out, y)
                rec.loss(loss)
                params = list(model.parameters())
                if case == "inspect":  # a norm for logging, .grad untouched
                    torch.autograd.grad(loss, params, retain_graph=True)
                    loss.backward()
                elif case == "penalty":
                    g = torch.autograd.grad(loss, params, create_graph=True)
                    (loss + 0.1 * sum(gi.pow(2).sum() for gi in g)).backward()
                elif case == "input_penalty":  # WGAN-GP's shape
                    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                    (loss + (gx.norm() - 1).pow(2)).backward()
                elif case == "sam":  # ascend, zero_grad, the gradient at the perturbed point
                    loss.backward()
                    with torch.no_grad():
                        eps = [0.05 * p.grad / p.grad.norm() for p in params]
                        for p, e in zip(params, eps):
                            p.add_(e)
                    opt.zero_grad()
                    _loss(model(x), y).backward()
                    with torch.no_grad():
                        for p, e in zip(params, eps):
                            p.sub_(e)
                elif case == "two_losses":  # several losses, no zeroing between: the sum
                    loss.backward(retain_graph=True)
                    out.abs().mean().backward()
                want |= {n: p.grad.clone() for n, p in model.named_parameters()}
                opt.step()
            refs.append(want)
    return deepscope.open_run(tmp_path / case), refs


@pytest.mark.parametrize("case", CASES)
def test_recorded_gradients_are_those_of_the_passes_that_reach_grad(tmp_path, case):
    run, refs = _train(tmp_path, case)
    checked = 0
    for step, want in enumerate(refs):
        for name, g in want.items():
            row = run.stats_wide(name, direction="grad", step=step).iloc[0]
            v = g.double()
            assert row["norm"] == pytest.approx(float(v.norm()), rel=1e-5), (case, step, name)
            assert row["mean"] == pytest.approx(float(v.mean()), rel=1e-5, abs=1e-8), (
                case, step, name)
            assert row["max"] == pytest.approx(float(v.max()), rel=1e-5, abs=1e-8), (
                case, step, name)
            checked += 1
    assert checked == 3 * 6  # 4 parameters and 2 activations


def test_accumulates_says_which_pass_reaches_grad():
    w = nn.Parameter(torch.randn(3))
    frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    x = torch.randn(3, requires_grad=True)
    seen: list[tuple[bool, bool]] = []
    h = (w * x).tanh()
    h.register_hook(lambda g: seen.append((accumulates([frozen, w]), accumulates([]))))
    h.sum().backward(retain_graph=True)
    torch.autograd.grad(h.sum(), [w], retain_graph=True)
    torch.autograd.grad(h.sum(), [x], retain_graph=True)
    h.sum().backward(inputs=[x], retain_graph=True)
    h.sum().backward(inputs=[w])
    # backward(); autograd.grad of w, of x; backward into x only, into w only. With no
    # parameter to ask about, every pass counts.
    assert seen == [(True, True), (False, True), (False, True), (False, True), (True, True)]
