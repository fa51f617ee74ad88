"""Curvature operator and estimators against dense float64 Hessians from torch.func."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, vjp

from deepscope.instruments.curvature import (
    Estimate,
    HessianOperator,
    dense_hessian,
    exact_diagonal,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    lanczos,
    layer_traces,
    power_iteration,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
F64 = torch.float64


class Quadratic(nn.Module):
    """loss(θ) = ½ θᵀAθ + bᵀθ: a 'model' whose Hessian is exactly A."""

    def __init__(self, eigenvalues: Tensor, seed: int, rotate: bool = True) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        d = eigenvalues.numel()
        u, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
        u = u if rotate else torch.eye(d, dtype=F64)
        self.register_buffer("a", u @ torch.diag(eigenvalues.to(F64)) @ u.T)
        self.register_buffer("b", torch.randn(d, generator=gen, dtype=F64))
        self.theta = nn.Parameter(torch.randn(d, generator=gen, dtype=F64))

    def forward(self, _: Tensor) -> Tensor:
        return 0.5 * self.theta @ self.a @ self.theta + self.b @ self.theta


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, y)


def _ce(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out, y)


def _case(name: str, device: str) -> tuple[nn.Module, Tensor, Tensor, Callable]:
    """(model, x, y, loss_fn) for one test model, float64 on `device`."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "linear_mse":  # repeated eigenvalues: I ⊗ XᵀX structure
        model = nn.Linear(4, 3)
        x, y, loss_fn = torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen), _mse
    elif name == "mlp_tanh_ce":
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        x, y, loss_fn = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,)), _ce
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3)
        )
        x, y, loss_fn = torch.randn(6, 1, 4, 4, generator=gen), torch.randint(0, 3, (6,)), _ce
    elif name == "layernorm_gelu":
        model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 2))
        x, y, loss_fn = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen), _mse
    else:
        raise AssertionError(name)
    model = model.to(device=device, dtype=F64)
    x = x.to(device=device, dtype=F64)
    y = y.to(device=device, dtype=F64 if y.is_floating_point() else y.dtype)
    return model, x, y, loss_fn


CASES = ["linear_mse", "mlp_tanh_ce", "cnn", "layernorm_gelu"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread avoids contention on shared CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(name: str, device: str, batch_size: int = 16):
    """(model, operator, dense reference Hessian) for a case."""
    model, x, y, loss_fn = _case(name, device)
    loss = loss_fn(model(x), y)
    op = HessianOperator(loss, list(model.parameters()), batch_size=batch_size)
    return model, op, _case_hessian(name, device)


@functools.cache
def _case_hessian(name: str, device: str) -> Tensor:
    model, x, y, loss_fn = _case(name, device)
    return _reference_hessian(model, lambda m: loss_fn(m(x), y))


def _reference_hessian(model: nn.Module, loss_of: Callable[[Callable], Tensor]) -> Tensor:
    """Dense (D, D) Hessian of the loss as a function of the flattened parameters.

    torch.func reverse-over-reverse (vjp of grad), one column at a time. torch.func.hessian
    agrees on the other cases (`test_reference_matches_torch_func_hessian`), but its vmap
    over columns gives wrong, asymmetric mixed derivatives through LayerNorm's weight in
    torch 2.13 (layer_norm backward batching rule, pytorch/functorch#534).
    `test_reference_matches_finite_differences` checks this reference independently of
    autograd's second derivatives.
    """
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    sizes = [p.numel() for p in params]

    def f(flat: Tensor) -> Tensor:
        tensors = [t.view(p.shape) for t, p in zip(flat.split(sizes), params)]
        return loss_of(lambda *args: functional_call(model, dict(zip(names, tensors)), args))

    flat = torch.cat([p.reshape(-1) for p in params])
    eye = torch.eye(flat.numel(), dtype=flat.dtype, device=flat.device)
    _, vjp_fn = vjp(grad(f), flat)
    h = torch.stack([vjp_fn(e)[0] for e in eye])
    torch.testing.assert_close(h, h.T, rtol=0, atol=1e-12)  # guard the reference itself
    return h


def _quadratic(
    eigenvalues: list[float], seed: int = 0, rotate: bool = True
) -> tuple[HessianOperator, Tensor]:
    model = Quadratic(torch.tensor(eigenvalues), seed, rotate)
    return HessianOperator(model(torch.empty(0)), [model.theta]), model.a


def _close(actual: Tensor, expected: Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(actual, expected.to(actual), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- operator


@pytest.mark.parametrize("name", ["linear_mse", "mlp_tanh_ce", "cnn"])  # not LayerNorm: see above
def test_reference_matches_torch_func_hessian(name: str) -> None:
    model, x, y, loss_fn = _case(name, "cpu")
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]

    def f(flat: Tensor) -> Tensor:
        tensors = [t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)]
        return loss_fn(functional_call(model, dict(zip(names, tensors)), (x,)), y)

    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    _close(hessian(f)(flat), _case_hessian(name, "cpu"), tol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_finite_differences(name: str) -> None:
    # Central differences of first-order gradients: O(eps²) truncation, no double backward.
    model, x, y, loss_fn = _case(name, "cpu")
    h = _reference_hessian(model, lambda m: loss_fn(m(x), y))
    params = list(model.parameters())
    flat = torch.nn.utils.parameters_to_vector(params).detach()
    eps, columns = 1e-5, []
    for d in range(flat.numel()):
        grads = []
        for sign in (1, -1):
            shifted = flat.clone()
            shifted[d] += sign * eps
            torch.nn.utils.vector_to_parameters(shifted, params)
            g = torch.autograd.grad(loss_fn(model(x), y), params)
            grads.append(torch.cat([t.reshape(-1) for t in g]))
        columns.append((grads[0] - grads[1]) / (2 * eps))
    torch.nn.utils.vector_to_parameters(flat, params)
    torch.testing.assert_close(torch.stack(columns, 1), h, rtol=0, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_matvec_matches_dense_hessian(name: str, device: str) -> None:
    _, op, h = _setup(name, device)
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(3):
        v = torch.randn(op.dim, generator=gen, dtype=F64, device=device)
        hv = op.matvec(v)
        assert hv.shape == (op.dim,) and not hv.requires_grad
        _close(hv, h @ v)


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_matmat_matches_dense_hessian_for_any_batch_size(batch_size: int) -> None:
    # 1: one backward per row; 3: several vmapped blocks with a remainder; 64: one block.
    _, op, h = _setup("layernorm_gelu", "cpu", batch_size=batch_size)
    v = torch.randn(7, op.dim, dtype=F64)
    _close(op.matmat(v), v @ h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_exact_diagonal_and_dense_hessian(name: str, device: str) -> None:
    _, op, h = _setup(name, device)
    diag = exact_diagonal(op)
    assert isinstance(diag, Estimate) and diag.estimator == "exact" and diag.samples == op.dim
    _close(diag.value, torch.diagonal(h))
    dense = dense_hessian(op)
    assert dense.shape == (op.dim, op.dim)
    _close(dense, dense.T)
    _close(dense, h)


def test_split_shapes_and_layer_traces() -> None:
    model, op, h = _setup("cnn", "cpu")
    params = list(model.parameters())
    flat = torch.arange(op.dim, dtype=F64)
    parts = op.split(flat)
    assert [p.shape for p in parts] == [p.shape for p in params]
    assert op.sizes == [p.numel() for p in params] and sum(op.sizes) == op.dim
    assert torch.equal(torch.cat([p.reshape(-1) for p in parts]), flat)
    expected = [float(s.sum()) for s in torch.diagonal(h).split(op.sizes)]
    assert layer_traces(op, exact_diagonal(op).value) == pytest.approx(expected, abs=1e-10)


def test_default_batch_size_shrinks_for_large_models() -> None:
    small = torch.ones(10, dtype=F64, requires_grad=True)
    large = torch.ones(2**20, requires_grad=True)
    assert HessianOperator(small.pow(3).sum(), [small]).batch_size == 64
    assert HessianOperator(large.pow(3).sum(), [large]).batch_size == 16  # 2**24 / 2**20
    assert HessianOperator(large.pow(3).sum(), [large], batch_size=2).batch_size == 2


def test_unused_parameter_and_linear_loss_give_zero_rows() -> None:
    used, unused = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    x = torch.randn(5, 3, dtype=F64)
    loss = used(x).tanh().pow(2).mean()
    op = HessianOperator(loss, [*used.parameters(), *unused.parameters()])
    dense = dense_hessian(op)
    n_used = sum(p.numel() for p in used.parameters())
    assert dense[n_used:].abs().max() == 0 and dense[:, n_used:].abs().max() == 0
    assert dense[:n_used, :n_used].abs().max() > 0

    linear = HessianOperator(used(x).sum(), list(used.parameters()))  # H = 0
    assert linear.matvec(torch.ones(linear.dim, dtype=F64)).abs().max() == 0


class _CubeWithUnbatchableSecondDerivative(torch.autograd.Function):
    """x³ whose second derivative calls .item(), which vmap cannot batch."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return _CubeGrad.apply(x, g)


class _CubeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, g: Tensor) -> Tensor:
        ctx.save_for_backward(x, g)
        return 3 * x**2 * g

    @staticmethod
    def backward(ctx, gg: Tensor) -> tuple[Tensor, Tensor]:
        x, g = ctx.saved_tensors
        assert math.isfinite(gg.sum().item())  # data-dependent: fails under vmap
        return 6 * x * g * gg, 3 * x**2 * gg


def test_matmat_falls_back_when_the_graph_cannot_be_vmapped() -> None:
    theta = torch.randn(5, dtype=F64, requires_grad=True)
    op = HessianOperator(_CubeWithUnbatchableSecondDerivative.apply(theta).sum(), [theta])
    v = torch.randn(4, 5, dtype=F64)
    _close(op.matmat(v), v * (6 * theta.detach()))  # H = diag(6θ)


def test_matmat_correct_on_group_norm() -> None:
    # GroupNorm's vmapped double backward raises a shape error in torch 2.13.
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten())
    model = model.double()
    x = torch.randn(5, 1, 4, 4, dtype=F64)
    op = HessianOperator(model(x).pow(3).mean(), list(model.parameters()), batch_size=8)
    _close(dense_hessian(op), _reference_hessian(model, lambda m: m(x).pow(3).mean()))


def test_matmat_falls_back_when_vmapped_backward_is_silently_wrong(monkeypatch) -> None:
    _, op, h = _setup("mlp_tanh_ce", "cpu", batch_size=4)
    plain_grad = torch.autograd.grad

    def wrong_when_batched(*args, is_grads_batched: bool = False, **kwargs):
        out = plain_grad(*args, is_grads_batched=is_grads_batched, **kwargs)
        return tuple(o + 1 for o in out) if is_grads_batched else out

    monkeypatch.setattr(torch.autograd, "grad", wrong_when_batched)
    v = torch.randn(10, op.dim, dtype=F64)
    _close(op.matmat(v), v @ h)


def test_op_without_second_derivative_gives_one_line_error() -> None:
    # CPU flash attention has no double backward in torch 2.13.
    lin = nn.Linear(4, 12).double()
    q, k, v = lin(torch.randn(2, 3, 4, dtype=F64)).unsqueeze(1).chunk(3, -1)
    loss = nn.functional.scaled_dot_product_attention(q, k, v).pow(2).sum()
    op = HessianOperator(loss, list(lin.parameters()))
    with pytest.raises(NotImplementedError) as err:
        op.matmat(torch.ones(3, op.dim, dtype=F64))
    assert "sdpa_kernel" in _one_line(err)


def test_works_in_float32_under_no_grad() -> None:
    model, x, y, loss_fn = _case("mlp_tanh_ce", "cpu")
    h = _reference_hessian(model, lambda m: loss_fn(m(x), y))
    model, x = model.float(), x.float()
    loss = loss_fn(model(x), y)
    with torch.no_grad():  # the recorder may build the operator inside no_grad
        op = HessianOperator(loss, list(model.parameters()))
        diag = exact_diagonal(op).value
    assert op.dtype == torch.float32 and diag.dtype == torch.float32
    torch.testing.assert_close(diag, torch.diagonal(h).float(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- user's backward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_user_backward_unchanged_after_operator_use(name: str, device: str) -> None:
    model, x, y, loss_fn = _case(name, device)
    params = list(model.parameters())
    expected = torch.autograd.grad(loss_fn(model(x), y), params)

    loss = loss_fn(model(x), y)
    with HessianOperator(loss, params, batch_size=8) as op:
        lanczos(op, num_iter=5)
        hutchinson_trace(op, samples=10)
        exact_diagonal(op)
    loss.backward()
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="released"):
        op.matvec(torch.zeros(op.dim, dtype=F64, device=device))


def test_release_frees_the_double_backward_graph() -> None:
    model, x, y, loss_fn = _case("mlp_tanh_ce", "cpu")
    loss = loss_fn(model(x), y)
    op = HessianOperator(loss, list(model.parameters()))
    # The create_graph gradients are the only owners of the double-backward graph.
    refs = [weakref.ref(g) for _, g in op._grads]
    assert all(r() is not None for r in refs)
    op.release()
    assert all(r() is None for r in refs)
    loss.backward()  # and the user's graph is still there


# ------------------------------------------------------------------------------ Lanczos


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_lanczos_with_num_iter_at_least_dim_is_exact(name: str, device: str) -> None:
    _, op, h = _setup(name, device)
    eig = torch.linalg.eigvalsh(h).cpu()
    result = lanczos(op, num_iter=op.dim + 10)
    scale = float(eig.abs().max())
    assert {e.samples for e in result.values()} == {op.dim}  # capped at D
    assert result["max_algebraic"].value == pytest.approx(float(eig[-1]), abs=1e-6 * scale)
    assert result["min_algebraic"].value == pytest.approx(float(eig[0]), abs=1e-6 * scale)
    biggest = float(eig[eig.abs().argmax()])
    assert result["max_magnitude"].value == pytest.approx(biggest, abs=1e-6 * scale)


def test_lanczos_few_iterations_with_spectral_gap() -> None:
    # Outliers 12 and -8 over a bulk in [-1, 1], D = 80: 12 steps resolve both to 1e-8.
    bulk = torch.linspace(-1, 1, 78, dtype=F64).tolist()
    op, _ = _quadratic([12.0, -8.0, *bulk])
    result = lanczos(op, num_iter=12, seed=3)
    assert result["max_algebraic"].samples == 12
    assert result["max_algebraic"].value == pytest.approx(12.0, rel=1e-8)
    assert result["min_algebraic"].value == pytest.approx(-8.0, rel=1e-8)
    assert result["max_magnitude"].value == pytest.approx(12.0, rel=1e-8)


@pytest.mark.parametrize("name", CASES)
def test_lanczos_ritz_values_lie_inside_the_spectrum(name: str) -> None:
    _, op, h = _setup(name, "cpu")
    eig = torch.linalg.eigvalsh(h)
    tol = 1e-10 * float(eig.abs().max())
    for seed in range(3):
        result = lanczos(op, num_iter=4, seed=seed)
        assert float(eig[0]) - tol <= result["min_algebraic"].value
        assert result["min_algebraic"].value <= result["max_algebraic"].value
        assert result["max_algebraic"].value <= float(eig[-1]) + tol


# ---------------------------------------------------------------------- power iteration


def test_power_iteration_returns_largest_magnitude_not_largest_algebraic() -> None:
    op, _ = _quadratic([-5.0, 3.0, 2.0, 1.0, 0.5, 0.1, -0.2])
    est = power_iteration(op)  # Cockpit defaults: rtol 1e-3, atol 1e-6
    assert est.estimator == "power_iteration" and 1 < est.samples < 100
    assert est.value == pytest.approx(-5.0, rel=1e-2)
    assert lanczos(op, num_iter=7)["max_algebraic"].value == pytest.approx(3.0, rel=1e-10)
    tight = power_iteration(op, max_iter=1000, rtol=1e-12, atol=0.0)
    assert tight.value == pytest.approx(-5.0, rel=1e-9)


@pytest.mark.parametrize("name", CASES)
def test_power_iteration_follows_cockpits_iteration(name: str) -> None:
    # Cockpit: uniform start, Rayleigh quotient, stop when torch.allclose(old, new).
    _, op, h = _setup(name, "cpu")
    v = torch.rand(op.dim, generator=torch.Generator().manual_seed(0), dtype=F64)
    v, old, matvecs = v / v.norm(), torch.tensor(math.inf, dtype=F64), 0
    while matvecs < 100:
        hv = h @ v
        new, v, matvecs = v @ hv, hv / hv.norm(), matvecs + 1
        if torch.allclose(old, new, rtol=1e-3, atol=1e-6):
            break
        old = new
    est = power_iteration(op, seed=0)
    assert est.samples == matvecs < 100
    assert est.value == pytest.approx(float(new), rel=1e-9)


@pytest.mark.parametrize("name", CASES)
def test_power_iteration_matches_dominant_eigenvalue(name: str) -> None:
    _, op, h = _setup(name, "cpu")
    eig = torch.linalg.eigvalsh(h)
    biggest = float(eig[eig.abs().argmax()])
    est = power_iteration(op, max_iter=5000, rtol=1e-10, atol=0.0)
    assert est.value == pytest.approx(biggest, rel=1e-6)


def test_power_iteration_warns_when_not_converged() -> None:
    op, _ = _quadratic([-5.0, 4.9, 1.0])
    with pytest.warns(RuntimeWarning, match="did not converge"):
        est = power_iteration(op, max_iter=2)
    assert est.samples == 2 and math.isfinite(est.value)


# -------------------------------------------------------------------------- Hutchinson


def _hutchinson_trace_sd(h: Tensor, samples: int) -> float:
    """Exact standard deviation of the Rademacher Hutchinson trace estimate."""
    return math.sqrt(2 * (h.pow(2).sum() - torch.diagonal(h).pow(2).sum()) / samples)


@pytest.mark.parametrize("name", CASES)
def test_hutchinson_trace_within_standard_errors(name: str) -> None:
    _, op, h = _setup(name, "cpu")
    est = hutchinson_trace(op, samples=100, seed=0)
    assert est.estimator == "hutchinson" and est.samples == 100
    assert abs(est.value - float(torch.trace(h))) <= 4 * _hutchinson_trace_sd(h, 100)
    assert hutchinson_trace(op, samples=100, seed=0).value == est.value  # reproducible
    diag = hutchinson_diagonal(op, samples=100, seed=0).value
    assert est.value == pytest.approx(float(diag.sum()), abs=1e-12)


@pytest.mark.parametrize("samples", [1, 7, 100])
def test_hutchinson_exact_on_a_diagonal_hessian(samples: int) -> None:
    # z ⊙ Hz = diag(H) for every ±1 probe z when H is diagonal: zero variance.
    op, a = _quadratic([3.0, -1.0, 0.5, 2.0, 0.0], rotate=False)
    _close(hutchinson_diagonal(op, samples).value, torch.diagonal(a))
    assert hutchinson_trace(op, samples).value == pytest.approx(4.5, abs=1e-12)


def test_hutchinson_trace_error_shrinks_like_one_over_samples() -> None:
    _, op, h = _setup("mlp_tanh_ce", "cpu")
    trace = float(torch.trace(h))
    for samples in (4, 64):
        errors = [hutchinson_trace(op, samples, seed=s).value - trace for s in range(40)]
        mse = sum(e * e for e in errors) / len(errors)
        # 40 seeds: mse / variance ~ chi²₄₀ / 40, inside [0.4, 1.9] with p > 0.999
        assert 0.4 <= mse / _hutchinson_trace_sd(h, samples) ** 2 <= 1.9


def test_hutchinson_diagonal_is_unbiased() -> None:
    _, op, h = _setup("layernorm_gelu", "cpu")
    seeds, samples = 40, 25
    estimates = [hutchinson_diagonal(op, samples, seed=s) for s in range(seeds)]
    assert {(e.estimator, e.samples) for e in estimates} == {("hutchinson", samples)}
    mean = sum(e.value for e in estimates) / seeds
    off_diag_sq = h.pow(2).sum(1) - torch.diagonal(h).pow(2)
    se = (off_diag_sq / (seeds * samples)).sqrt()
    assert ((mean - torch.diagonal(h)).abs() <= 5 * se + 1e-12).all()
    assert not torch.allclose(mean, torch.diagonal(h), atol=1e-6)  # it is an estimate


# ----------------------------------------------------------------------------- Hutch++


@pytest.mark.parametrize("name", CASES)
def test_hutchpp_exact_with_three_times_dim_samples(name: str) -> None:
    _, op, h = _setup(name, "cpu")
    est = hutchpp_trace(op, samples=3 * op.dim)
    assert est.estimator == "hutch++" and est.samples == 3 * op.dim
    assert est.value == pytest.approx(float(torch.trace(h)), abs=1e-9 * float(h.abs().max()))


def _trace_mse(estimator: Callable, op: HessianOperator, trace: float, samples: int) -> float:
    """Mean squared error of a trace estimator over seeds 0..29."""
    return sum((estimator(op, samples, seed=s).value - trace) ** 2 for s in range(30)) / 30


@pytest.mark.parametrize("name", CASES)
def test_hutchpp_is_unbiased(name: str) -> None:
    _, op, h = _setup(name, "cpu")
    trace = float(torch.trace(h))
    errors = [hutchpp_trace(op, 12, seed=s).value - trace for s in range(30)]
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    assert abs(sum(errors) / len(errors)) <= 4 * rms / math.sqrt(len(errors))
    assert abs(errors[0]) <= 4 * rms  # the fixed seed is within a few standard errors


def test_hutchpp_beats_hutchinson_on_a_decaying_spectrum() -> None:
    # Eigenvalues 1/k², D = 60: Hutch++ captures the top of the spectrum exactly, so its
    # squared error falls faster than 1/samples; Hutchinson's falls like 1/samples.
    op, a = _quadratic([1.0 / (k + 1) ** 2 for k in range(60)])
    trace = float(torch.trace(a))
    mse = {m: _trace_mse(hutchpp_trace, op, trace, m) for m in (9, 30, 90)}
    assert mse[30] < mse[9] / 10 and mse[90] < mse[30] / 10
    assert mse[30] < _trace_mse(hutchinson_trace, op, trace, 30) / 100


# ---------------------------------------------------------------------- non-finite values


def test_non_finite_hessian_gives_nan_estimates_not_errors() -> None:
    w = torch.tensor([1.0, math.nan, 2.0], dtype=F64, requires_grad=True)
    op = HessianOperator((w**3).sum(), [w])
    assert all(math.isnan(e.value) for e in lanczos(op, num_iter=3).values())
    with pytest.warns(RuntimeWarning):
        assert math.isnan(power_iteration(op, max_iter=3).value)
    assert math.isnan(hutchinson_trace(op).value)
    assert math.isnan(hutchpp_trace(op, samples=6).value)
    diag = exact_diagonal(op).value
    assert diag.isnan().tolist() == [False, True, False]


# ---------------------------------------------------------------------------- bad input


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message
    return message


def test_bad_operator_input_gives_one_line_errors() -> None:
    model, x, y, loss_fn = _case("mlp_tanh_ce", "cpu")
    params = list(model.parameters())
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(ValueError) as err:
        HessianOperator(losses, params)
    assert "scalar" in _one_line(err)
    frozen = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError) as err:
        HessianOperator(losses.mean(), [*params, frozen])
    assert "params[4]" in _one_line(err) and "require grad" in _one_line(err)
    with pytest.raises(ValueError) as err:
        HessianOperator(losses.mean().detach(), params)
    assert "does not require grad" in _one_line(err)
    with pytest.raises(TypeError) as err:
        HessianOperator(1.0, params)
    _one_line(err)
    with pytest.raises(TypeError) as err:
        HessianOperator(losses.mean(), params[0])
    assert "list" in _one_line(err)
    with pytest.raises(ValueError) as err:
        HessianOperator(losses.mean(), [params[0], params[0]])
    assert "twice" in _one_line(err)
    with pytest.raises(ValueError) as err:
        HessianOperator(losses.mean(), [])
    _one_line(err)
    with pytest.raises(ValueError) as err:
        HessianOperator(losses.mean(), params, batch_size=0)
    assert "batch_size" in _one_line(err)

    loss = losses.mean()
    loss.backward()
    with pytest.raises(ValueError) as err:
        HessianOperator(loss, params)
    assert "before calling loss.backward()" in _one_line(err)


def test_bad_estimator_input_gives_one_line_errors() -> None:
    _, op, _ = _setup("linear_mse", "cpu")
    with pytest.raises(ValueError) as err:
        op.matvec(torch.zeros(op.dim + 1, dtype=F64))
    assert f"D={op.dim}" in _one_line(err)
    with pytest.raises(ValueError) as err:
        exact_diagonal(op, max_dim=op.dim - 1)
    assert "max_dim" in _one_line(err)
    with pytest.raises(ValueError) as err:
        dense_hessian(op, max_dim=3)
    assert "max_dim" in _one_line(err)
    with pytest.raises(ValueError) as err:
        lanczos(op, num_iter=0)
    assert "num_iter" in _one_line(err)
    with pytest.raises(ValueError) as err:
        hutchpp_trace(op, samples=2)
    assert "samples" in _one_line(err)
    with pytest.raises(TypeError) as err:
        hutchinson_trace("not an operator")
    assert "HessianOperator" in _one_line(err)
    with pytest.raises(TypeError) as err:
        layer_traces(op, exact_diagonal(op))
    assert ".value" in _one_line(err)
    with pytest.raises(ValueError) as err:
        power_iteration(op, rtol=-1.0)
    _one_line(err)
