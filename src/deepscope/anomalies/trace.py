"""What one step leaves for the trace, and finding where its first non-finite value came from.

The monitor's hooks fill a `StepRecord` without ever synchronising: every tensor they see
gets its (min, max) written into device `Slots`. Only when the step's health check fails are
those slots fetched and walked here, on the host:

1. forward, in execution order: the first tensor whose min or max is not finite. A module
   output names its module (all its inputs were seen earlier and are finite); a tensor no
   watched module returned is the model's input (the data) or came from code between
   modules, named by the module whose forward ran that code.
2. the loss, if every forward tensor is finite.
3. backward, in execution order: the first non-finite gradient. Gradients are kept for
   module outputs, so the module to blame is the one that *consumed* that tensor: its
   backward turned the finite gradient of its own output into a non-finite one for its
   input. Parameter gradients are checked by their norm, in module order from the output
   back; a non-finite one names the parameter.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .detectors import Detector, StepContext
from .findings import Finding


class Slots:
    """A reusable 1-D device buffer that per-tensor reductions write into (`out=`).

    Writing each statistic into a preallocated slot spares the step a `torch.stack` of many
    0-d tensors (about 1 µs each on CPU). One buffer per (device, dtype); it doubles when
    full, keeping what was written.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int = 64) -> None:
        self.data = torch.empty(size, device=device, dtype=dtype)
        self._views = self.data.unbind(0)  # made once: unbind costs ~2 µs per view
        self.used = 0

    def take(self, n: int) -> int:
        """Reserve `n` consecutive slots; returns the first index."""
        while self.used + n > len(self._views):
            grown = torch.empty(2 * len(self._views), device=self.data.device,
                                dtype=self.data.dtype)
            grown[:self.used].copy_(self.data[:self.used])
            self.data, self._views = grown, grown.unbind(0)
        first = self.used
        self.used += n
        return first

    def view(self, index: int) -> Tensor:
        return self._views[index]


class Stat(NamedTuple):
    """Where a tensor's (min, max) lives: two slots from `index`. Exact: non-finite iff the
    tensor holds a NaN or ±Inf, and, unlike a sum, it cannot overflow."""

    slots: Slots
    index: int


@dataclass
class TensorRecord:
    """A forward tensor (one version of it) seen by a hook. Its key is its list index."""

    shape: tuple[int, ...]
    stat: Stat
    producer: int | None  # index of the module call that returned it; None: nobody did
    suffix: str           # ".key" / ".0" inside a dict / tuple output


@dataclass
class CallRecord:
    """One module call, in completion order (children before their parent)."""

    module: int           # index into ModelMap.paths
    number: int           # earlier calls of the same module in this step
    inputs: list[int]     # tensor keys of its floating-point tensor arguments
    outputs: list[int]    # tensor keys of its floating-point outputs


@dataclass
class StepRecord:
    """Everything the hooks saw during one step; the trace reads it after the check fails."""

    step: int
    kind: str
    ctx: StepContext
    slots: dict[tuple[torch.device, torch.dtype], Slots]  # reused buffers, reset at start
    due: list[Detector]                                   # detectors running this step
    observers: list[Detector]                             # those of `due` that see outputs
    tensors: list[TensorRecord] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    # (tensor key, stat) of activation gradients, in backward execution order
    backward: list[tuple[int, Stat]] = field(default_factory=list)
    grad_params: list[int] = field(default_factory=list)  # parameters with a new gradient
    # id(tensor) -> (weak reference, version counter, key): one statistic per tensor version
    memo: dict[int, tuple[weakref.ref, int, int]] = field(default_factory=dict)
    numbers: dict[int, int] = field(default_factory=dict)  # module index -> calls so far
    loss: Tensor | None = None
    loss_host: float | None = None  # the loss read at once (CPU): not in the fetched vector
    check_grads: bool = True        # parameter gradients are checked in this step
    # checked whatever the loss (grad_every, detector step, trace, deferred): on every rank
    shared_check: bool = True
    broken: bool = False


@dataclass
class ModelMap:
    """Names and structure of the watched model, by module and parameter index."""

    paths: list[str]                   # module index -> name (root first)
    types: list[str]
    modules: list[nn.Module]
    parents: list[int | None]
    params: list[tuple[str, Tensor, int]]  # (full name, parameter, owning module index)

    def ancestors(self, index: int) -> set[int]:
        found: set[int] = set()
        parent = self.parents[index]
        while parent is not None:
            found.add(parent)
            parent = self.parents[parent]
        return found


class _Values:
    """Host copies of the slots of one step (by id of the Slots), as fetched."""

    def __init__(self, host: dict[int, list[float]]) -> None:
        self._host = host

    def get(self, stat: Stat) -> list[float]:
        return self._host[id(stat.slots)][stat.index:stat.index + 2]


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _range(values: list[float]) -> str:
    return f"min {values[0]:.4g}, max {values[1]:.4g}"


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


class Tracer:
    """Finds the origin of the first non-finite value of a failed step (host side)."""

    def __init__(self, model: ModelMap, grad_is_finite: Callable[[int], bool | None],
                 root: int = 0) -> None:
        """grad_is_finite(parameter index): re-check a gradient whose norm is not finite
        (the norm overflows past ~1e19); None when the gradient has changed since."""
        self.model = model
        self.grad_is_finite = grad_is_finite
        self.root = root

    def trace(self, rec: StepRecord, loss: float | None, host: dict[int, list[float]],
              grad_norms: list[float]) -> Finding | None:
        """The origin finding, or None if nothing is non-finite after all (a sum overflowed).

        host: the step's slot values fetched to the host, by id of their `Slots`.
        grad_norms: the norms of the gradients of `rec.grad_params`, in that order."""
        values = _Values(host)
        norms = dict(zip(rec.grad_params, grad_norms))
        return (self._forward(rec, values) or self._loss(rec, loss)
                or self._backward(rec, values, norms))

    # -- names ------------------------------------------------------------------------------
    def _call_name(self, rec: StepRecord, call: CallRecord) -> str:
        many = sum(1 for c in rec.calls if c.module == call.module) > 1
        path = self.model.paths[call.module]
        return f"{path} (call {call.number + 1})" if many else path

    def _tensor_name(self, rec: StepRecord, key: int) -> str:
        t = rec.tensors[key]
        if t.producer is not None:
            return self.model.paths[rec.calls[t.producer].module] + t.suffix
        consumer = self._consumers(rec, key)[0]
        index = rec.calls[consumer].inputs.index(key)
        return f"input {index} of {self.model.paths[rec.calls[consumer].module]}"

    def _parent_path(self, module: int) -> str:
        parent = self.model.parents[module]
        return self.model.paths[self.root if parent is None else parent]

    def _consumers(self, rec: StepRecord, key: int) -> list[int]:
        """Calls that took tensor `key` as an input, innermost only (a container and its
        first child both receive it; the child is the one that used it)."""
        calls = [i for i, c in enumerate(rec.calls) if key in c.inputs]
        modules = {rec.calls[i].module for i in calls}
        outer = set().union(*(self.model.ancestors(m) for m in modules)) if modules else set()
        return [i for i in calls if rec.calls[i].module not in outer]

    def _inputs_text(self, rec: StepRecord, call: CallRecord, values: _Values) -> str:
        parts = []
        for i, key in enumerate(call.inputs):
            t = rec.tensors[key]
            source = (f" (from {self.model.paths[rec.calls[t.producer].module]}{t.suffix})"
                      if t.producer is not None else "")
            parts.append(f"input {i}{source} {_range(values.get(t.stat))}")
        return "; ".join(parts) if parts else "no floating-point inputs"

    def _params_text(self, module: int) -> str:
        own = [(n, p) for n, p, m in self.model.params if m == module]
        bad = [n for n, p in own if not bool(torch.isfinite(p.detach()).all())]
        if bad:
            return f"; its parameters {', '.join(bad)} are non-finite now (after the step)"
        return "; its parameters are finite" if own else ""

    # -- the three phases ---------------------------------------------------------------------
    def _forward(self, rec: StepRecord, values: _Values) -> Finding | None:
        for key, t in enumerate(rec.tensors):
            v = values.get(t.stat)
            if _finite(v):
                continue
            if t.producer is not None:
                call = rec.calls[t.producer]
                name = self.model.paths[call.module] + t.suffix
                return Finding(rec.step, name, "nonfinite", None, None, (
                    f"first non-finite value of step {rec.step}: forward output of "
                    f"{self._call_name(rec, call)}{t.suffix} ({self.model.types[call.module]}, "
                    f"shape {_shape(t.shape)}) has {_range(v)}, while its inputs are finite: "
                    f"{self._inputs_text(rec, call, values)}{self._params_text(call.module)}"))
            consumers = self._consumers(rec, key)
            call = rec.calls[consumers[0]]
            index = call.inputs.index(key)
            if any(rec.calls[i].module == self.root for i in self._all_consumers(rec, key)):
                root = self.model.paths[self.root]
                return Finding(rec.step, root, "nonfinite", None, None, (
                    f"first non-finite value of step {rec.step}: the model's input "
                    f"(input {index} of {self.model.paths[call.module]}, shape "
                    f"{_shape(t.shape)}) already has {_range(v)}: check the data and the code "
                    "before the model"))
            parent = self._parent_path(call.module)
            return Finding(rec.step, parent, "nonfinite", None, None, (
                f"first non-finite value of step {rec.step}: input {index} of "
                f"{self._call_name(rec, call)} ({self.model.types[call.module]}, shape "
                f"{_shape(t.shape)}) has {_range(v)}, but no watched module returned it: code "
                f"in the forward of {parent}, outside its submodules, computed it "
                "(or changed it in place)"))
        return None

    def _all_consumers(self, rec: StepRecord, key: int) -> list[int]:
        return [i for i, c in enumerate(rec.calls) if key in c.inputs]

    def _loss(self, rec: StepRecord, loss: float | None) -> Finding | None:
        if loss is None or math.isfinite(loss):
            return None
        name = rec.ctx.loss_name
        return Finding(rec.step, name, "nonfinite", None, None, (
            f"first non-finite value of step {rec.step}: the loss {name} is {loss} while every "
            "watched module output is finite: the loss computation (code between the model "
            "output and the loss) produced it"))

    def _backward(self, rec: StepRecord, values: _Values,
                  norms: dict[int, float]) -> Finding | None:
        # A module's backward computes its parameters' gradients once the gradient of its
        # output is known: check them right after that gradient, before the ones after it.
        owned: dict[int, list[int]] = {}
        for index in norms:
            owned.setdefault(self.model.params[index][2], []).append(index)
        grads = dict(_grad_stats(rec, values))
        for key, _ in rec.backward:
            if not _finite(grads[key]):
                return self._grad(rec, key, grads[key], grads)
            producer = rec.tensors[key].producer
            if producer is not None:
                found = self._params(rec, owned.pop(rec.calls[producer].module, []), norms)
                if found is not None:
                    return found
        rest = [i for m in sorted(owned, reverse=True) for i in owned[m]]
        return self._params(rec, rest, norms)

    def _params(self, rec: StepRecord, indices: list[int],
                norms: dict[int, float]) -> Finding | None:
        for index in indices:
            if math.isfinite(norms[index]):
                continue
            verdict = self.grad_is_finite(index)
            if verdict:
                continue  # only its norm overflowed
            name, param, module = self.model.params[index]
            maybe = (" (or holds values beyond ~1e19, so that its norm overflows: it was "
                     "replaced before it could be re-checked)") if verdict is None else ""
            return Finding(rec.step, name, "nonfinite", None, None, (
                f"first non-finite gradient of step {rec.step}: the gradient of parameter "
                f"{name} (shape {_shape(tuple(param.shape))}) of {self.model.paths[module]} "
                f"({self.model.types[module]}) has norm {norms[index]:.4g}{maybe} while the "
                f"gradients before it are finite: {self.model.paths[module]}'s backward "
                "produced it"))
        return None

    def _grad(self, rec: StepRecord, key: int, v: list[float],
              grads: dict[int, list[float]]) -> Finding:
        t = rec.tensors[key]
        what = (f"the gradient of {self._tensor_name(rec, key)} (shape {_shape(t.shape)}) has "
                f"{_range(v)}")
        head = f"first non-finite gradient of step {rec.step}: "
        consumers = self._consumers(rec, key)
        if consumers:
            call = rec.calls[consumers[0]]
            outs = [grads[k] for k in call.outputs if k in grads]
            out_text = ("the gradient of its output is finite (" +
                        "; ".join(_range(g) for g in outs) + ")") if outs else \
                "its output has no recorded gradient"
            others = [self._call_name(rec, rec.calls[i]) for i in consumers[1:]]
            also = (f"; {', '.join(others)} also use{'s' if len(others) == 1 else ''} this "
                    "tensor") if others else ""
            return Finding(rec.step, self.model.paths[call.module], "nonfinite", None, None, (
                f"{head}the backward of {self._call_name(rec, call)} "
                f"({self.model.types[call.module]}) made it: {out_text}, but {what}{also}"))
        producer = rec.calls[t.producer] if t.producer is not None else None
        if any(key in c.outputs for c in rec.calls if c.module == self.root):
            name = rec.ctx.loss_name
            return Finding(rec.step, name, "nonfinite", None, None, (
                f"{head}{what}, the model output: the backward of the loss computation "
                f"(code between the model output and {name}) produced it"))
        parent = self._parent_path(producer.module if producer is not None else self.root)
        return Finding(rec.step, parent, "nonfinite", None, None, (
            f"{head}{what}; no watched module used that tensor, so the backward of code in "
            f"the forward of {parent}, outside its submodules, produced it"))


def _grad_stats(rec: StepRecord, values: _Values) -> list[tuple[int, list[float]]]:
    """(tensor key, host statistic) of every activation gradient of the step."""
    return [(k, values.get(s)) for k, s in rec.backward if k >= 0]
