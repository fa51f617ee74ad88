"""One step's per-sample gradient statistics from the engine, each computed once and
shared by every quantity (and α) that needs it."""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor

from .engine import PerSampleEngine
from .quantities.norms import squared_norms

# An update this close to −ḡ in direction (1 + cosine) is a plain SGD step, and α projects
# on −ḡ/‖ḡ‖ (as Cockpit does): storing θ in float32 rounds the realised update, typically to
# 1 + cosine ~ 1e-6, a direction error of ~1e-3 that is round-off, not optimiser behaviour.
SGD_COSINE_TOLERANCE = 1e-5


class Batch:
    """Per-step statistics from the engine, each computed once and shared.

    Per-layer results are float64 with one row per parameter tensor, in `names` order.
    Dot products gᵢ·v with several vectors share one pass over the captures: `want` them
    all before the first `dots`.
    """

    def __init__(self, engine: PerSampleEngine) -> None:
        self.engine = engine
        self.size = engine.batch_size  # raises when the losses and the model disagree
        self._wanted: dict[str, dict[str, Tensor]] = {}
        self._dots: dict[str, Tensor] = {}
        self._sgd: dict[str, bool] = {}  # is_sgd_step, by key

    @cached_property
    def grad_mean(self) -> list[Tensor]:
        """ḡ⁽ᵏ⁾, parameter-shaped."""
        return list(self.engine.grad_mean().values())

    @cached_property
    def grad_sq_norms(self) -> Tensor:
        """(K,) ‖ḡ⁽ᵏ⁾‖²."""
        return squared_norms(self.grad_mean)

    @cached_property
    def sq_norm_sums(self) -> Tensor:
        """(K,) Σᵢ ‖gᵢ⁽ᵏ⁾‖²."""
        return torch.stack([v.double().sum() for v in self.engine.sq_norms().values()])

    def want(self, key: str, vectors: dict[str, Tensor] | None = None) -> None:
        """Register vectors (per parameter tensor; None: ḡ) for `dots(key)`."""
        self._wanted[key] = dict(zip(self.engine.param_names, self.grad_mean)) \
            if vectors is None else vectors

    def dots(self, key: str) -> Tensor:
        """(K, B) gᵢ⁽ᵏ⁾·v⁽ᵏ⁾ for the vectors registered as `key`; the first call computes
        those of every registered key at once."""
        if key not in self._dots:
            keys = [key, *(k for k in self._wanted if k not in self._dots and k != key)]
            results = self.engine.dots_many([self._wanted[k] for k in keys])
            for k, dots in zip(keys, results):
                self._dots[k] = torch.stack([v.double() for v in dots.values()])
        return self._dots[key]

    @cached_property
    def dots_with_mean(self) -> Tensor:
        """(K, B) gᵢ⁽ᵏ⁾ᵀḡ⁽ᵏ⁾."""
        if "mean" not in self._wanted:
            self.want("mean")
        return self.dots("mean")

    def is_sgd_step(self, key: str, update: dict[str, Tensor], tau: float) -> bool:
        """Whether the gradient tests take gᵢᵀḡ at this step and d̂ = d/τ (the update
        `key`) is −ḡ/‖ḡ‖ up to round-off (a plain SGD step): then α's slopes are
        −gᵢᵀḡ/‖ḡ‖, one vector fewer."""
        if key not in self._sgd:
            norm = float(self.grad_sq_norms.sum().sqrt()) if "mean" in self._wanted else 0.0
            inner = sum(float(torch.vdot(d.reshape(-1), g.reshape(-1).to(d)))
                        for d, g in zip(update.values(), self.grad_mean)) if norm > 0 else 0.0
            self._sgd[key] = norm > 0 and inner / (tau * norm) < -1 + SGD_COSINE_TOLERANCE
        return self._sgd[key]

    def projections(self, key: str, update: dict[str, Tensor], tau: float) -> Tensor:
        """(B,) gᵢᵀd̂ over the whole model along d̂ = d/τ, d registered as `key` (unless it
        is a plain SGD step, see `is_sgd_step`)."""
        if key not in self._wanted and self.is_sgd_step(key, update, tau):
            return -self.dots_with_mean.sum(0) / float(self.grad_sq_norms.sum().sqrt())
        if key not in self._wanted:
            self.want(key, update)
        return self.dots(key).sum(0) / tau

    @cached_property
    def second_moment_sums(self) -> list[Tensor]:
        """Σᵢ (gᵢ⁽ᵏ⁾)², parameter-shaped."""
        return list(self.engine.second_moments().values())

    def unavailable(self) -> dict[str, str]:
        """Parameter name -> why its per-sample gradients could not be obtained."""
        return dict(self.engine.unavailable)

    def unavailable_sum(self) -> dict[str, str]:
        """Parameter name -> why even its mean gradient ḡ could not be obtained."""
        return dict(self.engine.unavailable_sum)

    def check_complete(self, name: str) -> None:
        """Raise when a whole-model quantity would need a parameter without gᵢ."""
        missing = self.unavailable()
        if missing:
            first = next(iter(missing))
            raise ValueError(
                f"{name} needs every parameter's per-sample gradients; unavailable for "
                f"{', '.join(sorted(missing))} ({first}: {missing[first]})")
