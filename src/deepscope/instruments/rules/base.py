"""Shared pieces of the per-sample gradient rules.

A *rule* knows how to turn the captured forward calls of one module (inputs, kwargs,
gradients w.r.t. its outputs) into per-sample gradient statistics of that module's own
parameters. The engine (`deepscope.instruments.engine`) owns the hooks; rules never
register hooks and never read current parameter values (the optimiser may already have
changed them): what they need from the forward pass they take in `Rule.capture`.

Notation: B batch size, gᵢ = ∇θ ℓᵢ the gradient of sample i's loss (not divided by B).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

# Most elements of per-sample gradients materialised at once: chunks of up to `chunk_size`
# samples are cut smaller for large layers, so that the allocator reuses one chunk's memory
# for the next (on the CPU a fresh mapping per chunk page-faults on every first touch)
CHUNK_ELEMENTS = 1 << 20


def samples_per_chunk(chunk_size: int, elements: int) -> int:
    """Samples per materialised chunk: at most `chunk_size`, and at most `CHUNK_ELEMENTS`
    elements of `elements` per sample (at least one sample)."""
    return max(1, min(chunk_size, CHUNK_ELEMENTS // max(elements, 1)))


class Unsupported(Exception):
    """Raised by a rule when a call cannot be split into per-sample gradients.

    The engine then reports NaN for the module's parameters and records the message.
    """


@dataclass
class Call:
    """One forward call of a module, as captured by the engine's hooks.

    args / kwargs: the call's inputs; tensors detached (same storage, no copy).
    grads:   one slot per output tensor leaf that required grad: ∂L/∂leaf (summed over
             backward passes), or None when no gradient reached it.
    out_index: position of each of those leaves among all tensor leaves of the output.
    outputs: the detached output leaves with gradient slots, and their version counters
             at forward time (only kept for rules that set `keeps_outputs`).
    in_versions: version counters of the tensor leaves of (args, kwargs) at forward time.
    extra:   what `Rule.capture` returned at forward time.
    micro:   index of the registered loss whose backward delivered `grads` (None: none yet).
    node:    the output's autograd node, kept when the output has batch size 1 (a candidate
             for broadcasting over the batch).
    broadcast: for such an output added to a batched tensor, ∂L/∂(the broadcast result),
             (B, *output.shape[1:]), which is its per-sample gradient.
    error:   why this call has no per-sample gradients (set while capturing).
    kept:    the call's per-sample gradients (module-local name -> (samples, *shape), scaled),
             materialised when its output gradient arrived (rules with `early`); its inputs,
             outputs and output gradients are then dropped.
    samples: its batch size, when `kept` replaced the inputs it is read from.
    task:    the backward pass (autograd graph task) the call was captured in, when a
             checkpoint recomputed it there (torch.utils.checkpoint); None for a forward.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out_index: list[int]
    grads: list[Tensor | None]
    outputs: list[Tensor] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    in_versions: list[int] = field(default_factory=list)
    extra: Any = None
    micro: int | None = None  # the registered loss (micro-batch) whose backward reached it
    node: Any = None
    broadcast: Tensor | None = None
    error: str | None = None
    kept: dict[str, Tensor] | None = None
    samples: int | None = None
    task: int | None = None


@dataclass
class Context:
    """Per-step settings the engine hands to rules.

    batch_size: B.  scale: factor turning captured output gradients into gradients of
    the per-sample losses (B for a mean-reduced loss, 1 for a sum).  chunk_size: samples
    per materialised chunk.  budget: bytes of per-sample gradients rules may keep for
    reuse within the step.  warn: records a user-facing message once.  counting: counts
    what a materialising sweep goes through (see `Counting`), or None.
    """

    batch_size: int
    scale: float
    chunk_size: int
    budget: Budget
    warn: Callable[[str], None]
    counting: Counting | None = None


class Counting(Protocol):
    """Counters fed by a module's materialising sweep (`ModuleGrads._fused_pass`): the
    step's histograms counted on the way, so that no later pass materialises those
    per-sample gradients again and none are kept for it."""

    def fresh(self, swept: Collection[str]) -> dict[str, Any]:
        """module-local parameter name -> a new counter (`.add(chunk)`) for those of `swept`
        (the module-local names the sweep goes through) to count."""

    def done(self, counters: dict[str, Any]) -> None:
        """The sweep went through every sample: `counters` are complete."""


@dataclass(frozen=True)
class RankOne:
    """Per-sample gradients of consecutive samples that are outer products, never formed:
    gᵢ = left[i] ⊗ right[i], element (o, j) of sample i is ``left[i, o] * right[i, j]``
    (rounded once, as materialising them would), in the row-major order of the parameter.

    left: (b, O).  right: (b, I), same dtype and device.
    """

    left: Tensor
    right: Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.left.dtype

    @property
    def samples(self) -> int:
        return self.left.shape[0]

    def materialise(self, lo: int, hi: int) -> Tensor:
        """The gradients of samples lo..hi-1 of this part, (hi - lo, O·I)."""
        return (self.left[lo:hi, :, None] * self.right[lo:hi, None, :]).flatten(1)


# A part of one parameter's per-sample gradients: consecutive samples, materialised
# (b, *param.shape) or factored.
Part = Tensor | RankOne


class Budget:
    """A byte allowance shared by all modules of one step for keeping per-sample grads."""

    def __init__(self, limit_bytes: int) -> None:
        self.left = limit_bytes

    def take(self, nbytes: int) -> bool:
        """Reserve `nbytes` if that much is left; True when granted."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def tensor_leaves(obj: Any) -> list[Tensor]:
    """The tensors inside nested tuples / lists / dicts (dict values in key order)."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensor_leaves(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensor_leaves(item)]
    return []


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """Rebuild nested tuples / lists / dicts with every tensor leaf replaced by fn(leaf).

    Leaves are visited in the same order as `tensor_leaves`.
    """
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(item, fn) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(item, fn) for item in obj]
    if isinstance(obj, dict):
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    return obj


def first_input(call: Call, name: str = "input") -> Tensor:
    """The module's first positional input, or keyword `name` (e.g. F.linear's `input`)."""
    x = first_input_or_none(call, name)
    if x is None:
        found = call.args[0] if call.args else call.kwargs.get(name)
        raise Unsupported(f"its first input is {type(found).__name__}, not a tensor")
    return x


def first_input_or_none(call: Call, name: str = "input") -> Tensor | None:
    """`first_input`, or None where it is not a tensor."""
    x = call.args[0] if call.args else call.kwargs.get(name)
    return x if isinstance(x, Tensor) else None


class ModuleGrads:
    """Per-sample gradient statistics of one module's own parameters for one step.

    Names are the module-local parameter names given at construction. Subclasses
    implement `per_sample(lo, hi)`; closed forms override the statistics they can get
    without materialising gᵢ. The defaults materialise gᵢ chunk by chunk (at most
    `chunk_size` samples at a time) in one fused pass that yields all three reductions,
    and keep the per-sample tensors for the step when the budget allows.
    """

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, ctx: Context) -> None:
        self.shapes = shapes
        self.dtype = dtype
        self.ctx = ctx
        self._fused: tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]] | None = None
        self._swept_dots: dict[str, Tensor] = {}
        self._kept: dict[str, Tensor] | None = None

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        """gᵢ for samples lo..hi-1: name -> (hi - lo, *param.shape)."""
        raise NotImplementedError

    def parts(self) -> Iterator[dict[str, Part]]:
        """Every gᵢ, as parts of consecutive samples covering the batch, in the cheapest form
        the rule has: factored (`RankOne`) where it can, else materialised chunks."""
        return self.chunks()

    def chunk(self, lo: int, hi: int) -> dict[str, Tensor]:
        """gᵢ for samples lo..hi-1, from the kept tensors when there are any."""
        if self._kept is not None:
            return {name: g[lo:hi] for name, g in self._kept.items()}
        return self.per_sample(lo, hi)

    def chunks(self) -> Iterator[dict[str, Tensor]]:
        """gᵢ of consecutive sample chunks covering the batch (the kept tensors: one chunk)."""
        if self._kept is not None:
            yield self._kept
            return
        size = samples_per_chunk(self.ctx.chunk_size, self._elements_per_sample())
        for lo in range(0, self.ctx.batch_size, size):
            yield self.per_sample(lo, min(lo + size, self.ctx.batch_size))

    def _elements_per_sample(self) -> int:
        """Elements one sample's gradients take to materialise (and what they are made of)."""
        return sum(shape.numel() for shape in self.shapes.values())

    def _fused_pass(self, vector_sets: Sequence[dict[str, Tensor]] = ()
                    ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """(‖gᵢ‖² (B,), Σᵢ gᵢ, Σᵢ gᵢ²) for every parameter, from one materialising sweep;
        with `vector_sets`, that sweep also takes the dots (`self._swept_dots`, name ->
        (B, sets holding it) columns)."""
        if self._fused is None:
            # only what this sweep goes through: a member of a module's grads (an LSTM's
            # input and recurrent halves) sweeps its own, and an unfed counter is not done
            counters = (self.ctx.counting.fresh(self.shapes) if self.ctx.counting is not None
                        else {})
            # kept for the histogram pass's reuse, unless counted here
            keep = not counters and self._kept is None and self.ctx.budget.take(self._nbytes())
            sq: dict[str, list[Tensor]] = {name: [] for name in self.shapes}
            total: dict[str, Tensor] = {}
            squares: dict[str, Tensor] = {}
            # filled chunk by chunk: a list of chunks joined at the end would hold them twice
            kept: dict[str, Tensor] = {}
            stacked = _stacked_vectors(vector_sets)
            dots: dict[str, list[Tensor]] = {name: [] for name in stacked}
            lo = 0
            for chunk in self.chunks():
                for name, g in chunk.items():
                    if keep and len(g) == self.ctx.batch_size:  # one chunk: kept as it is
                        kept[name] = g
                    elif keep:  # copied in, then read from there: the chunk is dropped
                        if name not in kept:
                            kept[name] = g.new_empty(self.ctx.batch_size, *g.shape[1:])
                        kept[name][lo:lo + len(g)] = g
                        g = chunk[name] = kept[name][lo:lo + len(g)]
                    if name in stacked:
                        dots[name].append(g.flatten(1) @ stacked[name])
                    if name in counters:
                        try:
                            counters[name].add(g)
                        except Exception:  # not this sweep's failure: its own pass reports it
                            del counters[name]
                    g2 = g.square()
                    sq[name].append(g2.flatten(1).sum(1))
                    total[name] = total[name] + g.sum(0) if name in total else g.sum(0)
                    sq_g = g2.sum(0)
                    del g2  # one chunk-sized temporary at a time
                    squares[name] = squares[name] + sq_g if name in squares else sq_g
                lo += len(g)
                chunk = g = None  # not held while the next chunk is made
            if keep:
                self._kept = kept
            if counters:
                self.ctx.counting.done(counters)
            self._fused = ({n: torch.cat(v) for n, v in sq.items()}, total, squares)
            self._swept_dots = {name: torch.cat(p) for name, p in dots.items()}
        return self._fused

    def _nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.ctx.batch_size * s.numel() * itemsize for s in self.shapes.values())

    def sq_norms(self) -> dict[str, Tensor]:
        """name -> (B,) ‖gᵢ‖²."""
        return self._fused_pass()[0]

    def grad_sum(self, observed: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """name -> Σᵢ gᵢ, parameter-shaped.

        observed: what autograd delivered to the parameters, scaled to Σᵢ gᵢ (absent where
        unusable). A rule may return it after a check, much cheaper than the sum, that it
        equals Σᵢ gᵢ up to round-off; by default it is ignored.
        """
        return self._fused_pass()[1]

    def second_moments(self) -> dict[str, Tensor]:
        """name -> Σᵢ gᵢ² (elementwise), parameter-shaped."""
        return self._fused_pass()[2]

    def dots(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """For each set: name -> (B,) gᵢ·v for the names in it (parameter-shaped, same dtype).

        All sets share one pass over the per-sample gradients.
        """
        if self._fused is None:  # one sweep for these and the norms and sums, later wanted
            self._fused_pass(vector_sets)
            joined, self._swept_dots = self._swept_dots, {}
            return split_dots(joined, vector_sets)
        stacked = _stacked_vectors(vector_sets)
        parts: dict[str, list[Tensor]] = {name: [] for name in stacked}
        for chunk in self.chunks():
            for name, columns in stacked.items():
                parts[name].append(chunk[name].flatten(1) @ columns)
        joined = {name: torch.cat(p) for name, p in parts.items()}
        return split_dots(joined, vector_sets)

    def all_per_sample(self) -> dict[str, Tensor]:
        """name -> (B, *param.shape): every gᵢ of this module at once."""
        if self._kept is not None:
            return self._kept
        out: dict[str, Tensor] = {}
        lo = 0
        for chunk in self.chunks():  # filled in place: joining a list would hold it twice
            for name, g in chunk.items():
                if name not in out:
                    out[name] = g.new_empty(self.ctx.batch_size, *g.shape[1:])
                out[name][lo:lo + len(g)] = g
            lo += len(g)
            chunk = g = None
        return out


def _stacked_vectors(vector_sets: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """name -> (numel, sets holding it): the flat vectors of each name, one column per set."""
    names = {name for vectors in vector_sets for name in vectors}
    return {name: torch.stack([vs[name].reshape(-1) for vs in vector_sets if name in vs], 1)
            for name in names}


def split_dots(
    joined: dict[str, Tensor], vector_sets: Sequence[dict[str, Tensor]]
) -> list[dict[str, Tensor]]:
    """Per-set results from name -> (B, k) columns, one per set that has the name, in order."""
    out: list[dict[str, Tensor]] = [{} for _ in vector_sets]
    for name, columns in joined.items():
        holders = [k for k, vectors in enumerate(vector_sets) if name in vectors]
        for column, k in enumerate(holders):
            out[k][name] = columns[:, column]
    return out


class StackedGrads(ModuleGrads):
    """One module's statistics over the micro-batches of a step (gradient accumulation):
    consecutive blocks of samples, each with its own ModuleGrads, or None where the module
    received no gradient from that block (its gᵢ are zero there)."""

    def __init__(
        self, blocks: list[tuple[int, ModuleGrads | None]], params: dict[str, Tensor],
        ctx: Context,
    ) -> None:
        first = next(g for _, g in blocks if g is not None)
        super().__init__(first.shapes, first.dtype, ctx)
        self.blocks = blocks  # (samples, grads) in sample order
        self._like = params

    def _zeros(self, n: int) -> dict[str, Tensor]:
        return {name: self._like[name].new_zeros(n, *shape, dtype=self.dtype)
                for name, shape in self.shapes.items()}

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        pieces: dict[str, list[Tensor]] = {name: [] for name in self.shapes}
        start = 0
        for size, grads in self.blocks:
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                chunk = self._zeros(b - a) if grads is None else grads.chunk(a - start, b - start)
                for name, g in chunk.items():
                    pieces[name].append(g)
            start += size
        return {name: torch.cat(p) for name, p in pieces.items()}

    def _joined(self, per_block: Callable[[ModuleGrads], dict[str, Tensor]]) -> dict[str, Tensor]:
        """Per-sample results (b,) of each block joined in sample order (zeros where None)."""
        parts: dict[str, list[Tensor]] = {name: [] for name in self.shapes}
        for size, grads in self.blocks:
            got = per_block(grads) if grads is not None else None
            for name in self.shapes:
                zero = self._like[name].new_zeros(size, dtype=self.dtype)
                parts[name].append(zero if got is None or name not in got else got[name])
        return {name: torch.cat(p) for name, p in parts.items()}

    def _summed(self, per_block: Callable[[ModuleGrads], dict[str, Tensor]]) -> dict[str, Tensor]:
        total: dict[str, Tensor] = {}
        for _, grads in self.blocks:
            if grads is not None:
                for name, v in per_block(grads).items():
                    total[name] = total[name] + v if name in total else v
        return total

    def sq_norms(self) -> dict[str, Tensor]:
        return self._joined(lambda g: g.sq_norms())

    def grad_sum(self, observed: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        return self.grad_sum_blocks([None] * len(self.blocks))

    def grad_sum_blocks(self, observed: list[dict[str, Tensor] | None]) -> dict[str, Tensor]:
        """Σᵢ gᵢ, offering each block what autograd delivered in its backward pass."""
        blocks = iter(observed)
        return self._summed(lambda g: g.grad_sum(next(blocks)))

    def second_moments(self) -> dict[str, Tensor]:
        return self._summed(lambda g: g.second_moments())

    def dots(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        per_block = [(size, g.dots(vector_sets) if g is not None else None)
                     for size, g in self.blocks]
        out: list[dict[str, Tensor]] = []
        for k, vectors in enumerate(vector_sets):
            out.append({})
            for name in (n for n in self.shapes if n in vectors):
                out[k][name] = torch.cat([
                    got[k][name] if got is not None
                    else self._like[name].new_zeros(size, dtype=self.dtype)
                    for size, got in per_block])
        return out

    def parts(self) -> Iterator[dict[str, Part]]:
        for size, grads in self.blocks:
            if grads is not None:
                yield from grads.parts()
                continue
            for lo in range(0, size, self.ctx.chunk_size):
                yield self._zeros(min(self.ctx.chunk_size, size - lo))


class DenseGrads(ModuleGrads):
    """Per-sample gradients that are small enough to compute whole (norm layers)."""

    def __init__(self, grads: dict[str, Tensor], ctx: Context) -> None:
        first = next(iter(grads.values()))
        super().__init__({name: g.shape[1:] for name, g in grads.items()}, first.dtype, ctx)
        self._kept = grads

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        return self.chunk(lo, hi)  # always kept


class Rule:
    """How to get per-sample gradients of one module's own parameters.

    One instance per hooked module. `params` maps module-local names to the trainable
    parameters the rule is responsible for.

    Class attributes:
      recursive      the rule owns every trainable parameter in the module's subtree (for
                     modules that use their children's parameters without calling them,
                     like nn.MultiheadAttention's out_proj).
      keeps_outputs  the engine keeps each call's detached output leaves in `Call.outputs`.
      batch_dim0     the batch is dim 0 of every input and of the output: a call on inputs of
                     batch size 1 whose output is broadcast over the batch gets per-sample
                     gradients by expanding its size-1 inputs (see the engine).
      early          `grads` of one call needs nothing known only after the backward pass:
                     the engine may materialise a call's per-sample gradients when its output
                     gradient arrives and drop the call's captures, where those are larger.
      channels_at_dim1  dim 1 of its input is channels, never the batch (convolutions,
                     BatchNorm, GroupNorm): see `sequence_first`.
    """

    recursive: bool = False
    early: bool = False
    keeps_outputs: bool = False
    batch_dim0: bool = True  # the batch is dim 0 of inputs and output (broadcasts are split)
    channels_at_dim1: bool = False

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
        self.module = module
        self.params = params

    def unsupported(self) -> str | None:
        """Why this module's configuration needs the generic rule instead, or None."""
        return None

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Forward-time extras a later computation needs (stored in `Call.extra`)."""
        return None

    def reset(self) -> None:
        """Forget per-step state (the engine calls this when it drops captures)."""

    def batch_size(self, call: Call) -> int:
        """B as seen by this call (dim 0 of the first input unless the rule knows better)."""
        x = first_input(call)
        if x.dim() == 0:
            raise Unsupported("its input is a 0-d tensor without a batch dimension")
        return int(x.shape[0])

    def sequence_first(self, call: Call) -> bool:
        """Whether this call's batch is dim 1 of its input, after a sequence (an RNN or
        attention with batch_first=False): the engine then cannot take dim 0 for the batch of
        other modules' (B, B, …) inputs, which may be (sequence, batch, …) too."""
        return False

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        """Per-sample gradient statistics from this step's calls (all with some gradient)."""
        raise NotImplementedError

    def _grad(self, call: Call, ctx: Context, dtype: torch.dtype) -> Tensor:
        """The scaled gradient w.r.t. the call's single output, in `dtype`."""
        return self._output_grad(call, dtype) * ctx.scale

    def _output_grad(self, call: Call, dtype: torch.dtype) -> Tensor:
        """The gradient w.r.t. the call's single output as captured (not scaled), in
        `dtype`: rules that keep it for the step scale slices of it when they use them
        (`Context.scale`), so that no scaled copy of every layer's output gradient is
        held for the step."""
        g = call.grads[0]
        if g is None or len(call.grads) != 1 or call.out_index != [0]:
            raise Unsupported("its output is not a single tensor")
        return g.to(dtype)
