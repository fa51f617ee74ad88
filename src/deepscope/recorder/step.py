"""One training step as the user sees it: `with scope.step(n, kind=...) as rec:`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..backward import graph_task, in_backward
from ..distributed import is_dtensor
from ..hookstate import hooks_paused
from ..layouts import output_batch_dims
from ..naming import named_leaves
from ..records import QuantityValue, StepPayload, TensorInfo
from ..store import limits
from .buffers import is_private
from .context import StepOutcome
from .graph import (
    ModuleCall,
    Named,
    build_graphs,
    graph_hash,
    memory_region,
    saved_attachments,
)
from .passes import PassFilter
from .ranks import local_values
from .summary import Capture, StepCaptures, SummarySettings

if TYPE_CHECKING:
    from .context import StepContext

ROLES = ("input", "target", "activation", "output", "loss", "parameter")
_BATCHED_ROLES = ("input", "target", "activation", "output", "loss")
AUTO = "auto"
_MAX_FLOAT = int(torch.finfo(torch.float64).max)
_MAX_INFOS = 4096  # TensorInfo kept across steps (StepContext.infos)
_HALF = (torch.float16, torch.bfloat16)


def check_text(text: str, what: str) -> str:
    """Text goes into the run as UTF-8: a lone surrogate (e.g. from a mis-decoded file name)
    cannot be stored, so it is refused here rather than failing the write later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} {text[:80]!r} holds a lone surrogate "
                         f"{text[exc.start]!r} that UTF-8 cannot store; pass valid text, "
                         "e.g. text.encode('utf-8', 'replace').decode()") from None
    return text


_GOOD_NAMES: set[str] = set()  # names checked already (a loop passes the same ones each step)


def _check_name(name: Any, what: str = "name") -> str:
    if type(name) is str and name in _GOOD_NAMES:
        return name
    if not isinstance(name, str) or not name or len(name) > 256:
        raise TypeError(f"tensor {what} must be a non-empty string of at most 256 characters, "
                        f"got {name!r}")
    check_text(name, f"tensor {what}")
    if len(_GOOD_NAMES) < 4096:
        _GOOD_NAMES.add(name)
    return name


EVAL_FORWARD = ("a watched module ran without gradients after the optimiser's step (a validation "
                "forward inside the training step?): its outputs are not recorded, they would "
                "pass for the training batch's; record validation in a step of its own, e.g. "
                "scope.step(n, kind='val')")

SHARDS_NOT_RECORDED = ("parameters sharded across ranks (DTensor shards: FSDP2, tensor parallel) "
                       "and their gradients are not recorded yet: each rank holds only its "
                       "shard; see docs/LIMITATIONS.md, 'FSDP2'")


def unrecordable(tensor: torch.Tensor) -> str | None:
    """Why `tensor`'s values cannot be recorded (and what to pass instead), or None."""
    if is_dtensor(tensor):
        return ("it is a DTensor, of which this rank holds a shard; sharded tensors are not "
                "recorded yet, see docs/LIMITATIONS.md, 'FSDP2'")
    if tensor.is_meta:
        return "it is on the meta device and holds no values; record a real tensor"
    if tensor.layout != torch.strided:
        return f"its layout is {tensor.layout}; record tensor.to_dense()"
    if tensor.is_complex():
        return "it is complex; record tensor.real and tensor.imag (or tensor.abs()) instead"
    return None


def _check_kpi(name: Any, value: Any) -> None:
    _check_name(name, "KPI name")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"rec.kpi({name!r}, ...) needs a single number; got a tensor of "
                             f"shape {tuple(value.shape)} (reduce it, e.g. .mean())")
        if reason := unrecordable(value):
            raise ValueError(f"rec.kpi({name!r}, ...) cannot store this tensor: {reason}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"rec.kpi({name!r}, ...) needs a number or a 1-element tensor, "
                        f"got {type(value).__name__}")
    elif isinstance(value, int) and abs(value) > _MAX_FLOAT:
        raise ValueError(f"rec.kpi({name!r}, ...) got an integer of {len(str(abs(value)))} "
                         "digits, beyond float64's range (about 1.8e308); pass a float")


def _check_batch_dim(name: str, tensor: torch.Tensor, batch_dim: Any) -> int | None:
    """batch_dim as given, checked: an int within the tensor's dims, None, or "auto"."""
    if isinstance(batch_dim, str) and batch_dim == AUTO:
        return AUTO  # type: ignore[return-value]
    if batch_dim is None:
        return None
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
        raise TypeError(f"batch_dim of tensor {name!r} must be an int, None or 'auto', got "
                        f"{batch_dim!r}")
    if not -tensor.dim() <= batch_dim < tensor.dim():
        raise ValueError(f"batch_dim={batch_dim} is out of range for tensor {name!r} of "
                         f"shape {tuple(tensor.shape)}; pass a valid dim or None")
    return batch_dim


class StepRecorder:
    """Records one step. Methods are cheap no-ops when the step is not recorded.

    Not created directly: use `Scope.step` (or `Scope.begin_step`). `rec.scope` is the
    Scope that opened it.
    """

    def __init__(self, context: StepContext, step: int, kind: str, record: bool,
                 tentative: bool, instrumented: bool) -> None:
        self._ctx = context
        self.scope = context.scope
        self.step = step
        self.kind = kind
        self.recording = record or tentative
        self._tentative = tentative and not record
        self._decision: bool | None = None
        self._instrumented = instrumented
        self._iteration = 0
        self._open = False
        self._iterations_used = False
        self._after_loss = False  # a rec.loss ended a micro-batch: the next tensor starts one
        self._loss_names: set[str] = set()
        self._kpis: list[tuple[str, Any]] = []
        self.loss_value: torch.Tensor | None = None
        self._hooks: list[Any] = []
        # Inside a watched optimiser's step (LBFGS's closure): its first evaluation is at the
        # step's parameters; later ones are at moved parameters, and not recorded: neither
        # their rec.loss (counted here, on every step) nor, on a recorded step, what follows
        # the first backward pass inside it.
        self._in_optimizer_step = False
        self._step_losses = 0  # rec.loss calls inside it
        self._step_pass: int | None = None  # the first pass inside it
        if not self.recording:
            return
        self._named: list[Named] = []
        self._seen: set[tuple[str, int]] = set()
        self._manual: list[tuple[str, str, int]] = []
        self._infos: dict[str, TensorInfo] = {}
        self._captures: list[Capture] = []
        self._copies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads: dict[tuple[str, int], torch.Tensor] = {}
        self._grad_versions: dict[tuple[str, int], int] = {}  # as received (see _snapshot_grads)
        self._owned: set[tuple[str, int]] = set()  # gradients we made (copies, sums)
        # autograd.grad passes do not count; a GradScaler's scale is divided out
        self._passes = PassFilter(context.params.values(), context.scaler)
        self._activation_counts: dict[tuple[str, int], int] = {}
        self._recomputed_counts: dict[str, int] = {}  # module outputs a checkpoint recomputed
        self._grad_hooked: set[tuple[str, int]] = set()  # tensors whose gradient is awaited
        # what module hooks saw of frozen modules: autograd has no edges from it
        self._module_calls: dict[tuple[str, int], ModuleCall] = {}
        self._attachments: dict | None = None
        self._losses: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # of rec.loss calls
        # parameters (ids) whose optimiser has stepped: later passes are not in their update
        self._stepped_params: set[int] = set()
        self._started = time.time()

    def __enter__(self) -> StepRecorder:
        self._open = True
        self._ctx.begin(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._ctx.end(self, exc_type is not None)

    def _finish(self, failed: bool) -> StepOutcome:
        """End the step (its hooks removed, its methods closed) and say what to store."""
        self._open = False
        self._remove_hooks()
        return StepOutcome(self.step, self.kind, failed, self._instrumented, self._kpis,
                           self.recording, self._keep, self._payload, self._tentative,
                           self._local_values)

    def _check_open(self, call: str) -> None:
        if not self._open:
            raise ValueError(f"rec.{call}(...) called outside its step; call it inside "
                             "`with scope.step(n) as rec:`")

    # --- public API -------------------------------------------------------------------------
    def tensor(self, name: str, tensor: torch.Tensor, role: str = "activation", *,
               node: str | None = None, role_in_node: str | None = None,
               batch_dim: int | None | str = AUTO) -> None:
        """Register a named tensor of the current iteration.

        role: one of input, target, activation, output, loss, parameter. node: the graph node
        it is drawn in (default: its name). batch_dim: the batch dimension, None for none;
        "auto" = 0 for batched roles with at least one dimension, else None. Its gradient is
        recorded after backward when it requires grad (by a hook; the tensor is not changed).
        """
        if not self._open:  # (tested here: a call less on every step)
            self._check_open("tensor")
        if not self.recording:
            return
        if in_backward():  # a checkpoint recomputing the forward: recorded already
            self._ctx.guard(self._recomputed, name, tensor)
            return
        if self._reevaluating():
            return
        _check_name(name)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"rec.tensor({name!r}, ...) needs a torch.Tensor, got "
                            f"{type(tensor).__name__}; wrap it with torch.as_tensor(...)")
        if reason := unrecordable(tensor):
            raise ValueError(f"rec.tensor({name!r}, ...) cannot record this tensor: {reason}")
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} for tensor {name!r}; use one of "
                             f"{', '.join(ROLES)}")
        if node is not None:
            _check_name(node, "node")
        if role_in_node is not None:
            _check_name(role_in_node, "role_in_node")
        batch_dim = _check_batch_dim(name, tensor, batch_dim)
        if self._after_loss and (name, self._iteration) in self._seen:
            # a name registered again after a rec.loss: the next micro-batch's forward
            # (a new name after the loss stays with the micro-batch it follows)
            self._next_micro_batch()
        key = (name, self._iteration)
        if key in self._seen:
            raise ValueError(f"tensor {name!r} is already registered in iteration "
                             f"{self._iteration} of step {self.step}; give it another name or "
                             "start a new iteration with rec.iteration()")
        if batch_dim == AUTO:
            batch_dim = 0 if (role in _BATCHED_ROLES and tensor.dim() >= 1) else None
        self._seen.add(key)
        self._ctx.guard(self._add, name, tensor, role, node or name, role_in_node or name,
                          batch_dim)

    def loss(self, loss: torch.Tensor, per_sample: torch.Tensor | None = None,
             name: str = "loss") -> None:
        """Register the loss that will be backpropagated, and optionally the per-sample losses.

        Call it after the forward and before the backward. loss: scalar tensor, the mean or
        the sum of per_sample, either possibly divided by a whole number k (loss / k under
        gradient accumulation); the reduction is inferred. per_sample: (B, ...) losses of the
        batch items, batch first (e.g. (B, 1) from MSELoss(reduction='none'), (B, T) per
        token); the other dims are averaged for a mean loss and summed for a sum loss;
        needed by most instruments. Only the backward pass through this loss (or
        per_sample) feeds the instruments: other backward / autograd.grad passes in the step
        (a gradient penalty) do not.

        Gradient accumulation: call rec.loss once per micro-batch, each before that
        micro-batch's backward; the k micro-batches of the step are one batch of all their
        samples for the instruments. The next micro-batch's forward (a watched module's output,
        a tensor name registered again, or the next rec.loss after a rec.loss) starts a new
        iteration: micro-batch m is iteration m. A tensor of a new name registered after
        the loss stays with the micro-batch it follows.

        The loss is also logged as the KPI `name` on every step: with several rec.loss calls
        of one name, their sum (the loss whose gradient the optimiser step uses). Losses of
        two names in one step (a GAN's D and G losses) are not micro-batches of one batch:
        the instruments' values of that step are missing with the reason; register only the
        instrumented (first watched) model's loss, and `rec.kpi` the other.
        """
        self._check_open("loss")
        _check_name(name, "loss name")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__)
            raise TypeError(f"rec.loss(loss, ...) needs the scalar loss tensor, got {got}")
        if per_sample is not None and (not isinstance(per_sample, torch.Tensor)
                                       or per_sample.dim() < 1 or per_sample.numel() == 0):
            raise TypeError("rec.loss(..., per_sample=...) needs a tensor of per-sample losses "
                            "with the batch as dim 0 (reduction='none'), e.g. "
                            "loss_fn(out, y, reduction='none')")
        if self._in_optimizer_step:
            self._step_losses += 1
            if self._step_losses > 1 or self._reevaluating():
                return  # LBFGS's closure again, at moved parameters: the step's loss came first
        if self._after_loss:
            self._next_micro_batch()
        value = loss.detach()
        if name in self._loss_names:  # accumulation: the step's loss is the sum
            j = next(j for j, (kpi, _) in enumerate(self._kpis) if kpi == name)
            value = self._kpis.pop(j)[1] + value
        self._loss_names.add(name)
        self.loss_value = value
        self._kpis.append((name, value))
        if self.recording:
            self._losses.append((loss.detach(),
                                 None if per_sample is None else per_sample.detach()))
            self.tensor(name, loss.reshape(()) if loss.dim() else loss, role="loss")
            if per_sample is not None:
                self.tensor(f"{name}_per_sample", per_sample, role="loss", node=name,
                            role_in_node="per_sample")
        if self.recording:
            # Look now, before backward frees what autograd saved: inputs and targets are
            # found through saved tensors only.
            self._ctx.guard(self._attach_saved)
        if self._ctx.monitor is not None:
            self._ctx.guard(self._ctx.monitor.loss, loss, name)
        if self._instrumented:
            # Bad input must reach the user; internal failures are handled inside Instruments.
            self._ctx.instruments.loss(loss, per_sample, name)
        self._after_loss = True

    def kpi(self, name: str, value: float | torch.Tensor) -> None:
        """Log a scalar on every step, recorded or not (cheap: no host sync here)."""
        self._check_open("kpi")
        _check_kpi(name, value)
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self._kpis.append((name, value))

    @contextlib.contextmanager
    def iteration(self) -> Iterator[int]:
        """Context for one forward pass of an unrolled (recurrent) step; yields its index."""
        self._check_open("iteration")
        if self._iterations_used:
            if self._iteration + 1 >= limits.MAX_ITERATIONS:
                # Readers refuse more (a crafted file's guard): never write an unreadable step.
                raise ValueError(f"a step holds at most {limits.MAX_ITERATIONS} iterations; "
                                 "record every n-th iteration, or split the sequence into steps")
            self._iteration += 1
        self._iterations_used = True
        self._after_loss = False
        yield self._iteration

    def connect(self, source: str, target: str) -> None:
        """Add a graph edge autograd cannot see (detach, integer paths), in this iteration."""
        self._check_open("connect")
        _check_name(source, "connection source")
        _check_name(target, "connection target")
        if self.recording:
            self._manual.append((source, target, self._iteration))

    def gradients(self, group: str) -> None:
        """Snapshot the gradients received so far under direction 'grad:<group>'.

        Use it between the backward passes of several losses; the plain 'grad' record at the
        end of the step holds the sum over the passes that accumulate into `.grad`
        (`backward()`; not `torch.autograd.grad`), a parameter's since its `.grad` was last
        set to None.
        """
        self._check_open("gradients")
        _check_name(group, "gradient group")
        if self.recording:
            self._ctx.guard(self._snapshot_grads, f"grad:{group}")

    def keep(self) -> None:
        """Keep this step although the schedule did not choose it (dynamic recording)."""
        self._decision = True

    def discard(self) -> None:
        """Do not store this step's tensors (KPIs and instrument values are still stored)."""
        self._decision = False

    @property
    def iteration_index(self) -> int:
        """Index of the current iteration of this step (0 until a second `iteration()`)."""
        return self._iteration

    # --- internals ------------------------------------------------------------------------
    def _next_micro_batch(self) -> None:
        """After a rec.loss, the next micro-batch's iteration starts at the next rec.loss, the next
        watched module's forward, or a tensor name registered again."""
        self._after_loss = False
        self._iteration += 1
        self._iterations_used = True

    def _record_output(self, path: str, is_root: bool, output: Any, module: torch.nn.Module,
                       inputs: Any, sequence_first: bool = False) -> None:
        """A watched module's output (Scope.watch(activations=True)), by module path;
        `sequence_first`: inside a PyTorch transformer with batch_first=False (see layouts)."""
        if in_backward():  # a checkpoint recomputing the forward: recorded already
            for suffix, t in named_leaves(output):
                base = path + suffix
                count = self._recomputed_counts.get(base, 0)
                self._recomputed_counts[base] = count + 1
                self._recomputed(base if count == 0 else f"{base}#{count + 1}", t)
            return
        if self._stepped_params and not torch.is_grad_enabled():
            self._ctx.warn_once(EVAL_FORWARD)
            return
        if self._reevaluating():
            return
        role = "output" if is_root else "activation"
        frozen = tuple(id(p) for p in module.parameters(recurse=False) if not p.requires_grad)
        if self._after_loss:  # the next micro-batch's forward (gradient accumulation)
            self._next_micro_batch()
        batch_dims = output_batch_dims(module, output, sequence_first)
        for suffix, t in named_leaves(output):
            if reason := unrecordable(t):  # e.g. a sparse output: the other outputs go on
                self._ctx.warn_once(f"activation {path + suffix}: {reason}; it is not recorded")
                continue
            base = path + suffix
            count = self._activation_counts.get((base, self._iteration), 0)
            self._activation_counts[(base, self._iteration)] = count + 1
            name = base if count == 0 else f"{base}#{count + 1}"
            if (name, self._iteration) in self._seen:
                continue  # the user registered this name explicitly
            self.tensor(name, t, role=role, node=path,
                        role_in_node=suffix.lstrip(".") or "output",
                        batch_dim=batch_dims.get(suffix, AUTO))
            no_grad = t.grad_fn is None and not t.requires_grad
            if no_grad or frozen:  # edges autograd does not have
                regions = tuple(memory_region(x) for _, x in named_leaves(inputs)
                                ) if no_grad else ()
                self._module_calls[(name, self._iteration)] = ModuleCall(regions, frozen)

    def _add(self, name: str, tensor: torch.Tensor, role: str, node: str, role_in_node: str,
             batch_dim: int | None) -> None:
        it = self._iteration
        if name not in self._infos:
            self._infos[name] = self._info(name, role, node, role_in_node, tensor, batch_dim)
        self._named.append(Named.of(name, it, tensor, role, node))
        self._record_values([(name, "forward", it, tensor, batch_dim)])
        if tensor.requires_grad:
            self._hooks.append(tensor.register_hook(self._grad_hook(name, it)))
            self._grad_hooked.add((name, it))

    def _recomputed(self, name: str, tensor: torch.Tensor) -> None:
        """`name` computed again inside backward by a checkpoint: its value was recorded in
        the forward. torch.utils.checkpoint(use_reentrant=True) ran that forward without
        gradients and backpropagates through this recomputed tensor: its gradient is the
        recorded one's (non-reentrant checkpoints backpropagate through the first)."""
        key = next(((name, it) for it in range(self._iteration + 1)
                    if (name, it) in self._seen and (name, it) not in self._grad_hooked), None)
        if key is not None and tensor.requires_grad:
            self._hooks.append(tensor.register_hook(self._grad_hook(*key)))
            self._grad_hooked.add(key)

    def _grad_hook(self, name: str, iteration: int) -> Callable[[torch.Tensor], None]:
        key = (name, iteration)

        def hook(grad: torch.Tensor) -> None:
            if not hooks_paused():
                self._ctx.guard(self._on_grad, key, grad)
        return hook

    def _param_grad_hook(self, name: str, param: torch.Tensor
                         ) -> Callable[[torch.Tensor], None]:
        key = (name, 0)

        def hook(grad: torch.Tensor) -> None:
            if not hooks_paused():
                self._ctx.guard(self._on_grad, key, grad, param)
        return hook

    def _on_grad(self, key: tuple[str, int], grad: torch.Tensor,
                 param: torch.Tensor | None = None) -> None:
        """Keep the gradient of `key` (of `param`, a parameter's) that backward produced."""
        if self._attachments is None:  # (before any pass can free the saved tensors)
            self._attach_saved()
        if param is not None and id(param) in self._stepped_params:
            return  # after its optimiser's step (a GAN's G loss reaching D): not its update
        if not self._passes.counts():
            return  # an autograd.grad pass: its gradients never reach .grad
        if self._in_optimizer_step:
            if self._step_pass is None:
                self._step_pass = graph_task()
            elif graph_task() != self._step_pass:
                return  # a closure evaluated again inside the step, at moved parameters
        if grad.layout != torch.strided:  # nn.Embedding(sparse=True)'s: recorded densified,
            grad = grad.to_dense()  # the parameter's size (its statistics count every row)
            self._owned.add(key)
        scale = self._passes.scale
        if scale is not None:  # a GradScaler's pass: the loss's gradient, as unscale_ gives
            # (in float32: a half-precision gradient divided by the scale would underflow)
            grad = (grad.float() if grad.dtype in _HALF else grad) / scale
            self._owned.add(key)
        prev = self._grads.get(key)
        if prev is not None and param is not None and param.grad is None:
            # .grad was set to None since the earlier pass (zero_grad between two backward
            # passes, as SAM does): that pass's gradient is not in the .grad the step uses
            prev = None
        if prev is not None:
            grad = prev + grad
            self._owned.add(key)
        elif param is not None and param.grad is None and scale is None:
            # AccumulateGrad adopts this gradient as .grad, which the user may change in
            # place before the step ends (clip_grad_norm_, AMP's unscale_): a copy now. (Into
            # an existing .grad it adds, leaving this one alone.)
            grad = self._ctx.buffers.copy(grad)
            self._owned.add(key)
        # Else the gradient itself is kept, not a detached alias of it: while it is held,
        # autograd cannot hand it on as a parameter's .grad, nor add into it in place.
        self._grads[key] = grad
        self._grad_versions[key] = grad._version

    def _reevaluating(self) -> bool:
        """Whether an optimiser's closure runs again inside its step (LBFGS's line search):
        after the step's first backward pass there, at parameters the step already moved."""
        return self._in_optimizer_step and self._step_pass is not None

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()` ended (Scope's step post hook): the gradients of its parameters
        recorded so far are those it stepped with; passes after it do not change them."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        # (a step before this step's backward, of the last step's gradients, ends nothing)
        received = {name for name, _ in self._grads}
        self._stepped_params.update(id(p) for name, p in self._ctx.params.items()
                                    if name in received and id(p) in stepped)

    def _record_values(self, records: list[tuple[str, str, int, torch.Tensor, int | None]]
                       ) -> None:
        """Capture (name, direction, iteration, tensor, batch_dim) records, their copies
        taken together."""
        # A copy, because the user may change the tensor in place later in the step (inplace
        # ReLU, optimizer.step, zero_grad); statistics are computed off the training thread.
        # The same tensor under a second name (a container module's output is its last
        # child's) shares the first one's copy.
        copies, infos, captures = self._copies, self._infos, self._captures
        keys, new = [], {}
        for _, direction, _, t, batch_dim in records:  # (loops: no comprehension frames)
            key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version,
                   direction, batch_dim)
            keys.append(key)
            if key not in copies:
                new[key] = t
        if new:
            # holding the tensor keeps its memory ours during the step
            tensors = list(new.values())
            for key, t, copy in zip(new, tensors, self._ctx.buffers.copy_all(tensors)):
                copies[key] = (t, copy)
        for (name, direction, it, _, batch_dim), key in zip(records, keys):
            captures.append(Capture(name, direction, it, copies[key][1], batch_dim,
                                    infos[name].role == "parameter"))

    def _info(self, name: str, role: str, node: str, role_in_node: str, tensor: torch.Tensor,
              batch_dim: int | None) -> TensorInfo:
        """The TensorInfo of this description, an earlier step's when alike (a new one costs
        ~2 µs, per tensor and recorded step)."""
        key = (name, role, node, role_in_node, tensor.shape, tensor.dtype, batch_dim)
        cache = self._ctx.infos
        info = cache.get(key)
        if info is None:
            if len(cache) >= _MAX_INFOS:  # shapes that change every step: no reuse anyway
                cache.clear()
            info = cache[key] = TensorInfo(name, role, node, role_in_node, list(tensor.shape),
                                           str(tensor.dtype).replace("torch.", ""), batch_dim)
        return info

    def _param_info(self, name: str, p: torch.Tensor, kind: tuple) -> TensorInfo | None:
        """The TensorInfo of parameter `name` of this `kind` (type, shape, dtype, device,
        layout), None if it cannot be recorded (said once); kept for the next steps."""
        info = None
        if reason := unrecordable(p):  # one warning for all of a sharded model's
            self._ctx.warn_once(SHARDS_NOT_RECORDED if is_dtensor(p) else
                                f"parameter {name}: {reason}; it is not recorded")
        else:
            node, role_in_node = self._ctx.param_nodes[name]
            info = TensorInfo(name, "parameter", node, role_in_node, list(p.shape),
                              str(p.dtype).replace("torch.", ""), None)
        self._ctx.infos[name] = (kind, info)
        return info

    def _start(self) -> None:
        """Called on entry of a recorded step: parameter values and gradient hooks."""
        records = []
        infos, cache = self._infos, self._ctx.infos
        for name, p in self._ctx.params.items():
            # an earlier step's TensorInfo while the parameter stays alike (the usual case)
            kind = (type(p), p.shape, p.dtype, p.device, p.layout)
            cached = cache.get(name)  # (parameters by name: str keys, not tuples)
            info = (cached[1] if cached is not None and cached[0] == kind
                    else self._param_info(name, p, kind))
            if info is None:
                continue
            infos[name] = info
            records.append((name, "forward", 0, p, None))
            if p.requires_grad:
                self._hooks.append(p.register_hook(self._param_grad_hook(name, p)))
        self._record_values(records)

    def _graph_key(self) -> tuple:
        return (self.kind, tuple((r.name, r.iteration, r.tensor.shape)
                                 for r in self._named), tuple(self._manual))

    def _attach_saved(self) -> None:
        if self._attachments is None:
            cached = self._graph_key() in self._ctx.graph_cache
            self._attachments = {} if cached else saved_attachments(self._named)

    def _graph(self) -> list[tuple[int, str, str]]:
        """[(iteration, hash, JSON body)] of this step, from the cache when the structure
        (kind, names, shapes, manual edges) was seen before."""
        key = self._graph_key()
        cached = self._ctx.graph_cache.get(key)
        if cached is None:
            self._attach_saved()  # no backward ran: saved tensors are still there
            param_nodes = {n: v[0] for n, v in self._ctx.param_nodes.items()}
            bodies = build_graphs(self._named, self._ctx.params, param_nodes, self._manual,
                                  self._attachments or {}, self._module_calls)
            cached = [(it, graph_hash(body), json.dumps(body, separators=(",", ":")))
                      for it, body in sorted(bodies.items())]
            self._ctx.graph_cache[key] = cached
        return cached

    def _snapshot_grads(self, direction: str) -> None:
        """Capture the gradients received so far: kept as they are where nobody else can
        reach them (autograd's own, after backward: no copy), else copied."""
        records = []
        infos, versions = self._infos, self._grad_versions
        for key in list(self._grads):  # (an items() iterator would hold a reference)
            grad = self._grads[key]
            name, it = key
            if grad._version != versions[key]:
                # a hook of the user's changed it in place after ours ran: the gradient
                # backward produced is gone
                self._ctx.warn_once(f"the gradient of {name!r} was changed in place after "
                                    "deepscope received it (by a tensor hook?); it is not "
                                    "recorded at this step")
                continue
            info = infos[name]
            # ours (a copy, a sum) or, held by nobody else (two references: the dict's and
            # `grad`), autograd's own
            if (key in self._owned and not grad.requires_grad) or is_private(grad, 2):
                self._captures.append(Capture(name, direction, it, grad, info.batch_dim,
                                              info.role == "parameter"))
            else:
                records.append((name, direction, it, grad, info.batch_dim))
        self._record_values(records)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _keep(self) -> bool:
        if self._decision is not None:
            return self._decision
        if self._tentative:
            keep_if = self._ctx.keep_if
            return bool(keep_if(self)) if keep_if is not None else False
        return True

    def _local_values(self) -> list[QuantityValue]:
        """This rank's BatchSize and Loss of the recorded step (see `ranks.local_values`)."""
        return local_values(self.step, self._losses, list(self._infos.values()),
                            self._iteration + 1)

    def _check_loss_scale(self) -> None:
        """Tell `scale_check` the loss's gradient, ∂(backpropagated root)/∂loss (> 1 when
        scaled up). A method of its own: no reference to the gradient may outlive it, or
        `_snapshot_grads` would copy a gradient nobody else holds."""
        factor = next((g for (name, _), g in self._grads.items()
                       if name in self._loss_names), None)
        if factor is not None and factor.numel() == 1:
            self._ctx.scale_check.note(factor)

    def _payload(self) -> StepPayload:
        ctx = self._ctx
        if ctx.scaler is None and not ctx.scale_check.done:
            self._check_loss_scale()
        self._snapshot_grads("grad")
        cached = self._graph()
        self._copies.clear()  # the captures hold the copies; let the user's tensors go
        summarise = StepCaptures(self._captures, SummarySettings(
            ctx.max_samples, ctx.max_neurons, ctx.singular_values, ctx.exact_views),
            ctx.buffers.release)
        return StepPayload(
            step=self.step, kind=self.kind, wall_time=self._started,
            iterations=self._iteration + 1, tensors=list(self._infos.values()),
            summarise=summarise,
            graphs={h: body for _, h, body in cached},
            iteration_graphs=[(it, h) for it, h, _ in cached])

