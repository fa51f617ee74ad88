"""What the user changes in place after the recorder saw a tensor never reaches a recorded
value: clip_grad_norm_, gradients accumulated across steps, zero_grad(set_to_none=False), an
in-place ReLU on a recorded activation, the optimiser's update of the parameters, a hook of
the user's own that keeps the gradient and changes it later.

The writer is held back until training ends (a slow writer, made deterministic): every
recorded tensor is summarised only after all of the user's later in-place changes, so a
record that still shares memory with the user's tensors shows their final values, not the
values of its step. Every value is checked against an independent reference: a copy of the
model at the step's start, run out of place, its gradients from `torch.autograd.grad`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import deepscope
from deepscope.recorder.buffers import is_private

STEPS = 3
STATS = ("mean", "min", "max", "norm")


def _held_writer(scope: deepscope.Scope) -> list:
    """Make the writer summarise nothing until `release` runs: payloads are kept."""
    held: list = []
    submit = scope.writer.submit_step

    def hold(payload):
        held.append(payload)
        return True

    scope.writer.submit_step = hold
    return [held, submit]


def _reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Values of one step computed out of place on a copy of the model."""
    ref = copy.deepcopy(model)
    pre = ref[0](x)
    out = ref[2](torch.relu(pre))
    loss = (out - y).pow(2).mean()
    names = [n for n, _ in ref.named_parameters()]
    params = [p for _, p in ref.named_parameters()]
    grads = torch.autograd.grad(loss, [*params, pre, out])
    values = {(n, "forward"): p.detach().clone() for n, p in zip(names, params)}
    values |= {(n, "grad"): g for n, g in zip(names, grads)}
    values |= {("pre", "forward"): pre.detach(), ("out", "forward"): out.detach(),
               ("pre", "grad"): grads[-2], ("out", "grad"): grads[-1]}
    return values


def _train(tmp_path, case: str) -> tuple[deepscope.Run, list[dict]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept: list[torch.Tensor] = []  # what a hook of the user's own keeps
    refs = []
    with deepscope.Scope(tmp_path, case, schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt)
        held, submit = _held_writer(scope)
        for step in range(STEPS):
            x, y = torch.randn(6, 5), torch.randn(6, 3)
            refs.append(_reference(model, x, y))
            with scope.step(step) as rec:
                if case == "zero_fill":
                    opt.zero_grad(set_to_none=False)
                elif case != "accumulate":
                    opt.zero_grad()
                pre = model[0](x)
                rec.tensor("pre", pre)
                if case == "user_hook":
                    pre.register_hook(kept.append)
                out = model[2](model[1](pre))  # ReLU(inplace=True) changes `pre`
                rec.tensor("out", out, role="output")
                loss = (out - y).pow(2).mean()
                rec.loss(loss)
                loss.backward()
                if case == "clip":
                    nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
            for g in kept:  # the user's later use of the gradient it kept
                g.mul_(-3.0)
        for payload in held:
            submit(payload)
    return deepscope.open_run(tmp_path / case), refs


@pytest.mark.parametrize("case", ["clip", "accumulate", "zero_fill", "user_hook"])
def test_in_place_changes_after_capture_never_reach_recorded_values(tmp_path, case):
    run, refs = _train(tmp_path, case)
    assert run.steps() == list(range(STEPS))
    checked = 0
    for step, ref in enumerate(refs):
        for (name, direction), value in ref.items():
            row = run.stats_wide(name, direction=direction, step=step).iloc[0]
            v = value.double()
            want = {"mean": v.mean(), "min": v.min(), "max": v.max(), "norm": v.norm()}
            for stat in STATS:
                assert row[stat] == pytest.approx(float(want[stat]), rel=1e-5, abs=1e-7), (
                    case, step, name, direction, stat)
            checked += 1
    assert checked == STEPS * 12  # 4 parameters and 2 activations, values and gradients


def test_a_gradient_changed_in_place_by_a_later_hook_is_not_recorded_and_says_so(tmp_path,
                                                                                 caplog):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1)) as scope:
        scope.watch(model)
        with scope.step(0) as rec:
            out = model(torch.randn(4, 3))
            rec.tensor("out", out, role="output")
            out.register_hook(lambda g: g.mul_(2.0))  # after deepscope's hook: changes it
            loss = out.pow(2).mean()
            rec.loss(loss)
            loss.backward()
    run = deepscope.open_run(tmp_path / "r")
    grads = set(run.stats(direction="grad", step=0)["tensor"])
    assert "out" not in grads and {"weight", "bias", "loss"} <= grads
    assert "the gradient of 'out' was changed in place after deepscope received it" in (
        caplog.text)


def test_is_private_only_for_a_tensor_nobody_else_reaches():
    t = torch.randn(4, 3)
    assert is_private(t, 1)  # `t` here
    assert not is_private(t, 0)
    other = t
    assert not is_private(t, 1)  # a second reference
    del other
    view = t[1:]
    assert not is_private(t, 1)  # memory shared with a view
    assert not is_private(view, 1)  # ... and the other way round (not contiguous... either)
    del view
    base = torch.randn(12)
    flat = base.view(4, 3)
    assert not is_private(flat, 1)  # its base is reachable
    del base
    assert is_private(flat, 1)  # reachable only through the view
    assert not is_private(torch.randn(3, 4).t().contiguous().t(), 0)  # not contiguous
    w = torch.randn(3, requires_grad=True)
    assert not is_private(w * 2, 0)  # holds an autograd graph
    p = nn.Parameter(torch.randn(3))
    alias = torch.randn(3)
    p.grad = alias.detach()  # as AccumulateGrad adopts a gradient
    assert not is_private(alias, 1)


def test_gradients_of_micro_batches_add_up_whatever_is_done_to_grad_after(tmp_path):
    """Two micro-batches in a step: the first backward's gradient becomes .grad (copied by
    the recorder), the second adds into it in place (kept as it is); the recorded gradient
    is their sum, before the clipping and the update that follow."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    want = [sum(g) for g in zip(*(torch.autograd.grad(model(x).pow(2).mean(),
                                                      list(model.parameters())) for x in xs))]
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1)) as scope:
        scope.watch(model)
        held, submit = _held_writer(scope)
        with scope.step(0) as rec:
            opt.zero_grad()
            for x in xs:
                loss = model(x).pow(2).mean()
                rec.loss(loss)
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
            opt.step()
        opt.zero_grad(set_to_none=False)
        for payload in held:
            submit(payload)
    run = deepscope.open_run(tmp_path / "r")
    for name, g in zip(("weight", "bias"), want):
        row = run.stats_wide(name, direction="grad", step=0).iloc[0]
        assert row["norm"] == pytest.approx(float(g.double().norm()), rel=1e-6)
        assert row["max"] == pytest.approx(float(g.max()), rel=1e-6)
