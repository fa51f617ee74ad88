"""One instrumented step's state, created by `Instruments.start` and dropped by `finish` /
`abort`, and the helpers that turn a step's results into `QuantityValue`s."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .alpha import AlphaStart
from .base import TOTAL, QuantityValue
from .histograms import Histogram


@dataclass
class StepState:
    """What the suite knows about the step in progress (everything that a new step resets).

    step: the step's number; due: the quantities due at it; alpha_end: the previous step's
    α start point, whose end point this step measures; engine_on: per-sample hooks on;
    started_at: (perf_counter, thread_time) at start(), the forward's yardstick.
    """

    step: int
    due: frozenset[str]
    alpha_end: AlphaStart | None
    started_at: tuple[float, float]
    engine_on: bool = False
    theta: list[Tensor] | None = None  # θₜ per parameter tensor, when a quantity needs it
    # the parameters' version counters when θₜ was last read (None: sharded, not checked)
    versions: list[int] | None = None
    theta0_here: bool = False  # θ₀ (Distance's origin) was taken at this step's start
    update_sizes: Tensor | None = None  # (K + 1,) ‖dₜ‖ per tensor, then in total
    distance: Tensor | None = None  # (K + 1,) ‖θₜ − θ₀‖ per tensor, then in total
    loss: Tensor | None = None  # L, float64 scalar
    losses: Tensor | None = None  # ℓᵢ, (B,) over every micro-batch
    counts: list[int] = field(default_factory=list)  # samples per micro-batch (rec.loss call)
    calls: int = 0  # loss() calls this step
    reduction: str = "unknown"
    curvature: dict[str, Any] = field(default_factory=dict)  # see `CurvatureRunner.run`
    failed: dict[str, str] = field(default_factory=dict)  # quantity -> reason, from loss()
    # parameters the curvature's autograd.grad did not reach, with their .grad then (see
    # `grad_state`): one that gets a gradient anyway was hidden from the curvature
    unreached: list[tuple[Tensor, Any]] = field(default_factory=list)
    hist_results: dict[str, tuple[dict[str, Histogram], dict]] | None = None
    loss_name: str | None = None  # the name of the step's rec.loss calls
    refused: str | None = None  # why none of this step's quantities can be computed

    def take_loss(self, loss: Tensor) -> None:
        """Take a loss given without per-sample losses (only Loss is then computed)."""
        self.loss = loss.detach().double().reshape(())
        if self.calls > 1:
            self.failed["Loss"] = (
                "several rec.loss calls in this step (gradient accumulation): Loss needs "
                "per_sample= in each, to weigh the micro-batches by their samples")

    def take_losses(self, losses: Tensor, reduction: str) -> int:
        """Add a micro-batch's (B,) ℓᵢ, its loss a `reduction` ("mean" | "sum") of them;
        return how many samples came before it. Raises ValueError when the micro-batches
        are reduced differently."""
        if self.counts and reduction != self.reduction:
            raise ValueError(
                f"micro-batch {len(self.counts) + 1}'s loss is a {reduction} of per_sample but "
                f"the earlier ones were a {self.reduction}; reduce every micro-batch alike")
        before = sum(self.counts)
        self.counts.append(losses.shape[0])
        self.losses = losses if self.losses is None else torch.cat([self.losses, losses])
        self.loss = self.losses.mean()
        self.reduction = reduction
        return before

    def forward_seconds(self, device: torch.device) -> float:
        """Seconds since start(), "auto"'s yardstick for the forward: on the CPU the
        thread's CPU time, which a busy machine does not inflate (then a small budget errs
        towards Hutchinson); elsewhere wall time (the caller waited for the device)."""
        wall, cpu = self.started_at
        if device.type == "cpu":
            return time.thread_time() - cpu
        return time.perf_counter() - wall


ZERO_MEAN = ("the mean gradient ḡ is zero up to round-off (e.g. a bias right before a "
             "BatchNorm in train mode, whose batch gradient cancels): the test divides by it")
ROUNDOFF = 16  # ‖ḡ‖ within this many ulps of the per-sample gradients' rms norm counts as 0


def zero_mean(grad_sq_norms: Tensor, sq_norm_sums: Tensor, batch_size: int, eps: float
              ) -> Tensor:
    """Rows (R,) whose N = ‖ḡ‖² is zero or round-off: N ≤ (ROUNDOFF·eps)² · S/B with
    S = Σᵢ‖gᵢ‖² (S/B the per-sample gradients' mean squared norm) and eps the gradients'
    machine epsilon. A batch gradient that cancels exactly in theory comes out ~1e-17 in
    float64, and a gradient test divided by it would read 1e15 — plausible-looking noise."""
    floor = (ROUNDOFF * eps) ** 2 * sq_norm_sums.double() / batch_size
    return grad_sq_norms.double() <= floor


HIDDEN_FROM_CURVATURE = (
    "parameter {name} gets its gradient from a backward pass of its own that "
    "torch.autograd.grad cannot run (torch.utils.checkpoint with use_reentrant=True?): the "
    "Hessian-vector products leave it out; use use_reentrant=False (Hugging Face: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': "
    "False}}))")


IGNORED_SAMPLES = (
    "the loss is the sum of per_sample over its {k} non-zero values of {n} (a mean over valid "
    "targets: cross_entropy's ignore_index?): the instruments count all {rows} samples, the "
    "ignored ones with zero loss and gradient, so GradNorm is about {k}/{n} of the loss's "
    "gradient norm and the gradient tests count them; pass per-sample losses that are each "
    "a mean over valid targets (e.g. per sequence), or keep ignored samples out of "
    "instrumented steps")


def grad_state(p: Tensor) -> tuple[int, int] | None:
    """What `p.grad` is now (which tensor, its version), to tell later whether a backward
    pass has written to it."""
    return None if p.grad is None else (id(p.grad), p.grad._version)


def missing(name: str, step: int, reason: str, layer: str = TOTAL) -> QuantityValue:
    """A value of `name` that could not be computed, and why."""
    return QuantityValue(name, step, layer, meta={"reason": reason})


def rows(
    name: str,
    step: int,
    names: list[str],
    values: Tensor,
    meta: dict[str, Any] | None = None,
    undefined: Tensor | None = None,
    reason: str = "",
    unavailable: dict[str, str] | None = None,
) -> list[QuantityValue]:
    """QuantityValues of a (K + 1,) per-layer-then-total result, total first; `names`: the
    K parameter tensors.

    undefined: (K + 1,) bool, rows undefined by definition (value None, `reason`).
    unavailable: parameter -> reason its per-sample gradients are missing (its row and
    the total are reported missing).
    """
    host = values.tolist()
    bad = undefined.tolist() if undefined is not None else [False] * len(host)
    unavailable = unavailable or {}
    layers = [*names, TOTAL]
    out = []
    for layer, value, is_bad in zip(layers, host, bad):
        if layer in unavailable:
            why = f"per-sample gradients unavailable: {unavailable[layer]}"
        elif layer == TOTAL and unavailable:
            first = min(unavailable)
            why = (f"per-sample gradients unavailable for {', '.join(sorted(unavailable))} "
                   f"({first}: {unavailable[first]})")
        elif is_bad:
            why = reason
        else:
            out.append(QuantityValue(name, step, layer, value=value, meta=dict(meta or {})))
            continue
        out.append(missing(name, step, why, layer))
    return out[-1:] + out[:-1]


def reduce_loss(loss: Tensor, per_sample: Tensor) -> tuple[Tensor, float, str]:
    """(ℓᵢ (B,) float64, engine scale Σᵢ ℓᵢ / loss, "mean" | "sum") from the loss and
    its per-sample parts (B, ...).

    loss ≈ mean / k → ℓᵢ = the mean of sample i's parts, scale k·B; ≈ sum / k → their
    sums, scale k; k = 1 or a whole number (micro-batches of gradient accumulation),
    tried in that order. A non-finite loss cannot tell: it is taken as a mean (its
    quantities are NaN anyway).
    """
    flat = per_sample.detach().reshape(per_sample.shape[0], -1).double()
    value, mean, total = torch.stack(
        [loss.detach().double().reshape(()), flat.mean(), flat.sum()]
    ).tolist()
    rtol = max(1e-4, 10 * torch.finfo(loss.dtype).eps)

    def divisor(reduced: float) -> int | None:
        """k with value ≈ reduced / k, or None."""
        if abs(value - reduced) <= rtol * max(abs(value), abs(reduced)):
            return 1
        if value == 0 or reduced == 0 or (value > 0) != (reduced > 0):
            return None
        k = round(reduced / value)
        ok = k >= 2 and abs(value * k - reduced) <= rtol * abs(reduced)
        return k if ok else None

    if not math.isfinite(value):
        return flat.mean(1), float(flat.shape[0]), "mean"
    for reduced, kind in ((mean, "mean"), (total, "sum")):
        k = divisor(reduced)
        if k is not None:
            values = flat.mean(1) if kind == "mean" else flat.sum(1)
            scale = k * (flat.shape[0] if kind == "mean" else 1)
            return values, float(scale), kind
    raise ValueError(
        f"loss ({value:.6g}) is neither the mean ({mean:.6g}) nor the sum ({total:.6g}) of "
        "per_sample, nor one of them divided by a whole number; pass loss = "
        "per_sample.mean() or per_sample.sum() (or either / k for k micro-batches)"
    )
