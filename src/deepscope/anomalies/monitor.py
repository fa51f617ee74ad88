"""`HealthMonitor`: an always-on health check of every step, the first non-finite value traced
to its origin, and the detectors (see `detectors`), driven once per step by the recorder or by
a hand-written loop::

    monitor = HealthMonitor(model, on_anomaly=print)
    for step, (x, y) in enumerate(loader):
        monitor.start(step, "train")               # before the forward
        loss = loss_fn(model(x), y)
        monitor.loss(loss)                         # before backward (optional)
        opt.zero_grad(); loss.backward(); opt.step()
        findings, record_next = monitor.finish(step)   # after the optimiser step
    findings, _ = monitor.flush()                  # the last step's, when deferred (CUDA)
    monitor.close()

What it costs, every step (no statistic is synchronised on its own):
- with the trace (default): per distinct module output, and per gradient of one, a forward
  or tensor hook and one `aminmax` written into a reusable device buffer (`out=`).
  Activations that cannot create a NaN/Inf from finite values (ReLU, GELU, Tanh, ...) are
  not hooked; the root module always is.
- always: one fused L2 norm of every parameter gradient that changed, stacked with the
  loss, concatenated with the buffers: ONE host transfer for the whole step. On CUDA it is a
  non_blocking copy into pinned memory read one step later (`finish(t + 1)` returns step t's
  findings), so the GPU queue never drains.
- with grad_every=n (the recorder's default check uses 10), on the steps in between:
  the loss alone, read on the CPU where it costs no sync, and no torch op at all (a *light*
  step: no step record, the loss-spike detector judges the value on the host). When the
  loss of step t + 1 is not finite and step t's gradients were not checked, the parameters
  are checked at once (before step t + 1's backward and update): if they are non-finite
  already, step t's update made them so, and step t is reported, naming the non-finite
  gradient it still holds (the usual loop zeroes gradients after the forward), or else the
  parameter, saying the gradient is gone. Otherwise step t + 1 is checked in full.
Measured on a 784-256-256-10 MLP, batch 128, one CPU thread (a shared, loaded 2-core VM,
~2 ms per plain step), the monitor's own time per step with `trace=False, grad_every=10` (the
recorder's default): ~15-40 µs on a light step, ~200-250 µs on a gradient-check step (every
10th: the gradients' norm, the gradient-norm detector), ~650 µs more on every 50th (the
update ratio's snapshot and norms, the activation hooks); in all ~+3-7% per step
(`benchmarks/unrecorded_steps.py`, whose turns include every kind of step). Each torch call or
Python frame costs ~10× more right after a step's kernels than in a warm loop, so the light
step is kept to one `item()` and a few frames. +22% with the trace (its hooks dominate). The
relative cost falls as layers grow, since it is per module, not per FLOP.

Min and max are exact finiteness flags — a NaN or ±Inf anywhere in a tensor shows in them —
and cannot overflow. The host sums the fetched values (NaN and ±Inf survive a sum); only if
that sum is not finite does the trace look at each value, so a sum that merely overflowed
reports nothing. A gradient norm overflows past ~1e19: such a gradient is re-checked itself
before it is reported (when it has changed since, e.g. deferred on CUDA, the finding says so).

Findings are reported once per episode: a run of consecutive non-finite steps gives one
`nonfinite` finding (its first step); a detector reports a tensor when it turns anomalous.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..hookstate import hooks_paused
from ..naming import ModelNames, named_leaves
from .detectors import Detector, StepContext, default_detectors
from .findings import Finding, StopTraining
from .trace import CallRecord, ModelMap, Slots, Stat, StepRecord, TensorRecord, Tracer

log = logging.getLogger("deepscope")


@dataclass
class _Pending:
    """A finished step whose fetched values are not yet judged (in flight on CUDA)."""

    rec: StepRecord
    values: Tensor | None          # [grad norms..., loss?, slot buffers..., detector values...]
    event: Any                     # torch.cuda.Event to wait for, or None
    segments: list[tuple[Slots, int, int]]  # the slot buffers in `values`: used, size
    measured: list[tuple[Detector, list[tuple[str, int]]]]  # keys and sizes per detector


class HealthMonitor:
    """Checks every step for non-finite values, traces the first one, runs the detectors.

    model: the module to watch (forward hooks on its submodules, tensor hooks on their
    outputs during a step; removed by `close`). names: the recorded names of its modules and
    parameters (`scope.watch` passes its own); by default those of
    `ModelNames.of(model, prefix, root_name)`: children `prefix.path` (or `path`), the root
    `prefix` (or `root_name`).
    record_next: how many following steps the recorder should record in full after an acute
    finding (`nonfinite`, `exploding_gradient`, `loss_spike`). detectors: default
    `default_detectors()`; [] for the health check alone. detector_every: run the detectors on
    every n-th step (counting `start` calls, from the first), except `every_step` ones, and
    those of a `period` > 1 on every period-th of those steps (see `detectors`).
    on_anomaly: called with each finding after the step; raise `StopTraining` in it to stop
    (raised from the next `start`), or set a flag your loop reads. trace: keep the per-module
    statistics that locate the first non-finite value (default); False checks only the loss
    and the parameter gradients, which is cheaper but names only those. defer: read the check
    one step late (default: on CUDA only).
    grad_every: check the parameter gradients on every n-th step only (and on detector
    steps); the loss is still checked on every step. Applies when the loss is given and
    lives on the CPU, without the trace and not deferred (else gradients are checked every
    step). A gradient that turns non-finite on an unchecked step is still found, at that
    step, when its update makes the next step's loss non-finite (see the module docstring);
    one that is never applied (a skipped update) is found only if it is still non-finite at
    the next checked step.
    distributed: the ranks of a DDP job must record the same steps, so `record_next` follows
    evidence that is the same on every rank only: a non-finite gradient (after DDP's
    all-reduce) on a step every rank checks gradients on (every grad_every-th step, detector
    steps, every step with the trace or deferred; not a step checked because this rank's
    own loss was non-finite), and acute findings of `shared` detectors (the gradient norm's).
    A finding on the rank's own loss or activations alone is reported, not followed.
    """

    def __init__(self, model: nn.Module, *, prefix: str = "", root_name: str = "model",
                 names: ModelNames | None = None,
                 record_next: int = 3, detectors: Sequence[Detector] | None = None,
                 detector_every: int = 10, on_anomaly: Callable[[Finding], None] | None = None,
                 trace: bool = True, defer: bool | None = None, grad_every: int = 1,
                 distributed: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"HealthMonitor needs a torch.nn.Module, got {type(model).__name__}")
        if isinstance(record_next, bool) or not isinstance(record_next, int) or record_next < 0:
            raise ValueError(f"record_next must be an integer >= 0, got {record_next!r}")
        for arg, value in (("detector_every", detector_every), ("grad_every", grad_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")
        self.grad_every = grad_every
        self.detectors = list(default_detectors() if detectors is None else detectors)
        for d in self.detectors:
            if not isinstance(d, Detector):
                raise TypeError(f"detectors must be Detector instances, got {type(d).__name__}")
            if isinstance(d.period, bool) or not isinstance(d.period, int) or d.period < 1:
                raise ValueError(f"detector {d.name}: period must be an integer >= 1, got "
                                 f"{d.period!r}")
        self.record_next = record_next
        self.detector_every = detector_every
        self.on_anomaly = on_anomaly
        self.model = _map_model(model, names or ModelNames.of(model, prefix, root_name))
        self._tracer = Tracer(self.model, self._grad_is_finite)
        self._acute = frozenset({"nonfinite"}).union(*(d.acute for d in self.detectors))
        self.distributed = distributed
        self._shared_acute = frozenset().union(*(d.acute for d in self.detectors if d.shared))
        self._shared_nonfinite = False  # in an episode of non-finite synced gradients
        self._params = {name: p for name, p, _ in self.model.params}
        devices = {p.device for p in self._params.values()}
        self._device = min(devices, key=str) if devices else torch.device("cpu")
        self._one_device = len(devices) <= 1
        self._defer = self._device.type == "cuda" if defer is None else defer
        self._slot_sets: list[dict[tuple[torch.device, torch.dtype], Slots]] = [{}, {}]
        self._parity = 0
        self._starts = 0
        self._detections = 0  # detector steps so far
        self._step: StepRecord | None = None
        # A light step: one that checks only its loss, on the host, whose every-step detectors
        # do no device work (the loss spike). It has no StepRecord unless its loss is not
        # finite or not given (then it becomes a full step): (step, kind), and the loss read.
        every = [d for d in self.detectors if d.every_step]
        self._light_due = every if all(map(_host_only, every)) else None
        self._light: tuple[int, str] | None = None
        self._light_loss: tuple[float, str] | None = None
        self._light_ctx = StepContext(0, "", self._params)
        self._pending: _Pending | None = None
        self._held: tuple[list[Finding], int] = ([], 0)  # judged, not yet handed over
        # Hooks may run on several threads at once (autograd's per-device workers,
        # DataParallel replicas): records and slots are shared.
        self._lock = threading.Lock()
        self._nonfinite = False    # inside an episode of non-finite steps
        # (step, kind) of the last finished step if its gradients were not checked, and the
        # last step whose gradients were
        self._unchecked: tuple[int, str] | None = None
        self._last_checked: int | None = None
        self._stop: StopTraining | None = None
        self._reported: set[str] = set()
        self._closed = False
        # per parameter: (weak reference, version) of the gradient checked last, to skip
        # gradients no backward touched since (e.g. on an evaluation step)
        self._checked: list[tuple[weakref.ref | None, int]] = [(None, 0)] * len(self._params)
        # Traced modules are hooked for good; the others (all of them without the trace, and
        # activations that cannot create a NaN/Inf from finite values) only during steps
        # whose detectors observe module outputs.
        traced = [i for i, m in enumerate(self.model.modules)
                  if trace and (i == 0 or not _cannot_create_nonfinite(m))]
        self._untraced = sorted(set(range(len(self.model.modules))) - set(traced))
        self._handles = self._hook(traced, True)
        self._step_handles: list[Any] = []
        self._observed_cache: dict[tuple[int, ...], list[int]] = {}

    # --- the interface the recorder drives ----------------------------------------------------
    def start(self, step: int, kind: str) -> None:
        """Begin step `step` of kind `kind` (before the user's forward).

        Raises the `StopTraining` an `on_anomaly` callback raised after an earlier step."""
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop
        self._check_open("start")
        if self._step is not None:  # the previous step failed before finish()
            self._abort(self._step)
            self._unhook_step()
            self._unchecked = None  # it may have updated the parameters: no evidence left
            self._step = None
        if self._light is not None:  # the same, for a light step
            self._light = self._light_loss = None
            self._unchecked = None
        detect = self._starts % self.detector_every == 0
        grads_due = self._starts % self.grad_every == 0
        self._starts += 1
        if detect:
            self._detections += 1
        # The loss is checked on every step, gradients every grad_every steps and on detector
        # steps; with the trace, or deferred (the loss cannot be read before the update), on
        # every step.
        check = grads_due or detect or bool(self._handles) or self._defer
        if not check and self._light_due is not None:
            self._light = (step, kind)  # nothing on the device: see `loss` and `finish`
            return
        self._step = self._record(step, kind, detect, check)

    def _record(self, step: int, kind: str, detect: bool, check: bool) -> StepRecord:
        """The StepRecord of a full step: slots reset, its detectors begun, hooks placed."""
        slots = self._slot_sets[self._parity]
        if self._defer:  # step t's slots must survive until finish(t + 1) reads them
            self._parity ^= 1
        if self._pending is not None and self._pending.rec.slots is slots:
            # finish() was skipped (the user's step raised): judge the old step before its
            # slots are reused, and hand its findings over with the next finish().
            self._held = self._merge(self._held, self._judge_pending())
        for s in slots.values():
            s.used = 0
        nth = self._detections - 1  # of this detector step, from 0
        due = [d for d in self.detectors
               if d.every_step or (detect and nth % d.period == 0)]
        rec = StepRecord(step, kind, StepContext(step, kind, self._params), slots, due,
                         [d for d in due if d.observes_outputs])
        rec.check_grads = rec.shared_check = check
        for d in due:
            self._guard(step, d.begin, rec.ctx)
        if rec.observers:
            self._step_handles = self._hook(self._observed(rec.observers), False)
        return rec

    @property
    def hooks_modules(self) -> bool:
        """Whether module forward hooks observe the current step (the trace, or a detector
        of module outputs); they do not fire inside compiled code."""
        return bool(self._handles) or (self._step is not None and bool(self._step.observers))

    def loss(self, loss: Tensor, name: str = "loss") -> None:
        """The loss of the step (a 1-element tensor), before backward. name: as stored."""
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise TypeError(f"monitor.loss(...) needs the scalar loss tensor, got {got}")
        rec = self._step
        first = rec is None or rec.loss is None
        if rec is None:
            if self._light is None:
                raise ValueError("monitor.loss(...) called outside a step; call start(step, "
                                 "kind) first")
            if loss.is_cpu:  # (a light step is not deferred)
                value = loss.item()  # on the CPU a read costs no sync: the loss is there now
                if math.isfinite(value):
                    self._light_loss = (value, name)
                    return
            # not finite, or not on the CPU: this step becomes a full one
            rec = self._step = self._record(*self._light, detect=False, check=False)
            self._light = None
            if self._light_loss is not None:  # an earlier micro-batch's loss, finite
                rec.loss_host, rec.ctx.loss_name = self._light_loss
                self._light_loss = None
                first = False
        rec.loss = loss  # a reference: read in finish(), without a copy or a sync
        rec.ctx.loss_name = name
        if self._defer or loss.device.type != "cpu" or (not first and rec.loss_host is None):
            rec.loss_host = None  # read in finish (no sync here), with the gradients
            rec.check_grads = True
            return
        value = loss.item()  # on the CPU a read costs no sync: the loss is there now
        if rec.loss_host is None or math.isfinite(rec.loss_host):  # keep a non-finite one
            rec.loss_host = value
        if not math.isfinite(value):
            rec.check_grads = True  # re-run the decision: this step is checked in full
            if first and self._unchecked is not None and not self._nonfinite:
                self._held = self._merge(self._held, self._before_forward(rec.step))

    def finish(self, step: int) -> tuple[list[Finding], int]:
        """End step `step` (after backward and the optimiser step).

        Returns (findings to store, number of following steps to record in full). When
        deferred (CUDA) these are the previous step's; `flush()` returns the last ones."""
        self._check_open("finish")
        if self._light is not None:
            (light, kind), self._light = self._light, None
            if light == step and self._light_loss is not None:
                return self._finish_light(step, kind)
            # no loss given: the gradients are the check (a mismatched step is refused below)
            self._step = self._record(light, kind, detect=False, check=True)
        rec, self._step = self._step, None
        self._unhook_step()
        if rec is None or rec.step != step:
            started = "no step" if rec is None else f"step {rec.step}"
            raise ValueError(f"monitor.finish({step}) called after start of {started}; call "
                             "start(step, kind) and finish(step) once per step, in order")
        result = self.flush()  # the previous step's, in deferred mode
        if rec.loss_host is None:  # no loss read at once: the gradients are the check
            rec.check_grads = True
        self._unchecked = None if rec.check_grads else (rec.step, rec.kind)
        if rec.check_grads:
            self._last_checked = rec.step
        pending = self._launch(rec)
        if pending is not None:
            if self._defer:
                self._pending = pending
            else:
                result = self._merge(result, self._judge(pending))
        return result

    def flush(self) -> tuple[list[Finding], int]:
        """Findings not handed over yet: the step still in flight in deferred mode."""
        held, self._held = self._held, ([], 0)
        return self._merge(held, self._judge_pending())

    def _finish_light(self, step: int, kind: str) -> tuple[list[Finding], int]:
        """End a light step: its finite loss judged by the every-step detectors. Kept short:
        it runs on most steps, right after the step's kernels, where each line costs."""
        value, name = self._light_loss
        self._light_loss = None
        self._unchecked = (step, kind)
        self._nonfinite = False  # a finite step ends an episode of non-finite ones
        findings: list[Finding] = []
        ctx = self._light_ctx  # one context for all light steps (a new one costs ~5 µs)
        ctx.step, ctx.kind, ctx.loss, ctx.loss_name = step, kind, value, name
        for d in self._light_due:
            try:  # (not through _guard: one frame less on most steps)
                found = d.judge(ctx, {})
            except Exception as exc:
                self._failed(step, d.judge, exc)
                continue
            if found:
                findings += found
        if not findings and not self._held[0] and not self._held[1]:
            return findings, 0  # (nothing pending: a light step is never deferred)
        return self._merge(self.flush(), self._conclude(findings, False, []))

    def _judge_pending(self) -> tuple[list[Finding], int]:
        if self._pending is None:
            return [], 0
        pending, self._pending = self._pending, None
        return self._judge(pending)

    @staticmethod
    def _merge(a: tuple[list[Finding], int], b: tuple[list[Finding], int]
               ) -> tuple[list[Finding], int]:
        return a[0] + b[0], max(a[1], b[1])

    def close(self) -> None:
        """Remove every hook. Call `flush()` first to get the last deferred findings (their
        callbacks run either way). Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._step = self._light = self._light_loss = None
        self._unhook_step()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, indices: list[int], traced: bool) -> list[Any]:
        return [self.model.modules[i].register_forward_hook(
            partial(self._on_forward, i, traced)) for i in indices]

    def _observed(self, observers: list[Detector]) -> list[int]:
        """The untraced modules whose outputs one of `observers` wants (cached per set)."""
        key = tuple(map(id, observers))
        found = self._observed_cache.get(key)
        if found is None:
            found = self._observed_cache[key] = [
                i for i in self._untraced
                if any(d.observes(self.model.modules[i]) for d in observers)]
        return found

    def _unhook_step(self) -> None:
        for h in self._step_handles:
            h.remove()
        self._step_handles = []

    # --- hooks (no host sync in any of them) ----------------------------------------------------
    def _on_forward(self, index: int, traced: bool, module: nn.Module, args: Any,
                    output: Any) -> None:
        rec = self._step
        if rec is None or rec.broken or hooks_paused():  # paused: deepscope's own passes
            return
        try:
            # no_grad: statistics are written with out=, which autograd refuses; cheaper than
            # a detach() per tensor (each torch op costs ~10 µs right after heavy kernels)
            with self._lock, torch.no_grad():
                self._forward(rec, index, traced, module, args, output)
        except Exception as exc:  # the check must never break the user's training
            self._broken(rec, exc)

    def _forward(self, rec: StepRecord, index: int, traced: bool, module: nn.Module,
                 args: Any, output: Any) -> None:
        if type(output) is Tensor:  # the usual case, kept short: this runs for every module
            outs = [("", output)] if _usable(output) else []
        else:
            outs = [(s, t) for s, t in named_leaves(output) if _usable(t)]
        if len(args) == 1 and type(args[0]) is Tensor:
            ins = [args[0]] if _usable(args[0]) else []
        else:
            ins = [t for t in _tensors(args) if _usable(t)]
        probe = outs[0][1] if outs else (ins[0] if ins else None)
        if probe is None or _functorch_wrapped(probe):
            return  # nothing to check, or a torch.func re-run (instruments), not the user's
        if not traced:
            self._observe(rec, index, module, outs)
            return
        number = rec.numbers.get(index, 0)
        rec.numbers[index] = number + 1
        call = len(rec.calls)
        out_ids = {id(t) for _, t in outs}
        inputs = [self._input(rec, t, id(t) in out_ids) for t in ins]
        outputs = [self._output(rec, t, suffix, call) for suffix, t in outs]
        rec.calls.append(CallRecord(index, number, inputs, outputs))
        if rec.observers:
            self._observe(rec, index, module, outs)

    def _observe(self, rec: StepRecord, index: int, module: nn.Module,
                 outs: list[tuple[str, Tensor]]) -> None:
        path = self.model.paths[index]
        for suffix, t in outs:
            for d in rec.observers:
                d.observe(path + suffix, module, t)

    def _input(self, rec: StepRecord, t: Tensor, inplace: bool) -> int:
        entry = rec.memo.get(id(t))
        # An in-place module (ReLU(inplace=True)) returns its input, changed: its input is
        # the version seen before it ran.
        if entry is not None and entry[0]() is t and (inplace or entry[1] == _version(t)):
            return entry[2]
        return self._new(rec, t, "", None, _version(t))

    def _output(self, rec: StepRecord, t: Tensor, suffix: str, call: int) -> int:
        entry = rec.memo.get(id(t))
        version = _version(t)
        if entry is not None and entry[0]() is t and entry[1] == version:
            return entry[2]  # a container passing on its child's output: already checked
        return self._new(rec, t, suffix, call, version)

    def _new(self, rec: StepRecord, t: Tensor, suffix: str, producer: int | None,
             version: int) -> int:
        key = len(rec.tensors)
        rec.tensors.append(TensorRecord(tuple(t.shape), self._stat(rec, t), producer,
                                        suffix))
        rec.memo[id(t)] = (weakref.ref(t), version, key)
        if t.requires_grad:
            t.register_hook(partial(self._on_grad, rec, key))
        return key

    def _on_grad(self, rec: StepRecord, key: int, grad: Tensor) -> None:
        if rec is not self._step or rec.broken or hooks_paused():
            return  # a backward outside its step (its slots may be reused by now), or ours
        try:
            with self._lock, torch.no_grad():  # create_graph=True runs hooks with grad on
                rec.backward.append((key, self._stat(rec, grad)))
        except Exception as exc:
            self._broken(rec, exc)

    def _stat(self, rec: StepRecord, t: Tensor) -> Stat:
        """Write (min, max) of `t` into this step's slots (grad mode must be off: autograd
        refuses out=)."""
        key = (t.device, t.dtype)
        slots = rec.slots.get(key)
        if slots is None:
            slots = rec.slots[key] = Slots(t.device, t.dtype)
        i = slots.take(2)
        torch.aminmax(t, out=(slots.view(i), slots.view(i + 1)))
        return Stat(slots, i)

    def _new_grads(self, rec: StepRecord) -> list[Tensor]:
        """The parameter gradients that changed in this step (noted in `rec`).

        Read here rather than in per-parameter hooks: a hook call from autograd for each
        costs more, and here the gradient is the one the optimiser used (after clipping,
        AMP unscaling, all-reduce)."""
        grads = []
        for i, (name, param, _) in enumerate(self.model.params):
            grad = param.grad
            if grad is None:
                continue
            ref, version = self._checked[i]
            now = _version(grad)
            if ref is not None and ref() is grad and version == now:
                continue  # untouched since the last check (no backward reached it)
            self._checked[i] = (weakref.ref(grad), now)
            rec.grad_params.append(i)
            rec.ctx.grads.append(name)
            grads.append(grad.coalesce().values() if grad.is_sparse else grad)
        return grads

    def _grad_is_finite(self, index: int) -> bool | None:
        """Re-check a gradient whose norm is not finite; None if it changed since."""
        ref, version = self._checked[index]
        grad = self.model.params[index][1].grad
        if grad is None or ref is None or ref() is not grad or _version(grad) != version:
            return None
        values = grad.coalesce().values() if grad.is_sparse else grad
        return bool(torch.isfinite(values).all())

    # --- end of step ---------------------------------------------------------------------------
    def _launch(self, rec: StepRecord) -> _Pending | None:
        """Gradient and loss statistics, the detectors' values, and the step's one transfer."""
        if rec.broken:
            self._abort(rec)
            return None
        try:
            with torch.no_grad():
                return self._launch_checked(rec)
        except Exception as exc:
            self._broken(rec, exc)
            self._abort(rec)
            return None

    def _launch_checked(self, rec: StepRecord) -> _Pending:
        """`_launch` inside no_grad; exceptions are handled by `_launch`."""
        # Every torch op costs ~10-20 µs right after the heavy kernels of a step on CPU (cold
        # caches), so the step's checks are kept to a handful of ops: one fused norm of all
        # gradients, one stack with the loss, one cat with the slot buffers, one transfer.
        # A norm is non-finite iff its gradient is, or overflows (values past ~1e19): the
        # trace re-checks those before it reports one.
        grads = self._new_grads(rec) if rec.check_grads else []
        scalars = list(torch._foreach_norm(grads)) if grads else []
        fetch_loss = rec.loss is not None and rec.loss_host is None
        if fetch_loss:
            scalars.append(rec.loss if rec.loss.dim() == 0 else rec.loss.reshape(()))
        if not self._one_device or (fetch_loss and rec.loss.device != self._device):
            scalars = [t.to(self._device) for t in scalars]
        pieces = [torch.stack(scalars)] if scalars else []
        # Whole buffers, unused tail included: slicing them would be one more op.
        segments = [(s, s.used, len(s.data)) for s in rec.slots.values() if s.used]
        pieces += [s.data for s, _, _ in segments]
        measured = []
        for d in rec.due:
            values = self._guard(rec.step, d.measure, rec.ctx) or {}
            layout = []
            for key, v in values.items():
                pieces.append(v.detach().reshape(-1))
                layout.append((key, pieces[-1].numel()))
            measured.append((d, layout))
        if len(pieces) == 1:
            vector = pieces[0]
        elif pieces:  # cat promotes mixed dtypes
            vector = torch.cat([p if p.device == self._device else p.to(self._device)
                                for p in pieces])
        else:
            vector = None  # an unchecked step: its loss was read already, nothing to fetch
        event = None
        if self._defer and vector is not None and vector.is_cuda:
            # Pinned memory: a copy to pageable memory would block until the GPU is done.
            host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            host.copy_(vector, non_blocking=True)
            vector = host
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        return _Pending(rec, vector, event, segments, measured)

    def _judge(self, p: _Pending) -> tuple[list[Finding], int]:
        """Host side: the one sync of the step, the trace if needed, the detectors."""
        rec = p.rec
        try:
            if p.event is not None:
                p.event.synchronize()
            values = p.values.tolist() if p.values is not None else []
            at = len(rec.grad_params)
            norms = values[:at]
            loss = rec.loss_host
            if loss is None and rec.loss is not None:
                loss = values[at]
                at += 1
            host: dict[int, list[float]] = {}
            for slots, used, size in p.segments:
                host[id(slots)] = values[at:at + used]
                at += size
            # NaN and ±Inf survive a sum; a finite sum that overflows is sorted out by the
            # trace, which looks at every value on its own.
            flagged = not all(math.isfinite(sum(v)) for v in [*host.values(), norms]) or (
                loss is not None and not math.isfinite(loss))
            origin = self._tracer.trace(rec, loss, host, norms) if flagged else None
            findings = [origin] if origin is not None and not self._nonfinite else []
            self._nonfinite = origin is not None
            if origin is None:  # detector values of a non-finite step would poison histories
                rec.ctx.loss = loss
                rec.ctx.grad_norms = dict(zip(rec.ctx.grads, norms))
                for d, layout in p.measured:
                    mine: dict[str, list[float]] = {}
                    for key, n in layout:
                        mine[key] = values[at:at + n]
                        at += n
                    findings += self._guard(rec.step, d.judge, rec.ctx, mine) or []
        except Exception as exc:
            self._broken(rec, exc)
            return [], 0
        return self._conclude(findings, rec.shared_check, norms)

    def _conclude(self, findings: list[Finding], shared_check: bool, norms: list[float]
                  ) -> tuple[list[Finding], int]:
        """The user's callback for each finding, and (findings, steps to record in full)."""
        self._notify(findings)
        if self.distributed:
            return findings, self._shared_record_next(shared_check, norms, findings)
        acute = any(f.detector in self._acute for f in findings)
        return findings, self.record_next if acute else 0

    def _shared_record_next(self, shared_check: bool, norms: list[float],
                            findings: list[Finding]) -> int:
        """`record_next` from the evidence every rank has alike (see `distributed`): the
        first non-finite synced gradient of an episode, or a shared detector's finding."""
        acute = any(f.detector in self._shared_acute for f in findings)
        if shared_check:
            bad = not all(math.isfinite(n) for n in norms)
            acute = acute or (bad and not self._shared_nonfinite)
            self._shared_nonfinite = bad
        return self.record_next if acute else 0

    def _before_forward(self, step: int) -> tuple[list[Finding], int]:
        """The loss of `step` is not finite, and the previous step's gradients were not
        checked. If the parameters are non-finite already (before this step's backward and
        update), that step's update made them so: it is the first non-finite step, named by
        its gradients if they are still held, else by the parameter. Otherwise this step's
        forward is the origin, found by its full check in finish()."""
        assert self._unchecked is not None
        prev, kind = self._unchecked
        try:
            with torch.no_grad():
                bad = [i for i, (_, p, _) in enumerate(self.model.params)
                       if not bool(torch.isfinite(p).all())]
                if not bad:
                    return [], 0
                old = StepRecord(prev, kind, StepContext(prev, kind, self._params), {}, [], [])
                grads = self._new_grads(old)  # the previous step's, unless zeroed since
                norms = [float(n) for n in torch._foreach_norm(grads)] if grads else []
                origin = self._tracer.trace(old, None, {}, norms)
        except Exception as exc:  # the full check of this step in finish() still runs
            self._warn_once(f"health check of the parameters failed ({type(exc).__name__}: "
                            f"{exc}) at step {step}; training continues")
            return [], 0
        since = ("since the start" if self._last_checked is None
                 else f"after step {self._last_checked}")
        how = (f"found at step {step}, whose loss is non-finite while its parameters already "
               f"were before its forward; gradients are checked every {self.grad_every} "
               f"steps and were not {since}")
        if origin is not None:
            origin = replace(origin, message=f"{origin.message} ({how})")
        else:
            i = min(bad, key=lambda i: (-self.model.params[i][2], i))  # output side first
            name, param, module = self.model.params[i]
            origin = Finding(prev, name, "nonfinite", None, None, (
                f"first non-finite value at step {prev} or earlier: parameter {name} (shape "
                f"{tuple(param.shape)}) of {self.model.paths[module]} is non-finite before the "
                f"forward of step {step}, and the loss of step {prev} was finite: the update "
                f"of step {prev} made it non-finite (or an earlier unchecked one, if {name} "
                f"does not reach the loss). Its gradient was zeroed before this forward, so "
                f"the gradient that caused it cannot be named ({how})"))
        self._nonfinite = True
        self._notify([origin])
        # distributed: found because this rank's loss was non-finite, a rank's own moment
        return [origin], 0 if self.distributed else self.record_next

    def _notify(self, findings: list[Finding]) -> None:
        if self.on_anomaly is None:
            return
        for f in findings:
            try:
                self.on_anomaly(f)
            except StopTraining as stop:
                if self._stop is None:
                    self._stop = stop
            except Exception as exc:
                self._warn_once(f"on_anomaly callback raised {type(exc).__name__}: {exc}; "
                                "training continues (raise StopTraining to stop)")

    # --- failures inside the monitor never stop training ---------------------------------------
    def _guard(self, step: int, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self._failed(step, fn, exc)
            return None

    def _failed(self, step: int, fn: Callable, exc: Exception) -> None:
        """Say once that a detector's `fn` raised `exc` (first at `step`)."""
        self._warn_once(f"detector {type(getattr(fn, '__self__', fn)).__name__} failed "
                        f"({type(exc).__name__}: {exc}) first at step {step}; it is "
                        "skipped wherever it fails", key=f"{fn}{type(exc)}{exc}")

    def _broken(self, rec: StepRecord, exc: Exception) -> None:
        rec.broken = True
        self._warn_once(f"health check failed ({type(exc).__name__}: {exc}) first at step "
                        f"{rec.step}; training continues, steps where it fails are not checked",
                        key=f"{type(exc)}{exc}")

    def _abort(self, rec: StepRecord) -> None:
        for d in rec.due:
            self._guard(rec.step, d.abort)

    def _warn_once(self, message: str, key: str | None = None) -> None:
        """Log `message` the first time `key` (default: the message) comes up."""
        key = message if key is None else key
        if key not in self._reported:
            self._reported.add(key)
            log.warning("deepscope: %s", message)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ValueError(f"monitor.{call}(...) after close(); create a new HealthMonitor")


def _map_model(model: nn.Module, names: ModelNames) -> ModelMap:
    """Module and parameter names exactly as the recorder names activations and parameters."""
    paths: list[str] = []
    types: list[str] = []
    modules: list[nn.Module] = []
    parents: list[int | None] = []
    index: dict[str, int] = {}
    for mpath, module in model.named_modules():
        index[mpath] = len(paths)
        paths.append(names.module(mpath))
        types.append(type(module).__name__)
        modules.append(module)
        parents.append(index[mpath.rpartition(".")[0]] if mpath else None)
    params = [(names.param(name), p, index[name.rpartition(".")[0]])
              for name, p in model.named_parameters() if p.requires_grad]
    return ModelMap(paths, types, modules, parents, params)


# Elementwise activations whose output and gradient stay finite for finite inputs: they
# cannot be the origin of a NaN/Inf, so the trace does not hook them (a hook costs ~10 µs).
_SAFE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid,
         nn.Hardswish, nn.ELU, nn.Softsign, nn.Identity)


def _cannot_create_nonfinite(module: nn.Module) -> bool:
    if isinstance(module, nn.LeakyReLU):
        return abs(module.negative_slope) <= 1
    return type(module) in _SAFE  # exact types: a subclass may compute anything


def _host_only(d: Detector) -> bool:
    """Whether `d` does no device work (nothing of its own but `judge`): it can judge a light
    step from the loss alone."""
    kind = type(d)
    return (not d.observes_outputs and kind.begin is Detector.begin
            and kind.measure is Detector.measure and kind.abort is Detector.abort)


def _tensors(obj: Any) -> list[Tensor]:
    """Every tensor in an argument tuple (nested tuples, lists and dicts included)."""
    return [t for _, t in named_leaves(obj)]


def _usable(t: Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter (and cannot change)
        return -1


def _functorch_wrapped(t: Tensor) -> bool:
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))
