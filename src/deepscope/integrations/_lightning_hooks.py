"""The Lightning callback's logic, free of any Lightning import so that both package
namespaces (`lightning.pytorch` and `pytorch_lightning`) subclass it with their own
`Callback` base (see `deepscope.integrations.lightning`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from . import CallbackRecorder

PER_SAMPLE_KEY = "per_sample_loss"  # the key of training_step's returned dict we read


class LightningHooks(CallbackRecorder):
    """Records a Lightning `Trainer.fit` into `path/run/`: one deepscope step per optimizer
    step (its `accumulate_grad_batches` micro-batches are that step's `rec.loss` calls).

    training_step returns {"loss": loss, "per_sample_loss": losses} (losses: (B,) or
    (B, ...) with reduction="none") for the instruments; a plain loss is enough without
    instruments. What `self.log` logs in a training step is stored as KPIs (the last value
    of the optimizer step); with gradient clipping, the gradient's 2-norm before and after
    clipping as the KPIs `grad_norm` and `grad_norm_clipped`. Instruments read the gradients
    before clipping and the trainer's optimizer for α and the update quantities.

    schedule / instruments / other keyword arguments: those of `deepscope.Scope`.
    activations: also record every module's output (see `Scope.watch`).
    An exception in training closes the run with a note "interrupted: <error>".
    """

    def __init__(self, path: str | Path = "runs", run: str = "run", **options: Any) -> None:
        super().__init__(path, run, **options)
        self._opened_at = 0  # trainer.global_step when the open step began
        self._per_sample: torch.Tensor | None = None
        self._logged: dict[str, Any] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        self._clipping = False

    # --- Lightning hooks --------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and (self.scope is None or self.scope.closed):
            self._open_scope()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.scope is None:
            return
        if not pl_module.automatic_optimization:
            raise ValueError("DeepscopeCallback records automatic optimization only; with "
                             "manual optimization use deepscope.Scope in training_step")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError("DeepscopeCallback cannot read the loss under a GradScaler "
                             "(precision='16-mixed'); use precision='bf16-mixed' or '32-true'")
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.scope.watch(pl_module, activations=self.activations, optimizer=optimizer)
        self._clipping = bool(trainer.gradient_clip_val)
        self._patch(pl_module, "training_step", self._wrap_training_step)
        self._patch(pl_module, "log", self._wrap_log)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self.scope is None or self._rec is not None:
            return  # not fitting, or the next micro-batch of an open step
        self._opened_at = trainer.global_step
        self._open_step(trainer.global_step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._rec is None:
            return
        per_sample, self._per_sample = self._per_sample, None
        if per_sample is None and self.scope.instruments is not None:
            raise ValueError("deepscope instruments need the per-sample losses: return "
                             f"{{'loss': loss, '{PER_SAMPLE_KEY}': losses}} from training_step "
                             "(losses: reduction='none', batch first)")
        # `loss` is what Lightning backpropagates: the step's loss / accumulate_grad_batches
        self._rec.loss(loss, per_sample=per_sample)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._rec is not None and self._clipping:  # Lightning clips right after this hook
            self._logged["grad_norm"] = _grad_norm(optimizer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._rec is None or trainer.global_step == self._opened_at:
            return  # accumulating: the optimizer has not stepped yet
        if self._clipping:  # the clipped gradients stay until the next step's zero_grad
            self._logged["grad_norm_clipped"] = _grad_norm(trainer.optimizers[0])
        for name, value in self._logged.items():
            self._rec.kpi(name, value)
        self._close_step()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(pl_module, exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._finish(pl_module, None)

    # --- internals --------------------------------------------------------------------------
    def _wrap_training_step(self, original: Callable) -> Callable:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if self._rec is not None:
                self._per_sample = out.get(PER_SAMPLE_KEY) if isinstance(out, Mapping) else None
            return out
        return training_step

    def _wrap_log(self, original: Callable) -> Callable:
        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if self._rec is not None and _is_scalar(value):
                self._logged[name] = value.detach() if isinstance(value, torch.Tensor) else value
            return original(name, value, *args, **kwargs)
        return log

    def _patch(self, obj: Any, attr: str, wrap: Callable[[Callable], Callable]) -> None:
        """Wrap a method on the instance; `_unpatch` restores what was there."""
        self._patched.append((obj, attr, obj.__dict__.get(attr)))
        object.__setattr__(obj, attr, wrap(getattr(obj, attr)))

    def _unpatch(self) -> None:
        for obj, attr, before in reversed(self._patched):
            if before is None:
                obj.__dict__.pop(attr, None)
            else:
                object.__setattr__(obj, attr, before)
        self._patched.clear()

    def _close_step(self) -> None:
        self._logged = {}
        self._per_sample = None
        self._end_step()

    def _finish(self, pl_module: Any, error: BaseException | None) -> None:
        """Close the run (once): an open step is dropped (its optimizer step never came)."""
        self._unpatch()
        self._close_run(error)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _grad_norm(optimizer: Any) -> torch.Tensor:
    """The 2-norm of all gradients of `optimizer`'s parameters, as clip_grad_norm_ takes it."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads]))
