"""Per-sample gradient statistics of any PyTorch model, without keeping per-sample grads.

Usage (one step):

    engine = PerSampleEngine(model)
    engine.start()                      # hooks on; old captures dropped
    losses = loss_fn(model(x), y, reduction="none")
    losses.mean().backward()
    engine.stop()                       # hooks off; captures kept
    engine.set_scale(len(x))            # the loss was a mean: gᵢ = B · captured gradients
    opt.step()                          # allowed: nothing below reads current parameters
    norms = engine.sq_norms()           # name -> (B,) ‖gᵢ‖²

Forward hooks keep each call's inputs, tensor hooks on the outputs keep ∂L/∂output;
per-module rules (`deepscope.instruments.rules`) turn them into statistics by closed
forms (Linear, Conv, Embedding, norms) or by torch.func re-runs (everything else).
Notation: B batch size, gᵢ = ∇θ ℓᵢ (not divided by B), k a parameter tensor.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..hookstate import hooks_paused
from .rules import GenericRule, rule_for
from .rules.base import (
    Budget,
    Call,
    Context,
    ModuleGrads,
    Part,
    Rule,
    Unsupported,
    map_tensors,
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


def _detach(x: Tensor) -> Tensor:
    return x.detach()  # same storage and version counter: no copy, in-place edits visible


class PerSampleEngine:
    """Per-sample gradient statistics gᵢ⁽ᵏ⁾ = ∇θ⁽ᵏ⁾ ℓᵢ for every trainable parameter.

    model:       any nn.Module; the batch is dim 0 of each module's input (the rules for
                 nn.MultiheadAttention and RNNs follow their `batch_first`).
    chunk_size:  samples per chunk whenever per-sample gradients are materialised.
    cache_bytes: per-sample gradients up to this many bytes (all modules together, and at
                 most the largest module's) are kept for reuse within a step; beyond it they
                 are recomputed when needed.

    Parameter names are those of `model.named_parameters()` (a shared parameter once,
    under its first name); only parameters with requires_grad count. Results are in each
    parameter's dtype and device. Parameters whose per-sample gradients cannot be
    obtained this step are NaN, listed in `unavailable` with the reason, and explained
    once in `warnings`.
    """

    def __init__(self, model: nn.Module, chunk_size: int = 32, *, cache_bytes: int = 2**28) -> None:
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
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.param_names: list[str] = list(self._params)
        self._hooked = self._find_modules()
        # parameter name -> [(index into _hooked, module-local name)]
        self._owners: dict[str, list[tuple[int, str]]] = {n: [] for n in self.param_names}
        for index, hooked in enumerate(self._hooked):
            for local, name in hooked.names.items():
                self._owners[name].append((index, local))
        self._scale = 1.0
        self._handles: list[RemovableHandle] = []
        # ∂L/∂θ as autograd delivered it to each parameter this step (summed over backward
        # passes), with its version counter then: in-place edits later (clipping) disqualify it
        self._observed: dict[str, tuple[Tensor, int]] = {}
        self._reset_step_state()

    # -- setup ------------------------------------------------------------------------
    def _find_modules(self) -> list[_Hooked]:
        engine_name = {id(p): n for n, p in self._params.items()}
        covered: set[int] = set()  # submodules whose parameters a recursive rule owns
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
            label = f"{type(module).__name__} '{module_name or '<model>'}'"
            rule = rule_cls(module, params)
            reason = rule.unsupported()
            if reason is not None:
                self._warn(f"{label}: {reason}; using the generic rule, one sample at a time")
                rule = GenericRule(module, params)
                rule.batched = False  # the reasons are couplings between samples
            names = {local: engine_name[id(p)] for local, p in params.items()}
            hooked.append(_Hooked(label, module, rule, names))
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
        self._cache: dict[str, dict[str, Tensor]] = {}
        self._shared: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

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
        self.unavailable = {}
        self._reset_step_state()

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
        call = Call(
            args=map_tensors(args, _detach),
            kwargs=map_tensors(kwargs, _detach),
            out_index=slots,
            grads=[None] * len(slots),
            in_versions=[x._version for x in tensor_leaves((args, kwargs))],
            extra=hooked.rule.capture(args, kwargs),
        )
        if hooked.rule.keeps_outputs:
            call.outputs = [leaves[j].detach() for j in slots]
            call.out_versions = [leaves[j]._version for j in slots]
        for slot, j in enumerate(slots):
            self._handles.append(leaves[j].register_hook(partial(self._on_grad, call, slot)))
        hooked.calls.append(call)
        self._order.append((index, call))
        self._built = None
        self._batch = None

    @staticmethod
    def _on_grad(call: Call, slot: int, grad: Tensor) -> None:
        if hooks_paused():  # deepscope's own backward passes (curvature) are not the user's
            return
        # several backward passes through one output add up, like .grad does
        previous = call.grads[slot]
        call.grads[slot] = grad if previous is None else previous + grad

    def _on_param_grad(self, name: str, grad: Tensor) -> None:
        if hooks_paused():
            return
        previous = self._observed.get(name)
        total = grad if previous is None else previous[0] + grad
        self._observed[name] = (total, total._version)

    # -- per-step setup -----------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """B: the batch dim size most module calls agree on (normally dim 0 of every input)."""
        if self._batch is None:
            if not self._order:
                raise ValueError(
                    "no forward pass was captured: call engine.start() before the model's forward"
                )
            sizes: Counter[int] = Counter()
            for index, call in self._order:
                if any(g is not None for g in call.grads):
                    try:
                        sizes[self._hooked[index].rule.batch_size(call)] += 1
                    except Unsupported:
                        continue
            if not sizes:
                raise ValueError(
                    "no gradients were captured: call backward() on the loss after the forward, "
                    "and engine.stop() only after it"
                )
            self._batch = sizes.most_common(1)[0][0]
        return self._batch

    def set_scale(self, scale: float) -> None:
        """Set the factor from captured output gradients to gradients of the ℓᵢ:
        B when the backpropagated loss was the mean of the ℓᵢ, 1 when it was their sum."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a number (e.g. the batch size), got {scale!r}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be finite and > 0 (B for a mean loss), got {scale}")
        if scale != self._scale:
            self._scale = float(scale)
            self._built = None

    def _build(self) -> dict[int, ModuleGrads | str]:
        """ModuleGrads (or the reason there are none) per hooked module with gradients."""
        if self._built is not None:
            return self._built
        batch = self.batch_size
        # kept per-sample gradients never outweigh the largest module's: peak memory stays
        # within the training's plus about one layer's per-sample gradients
        largest = max((batch * sum(p.numel() * p.element_size() for p in h.rule.params.values())
                       for h in self._hooked), default=0)
        budget = Budget(min(self.cache_bytes, largest))
        built: dict[int, ModuleGrads | str] = {}
        for index, hooked in enumerate(self._hooked):
            calls = [c for c in hooked.calls if any(g is not None for g in c.grads)]
            if not calls:
                continue
            warn = partial(self._module_warn, hooked)
            ctx = Context(batch, self._scale, self.chunk_size, budget, warn)
            for call in calls:
                current = [x._version for x in tensor_leaves((call.args, call.kwargs))]
                if current != call.in_versions:
                    warn(
                        "an input was modified in place after its forward (e.g. by an in-place "
                        "op): its per-sample gradients use the modified values; avoid the "
                        "in-place op"
                    )
            try:
                seen = sorted({hooked.rule.batch_size(c) for c in calls})
                if seen != [batch]:
                    raise Unsupported(
                        f"its input batch size is {', '.join(map(str, seen))} but the batch has "
                        f"{batch} samples (the batch must be dim 0 of every module input; a "
                        "tensor broadcast over the batch has no per-sample gradient)"
                    )
                built[index] = hooked.rule.grads(calls, ctx)
            except Unsupported as error:
                built[index] = str(error)
                warn(f"{error}; its per-sample gradients are reported as NaN")
        self._built = built
        self._status = None
        self._cache = {}
        self._shared = {}
        return built

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
                elif pname in self._observed:
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
                    out[name] = self._constant(name, per_sample, math.nan)
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
            batch, step = self.batch_size, self.chunk_size
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
        """name -> ḡ⁽ᵏ⁾ = (1/B) Σᵢ gᵢ⁽ᵏ⁾, parameter-shaped (the mean-loss gradient)."""
        sums = self._gather("sum", False, self._module_sum)
        return {name: s / self.batch_size for name, s in sums.items()}

    def _module_sum(self, index: int) -> dict[str, Tensor]:
        """Σᵢ gᵢ of one module's parameters. The gradients autograd delivered are offered
        to the rule, which may accept them after a cheap check instead of recomputing:
        they differ from Σᵢ gᵢ when the backpropagated loss has terms that reach the
        parameter other than through this module's outputs (a penalty on θ), or when
        they were edited in place (clipping)."""
        hooked = self._hooked[index]
        observed = {}
        for local, name in hooked.names.items():
            kept = self._observed.get(name)
            if kept is not None and kept[0]._version == kept[1] and len(self._owners[name]) == 1:
                observed[local] = kept[0] * self._scale  # Σᵢ gᵢ = scale · ∂L/∂θ
        return self._built[index].grad_sum(observed)

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

    def per_sample_parts(self) -> Iterator[tuple[str, Part]]:
        """(name, part) covering every parameter's gᵢ, without joining them: consecutive
        samples per part, in sample order per parameter, one module's at a time (parts of
        one module's parameters interleave). A part is a (b, *param.shape) tensor or, for
        outer-product layers, a `RankOne` factorisation (see `rules.base`)."""
        built = self._build()
        batch = self.batch_size
        done: set[int] = set()
        for name in self.param_names:
            owners = self._owners_of(name)
            if owners is None or isinstance(owners, str):
                value = 0.0 if owners is None else math.nan
                p = self._params[name]
                for lo in range(0, batch, self.chunk_size):
                    shape = (min(self.chunk_size, batch - lo), *p.shape)
                    yield name, torch.full(shape, value, dtype=p.dtype, device=p.device)
            elif len(owners) > 1:  # shared: gᵢ is the sum over the modules using it
                for lo in range(0, batch, self.chunk_size):
                    hi = min(lo + self.chunk_size, batch)
                    yield name, sum(built[i].chunk(lo, hi)[local] for i, local in owners)
            elif owners[0][0] not in done:
                index = owners[0][0]
                done.add(index)
                names = self._hooked[index].names
                alone = {local for local, n in names.items()
                         if self._owners_of(n) == [(index, local)]}
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
