"""The instrument suite the recorder drives: which quantities are due at a step, the hooks
they need, and computing them into `QuantityValue`s.

Call order per instrumented step (the recorder does this; a hand-written loop may too):

    if inst.wants(step, kind):
        inst.start(step, kind)                  # before the forward
        losses = loss_fn(model(x), y, reduction="none")
        inst.loss(losses.mean(), per_sample=losses)   # before backward
        opt.zero_grad(); losses.mean().backward(); opt.step()
        values = inst.finish()                  # after the optimiser step

Gradient accumulation: call `loss` once per micro-batch (after its forward, before its
backward); the k micro-batches of a step are one batch of all their samples.

Every quantity is reported for the whole model (layer "") and, where meaningful, per
parameter tensor (layer = its dotted name). A quantity that cannot be computed at a step
is reported with value None and meta["reason"]; finish() never raises.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Sequence
from functools import cached_property, reduce
from operator import add
from typing import Any

import torch
from torch import Tensor, nn

from ..hookstate import paused
from .alpha import AlphaStart, fit_alpha, line_point
from .base import TOTAL, InstrumentWarning, QuantityValue
from .config import (
    NEEDS_DIAGONAL,
    NEEDS_ENGINE,
    NEEDS_HESSIAN,
    NEEDS_PER_SAMPLE,
    NEEDS_SNAPSHOT,
    check_curvature_mode,
    resolve_quantities,
)
from .curvature import Estimate, HessianOperator, OverBudget, exact_diagonal
from .engine import PerSampleEngine
from .histograms import Bins, GradHistogram, Histogram, finite_abs_max, symmetric_bins
from .quantities import (
    EXACT_MAX_DIM,
    cabs,
    choose_diagonal,
    diagonal_budget,
    early_stopping,
    hess_max_ev,
    hess_trace,
    hessian_diagonal,
    inner_test,
    layer_norms,
    mean_gsnr,
    norm_test,
    ortho_test,
    over_budget,
    tic_diag,
    tic_trace,
    with_total,
)
from .quantities.norms import squared_norms

Schedule = Callable[[int, str], bool]

# Few Hessian-vector products by default (each costs about two training steps); raise them
# for more accurate curvature. Hutchinson's diagonal is very noisy with 2 probes.
HUTCHINSON_SAMPLES = 2
LANCZOS_ITER = 10
CPU_PLAIN_HVP_DIM = 2**16  # from this many parameters on, HVPs one at a time on CPU
NO_LOSS = "loss() was not called in this step; call rec.loss(loss, per_sample=losses)"
NO_LOSS_WARNING = ("an instrumented step had no rec.loss(...): its quantities (all but Distance "
                   "and UpdateSize) are missing; call rec.loss(loss, per_sample=losses) inside "
                   "every instrumented step")
LOSS_FREE = frozenset({"Distance", "UpdateSize"})  # the quantities that need no loss
# The engine names what a warning is about first: "Linear '0': ..." or "parameter 'w': ...".
_ENGINE_LOCATION = re.compile(r"((?:parameter|[A-Za-z_][\w.]*) '[^']*'): (.+)", re.S)
# An update this close to −ḡ in direction (1 + cosine) is a plain SGD step, and α projects
# on −ḡ/‖ḡ‖ (as Cockpit does): storing θ in float32 rounds the realised update, typically to
# 1 + cosine ~ 1e-6, a direction error of ~1e-3 that is round-off, not optimiser behaviour.
SGD_COSINE_TOLERANCE = 1e-5
HIST2D_BINS = (40, 50)
HIST2D_RANGE = ((-1.0, 1.0), (-2.0, 2.0))


def _every_step(step: int, kind: str) -> bool:
    return True


def _check_schedule(schedule: object, what: str) -> Schedule:
    if not callable(schedule):
        raise TypeError(
            f"{what} must be a callable (step, kind) -> bool, got {type(schedule).__name__}"
        )
    return schedule  # type: ignore[return-value]


def is_plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is SGD without momentum, weight decay, dampening or Nesterov in
    every group (what CABS and EarlyStopping assume; Cockpit's test for them)."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        not g.get("momentum") and not g.get("weight_decay") and not g.get("dampening")
        and not g.get("nesterov") for g in optimizer.param_groups)


def _describe(error: BaseException) -> str:
    """'ErrorType: first line of the message', naming the first public error class."""
    kind = next(c.__name__ for c in type(error).__mro__ if not c.__name__.startswith("_"))
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{kind}: {text}" if text else kind


def _hvp_seconds(op: HessianOperator, repeats: int = 5) -> float:
    """Seconds of one Hessian-vector product: the fastest of `repeats` timed ones, after one
    untimed (its first pass pays one-off costs; a busy machine only slows some)."""
    v = torch.ones(op.dim, dtype=op.dtype, device=op.device)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        op.matvec(v).sum().item()  # waits for the device: the product's time, not its launch
        times.append(time.perf_counter() - began)
    return min(times[1:])


class _Batch:
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

    def check_complete(self, name: str) -> None:
        """Raise when a whole-model quantity would need a parameter without gᵢ."""
        missing = self.unavailable()
        if missing:
            first = next(iter(missing))
            raise ValueError(
                f"{name} needs every parameter's per-sample gradients; unavailable for "
                f"{', '.join(sorted(missing))} ({first}: {missing[first]})")


class Instruments:
    """Cockpit's quantities (and more) for one model, computed on scheduled steps.

    Args:
        model: the network; its trainable parameters are instrumented.
        quantities: "economy" | "business" | "full" | a list of quantity names.
        schedule: (step, kind) -> bool, when to compute; None: every step.
        optimizer: the optimiser (CABS reads the learning rate of its first group).
        schedules: per-quantity schedules overriding `schedule`, by quantity name.
        hist_bins, hist_range: GradHist1d bins on (lo, hi), or hist_range="adaptive" for a
            symmetric range from each step's largest finite |gᵢ,ₐ| (costs a second pass).
        seed: base seed of the curvature estimators (step t uses seed + t).
        curvature: Hessian diagonal for HessTrace / TIC: "auto" (exact when its D HVPs fit
            in one batched backward pass, or cost at most 10 training steps or 0.1 s,
            measured at the first curvature step, and D <= 5000; else Hutchinson, with a
            warning; see `choose_diagonal`), "exact" or "hutchinson". The choice and why
            are in each value's meta["choice"].
        hutchinson_samples: Rademacher probes (HVPs) per step for a Hutchinson diagonal.
        lanczos_iter: Lanczos iterations (HVPs) per step for HessMaxEV.
        hist2d_per_layer: also store GradHist2d per parameter tensor (40×50 counts each).
        hist2d_bins, hist2d_range: GradHist2d bins of the (θ, gᵢ) axes and their (lo, hi)
            ranges; default 40 on (−1, 1) for θ, 50 on (−2, 2) for gᵢ.

    Raises:
        TypeError / ValueError: for bad arguments, in one line naming the fix; an unknown
        quantity name lists the valid ones.
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: str | Sequence[str],
        schedule: Schedule | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        schedules: dict[str, Schedule] | None = None,
        hist_bins: int = 100,
        hist_range: tuple[float, float] | str = (-2.0, 2.0),
        seed: int = 0,
        curvature: str = "auto",
        *,
        hutchinson_samples: int = HUTCHINSON_SAMPLES,
        lanczos_iter: int = LANCZOS_ITER,
        hist2d_per_layer: bool = False,
        hist2d_bins: tuple[int, int] = HIST2D_BINS,
        hist2d_range: tuple[tuple[float, float], tuple[float, float]] = HIST2D_RANGE,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.quantities = resolve_quantities(quantities)
        self.schedule = _every_step if schedule is None else _check_schedule(schedule, "schedule")
        self.schedules: dict[str, Schedule] = {}
        for name, sched in (schedules or {}).items():
            if name not in self.quantities:
                raise ValueError(
                    f"schedules has {name!r}, which is not among the chosen quantities "
                    f"({', '.join(self.quantities)})"
                )
            self.schedules[name] = _check_schedule(sched, f"schedules[{name!r}]")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        if hist_range == "adaptive":
            self._hist_bins: Bins | None = None
            Bins(hist_bins, -1.0, 1.0)  # validates the bin count now
        elif isinstance(hist_range, (tuple, list)) and len(hist_range) == 2:
            self._hist_bins = Bins(hist_bins, float(hist_range[0]), float(hist_range[1]))
        else:
            raise ValueError(f"hist_range must be (lo, hi) or 'adaptive', got {hist_range!r}")
        self.hist_bins = hist_bins
        if len(hist2d_bins) != 2 or len(hist2d_range) != 2:
            raise ValueError("hist2d_bins and hist2d_range need two entries each (θ, gᵢ), got "
                             f"{hist2d_bins!r} and {hist2d_range!r}")
        self._hist2d = tuple(Bins(n, float(lo), float(hi))
                             for n, (lo, hi) in zip(hist2d_bins, hist2d_range))
        self.hist2d_per_layer = bool(hist2d_per_layer)
        for label, value, least in (("seed", seed, 0), ("lanczos_iter", lanczos_iter, 1),
                                    ("hutchinson_samples", hutchinson_samples, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{label} must be an int >= {least}, got {value!r}")
        self.seed = seed
        self.curvature = check_curvature_mode(curvature)
        self.hutchinson_samples = hutchinson_samples
        self.lanczos_iter = lanczos_iter

        self.model = model
        self._params: dict[str, Tensor] = {
            n: p for n, p in model.named_parameters() if p.requires_grad
        }
        if not self._params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        self._names = list(self._params)
        self._engine = PerSampleEngine(model) if set(self.quantities) & NEEDS_ENGINE else None
        self._warnings: list[str] = []
        self._new_warnings: list[InstrumentWarning] = []  # not yet taken by take_warnings()
        self._engine_warnings_taken = 0
        self._auto_diagonal: tuple[str, str] | None = None  # "auto"'s (estimator, why)
        self._started_at = (0.0, 0.0)  # (perf_counter, thread_time) at start(): the forward's
        self._theta0: list[Tensor] | None = None
        self._pending: AlphaStart | None = None  # α start point waiting for the next step
        self._hvp_batched: bool | None = None  # vmapped HVPs verified on this model
        self._deferred: list[QuantityValue] = []  # values known before their finish()
        self._reset()

    # -- state ----------------------------------------------------------------------------
    def _reset(self) -> None:
        self._step: int | None = None
        self._due: frozenset[str] = frozenset()
        self._alpha_end: AlphaStart | None = None
        self._engine_on = False
        self._theta: list[Tensor] | None = None
        self._update_sizes: Tensor | None = None  # (K + 1,) ‖dₜ‖ per tensor, then in total
        self._distance: Tensor | None = None
        self._loss: Tensor | None = None  # L, float64 scalar
        self._losses: Tensor | None = None  # ℓᵢ, (B,) over every micro-batch
        self._counts: list[int] = []  # samples per micro-batch (rec.loss call)
        self._calls = 0  # loss() calls this step
        self._reduction = "unknown"
        self._curvature: dict[str, Any] = {}
        self._failed: dict[str, str] = {}  # quantity -> reason, from start() / loss()
        self._hist_results: dict[str, tuple[dict[str, Histogram], dict]] | None = None

    @property
    def warnings(self) -> list[str]:
        """One-line messages about things the user may want to change (each once)."""
        engine = self._engine.warnings if self._engine is not None else []
        return [*self._warnings, *engine]

    def _warn(self, message: str, quantities: frozenset[str] | None = None) -> None:
        """Note a warning about the whole model (once); `quantities`: those it affects
        (default: every chosen one)."""
        if message in self._warnings:
            return
        self._warnings.append(message)
        affected = tuple(q for q in self.quantities if quantities is None or q in quantities)
        self._new_warnings.append(InstrumentWarning(self._step, "", affected, message))

    def take_warnings(self, step: int | None = None) -> list[InstrumentWarning]:
        """The warnings that appeared since the last call, each distinct one once.

        The recorder calls it after every instrumented step and hands them to the user
        (a Python warning) and to the run. Warnings of the per-sample engine (a module whose
        per-sample gradients cannot be exact, ...) are dated `step` and affect the
        quantities built on per-sample gradients.
        """
        out, self._new_warnings = self._new_warnings, []
        if self._engine is not None:
            fresh = self._engine.warnings[self._engine_warnings_taken:]
            self._engine_warnings_taken += len(fresh)
            affected = tuple(q for q in self.quantities if q in NEEDS_ENGINE)
            for text in fresh:
                match = _ENGINE_LOCATION.fullmatch(text)
                location, message = match.groups() if match else ("", text)
                out.append(InstrumentWarning(step, location, affected, message))
        return out

    def _due_at(self, step: int, kind: str) -> frozenset[str]:
        return frozenset(
            q for q in self.quantities if self.schedules.get(q, self.schedule)(step, kind)
        )

    # -- the recorder's calls --------------------------------------------------------------
    def wants(self, step: int, kind: str) -> bool:
        """Whether step `step` of kind `kind` must be instrumented (hooks on): some
        quantity is due, or the previous step's α waits for its end point."""
        return self._pending is not None or bool(self._due_at(step, kind))

    def start(self, step: int, kind: str) -> None:
        """Begin step `step` before the user's forward: snapshot θₜ and turn hooks on."""
        if self._step is not None:
            self._warn(
                f"start({step}) came before finish() of step {self._step}; that step was dropped"
            )
            self.abort()
        self._started_at = (time.perf_counter(), time.thread_time())
        self._due = self._due_at(step, kind)
        self._step = step
        self._alpha_end, self._pending = self._pending, None
        params = list(self._params.values())
        with torch.no_grad():
            if self._theta0 is None and "Distance" in self.quantities:
                self._theta0 = [p.detach().clone() for p in params]
            if self._due & NEEDS_SNAPSHOT:
                self._theta = [p.detach().clone() for p in params]
            if "Distance" in self._due:
                self._distance = layer_norms([p - p0 for p, p0 in zip(params, self._theta0)])
        if self._engine is not None and (self._due & NEEDS_ENGINE or self._alpha_end):
            self._engine.start()
            self._engine_on = True

    def loss(self, loss: Tensor, per_sample: Tensor | None) -> None:
        """Take the loss after the forward, before the user's backward; run curvature.

        Gradient accumulation: call it once per micro-batch, after its forward and before
        its backward; the step's quantities are those of one batch of all the micro-batches'
        samples (Loss: the mean ℓᵢ over all of them).

        Args:
            loss: the scalar that will be backpropagated: the mean or the sum of per_sample,
                either possibly divided by a whole number k (the usual loss / k of
                accumulation), inferred from the values; gᵢ and the Hessian of the mean loss
                follow. Factors applied after this call (loss / k, a GradScaler) are read from
                the backward pass.
            per_sample: the (B, ...) per-sample losses, batch first; other dims (e.g. tokens)
                are averaged for a mean loss and summed for a sum loss. None when no chosen
                quantity needs them.

        Raises:
            RuntimeError: outside start() / finish().
            TypeError / ValueError: bad input, in one line (e.g. a missing per_sample=).
        """
        if self._step is None:
            raise RuntimeError("loss() called outside a step; call start(step, kind) first")
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError("loss must be a scalar floating-point tensor (the reduced loss)")
        needs = self._due & NEEDS_PER_SAMPLE | ({"Alpha"} if self._alpha_end else set())
        self._calls += 1
        if per_sample is None:
            if needs:
                raise ValueError(
                    f"{', '.join(sorted(needs))} need the per-sample losses: pass per_sample= "
                    "(reduction='none'), e.g. rec.loss(losses.mean(), per_sample=losses)"
                )
            self._loss = loss.detach().double().reshape(())
            if self._calls > 1:
                self._failed["Loss"] = (
                    "several rec.loss calls in this step (gradient accumulation): Loss needs "
                    "per_sample= in each, to weigh the micro-batches by their samples")
            return
        if not isinstance(per_sample, Tensor) or per_sample.dim() < 1 or per_sample.numel() == 0:
            raise TypeError("per_sample must be a non-empty tensor of per-sample losses (B, ...)")
        losses, scale, kind = self._reduce(loss, per_sample)
        reduction = "sum" if kind == "sum" and losses.shape[0] > 1 else "mean"
        if self._counts and reduction != self._reduction:
            raise ValueError(
                f"micro-batch {len(self._counts) + 1}'s loss is a {reduction} of per_sample but "
                f"the earlier ones were a {self._reduction}; reduce every micro-batch alike")
        before = sum(self._counts)
        self._counts.append(losses.shape[0])
        self._losses = losses if self._losses is None else torch.cat([self._losses, losses])
        self._loss = self._losses.mean()
        self._reduction = reduction
        if self._engine_on:
            # ∂loss/∂(one element of per_sample): a mean also averages each sample's parts
            unit = 1 / (scale * per_sample[0].numel()) if kind == "mean" else 1 / scale
            self._engine.add_loss(loss, scale, per_sample, unit)
        if self._due & NEEDS_HESSIAN:
            # the forward's time, "auto"'s yardstick: on the CPU the thread's CPU time, which a
            # busy machine does not inflate (then a small budget errs towards Hutchinson);
            # elsewhere wall time (_reduce waited for the device)
            wall, cpu = self._started_at
            forward_s = (time.thread_time() - cpu if loss.device.type == "cpu"
                         else time.perf_counter() - wall)
            # H of the micro-batch's mean loss = loss · scale / B, whatever the reduction
            previous, self._curvature = self._curvature, {}
            batch = losses.shape[0]
            self._run_curvature(loss if scale == batch else loss * (scale / batch), forward_s)
            if before:
                self._merge_curvature(previous, before, batch)

    def finish(self) -> list[QuantityValue]:
        """Compute every due quantity after the user's backward and optimiser step.

        Returns the values of this step, α of the previous step (under its step), and
        anything deferred (e.g. an α whose end step never came). Never raises.
        """
        values, self._deferred = self._deferred, []
        if self._step is None:
            return values
        try:
            if self._engine_on:
                self._engine.stop()
            values.extend(self._compute())
        except Exception as error:  # recording must never break training
            reason = _describe(error)
            values.extend(QuantityValue(q, self._step, meta={"reason": reason})
                          for q in sorted(self._due))
        finally:
            if self._engine_on:
                self._engine.clear()
            self._reset()
        return values

    def abort(self) -> None:
        """The user's step raised: drop its captures and hooks (its α start is lost too)."""
        if self._alpha_end is not None:
            self._deferred.append(self._missing(
                "Alpha", self._alpha_end.step, "the next step, α's end point, failed"))
        if self._engine_on:
            self._engine.stop()
            self._engine.clear()
        self._reset()

    def close(self) -> None:
        """Drop everything (an α still waiting for its end point is not reported)."""
        self.abort()
        self._pending = None
        self._deferred = []
        self._theta0 = None

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _reduce(loss: Tensor, per_sample: Tensor) -> tuple[Tensor, float, str]:
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

    def _merge_curvature(self, previous: dict[str, Any], before: int, added: int) -> None:
        """Fold a micro-batch's curvature (`self._curvature`, `added` samples) into that of
        the earlier ones (`before` samples): the mean loss's Hessian over all samples is the
        sample-weighted mean of theirs, and the diagonal estimates are linear in it (with
        the same probes); the top eigenvalue is not."""
        current, self._curvature = self._curvature, {}
        due = self._due & NEEDS_HESSIAN
        if "HessMaxEV" in due:
            self._failed["HessMaxEV"] = (
                "HessMaxEV needs the Hessian of the whole step's loss at once; with several "
                "rec.loss calls (gradient accumulation) each micro-batch's graph is freed by "
                "its backward: schedule it on steps without accumulation")
        if "diagonal" not in previous or "diagonal" not in current:
            return  # the failing micro-batch's reason is in self._failed already
        if previous["diagonal_meta"] != current["diagonal_meta"]:
            self._failed.update(dict.fromkeys(due & NEEDS_DIAGONAL, (
                "the micro-batches' Hessian diagonals were estimated differently "
                f"({previous['diagonal_meta']} and {current['diagonal_meta']})")))
            return
        w0, w1 = before / (before + added), added / (before + added)
        self._curvature = {
            "diagonal": [w0 * a + w1 * b for a, b in zip(previous["diagonal"],
                                                          current["diagonal"])],
            "traces": w0 * previous["traces"] + w1 * current["traces"],
            "diagonal_meta": current["diagonal_meta"],
        }

    def _run_curvature(self, mean_loss: Tensor, forward_s: float) -> None:
        due = self._due & NEEDS_HESSIAN
        seed = (self.seed + self._step) % 2**31  # fresh probes each step, reproducibly
        params = list(self._params.values())
        try:
            # paused: every deepscope hook (engine, recorder, monitor) ignores these passes
            # on CPU, vmapped HVPs only pay while per-pass overhead dominates (2.7e5
            # parameters: two vmapped 8.0 ms, two plain 6.8 ms)
            dim = sum(p.numel() for p in params)
            one_by_one = 1 if mean_loss.device.type == "cpu" and dim >= CPU_PLAIN_HVP_DIM else None
            with paused(), HessianOperator(mean_loss, params, one_by_one,
                                           batched=self._hvp_batched) as op:
                if due & NEEDS_DIAGONAL:
                    try:
                        diagonal, choice = self._diagonal(op, seed, forward_s)
                        self._curvature["diagonal"] = op.split(diagonal.value)
                        self._curvature["traces"] = hess_trace(op, diagonal.value)
                        self._curvature["diagonal_meta"] = {
                            "estimator": diagonal.estimator, "samples": diagonal.samples,
                            **({"choice": choice} if choice else {})}
                    except Exception as error:
                        self._failed.update(dict.fromkeys(due & NEEDS_DIAGONAL, _describe(error)))
                if "HessMaxEV" in due:
                    try:
                        self._curvature["max_ev"] = hess_max_ev(op, self.lanczos_iter, seed)
                    except Exception as error:
                        self._failed["HessMaxEV"] = _describe(error)
                self._hvp_batched = op.batched  # checked once per model, not every step
        except Exception as error:  # e.g. the operator cannot be built
            self._failed.update(dict.fromkeys(due, _describe(error)))

    def _diagonal(self, op: HessianOperator, seed: int, forward_s: float) -> tuple[Estimate, str]:
        """diag(H) by the configured estimator, and (for "auto") why.

        "auto" decides at its first step by the measured cost of an HVP against the
        training step (see `choose_diagonal`), and still stops an exact diagonal that
        overruns its budget, then takes Hutchinson's from there on; it warns when it
        settles for Hutchinson.
        """
        samples = self.hutchinson_samples
        if self.curvature != "auto":
            return hessian_diagonal(op, self.curvature, samples, seed), ""
        timed = max(samples, op.batch_size) < op.dim  # else exact by count: one pass
        if self._auto_diagonal is None:
            hvp_s = _hvp_seconds(op) if timed and op.dim <= EXACT_MAX_DIM else math.nan
            self._auto_diagonal = choose_diagonal(op.dim, samples, hvp_s, forward_s,
                                                  one_pass=op.batch_size)
            if self._auto_diagonal[0] == "hutchinson":
                self._warn_estimate(self._auto_diagonal[1])
        mode, why = self._auto_diagonal
        if mode == "exact":
            try:
                budget = diagonal_budget(forward_s) if timed else None
                return exact_diagonal(op, max_dim=op.dim, budget_s=budget), why
            except OverBudget as over:
                why = over_budget(op.dim, self._step, samples, over.projected_s, forward_s)
                self._auto_diagonal = "hutchinson", why
                self._warn_estimate(why)
        return hessian_diagonal(op, "hutchinson", samples, seed), why

    def _warn_estimate(self, why: str) -> None:
        self._warn(why + "; HessTrace and TIC are estimates: pass curvature='exact' "
                   "(instrument_options={'curvature': 'exact'}) to force the exact diagonal",
                   NEEDS_DIAGONAL)

    def _missing(self, name: str, step: int, reason: str, layer: str = TOTAL) -> QuantityValue:
        return QuantityValue(name, step, layer, meta={"reason": reason})

    def _rows(
        self,
        name: str,
        values: Tensor,
        meta: dict[str, Any] | None = None,
        undefined: Tensor | None = None,
        reason: str = "",
        unavailable: dict[str, str] | None = None,
    ) -> list[QuantityValue]:
        """QuantityValues of a (K + 1,) per-layer-then-total result, total first.

        undefined: (K + 1,) bool, rows undefined by definition (value None, `reason`).
        unavailable: parameter -> reason its per-sample gradients are missing (its row and
        the total are reported missing).
        """
        host = values.tolist()
        bad = undefined.tolist() if undefined is not None else [False] * len(host)
        unavailable = unavailable or {}
        layers = [*self._names, TOTAL]
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
                out.append(QuantityValue(name, self._step, layer, value=value,
                                         meta=dict(meta or {})))
                continue
            out.append(self._missing(name, self._step, why, layer))
        return out[-1:] + out[:-1]

    # -- computing --------------------------------------------------------------------------
    def _compute(self) -> list[QuantityValue]:
        due, step = self._due, self._step
        out: list[QuantityValue] = []
        update: list[Tensor] | None = None
        if self._theta is not None:
            with torch.no_grad():
                update = [p.detach() - t for p, t in zip(self._params.values(), self._theta)]

        batch: _Batch | None = None
        batch_error = NO_LOSS
        if self._engine_on and self._losses is not None:
            try:
                batch = _Batch(self._engine)
            except Exception as error:
                batch_error = _describe(error)
        if update is not None:
            self._update_sizes = layer_norms(update)
        if batch is not None:
            # a failure here is reported by each quantity that needs the products
            with contextlib.suppress(Exception):
                self._want_dots(batch, update)

        if self._loss is None and due - LOSS_FREE:
            self._warn(NO_LOSS_WARNING, frozenset(self.quantities) - LOSS_FREE)

        def attempt(name: str, compute: Callable[[], list[QuantityValue]]) -> None:
            if self._loss is None and name not in LOSS_FREE:
                out.append(self._missing(name, step, NO_LOSS))
                return
            if name in self._failed:
                out.append(self._missing(name, step, self._failed[name]))
                return
            if name in NEEDS_ENGINE and batch is None:
                out.append(self._missing(name, step, batch_error))
                return
            try:
                out.extend(compute())
            except Exception as error:  # one failing spares the rest
                out.append(self._missing(name, step, _describe(error)))

        if self._alpha_end is not None:
            start = self._alpha_end
            if batch is None:
                out.append(self._missing("Alpha", start.step, batch_error))
            else:
                try:
                    out.append(self._alpha_value(start, batch))
                except Exception as error:
                    out.append(self._missing("Alpha", start.step, _describe(error)))

        for name in self.quantities:
            if name in due:
                attempt(name, lambda name=name: self._quantity(name, batch, update))
        return out

    def _want_dots(self, batch: _Batch, update: list[Tensor] | None) -> None:
        """Register every gᵢ·v this step needs, so that they share one pass."""
        if self._due & {"InnerTest", "OrthoTest"}:
            batch.want("mean")
        if self._alpha_end is not None:
            batch.want("end", self._alpha_end.update)
        if "Alpha" in self._due and update is not None:
            named = dict(zip(self._names, update))
            tau = float(self._update_sizes[-1])
            if tau > 0 and not batch.is_sgd_step("start", named, tau):
                batch.want("start", named)

    def _quantity(
        self, name: str, batch: _Batch | None, update: list[Tensor] | None
    ) -> list[QuantityValue]:
        """The values of one due quantity at the current step."""
        if name == "Loss":
            meta: dict[str, Any] = {"reduction": self._reduction}
            if len(self._counts) > 1:
                meta["micro_batches"] = len(self._counts)
            return [QuantityValue("Loss", self._step, value=float(self._loss), meta=meta)]
        if name == "Distance":
            return self._rows(name, self._distance)
        if name == "UpdateSize":
            return self._rows(name, self._update_sizes)
        if name in ("HessTrace", "HessMaxEV"):
            return self._curvature_values(name)
        if name == "Alpha":
            return self._alpha_start(batch, update)
        if name in ("GradHist1d", "GradHist2d"):
            return self._histograms(name, batch)
        return self._gradient_values(name, batch)

    def _gradient_values(self, name: str, batch: _Batch) -> list[QuantityValue]:
        """Quantities from per-sample gradient statistics, per layer and in total."""
        B = batch.size
        if name in ("NormTest", "InnerTest", "OrthoTest", "CABS", "EarlyStopping") and B < 2:
            raise ValueError(f"{name} needs a batch of at least 2 samples, got {B}")
        meta: dict[str, Any] = {}
        undefined, reason = None, ""
        if name in ("NormTest", "InnerTest", "OrthoTest", "CABS"):
            N = with_total(batch.grad_sq_norms)
            undefined, reason = N == 0, "the mean gradient ḡ is exactly zero"
        if name == "GradNorm":
            value = with_total(batch.grad_sq_norms).sqrt()
        elif name == "NormTest":
            value = norm_test(with_total(batch.sq_norm_sums), N, B)
        elif name == "InnerTest":
            value = inner_test(with_total(batch.dots_with_mean), N, B)
        elif name == "OrthoTest":
            value = ortho_test(with_total(batch.sq_norm_sums), with_total(batch.dots_with_mean),
                               N, B)
        elif name == "MeanGSNR":
            value = mean_gsnr(batch.grad_mean, batch.second_moment_sums, B)
        elif name == "EarlyStopping":
            value = early_stopping(batch.grad_mean, batch.second_moment_sums, B)
            meta = self._sgd_note(name)
        elif name == "CABS":
            value, meta = self._cabs(with_total(batch.sq_norm_sums), N, B)
            if self._loss == 0:
                undefined, reason = torch.ones_like(N, dtype=torch.bool), "the loss is zero"
        else:  # TICDiag, TICTrace
            if "diagonal" not in self._curvature:
                raise RuntimeError("the Hessian diagonal was not computed at this step")
            moments = [m / B for m in batch.second_moment_sums]
            meta = self._curvature["diagonal_meta"]
            value = (tic_diag(moments, self._curvature["diagonal"]) if name == "TICDiag"
                     else tic_trace(moments, self._curvature["traces"]))
        # read after computing: the engine finds parameters without per-sample gradients then;
        # ḡ needs none (GradNorm): only parameters whose delivered gradient is unusable too
        missing = batch.engine.unavailable_sum if name == "GradNorm" else batch.unavailable()
        return self._rows(name, value, meta, undefined, reason, dict(missing))

    def _cabs(self, S: Tensor, N: Tensor, B: int) -> tuple[Tensor, dict[str, Any]]:
        """CABS rows and meta; the learning rate comes from the optimiser's first group."""
        if self.optimizer is None:
            raise ValueError("CABS needs the learning rate: pass optimizer= to the instruments")
        group = self.optimizer.param_groups[0]
        lr = float(group["lr"])
        meta: dict[str, Any] = {"optimizer": type(self.optimizer).__name__, "lr": lr,
                                **self._sgd_note("CABS")}
        return cabs(S, N, B, float(self._loss), lr), meta

    def _sgd_note(self, name: str) -> dict[str, str]:
        """meta["note"] (and one warning) when `name`, which assumes plain SGD, is computed
        for another optimiser; Cockpit refuses to compute it then."""
        if self.optimizer is None:
            return {"note": f"{name} assumes plain SGD; no optimizer was given to check"}
        if is_plain_sgd(self.optimizer):
            return {}
        note = (f"{name} assumes plain SGD (no momentum, weight decay, dampening or Nesterov); "
                f"computed for {type(self.optimizer).__name__} anyway, where the criterion "
                "does not hold as stated")
        if note not in self._warnings:
            self._warnings.append(note)
        return {"note": note}

    def _curvature_values(self, name: str) -> list[QuantityValue]:
        if name == "HessMaxEV":
            value, meta = self._curvature["max_ev"]
            return [QuantityValue(name, self._step, value=value, meta=meta)]
        return self._rows(name, self._curvature["traces"], self._curvature["diagonal_meta"])

    # -- α ---------------------------------------------------------------------------------
    def _alpha_start(self, batch: _Batch, update: list[Tensor]) -> list[QuantityValue]:
        """Measure α's start point; α itself comes at the next step (or now if τ = 0)."""
        tau = float(self._update_sizes[-1])
        if tau == 0:
            return [QuantityValue("Alpha", self._step, value=-1.0, meta={"tau": 0.0})]
        named = dict(zip(self._names, update))
        projections = batch.projections("start", named, tau)
        batch.check_complete("Alpha")
        point = line_point(self._losses, projections)
        self._pending = AlphaStart(self._step, point, named, tau)
        return []

    def _alpha_value(self, start: AlphaStart, batch: _Batch) -> QuantityValue:
        """α of step start.step from its start point and this step's end point."""
        projections = batch.projections("end", start.update, start.tau)
        batch.check_complete("Alpha")
        end = line_point(self._losses, projections)
        fit = fit_alpha(start.point, end, start.tau)
        meta: dict[str, Any] = {
            "tau": start.tau, "end_step": self._step,
            "f": [start.point.f, end.f], "df": [start.point.df, end.df],
            "var_f": [start.point.var_f, end.var_f], "var_df": [start.point.var_df, end.var_df],
        }
        if fit.mu is not None:
            meta["mu"] = list(fit.mu)
        if fit.reason is not None:
            meta["reason"] = fit.reason
        return QuantityValue("Alpha", start.step, value=fit.alpha, meta=meta)

    # -- histograms --------------------------------------------------------------------------
    def _histogram_pass(self, batch: _Batch) -> dict[str, tuple[dict[str, Histogram], dict]]:
        """GradHist1d and GradHist2d (those due) per parameter tensor, from one pass over
        the per-sample gradients, part by part: name -> (per layer, meta)."""
        due = {"GradHist1d", "GradHist2d"} & self._due
        meta: dict[str, dict[str, Any]] = {name: {} for name in due}
        engine = batch.engine
        bins = self._hist_bins
        # batch.unavailable() is complete once the engine yielded its first part
        if "GradHist1d" in due and bins is None:  # adaptive: a first pass for the range
            bound = finite_abs_max(part for n, part in engine.per_sample_parts()
                                   if n not in batch.unavailable())
            bins = symmetric_bins(self.hist_bins, bound)
            meta["GradHist1d"]["range"] = "adaptive"
        theta = dict(zip(self._names, self._theta or []))
        param_bins, grad_bins = self._hist2d
        counters: dict[str, dict[str, GradHistogram]] = {name: {} for name in due}
        for pname, part in engine.per_sample_parts():
            if pname in batch.unavailable():
                continue
            if "GradHist1d" in due:
                counters["GradHist1d"].setdefault(pname, GradHistogram(bins)).add(part)
            if "GradHist2d" in due:  # (a GradHistogram costs nothing until its first add)
                counters["GradHist2d"].setdefault(
                    pname, GradHistogram(grad_bins, theta[pname], param_bins)).add(part)
        if batch.unavailable():
            for extra in meta.values():
                extra["excluded"] = sorted(batch.unavailable())
        return {name: ({n: counters[name][n].result() for n in self._names
                        if n in counters[name]}, meta[name]) for name in due}

    def _histograms(self, name: str, batch: _Batch) -> list[QuantityValue]:
        """GradHist1d / GradHist2d values: total, and per layer (2-D: if hist2d_per_layer)."""
        if self._hist_results is None:
            self._hist_results = self._histogram_pass(batch)
        per_layer, meta = self._hist_results[name]
        if not per_layer:
            raise ValueError("no parameter has per-sample gradients at this step")
        total = reduce(add, per_layer.values())
        out = [self._histogram_value(name, TOTAL, total, meta)]
        if name == "GradHist1d" or self.hist2d_per_layer:
            out += [self._histogram_value(name, n, h, meta) for n, h in per_layer.items()]
            out += [self._missing(name, self._step, f"per-sample gradients unavailable: {why}", n)
                    for n, why in batch.unavailable().items()]
        return out

    def _histogram_value(
        self, name: str, layer: str, hist: Histogram, meta: dict[str, Any]
    ) -> QuantityValue:
        return QuantityValue(name, self._step, layer, array=hist.counts,
                             meta={**hist.meta(), **meta})
