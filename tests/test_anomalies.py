"""Health monitor: the first NaN/Inf traced to its origin, the detectors, `deepscope doctor`.

The monitor is driven by hand-written loops (start / loss / finish), as the recorder drives it.
The last test goes through `deepscope.Scope(..., anomalies="trace")`, as a user would.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import deepscope
from deepscope.anomalies import (
    DeadUnits,
    Detector,
    Finding,
    GradientNorm,
    HealthMonitor,
    LossSpike,
    StepContext,
    StopTraining,
    UpdateRatio,
)
from deepscope.anomalies.doctor import report
from deepscope.cli.main import main as cli_main

INF, NAN = math.inf, math.nan


# --- models with a fault that can be switched on at a known step ----------------------------------
class InfAt(nn.Module):
    """Identity, except that one element of its output is +Inf while `fire` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fire:
            return x
        x = x.clone()
        x[0, 0] = INF
        return x


class _NaNGrad(torch.autograd.Function):
    """Identity forward; the backward returns NaN gradients when asked to."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fire: bool) -> torch.Tensor:
        ctx.fire = fire
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (torch.full_like(grad, NAN) if ctx.fire else grad), None


class NaNGradAt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NaNGrad.apply(x, self.fire)


class Block(nn.Module):
    """Applies the NaN-gradient function in its own code, between its submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_NaNGrad.apply(self.a(x), self.fire))


class Overflow(nn.Module):
    """Multiplies by Inf in its own code (not in a submodule) while `fire` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 8)
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * INF if self.fire else h)


def mlp(fault: nn.Module) -> nn.Sequential:
    """Paths: 0 Linear, 1 ReLU, 2 fault, 3 Linear, 4 Tanh, 5 Linear."""
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), fault, nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def train(model: nn.Module, monitor: HealthMonitor, steps: int, *, before=None, lr=0.1,
          loss_of=None, x_of=None, kind: str = "train", optimise: bool = True
          ) -> dict[int, tuple[list[Finding], int]]:
    """A plain training loop driving the monitor; returns finish() results per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    results = {}
    for step in range(steps):
        if before is not None:
            before(step)
        x = torch.randn(16, 6) if x_of is None else x_of(step)
        y = torch.randint(0, 3, (16,))
        monitor.start(step, kind)
        out = model(x)
        loss = F.cross_entropy(out, y) if loss_of is None else loss_of(step, out, y)
        monitor.loss(loss)
        opt.zero_grad()
        loss.backward()
        if optimise:
            opt.step()
        results[step] = monitor.finish(step)
    return results


def only(results: dict, detector: str | None = None) -> list[Finding]:
    return [f for found, _ in results.values() for f in found
            if detector is None or f.detector == detector]


def one_forward_findings(model: nn.Module, detector: Detector, x: torch.Tensor
                         ) -> dict[str, float]:
    """{detector name: value} of the findings of one monitored forward of `x` (no backward)."""
    monitor = HealthMonitor(model, detectors=[detector], trace=False)
    monitor.start(0, "train")
    with torch.no_grad():
        model(x)
    return {f.detector: f.value for f in monitor.finish(0)[0]}


def switch_at(module: nn.Module, step: int):
    def before(s: int) -> None:
        module.fire = s == step
    return before


# --- trace to origin ------------------------------------------------------------------------------
def test_forward_inf_is_traced_to_the_module_that_made_it_not_to_later_layers():
    fault = InfAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, prefix="net", detectors=[])
    results = train(model, monitor, 8, before=switch_at(fault, 4))
    found = only(results)
    assert [(f.step, f.tensor, f.detector) for f in found] == [(4, "net.2", "nonfinite")]
    msg = found[0].message
    assert "forward output of net.2" in msg and "InfAt" in msg and "shape (16, 8)" in msg
    assert "max inf" in msg and "inputs are finite" in msg  # its input's min/max are given
    assert results[4][1] == 3          # the recorder is asked to record 3 more steps in full
    assert all(results[s] == ([], 0) for s in range(4))
    # The update of step 4 made the weights non-finite: the episode goes on, one finding only.
    assert all(results[s][0] == [] for s in range(5, 8))


def test_backward_only_nan_names_the_module_whose_backward_made_it():
    fault = NaNGradAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, prefix="net", detectors=[])
    results = train(model, monitor, 6, before=switch_at(fault, 3), optimise=False)
    found = only(results)
    assert [(f.step, f.tensor) for f in found] == [(3, "net.2")]
    msg = found[0].message
    assert msg.startswith("first non-finite gradient of step 3: the backward of net.2")
    assert "NaNGradAt" in msg and "gradient of its output is finite" in msg
    # its input comes from net.1, a ReLU: an activation the trace does not hook
    assert "gradient of input 0 of net.2 (shape (16, 8)) has min nan" in msg
    assert results[3][1] == 3


def test_backward_nan_made_by_code_inside_a_module_names_that_module():
    block = Block()
    model = nn.Sequential(nn.Linear(6, 8), block, nn.Linear(8, 3))
    monitor = HealthMonitor(model, detectors=[])
    found = only(train(model, monitor, 5, before=switch_at(block, 2), optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(2, "1")]
    assert "gradient of 1.a" in found[0].message
    assert "no watched module used that tensor" in found[0].message


def test_nonfinite_loss_with_finite_activations_names_the_loss():
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[])

    def loss_of(step, out, y):
        loss = F.cross_entropy(out, y)
        return loss + torch.log(torch.zeros(())) if step == 3 else loss

    found = only(train(model, monitor, 5, loss_of=loss_of, optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(3, "loss")]
    assert "every watched module output is finite" in found[0].message


def test_nonfinite_data_names_the_models_input():
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, root_name="mlp", detectors=[])

    def x_of(step):
        x = torch.randn(16, 6)
        if step == 2:
            x[3, 1] = NAN
        return x

    found = only(train(model, monitor, 4, x_of=x_of, optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(2, "mlp")]
    assert "the model's input" in found[0].message


def test_nonfinite_made_between_submodules_names_the_parent_module():
    parent = Overflow()
    model = nn.Sequential(parent, nn.Linear(8, 3))
    monitor = HealthMonitor(model, detectors=[])
    found = only(train(model, monitor, 4, before=switch_at(parent, 1)))
    assert [(f.step, f.tensor) for f in found] == [(1, "0")]
    assert "no watched module returned it" in found[0].message
    assert "input 0 of 0.b" in found[0].message


def test_nonfinite_weights_are_named_in_the_finding():
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[])

    def before(step):
        if step == 2:
            with torch.no_grad():
                model[3].weight[0, 0] = INF

    found = only(train(model, monitor, 3, before=before, optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(2, "3")]
    assert "its parameters 3.weight" in found[0].message


def test_dict_outputs_and_repeated_calls_are_named_like_the_recorder():
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fire = False

        def forward(self, x):
            return {"ok": x, "bad": x * INF if self.fire else x * 2}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell, self.heads, self.out = nn.Linear(6, 6), Heads(), nn.Linear(6, 3)

        def forward(self, x):
            for _ in range(3):  # the same module, called three times
                x = torch.tanh(self.cell(x))
            return self.out(self.heads(x)["bad"])

    net = Net()
    monitor = HealthMonitor(net, prefix="net", detectors=[])
    found = only(train(net, monitor, 3, before=switch_at(net.heads, 1), optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(1, "net.heads.bad")]
    assert "its inputs are finite: input 0 min" in found[0].message  # tanh is not a module

    with torch.no_grad():
        net.cell.weight.fill_(1e38)  # its first call saturates tanh, the second overflows
    monitor.start(9, "train")
    net(torch.full((2, 6), 1e-10))
    found, _ = monitor.finish(9)
    assert [f.tensor for f in found] == ["net.cell"]
    assert "net.cell (call 2)" in found[0].message


def test_inplace_relu_keeps_its_input_version():
    fault = InfAt()
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), fault, nn.Linear(8, 3))
    monitor = HealthMonitor(model, detectors=[])
    found = only(train(model, monitor, 3, before=switch_at(fault, 1)))
    assert [(f.step, f.tensor) for f in found] == [(1, "2")]


def test_nan_gradient_from_the_loss_function_names_the_loss():
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[])

    def loss_of(step, out, y):  # sqrt at 0: finite value, infinite slope (0 * inf = NaN)
        loss = F.cross_entropy(out, y)
        return loss + torch.sqrt((out * 0).sum()) if step == 2 else loss

    found = only(train(model, monitor, 3, loss_of=loss_of, optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(2, "loss")]
    assert "the model output: the backward of the loss computation" in found[0].message


def test_a_gradient_norm_that_overflows_is_verified_before_it_is_reported():
    model = nn.Linear(4, 4)
    monitor = HealthMonitor(model, detectors=[])
    for step, poison in enumerate([False, True]):
        monitor.start(step, "train")
        model(torch.ones(2, 4))
        model.weight.grad = torch.full_like(model.weight, 3e38)  # finite; its norm is not
        model.bias.grad = torch.zeros_like(model.bias)
        if poison:
            model.weight.grad[1, 2] = INF
        found, _ = monitor.finish(step)
        assert [f.tensor for f in found] == (["weight"] if poison else [])


def test_deferred_check_reports_one_step_late_and_on_flush():
    fault = InfAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], defer=True)
    results = train(model, monitor, 4, before=switch_at(fault, 3))
    assert only(results) == []                      # step 3 is still in flight
    found, record = monitor.flush()
    assert [(f.step, f.tensor) for f in found] == [(3, "2")] and record == 3

    fault2 = InfAt()
    model2 = mlp(fault2)
    monitor2 = HealthMonitor(model2, detectors=[], defer=True)
    results2 = train(model2, monitor2, 4, before=switch_at(fault2, 1))
    assert results2[1] == ([], 0)
    assert [(f.step, f.tensor) for f in results2[2][0]] == [(1, "2")]
    monitor.close()
    monitor2.close()


def test_a_step_left_without_finish_is_still_judged_in_deferred_mode():
    fault = InfAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], defer=True)
    for step in range(4):
        fault.fire = step == 1
        monitor.start(step, "train")
        model(torch.randn(4, 6)).sum().backward()
        if step == 2:
            continue  # the user's step raised: the recorder does not call finish()
        found, record = monitor.finish(step)
        if step == 3:  # step 1's slots were about to be reused: judged at start(3)
            assert [(f.step, f.tensor) for f in found] == [(1, "2")] and record == 3
        else:
            assert found == []


def test_deepscopes_own_passes_are_ignored():
    from deepscope.hookstate import paused

    fault = InfAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[])
    monitor.start(0, "train")
    model(torch.randn(4, 6)).sum().backward()
    with paused():  # e.g. a curvature instrument re-running the model
        fault.fire = True
        model(torch.randn(4, 6)).sum()
    assert monitor.finish(0) == ([], 0)


def test_health_check_without_trace_names_the_first_bad_gradient():
    fault = NaNGradAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], trace=False)
    found = only(train(model, monitor, 4, before=switch_at(fault, 2), optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(2, "0.weight")]


def test_healthy_training_reports_nothing():
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detector_every=2)
    assert only(train(model, monitor, 30, lr=0.05)) == []


# --- callbacks ------------------------------------------------------------------------------------
def test_stop_training_from_the_callback_is_raised_at_the_next_start():
    def stop(finding: Finding) -> None:
        if finding.detector == "nonfinite":
            raise StopTraining(finding)

    fault = InfAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], on_anomaly=stop)
    with pytest.raises(StopTraining) as info:
        train(model, monitor, 10, before=switch_at(fault, 2))
    assert info.value.finding.step == 2 and info.value.finding.tensor == "2"
    assert not isinstance(info.value, Exception)  # passes `except Exception` guards


def test_a_failing_callback_is_logged_once_and_training_goes_on(caplog):
    calls = []

    def broken(finding: Finding) -> None:
        calls.append(finding.step)
        raise RuntimeError("oops")

    fault = InfAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], on_anomaly=broken)

    def before(step: int) -> None:  # two episodes: Inf at 1, finite at 2, Inf at 3
        fault.fire = step in (1, 3)

    with caplog.at_level(logging.WARNING, logger="deepscope"):
        results = train(model, monitor, 5, before=before, optimise=False)
    assert calls == [1, 3] and [f.step for f in only(results)] == [1, 3]
    assert sum("on_anomaly callback raised" in r.message for r in caplog.records) == 1


# --- detectors ------------------------------------------------------------------------------------
def test_gradient_norm_flags_explosion_and_vanishing_only_when_they_happen():
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[GradientNorm()], detector_every=1)

    def loss_of(step, out, y):
        scale = {20: 1e3, 26: 1e-4}.get(step, 1.0)
        return F.cross_entropy(out, y) * scale

    results = train(model, monitor, 30, loss_of=loss_of, optimise=False)
    exploding = only(results, "exploding_gradient")
    vanishing = only(results, "vanishing_gradient")
    names = {n for n, _ in model.named_parameters()}
    assert {f.step for f in exploding} == {20} and {f.tensor for f in exploding} == names
    assert {f.step for f in vanishing} == {26} and {f.tensor for f in vanishing} == names
    assert all(f.value >= 10 and f.threshold == 10 for f in exploding)
    assert all(f.value <= 0.01 for f in vanishing)
    assert results[20][1] == 3 and results[26][1] == 0   # only the explosion is acute
    assert len(only(results)) == len(exploding) + len(vanishing)


@pytest.mark.parametrize("light", [False, True])
def test_loss_spike_runs_every_step_and_compares_with_the_running_median(light):
    """light: without the trace and with gradients every 10th step, the steps in between
    check their loss on the host alone (no step record); the spike is found the same."""
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[LossSpike()], detector_every=7,
                            **({"trace": False, "grad_every": 10} if light else {}))
    losses = {}

    def loss_of(step, out, y):
        loss = F.cross_entropy(out, y) * (10.0 if step == 23 else 1.0)
        losses[step] = loss.item()
        return loss

    results = train(model, monitor, 26, loss_of=loss_of, optimise=False)
    found = only(results)
    assert [(f.step, f.tensor, f.detector) for f in found] == [(23, "loss", "loss_spike")]
    assert found[0].value == pytest.approx(losses[23] / sorted(losses[s] for s in
                                                               range(23))[11], rel=1e-5)
    assert results[23][1] == 3


def test_dead_and_saturated_relu_units_are_flagged_and_healthy_ones_are_not():
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    dead = DeadUnits()
    dead.period = 1  # on every detector step (default: every 5th)
    monitor = HealthMonitor(model, detectors=[dead], detector_every=5)
    assert only(train(model, monitor, 10)) == []
    with torch.no_grad():
        model[0].bias[:24] = -100.0  # 24 of 32 units can never fire
    found = only(train(model, monitor, 10))
    kinds = {(f.step, f.tensor, f.detector): f.value for f in found}
    assert set(kinds) == {(0, "1", "dead_units")}
    assert kinds[(0, "1", "dead_units")] == pytest.approx(0.75)

    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    found = only(train(model, monitor, 1))
    # saturation is new; dead_units is the same episode as before, so it is not repeated
    assert {(f.detector, f.value) for f in found} == {("saturation", 1.0)}


def test_dead_unit_fractions_match_a_brute_force_count_over_two_calls():
    """A ReLU called twice in a step: zeros are counted over both calls, a unit is dead only
    if it is zero for every item of both; NaN is not zero."""
    torch.manual_seed(0)
    relu = nn.ReLU()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.relu = nn.Linear(6, 12), relu

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            h[0, 7] = NAN  # one NaN output of a live unit: not a zero
            return self.relu(h) + self.relu(self.lin(-x))

    model = Twice()
    with torch.no_grad():
        model.lin.bias[:5] = -100.0  # units 0-4 dead in both calls
    outs = []
    relu.register_forward_hook(lambda m, i, o: outs.append(o.detach().clone()))
    found = one_forward_findings(model, DeadUnits(saturation=0.01, dead=0.01),
                                 torch.randn(16, 6))
    both = torch.cat(outs)
    zero_frac = (both == 0).sum().item() / both.numel()
    dead_frac = (both == 0).all(0).double().mean().item()
    assert found == {"saturation": pytest.approx(zero_frac, abs=1e-12),
                     "dead_units": pytest.approx(dead_frac, abs=1e-12)}
    assert dead_frac == pytest.approx(5 / 12) and 0 < zero_frac < 1


def test_dead_units_also_work_without_the_trace():
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    monitor = HealthMonitor(model, detectors=[DeadUnits()], trace=False)
    found = only(train(model, monitor, 2))
    assert {(f.step, f.detector) for f in found} == {(0, "dead_units"), (0, "saturation")}
    monitor.close()
    assert all(not m._forward_hooks for m in model.modules())


def test_update_ratio_flags_steps_out_of_range():
    for lr, expect in [(1e-9, "below"), (100.0, "above"), (0.05, None)]:
        model = mlp(nn.Identity()).double()  # float64: a 1e-9 update is not rounded away
        monitor = HealthMonitor(model, detectors=[UpdateRatio()], detector_every=3)
        found = only(train(model, monitor, 2, lr=lr,
                           x_of=lambda s: torch.randn(16, 6, dtype=torch.float64)))
        weights = {n for n, p in model.named_parameters() if p.dim() == 2}
        if expect is None:
            assert found == []
        else:
            assert {f.tensor for f in found} == weights and {f.step for f in found} == {0}
            assert all(expect in f.message for f in found)
    # no optimiser step (gradient accumulation): nothing moved, nothing is judged
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[UpdateRatio()])
    assert only(train(model, monitor, 2, optimise=False)) == []


def test_update_ratios_match_a_brute_force_snapshot_on_every_detector_step():
    """The snapshot is reused between detector steps (and remade when a parameter is
    replaced by one of another shape); each ratio is ‖θ_after − θ_before‖ / ‖θ_before‖ of
    that step, computed here in float64 from copies taken around the optimiser step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    detector = UpdateRatio(low=0.0, high=1e-12)  # every weight is reported... once per episode
    detector.period = 1
    monitor = HealthMonitor(model, detectors=[detector], detector_every=2, trace=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    expected, got = {}, {}
    for step in range(7):
        if step == 4:  # a new, larger last layer: its snapshot is remade
            model[2] = nn.Linear(8, 5)
            monitor.close()
            detector._active.clear()
            monitor = HealthMonitor(model, detectors=[detector], detector_every=2,
                                    trace=False)
            monitor._starts = 1  # step 4 is not a detector step, step 5 is
            opt = torch.optim.Adam(model.parameters(), lr=0.05)
        weights = {n: p for n, p in model.named_parameters() if p.dim() == 2}
        before = {n: p.detach().double().clone() for n, p in weights.items()}
        monitor.start(step, "train")
        loss = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 3, (16,)))
        monitor.loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for f in monitor.finish(step)[0]:
            got[(step, f.tensor)] = f.value
            detector._active.clear()  # report every step, not once per episode
        expected.update({(step, n): ((p.detach().double() - before[n]).norm()
                                     / before[n].norm()).item()
                         for n, p in weights.items()})
    assert {s for s, _ in got} == {0, 2, 5}
    for key, value in got.items():
        assert value == pytest.approx(expected[key], rel=1e-5), key


def test_dead_units_of_an_activation_with_negative_outputs():
    """Hardswish is negative for inputs in (-3, 0): those outputs are not zero, and a unit
    with only negative outputs is alive."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Hardswish())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.copy_(torch.tensor([-1.0, -1.0, -1.0, -5.0, -5.0, 0.0]))
    found = one_forward_findings(model, DeadUnits(saturation=0.3, dead=0.3),
                                 torch.randn(8, 4))
    assert found == {"saturation": pytest.approx(0.5), "dead_units": pytest.approx(0.5)}


def test_history_median_matches_statistics_median_over_a_sliding_window():
    import random
    import statistics
    from collections import deque

    from deepscope.anomalies.detectors import _History

    rng = random.Random(0)
    history, window = _History(window=7, min_history=3), deque(maxlen=7)
    for _ in range(200):
        value = rng.choice([rng.random(), 0.5, float(rng.randint(0, 3))])
        ratio, median, n = history.ratio("k", value)
        assert n == len(window)
        if n >= 3:
            assert median == statistics.median(window)
            assert ratio == (value / median if median > 0 else None)
        else:
            assert math.isnan(median) and ratio is None
        window.append(value)
    assert history.ratio("k", NAN)[2] == 7 and history.ratio("k", 1.0)[2] == 7  # not kept


def test_detector_periods_thin_the_costly_detectors():
    """A detector of period p runs on every p-th detector step, from the first; the update
    ratio and the activation detector default to 5 (every 50 steps), the others to 1."""
    seen: dict[int, list[int]] = {1: [], 5: []}

    class Spy(Detector):
        name = "spy"

        def __init__(self, period: int) -> None:
            super().__init__()
            self.period = period

        def begin(self, ctx: StepContext) -> None:
            seen[self.period].append(ctx.step)

    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[Spy(1), Spy(5)], trace=False, grad_every=10)
    train(model, monitor, 101)
    assert seen == {1: list(range(0, 101, 10)), 5: [0, 50, 100]}
    assert DeadUnits().period == UpdateRatio().period == 5
    assert GradientNorm().period == LossSpike().period == 1
    with pytest.raises(ValueError, match="spy: period must be an integer >= 1"):
        HealthMonitor(model, detectors=[Spy(0)])


def test_custom_detector_sees_the_step_and_eval_steps_skip_stale_gradients():
    class Probe(Detector):
        name = "probe"
        observes_outputs = True

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[int, list[str], list[str]]] = []
            self.outputs: list[str] = []

        def observe(self, path, module, output):
            self.outputs.append(path)

        def measure(self, ctx: StepContext):
            return {"n": torch.tensor(float(len(ctx.grads)))}

        def judge(self, ctx, values):
            self.seen.append((ctx.step, ctx.kind, list(ctx.grads), values["n"]))
            return [Finding(ctx.step, "x", self.name, values["n"][0], None, "probe")]

    probe = Probe()
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    monitor = HealthMonitor(model, detectors=[probe], detector_every=1)
    results = train(model, monitor, 1)
    assert [f.detector for f in only(results)] == ["probe"] and results[0][1] == 0
    assert probe.outputs == ["0", "1", "2", "model"]
    monitor.start(1, "eval")
    with torch.no_grad():
        model(torch.randn(3, 6))
    monitor.finish(1)
    assert probe.seen[0][2] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert probe.seen[1][1:] == ("eval", [], [0.0])


# --- interface errors -----------------------------------------------------------------------------
def test_misuse_is_refused_with_a_clear_message():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="record_next"):
        HealthMonitor(model, record_next=-1)
    with pytest.raises(ValueError, match="detector_every"):
        HealthMonitor(model, detector_every=0)
    with pytest.raises(TypeError, match="Detector instances"):
        HealthMonitor(model, detectors=[object()])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        HealthMonitor(object())
    with pytest.raises(ValueError, match="need 0 <= vanish < 1 < explode"):
        GradientNorm(explode=0.5)
    monitor = HealthMonitor(model)
    with pytest.raises(ValueError, match="start"):
        monitor.finish(0)
    monitor.start(0, "train")
    with pytest.raises(TypeError, match="scalar loss"):
        monitor.loss(torch.ones(3))
    with pytest.raises(ValueError, match="finish\\(1\\)"):
        monitor.finish(1)
    monitor.close()
    monitor.close()
    with pytest.raises(ValueError, match="after close"):
        monitor.start(1, "train")
    assert not model._forward_hooks


# --- doctor ---------------------------------------------------------------------------------------
def _run_with_findings(tmp_path, rows):
    scope = deepscope.Scope(tmp_path, run="r1", schedule=deepscope.at([5, 6, 7]))
    model = nn.Linear(3, 1)
    scope.watch(model)
    for step in range(9):
        with scope.step(step) as rec:
            loss = model(torch.randn(4, 3)).pow(2).mean()
            rec.loss(loss)
            loss.backward()
    scope.writer.submit_anomalies(rows)
    scope.close()
    return tmp_path / "r1"


def test_doctor_reports_the_first_nonfinite_and_where_to_look(tmp_path, capsys):
    run = _run_with_findings(tmp_path, [
        (3, "net.0", "exploding_gradient", 14.2, 10.0, "gradient norm of net.0.weight ..."),
        (5, "net.2", "nonfinite", None, None, "first non-finite value of step 5: forward"),
        (6, "loss", "loss_spike", 4.0, 3.0, "loss 9 is 4× the median"),
        (8, "net.2", "nonfinite", None, None, "first non-finite value of step 8: ..."),
    ])
    text = report(run)
    assert "4 findings — 2 nonfinite, 1 exploding_gradient, 1 loss_spike" in text
    assert "FIRST NON-FINITE VALUE: step 5, net.2" in text
    assert "look: Graph tab at step 5: node net.2" in text
    assert "recorded steps from there: 5, 6, 7" in text
    assert "non-finite again later (new episodes) at steps 8" in text
    assert "KPIs tab" in text and "Instruments tab, GradNorm" in text
    assert cli_main(["doctor", str(run), "--limit", "1"]) == 0
    assert "FIRST NON-FINITE VALUE" in capsys.readouterr().out


def test_doctor_group_hints_name_steps_and_tensors_and_findings_have_kinds(tmp_path):
    run = _run_with_findings(tmp_path, [
        (3, "net.0", "exploding_gradient", 14.2, 10.0, "gradient norm of net.0 ..."),
        (4, "net.1", "exploding_gradient", 15.0, 10.0, "gradient norm of net.1 ..."),
        (6, "loss", "loss_spike", 4.0, 3.0, "loss 9 is 4× the median"),
    ])
    text = report(run)
    assert "<tensor>" not in text and "<step>" not in text
    assert "Instruments tab, GradNorm of layer net.0, net.1" in text
    assert "KPIs tab, loss around step 6" in text
    with deepscope.open_run(run) as r:
        assert list(r.anomalies()["kind"]) == ["default"] * 3


def test_doctor_on_a_clean_run_a_project_and_a_bad_path(tmp_path, capsys):
    run = _run_with_findings(tmp_path, [])
    assert "no anomalies recorded" in report(run)
    assert "run r1" in report(tmp_path)               # a project folder: each of its runs
    assert cli_main(["doctor", str(tmp_path / "nope")]) == 2
    assert "no run folder at" in capsys.readouterr().err


# --- end to end through the recorder: Scope(..., anomalies="trace") ---------------------------
def test_end_to_end_scope_records_the_origin_and_the_steps_after_it(tmp_path):
    fault = InfAt()
    model = mlp(fault)
    scope = deepscope.Scope(tmp_path, run="e2e", schedule=deepscope.every(100),
                            anomalies="trace")
    scope.watch(model, name="net", activations=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(12):
        fault.fire = step == 6
        with scope.step(step) as rec:
            loss = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 3, (16,)))
            rec.loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    scope.close()
    run = deepscope.open_run(tmp_path / "e2e")
    found = run.anomalies()
    first = found[found["detector"] == "nonfinite"].iloc[0]
    assert (int(first["step"]), first["tensor"]) == (6, "net.2")
    assert {7, 8, 9} <= set(run.steps())              # recorded in full after the finding
    assert "FIRST NON-FINITE VALUE: step 6, net.2" in report(tmp_path / "e2e")


# --- gradients on a schedule (grad_every): the first non-finite step is still found ---------------
def train_zeroing_first(model: nn.Module, monitor: HealthMonitor, steps: int, *, before
                        ) -> dict[int, tuple[list[Finding], int]]:
    """Like `train`, but zero_grad at the top of the step: no gradient survives into the next."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = {}
    for step in range(steps):
        before(step)
        opt.zero_grad()
        monitor.start(step, "train")
        loss = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 3, (16,)))
        monitor.loss(loss)
        loss.backward()
        opt.step()
        results[step] = monitor.finish(step)
    return results


@pytest.mark.parametrize("grad_every", [1, 10])
def test_nan_gradient_on_an_unchecked_step_is_named_at_its_own_step(grad_every):
    """Step 3's gradients are not checked (grad_every=10): its NaN update makes the loss of
    step 4 non-finite, and the finding still names step 3 and the same gradient as a check of
    every step does."""
    torch.manual_seed(0)
    fault = NaNGradAt()
    model = mlp(fault)
    seen = []
    monitor = HealthMonitor(model, detectors=[], trace=False, grad_every=grad_every,
                            on_anomaly=seen.append)
    results = train(model, monitor, 8, before=switch_at(fault, 3))
    found = only(results)
    assert [(f.step, f.tensor, f.detector) for f in found] == [(3, "0.weight", "nonfinite")]
    assert seen == found
    assert "first non-finite gradient of step 3" in found[0].message
    if grad_every == 10:
        assert "found at step 4" in found[0].message
        assert results[4][1] == monitor.record_next  # handed over with step 4, acute


def test_nan_update_on_an_unchecked_step_names_the_parameter_when_its_gradient_is_gone():
    torch.manual_seed(0)
    fault = NaNGradAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], trace=False, grad_every=10)
    found = only(train_zeroing_first(model, monitor, 8, before=switch_at(fault, 3)))
    assert [(f.step, f.tensor) for f in found] == [(3, "0.weight")]
    assert "cannot be named" in found[0].message and "step 4" in found[0].message


def test_forward_origin_on_an_unchecked_step_is_found_at_that_step():
    """Finite parameters before a non-finite loss: the step's own forward is the origin, as
    with a check of every step."""
    def loss_of(step, out, y):
        return F.cross_entropy(out, y) * (INF if step == 4 else 1.0)

    by_every = {}
    for grad_every in (1, 10):
        torch.manual_seed(0)
        model = mlp(nn.Identity())
        monitor = HealthMonitor(model, detectors=[], trace=False, grad_every=grad_every)
        found = only(train(model, monitor, 7, loss_of=loss_of))
        by_every[grad_every] = [(f.step, f.tensor) for f in found]
    assert by_every[10] == by_every[1] == [(4, "loss")]


def test_gradient_only_nan_on_an_unchecked_step_is_missed_when_never_applied():
    """Documented limit of grad_every: a NaN gradient that no update applies (the loss stays
    finite) is seen only on a checked step — here step 10, not step 3."""
    fault = NaNGradAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[], trace=False, grad_every=10)
    missed = only(train(model, monitor, 12, before=switch_at(fault, 3), optimise=False))
    assert missed == []
    monitor = HealthMonitor(model, detectors=[], trace=False, grad_every=10)
    found = only(train(model, monitor, 12, before=switch_at(fault, 10), optimise=False))
    assert [(f.step, f.tensor) for f in found] == [(10, "0.weight")]


def test_a_step_without_a_loss_checks_its_gradients():
    """With gradients every 10th step, a step whose loss is not given is checked by its
    gradients: a NaN gradient at step 3 is found at step 3."""
    fault = NaNGradAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[LossSpike()], trace=False, grad_every=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = []
    for step in range(6):
        fault.fire = step == 3
        monitor.start(step, "train")
        loss = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 3, (16,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        found += monitor.finish(step)[0]
    assert [(f.step, f.tensor, f.detector) for f in found] == [(3, "0.weight", "nonfinite")]


@pytest.mark.parametrize("grad_every", [1, 10])
def test_a_later_micro_batch_with_an_infinite_loss_is_found_at_its_step(grad_every):
    """Two micro-batches per step, the second one's loss infinite at step 4: the finding is the
    loss of step 4, whether or not the step's gradients were due for a check."""
    torch.manual_seed(0)
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[LossSpike()], trace=False,
                            grad_every=grad_every)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found, record_next = [], {}
    for step in range(7):
        monitor.start(step, "train")
        opt.zero_grad()
        for micro in range(2):
            loss = F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,)))
            if step == 4 and micro == 1:
                loss = loss * INF
            monitor.loss(loss)
            (loss / 2).backward()
        opt.step()
        findings, record_next[step] = monitor.finish(step)
        found += findings
    assert [(f.step, f.tensor, f.detector) for f in found] == [(4, "loss", "nonfinite")]
    assert record_next[4] == monitor.record_next


def test_a_light_step_left_without_finish_is_dropped_and_checks_go_on():
    """A step that raised before finish(): the next start() drops it, its loss included; a
    NaN gradient at step 3 is still named at step 3 (from step 4's non-finite loss)."""
    torch.manual_seed(0)
    fault = NaNGradAt()
    model = mlp(fault)
    monitor = HealthMonitor(model, detectors=[LossSpike()], trace=False, grad_every=10)
    monitor.start(0, "train")
    monitor.loss(torch.tensor(1.0))  # step 0 raised in the user's code after this
    with pytest.raises(ValueError, match="finish\\(0\\) called after start of step 1"):
        monitor.start(1, "train")
        monitor.finish(0)
    results = train(model, monitor, 6, before=lambda s: switch_at(fault, 3)(s + 2))
    found = only(results)
    assert [(f.step, f.tensor) for f in found] == [(1, "0.weight")]
    assert "found at step 2" in found[0].message


def test_a_failing_detector_on_light_steps_is_reported_once_and_the_others_still_judge(caplog):
    class Broken(Detector):
        name = "broken"
        every_step = True

        def judge(self, ctx, values):
            raise RuntimeError("boom")

    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[Broken(), LossSpike()], trace=False,
                            grad_every=10)
    assert monitor._light_due is not None  # both judge from the host alone: light steps

    def loss_of(step, out, y):
        return F.cross_entropy(out, y) * (10.0 if step == 23 else 1.0)

    with caplog.at_level(logging.WARNING, logger="deepscope"):
        found = only(train(model, monitor, 26, loss_of=loss_of, optimise=False))
    assert [(f.step, f.detector) for f in found] == [(23, "loss_spike")]
    assert sum("detector Broken failed (RuntimeError: boom)" in r.message
               for r in caplog.records) == 1


def test_grad_every_is_validated():
    with pytest.raises(ValueError, match="grad_every must be an integer >= 1"):
        HealthMonitor(mlp(nn.Identity()), grad_every=0)


def test_default_scope_check_names_an_unchecked_nan_gradient_step(tmp_path):
    """Through the recorder's default check (gradients every 10th step): a NaN gradient at
    step 13 is stored under step 13, with the gradient it came from."""
    torch.manual_seed(0)
    fault = NaNGradAt()
    model = mlp(fault)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.never) as scope:
        scope.watch(model)
        for step in range(16):
            fault.fire = step == 13
            with scope.step(step) as rec:
                losses = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 3, (16,)),
                                         reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
    rows = deepscope.open_run(tmp_path / "r").anomalies()
    nonfinite = rows[rows["detector"] == "nonfinite"]
    assert nonfinite[["step", "tensor"]].values.tolist() == [[13, "0.weight"]]
    # found during step 14, which had started unrecorded: the steps after it are recorded
    assert set(deepscope.open_run(tmp_path / "r").steps()) == {15}


def test_detector_steps_hook_only_the_modules_a_detector_observes():
    class LinearOnly(Detector):
        name = "linear_only"
        observes_outputs = True

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def observes(self, module: nn.Module) -> bool:
            return isinstance(module, nn.Linear)

        def observe(self, path: str, module: nn.Module, output: torch.Tensor) -> None:
            self.seen.append(path)

    probe = LinearOnly()
    model = mlp(nn.Identity())
    monitor = HealthMonitor(model, detectors=[probe], trace=False)
    monitor.start(0, "train")
    assert len(monitor._step_handles) == 3  # the three Linear layers, nothing else hooked
    model(torch.randn(4, 6)).sum().backward()
    monitor.finish(0)
    assert probe.seen == ["0", "3", "5"]
