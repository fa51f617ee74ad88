"""The Instruments suite end to end, through hand-written training loops, against the
brute-force float64 reference (per-sample autograd loop, dense torch.func Hessian)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepscope.instruments import (
    CONFIGURATIONS,
    QUANTITY_NAMES,
    Instruments,
    QuantityValue,
    resolve_quantities,
)
from deepscope.instruments.histograms import Bins
from deepscope.instruments.quantities.curvature import MAX_EV_TOL

from . import reference as R

F64 = torch.float64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FIRST_ORDER = ["Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest",
               "OrthoTest", "Alpha", "MeanGSNR", "CABS", "EarlyStopping", "GradHist1d"]
CURVATURE = ["HessTrace", "TICDiag", "TICTrace", "HessMaxEV"]
LR = 0.05


# -- models ---------------------------------------------------------------------------------
class TinyTransformer(nn.Module):
    """Embedding -> LayerNorm -> self-attention -> GELU -> mean over tokens -> Linear.

    Attention runs on the math kernel: PyTorch's fused CPU attention kernel has no double
    backward, which Hessian-vector products need (see test_curvature_failure_...).
    """

    def __init__(self, math_kernel: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)
        self.math_kernel = math_kernel

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.norm(self.embed(tokens))
        kernel = sdpa_kernel(SDPBackend.MATH) if self.math_kernel else contextlib.nullcontext()
        with kernel:
            a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(F.gelu(a + h).mean(1))


class Shared(nn.Module):
    """Weight sharing: `mid` is called twice, and `tied` uses mid's weight as its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.tied = nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.tied.weight = self.mid.weight
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))
        return self.out(torch.tanh(self.tied(h)))


@dataclass
class Case:
    model: nn.Module
    batch: Callable[[int], tuple[Tensor, Tensor]]  # step -> (x, y)


def make_case(name: str, device: str = "cpu", batch_size: int = 6) -> Case:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "linear":
        model, shape = nn.Linear(5, 3), (5,)
    elif name == "mlp":
        model, shape = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)), (5,)
    elif name == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                              nn.Linear(8, 3))
        shape = (1, 6, 6)
    elif name == "shared":
        model, shape = Shared(), (5,)
    else:
        model, shape = TinyTransformer(), None
    model = model.to(device=device, dtype=F64)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        if shape is None:
            x = torch.randint(0, 7, (batch_size, 5), generator=gen)
        else:
            x = torch.randn(batch_size, *shape, generator=gen, dtype=F64)
        y = torch.randint(0, 3, (batch_size,), generator=gen)
        return x.to(device), y.to(device)

    return Case(model, batch)


# -- a training loop that records the reference beside the instruments -----------------------
@dataclass
class Run:
    values: dict[tuple[str, int, str], QuantityValue] = field(default_factory=dict)
    refs: list[R.BatchRef] = field(default_factory=list)
    thetas: list[np.ndarray] = field(default_factory=list)  # flat θₜ, one more than steps
    layer_thetas: list[dict[str, np.ndarray]] = field(default_factory=list)
    hessians: list[np.ndarray] = field(default_factory=list)
    inst: Instruments | None = None

    def value(self, name: str, step: int, layer: str = "") -> QuantityValue:
        return self.values[(name, step, layer)]


def flat_params(model: nn.Module) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    named = R.trainable(model)
    layers = {n: p.detach().reshape(-1).cpu().numpy().copy() for n, p in named}
    return np.concatenate(list(layers.values())), layers


def train(
    case: Case,
    quantities: list[str] | str,
    steps: int = 3,
    reduction: str = "mean",
    optimizer: str = "sgd",
    hessian: bool = False,
    **kwargs,
) -> Run:
    model = case.model
    params = [p for _, p in R.trainable(model)]
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=LR),
        "momentum": lambda: torch.optim.SGD(params, lr=LR, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=0.01),
    }[optimizer]()
    inst = Instruments(model, quantities, optimizer=opt, **kwargs)
    run = Run(inst=inst)
    for step in range(steps):
        x, y = case.batch(step)

        def per_sample_loss(m: nn.Module, x=x, y=y) -> Tensor:
            return F.cross_entropy(m(x), y, reduction="none")

        flat, layers = flat_params(model)
        run.thetas.append(flat)
        run.layer_thetas.append(layers)
        run.refs.append(R.batch_reference(model, per_sample_loss))
        if hessian:
            run.hessians.append(R.hessian_reference(model, per_sample_loss))
        assert inst.wants(step, "train")
        inst.start(step, "train")
        losses = per_sample_loss(model)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        inst.loss(loss, per_sample=losses)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for v in inst.finish():
            key = (v.name, v.step, v.layer)
            assert key not in run.values, f"duplicate value {key}"
            run.values[key] = v
    run.thetas.append(flat_params(model)[0])
    run.layer_thetas.append(flat_params(model)[1])
    return run


def assert_close(got: QuantityValue, want: float, rtol: float = 1e-6) -> None:
    assert got.value is not None, f"{got.name}[{got.layer!r}] missing: {got.meta}"
    assert math.isclose(got.value, want, rel_tol=rtol, abs_tol=1e-12), (
        f"{got.name} step {got.step} layer {got.layer!r}: {got.value} != {want}"
    )


def check_layers(run: Run, name: str, step: int, want: dict[str, float], rtol: float = 1e-6):
    for layer, value in want.items():
        assert_close(run.value(name, step, layer), value, rtol)


def assert_counts_match(got: np.ndarray, want: np.ndarray, G: np.ndarray, edges: np.ndarray):
    """Equal counts, up to elements within round-off of an edge: engine and reference
    compute gᵢ differently, so e.g. a mathematically zero gradient (attention's key bias)
    is ±1e-17 with either sign."""
    scale = max(float(np.abs(G).max()), 1.0)
    ambiguous = int(np.sum(np.min(np.abs(G.reshape(-1, 1) - edges[None, :]), axis=1)
                           < 1e-12 * scale))
    assert got.sum() == want.sum()
    assert np.abs(got - want).sum() <= 2 * ambiguous, (got, want)


CASES = ["linear", "mlp", "cnn", "transformer", "shared"]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", CASES)
def test_first_order_quantities_match_reference(name: str, reduction: str) -> None:
    run = train(make_case(name), FIRST_ORDER, steps=3, reduction=reduction)
    for t, ref in enumerate(run.refs):
        loss = float(ref.losses.mean())
        assert_close(run.value("Loss", t), loss)
        assert run.value("Loss", t).meta["reduction"] == reduction
        check_layers(run, "GradNorm", t, R.per_layer(R.grad_norm, ref))
        check_layers(run, "NormTest", t, R.per_layer(R.norm_test, ref))
        check_layers(run, "InnerTest", t, R.per_layer(R.inner_test, ref))
        check_layers(run, "OrthoTest", t, R.per_layer(R.ortho_test, ref))
        check_layers(run, "MeanGSNR", t, R.per_layer(R.mean_gsnr, ref))
        check_layers(run, "EarlyStopping", t, R.per_layer(R.early_stopping, ref))
        check_layers(run, "CABS", t, R.per_layer(lambda G, L=loss: R.cabs(G, L, LR), ref))
        distance = {n: np.linalg.norm(run.layer_thetas[t][n] - run.layer_thetas[0][n])
                    for n in ref.names}
        distance[""] = np.linalg.norm(run.thetas[t] - run.thetas[0])
        check_layers(run, "Distance", t, distance)
        update = {n: np.linalg.norm(run.layer_thetas[t + 1][n] - run.layer_thetas[t][n])
                  for n in ref.names}
        update[""] = np.linalg.norm(run.thetas[t + 1] - run.thetas[t])
        check_layers(run, "UpdateSize", t, update)
        for layer, G in ref.layers().items():
            counts, extras = R.histogram_1d(G, 100, -2.0, 2.0)
            hist = run.value("GradHist1d", t, layer)
            assert_counts_match(hist.array, counts, G, np.linspace(-2.0, 2.0, 101))
            assert hist.array.dtype == np.int64
            assert {k: hist.meta[k] for k in extras} == extras
            assert hist.meta["edges"] == [-2.0, 2.0, 100]
    for t in range(len(run.refs) - 1):  # α of the last step waits for a step that never came
        want, mu = R.alpha(run.refs[t], run.refs[t + 1], run.thetas[t + 1] - run.thetas[t])
        got = run.value("Alpha", t)
        assert_close(got, want)
        np.testing.assert_allclose(got.meta["mu"], mu, rtol=1e-6)
    assert ("Alpha", len(run.refs) - 1, "") not in run.values
    names = {k[2] for k in run.values if k[0] == "NormTest"}
    assert names == {"", *run.refs[0].names}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_alpha_and_update_size_for_any_optimizer(optimizer: str) -> None:
    run = train(make_case("mlp"), ["Alpha", "UpdateSize"], steps=4, optimizer=optimizer)
    for t in range(3):
        want, _ = R.alpha(run.refs[t], run.refs[t + 1], run.thetas[t + 1] - run.thetas[t])
        assert_close(run.value("Alpha", t), want)
        assert run.value("Alpha", t).meta["tau"] == pytest.approx(
            np.linalg.norm(run.thetas[t + 1] - run.thetas[t]), rel=1e-9)
        assert_close(run.value("UpdateSize", t), np.linalg.norm(run.thetas[t + 1] - run.thetas[t]))


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "shared"])
def test_curvature_quantities_exact_mode(name: str) -> None:
    case = make_case(name)
    dim = sum(p.numel() for _, p in R.trainable(case.model))
    # Lanczos with as many steps as parameters is exact; the transformer's HVPs are slow,
    # so it gets fewer steps and only the Ritz bound (never above the top eigenvalue)
    iters = 12 if name == "transformer" else dim
    run = train(case, CURVATURE, steps=1 if name == "transformer" else 2, hessian=True,
                lanczos_iter=iters, curvature="exact")
    for t, (ref, H) in enumerate(zip(run.refs, run.hessians)):
        check_layers(run, "HessTrace", t, R.hess_trace(ref, H))
        check_layers(run, "TICDiag", t, R.tic_diag(ref, H))
        check_layers(run, "TICTrace", t, R.tic_trace(ref, H))
        assert run.value("HessTrace", t).meta == {"estimator": "exact", "samples": dim}
        top = run.value("HessMaxEV", t)
        # Lanczos stops once converged: at most `iters` HVPs, fewer when it converged
        assert top.meta["estimator"] == "lanczos" and top.meta["samples"] <= iters
        assert top.meta["warm_start"] == (t > 0)
        if iters < dim and not top.meta["converged"]:
            assert "did not converge" in top.meta["note"]
            assert 0.9 * R.hess_max_ev(H) <= top.value <= R.hess_max_ev(H) + 1e-9
            continue
        assert top.meta["converged"] and "note" not in top.meta
        assert_close(top, R.hess_max_ev(H), rtol=MAX_EV_TOL)  # Lanczos' stopping tolerance
        # the other Ritz values of the same (maybe early-stopped) run lie inside the spectrum
        eig = np.linalg.eigvalsh((H + H.T) / 2)
        assert eig[0] - 1e-9 <= top.meta["min_algebraic"] <= eig[-1] + 1e-9
        assert abs(top.meta["max_magnitude"]) <= np.abs(eig).max() + 1e-9


def test_curvature_with_sum_reduction_is_the_mean_loss_hessian() -> None:
    run = train(make_case("mlp"), ["HessTrace", "TICDiag"], steps=1, reduction="sum",
                hessian=True)
    check_layers(run, "HessTrace", 0, R.hess_trace(run.refs[0], run.hessians[0]))
    check_layers(run, "TICDiag", 0, R.tic_diag(run.refs[0], run.hessians[0]))


def test_curvature_failure_is_reported_and_training_continues() -> None:
    case = make_case("transformer")
    case.model.math_kernel = False  # the fused CPU attention kernel: no double backward
    run = train(case, ["HessTrace", "HessMaxEV", "GradNorm", "Loss"], steps=2)
    for t in range(2):
        for name in ("HessTrace", "HessMaxEV"):
            if DEVICES == ["cpu"]:
                assert run.value(name, t).value is None
                reason = run.value(name, t).meta["reason"]
                assert reason.startswith("NotImplementedError: ") and "second derivative" in reason
        assert run.value("GradNorm", t).value is not None
        assert run.value("Loss", t).value is not None


def test_hutchinson_trace_within_its_stated_error() -> None:
    samples = 64
    run = train(make_case("mlp"), ["HessTrace"], steps=1, hessian=True, curvature="hutchinson",
                hutchinson_samples=samples)
    H = run.hessians[0]
    got = run.value("HessTrace", 0)
    assert got.meta == {"estimator": "hutchinson", "samples": samples}
    # Rademacher probes: Var = 2(‖H‖_F² − Σ H_dd²) / samples
    sigma = math.sqrt(2 * (np.sum(H**2) - np.sum(np.diag(H) ** 2)) / samples)
    assert abs(got.value - np.trace(H)) < 4 * sigma
    assert sigma < 0.5 * abs(np.trace(H))  # the check above is not vacuous


def test_histograms_2d_and_adaptive_range() -> None:
    run = train(make_case("mlp"), ["GradHist1d", "GradHist2d"], steps=2,
                hist_range="adaptive", hist_bins=30, hist2d_per_layer=True)
    for t, ref in enumerate(run.refs):
        layers = ref.layers()
        bound = max(np.abs(G).max() for G in layers.values())
        for layer, G in layers.items():
            counts, _ = R.histogram_1d(G, 30, -bound, bound)
            hist = run.value("GradHist1d", t, layer)
            assert_counts_match(hist.array, counts, G, np.linspace(-bound, bound, 31))
            assert hist.meta["range"] == "adaptive"
            assert hist.meta["edges"] == [-bound, bound, 30]
            theta = (run.thetas[t] if layer == "" else run.layer_thetas[t][layer])
            want = R.histogram_2d(theta, G, (40, 50), ((-1, 1), (-2, 2)))
            hist2 = run.value("GradHist2d", t, layer)
            np.testing.assert_array_equal(hist2.array, want)
            assert hist2.array.shape == (40, 50)
            assert hist2.meta["edges"] == [[-1.0, 1.0, 40], [-2.0, 2.0, 50]]
            assert hist2.array.sum() + sum(
                hist2.meta[k] for k in ("underflow", "overflow", "nan", "posinf", "neginf",
                                        "param_underflow", "param_overflow", "param_nonfinite")
            ) == G.size


@pytest.mark.parametrize("device", DEVICES)
def test_economy_on_device_with_float32_model(device: str) -> None:
    case = make_case("mlp", device=device, batch_size=16)
    case.model.float()
    base = case.batch

    def batch32(step: int) -> tuple[Tensor, Tensor]:
        x, y = base(step)
        return x.float(), y

    case.batch = batch32
    run = train(case, "economy", steps=3)
    assert set(run.inst.quantities) == CONFIGURATIONS["economy"]
    for t, ref in enumerate(run.refs):  # the reference itself runs in float32 here
        check_layers(run, "NormTest", t, R.per_layer(R.norm_test, ref), rtol=1e-4)
        check_layers(run, "GradNorm", t, R.per_layer(R.grad_norm, ref), rtol=1e-4)
        hist = run.value("GradHist1d", t)
        assert hist.array.sum() + hist.meta["underflow"] + hist.meta["overflow"] == (
            ref.layers()[""].size)
    assert {k[0] for k in run.values} == CONFIGURATIONS["economy"]


def test_full_configuration_reports_every_quantity() -> None:
    run = train(make_case("mlp"), "full", steps=2)
    names = {k[0] for k in run.values}
    assert names == CONFIGURATIONS["full"]
    assert all(v.value is not None or v.array is not None
               for v in run.values.values()), [v for v in run.values.values() if v.meta.get(
                   "reason")]
    assert ("GradHist2d", 0, "0.weight") not in run.values  # 2-D per layer is opt-in


def test_plain_sgd_alpha_reuses_the_gradient_tests_products(monkeypatch) -> None:
    from deepscope.instruments.engine import PerSampleEngine

    calls: list[int] = []  # vectors per engine call
    original = PerSampleEngine.dots_many
    monkeypatch.setattr(PerSampleEngine, "dots_many",
                        lambda self, sets: calls.append(len(sets)) or original(self, sets))
    train(make_case("mlp"), ["InnerTest", "Alpha"], steps=1)
    assert calls == [1]  # gᵢᵀḡ for InnerTest; α's start slopes come from it
    calls.clear()
    train(make_case("mlp"), ["InnerTest", "Alpha"], steps=1, optimizer="adam")
    assert calls == [2]  # ḡ and the update, in one pass
    calls.clear()
    train(make_case("mlp"), ["InnerTest", "Alpha"], steps=2, optimizer="adam")
    assert calls == [2, 3]  # step 1 adds α(0)'s end point: still one pass per step


class ReadOutside(nn.Module):
    """`head`'s weight is read directly (F.linear), never through a call of `head`."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.head = nn.Linear(5, 4), nn.Linear(4, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.mix(x)), self.head.weight)


def test_parameters_without_per_sample_gradients_are_missing_with_reason() -> None:
    case = make_case("mlp")
    torch.manual_seed(0)
    case.model = ReadOutside().to(F64)
    run = train(case, ["GradNorm", "NormTest", "GradHist1d"], steps=1)
    for name, fn in (("GradNorm", R.grad_norm), ("NormTest", R.norm_test)):
        assert_close(run.value(name, 0, "mix.weight"), R.per_layer(fn, run.refs[0])["mix.weight"])
    assert run.value("NormTest", 0, "head.weight").value is None
    assert "outside its module" in run.value("NormTest", 0, "head.weight").meta["reason"]
    total = run.value("NormTest", 0).meta["reason"]
    assert "head.weight" in total and "outside its module" in total  # says what happened
    # ḡ needs no per-sample gradients: GradNorm is exact everywhere, total included
    check_layers(run, "GradNorm", 0, R.per_layer(R.grad_norm, run.refs[0]))
    assert run.value("GradHist1d", 0).meta["excluded"] == ["head.weight"]
    assert run.value("GradHist1d", 0, "head.weight").array is None
    assert any("outside its module" in w for w in run.inst.warnings)


# -- schedules --------------------------------------------------------------------------------
def test_wants_follows_schedules_and_alpha_end_point() -> None:
    model = make_case("mlp").model
    inst = Instruments(model, ["Alpha", "GradNorm"], schedule=lambda s, k: s % 3 == 0,
                       schedules={"GradNorm": lambda s, k: k == "val"})
    assert inst.wants(0, "train") and not inst.wants(1, "train") and inst.wants(1, "val")
    inst2 = Instruments(model, ["GradNorm"], schedule=lambda s, k: False)
    assert not inst2.wants(0, "train")


def test_alpha_end_point_is_the_next_step_even_when_not_scheduled() -> None:
    case = make_case("mlp")
    model = case.model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inst = Instruments(model, ["Alpha", "Loss"], schedule=lambda s, k: s == 0)
    seen = []
    for step in range(3):
        if not inst.wants(step, "train"):
            seen.append(step)
            continue
        x, y = case.batch(step)
        inst.start(step, "train")
        losses = F.cross_entropy(model(x), y, reduction="none")
        inst.loss(losses.mean(), per_sample=losses)
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
        values = inst.finish()
        if step == 1:
            assert [(v.name, v.step) for v in values] == [("Alpha", 0)]
            assert values[0].value is not None and values[0].meta["end_step"] == 1
    assert seen == [2]


def test_configurations_are_cockpits() -> None:
    economy = {"Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest",
               "OrthoTest", "UpdateSize"}
    assert CONFIGURATIONS["economy"] == economy
    assert CONFIGURATIONS["business"] == economy | {"TICDiag", "HessTrace"}
    assert CONFIGURATIONS["full"] == economy | {"TICDiag", "HessTrace", "HessMaxEV", "GradHist2d"}
    assert set(QUANTITY_NAMES) - CONFIGURATIONS["full"] == {
        "TICTrace", "MeanGSNR", "CABS", "EarlyStopping"}
    assert resolve_quantities("Business") == tuple(
        q for q in QUANTITY_NAMES if q in CONFIGURATIONS["business"])
    assert resolve_quantities("CABS") == ("CABS",)
    assert resolve_quantities(["Alpha", "Loss", "Alpha"]) == ("Loss", "Alpha")
    with pytest.raises(TypeError, match="quantities must hold strings"):
        resolve_quantities(["Loss", 3])
    with pytest.raises(ValueError, match="no quantity chosen"):
        resolve_quantities([])


# -- bad input and failures -------------------------------------------------------------------
def test_unknown_quantity_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown quantity 'GradNrm'") as info:
        Instruments(nn.Linear(2, 2), ["GradNrm"])
    assert "\n" not in str(info.value)
    for name in QUANTITY_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"model": "net"}, TypeError, "torch.nn.Module"),
    ({"schedule": 5}, TypeError, "schedule must be a callable"),
    ({"schedules": {"Alpha": lambda s, k: True}}, ValueError, "not among the chosen"),
    ({"hist_range": "auto"}, ValueError, "hist_range must be"),
    ({"hist_range": (1.0, -1.0)}, ValueError, "lo < hi"),
    ({"hist_bins": 0}, ValueError, "bins must be >= 1"),
    ({"curvature": "dense"}, ValueError, "curvature must be one of"),
    ({"lanczos_iter": 0}, ValueError, "lanczos_iter must be an int >= 1"),
    ({"optimizer": "sgd"}, TypeError, "torch.optim.Optimizer"),
])
def test_bad_arguments_fail_in_one_line(kwargs, error, match) -> None:
    args = {"model": nn.Linear(2, 2), "quantities": ["GradNorm"], **kwargs}
    with pytest.raises(error, match=match) as info:
        Instruments(**args)
    assert "\n" not in str(info.value)


def test_wrong_call_order_and_frozen_model() -> None:
    inst = Instruments(nn.Linear(2, 2), ["Loss"])
    with pytest.raises(RuntimeError, match="call start"):
        inst.loss(torch.tensor(1.0), None)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        Instruments(frozen, ["Loss"])


def test_missing_per_sample_names_the_argument() -> None:
    model = nn.Linear(3, 2)
    inst = Instruments(model, ["GradNorm", "Loss"])
    inst.start(0, "train")
    out = model(torch.randn(4, 3))
    with pytest.raises(ValueError, match="per_sample=") as info:
        inst.loss(out.pow(2).mean(), None)
    assert "\n" not in str(info.value)
    inst.abort()


def test_loss_must_be_mean_or_sum_of_per_sample() -> None:
    model = nn.Linear(3, 2)
    inst = Instruments(model, ["GradNorm"])
    inst.start(0, "train")
    losses = model(torch.randn(4, 3)).pow(2).sum(1)
    with pytest.raises(ValueError, match="neither the mean .* nor the sum"):
        inst.loss(3 * losses.mean(), losses)  # (2 × mean = sum / 2: accumulation)
    inst.abort()


def test_loss_only_quantities_need_no_per_sample() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inst = Instruments(model, ["Loss", "UpdateSize", "Distance"])
    inst.start(0, "train")
    loss = model(torch.randn(4, 3)).pow(2).mean()
    inst.loss(loss, None)
    loss.backward()
    opt.step()
    values = {v.name: v for v in inst.finish() if v.layer == ""}
    assert values["Loss"].value == pytest.approx(loss.item())
    assert values["Loss"].meta["reduction"] == "unknown"
    assert values["UpdateSize"].value > 0


def test_a_failing_quantity_is_missing_and_training_continues(monkeypatch) -> None:
    from deepscope.instruments import suite

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(suite, "norm_test", broken)
    run = train(make_case("mlp"), ["NormTest", "GradNorm", "CABS"], steps=2)
    for t in range(2):
        assert run.value("NormTest", t).value is None
        assert run.value("NormTest", t).meta["reason"] == "RuntimeError: boom"
        assert run.value("GradNorm", t).value is not None
        assert run.value("CABS", t).value is not None


def test_non_finite_values_are_reported_not_hidden() -> None:
    case = make_case("mlp")
    base = case.batch

    def poisoned(step: int) -> tuple[Tensor, Tensor]:
        x, y = base(step)
        x[0, 0] = math.nan if step == 1 else x[0, 0]
        return x, y

    case.batch = poisoned
    run = train(case, ["Loss", "GradNorm", "NormTest", "GradHist1d", "Alpha"], steps=3)
    assert math.isnan(run.value("Loss", 1).value)
    assert math.isnan(run.value("GradNorm", 1).value)
    hist = run.value("GradHist1d", 1)
    assert hist.meta["nan"] > 0
    assert hist.array.sum() + sum(hist.meta[k] for k in ("underflow", "overflow", "nan",
                                                          "posinf", "neginf")) == (
        run.refs[1].layers()[""].size)
    assert math.isnan(run.value("Alpha", 0).value)  # its end point is the NaN step
    assert "non-finite" in run.value("Alpha", 0).meta["reason"]


def test_cabs_without_optimizer_and_non_sgd_note() -> None:
    case = make_case("mlp")
    inst = Instruments(case.model, ["CABS"])
    x, y = case.batch(0)
    inst.start(0, "train")
    losses = F.cross_entropy(case.model(x), y, reduction="none")
    inst.loss(losses.mean(), losses)
    losses.mean().backward()
    (value,) = [v for v in inst.finish() if v.layer == ""]
    assert value.value is None and "optimizer=" in value.meta["reason"]
    run = train(make_case("mlp"), ["CABS"], steps=1, optimizer="adam")
    assert run.value("CABS", 0).meta["note"].startswith("CABS assumes plain SGD")
    assert run.value("CABS", 0).meta["optimizer"] == "Adam"


def test_abort_drops_the_step_and_reports_the_lost_alpha() -> None:
    case = make_case("mlp")
    model = case.model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inst = Instruments(model, ["Alpha"])
    x, y = case.batch(0)
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    inst.loss(losses.mean(), losses)
    losses.mean().backward()
    opt.step()
    assert inst.finish() == []
    inst.start(1, "train")
    inst.abort()  # the user's step raised after start
    (lost,) = inst.finish()
    assert (lost.name, lost.step, lost.value) == ("Alpha", 0, None)
    assert "failed" in lost.meta["reason"]


def test_histograms_of_linear_layers_are_exact_without_materialising(monkeypatch) -> None:
    """Float32 MLP, bins fine enough that many values are outer: the suite's GradHist1d /
    GradHist2d (factored rank-one path) equal numpy's on the materialised gradients."""
    from deepscope.instruments import histograms as H
    from deepscope.instruments.engine import PerSampleEngine

    used: list[bool] = []
    original = H._rank_one_1d
    monkeypatch.setattr(H, "_rank_one_1d",
                        lambda part, axis: used.append(True) or original(part, axis))
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 5))
    x, y = torch.randn(16, 40), torch.randint(0, 5, (16,))
    engine = PerSampleEngine(model)
    engine.start()
    F.cross_entropy(model(x), y, reduction="none").mean().backward()
    engine.stop()
    engine.set_scale(16)
    grads = {n: g.reshape(16, -1).numpy() for n, g in engine.per_sample_grads()}
    theta = {n: p.detach().reshape(-1).numpy().copy() for n, p in model.named_parameters()}
    model.zero_grad()

    inst = Instruments(model, ["GradHist1d", "GradHist2d"], hist_range=(-0.3, 0.3),
                       hist_bins=60, hist2d_per_layer=True)
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    losses.mean().backward()
    values = {(v.name, v.layer): v for v in inst.finish()}
    assert used  # the factored path, not a materialising fallback
    for name, G in grads.items():
        counts, extras = R.histogram_1d(G, 60, -0.3, 0.3)
        hist = values[("GradHist1d", name)]
        np.testing.assert_array_equal(hist.array, counts)
        assert {k: hist.meta[k] for k in extras} == extras
        hist2 = values[("GradHist2d", name)]
        want = H.histogram_2d(torch.from_numpy(theta[name]), torch.from_numpy(G),
                              Bins(40, -1.0, 1.0), Bins(50, -2.0, 2.0))
        np.testing.assert_array_equal(hist2.array, want.counts)


@pytest.mark.filterwarnings("ignore:.*BatchNorm")
def test_gradient_tests_of_a_mean_gradient_cancelled_to_round_off_are_missing() -> None:
    """A conv bias right before a train-mode BatchNorm: its batch gradient cancels in theory
    and comes out ~1e-17, so NormTest/InnerTest/OrthoTest of it would read ~1e15. They are
    missing with the reason; the conv's weight, whose ḡ does not cancel, keeps its values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 3)).to(F64)
    x, y = torch.randn(6, 3, 8, 8, dtype=F64), torch.randint(0, 3, (6,))
    inst = Instruments(model, ["NormTest", "InnerTest", "OrthoTest"])
    inst.start(0, "train")
    losses = F.cross_entropy(model(x), y, reduction="none")
    inst.loss(losses.mean(), per_sample=losses)
    losses.mean().backward()
    assert 0 < float(model[0].bias.grad.norm()) < 1e-14  # cancelled up to round-off
    values = {(v.name, v.layer): v for v in inst.finish()}
    for name in ("NormTest", "InnerTest", "OrthoTest"):
        bias, weight = values[(name, "0.bias")], values[(name, "0.weight")]
        assert bias.value is None and "round-off" in bias.meta["reason"], bias
        assert weight.value is not None and 0 < weight.value < 100, weight
