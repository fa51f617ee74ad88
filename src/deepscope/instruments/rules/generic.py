"""The generic rule: per-sample gradients of any module by re-running it with torch.func.

For each captured call the module is re-run functionally (`functional_call`) on copies
of its parameters taken at forward time and on the saved inputs, and the saved output
gradients are pulled back with `vjp`:
  - per-sample gradients: `vmap` over samples (each re-run on a batch of one), chunked by
    `chunk_size`; when vmap cannot handle the module (data-dependent control flow, ops
    without batching rules) a per-sample loop, recorded in the warnings;
  - Σᵢ gᵢ: one vjp over the whole batch;
  - gᵢ·v: one forward-mode jvp over the whole batch per parameter, gᵢ·v = Gᵢ·(Jᵢ v).
A re-run that does not reproduce the recorded output (dropout, changed state) is reported.
All of this assumes that a sample's outputs depend on that sample's inputs only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn.utils import parametrize

from ...hookstate import paused
from .base import (
    Call,
    Context,
    ModuleGrads,
    Rule,
    Unsupported,
    first_input,
    first_input_or_none,
    map_tensors,
    tensor_leaves,
)

try:  # the math attention kernel has forward-AD formulas and batching rules
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def _math_attention() -> contextlib.AbstractContextManager:
        return sdpa_kernel([SDPBackend.MATH])

except ImportError:  # PyTorch < 2.3

    def _math_attention() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@dataclass
class _Prepared:
    """One call, ready for re-running: tensor inputs, their batch dims, output gradients."""

    leaves: list[Tensor]  # tensor leaves of (args, kwargs)
    in_dims: list[int | None]  # batch dim of each leaf, None = shared by all samples
    rebuild: Callable[[list[Tensor]], tuple[tuple, dict]]
    select: list[int]  # output tensor leaves that received a gradient
    gouts: list[Tensor]  # their scaled gradients
    out_dims: list[int]
    params: dict[str, Tensor]  # copies of its own parameters from forward time
    fixed: dict[str, Tensor]  # copies of its submodules' parameters from forward time
    recorded: list[Tensor | None]  # recorded outputs (None where modified in place since)
    buffers: dict[str, Tensor]  # buffer copies from forward time (over the step's copies)


class GenericGrads(ModuleGrads):
    """Per-sample gradients of one module's parameters by functional re-runs."""

    def __init__(self, rule: GenericRule, calls: list[_Prepared], ctx: Context) -> None:
        first = next(iter(calls[0].params.values()))
        super().__init__({n: p.shape for n, p in calls[0].params.items()}, first.dtype, ctx)
        self.rule = rule
        self.calls = calls
        # copies, so that a re-run that updates buffers (BatchNorm inside) changes nothing
        self.buffers = {n: b.detach().clone() for n, b in rule.module.named_buffers()}
        self._sum: dict[str, Tensor] | None = None
        self._checked: set[int] = set()

    # -- re-running ------------------------------------------------------------------
    def _run(self, call: _Prepared, leaves: list[Tensor], params: dict[str, Tensor]) -> tuple:
        """The call's gradient-carrying outputs, re-run on `leaves` with `params`."""
        args, kwargs = call.rebuild(leaves)
        with self.rule.rerunning():
            out = functional_call(self.rule.module,
                                  {**self.buffers, **call.buffers, **call.fixed, **params},
                                  args, kwargs)
        outs = tensor_leaves(out)
        return tuple(outs[j] for j in call.select)

    def _vjp(self, call: _Prepared, leaves: list[Tensor], gouts: list[Tensor]) -> tuple:
        """(Σ over the given samples of gᵢ, outputs) for one call."""
        outs, pull = vjp(partial(self._run, call, leaves), call.params)
        return pull(tuple(gouts))[0], outs

    def _check(self, index: int, call: _Prepared, outs: tuple, lo: int) -> None:
        """Warn once per call if re-running did not reproduce the recorded outputs.

        `outs` are sample-first and start at sample `lo`."""
        if index in self._checked:
            return
        self._checked.add(index)
        for out, recorded, d in zip(outs, call.recorded, call.out_dims):
            if recorded is None:
                continue
            ref = recorded.movedim(d, 0)[lo : lo + out.shape[0]].to(out.dtype)
            tol = 1e-3 * float(ref.abs().max()) if ref.numel() else 0.0
            if out.shape != ref.shape or not torch.allclose(out, ref, rtol=1e-3, atol=tol):
                self.ctx.warn(
                    "re-running it did not reproduce its recorded output (randomness such as "
                    "dropout, or state changed since the forward): its per-sample gradients "
                    "are unreliable"
                )
                return

    def _per_sample_vmap(self, call: _Prepared, leaves: list[Tensor], gouts: list[Tensor]):
        def one(leaves_i: tuple, gouts_i: tuple) -> tuple:
            # each sample is re-run as a batch of one, the shape the module expects
            batch1 = [x if d is None else x.unsqueeze(d) for x, d in zip(leaves_i, call.in_dims)]
            gouts1 = [g.unsqueeze(d) for g, d in zip(gouts_i, call.out_dims)]
            grads, outs = self._vjp(call, batch1, gouts1)
            return grads, tuple(o.squeeze(d) for o, d in zip(outs, call.out_dims))

        with warnings.catch_warnings():
            # ops without batching rules still work (slower); not the user's concern
            warnings.filterwarnings("ignore", message="There is a performance drop")
            return vmap(
                one, in_dims=(tuple(call.in_dims), tuple(call.out_dims)), randomness="different"
            )(tuple(leaves), tuple(gouts))

    def _per_sample_loop(self, call: _Prepared, leaves: list[Tensor], gouts: list[Tensor]):
        grads, outs = [], []
        for i in range(gouts[0].shape[call.out_dims[0]]):
            leaves_i = [x if d is None else x.narrow(d, i, 1) for x, d in zip(leaves, call.in_dims)]
            gouts_i = [g.narrow(d, i, 1) for g, d in zip(gouts, call.out_dims)]
            g, o = self._vjp(call, leaves_i, gouts_i)
            grads.append(g)
            outs.append([t.squeeze(d) for t, d in zip(o, call.out_dims)])
        stacked = {n: torch.stack([g[n] for g in grads]) for n in grads[0]}
        return stacked, tuple(torch.stack(parts) for parts in zip(*outs))

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        total: dict[str, Tensor] = {}
        with paused(), torch.enable_grad(), _math_attention():
            for index, call in enumerate(self.calls):
                leaves = [
                    x if d is None else x.narrow(d, lo, hi - lo)
                    for x, d in zip(call.leaves, call.in_dims)
                ]
                gouts = [g.narrow(d, lo, hi - lo) for g, d in zip(call.gouts, call.out_dims)]
                if not self.rule.use_loop:
                    try:
                        grads, outs = self._per_sample_vmap(call, leaves, gouts)
                    except Exception as error:  # any vmap limitation: loop instead
                        self.rule.use_loop = True
                        message = (str(error).strip().splitlines() or [""])[0]
                        if len(message) > 120:
                            message = message[:120] + "…"
                        self.ctx.warn(
                            f"torch.func.vmap failed ({type(error).__name__}: {message}); "
                            "per-sample gradients come from a slower per-sample loop"
                        )
                if self.rule.use_loop:
                    grads, outs = self._per_sample_loop(call, leaves, gouts)
                self._check(index, call, outs, lo)
                for n, g in grads.items():
                    total[n] = total[n] + g if n in total else g
        return total

    # -- statistics without per-sample gradients --------------------------------------
    def grad_sum(self, observed: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        if self._fused is not None or self._kept is not None or not self.rule.batched:
            return self._fused_pass()[1]
        if self._sum is None:
            total: dict[str, Tensor] = {}
            with paused(), torch.enable_grad(), _math_attention():
                for index, call in enumerate(self.calls):
                    grads, outs = self._vjp(call, call.leaves, call.gouts)
                    first = tuple(o.movedim(d, 0) for o, d in zip(outs, call.out_dims))
                    self._check(index, call, first, 0)
                    for n, g in grads.items():
                        total[n] = total[n] + g if n in total else g
            self._sum = total
        return self._sum

    def dots(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        if self._kept is not None or self.rule.no_jvp or not self.rule.batched:
            return super().dots(vector_sets)
        try:
            return [self._dots_jvp(vectors) for vectors in vector_sets]
        except Exception:  # an op without a forward-AD formula: materialise instead
            self.rule.no_jvp = True
            return super().dots(vector_sets)

    def _dots_jvp(self, vectors: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        with paused(), _math_attention():
            for name in (n for n in self.shapes if n in vectors):
                dot = 0
                for call in self.calls:
                    tangents = {n: torch.zeros_like(p) for n, p in call.params.items()}
                    tangents[name] = vectors[name].to(call.params[name].dtype)
                    run = partial(self._run, call, call.leaves)
                    _, out_t = jvp(run, (call.params,), (tangents,))
                    for t, g, d in zip(out_t, call.gouts, call.out_dims):
                        # gᵢ·v = Σ over sample i's outputs of (∂out/∂θ · v) ∘ gout
                        dot = dot + (t.movedim(d, 0) * g.movedim(d, 0)).flatten(1).sum(1)
                out[name] = dot
        return out


class GenericRule(Rule):
    """Any module: per-sample gradients of its own parameters by torch.func re-runs.

    Batch dims: a tensor input or output is batched along dim 0 when its dim 0 equals
    the batch size (dim 0 of the first tensor input); other tensors are shared by all
    samples. Subclasses override `in_dim` / `out_dim` / `batch_size` for other layouts.
    """

    keeps_outputs = True

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
        super().__init__(module, params)
        self.use_loop = False  # vmap failed once: loop from then on
        self.no_jvp = False  # forward AD failed once: dots by materialising
        # whole-batch re-runs (Σᵢ gᵢ by one vjp, dots by jvp) agree with per-sample ones
        # unless the module couples samples; then everything goes through per-sample grads
        self.batched = True
        self._copies: dict[str, tuple[Tensor, int]] = {}

    def reset(self) -> None:
        self._copies = {}

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Copies of the parameters as used in this forward (the optimiser may change them):
        its own, and its submodules' trainable ones that a re-run reads (not
        differentiated); several calls in one step share a copy while the parameter is
        unchanged. And copies of the buffers `forward_buffers` names, as this forward left
        them."""
        copies = {}
        used = {**{n: p for n, p in self.module.named_parameters() if p.requires_grad},
                **self.params}
        for name, p in used.items():
            kept = self._copies.get(name)
            if kept is None or kept[1] != p._version:
                kept = (p.detach().clone(), p._version)
                self._copies[name] = kept
            copies[name] = kept[0]
        return copies, {n: b.detach().clone() for n, b in self.forward_buffers()}

    def forward_buffers(self) -> list[tuple[str, Tensor]]:
        """(module-local name, buffer) of the buffers a re-run must see as each call's
        forward left them (default: none; the others as at the end of the step)."""
        return []

    def rerunning(self) -> contextlib.AbstractContextManager:
        """Context of a functional re-run of the module (default: none)."""
        return contextlib.nullcontext()

    def batch_size(self, call: Call) -> int:
        leaves = tensor_leaves((call.args, call.kwargs))
        if not leaves or leaves[0].dim() == 0:
            raise Unsupported("it has no tensor input with a batch dimension at dim 0")
        return int(leaves[0].shape[0])

    def in_dim(self, key: int | str, x: Tensor, batch: int) -> int | None:
        """Batch dim of tensor input `x` (inside positional arg / kwarg `key`), or None."""
        return 0 if x.dim() > 0 and x.shape[0] == batch else None

    def out_dim(self, index: int, y: Tensor, batch: int) -> int | None:
        """Batch dim of the index-th tensor leaf of the output, or None."""
        return 0 if y.dim() > 0 and y.shape[0] == batch else None

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        return GenericGrads(self, [self._prepare(c, ctx) for c in calls], ctx)

    def _prepare(self, call: Call, ctx: Context) -> _Prepared:
        batch = ctx.batch_size
        leaves: list[Tensor] = []
        in_dims: list[int | None] = []
        for key, value in [*enumerate(call.args), *call.kwargs.items()]:
            for x in tensor_leaves(value):
                leaves.append(x)
                in_dims.append(self.in_dim(key, x, batch))
        if all(d is None for d in in_dims):
            raise Unsupported("none of its tensor inputs has the batch dimension")
        select, gouts, out_dims, recorded = [], [], [], []
        for slot, (index, g) in enumerate(zip(call.out_index, call.grads)):
            if g is None:
                continue
            d = self.out_dim(index, g, batch)
            if d is None:
                raise Unsupported(f"its output leaf {index} has no batch dimension")
            out = call.outputs[slot]
            unchanged = out._version == call.out_versions[slot]
            select.append(index)
            gouts.append(g * ctx.scale)
            out_dims.append(d)
            recorded.append(out if unchanged else None)

        def rebuild(new: list[Tensor]) -> tuple[tuple, dict]:
            it = iter(new)
            return map_tensors((call.args, call.kwargs), lambda _: next(it))

        copies, buffers = call.extra
        own = {n: v for n, v in copies.items() if n in self.params}
        fixed = {n: v for n, v in copies.items() if n not in self.params}
        return _Prepared(leaves, in_dims, rebuild, select, gouts, out_dims, own, fixed,
                         recorded, buffers)


def _is_3d(x: Tensor | None) -> bool:
    return x is not None and x.dim() == 3


class MultiheadAttentionRule(GenericRule):
    """nn.MultiheadAttention: owns out_proj's parameters too (used without calling it);
    batch dim 1 for query/key/value unless batch_first."""

    recursive = True
    batch_dim0 = False

    def _dim(self) -> int:
        return 0 if self.module.batch_first else 1

    def sequence_first(self, call: Call) -> bool:
        return not self.module.batch_first and _is_3d(first_input_or_none(call, "query"))

    def batch_size(self, call: Call) -> int:
        query = first_input(call, "query")
        if query.dim() != 3:
            raise Unsupported("its query is unbatched (2-D)")
        return int(query.shape[self._dim()])

    def in_dim(self, key: int | str, x: Tensor, batch: int) -> int | None:
        if key in (0, 1, 2, "query", "key", "value"):
            return self._dim()
        if key in (3, "key_padding_mask"):
            return 0
        if x.dim() == 3:  # attn_mask (B·heads, L, S) mixes batch and heads
            raise Unsupported("a 3-D attn_mask is not supported; pass key_padding_mask instead")
        return None

    def out_dim(self, index: int, y: Tensor, batch: int) -> int | None:
        return self._dim() if index == 0 else 0  # attention weights are batch-first


class RNNRule(GenericRule):
    """nn.RNN / LSTM / GRU: input batch dim 0 if batch_first else 1; states batch dim 1."""

    batch_dim0 = False

    def _dim(self) -> int:
        return 0 if self.module.batch_first else 1

    def sequence_first(self, call: Call) -> bool:
        return not self.module.batch_first and _is_3d(first_input_or_none(call))

    def batch_size(self, call: Call) -> int:
        x = first_input(call)  # a PackedSequence is not a tensor: unsupported
        if x.dim() != 3:
            raise Unsupported("its input is unbatched (2-D)")
        return int(x.shape[self._dim()])

    def in_dim(self, key: int | str, x: Tensor, batch: int) -> int | None:
        return self._dim() if key in (0, "input") else 1

    def out_dim(self, index: int, y: Tensor, batch: int) -> int | None:
        return self._dim() if index == 0 else 1


class ParametrizedRule(GenericRule):
    """A module with torch.nn.utils.parametrize parametrizations (weight_norm, spectral_norm,
    orthogonal, ...): its trainable parameters are the originals under `parametrizations.`
    and the tensor its forward uses is computed from them at each call, so the closed form
    of its layer type does not apply; it is re-run by torch.func on the originals.

    The re-run must compute the tensor the forward computed: the parametrizations' buffers
    (spectral_norm's power-iteration vectors) are taken as each call's forward left them
    and the parametrizations run in eval mode (in train mode spectral_norm would iterate
    again), outside any `parametrize.cached()` of the user's. Batch dims are those of the
    module type's rule when that is a generic one (nn.RNN, nn.MultiheadAttention), else
    dim 0.
    """

    recursive = True  # owns the originals, parameters of the parametrizations submodule

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
        super().__init__(module, params)
        from . import type_rule  # the registry imports this module

        kind = type_rule(module)
        self.layout = kind(module, params) if issubclass(kind, GenericRule) else None
        self.batch_dim0 = self.layout.batch_dim0 if self.layout is not None else True

    def forward_buffers(self) -> list[tuple[str, Tensor]]:
        return list(self.module.parametrizations.named_buffers(prefix="parametrizations"))

    @contextlib.contextmanager
    def rerunning(self):
        parametrizations = self.module.parametrizations
        modes = [(m, m.training) for m in parametrizations.modules()]
        parametrizations.eval()
        # inside the user's parametrize.cached() the tensor would come from the cache, made
        # from the real originals, not the re-run's copies (whose gradients would be 0)
        cache_enabled, parametrize._cache_enabled = parametrize._cache_enabled, 0
        try:
            yield
        finally:
            parametrize._cache_enabled = cache_enabled
            for m, training in modes:
                m.training = training

    def batch_size(self, call: Call) -> int:
        return (super() if self.layout is None else self.layout).batch_size(call)

    def in_dim(self, key: int | str, x: Tensor, batch: int) -> int | None:
        return (super() if self.layout is None else self.layout).in_dim(key, x, batch)

    def out_dim(self, index: int, y: Tensor, batch: int) -> int | None:
        return (super() if self.layout is None else self.layout).out_dim(index, y, batch)
