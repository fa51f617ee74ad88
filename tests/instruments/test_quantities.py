"""The pure quantity functions against the definitions, computed from explicit
per-sample gradients (the brute-force reference), per layer and in total."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from deepscope.instruments.curvature import HessianOperator
from deepscope.instruments.quantities import (
    cabs,
    early_stopping,
    hess_max_ev,
    hess_trace,
    hessian_diagonal,
    inner_test,
    layer_norms,
    mean_gsnr,
    norm_test,
    ortho_test,
    tic_diag,
    tic_trace,
    with_total,
)

from . import reference as R

F64 = torch.float64
SIZES = [3, 5, 1, 4]
NAMES = [f"p{k}" for k in range(len(SIZES))]


def random_ref(seed: int, batch: int, spread: float = 1.0) -> R.BatchRef:
    """Per-sample gradients gᵢ = m + spread·noise for four 'parameter tensors'."""
    rng = np.random.default_rng(seed)
    grads = {
        n: rng.normal(size=(1, k)) + spread * rng.normal(size=(batch, k))
        for n, k in zip(NAMES, SIZES)
    }
    return R.BatchRef(NAMES, rng.uniform(0.5, 2, size=batch), grads, {})


def statistics(ref: R.BatchRef) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S, Q, N) per layer then total, as the suite feeds them: Σᵢ‖gᵢ‖², gᵢᵀḡ, ‖ḡ‖²."""
    G = [torch.from_numpy(ref.grads[n]) for n in NAMES]
    S = torch.stack([g.square().sum() for g in G])
    Q = torch.stack([g @ g.mean(0) for g in G])
    N = torch.stack([g.mean(0).square().sum() for g in G])
    return with_total(S), with_total(Q), with_total(N)


def as_rows(want: dict[str, float]) -> list[float]:
    return [want[n] for n in NAMES] + [want[""]]


@given(seed=st.integers(0, 2**16), batch=st.integers(2, 9),
       spread=st.sampled_from([1e-3, 0.3, 1.0, 30.0]))
@settings(max_examples=50, deadline=None)
def test_gradient_tests_match_definitions(seed: int, batch: int, spread: float) -> None:
    ref = random_ref(seed, batch, spread)
    S, Q, N = statistics(ref)
    # Without per-sample gradients the variances come from differences like Σ‖gᵢ‖² − B‖ḡ‖²:
    # relative error ~eps·(‖ḡ‖/spread)², and an absolute error ~√eps on the test's scale
    # √(S/(B(B−1)N)) when the true value is ~0 (e.g. OrthoTest of a 1-element tensor).
    rtol = 1e-9 / min(spread, 1.0) ** 2
    atol = 1e-7 * (S / (batch * (batch - 1) * N)).sqrt().numpy()
    for got, fn in ((norm_test(S, N, batch), R.norm_test),
                    (inner_test(Q, N, batch), R.inner_test),
                    (ortho_test(S, Q, N, batch), R.ortho_test)):
        assert got.dtype == F64 and got.shape == (len(SIZES) + 1,)
        want = np.array(as_rows(R.per_layer(fn, ref)))
        assert np.all(np.abs(got.numpy() - want) <= atol + rtol * want), (got, want)


def test_identical_samples_give_zero_not_nan() -> None:
    g = torch.tensor([[1.0, 2.0]] * 4, dtype=F64)
    S, Q, N = g.square().sum()[None], (g @ g.mean(0))[None], g.mean(0).square().sum()[None]
    assert norm_test(S, N, 4).item() == 0.0
    assert inner_test(Q, N, 4).item() == 0.0
    assert ortho_test(S, Q, N, 4).item() == 0.0


def test_zero_mean_gradient_row_is_not_finite() -> None:
    """The suite turns such rows into missing values with a reason."""
    g = torch.tensor([[1.0], [-1.0]], dtype=F64)
    S, Q, N = g.square().sum()[None], (g @ g.mean(0))[None], g.mean(0).square().sum()[None]
    for value in (norm_test(S, N, 2), inner_test(Q, N, 2), ortho_test(S, Q, N, 2)):
        assert not math.isfinite(value.item())


@pytest.mark.parametrize("seed", [0, 1])
def test_snr_quantities_match_definitions(seed: int) -> None:
    batch = 6
    ref = random_ref(seed, batch, spread=0.5)
    G = [torch.from_numpy(ref.grads[n]) for n in NAMES]
    means = [g.mean(0) for g in G]
    moments = [g.square().sum(0) for g in G]
    np.testing.assert_allclose(mean_gsnr(means, moments, batch).numpy(),
                               as_rows(R.per_layer(R.mean_gsnr, ref)), rtol=1e-10)
    np.testing.assert_allclose(early_stopping(means, moments, batch).numpy(),
                               as_rows(R.per_layer(R.early_stopping, ref)), rtol=1e-10)
    S, _, N = statistics(ref)
    loss, lr = float(ref.losses.mean()), 0.3
    np.testing.assert_allclose(cabs(S, N, batch, loss, lr).numpy(),
                               as_rows(R.per_layer(lambda G: R.cabs(G, loss, lr), ref)),
                               rtol=1e-10)


def test_snr_quantities_on_float32_are_accumulated_in_float64() -> None:
    batch = 8
    ref = random_ref(3, batch, spread=0.5)
    G = [torch.from_numpy(ref.grads[n]).float() for n in NAMES]
    got = mean_gsnr([g.mean(0) for g in G], [g.square().sum(0) for g in G], batch)
    assert got.dtype == F64
    np.testing.assert_allclose(got.numpy(), as_rows(R.per_layer(R.mean_gsnr, ref)), rtol=1e-5)


def test_layer_norms_per_tensor_and_total() -> None:
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]], dtype=torch.float32)]
    got = layer_norms(tensors)
    assert got.dtype == F64
    np.testing.assert_allclose(got.numpy(), [5.0, 12.0, 13.0])


# -- curvature quantities on the Hessian operator ----------------------------------------------
def small_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)
    x, y = torch.randn(7, 4, dtype=F64), torch.randint(0, 3, (7,))

    def per_sample_loss(m: nn.Module) -> torch.Tensor:
        return F.cross_entropy(m(x), y, reduction="none")

    ref = R.batch_reference(model, per_sample_loss)
    H = R.hessian_reference(model, per_sample_loss)
    op = HessianOperator(per_sample_loss(model).mean(), list(model.parameters()))
    return ref, H, op


def test_curvature_quantities_match_dense_hessian() -> None:
    ref, H, op = small_problem()
    diagonal = hessian_diagonal(op, "auto", samples=1, seed=0)
    assert (diagonal.estimator, diagonal.samples) == ("exact", op.dim)
    traces = hess_trace(op, diagonal.value)
    np.testing.assert_allclose(traces.numpy(), [R.hess_trace(ref, H)[n] for n in ref.names] +
                               [np.trace(H)], rtol=1e-10)
    moments = [torch.from_numpy((ref.grads[n] ** 2).mean(0)) for n in ref.names]
    layers = op.split(diagonal.value)
    np.testing.assert_allclose(tic_diag(moments, layers).numpy(),
                               [R.tic_diag(ref, H)[k] for k in (*ref.names, "")], rtol=1e-10)
    np.testing.assert_allclose(tic_trace(moments, traces).numpy(),
                               [R.tic_trace(ref, H)[k] for k in (*ref.names, "")], rtol=1e-10)
    value, meta = hess_max_ev(op, num_iter=op.dim, seed=0)
    eig = np.linalg.eigvalsh(H)
    assert value == pytest.approx(eig[-1], rel=1e-9)
    assert meta["min_algebraic"] == pytest.approx(eig[0], rel=1e-9)
    assert meta["max_magnitude"] == pytest.approx(eig[np.abs(eig).argmax()], rel=1e-9)
    assert (meta["estimator"], meta["samples"]) == ("lanczos", op.dim)


def test_hessian_diagonal_modes() -> None:
    _, H, op = small_problem(1)
    auto_small = hessian_diagonal(op, "auto", samples=3, seed=0, exact_max_dim=op.dim - 1)
    assert (auto_small.estimator, auto_small.samples) == ("hutchinson", 3)
    exact = hessian_diagonal(op, "exact", samples=3, seed=0, exact_max_dim=1)
    np.testing.assert_allclose(exact.value.numpy(), np.diag(H), rtol=1e-10, atol=1e-14)
    many = 2000
    estimate = hessian_diagonal(op, "hutchinson", samples=many, seed=0)
    # element d has variance Σ_{e≠d} H_de² / samples
    sigma = np.sqrt(((H**2).sum(1) - np.diag(H) ** 2) / many)
    assert np.all(np.abs(estimate.value.numpy() - np.diag(H)) <= 5 * sigma + 1e-12)
