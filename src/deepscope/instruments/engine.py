"""Per-sample gradient statistics of any PyTorch model, without keeping per-sample grads.

Usage (one step):

    engine = PerSampleEngine(model)
    engine.start()                      # hooks on; old captures dropped
    for x, y in micro_batches:          # one or more (gradient accumulation)
        losses = loss_fn(model(x), y, reduction="none")
        engine.add_loss(losses.mean(), len(x))   # before its backward; B: it is a mean
        losses.mean().backward()
    engine.stop()                       # hooks off; captures kept
    opt.step()                          # allowed: nothing below reads current parameters
    norms = engine.sq_norms()           # name -> (k·B,) ‖gᵢ‖², micro-batches in order

Only the backward pass through each loss given to `add_loss` is used: other backward or
`torch.autograd.grad` passes in the step (a gradient penalty, a metric) change nothing.
Without `add_loss` (the older protocol: `set_scale` after the backward) every backward pass
through the captured calls counts, as one batch.

Forward hooks keep each call's inputs, tensor hooks on the outputs keep ∂L/∂output;
per-module rules (`deepscope.instruments.rules`) turn them into statistics by closed
forms (Linear, Conv, Embedding, norms) or by torch.func re-runs (everything else). A
module whose per-sample gradients are smaller than those captures (norms, early convs: rules
with `early`) gets them materialised in the registered loss's backward pass instead, and its
captures dropped there.
Notation: B batch size, gᵢ = ∇θ ℓᵢ (not divided by B), k a parameter tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..backward import accumulates, graph_task
from ..hookstate import hooks_paused
from ..layouts import sequence_first_modules
from ..naming import ModelNames
from .rules import GenericRule, rule_for
from .rules.base import (
    Budget,
    Call,
    Context,
    DenseGrads,
    ModuleGrads,
    Part,
    Rule,
    StackedGrads,
    Unsupported,
    map_tensors,
    samples_per_chunk,
    tensor_leaves,
)

__all__ = ["PerSampleEngine"]


@dataclass
class _Hooked:
    """A module that owns trainable parameters, with its rule and captured calls."""

    label: str  # e.g. "Linear 'fc1'"
    module: nn.Module
    rule: Rule
    names: dict[str, str]  # module-local parameter name -> engine (dotted) name
    calls: list[Call] = field(default_factory=list)
    # a batch-first rule inside a sequence-first transformer: its 3-D inputs, outputs and
    # output gradients are (T, B, …), captured as (B, T, …) (position-wise layers: exact)
    transposed: bool = False


def _detach(x: Tensor) -> Tensor:
    return x.detach()  # same storage and version counter: no copy, in-place edits visible


def _batch_first(x: Tensor) -> Tensor:
    """A (T, B, …) tensor as a (B, T, …) view; others as they are."""
    return x.movedim(1, 0) if x.dim() == 3 else x


def _edited(call: Call) -> bool:
    """Whether an input of `call` was modified in place since its forward."""
    return [x._version for x in tensor_leaves((call.args, call.kwargs))] != call.in_versions


def _expanded(call: Call) -> Call:
    """A broadcast call as the batched call it stands for: inputs of batch size 1 expanded
    to the batch (views), the broadcast result's gradient as its output gradient."""
    g, total = call.broadcast, call.grads[0]
    if g is None or call.error is not None or total is None:
        return call
    if g.dim() != total.dim():  # aligned from the right: its dim 0 is not the batch's
        return replace(call, error=(
            f"its batch-size-1 output {tuple(total.shape)} is broadcast against "
            f"{tuple(g.shape)}, so its dim 0 is not the batch"))
    # the per-sample gradient: the broadcast result's, summed over the other broadcast dims
    dims = [d for d in range(1, g.dim()) if total.shape[d] == 1 and g.shape[d] != 1]
    g = g.sum(dims, keepdim=True) if dims else g
    if not torch.allclose(g.sum(0, keepdim=True), total, rtol=1e-4,
                          atol=1e-6 * float(total.abs().max())):
        return replace(call, error=(
            "its batch-size-1 output is broadcast over the batch, but the gradients of the "
            "broadcast results do not add up to its gradient (it also reaches the loss "
            "another way)"))
    batch = g.shape[0]

    def expand(x: Tensor) -> Tensor:
        return x.expand(batch, *x.shape[1:]) if x.dim() > 0 and x.shape[0] == 1 else x

    return replace(call, args=map_tensors(call.args, expand),
                   kwargs=map_tensors(call.kwargs, expand), grads=[g],
                   outputs=[expand(o) for o in call.outputs], broadcast=None)


# consumers whose gradient w.r.t. a broadcast operand is ± alpha × their output gradient,
# summed over the broadcast dims: the per-sample gradient is that output gradient
_BROADCAST_SIGNS = {"AddBackward0": (1, 1), "SubBackward0": (1, -1)}


@dataclass
class _Micro:
    """One registered loss (a micro-batch) and the backward pass that belongs to it."""

    scale: float  # Σᵢ ℓᵢ / loss: B for a mean, 1 for a sum, k·B for mean / k
    size: int | None = None  # B, from per_sample when given
    task: int | None = None  # graph task of its backward
    provisional: bool = False  # that task was a create_graph=True pass (a later plain one wins)
    unit: float = 1.0  # ∂loss/∂(an element of per_sample)
    # ∂(backpropagated root)/∂loss: 1, or e.g. a GradScaler factor; or, when the pass was
    # claimed through per_sample, ∂root/∂per_sample (then root / unit is that factor)
    root: Tensor | None = None
    via_parts: bool = False
    # ∂root/∂θ as autograd delivered it in that task, with its version counter then
    observed: dict[str, tuple[Tensor, int]] = field(default_factory=dict)


@dataclass
class _Counting:
    """`Counting` of one hooked module's parameters (those it alone uses) for an engine."""

    engine: PerSampleEngine
    index: int

    def fresh(self, swept: Collection[str]) -> dict[str, Any]:
        engine = self.engine
        names = engine._hooked[self.index].names
        return {local: engine._new_counter(name) for local, name in names.items()
                if local in swept and engine._new_counter is not None
                and len(engine._owners[name]) == 1}

    def done(self, counters: dict[str, Any]) -> None:
        names = self.engine._hooked[self.index].names
        self.engine.swept.update({names[local]: c for local, c in counters.items()})


class PerSampleEngine:
    """Per-sample gradient statistics gᵢ⁽ᵏ⁾ = ∇θ⁽ᵏ⁾ ℓᵢ for every trainable parameter.

    model:       any nn.Module; the batch is dim 0 of each module's input (the rules for
                 nn.MultiheadAttention and RNNs follow their `batch_first`).
    chunk_size:  samples per chunk whenever per-sample gradients are materialised.
    cache_bytes: per-sample gradients up to this many bytes (all modules together, and at
                 most the largest module's) are kept for reuse within a step; beyond it they
                 are recomputed when needed.
    names:       the recorded names of the model's modules and parameters (`scope.watch`'s);
                 default: those of `named_parameters()` / `named_modules()` as they are.

    Parameter names are those of `names` for `model.named_parameters()` (a shared parameter
    once, under its first name); only parameters with requires_grad count. Results are in each
    parameter's dtype and device. Parameters whose per-sample gradients cannot be
    obtained this step are NaN, listed in `unavailable` with the reason, and explained
    once in `warnings`.

    Micro-batches: each `add_loss` registers the loss of one micro-batch; the gᵢ of all of
    them form one batch, in registration order (k micro-batches of B: k·B samples).
    """

    def __init__(self, model: nn.Module, chunk_size: int = 32, *, cache_bytes: int = 2**28,
                 names: ModelNames | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be a non-negative int, got {cache_bytes!r}")
        self.model = model
        self.chunk_size = chunk_size
        self.cache_bytes = cache_bytes
        self.warnings: list[str] = []
        self.unavailable: dict[str, str] = {}
        self._warned: set[str] = set()
        self._names = names or ModelNames.of(model, root_name="<model>")
        self._params = {self._names.param(n): p for n, p in model.named_parameters()
                        if p.requires_grad}
        self.param_names: list[str] = list(self._params)
        self._hooked = self._find_modules()
        # parameter name -> [(index into _hooked, module-local name)]
        self._owners: dict[str, list[tuple[int, str]]] = {n: [] for n in self.param_names}
        for index, hooked in enumerate(self._hooked):
            for local, name in hooked.names.items():
                self._owners[name].append((index, local))
        self._scale = 1.0
        self._handles: list[RemovableHandle] = []
        # without add_loss: ∂L/∂θ as autograd delivered it to each parameter this step (summed
        # over backward passes), with its version counter then: in-place edits later
        # (clipping) disqualify it
        self._observed: dict[str, tuple[Tensor, int]] = {}
        self._micros: list[_Micro] = []
        self.unavailable_sum: dict[str, str] = {}
        self._new_counter: Callable[[], Any] | None = None
        self._reset_step_state()

    # -- setup ------------------------------------------------------------------------
    def _find_modules(self) -> list[_Hooked]:
        engine_name = {id(p): n for n, p in self._params.items()}
        covered: set[int] = set()  # submodules whose parameters a recursive rule owns
        sequence_first = sequence_first_modules(self.model)
        hooked = []
        for module_name, module in self.model.named_modules():
            if id(module) in covered:
                continue
            rule_cls = rule_for(module)
            own = module.named_parameters(recurse=rule_cls.recursive)
            params = {local: p for local, p in own if id(p) in engine_name}
            if rule_cls.recursive:
                covered.update(id(m) for m in module.modules() if m is not module)
            if not params:
                continue
            label = f"{type(module).__name__} '{self._names.module(module_name)}'"
            rule = rule_cls(module, params)
            reason = rule.unsupported()
            if reason is not None:
                self._warn(f"{label}: {reason}; using the generic rule, one sample at a time")
                rule = GenericRule(module, params)
                rule.batched = False  # the reasons are couplings between samples
            names = {local: engine_name[id(p)] for local, p in params.items()}
            hooked.append(_Hooked(label, module, rule, names, transposed=rule.batch_dim0
                                  and id(module) in sequence_first))
        return hooked

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self.warnings.append(message)

    def _reset_step_state(self) -> None:
        self._order: list[tuple[int, Call]] = []  # every captured call, in forward order
        self._built: dict[int, ModuleGrads | str] | None = None
        self._status: dict[str, list[tuple[int, str]] | str | None] | None = None
        self._batch: int | None = None
        self._sizes: list[tuple[int, int]] | None = None  # (micro, samples) in sample order
        self._effective: dict[int, list[tuple[int, Call]]] | None = None
        self._shared_forward: set[int] = set()  # losses whose backward met another's calls
        self._sequence_first = False  # a (T=B, B, …) call had its batch at dim 1
        self._nested: dict[int, int] = {}  # a checkpoint's nested backward -> its outer pass
        self._cache: dict[str, dict[str, Tensor]] = {}
        self._shared: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        # parameter name -> its counter, complete, from a statistics sweep (count_in_sweeps)
        self.swept: dict[str, Any] = {}

    # -- hooks ------------------------------------------------------------------------
    def start(self) -> None:
        """Register the hooks and drop earlier captures (call before the forward)."""
        self.stop()
        self.clear()
        for index, hooked in enumerate(self._hooked):
            hook = partial(self._on_forward, index)
            self._handles.append(hooked.module.register_forward_hook(hook, with_kwargs=True))
        for name, p in self._params.items():
            self._handles.append(p.register_hook(partial(self._on_param_grad, name)))

    def stop(self) -> None:
        """Remove every hook (call after the backward); captures are kept."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        """Drop the captures and everything computed from them (frees their memory)."""
        for hooked in self._hooked:
            hooked.calls = []
            hooked.rule.reset()
        self._observed = {}
        self._micros = []
        self.unavailable = {}
        self.unavailable_sum = {}
        self._new_counter = None
        self._reset_step_state()

    def count_in_sweeps(self, new_counter: Callable[[str], Any]) -> None:
        """Count per-sample gradients while statistics materialise them anyway: each
        parameter of one module, in a step of one registered loss, gets a `new_counter(its
        name)` (with `.add(part)`, e.g. a histogram) fed by its module's materialising sweep;
        once the sweep went through the batch it is in `swept`, and `per_sample_parts(skip=
        swept)` need not materialise those again. Call before the step's first statistic;
        `clear` turns it off."""
        self._new_counter = new_counter
        self._built = None

    def _on_forward(
        self, index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> None:
        if hooks_paused() or not torch.is_grad_enabled():
            return
        leaves = tensor_leaves(output)
        slots = [j for j, y in enumerate(leaves) if y.requires_grad]
        if not slots:
            return
        hooked = self._hooked[index]
        detach = (lambda x: _batch_first(x.detach())) if hooked.transposed else _detach
        call = Call(
            args=map_tensors(args, detach),
            kwargs=map_tensors(kwargs, detach),
            out_index=slots,
            grads=[None] * len(slots),
            in_versions=[x._version for x in tensor_leaves((args, kwargs))],
            extra=hooked.rule.capture(args, kwargs),
        )
        task = graph_task()
        if task != -1:  # a checkpoint recomputing the forward inside a backward pass
            call.task = task
        if hooked.rule.keeps_outputs:
            call.outputs = [detach(leaves[j]) for j in slots]
            call.out_versions = [leaves[j]._version for j in slots]
        if (len(leaves) == 1 and leaves[0].dim() > 0 and leaves[0].shape[0] == 1
                and not hooked.transposed):
            call.node = leaves[0].grad_fn  # may be broadcast over the batch: see add_loss
        for slot, j in enumerate(slots):
            hook = partial(self._on_grad, index, call, slot)
            self._handles.append(leaves[j].register_hook(hook))
        if hooked.rule.sequence_first(call):
            x = tensor_leaves((call.args, call.kwargs))[0]  # (T, B, …)
            # T ≠ B: a module taking its (T, B, …) data for batch-first sees T samples and
            # says so; T == B: it cannot tell (see `_ambiguous`)
            self._sequence_first |= x.shape[0] == x.shape[1]
        hooked.calls.append(call)
        self._order.append((index, call))
        self._built = None
        self._batch = None

    def _task_now(self) -> int:
        """The backward pass running now: a checkpoint's nested pass counts as the pass that
        recomputed its forward (see `_on_grad`)."""
        task = graph_task()
        return self._nested.get(task, task)

    def _micro_now(self) -> int | None:
        """The registered loss whose backward is running now, or None (another pass)."""
        task = self._task_now()
        return next((m for m, micro in enumerate(self._micros) if micro.task == task), None)

    def _on_grad(self, index: int, call: Call, slot: int, grad: Tensor) -> None:
        if hooks_paused():  # deepscope's own backward passes (curvature) are not the user's
            return
        if call.task is not None and (now := graph_task()) != call.task:
            # torch.utils.checkpoint(use_reentrant=True) recomputed this call inside pass
            # call.task and backpropagates through it in a pass of its own: that pass, and the
            # parameter gradients it delivers, belong to call.task's
            self._nested[now] = self._nested.get(call.task, call.task)
        if self._micros:
            micro = self._micro_now()
            if micro is None:  # another backward / autograd.grad pass: not the loss's
                return
            if call.micro not in (None, micro):
                call.error = (
                    "its output reached two registered losses (rec.loss); a micro-batch's "
                    "forward must feed only its own loss"
                )
                self._shared_forward.add(micro)
                return
            call.micro = micro
        if self._hooked[index].transposed:
            grad = _batch_first(grad)
        # several backward passes through one output add up, like .grad does
        previous = call.grads[slot]
        call.grads[slot] = grad if previous is None else previous + grad
        if self._micros and not self._micros[call.micro].provisional:
            self._materialise(index, call)

    def _materialise(self, index: int, call: Call) -> None:
        """Replace a call's captures by its per-sample gradients where those are smaller
        (a BatchNorm's 2·C numbers per sample, an early conv's kernel): its registered
        loss's plain backward pass delivers its output gradient once, so they are final.
        Any failure leaves the captures for `_build`, which computes or explains them."""
        rule = self._hooked[index].rule
        if (not rule.early or len(call.grads) != 1 or call.node is not None
                or call.error is not None or _edited(call)):
            return
        captured = sum(t.numel() * t.element_size()
                       for t in tensor_leaves((call.args, call.kwargs, call.grads, call.outputs)))
        try:
            samples = rule.batch_size(call)
            if self._ambiguous(index, call, samples):
                return  # _build says why
            if samples * sum(p.numel() * p.element_size()
                             for p in rule.params.values()) >= captured:
                return
            ctx = Context(samples, self._micro_scale(call.micro), self.chunk_size, Budget(0),
                          partial(self._module_warn, self._hooked[index]))
            with torch.no_grad():
                kept = rule.grads([call], ctx).all_per_sample()
        except Exception:  # never in the way of training: the captures stay
            return
        call.kept, call.samples = kept, samples
        call.args, call.kwargs, call.outputs, call.grads = (), {}, [], [None]

    def _on_param_grad(self, name: str, grad: Tensor) -> None:
        if hooks_paused():
            return
        store = self._observed
        if self._micros:
            micro = self._micro_now()
            if micro is None:
                return
            store = self._micros[micro].observed
        previous = store.get(name)
        total = grad if previous is None else previous[0] + grad
        store[name] = (total, total._version)

    # -- registered losses (micro-batches) ---------------------------------------------------
    def add_loss(self, loss: Tensor, scale: float, per_sample: Tensor | None = None,
                 unit: float | None = None) -> None:
        """Register the loss of one micro-batch: after its forward, before its backward.

        Only the backward pass that runs through `loss` or `per_sample` (the first plain
        one; a create_graph=True pass only if no plain one follows) is captured for the
        calls it reaches: `rec.loss(losses.mean(), per_sample=losses)` followed by a new
        `losses.mean().backward()` is found through `per_sample`.

        scale: Σᵢ ℓᵢ / loss, i.e. gᵢ = scale · ∂loss/∂(sample i's part): B for a mean, 1
        for a sum, k·B for a mean divided by k micro-batches. unit: ∂loss/∂(one element
        of per_sample) (1 / (scale·T) for a mean over T parts per sample, 1 / scale for a
        sum). Whatever multiplies the loss on its way to the backpropagated root (loss / k,
        a GradScaler) is read from the backward pass itself.
        """
        scale = self._check_scale(scale)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("add_loss needs the scalar loss tensor that will be backpropagated")
        index = len(self._micros)
        size = per_sample.shape[0] if isinstance(per_sample, Tensor) and per_sample.dim() else None
        self._micros.append(_Micro(scale, size, unit=1.0 / scale if unit is None else unit))
        self._built = None
        self._batch = None
        nodes = [(t.grad_fn, t is not loss) for t in (loss, per_sample)
                 if isinstance(t, Tensor) and t.grad_fn is not None]
        for node, via_parts in nodes:  # none: reported as "no gradients were captured"
            self._handles.append(node.register_prehook(partial(self._on_root, index, via_parts)))
        if nodes:
            self._find_broadcasts(index, nodes[0][0])

    def _on_root(self, index: int, via_parts: bool, grad_outputs: tuple) -> None:
        """A backward pass reached loss `index`: claim it unless a better one already did."""
        if hooks_paused() or not accumulates(self._params.values()):
            return  # an autograd.grad pass (a norm for logging, a penalty): not .grad's
        micro = self._micros[index]
        task, differentiable = graph_task(), torch.is_grad_enabled()
        if micro.task is not None and (not micro.provisional or differentiable):
            return  # the first plain pass wins; create_graph passes are gradient penalties
        if micro.task is not None:  # a create_graph pass came first: drop what it left
            for _, call in self._order:
                if call.micro == index:
                    call.grads = [None] * len(call.grads)
                    call.micro = None
                    call.broadcast = None
            micro.observed = {}
        root = grad_outputs[0]
        micro.task, micro.provisional, micro.via_parts = task, differentiable, via_parts
        micro.root = None if root is None else root.detach()

    def _find_broadcasts(self, index: int, root: Any) -> None:
        """Hooks on the consumers of batch-size-1 outputs that are added to batched tensors
        (a position embedding of (1, T) positions): their output gradient is the per-sample
        gradient the broadcast output lacks. One walk of the loss's graph, only when such a
        call exists."""
        sizes: Counter[int] = Counter()
        single: dict[Any, Call] = {}  # output node -> call on inputs of batch size 1
        for i, call in self._order:
            if call.micro is not None or call.error is not None:
                continue
            with contextlib.suppress(Unsupported):
                size = self._hooked[i].rule.batch_size(call)
                sizes[size] += 1
                if size == 1 and call.node is not None and self._hooked[i].rule.batch_dim0:
                    single[call.node] = call
        batch = self._micros[index].size or (sizes.most_common(1)[0][0] if sizes else 1)
        if not single or batch <= 1:
            return
        consumers: dict[Any, list[tuple[Any, int]]] = {}
        seen, queue = {root}, deque([root])
        while queue:
            node = queue.popleft()
            for position, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                if child in single:
                    consumers.setdefault(child, []).append((node, position))
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
        for child, uses in consumers.items():
            call = single[child]
            others = sorted({type(node).__name__ for node, _ in uses} - set(_BROADCAST_SIGNS))
            if others:
                call.error = (
                    f"its output has batch size 1 and reaches the loss through {others[0]}, "
                    "which deepscope cannot split per sample (only + and - broadcasts are)"
                )
                continue
            for node, position in uses:
                sign = _BROADCAST_SIGNS[type(node).__name__][position]
                factor = sign * (node._saved_alpha if position == 1 else 1)
                hook = partial(self._on_broadcast, index, call, factor)
                self._handles.append(node.register_prehook(hook))

    def _on_broadcast(self, index: int, call: Call, factor: float, grad_outputs: tuple) -> None:
        if hooks_paused() or grad_outputs[0] is None or call.error is not None:
            return
        if self._micros[index].task != self._task_now():
            return
        g = grad_outputs[0] if factor == 1 else grad_outputs[0] * factor
        call.broadcast = g if call.broadcast is None else call.broadcast + g

    # -- per-step setup -----------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """The number of samples: B, or Σ over micro-batches (registered losses) of theirs;
        each one's is the batch dim size most of its module calls agree on (normally dim 0
        of every input)."""
        if self._batch is None:
            self._batch = sum(size for _, size in self._micro_sizes())
        return self._batch

    @property
    def micro_batch_sizes(self) -> list[int]:
        """Samples per registered loss, in registration order ([B] without add_loss)."""
        return [size for _, size in self._micro_sizes()]

    def _effective_calls(self) -> dict[int, list[tuple[int, Call]]]:
        """micro-batch -> [(module index, call)] of the calls with gradients; a call whose
        batch-size-1 output was broadcast over the batch is replaced by its per-sample form
        (size-1 inputs expanded to the batch, the broadcast result's gradient)."""
        if self._effective is None:
            calls: dict[int, list[tuple[int, Call]]] = {}
            for index, call in self._order:
                if (any(g is not None for g in call.grads) or call.error is not None
                        or call.kept is not None):
                    micro = call.micro if self._micros else 0
                    if micro is not None:
                        calls.setdefault(micro, []).append((index, _expanded(call)))
            self._effective = calls
        return self._effective

    def _micro_sizes(self) -> list[tuple[int, int]]:
        """(micro-batch, samples) in registration order: per_sample's batch when add_loss got
        it, else the batch size most calls agree on."""
        if self._sizes is not None:
            return self._sizes
        if not self._order:
            raise ValueError(
                "no forward pass was captured: call engine.start() before the model's forward"
            )
        effective = self._effective_calls()
        sizes = []
        for micro in range(max(len(self._micros), 1)):
            counts: Counter[int] = Counter()
            why: dict[str, str] = {}  # module -> why it has no batch size
            for index, call in effective.get(micro, []):
                try:
                    counts[self._samples(index, call)] += 1
                except Unsupported as error:
                    why.setdefault(self._hooked[index].label, str(error))
            which = f" of loss {micro + 1} (micro-batch {micro + 1})" if self._micros else ""
            if not counts and why:
                raise ValueError(
                    f"no module reached by the backward pass{which} has a batch dimension: "
                    + "; ".join(f"{label}: {reason}" for label, reason in why.items()))
            if not counts and not self._micros:
                raise ValueError(
                    "no gradients were captured: call backward() on the loss after the forward, "
                    "and engine.stop() only after it"
                )
            if not counts and micro in self._shared_forward:
                raise ValueError(
                    f"loss {micro + 1} reached only module outputs of an earlier registered "
                    "loss's forward (two registered losses on one forward are not two "
                    "micro-batches): register their sum once, or run a forward per micro-batch")
            if not counts:
                raise ValueError(
                    f"no gradients were captured{which}: no backward pass ran through the loss "
                    "or per_sample given to rec.loss; call rec.loss after the forward and "
                    "before backward() on that loss"
                )
            given = self._micros[micro].size if self._micros else None
            if given is not None and given not in counts:
                raise ValueError(
                    f"the model saw a batch{which} of {counts.most_common(1)[0][0]} samples but "
                    f"per_sample has {given}; pass the per-sample losses of this batch")
            sizes.append((micro, given or counts.most_common(1)[0][0]))
        self._sizes = sizes
        return sizes

    def _check_scale(self, scale: float) -> float:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a number (e.g. the batch size), got {scale!r}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be finite and > 0 (B for a mean loss), got {scale}")
        return float(scale)

    def set_scale(self, scale: float) -> None:
        """Set the factor from captured output gradients to gradients of the ℓᵢ:
        B when the backpropagated loss was the mean of the ℓᵢ, 1 when it was their sum.
        (Without `add_loss` only; a registered loss carries its own.)"""
        scale = self._check_scale(scale)
        if scale != self._scale:
            self._scale = scale
            self._built = None

    def _micro_scale(self, micro: int) -> float:
        """Factor from captured output gradients to gradients of the ℓᵢ of a micro-batch."""
        if not self._micros:
            return self._scale
        entry = self._micros[micro]
        if entry.root is None:
            return entry.scale
        if entry.via_parts:  # ∂root/∂per_sample: one factor for every element, or no gᵢ
            low, high = (float(v) for v in torch.aminmax(entry.root.reshape(-1)))
            if abs(high - low) > 1e-6 * max(abs(high), abs(low)):
                raise Unsupported(
                    "the backpropagated loss weighs the elements of per_sample unequally "
                    f"(from {low:.3g} to {high:.3g}); pass rec.loss the loss you backpropagate")
            root = high / entry.unit
        else:
            root = float(entry.root.reshape(()))
        if not math.isfinite(root) or root == 0:
            raise Unsupported(f"the backward pass scaled the loss by {root}")
        return entry.scale / root

    def _build(self) -> dict[int, ModuleGrads | str]:
        """ModuleGrads (or the reason there are none) per hooked module with gradients."""
        if self._built is not None:
            return self._built
        sizes = self._micro_sizes()
        batch = self.batch_size
        effective = self._effective_calls()
        # kept per-sample gradients never outweigh the largest module's: peak memory stays
        # within the training's plus about one layer's per-sample gradients
        largest = max((batch * sum(p.numel() * p.element_size() for p in h.rule.params.values())
                       for h in self._hooked), default=0)
        budget = Budget(min(self.cache_bytes, largest))
        by_module: dict[int, dict[int, list[Call]]] = {}
        for micro, pairs in effective.items():
            for index, call in pairs:
                by_module.setdefault(index, {}).setdefault(micro, []).append(call)
        built: dict[int, ModuleGrads | str] = {}
        for index, per_micro in by_module.items():
            hooked = self._hooked[index]
            warn = partial(self._module_warn, hooked)
            try:
                blocks = []
                for micro, size in sizes:
                    calls = per_micro.get(micro)
                    if not calls:
                        blocks.append((size, None))
                        continue
                    counting = (_Counting(self, index) if self._new_counter is not None
                                and len(sizes) == 1 else None)
                    ctx = Context(size, self._micro_scale(micro), self.chunk_size, budget, warn,
                                  counting)
                    blocks.append((size, self._module_grads(index, calls, ctx)))
                if len(blocks) == 1:
                    built[index] = blocks[0][1]
                else:
                    ctx = Context(batch, 1.0, self.chunk_size, budget, warn)
                    built[index] = StackedGrads(blocks, hooked.rule.params, ctx)
            except Unsupported as error:
                built[index] = str(error)
                warn(f"{error}; its per-sample gradients are reported as NaN")
        self._built = built
        self._status = None
        self._cache = {}
        self._shared = {}
        self.swept = {}
        return built

    def _ambiguous(self, index: int, call: Call, batch: int) -> bool:
        """Whether a dim-0-batch call's input (B, B, …) may be (sequence, batch, …): in a
        step with a sequence-first call, e.g. a Linear after nn.MultiheadAttention with
        batch_first=False, when the sequence is as long as the batch."""
        hooked = self._hooked[index]
        rule = hooked.rule
        if (not self._sequence_first or not rule.batch_dim0 or rule.channels_at_dim1
                or hooked.transposed):  # transposed: known to be (T, B, …)
            return False
        leaves = tensor_leaves((call.args, call.kwargs))
        return bool(leaves) and leaves[0].dim() >= 2 and leaves[0].shape[:2] == (batch, batch)

    def _samples(self, index: int, call: Call) -> int:
        """A call's batch size (Unsupported: why it has none)."""
        return call.samples if call.kept is not None else self._hooked[index].rule.batch_size(call)

    def _module_grads(self, index: int, calls: list[Call], ctx: Context) -> ModuleGrads:
        """One module's statistics over one micro-batch's calls (Unsupported: why none)."""
        hooked = self._hooked[index]
        for call in calls:
            if call.error is not None:
                raise Unsupported(call.error)
            if call.kept is not None:
                continue
            if _edited(call):
                ctx.warn(
                    "an input was modified in place after its forward (e.g. by an in-place "
                    "op): its per-sample gradients use the modified values; avoid the "
                    "in-place op"
                )
        seen = sorted({self._samples(index, c) for c in calls})
        if seen != [ctx.batch_size]:
            broadcast = 1 in seen and ctx.batch_size > 1
            raise Unsupported(
                f"its input batch size is {', '.join(map(str, seen))} but the batch has "
                f"{ctx.batch_size} samples"
                + ("; its batch-size-1 output was not added to the batch (+ or -) on its way "
                   "to the loss, so it has no per-sample gradient" if broadcast else
                   " (the batch must be dim 0 of every module input)")
            )
        if any(self._ambiguous(index, c, ctx.batch_size) for c in calls if c.kept is None):
            raise Unsupported(
                f"its input is ({ctx.batch_size}, {ctx.batch_size}, …) in a model with "
                "sequence-first modules (batch_first=False): its dim 0 may be the sequence, "
                "not the batch; use batch_first=True, or a sequence length other than the "
                "batch size")
        kept = [c.kept for c in calls if c.kept is not None]
        if not kept:
            return hooked.rule.grads(calls, ctx)
        rest = [c for c in calls if c.kept is None]
        # gᵢ of a module called several times is the sum over its calls
        parts = kept + ([hooked.rule.grads(rest, ctx).all_per_sample()] if rest else [])
        totals = parts[0]
        for part in parts[1:]:
            totals = {name: g + part[name] for name, g in totals.items()}
        return DenseGrads(totals, ctx)

    def _module_warn(self, hooked: _Hooked, message: str) -> None:
        self._warn(f"{hooked.label}: {message}")

    def _owners_of(self, name: str) -> list[tuple[int, str]] | str | None:
        """Live (module, local name) pairs of a parameter; a NaN reason; or None for zero."""
        if self._status is None:
            built = self._build()
            status: dict[str, list[tuple[int, str]] | str | None] = {}
            for pname, owners in self._owners.items():
                live = [(i, local) for i, local in owners if i in built]
                reasons = [built[i] for i, _ in live if isinstance(built[i], str)]
                if reasons:
                    status[pname] = reasons[0]
                elif live:
                    status[pname] = live
                elif any(pname in kept for kept in self._delivered_maps()):
                    modules = ", ".join(self._hooked[i].label for i, _ in owners) or "none"
                    status[pname] = (
                        f"it received a gradient, but its module ({modules}) passed none on; "
                        "it is used outside its module's forward (e.g. a tied weight read "
                        "directly): register a rule with recursive = True for the module "
                        "that uses it"
                    )
                    self._warn(f"parameter '{pname}': {status[pname]}; reported as NaN")
                else:
                    status[pname] = None  # no gradient reached it: gᵢ = 0
            self._status = status
            self.unavailable = {n: s for n, s in status.items() if isinstance(s, str)}
        return self._status[name]

    # -- results ------------------------------------------------------------------------
    def _constant(self, name: str, per_sample: bool, value: float) -> Tensor:
        p = self._params[name]
        shape = (self.batch_size,) if per_sample else p.shape
        return torch.full(shape, value, dtype=p.dtype, device=p.device)

    def _gather(
        self, key: str, per_sample: bool, single: Callable[[int], dict[str, Tensor]]
    ) -> dict[str, Tensor]:
        """name -> statistic, by `single(module index)` from each parameter's module (cached
        per step)."""
        self._build()
        if key not in self._cache:
            out = {}
            modules: dict[int, dict[str, Tensor]] = {}  # one call per module
            for name in self.param_names:
                owners = self._owners_of(name)
                if owners is None:
                    out[name] = self._constant(name, per_sample, 0.0)
                elif isinstance(owners, str):
                    total = self._delivered_sum(name) if key == "sum" else None
                    if total is None:
                        self.unavailable_sum[name] = owners
                    out[name] = self._constant(name, per_sample, math.nan) if total is None \
                        else total
                elif len(owners) == 1:
                    index, local = owners[0]
                    if index not in modules:
                        modules[index] = single(index)
                    out[name] = modules[index][local]
                else:
                    out[name] = self._shared_stats(name, owners)[key]
            self._cache[key] = out
        return dict(self._cache[key])

    def _shared_stats(self, name: str, owners: list[tuple[int, str]]) -> dict[str, Tensor]:
        """Statistics of a parameter used by several modules: gᵢ is the sum over them."""
        if name not in self._shared:
            batch = self.batch_size
            step = samples_per_chunk(self.chunk_size, self._params[name].numel())
            sq, total, squares = [], 0, 0
            for lo in range(0, batch, step):
                hi = min(lo + step, batch)
                g = sum(self._built[i].chunk(lo, hi)[local] for i, local in owners)
                sq.append(g.flatten(1).square().sum(1))
                total = total + g.sum(0)
                squares = squares + g.square().sum(0)
            self._shared[name] = {"sq": torch.cat(sq), "sum": total, "m2": squares}
        return self._shared[name]

    def sq_norms(self) -> dict[str, Tensor]:
        """name -> (B,) ‖gᵢ⁽ᵏ⁾‖² (squared L2 norm of each sample's gradient)."""
        return self._gather("sq", True, lambda i: self._built[i].sq_norms())

    def grad_mean(self) -> dict[str, Tensor]:
        """name -> ḡ⁽ᵏ⁾ = (1/B) Σᵢ gᵢ⁽ᵏ⁾, parameter-shaped (the mean-loss gradient). It needs
        no per-sample gradients: for a parameter without them it is what autograd delivered
        in the loss's backward pass, NaN only when that is unusable too (`unavailable_sum`)."""
        sums = self._gather("sum", False, self._module_sum)
        return {name: s / self.batch_size for name, s in sums.items()}

    def _module_sum(self, index: int) -> dict[str, Tensor]:
        """Σᵢ gᵢ of one module's parameters. The gradients autograd delivered are offered
        to the rule, which may accept them after a cheap check instead of recomputing:
        they differ from Σᵢ gᵢ when the backpropagated loss has terms that reach the
        parameter other than through this module's outputs (a penalty on θ), or when
        they were edited in place (clipping)."""
        hooked = self._hooked[index]

        def observed(micro: int) -> dict[str, Tensor]:
            out = {}
            for local, name in hooked.names.items():
                value = self._delivered(name, micro) if len(self._owners[name]) == 1 else None
                if isinstance(value, Tensor):
                    out[local] = value
            return out

        built = self._built[index]
        micros = [micro for micro, _ in self._micro_sizes()]
        if isinstance(built, StackedGrads):
            return built.grad_sum_blocks([observed(m) for m in micros])
        return built.grad_sum(observed(micros[0]))

    def _delivered_maps(self) -> list[dict[str, tuple[Tensor, int]]]:
        """What autograd delivered to the parameters, per registered loss (one map without)."""
        return [m.observed for m in self._micros] if self._micros else [self._observed]

    def _delivered(self, name: str, micro: int) -> Tensor | bool:
        """Σᵢ gᵢ over a micro-batch as scale · ∂L/∂θ from what autograd delivered in its
        backward; False when nothing was delivered, True when it is unusable (edited in place
        since, e.g. by gradient clipping, or the pass scaled the loss by 0)."""
        kept = self._delivered_maps()[micro].get(name)
        if kept is None:
            return False
        if kept[0]._version != kept[1]:
            return True
        try:
            return kept[0] * self._micro_scale(micro)
        except Unsupported:
            return True

    def _delivered_sum(self, name: str) -> Tensor | None:
        """Σᵢ gᵢ of a parameter from what autograd delivered, or None if unusable."""
        total = None
        for micro, _ in self._micro_sizes():
            value = self._delivered(name, micro)
            if value is True:
                return None
            if isinstance(value, Tensor):
                total = value if total is None else total + value
        return total

    def second_moments(self) -> dict[str, Tensor]:
        """name -> Σᵢ (gᵢ⁽ᵏ⁾)² elementwise, parameter-shaped (not divided by B)."""
        return self._gather("m2", False, lambda i: self._built[i].second_moments())

    def dots(self, vectors: dict[str, Tensor]) -> dict[str, Tensor]:
        """name -> (B,) gᵢ⁽ᵏ⁾·v⁽ᵏ⁾ for each name in `vectors` (parameter-shaped tensors);
        parameters missing from `vectors` are skipped."""
        return self.dots_many([vectors])[0]

    def dots_many(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """`dots` of several sets of vectors, from one pass over each module's captures."""
        checked_sets = [self._check_vectors(vectors) for vectors in vector_sets]
        built = self._build()
        out: list[dict[str, Tensor]] = [{} for _ in checked_sets]
        # module index -> one {local name: vector} per set
        per_module: dict[int, list[dict[str, Tensor]]] = {}
        for k, checked in enumerate(checked_sets):
            for name, v in checked.items():
                owners = self._owners_of(name)
                if owners is None:
                    out[k][name] = self._constant(name, True, 0.0)
                elif isinstance(owners, str):
                    out[k][name] = self._constant(name, True, math.nan)
                else:
                    for index, local in owners:
                        sets = per_module.setdefault(index, [{} for _ in checked_sets])
                        sets[k][local] = v
        for index, sets in per_module.items():  # one call per module: shared passes
            for k, dots in enumerate(built[index].dots(sets)):
                for local, dot in dots.items():
                    name = self._hooked[index].names[local]
                    out[k][name] = out[k][name] + dot if name in out[k] else dot
        return [{name: got[name] for name in checked} for got, checked in zip(out, checked_sets)]

    def _check_vectors(self, vectors: dict[str, Tensor]) -> dict[str, Tensor]:
        """`vectors` validated, in each parameter's dtype and device."""
        if not isinstance(vectors, dict):
            raise TypeError(f"vectors must be a dict name -> tensor, got {type(vectors).__name__}")
        checked = {}
        for name, v in vectors.items():
            if name not in self._params:
                raise ValueError(f"dots(): unknown parameter {name!r}; use engine.param_names")
            p = self._params[name]
            if not isinstance(v, Tensor) or v.shape != p.shape:
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(
                    f"dots(): vector for {name!r} must have the parameter's shape "
                    f"{tuple(p.shape)}, got {got}"
                )
            checked[name] = v.to(device=p.device, dtype=p.dtype)
        return checked

    def per_sample_parts(self, skip: Collection[str] = ()) -> Iterator[tuple[str, Part]]:
        """(name, part) covering every parameter's gᵢ, without joining them: consecutive
        samples per part, in sample order per parameter, one module's at a time (parts of
        one module's parameters interleave). A part is a (b, *param.shape) tensor or, for
        outer-product layers, a `RankOne` factorisation (see `rules.base`). Parameters in
        `skip` are left out (a module whose parameters all are is not materialised)."""
        built = self._build()
        batch = self.batch_size
        done: set[int] = set()
        for name in self.param_names:
            if name in skip:
                continue
            owners = self._owners_of(name)
            step = samples_per_chunk(self.chunk_size, self._params[name].numel())
            if owners is None or isinstance(owners, str):
                value = 0.0 if owners is None else math.nan
                p = self._params[name]
                for lo in range(0, batch, step):
                    shape = (min(step, batch - lo), *p.shape)
                    yield name, torch.full(shape, value, dtype=p.dtype, device=p.device)
            elif len(owners) > 1:  # shared: gᵢ is the sum over the modules using it
                for lo in range(0, batch, step):
                    hi = min(lo + step, batch)
                    yield name, sum(built[i].chunk(lo, hi)[local] for i, local in owners)
            elif owners[0][0] not in done:
                index = owners[0][0]
                done.add(index)
                names = self._hooked[index].names
                alone = {local for local, n in names.items()
                         if self._owners_of(n) == [(index, local)] and n not in skip}
                if not alone:
                    continue
                for part in built[index].parts():
                    for local, value in part.items():
                        if local in alone:
                            yield names[local], value

    def per_sample_grads(self) -> Iterator[tuple[str, Tensor]]:
        """(name, (B, *param.shape) gᵢ) for every parameter, one module's at a time."""
        built = self._build()
        current: tuple[int, dict[str, Tensor]] | None = None
        for name in self.param_names:
            owners = self._owners_of(name)
            if owners is None or isinstance(owners, str):
                value = 0.0 if owners is None else math.nan
                p = self._params[name]
                yield (
                    name,
                    torch.full((self.batch_size, *p.shape), value, dtype=p.dtype, device=p.device),
                )
            elif len(owners) == 1:
                index, local = owners[0]
                if current is None or current[0] != index:
                    current = None  # drop the previous module's tensors first
                    current = (index, built[index].all_per_sample())
                yield name, current[1][local]
            else:
                yield name, sum(built[i].all_per_sample()[local] for i, local in owners)
