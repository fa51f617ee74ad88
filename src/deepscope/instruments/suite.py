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

`Instruments` is the driver: the step's state is one `StepState` (step.py), the engine's
statistics one `Batch` (batch.py); α's two steps live in alpha.py, the histogram pass in
histograms/per_step.py, the curvature in quantities/curvature_runner.py; in a distributed
run (`reducer=`) global_batch.py turns every rank's statistics into values of the global
batch (sharded.py an FSDP2 model's shards).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..catalogue import MAX_EV_EVERY, needing, spec
from ..distributed import Reducer
from ..naming import ModelNames
from . import alpha
from .alpha import AlphaStart
from .base import InstrumentWarning, QuantityValue, describe
from .batch import Batch
from .config import check_curvature_mode, resolve_quantities
from .engine import PerSampleEngine
from .global_batch import REPLICATED, GlobalStep
from .histograms.per_step import (
    HIST2D_BINS,
    HIST2D_RANGE,
    HISTOGRAM_NAMES,
    HistogramSettings,
    histogram_pass,
    histogram_values,
    sweep_counters,
)
from .quantities import (
    cabs,
    diagonal_budget,
    early_stopping,
    inner_test,
    layer_norms,
    mean_gsnr,
    norm_test,
    ortho_test,
    tic_diag,
    tic_trace,
    with_total,
)
from .quantities.curvature_runner import CurvatureRunner
from .quantities.curvature_runner import hvp_seconds as _hvp_seconds
from .sharded import ShardedStep, shard_squares
from .sharding import fsdp2_model, local_shards
from .step import (
    HIDDEN_FROM_CURVATURE,
    IGNORED_SAMPLES,
    ZERO_MEAN,
    StepState,
    grad_state,
    missing,
    reduce_loss,
    rows,
    zero_mean,
)

Schedule = Callable[[int, str], bool]
# A quantity's compute function: (the suite, the quantity's name, the step, the engine's
# statistics or None, the update θₜ₊₁ − θₜ per parameter or None) -> its values (whole
# model, layer "", and per layer).
Compute = Callable[["Instruments", str, StepState, "Batch | None", "list[Tensor] | None"],
                   list[QuantityValue]]
# The compute function of every quantity, by catalogue name; `computes` fills it.
COMPUTE: dict[str, Compute] = {}


def computes(*names: str) -> Callable[[Compute], Compute]:
    """Decorator: register `fn` as the compute function of the catalogue quantities `names`
    (a new quantity is one `catalogue.register(QuantitySpec(...))` plus one of these)."""
    def add(fn: Compute) -> Compute:
        for name in names:
            COMPUTE[name] = fn
        return fn
    return add

# Few Hessian-vector products by default (each costs about two training steps); raise them
# for more accurate curvature. Hutchinson's diagonal is very noisy with 2 probes.
HUTCHINSON_SAMPLES = 2
LANCZOS_ITER = 10
PARAMETERS_CHANGED = (
    "the model's trainable parameters changed since it was watched ({name} frozen, unfrozen, "
    "added or replaced): the instruments cover the parameters trainable at watch(); watch "
    "the changed model in a Scope (a run) of its own")
SEVERAL_LOSSES = (
    "rec.loss got two losses in this step ({first!r}, then {second!r}): the instruments take "
    "one loss per step (its micro-batches under one name); register only the instrumented "
    "model's loss with rec.loss, log the other with rec.kpi")
NONFINITE_LOSS = "the loss is not finite at this step ({loss:g}): its gradients are not either"
NO_LOSS = "loss() was not called in this step; call rec.loss(loss, per_sample=losses)"
FORWARD_EDIT = ("the forward changed parameter '{name}' in place (e.g. nn.Embedding(max_norm=...) "
                "renormalising the rows it reads)")
NO_LOSS_WARNING = ("an instrumented step had no rec.loss(...): its quantities (all but Distance "
                   "and UpdateSize) are missing; call rec.loss(loss, per_sample=losses) inside "
                   "every instrumented step")
# The engine names what a warning is about first: "Linear '0': ..." or "parameter 'w': ...".
_ENGINE_LOCATION = re.compile(r"((?:parameter|[A-Za-z_][\w.]*) '[^']*'): (.+)", re.S)


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
        max_ev_every: HessMaxEV at the first step its schedule picks, then at every k-th one
            it picks (not computed, so not stored, at the others; its values' meta["every"]
            says k when k > 1). None: the configuration's (`catalogue.MAX_EV_EVERY`: 4 for
            "full"), 1 for a list of names. 1: every step its schedule picks.
        hist2d_per_layer: also store GradHist2d per parameter tensor (40×50 counts each).
        hist2d_bins, hist2d_range: GradHist2d bins of the (θ, gᵢ) axes and their (lo, hi)
            ranges; default 40 on (−1, 1) for θ, 50 on (−2, 2) for gᵢ.
        names: the recorded names of the model's modules and parameters (`scope.watch`
            passes its own): per-layer values' layers and warnings' locations carry them.
            Default: `model.named_parameters()` / `named_modules()` names as they are.
        reducer: in a distributed run (`Reducer.create`), every value is over the global
            batch (all ranks' micro-batches of the step; see `global_batch`), and each
            rank also gets its own Loss, GradNorm and BatchSize as `local=True` values.
            Every rank must then instrument the same steps. None: this process's batch.

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
        max_ev_every: int | None = None,
        hist2d_per_layer: bool = False,
        hist2d_bins: tuple[int, int] = HIST2D_BINS,
        hist2d_range: tuple[tuple[float, float], tuple[float, float]] = HIST2D_RANGE,
        names: ModelNames | None = None,
        reducer: Reducer | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # FSDP2: shard-wise sums (sharded.py); other sharding is refused
        self._sharded = fsdp2_model(model, reducer, "deepscope's instruments")
        self.quantities = resolve_quantities(quantities)
        uncomputed = [q for q in self.quantities if q not in COMPUTE]
        if uncomputed:
            raise ValueError(f"quantity {uncomputed[0]} has no compute function; register one "
                             "with deepscope.instruments.suite.computes")
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
        if reducer is not None and not isinstance(reducer, Reducer):
            raise TypeError("reducer must be a deepscope.distributed.Reducer (Reducer.create()) "
                            f"or None, got {type(reducer).__name__}")
        self.reducer = reducer
        # the curvature partial sums' shapes by due curvature quantities (see global_batch)
        self._partials_layouts: dict[frozenset[str], dict[str, tuple[int, ...]]] = {}
        self._histograms = HistogramSettings.from_arguments(
            hist_bins, hist_range, hist2d_bins, hist2d_range, hist2d_per_layer)
        self.hist_bins = hist_bins
        self.hist2d_per_layer = self._histograms.per_layer_2d
        if max_ev_every is None:
            max_ev_every = (MAX_EV_EVERY.get(quantities.lower(), 1)
                            if isinstance(quantities, str) else 1)
        for label, value, least in (("seed", seed, 0), ("lanczos_iter", lanczos_iter, 1),
                                    ("hutchinson_samples", hutchinson_samples, 1),
                                    ("max_ev_every", max_ev_every, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{label} must be an int >= {least}, got {value!r}")
        self.seed = seed
        self.curvature = check_curvature_mode(curvature)
        self.hutchinson_samples = hutchinson_samples
        self.lanczos_iter = lanczos_iter
        self.max_ev_every = max_ev_every
        self._max_ev_picked = 0  # steps HessMaxEV's schedule picked so far (its cadence)
        self._curvature = CurvatureRunner(
            self.curvature, hutchinson_samples, lanczos_iter, seed,
            warn=lambda message: self._warn(message, needing("diagonal")),
            timer=_hvp_seconds, budget=diagonal_budget, reducer=reducer)

        self.model = model
        names = names or ModelNames.of(model, root_name="<model>")
        self._params: dict[str, Tensor] = {
            names.param(n): p for n, p in model.named_parameters() if p.requires_grad
        }
        if not self._params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        self._names = list(self._params)
        self._named_trainable = names  # how `start` names the trainable parameters now
        self._engine = (PerSampleEngine(model, names=names)
                        if set(self.quantities) & needing("engine") and not self._sharded
                        else None)
        self._warnings: list[str] = []
        self._new_warnings: list[InstrumentWarning] = []  # not yet taken by take_warnings()
        self._engine_warnings_taken = 0
        self._theta0: list[Tensor] | None = None
        self._pending: AlphaStart | None = None  # α start point waiting for the next step
        self._deferred: list[QuantityValue] = []  # values known before their finish()
        self._state: StepState | None = None  # the step in progress

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
        step = self._state.step if self._state is not None else None
        self._new_warnings.append(InstrumentWarning(step, "", affected, message))

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
            affected = tuple(q for q in self.quantities if q in needing("engine"))
            for text in fresh:
                match = _ENGINE_LOCATION.fullmatch(text)
                location, message = match.groups() if match else ("", text)
                out.append(InstrumentWarning(step, location, affected, message))
        return out

    def grad_eps(self) -> float:
        """Machine epsilon of the least precise floating parameter (its gradients')."""
        return max((torch.finfo(p.dtype).eps for p in self._params.values()
                    if p.is_floating_point()), default=torch.finfo(torch.float32).eps)

    def _own_params(self) -> list[Tensor]:
        """The parameters' values on this rank, detached: FSDP2's local shards."""
        params = list(self._params.values())
        return local_shards(params) if self._sharded else [p.detach() for p in params]

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
        if self._state is not None:
            self._warn(f"start({step}) came before finish() of step {self._state.step}; "
                       "that step was dropped")
            self.abort()
        started_at = (time.perf_counter(), time.thread_time())
        due = self._due_at(step, kind)
        if "HessMaxEV" in due:  # its cadence: the first step picked, then every k-th
            self._max_ev_picked += 1
            if (self._max_ev_picked - 1) % self.max_ev_every:
                due -= {"HessMaxEV"}
        alpha_end, self._pending = self._pending, None
        changed = self._changed_parameter()
        if changed is not None:  # captures, θ₀ and the update are of other parameters
            self._state = state = StepState(step, due, None, started_at)
            state.refused = PARAMETERS_CHANGED.format(name=changed)
            if alpha_end is not None:
                self._deferred.append(missing("Alpha", alpha_end.step, state.refused))
            return
        self._state = state = StepState(step, due, alpha_end, started_at)
        params = self._own_params()
        with torch.no_grad():
            if self._theta0 is None and "Distance" in self.quantities:
                self._theta0 = [p.detach().clone() for p in params]
                state.theta0_here = True
            if due & needing("snapshot"):
                state.theta = [p.detach().clone() for p in params]
            if "Distance" in due:
                diffs = [p - p0 for p, p0 in zip(params, self._theta0)]
                state.distance = (shard_squares(diffs, list(self._params.values()))
                                  if self._sharded else layer_norms(diffs))
        if not self._sharded:  # (a forward's in-place edits: see _forward_edits)
            state.versions = [p._version for p in params]
        if self._engine is not None and (due & needing("engine") or alpha_end):
            self._engine.start()
            state.engine_on = True

    def _warn_if_ignored(self, per_sample: Tensor, k: int) -> None:
        """A loss that is the sum of per_sample over exactly its k non-zero values is a mean
        over valid targets (cross_entropy's ignore_index): the ignored samples still count
        as samples (see IGNORED_SAMPLES)."""
        n = per_sample.numel()
        if int((per_sample.detach() == 0).sum()) == n - k > 0:
            self._warn(IGNORED_SAMPLES.format(k=k, n=n, rows=per_sample.shape[0]),
                       frozenset(self.quantities) & needing("engine"))

    def _changed_parameter(self) -> str | None:
        """The name of a parameter frozen, unfrozen, added or replaced since the model was
        watched (its trainable parameters are the instruments' for the whole run), or None."""
        now = {self._named_trainable.param(n): p for n, p in self.model.named_parameters()
               if p.requires_grad}
        for name in [*self._params, *now]:
            if now.get(name) is not self._params.get(name):
                return name
        return None

    def loss(self, loss: Tensor, per_sample: Tensor | None, name: str = "loss") -> None:
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
            name: the loss's name (rec.loss's): the calls of one step are micro-batches of
                one loss only under one name; a second name (a GAN's D and G losses) makes
                every quantity of the step missing with the reason.

        Raises:
            RuntimeError: outside start() / finish().
            TypeError / ValueError: bad input, in one line (e.g. a missing per_sample=).
        """
        state = self._state
        if state is None:
            raise RuntimeError("loss() called outside a step; call start(step, kind) first")
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError("loss must be a scalar floating-point tensor (the reduced loss)")
        if state.loss_name is not None and name != state.loss_name and state.refused is None:
            state.refused = SEVERAL_LOSSES.format(first=state.loss_name, second=name)
        state.loss_name = name
        if state.refused is not None:
            return
        self._forward_edits(state)
        per_sample_needed = needing("engine") | needing("hessian")
        needs = state.due & per_sample_needed | ({"Alpha"} if state.alpha_end else set())
        state.calls += 1
        if per_sample is None:
            if needs:
                raise ValueError(
                    f"{', '.join(sorted(needs))} need the per-sample losses: pass per_sample= "
                    "(reduction='none'), e.g. rec.loss(losses.mean(), per_sample=losses)"
                )
            state.take_loss(loss)
            return
        if not isinstance(per_sample, Tensor) or per_sample.dim() < 1 or per_sample.numel() == 0:
            raise TypeError("per_sample must be a non-empty tensor of per-sample losses (B, ...)")
        losses, scale, kind = reduce_loss(loss, per_sample)
        if kind == "sum" and scale >= 2:
            self._warn_if_ignored(per_sample, int(scale))
        reduction = "sum" if kind == "sum" and losses.shape[0] > 1 else "mean"
        before = state.take_losses(losses, reduction)
        if state.engine_on:
            # ∂loss/∂(one element of per_sample): a mean also averages each sample's parts
            unit = 1 / (scale * per_sample[0].numel()) if kind == "mean" else 1 / scale
            self._engine.add_loss(loss, scale, per_sample, unit)
        if state.due & needing("hessian") and not self._sharded:
            forward_s = state.forward_seconds(loss.device)  # (reduce_loss waited for it)
            # H of the micro-batch's mean loss = loss · scale / B, whatever the reduction
            previous, batch = state.curvature, losses.shape[0]
            mean_loss = loss if scale == batch else loss * (scale / batch)
            state.curvature, failed = self._curvature.run(
                mean_loss, list(self._params.values()), state.due, state.step, forward_s,
                batch_size=batch)
            state.failed.update(failed)
            state.unreached += [(p, grad_state(p)) for p in self._curvature.unreached]
            if before:
                state.curvature, failed = self._curvature.merge(
                    previous, state.curvature, before, batch, state.due)
                state.failed.update(failed)

    def _forward_edits(self, state: StepState) -> None:
        """θₜ is where the step's loss was evaluated. A parameter that the forward changed in
        place since θₜ was read (nn.Embedding(max_norm=...) renormalises the rows it reads)
        is read again at the first micro-batch (θₜ, θ₀ at the first step, Distance); the
        previous step's α, whose end point is then off its update line, and, when a later
        micro-batch changes it again, this step's α (its samples saw different θ) are
        missing with the reason."""
        if state.versions is None:
            return
        params = self._own_params()
        versions = [p._version for p in params]
        changed = [k for k, (p, v) in enumerate(zip(params, versions))
                   if v != state.versions[k]
                   and (state.theta is None or not torch.equal(p, state.theta[k]))]
        state.versions = versions
        if not changed:
            return
        reason = FORWARD_EDIT.format(name=self._names[changed[0]])
        if state.alpha_end is not None:
            self._deferred.append(missing("Alpha", state.alpha_end.step,
                                          f"{reason} at the next step: α's end point is off "
                                          "the update line"))
            state.alpha_end = None
        if state.calls:
            if "Alpha" in state.due:
                state.failed["Alpha"] = (f"{reason} between micro-batches: the step's samples "
                                         "saw different parameters")
            return
        with torch.no_grad():
            for k in changed:
                if state.theta is not None:
                    state.theta[k] = params[k].clone()
                if state.theta0_here:
                    self._theta0[k] = params[k].clone()
            if state.distance is not None:
                state.distance = layer_norms([p - p0 for p, p0 in zip(params, self._theta0)])

    def finish(self) -> list[QuantityValue]:
        """Compute every due quantity after the user's backward and optimiser step.

        Returns the values of this step, α of the previous step (under its step), and
        anything deferred (e.g. an α whose end step never came); in a distributed run the
        values of the global batch on every rank, then this rank's own (`local=True`: Loss,
        BatchSize, GradNorm). Never raises.
        """
        values, self._deferred = self._deferred, []
        state = self._state
        if state is None:
            return values
        try:
            if state.engine_on:
                self._engine.stop()
            if state.refused is not None:
                values.extend(missing(q, state.step, state.refused) for q in sorted(state.due))
                if state.alpha_end is not None:
                    values.append(missing("Alpha", state.alpha_end.step, state.refused))
                return values
            values.extend(_explain_nonfinite(self._compute(state), state))
        except Exception as error:  # recording must never break training
            reason = describe(error)
            values.extend(QuantityValue(q, state.step, meta={"reason": reason})
                          for q in sorted(state.due))
        finally:
            if state.engine_on:
                self._engine.clear()
            self._state = None
        return values

    def abort(self) -> None:
        """The user's step raised: drop its captures and hooks (its α start is lost too)."""
        state, self._state = self._state, None
        if state is None:
            return
        if state.alpha_end is not None:
            self._deferred.append(missing(
                "Alpha", state.alpha_end.step, "the next step, α's end point, failed"))
        if state.engine_on:
            self._engine.stop()
            self._engine.clear()

    def close(self) -> None:
        """Drop everything (an α still waiting for its end point is not reported)."""
        self.abort()
        self._pending = None
        self._deferred = []
        self._theta0 = None

    # -- computing --------------------------------------------------------------------------
    def _compute(self, state: StepState) -> list[QuantityValue]:
        due, step = state.due, state.step
        out: list[QuantityValue] = []
        update: list[Tensor] | None = None
        if state.theta is not None:
            with torch.no_grad():
                if due & needing("snapshot") - {"Alpha", "UpdateSize"}:  # θₜ read later
                    update = [p - t for p, t in zip(self._own_params(), state.theta)]
                else:  # only dₜ = θₜ₊₁ − θₜ is read: made in θₜ's place
                    update = [torch.sub(p, t, out=t)
                              for p, t in zip(self._own_params(), state.theta)]
                    state.theta = None

        batch: Batch | None = None
        batch_error = NO_LOSS
        if state.engine_on and state.losses is not None:
            try:
                batch = Batch(self._engine)
            except Exception as error:
                batch_error = describe(error)
        if update is not None and not self._sharded:
            state.update_sizes = layer_norms(update)
        if batch is not None and self.reducer is None:
            counters = sweep_counters(self._histograms, due, self._names, state.theta)
            if counters is not None:  # counted while the statistics materialise gᵢ: no
                self._engine.count_in_sweeps(counters)  # second pass, none kept for one
            # a failure here is reported by each quantity that needs the products
            with contextlib.suppress(Exception):
                self._want_dots(state, batch, update)

        hidden = [p for p, before in state.unreached if grad_state(p) != before]
        if hidden:  # the curvature, computed before backward, did not see these
            name = next(n for n, p in self._params.items() if p is hidden[0])
            state.failed.update(dict.fromkeys(due & needing("hessian"),
                                              HIDDEN_FROM_CURVATURE.format(name=name)))
        loss_free = frozenset(self.quantities) - needing("loss")
        if state.loss is None and due - loss_free:
            self._warn(NO_LOSS_WARNING, frozenset(self.quantities) - loss_free)
        distributed = self.reducer is not None
        if self._sharded:
            return out + ShardedStep(self, state, update, NO_LOSS).values()

        def attempt(name: str, compute: Callable[[], list[QuantityValue]]) -> None:
            if state.loss is None and name not in loss_free:
                out.append(missing(name, step, NO_LOSS))
                return
            if name in state.failed:
                out.append(missing(name, step, state.failed[name]))
                return
            if "engine" in spec(name).needs and batch is None:
                out.append(missing(name, step, batch_error))
                return
            try:
                out.extend(compute())
            except Exception as error:  # one failing spares the rest
                out.append(missing(name, step, describe(error)))

        if distributed:  # the global batch's values, then this rank's own
            for name in self.quantities:
                if name in due & REPLICATED:
                    attempt(name, lambda name=name: COMPUTE[name](self, name, state, batch, update))
            return out + GlobalStep(self, state, batch, batch_error, update, NO_LOSS,
                                    COMPUTE).values()

        if state.alpha_end is not None:
            start = state.alpha_end
            if batch is None:
                out.append(missing("Alpha", start.step, batch_error))
            else:
                try:
                    out.append(alpha.measure_alpha(start, state.losses, batch, step))
                except Exception as error:
                    out.append(missing("Alpha", start.step, describe(error)))

        # histograms last: the statistics' sweeps count them on the way (count_in_sweeps)
        for name in sorted(self.quantities, key=lambda q: q in HISTOGRAM_NAMES):
            if name in due:
                attempt(name, lambda name=name: COMPUTE[name](self, name, state, batch, update))
        return out

    def _want_dots(self, state: StepState, batch: Batch, update: list[Tensor] | None) -> None:
        """Register every gᵢ·v this step needs, so that they share one pass."""
        if state.due & {"InnerTest", "OrthoTest"}:
            batch.want("mean")
        starts = "Alpha" in state.due and update is not None
        alpha.want_dots(batch, state.alpha_end, dict(zip(self._names, update)) if starts else None,
                        float(state.update_sizes[-1]) if starts else 0.0)

    def _cabs(
        self, S: Tensor, N: Tensor, B: int, loss: Tensor
    ) -> tuple[Tensor, dict[str, Any]]:
        """CABS rows and meta, for the learning rate of the optimiser's groups (one)."""
        if self.optimizer is None:
            raise ValueError("CABS needs the learning rate: pass optimizer= to the instruments")
        rates = sorted({float(group["lr"]) for group in self.optimizer.param_groups})
        if len(rates) > 1:  # (a parameter group added with its own rate, mid-run too)
            raise ValueError(f"CABS assumes one learning rate; the optimiser's parameter groups "
                             f"have {len(rates)} ({', '.join(f'{r:g}' for r in rates)})")
        lr = rates[0]
        meta: dict[str, Any] = {"optimizer": type(self.optimizer).__name__, "lr": lr,
                                **self._sgd_note("CABS")}
        return cabs(S, N, B, float(loss), lr), meta

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
        self._warn(note, frozenset({name}))  # once: a Python warning, stored in the run
        return {"note": note}


def _explain_nonfinite(values: list[QuantityValue], state: StepState) -> list[QuantityValue]:
    """`values` of the step, each NaN without a reason given the reason when the step's loss
    is not finite (a step a GradScaler skips): never an unexplained NaN."""
    loss = None if state.loss is None else float(state.loss)
    if loss is None or math.isfinite(loss):
        return values
    for v in values:
        if (v.step == state.step and v.value is not None and math.isnan(v.value)
                and "reason" not in v.meta):
            v.meta = {**v.meta, "reason": NONFINITE_LOSS.format(loss=loss)}
    return values


@computes("Loss")
def _loss(inst: Instruments, name: str, state: StepState, batch: Batch | None,
               update: list[Tensor] | None) -> list[QuantityValue]:
    meta: dict[str, Any] = {"reduction": state.reduction}
    if len(state.counts) > 1:
        meta["micro_batches"] = len(state.counts)
    return [QuantityValue(name, state.step, value=float(state.loss), meta=meta)]


@computes("Distance")
def _distance(inst: Instruments, name: str, state: StepState, batch: Batch | None,
              update: list[Tensor] | None) -> list[QuantityValue]:
    return rows(name, state.step, inst._names, state.distance)


@computes("UpdateSize")
def _update_size(inst: Instruments, name: str, state: StepState, batch: Batch | None,
                 update: list[Tensor] | None) -> list[QuantityValue]:
    return rows(name, state.step, inst._names, state.update_sizes)


@computes("HessMaxEV")
def _hess_max_ev(inst: Instruments, name: str, state: StepState, batch: Batch | None,
                 update: list[Tensor] | None) -> list[QuantityValue]:
    value, meta = state.curvature["max_ev"]
    if inst.max_ev_every > 1:
        meta = {**meta, "every": inst.max_ev_every}
    return [QuantityValue(name, state.step, value=value, meta=meta)]


@computes("HessTrace")
def _hess_trace(inst: Instruments, name: str, state: StepState, batch: Batch | None,
                update: list[Tensor] | None) -> list[QuantityValue]:
    return rows(name, state.step, inst._names, state.curvature["traces"],
                state.curvature["diagonal_meta"])


@computes("Alpha")
def _alpha(inst: Instruments, name: str, state: StepState, batch: Batch | None,
           update: list[Tensor] | None) -> list[QuantityValue]:
    """α's start point: measured now, its value comes at the next instrumented step."""
    start = alpha.measure_start(state.step, state.losses, batch,
                                dict(zip(inst._names, update)), float(state.update_sizes[-1]))
    if isinstance(start, QuantityValue):
        return [start]
    inst._pending = start
    return []


@computes(*HISTOGRAM_NAMES)
def _histogram(inst: Instruments, name: str, state: StepState, batch: Batch | None,
               update: list[Tensor] | None) -> list[QuantityValue]:
    if state.hist_results is None:
        state.hist_results = histogram_pass(inst._histograms, batch, state.due, inst._names,
                                            state.theta)
    return histogram_values(name, state.step, inst._histograms, state.hist_results,
                            batch.unavailable())


def _engine_rows(inst: Instruments, name: str, state: StepState, batch: Batch, value: Tensor,
                 meta: dict[str, Any] | None = None, undefined: Tensor | None = None,
                 reason: str = "") -> list[QuantityValue]:
    """Rows of a quantity from per-sample gradient statistics, per layer and in total; the
    parameters without usable per-sample gradients are read after computing `value` (the
    engine finds them then)."""
    return rows(name, state.step, inst._names, value, meta or {}, undefined, reason,
                dict(batch.unavailable()))


def _batch_size(name: str, batch: Batch, least: int = 2) -> int:
    if batch.size < least:
        raise ValueError(f"{name} needs a batch of at least {least} samples, got {batch.size}")
    return batch.size


@computes("GradNorm")
def _grad_norm(inst: Instruments, name: str, state: StepState, batch: Batch | None,
               update: list[Tensor] | None) -> list[QuantityValue]:
    value = with_total(batch.grad_sq_norms).sqrt()
    # ḡ needs no per-sample gradients: only parameters whose delivered gradient is unusable
    return rows(name, state.step, inst._names, value, {}, None, "",
                batch.unavailable_sum())


# The gradient tests from (the statistics, N = ‖ḡ‖² per layer and total, B)
_TESTS: dict[str, Callable[[Batch, Tensor, int], Tensor]] = {
    "NormTest": lambda b, N, B: norm_test(with_total(b.sq_norm_sums), N, B),
    "InnerTest": lambda b, N, B: inner_test(with_total(b.dots_with_mean), N, B),
    "OrthoTest": lambda b, N, B: ortho_test(with_total(b.sq_norm_sums),
                                            with_total(b.dots_with_mean), N, B),
}


@computes(*_TESTS)
def _gradient_test(inst: Instruments, name: str, state: StepState, batch: Batch | None,
                   update: list[Tensor] | None) -> list[QuantityValue]:
    B, N = _batch_size(name, batch), with_total(batch.grad_sq_norms)
    undefined = zero_mean(N, with_total(batch.sq_norm_sums), B, inst.grad_eps())
    return _engine_rows(inst, name, state, batch, _TESTS[name](batch, N, B),
                        undefined=undefined, reason=ZERO_MEAN)


@computes("MeanGSNR")
def _mean_gsnr(inst: Instruments, name: str, state: StepState, batch: Batch | None,
               update: list[Tensor] | None) -> list[QuantityValue]:
    value = mean_gsnr(batch.grad_mean, batch.second_moment_sums, batch.size)
    return _engine_rows(inst, name, state, batch, value)


@computes("EarlyStopping")
def _early_stopping(inst: Instruments, name: str, state: StepState, batch: Batch | None,
                    update: list[Tensor] | None) -> list[QuantityValue]:
    B = _batch_size(name, batch)
    value = early_stopping(batch.grad_mean, batch.second_moment_sums, B)
    return _engine_rows(inst, name, state, batch, value, inst._sgd_note(name))


@computes("CABS")
def _cabs_rows(inst: Instruments, name: str, state: StepState, batch: Batch | None,
               update: list[Tensor] | None) -> list[QuantityValue]:
    B, N = _batch_size(name, batch), with_total(batch.grad_sq_norms)
    value, meta = inst._cabs(with_total(batch.sq_norm_sums), N, B, state.loss)
    if state.loss == 0:
        undefined, reason = torch.ones_like(N, dtype=torch.bool), "the loss is zero"
    else:
        undefined, reason = N == 0, ZERO_MEAN
    return _engine_rows(inst, name, state, batch, value, meta, undefined, reason)


@computes("TICDiag", "TICTrace")
def _tic(inst: Instruments, name: str, state: StepState, batch: Batch | None,
         update: list[Tensor] | None) -> list[QuantityValue]:
    if "diagonal" not in state.curvature:
        raise RuntimeError("the Hessian diagonal was not computed at this step")
    moments = [m / batch.size for m in batch.second_moment_sums]
    value = (tic_diag(moments, state.curvature["diagonal"]) if name == "TICDiag"
             else tic_trace(moments, state.curvature["traces"]))
    return _engine_rows(inst, name, state, batch, value, state.curvature["diagonal_meta"])
