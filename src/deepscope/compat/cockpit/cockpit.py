"""`Cockpit`: Cockpit's tracking API over a deepscope `Scope`.

Cockpit's context wraps only the backward pass, after the forward and the loss; deepscope's
instruments must see the forward (to capture layer inputs for per-sample gradients) and
finish after the optimiser step (the update taken). So the Cockpit object runs a scope step
that is longer than its context:

    opt.zero_grad()
    outputs = model(inputs)          # forward pre-hook: opens scope step t (predicted t)
    loss = ...; losses = ...
    with cockpit(t, info={...}):     # rec.loss(loss, per_sample=losses), curvature
        loss.backward()
    opt.step()                       # optimizer post-hook: closes step t, values stored
                                     # and handed to the quantities' get_output()

The step number is predicted (last global_step + 1, starting at 0) because Cockpit gives it
only after the forward. A wrong prediction costs that step the quantities that need the
forward; the step is still recorded, and a warning says how to number steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ... import catalogue
from ...hookstate import hooks_paused
from ...instruments.base import TOTAL, QuantityValue
from ...instruments.suite import is_plain_sgd
from ...naming import ModelNames
from ...query.histogram import Histogram
from ...recorder.schedule import never
from ...recorder.scope import Scope
from ...recorder.step import StepRecorder
from ..backpack import extended_modules
from . import quantities as quantities_module
from .quantities import Quantity

log = logging.getLogger("deepscope")

# Cockpit reports these per parameter tensor (a list in `params` order), the rest in total.
PER_PARAMETER = catalogue.cockpit_per_parameter()
HISTOGRAMS = frozenset(catalogue.histograms())
SGD_ONLY = frozenset({"CABS", "EarlyStopping"})  # Cockpit refuses other optimisers
LOG_KPIS = ("train_loss", "valid_loss", "test_loss", "train_accuracy", "valid_accuracy",
            "test_accuracy", "learning_rate")


class _AnyOf:
    """A deepscope schedule (step, kind) -> bool from Cockpit schedules global_step -> bool
    (several instances of one quantity: computed when any of them is due)."""

    def __init__(self, schedules: list[Callable[[int], bool]]) -> None:
        self.schedules = schedules

    def __call__(self, step: int, kind: str) -> bool:
        return any(s(step) for s in self.schedules)


class Cockpit:
    """Cockpit's tracker. Values are computed by deepscope and stored as a deepscope run.

    Args:
        params: the parameters to track, e.g. `model.parameters()`; their model is found
            among the modules passed to `extend` (or pass `model=`).
        quantities: Cockpit quantities (instances, classes, or names such as "GradNorm"),
            e.g. `configuration("full")`. Default none.
        model: the model owning `params` (deepscope extension; default: found via `extend`).
        path: project folder of the run (default: a new temporary folder).
        run: run name (default "cockpit").
        overwrite: replace an existing run of that name.
        seed: base seed of the curvature estimators.

    Raises:
        ValueError: a parameter without requires_grad, or no extended model owns `params`.
    """

    def __init__(self, params: Iterable[torch.Tensor], quantities: Iterable[Any] | None = None,
                 *, model: nn.Module | None = None, path: str | Path | None = None,
                 run: str = "cockpit", overwrite: bool = False, seed: int = 0) -> None:
        self.params = list(params)
        for p in self.params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"Cockpit(params, ...) needs tensors such as model.parameters(), "
                                f"got {type(p).__name__}")
            if not p.requires_grad:
                raise ValueError(f"Got parameter with requires_grad=False (shape "
                                 f"{tuple(p.shape)}); pass only trainable parameters")
        self.model = model if model is not None else _owning_model(self.params)
        self._names = _parameter_names(self.model, self.params)
        self._scope: Scope | None = None
        self.quantities: list[Quantity] = []
        self._options: dict[str, Any] = {}  # Instruments settings the quantities ask for
        for q in quantities or []:
            self.add(q)
        self.output: defaultdict[int, dict[str, Any]] = defaultdict(dict)
        self._path = Path(path) if path is not None else Path(
            tempfile.mkdtemp(prefix="deepscope-cockpit-"))
        self._run, self._overwrite, self._seed = run, overwrite, seed
        self._rec: StepRecorder | None = None
        self._exited = False  # the open step's backward is done; it waits for opt.step()
        self._next_step = 0
        self._busy = False  # our own calls into the scope must not re-trigger our hooks
        self._optimizers: set[int] = set()
        self._optimizer: torch.optim.Optimizer | None = None  # info["optimizer"] of the step
        self._updates: dict[int, Any] = {}  # UpdateSize of step t, shown once t + 1 is tracked
        self._warned: set[str] = set()
        self._handles = [self.model.register_forward_pre_hook(self._on_forward)]

    # -- Cockpit's API ---------------------------------------------------------------------
    def add(self, quantity: Any) -> None:
        """Track one more quantity (instance, class or name); only before the first step."""
        if self._scope is not None:
            raise ValueError("Cockpit.add(...) after tracking started; pass every quantity to "
                             "Cockpit(params, quantities=[...])")
        if isinstance(quantity, str):
            quantity = quantities_module.by_name(quantity)
        if isinstance(quantity, type) and issubclass(quantity, Quantity):
            quantity = quantity()
        if not isinstance(quantity, Quantity) or type(quantity) is Quantity:
            raise ValueError(f"Added quantities must be instances of Quantity. Got {quantity!r}")
        options = quantity.instrument_options()
        for key, value in options.items():
            if self._options.get(key, value) != value:
                raise ValueError(f"two {quantity.name} quantities with different bins or range "
                                 f"({key}: {self._options[key]!r} and {value!r}); deepscope "
                                 f"stores one {quantity.name} per step: give them the same")
        self._options.update(options)
        self.quantities.append(quantity)

    def create_graph(self, global_step: int) -> bool:
        """Always False: deepscope never needs `backward(create_graph=True)`."""
        return False

    @contextlib.contextmanager
    def __call__(self, global_step: int, *exts: Any, info: dict[str, Any] | None = None,
                 debug: bool = False) -> Iterator[None]:
        """Context around `loss.backward()` for step `global_step`.

        info: "loss" (the loss you backpropagate), "individual_losses" (per sample,
        reduction="none"), "optimizer" (its step() ends the step; its learning rate is
        logged as the KPI "learning_rate"), "batch_size" (unused).
        BackPACK extensions in `exts` are not computed (deepscope needs none).
        """
        if isinstance(global_step, bool) or not isinstance(global_step, int):
            raise TypeError(f"global_step must be an int, got {type(global_step).__name__}")
        if info is not None and not isinstance(info, dict):
            raise TypeError(f"info must be a dict, got {type(info).__name__}")
        if exts:
            self._warn_once("exts", "deepscope: BackPACK extensions passed to cockpit(...) are "
                                    "not computed; deepscope computes its quantities itself")
        with self._own_calls():
            rec = self._begin(global_step)
            self._next_step = global_step + 1
            try:
                self._take_info(rec, info or {})
            except BaseException:
                self._end_step(discard=True)
                raise
        try:
            yield
        except BaseException:
            with self._own_calls():
                self._end_step(discard=True)
            raise
        self._exited = True
        with self._own_calls():
            self._track(global_step)

    def get_output(self) -> defaultdict[int, dict[str, Any]]:
        """Everything tracked so far, like Cockpit: {global_step: {quantity: value}},
        collected from the quantities' `get_output()` and the values `log()` was given.

        GradNorm, Distance, UpdateSize and HessTrace are lists in `params` order; the
        histograms are {"hist": counts, "edges": edges} (2-D: gradient axis first, as
        Cockpit's); Alpha is the int -1 where Cockpit returns it; the rest are floats. A
        value that could not be computed is left out, as Cockpit does.
        """
        collected: dict[int, dict[str, Any]] = {}
        for q in self.quantities:
            for step, value in q.get_output().items():
                collected.setdefault(step, {})[q.name] = value
        for step, logged in self.output.items():
            collected.setdefault(step, {}).update(logged)
        return defaultdict(dict, sorted(collected.items()))  # steps ascending

    def log(self, global_step: int, epoch_count: int, train_loss: float, valid_loss: float,
            test_loss: float, train_accuracy: float, valid_accuracy: float,
            test_accuracy: float, learning_rate: float) -> None:
        """Store per-epoch metrics; they also become KPIs of the run (the dashboard shows
        them in its performance and hyperparameter panels)."""
        values = {"epoch_count": epoch_count, "train_loss": train_loss,
                  "valid_loss": valid_loss, "test_loss": test_loss,
                  "train_accuracy": train_accuracy, "valid_accuracy": valid_accuracy,
                  "test_accuracy": test_accuracy, "learning_rate": learning_rate}
        self.output[global_step].update(values)
        rows = [(name, global_step, "default", float(values[name])) for name in LOG_KPIS
                if isinstance(values[name], numbers.Real) and not isinstance(values[name], bool)]
        self._ensure_scope().writer.submit_kpis(rows)

    def write(self, logpath: str | Path) -> None:
        """Write `get_output()` as JSON to `logpath` + ".json" (folders are created)."""
        target = Path(f"{logpath}.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w") as f:
            json.dump(_jsonable(self.get_output()), f, indent=4, sort_keys=True)

    # -- deepscope additions ---------------------------------------------------------------
    @property
    def run_path(self) -> Path:
        """The deepscope run folder the values are stored in (`deepscope serve` its parent)."""
        return self._path / self._run

    def flush(self) -> None:
        """Commit everything computed so far, so that readers (plots, GUI) see it."""
        self._ensure_scope().flush()

    def close(self) -> None:
        """Finish the last step, remove the hooks and close the run. Idempotent."""
        with self._own_calls():
            if self._rec is not None:
                # a step whose backward is done has normally been stepped by the optimiser
                self._end_step(discard=not self._exited)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scope is not None:
            self._scope.close()

    # -- the scope step behind the context ---------------------------------------------------
    @contextlib.contextmanager
    def _own_calls(self) -> Iterator[None]:
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def _ensure_scope(self) -> Scope:
        if self._scope is None:
            instrumented = [q for q in self.quantities if q.instrument]
            schedules: dict[str, list[Callable[[int], bool]]] = {}
            for q in instrumented:
                schedules.setdefault(q.name, []).append(q.should_compute)
            self._scope = Scope(
                self._path, self._run, schedule=never, instruments=sorted(schedules) or None,
                instrument_schedule=never, anomalies=False, overwrite=self._overwrite,
                quantity_schedules={n: _AnyOf(s) for n, s in schedules.items()} or None,
                instrument_options=self._options or None, seed=self._seed)
            self._scope.watch(self.model)
            instruments = self._scope.instruments
            if instruments is not None:  # each step's values reach the quantities at once
                instruments.finish = self._handing_over(instruments.finish)
            log.info("deepscope: Cockpit values are stored in %s", self.run_path)
        return self._scope

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        """Open the next step before the forward that starts it."""
        if (self._busy or not torch.is_grad_enabled() or hooks_paused()
                or (self._rec is not None and not self._exited)):
            return  # our own passes, evaluation, or another forward of the open step
        with self._own_calls():
            if self._rec is not None:  # no optimizer step was seen: the forward ends the step
                self._end_step()
            try:
                self._open_step(self._next_step)
            except ValueError as error:  # never break the user's forward; cockpit(...) reports
                self._warn_once("open", f"deepscope: step {self._next_step} not opened: {error}")

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                           kwargs: Any) -> None:
        """Close the step once its update is taken (UpdateSize and α need θₜ₊₁)."""
        if self._rec is not None and self._exited and not self._busy:
            with self._own_calls():
                self._end_step()

    def _open_step(self, step: int) -> StepRecorder:
        rec = self._ensure_scope().begin_step(step)
        self._rec, self._exited = rec, False
        return rec

    def _end_step(self, discard: bool = False) -> None:
        """Close the open step: store its values, or (discard: it failed) drop them."""
        rec, self._rec, self._exited = self._rec, None, False
        if rec is not None:
            self._ensure_scope().end_step(discard=discard)

    def _begin(self, global_step: int) -> StepRecorder:
        """The scope step for `global_step`: the one opened by the forward, or a late one."""
        if self._rec is not None and self._exited:
            self._end_step()  # the previous step saw no optimizer step nor forward
        rec = self._rec
        if rec is not None and rec.step == global_step:
            return rec
        expected = rec.step if rec is not None else self._next_step
        self._end_step(discard=True)  # its number turned out wrong
        self._warn_once("late", f"deepscope: cockpit({global_step}, ...) came after a forward "
                                f"pass recorded as step {expected}; quantities that need the "
                                "forward pass (per-sample gradients) are missing for this step. "
                                "Count global_step up by one per step, starting at 0.")
        return self._open_step(global_step)

    def _take_info(self, rec: StepRecorder, info: dict[str, Any]) -> None:
        optimizer = self._optimizer = info.get("optimizer")
        if isinstance(optimizer, torch.optim.Optimizer):
            if id(optimizer) not in self._optimizers:
                self._optimizers.add(id(optimizer))
                self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))
            instruments = self._ensure_scope().instruments
            if instruments is not None:
                instruments.optimizer = optimizer  # CABS reads its learning rate
            # the dashboard's hyperparameter panel (Cockpit shows it only after log())
            rec.kpi("learning_rate", float(optimizer.param_groups[0]["lr"]))
        loss = info.get("loss")
        if loss is None:
            self._warn_once("loss", "deepscope: info has no 'loss'; pass info={'loss': loss, "
                                    "'individual_losses': losses, ...} to compute the quantities")
            return
        rec.loss(loss, per_sample=info.get("individual_losses"))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)

    # -- the values, as Cockpit's quantities hold them -----------------------------------------
    def _track(self, global_step: int) -> None:
        """What Cockpit does when the context exits: refuse CABS / EarlyStopping for an
        optimiser other than plain SGD, show the previous step's UpdateSize, take `Time`
        and `Parameters`."""
        due = [q for q in self.quantities if q.should_compute(global_step)]
        refused = sorted({q.name for q in due if q.name in SGD_ONLY})
        if refused and (self._optimizer is None or not is_plain_sgd(self._optimizer)):
            self._end_step(ValueError)  # the step is dropped, as after a failed backward
            got = ("no info['optimizer']" if self._optimizer is None
                   else type(self._optimizer).__name__)
            raise ValueError(f"{', '.join(refused)} only supports zero-momentum SGD, as in "
                             f"Cockpit; got {got}: pass info={{'optimizer': opt, ...}} with "
                             "torch.optim.SGD without momentum, weight decay or Nesterov, or "
                             "do not track it")
        for step in sorted(self._updates):
            if step < global_step:  # Cockpit shows step t's update when step t + 1 is tracked
                value = self._updates.pop(step)
                if step == global_step - 1:
                    self._deliver(step, "UpdateSize", value)
        for q in due:
            if not q.instrument:
                q.output[global_step] = q.take(self.params)

    def _handing_over(self, finish: Callable[[], list[QuantityValue]]
                      ) -> Callable[[], list[QuantityValue]]:
        """`Instruments.finish`, also handing its values to the quantities."""
        def finish_and_hand_over() -> list[QuantityValue]:
            values = finish()
            try:
                self._take_values(values)
            except Exception as error:  # the values are still stored in the run
                self._warn_once("take", f"deepscope: Cockpit values not shown by get_output(): "
                                        f"{type(error).__name__}: {error}")
            return values
        return finish_and_hand_over

    def _take_values(self, values: list[QuantityValue]) -> None:
        rows: dict[tuple[int, str], dict[str, QuantityValue]] = {}
        for v in values:
            rows.setdefault((v.step, v.name), {})[v.layer] = v
        for (step, name), layers in rows.items():
            total = layers.get(TOTAL)
            if total is None or "reason" in total.meta:
                continue  # a value that could not be computed is left out, as Cockpit does
            value = self._cockpit_value(name, total, layers)
            if name == "UpdateSize":
                self._updates[step] = value
            else:
                self._deliver(step, name, value)

    def _cockpit_value(self, name: str, total: QuantityValue,
                       layers: dict[str, QuantityValue]) -> Any:
        """One quantity's value at one step in Cockpit's format."""
        if name in HISTOGRAMS:
            value = _cockpit_histogram(name, total)
            if name == "GradHist2d" and self._options.get("hist2d_per_layer"):
                value["param_groups"] = len(self._names)
                for idx, layer in enumerate(self._names):
                    if layer in layers and layers[layer].array is not None:
                        value[f"param_{idx}"] = _cockpit_histogram(name, layers[layer])
            return value
        if name in PER_PARAMETER:
            return [float(layers[n].value) if n in layers and layers[n].value is not None
                    else np.nan for n in self._names]
        mu = total.meta.get("mu")
        if name == "Alpha" and (total.meta.get("tau") == 0 or (mu and mu[2] < 0)):
            return -1  # Cockpit's int for a concave fit or no step
        return float(total.value)

    def _deliver(self, step: int, name: str, value: Any) -> None:
        """Give `value` to each quantity `name` whose schedule has `step`."""
        for q in self.quantities:
            if q.name == name and q.should_compute(step):
                q.output[step] = value


def _owning_model(params: list[torch.Tensor]) -> nn.Module:
    """The most recently extended module that owns every parameter in `params`."""
    wanted = {id(p) for p in params}
    for module in extended_modules():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError("Cockpit(params, ...) cannot find the model owning these parameters; wrap "
                     "the model with extend(model) (from deepscope.compat.backpack import extend) "
                     "before creating the Cockpit, or pass model=")


def _parameter_names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    """Recorded names of `params` in `model` (the layers of deepscope's per-layer values:
    those `scope.watch(model)` records)."""
    recorded = ModelNames.of(model)
    names = {id(p): recorded.param(n) for n, p in model.named_parameters()}
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"parameters of shapes {missing} are not in the model given; pass "
                         "model.parameters() of that model")
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if len({id(p) for p in params}) < trainable:
        warnings.warn("deepscope: Cockpit was given some of the model's trainable parameters; "
                      "whole-model values cover all of them", stacklevel=3)
    return [names[id(p)] for p in params]


def _cockpit_histogram(name: str, value: QuantityValue) -> dict[str, Any]:
    """Cockpit's {"hist", "edges"}: out-of-range and infinite values are counted in the
    edge bins, as Cockpit clamps them (NaN: not counted); 2-D: (gradient, parameter)
    axes."""
    hist = Histogram.decode(name, value.step, value.layer, np.array(value.array), value.meta)
    counts, meta = hist.counts, hist.meta
    if name == "GradHist1d":
        counts[0] += meta.get("underflow", 0) + meta.get("neginf", 0)
        counts[-1] += meta.get("overflow", 0) + meta.get("posinf", 0)
        return {"hist": counts, "edges": hist.edges[0]}
    for j, i, n in meta.get("clamped", []):  # outside pairs, where Cockpit counts them
        counts[j, i] += n
    param_axis, grad_axis = hist.edges
    return {"hist": counts.T.copy(), "edges": (grad_axis, param_axis)}


def _jsonable(value: Any) -> Any:
    """Arrays and tuples as lists, recursively (Cockpit writes them with json_tricks)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
