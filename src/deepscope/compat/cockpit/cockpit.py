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

from ...hookstate import hooks_paused
from ...query import open_run
from ...recorder.schedule import never
from ...recorder.scope import Scope
from ...recorder.step import StepRecorder
from ..backpack import extended_modules
from . import quantities as quantities_module
from .quantities import Quantity

log = logging.getLogger("deepscope")

# Cockpit reports these per parameter tensor (a list in `params` order), the rest in total.
PER_PARAMETER = frozenset({"GradNorm", "Distance", "UpdateSize", "HessTrace"})
HISTOGRAMS = frozenset({"GradHist1d", "GradHist2d"})
LOG_KPIS = ("train_loss", "valid_loss", "test_loss", "train_accuracy", "valid_accuracy",
            "test_accuracy", "learning_rate")


class _Skipped(Exception):
    """Ends a scope step whose number turned out wrong: nothing of it is stored."""


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
                self._end_step(_Skipped)
                raise
        try:
            yield
        except BaseException as error:
            with self._own_calls():
                self._end_step(type(error))
            raise
        self._exited = True

    def get_output(self) -> defaultdict[int, dict[str, Any]]:
        """Everything tracked so far, like Cockpit: {global_step: {quantity: value}}.

        GradNorm, Distance, UpdateSize and HessTrace are lists in `params` order; the
        histograms are {"hist": counts, "edges": edges} (2-D: edges per axis, parameter
        first); the rest are floats. Values `log()` was given are included. A value that
        could not be computed is left out, as Cockpit does.
        """
        collected: dict[int, dict[str, Any]] = {}
        for step, name, value in self._stored_values():
            collected.setdefault(step, {})[name] = value
        for step, logged in self.output.items():
            collected.setdefault(step, {}).update(logged)
        output = defaultdict(dict, sorted(collected.items()))  # steps ascending
        for q in self.quantities:
            q.output = {step: values[q.name] for step, values in output.items()
                        if q.name in values}
        return output

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
                self._end_step(None if self._exited else _Skipped)
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
            names = sorted({q.name for q in self.quantities})
            schedules: dict[str, list[Callable[[int], bool]]] = {}
            for q in self.quantities:
                schedules.setdefault(q.name, []).append(q.should_compute)
            self._scope = Scope(
                self._path, self._run, schedule=never, instruments=names or None,
                instrument_schedule=never, anomalies=False, overwrite=self._overwrite,
                quantity_schedules={n: _AnyOf(s) for n, s in schedules.items()} or None,
                seed=self._seed)
            self._scope.watch(self.model)
            log.info("deepscope: Cockpit values are stored in %s", self.run_path)
        return self._scope

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        """Open the next step before the forward that starts it."""
        if (self._busy or not torch.is_grad_enabled() or hooks_paused()
                or (self._rec is not None and not self._exited)):
            return  # our own passes, evaluation, or another forward of the open step
        with self._own_calls():
            if self._rec is not None:  # no optimizer step was seen: the forward ends the step
                self._end_step(None)
            try:
                self._open_step(self._next_step)
            except ValueError as error:  # never break the user's forward; cockpit(...) reports
                self._warn_once("open", f"deepscope: step {self._next_step} not opened: {error}")

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                           kwargs: Any) -> None:
        """Close the step once its update is taken (UpdateSize and α need θₜ₊₁)."""
        if self._rec is not None and self._exited and not self._busy:
            with self._own_calls():
                self._end_step(None)

    def _open_step(self, step: int) -> StepRecorder:
        rec = self._ensure_scope().step(step)
        rec.__enter__()
        self._rec, self._exited = rec, False
        return rec

    def _end_step(self, failure: type[BaseException] | None) -> None:
        """Close the open step: store its values, or (failure) drop them."""
        rec, self._rec, self._exited = self._rec, None, False
        if rec is not None:
            rec.__exit__(failure, None, None)

    def _begin(self, global_step: int) -> StepRecorder:
        """The scope step for `global_step`: the one opened by the forward, or a late one."""
        if self._rec is not None and self._exited:
            self._end_step(None)  # the previous step saw no optimizer step nor forward
        rec = self._rec
        if rec is not None and rec.step == global_step:
            return rec
        expected = rec.step if rec is not None else self._next_step
        self._end_step(_Skipped)
        self._warn_once("late", f"deepscope: cockpit({global_step}, ...) came after a forward "
                                f"pass recorded as step {expected}; quantities that need the "
                                "forward pass (per-sample gradients) are missing for this step. "
                                "Count global_step up by one per step, starting at 0.")
        return self._open_step(global_step)

    def _take_info(self, rec: StepRecorder, info: dict[str, Any]) -> None:
        optimizer = info.get("optimizer")
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

    # -- reading back ----------------------------------------------------------------------
    def _stored_values(self) -> Iterator[tuple[int, str, Any]]:
        """(step, quantity, value in Cockpit's format) for every stored value."""
        if self._scope is None:
            return
        self._scope.flush()
        with open_run(self.run_path) as run:
            table = run.quantities()
            by_layer = {(s, n, layer): v for s, n, layer, v in
                        table[["step", "name", "layer", "value"]].itertuples(index=False)}
            totals = table[table["layer"] == ""]
            for step, name, value, meta in totals[["step", "name", "value", "meta"]].itertuples(
                    index=False):
                step = int(step)
                if name in HISTOGRAMS:
                    if "edges" in meta:
                        yield step, name, _cockpit_histogram(*run.histogram(name, step))
                elif "reason" not in meta:  # a value that could not be computed is left out
                    if name in PER_PARAMETER:
                        yield step, name, [float(by_layer.get((step, name, layer), np.nan))
                                           for layer in self._names]
                    else:
                        yield step, name, float(value)


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
    """Dotted names of `params` in `model` (the layers of deepscope's per-layer values)."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"parameters of shapes {missing} are not in the model given; pass "
                         "model.parameters() of that model")
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if len({id(p) for p in params}) < trainable:
        warnings.warn("deepscope: Cockpit was given some of the model's trainable parameters; "
                      "whole-model values cover all of them", stacklevel=3)
    return [names[id(p)] for p in params]


def _cockpit_histogram(counts: np.ndarray, meta: dict[str, Any]) -> dict[str, Any]:
    """Cockpit's {"hist", "edges"} from a stored histogram (2-D: parameter axis first)."""
    edges = meta["edges"]
    if isinstance(edges[0], list):
        axes = tuple(np.linspace(lo, hi, int(n) + 1) for lo, hi, n in edges)
        return {"hist": counts, "edges": axes}
    lo, hi, n = edges
    return {"hist": counts, "edges": np.linspace(lo, hi, int(n) + 1)}


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
