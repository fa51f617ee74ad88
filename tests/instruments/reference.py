"""Independent brute-force reference for the instrument quantities, in float64.

Everything is computed the slow, obvious way: per-sample gradients by one
``torch.autograd.grad`` call per sample, the dense Hessian row by row by double backward, and
each quantity straight from its definition in QUANTITIES.md with numpy (explicit
differences, no algebraic shortcuts). Nothing is imported from deepscope, so a mistake
shared with the implementation cannot hide.

Per-layer results are dicts {layer: value} with the whole model under "".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

PerSampleLoss = Callable[[nn.Module], Tensor]  # model -> (B,) per-sample losses ℓᵢ


@dataclass
class BatchRef:
    """One batch at one θ: per-sample losses ℓᵢ, per-sample gradients gᵢ, and θ."""

    names: list[str]
    losses: np.ndarray  # (B,)
    grads: dict[str, np.ndarray]  # name -> (B, D_k), gᵢ = ∇ℓᵢ (not divided by B)
    params: dict[str, np.ndarray]  # name -> (D_k,)

    def layers(self) -> dict[str, np.ndarray]:
        """{layer: (B, D_layer) per-sample gradients}, the whole model under ""."""
        out = dict(self.grads)
        out[""] = np.concatenate([self.grads[n] for n in self.names], axis=1)
        return out


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def batch_reference(model: nn.Module, per_sample_loss: PerSampleLoss) -> BatchRef:
    """ℓᵢ and gᵢ by one autograd.grad per sample (the model must be float64)."""
    named = trainable(model)
    params = [p for _, p in named]
    losses = per_sample_loss(model)
    grads: dict[str, list[np.ndarray]] = {n: [] for n, _ in named}
    for i in range(losses.shape[0]):
        gi = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        for (n, p), g in zip(named, gi):
            g = torch.zeros_like(p) if g is None else g
            grads[n].append(g.detach().reshape(-1).cpu().numpy())
    return BatchRef(
        names=[n for n, _ in named],
        losses=losses.detach().cpu().numpy().astype(np.float64),
        grads={n: np.stack(v) for n, v in grads.items()},
        params={n: p.detach().reshape(-1).cpu().numpy().copy() for n, p in named},
    )


def hessian_reference(model: nn.Module, per_sample_loss: PerSampleLoss) -> np.ndarray:
    """Dense H = ∇²L of the mean loss over all trainable parameters, (D, D), float64.

    Row a is ∂(∂L/∂θₐ)/∂θ, one double-backward pass per row. (torch.func's jacrev of
    jacrev gets the LayerNorm-weight × Embedding block wrong in torch 2.13 — an asymmetric
    "Hessian" — and torch.func.hessian lacks forward AD through attention.)
    """
    params = [p for _, p in trainable(model)]
    grads = torch.autograd.grad(per_sample_loss(model).mean(), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = []
    for a in range(flat.numel()):
        parts = torch.autograd.grad(flat[a], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([
            (torch.zeros_like(p) if part is None else part).reshape(-1)
            for p, part in zip(params, parts)
        ]))
    return torch.stack(rows).detach().cpu().numpy()


def split_layers(names: list[str], sizes: list[int], vector: np.ndarray) -> dict[str, np.ndarray]:
    """{layer: segment} of a flat (D,) vector, and the whole vector under ""."""
    out, start = {}, 0
    for n, k in zip(names, sizes):
        out[n] = vector[start : start + k]
        start += k
    out[""] = vector
    return out


# -- first-order quantities, straight from the definitions ---------------------------------
def grad_norm(G: np.ndarray) -> float:
    return float(np.linalg.norm(G.mean(0)))


def norm_test(G: np.ndarray) -> float:
    B, gbar = G.shape[0], G.mean(0)
    spread = sum(np.sum((G[i] - gbar) ** 2) for i in range(B))
    return float(np.sqrt(spread / (B * (B - 1) * np.sum(gbar**2))))


def inner_test(G: np.ndarray) -> float:
    B, gbar = G.shape[0], G.mean(0)
    n2 = np.sum(gbar**2)
    spread = sum((G[i] @ gbar - n2) ** 2 for i in range(B))
    return float(np.sqrt(spread / (B * (B - 1) * n2**2)))


def ortho_test(G: np.ndarray) -> float:
    B, gbar = G.shape[0], G.mean(0)
    n2 = np.sum(gbar**2)
    spread = sum(np.sum((G[i] - (G[i] @ gbar / n2) * gbar) ** 2) for i in range(B))
    return float(np.sqrt(spread / (B * (B - 1) * n2)))


def mean_gsnr(G: np.ndarray, eps: float = 1e-5) -> float:
    gbar = G.mean(0)
    second = (G**2).mean(0)
    return float(np.mean(gbar**2 / (second - gbar**2 + eps)))


def early_stopping(G: np.ndarray, eps: float = 1e-5) -> float:
    B, gbar = G.shape[0], G.mean(0)
    var = ((G - gbar) ** 2).sum(0) / (B - 1)
    return float(1 - B * np.mean(gbar**2 / (var + eps)))


def cabs(G: np.ndarray, loss: float, lr: float) -> float:
    B, gbar = G.shape[0], G.mean(0)
    return float(lr * np.sum((G - gbar) ** 2) / (B * loss))


def per_layer(fn: Callable[[np.ndarray], float], ref: BatchRef) -> dict[str, float]:
    """fn applied to each layer's per-sample gradients and to the whole model's."""
    return {layer: fn(G) for layer, G in ref.layers().items()}


# -- curvature ----------------------------------------------------------------------------
def hess_trace(ref: BatchRef, H: np.ndarray) -> dict[str, float]:
    sizes = [ref.grads[n].shape[1] for n in ref.names]
    return {k: float(v.sum()) for k, v in split_layers(ref.names, sizes, np.diag(H)).items()}


def tic_diag(ref: BatchRef, H: np.ndarray, eps: float = 1e-7) -> dict[str, float]:
    sizes = [ref.grads[n].shape[1] for n in ref.names]
    diag = split_layers(ref.names, sizes, np.diag(H))
    return {
        k: float(np.sum((G**2).mean(0) / (diag[k] + eps))) for k, G in ref.layers().items()
    }


def tic_trace(ref: BatchRef, H: np.ndarray, eps: float = 1e-7) -> dict[str, float]:
    sizes = [ref.grads[n].shape[1] for n in ref.names]
    diag = split_layers(ref.names, sizes, np.diag(H))
    return {
        k: float(np.sum((G**2).mean(0)) / (np.sum(diag[k]) + eps))
        for k, G in ref.layers().items()
    }


def hess_max_ev(H: np.ndarray) -> float:
    return float(np.linalg.eigvalsh((H + H.T) / 2)[-1])


# -- α -------------------------------------------------------------------------------------
def alpha(start: BatchRef, end: BatchRef, update: np.ndarray) -> tuple[float, np.ndarray]:
    """(α, μ) by the GLS normal equations, literally as QUANTITIES.md writes them.

    update: dₜ = θₜ₊₁ − θₜ, flat over all parameters in `start.names` order.
    """
    tau = float(np.linalg.norm(update))
    direction = update / tau
    points = []
    for ref in (start, end):
        G = ref.layers()[""]
        proj = np.array([G[i] @ direction for i in range(G.shape[0])])
        points.append((ref.losses.mean(), ref.losses.var(ddof=1), proj.mean(), proj.var(ddof=1)))
    (f0, vf0, df0, vdf0), (f1, vf1, df1, vdf1) = points
    phi = np.array([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=np.float64)
    variances = np.array([vf0, vf1, vdf0, vdf1])
    variances[variances == 0] = 1e-10
    lam_inv = np.diag(1 / variances)
    y = np.array([f0, f1, df0, df1])
    mu = np.linalg.inv(phi.T @ lam_inv @ phi) @ phi.T @ lam_inv @ y
    if mu[2] < 0:
        return -1.0, mu
    return float(2 * tau / (-mu[1] / mu[2]) - 1), mu


# -- histograms -----------------------------------------------------------------------------
def histogram_1d(values: np.ndarray, bins: int, lo: float, hi: float) -> tuple[np.ndarray, dict]:
    """numpy.histogram counts of the finite values, and the extras counted explicitly."""
    flat = values.reshape(-1)
    finite = flat[np.isfinite(flat)]
    counts, edges = np.histogram(finite, bins=bins, range=(lo, hi))
    extras = {
        "underflow": int(np.sum(finite < edges[0])),
        "overflow": int(np.sum(finite > edges[-1])),
        "nan": int(np.sum(np.isnan(flat))),
        "posinf": int(np.sum(flat == np.inf)),
        "neginf": int(np.sum(flat == -np.inf)),
    }
    return counts, extras


def histogram_2d(
    params: np.ndarray, grads: np.ndarray, bins: tuple[int, int], ranges: tuple
) -> np.ndarray:
    """numpy.histogram2d of the pairs (θₐ, gᵢ,ₐ) with both coordinates finite.

    params (D,) θ; grads (B, D) per-sample gradients.
    """
    theta = np.broadcast_to(params, grads.shape).reshape(-1)
    g = grads.reshape(-1)
    keep = np.isfinite(theta) & np.isfinite(g)
    counts, _, _ = np.histogram2d(theta[keep], g[keep], bins=list(bins), range=list(ranges))
    return counts.astype(np.int64)
