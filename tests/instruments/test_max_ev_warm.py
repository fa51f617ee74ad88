"""HessMaxEV's Lanczos warm-started from the previous step's top Ritz vector and stopped
once converged, against the top eigenvalue of a dense float64 Hessian; and the batched
Hutchinson probes against the looped ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

from deepscope.instruments.curvature import HessianOperator, hutchinson_diagonal
from deepscope.instruments.quantities.curvature import MAX_EV_TOL, top_eigenvalue

F64 = torch.float64


def _model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    x = torch.randn(32, 6, dtype=F64)
    y = torch.randint(0, 3, (32,))
    return model, x, y


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _dense(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss's Hessian, (D, D) float64, by torch.func (independent of the operator)."""
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def flat_loss(flat: torch.Tensor) -> torch.Tensor:
        parts = flat.split([p.numel() for p in params.values()])
        shaped = {n: t.view(params[n].shape) for n, t in zip(names, parts)}
        return nn.functional.cross_entropy(functional_call(model, shaped, (x,)), y)

    return hessian(flat_loss)(torch.cat([p.reshape(-1) for p in params.values()]))


# (tol, rtol): the default tolerance, and a tight one that must reach rtol 1e-6
@pytest.mark.parametrize(("tol", "rtol"), [(MAX_EV_TOL, MAX_EV_TOL), (1e-9, 1e-6)])
def test_warm_started_early_stopped_lanczos_matches_the_dense_top_eigenvalue(
        tol: float, rtol: float) -> None:
    model, x, y = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    num_iter = 60  # < D = 83: a full basis would make any start exact
    start, cold_iterations, warm_iterations = None, [], []
    for step in range(6):
        loss = _loss(model, x, y)
        eig = torch.linalg.eigh(_dense(model, x, y))
        with HessianOperator(loss, list(model.parameters())) as op:
            assert op.dim > num_iter
            if step == 3:  # a poor start: the bottom eigenvector, far from the top
                start = eig.eigenvectors[:, 0].clone()
            value, meta, vector = top_eigenvalue(op, num_iter, step, start, tol)
            cold, cold_meta, _ = top_eigenvalue(op, num_iter, step, tol=tol)
        top = float(eig.eigenvalues[-1])
        assert meta["converged"] and "note" not in meta, meta
        assert meta["warm_start"] == (start is not None)
        assert meta["samples"] < num_iter  # stopped early
        assert meta["residual"] <= tol ** 0.5 * abs(value)
        assert value == pytest.approx(top, rel=rtol)
        assert cold == pytest.approx(top, rel=rtol)
        # the Ritz vector is a unit vector near the top eigenvector
        assert float(vector.norm()) == pytest.approx(1.0, rel=1e-10)
        assert abs(float(vector @ eig.eigenvectors[:, -1])) > 0.99
        if step not in (0, 3):
            warm_iterations.append(meta["samples"])
            cold_iterations.append(cold_meta["samples"])
        start = vector
        loss.backward()
        opt.step()
        opt.zero_grad()
    # a good start saves iterations (HVPs)
    assert sum(warm_iterations) < sum(cold_iterations), (warm_iterations, cold_iterations)


def test_lanczos_not_converged_within_num_iter_says_so() -> None:
    model, x, y = _model()
    top = float(torch.linalg.eigvalsh(_dense(model, x, y))[-1])
    with HessianOperator(_loss(model, x, y), list(model.parameters())) as op:
        value, meta, _ = top_eigenvalue(op, 2, seed=0)
    assert not meta["converged"] and meta["samples"] == 2
    assert "did not converge within lanczos_iter=2" in meta["note"]
    assert value <= top + 1e-12  # a Ritz value: a lower bound of the top eigenvalue


def test_a_start_of_the_wrong_shape_or_non_finite_is_ignored() -> None:
    model, x, y = _model()
    with HessianOperator(_loss(model, x, y), list(model.parameters())) as op:
        cold = top_eigenvalue(op, 40, seed=1)
        for start in (torch.ones(3, dtype=F64), torch.full((op.dim,), float("nan"), dtype=F64),
                      torch.zeros(op.dim, dtype=F64)):
            again = top_eigenvalue(op, 40, seed=1, start=start)
            assert again[0] == cold[0] and again[1]["samples"] == cold[1]["samples"]


@pytest.mark.parametrize("samples", [2, 5])
def test_batched_hutchinson_equals_the_looped_one(samples: int) -> None:
    model, x, y = _model()
    loss = _loss(model, x, y)
    params = list(model.parameters())
    with HessianOperator(loss, params, batch_size=samples) as batched, \
            HessianOperator(loss, params, batch_size=1) as looped:
        one = hutchinson_diagonal(batched, samples=samples, seed=4)
        two = hutchinson_diagonal(looped, samples=samples, seed=4)
        assert batched.batched is True  # the vmapped backward ran and was verified
    torch.testing.assert_close(one.value, two.value, rtol=1e-12, atol=1e-15)


class _Dense:
    """A symmetric matrix as the operator Lanczos takes."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix, self.dim = matrix, matrix.shape[0]
        self.dtype, self.device = matrix.dtype, matrix.device

    def matvec(self, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mv(self.matrix, v) if out is None else torch.mv(self.matrix, v, out=out)


def test_lanczos_runs_sharing_the_reused_buffers_do_not_disturb_each_other() -> None:
    """Lanczos keeps its vectors in a buffer reused between calls: a returned Ritz vector is
    the caller's own, and a run after runs of other sizes gives the same result bitwise."""
    model, x, y = _model()
    top = float(torch.linalg.eigvalsh(_dense(model, x, y))[-1])
    small = _Dense(torch.diag(torch.arange(1.0, 6.0, dtype=F64)))
    with HessianOperator(_loss(model, x, y), list(model.parameters())) as op:
        first, first_meta, vector = top_eigenvalue(op, 40, seed=2, tol=0.0)
        kept = vector.clone()
        top_eigenvalue(small, 5, seed=0)  # a smaller basis in the same buffer
        top_eigenvalue(op, 60, seed=5, start=vector)  # a bigger one, started from it
        again, again_meta, vector_again = top_eigenvalue(op, 40, seed=2, tol=0.0)
    assert torch.equal(vector, kept)
    assert again == first and again_meta == first_meta and torch.equal(vector_again, kept)
    assert first == pytest.approx(top, rel=1e-10)
