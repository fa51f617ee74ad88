"""Real training code: gradient accumulation, extra backward passes, per-sample losses of any
shape. Each step is compared with an equivalent plain step (float64, rtol 1e-10) and with the
brute-force per-sample reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from deepscope.instruments import Instruments, QuantityValue

from . import reference as R
from .test_suite import FIRST_ORDER, LR, assert_close

F64 = torch.float64
EXACT = ["HessTrace", "TICDiag", "TICTrace"]
# micro-batch losses -> the scalar each micro-batch backpropagates
SCALINGS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "mean": lambda losses, k: losses.mean(),
    "sum": lambda losses, k: losses.sum(),
    "mean/k": lambda losses, k: losses.mean() / k,
    "sum/k": lambda losses, k: losses.sum() / k,
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8, 3)).to(F64)


def data(model: nn.Module, n: int, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    shape = (5,) if isinstance(model[0], nn.Linear) else (1, 6, 6)
    return torch.randn(n, *shape, generator=gen, dtype=F64), torch.randint(0, 3, (n,),
                                                                          generator=gen)


Values = dict[tuple[str, int, str], QuantityValue]


def collect(values: Values, got: list[QuantityValue]) -> None:
    for v in got:
        key = (v.name, v.step, v.layer)
        assert key not in values, key
        values[key] = v


def run_steps(model: nn.Module, quantities: list[str], k: int, b: int, scaling: str,
              steps: int = 2, refs: list | None = None) -> Values:
    """Train `steps` SGD steps of k micro-batches of b samples (k = 1: one batch whose loss
    backpropagates what the k micro-batches would have, together)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inst = Instruments(model, quantities, optimizer=opt, curvature="exact")
    values: Values = {}
    for step in range(steps):
        x, y = data(model, k * b if k > 1 else b, step)
        if refs is not None:
            refs.append(R.batch_reference(
                model, lambda m, x=x, y=y: F.cross_entropy(m(x), y, reduction="none")))
        inst.start(step, "train")
        opt.zero_grad()
        if k == 1:  # one batch: its loss is the sum of the micro-batches' losses
            losses = F.cross_entropy(model(x), y, reduction="none")
            parts = losses.split(b // MICRO[0])
            loss = sum(SCALINGS[scaling](p, MICRO[0]) for p in parts)
            inst.loss(loss, per_sample=losses)
            loss.backward()
        else:
            for xm, ym in zip(x.split(b), y.split(b)):
                losses = F.cross_entropy(model(xm), ym, reduction="none")
                loss = SCALINGS[scaling](losses, k)
                inst.loss(loss, per_sample=losses)
                loss.backward()
        opt.step()
        collect(values, inst.finish())
    return values


MICRO = [2]  # micro-batches the one-batch run stands for (set per test)


def assert_same(got: QuantityValue, want: QuantityValue, rtol: float = 1e-10) -> None:
    where = f"{got.name} step {got.step} layer {got.layer!r}"
    if want.array is not None:
        assert got.array is not None, f"{where} missing: {got.meta}"
        np.testing.assert_array_equal(got.array, want.array, err_msg=where)
        return
    assert want.value is not None, f"{where}: the plain step has no value: {want.meta}"
    assert got.value is not None, f"{where} missing: {got.meta}"
    assert math.isclose(got.value, want.value, rel_tol=rtol, abs_tol=1e-13), (
        f"{where}: {got.value} != {want.value}")


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_step_equals_one_batch_of_all_micro_batches(k: int, scaling: str) -> None:
    b = 3
    MICRO[0] = k
    refs: list = []
    accumulated = run_steps(mlp(), FIRST_ORDER + EXACT, k, b, scaling, refs=refs)
    plain = run_steps(mlp(), FIRST_ORDER + EXACT, 1, k * b, scaling)
    assert accumulated.keys() == plain.keys()
    for key, want in plain.items():
        assert_same(accumulated[key], want)
    hist = accumulated[("GradHist1d", 0, "")]
    total = hist.array.sum() + sum(hist.meta[e] for e in ("underflow", "overflow", "nan",
                                                           "posinf", "neginf"))
    assert total == k * b * sum(p.numel() for p in mlp().parameters())  # k·b·D entries
    assert accumulated[("Loss", 0, "")].meta["micro_batches"] == k
    for t, ref in enumerate(refs):  # and against the brute-force per-sample loop
        assert_close(accumulated[("Loss", t, "")], float(ref.losses.mean()))
        check_layers_values(accumulated, "NormTest", t, R.per_layer(R.norm_test, ref))
        check_layers_values(accumulated, "GradNorm", t, R.per_layer(R.grad_norm, ref))
        check_layers_values(accumulated, "InnerTest", t, R.per_layer(R.inner_test, ref))


def check_layers_values(values: Values, name: str, step: int, want: dict[str, float]) -> None:
    for layer, value in want.items():
        assert_close(values[(name, step, layer)], value, rtol=1e-9)


def test_accumulation_on_a_cnn_and_loss_divided_after_rec_loss() -> None:
    """rec.loss gets each micro-batch's mean, the backward gets mean / k: the factor is
    read from the backward pass."""
    k, b = 2, 3
    MICRO[0] = k
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inst = Instruments(model, FIRST_ORDER, optimizer=opt)
    values: Values = {}
    for step in range(2):
        x, y = data(model, k * b, step)
        inst.start(step, "train")
        opt.zero_grad()
        for xm, ym in zip(x.split(b), y.split(b)):
            losses = F.cross_entropy(model(xm), ym, reduction="none")
            inst.loss(losses.mean(), per_sample=losses)
            (losses.mean() / k).backward()
        opt.step()
        collect(values, inst.finish())
    plain = run_steps(cnn(), FIRST_ORDER, 1, k * b, "mean/k")
    for key, want in plain.items():
        assert_same(values[key], want)


def test_hess_max_ev_with_accumulation_is_missing_with_reason() -> None:
    MICRO[0] = 2
    values = run_steps(mlp(), ["HessMaxEV", "Loss"], 2, 3, "mean/k", steps=1)
    got = values[("HessMaxEV", 0, "")]
    assert got.value is None and "accumulation" in got.meta["reason"]


def test_inconsistent_micro_batch_losses_fail_in_one_line() -> None:
    model = mlp()
    inst = Instruments(model, ["NormTest"])
    inst.start(0, "train")
    x, y = data(model, 6, 0)
    losses = F.cross_entropy(model(x[:3]), y[:3], reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    losses = F.cross_entropy(model(x[3:]), y[3:], reduction="none")
    with pytest.raises(ValueError, match="reduce every micro-batch alike") as info:
        inst.loss(losses.sum(), per_sample=losses)
    assert "\n" not in str(info.value)
    inst.abort()


# -- extra backward passes ---------------------------------------------------------------
def penalised_run(model: nn.Module, extra: bool, steps: int = 2) -> Values:
    """A step whose update is the cross-entropy's; with `extra`, the step also runs, before
    it, a plain autograd.grad of the loss for the last parameter only (a gradient read for
    logging: it claimed the loss's pass before 2026-12-02, leaving the other layers without
    per-sample gradients), an input-gradient penalty (create_graph=True through the loss's
    graph), a metric autograd.grad of that penalty, and a backward pass of another forward
    that accumulates into the input only."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inst = Instruments(model, FIRST_ORDER + EXACT, optimizer=opt, curvature="exact")
    values: Values = {}
    for step in range(steps):
        x, y = data(model, 6, step)
        x.requires_grad_(True)
        inst.start(step, "train")
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        inst.loss(losses.mean(), per_sample=losses)
        if extra:
            torch.autograd.grad(losses.mean(), list(model.parameters())[-1:], retain_graph=True)
            (gx,) = torch.autograd.grad(losses.sum(), x, create_graph=True)
            penalty = gx.square().sum()
            torch.autograd.grad(penalty, list(model.parameters()), retain_graph=True)
            other = x.detach().clone().requires_grad_(True)
            model(other).square().sum().backward(inputs=[other])
        losses.mean().backward()
        opt.step()
        collect(values, inst.finish())
    return values


@pytest.mark.parametrize("make", [mlp, cnn], ids=["mlp", "cnn"])
def test_extra_backward_passes_change_nothing(make: Callable[[], nn.Module]) -> None:
    plain = penalised_run(make(), extra=False)
    extra = penalised_run(make(), extra=True)
    assert plain.keys() == extra.keys()
    for key, want in plain.items():
        assert_same(extra[key], want, rtol=1e-12)


def test_backward_with_create_graph_alone_is_used() -> None:
    """A create_graph=True backward of the loss itself (second-order optimisers) is the
    loss's pass when no plain one follows."""
    model = mlp()
    inst = Instruments(model, ["GradNorm", "NormTest"])
    x, y = data(model, 6, 0)
    ref = R.batch_reference(model, lambda m: F.cross_entropy(m(x), y, reduction="none"))
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    losses.mean().backward(create_graph=True)
    values = {(v.name, v.step, v.layer): v for v in inst.finish()}
    check_layers_values(values, "NormTest", 0, R.per_layer(R.norm_test, ref))
    model.zero_grad(set_to_none=True)


# -- per-sample losses of any shape ---------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_losses_with_trailing_dims(reduction: str) -> None:
    """(N, 1) from MSELoss(reduction='none') and (N, 2): a mean loss averages the other
    dims per sample, a sum loss sums them."""
    model = mlp()
    x, _ = data(model, 5, 0)
    target = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    for cols in (1, 2):
        def per_sample(m: nn.Module, cols=cols) -> Tensor:
            parts = F.mse_loss(m(x)[:, :cols], target[:, :cols], reduction="none")
            return parts.mean(1) if reduction == "mean" else parts.sum(1)

        ref = R.batch_reference(model, per_sample)
        inst = Instruments(model, ["Loss", "GradNorm", "NormTest"])
        inst.start(0, "train")
        parts = F.mse_loss(model(x)[:, :cols], target[:, :cols], reduction="none")
        assert parts.shape == (5, cols)
        loss = parts.mean() if reduction == "mean" else parts.sum()
        inst.loss(loss, per_sample=parts)
        loss.backward()
        model.zero_grad()
        values = {(v.name, v.step, v.layer): v for v in inst.finish()}
        assert_close(values[("Loss", 0, "")], float(ref.losses.mean()), rtol=1e-12)
        assert values[("Loss", 0, "")].meta["reduction"] == reduction
        check_layers_values(values, "NormTest", 0, R.per_layer(R.norm_test, ref))
        check_layers_values(values, "GradNorm", 0, R.per_layer(R.grad_norm, ref))


# -- through the recorder -----------------------------------------------------------------
def test_scope_records_micro_batches_as_iterations(tmp_path) -> None:
    """Two micro-batches of MSE losses of shape (N, 1) in one scope.step: the instruments
    see one batch of 2·3 samples, each micro-batch's tensors are an iteration of their own,
    and the KPI is the step's loss (the sum of what was backpropagated)."""
    import deepscope

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, _ = data(model, 6, 0)
    target = torch.randn(6, 1, dtype=F64, generator=torch.Generator().manual_seed(4))

    def per_sample(m: nn.Module) -> Tensor:
        return F.mse_loss(m(x)[:, :1], target, reduction="none")[:, 0]

    ref = R.batch_reference(model, per_sample)
    with deepscope.Scope(tmp_path, "acc", instruments=["Loss", "GradNorm", "NormTest"],
                         anomalies=False) as scope:
        scope.watch(model, activations=True)
        with scope.step(0) as rec:
            opt.zero_grad()
            for xm, tm in zip(x.split(3), target.split(3)):
                rec.tensor("input", xm, role="input")
                parts = F.mse_loss(model(xm)[:, :1], tm, reduction="none")  # (3, 1)
                rec.loss(parts.mean() / 2, per_sample=parts)
                (parts.mean() / 2).backward()
            opt.step()
    run = deepscope.open_run(tmp_path / "acc")
    quantities = {(r.name, r.layer): r for r in run.quantities().itertuples()}
    assert quantities[("Loss", "")].value == pytest.approx(float(ref.losses.mean()), rel=1e-12)
    assert quantities[("Loss", "")].meta["micro_batches"] == 2
    for layer, want in R.per_layer(R.norm_test, ref).items():
        assert quantities[("NormTest", layer)].value == pytest.approx(want, rel=1e-9)
    assert run.kpis("loss").value.tolist() == pytest.approx([float(ref.losses.mean())])
    for it, xm in enumerate(x.split(3)):
        np.testing.assert_allclose(run.values("input", 0, view="samples", iteration=it),
                                   xm.float().numpy(), rtol=1e-6)
        assert {t["name"] for t in run.graph(0, iteration=it)["tensors"]} >= {
            "input", "0", "2", "loss", "loss_per_sample"}


def test_cockpit_compat_accepts_n_by_1_individual_losses(tmp_path, monkeypatch) -> None:
    """Cockpit's usual MSE regression: individual losses of shape (N, 1)."""
    import tempfile

    from deepscope.compat.backpack import extend
    from deepscope.compat.cockpit import Cockpit, quantities

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = extend(mlp())
    x, _ = data(model, 6, 0)
    target = torch.randn(6, 1, dtype=F64, generator=torch.Generator().manual_seed(5))
    ref = R.batch_reference(model, lambda m: F.mse_loss(m(x)[:, :1], target,
                                                        reduction="none")[:, 0])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model.parameters(), quantities=[quantities.NormTest, quantities.Loss])
    out = model(x)[:, :1]
    loss = F.mse_loss(out, target)
    losses = F.mse_loss(out, target, reduction="none")
    assert losses.shape == (6, 1)
    with cockpit(0, info={"loss": loss, "individual_losses": losses, "optimizer": opt}):
        loss.backward(create_graph=cockpit.create_graph(0))
    opt.step()
    output = cockpit.get_output()[0]
    assert output["Loss"] == pytest.approx(float(ref.losses.mean()), rel=1e-12)
    assert output["NormTest"] == pytest.approx(R.norm_test(ref.layers()[""]), rel=1e-9)


def one_step(backward: Callable[[Tensor], None], quantities: list[str]) -> Values:
    """One step of the MLP: rec.loss gets the mean, `backward(losses)` runs the backward."""
    model = mlp()
    inst = Instruments(model, quantities)
    x, y = data(model, 6, 0)
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    backward(losses)
    values: Values = {}
    collect(values, inst.finish())
    return values


def test_factors_after_rec_loss_are_read_from_the_backward_pass() -> None:
    """A GradScaler-like factor on the loss, or a new mean of per_sample: same values."""
    names = ["GradNorm", "NormTest", "MeanGSNR"]
    plain = one_step(lambda losses: losses.mean().backward(), names)
    for backward in (lambda losses: (losses.mean() * 1024.0).backward(),
                     lambda losses: (losses.sum() / 3).backward()):
        got = one_step(backward, names)
        for key, want in plain.items():
            assert_same(got[key], want, rtol=1e-12)


def test_unequal_weights_after_rec_loss_are_refused_with_reason() -> None:
    weights = torch.tensor([1.0, 2, 1, 1, 1, 1], dtype=F64)
    got = one_step(lambda losses: (losses * weights).sum().backward(), ["NormTest", "GradNorm"])
    assert got[("NormTest", 0, "")].value is None
    assert "unequally" in got[("NormTest", 0, "")].meta["reason"]


def test_wrong_order_and_shared_forward_say_what_happened() -> None:
    model = mlp()
    x, y = data(model, 6, 0)
    inst = Instruments(model, ["NormTest", "Loss"])
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    losses.mean().backward()
    inst.loss(losses.mean(), per_sample=losses)  # too late: its backward already ran
    values: Values = {}
    collect(values, inst.finish())
    assert values[("Loss", 0, "")].value is not None
    assert "before backward()" in values[("NormTest", 0, "")].meta["reason"]
    # two registered losses on one forward: not two micro-batches
    inst.start(1, "train")
    out = model(x)
    first = F.cross_entropy(out, y, reduction="none")
    inst.loss(first.mean(), per_sample=first)
    first.mean().backward(retain_graph=True)
    second = out.square().sum(1)
    inst.loss(second.mean(), per_sample=second)
    second.mean().backward()
    collect(values, inst.finish())
    assert "two registered losses on one forward" in values[("NormTest", 1, "")].meta["reason"]


def test_a_tensor_registered_after_the_loss_of_one_batch_stays_in_its_iteration(tmp_path):
    """Only the next forward (a repeated name, a watched module, the next rec.loss) starts a
    micro-batch: a new name logged after the loss of a single-batch step is iteration 0."""
    import deepscope

    model = mlp()
    x, _ = data(model, 4, 0)
    with deepscope.Scope(tmp_path, "r", anomalies=False) as scope, scope.step(0) as rec:
        rec.tensor("input", x, role="input")
        out = model(x)
        losses = out.square().mean(1)
        rec.loss(losses.mean(), per_sample=losses)
        rec.tensor("output", out)  # after the loss, a name not seen yet in this step
        losses.mean().backward()
    run = deepscope.open_run(tmp_path / "r")
    assert {t["name"] for t in run.graph(0, iteration=0)["tensors"]} >= {"input", "output"}
    assert run.step_table()["iterations"].tolist() == [1]


def test_samples_a_loss_ignores_are_said() -> None:
    """cross_entropy(ignore_index=-100)'s mean over the valid targets is the sum of per_sample
    over its non-zero values: the instruments count every row (the ignored ones with zero
    gradient), which a warning says; a sum loss, or one divided by k micro-batches, is not
    one."""
    model = mlp()
    inst = Instruments(model, ["GradNorm", "NormTest"])
    x, y = data(model, 6, 0)
    y[::3] = -100
    for step, ignore in enumerate((False, True)):
        inst.start(step, "train")
        losses = F.cross_entropy(model(x), y.clamp(min=0) if not ignore else y,
                                 reduction="none")
        loss = losses.sum() / 2 if not ignore else F.cross_entropy(model(x), y)
        inst.loss(loss, per_sample=losses)
        loss.backward()
        inst.finish()
        said = [w for w in inst.warnings if "ignore_index" in w]
        assert len(said) == ignore, step
    assert "its 4 non-zero values of 6" in said[0]
