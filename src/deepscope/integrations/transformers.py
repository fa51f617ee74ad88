"""Hugging Face `Trainer` callback: `Trainer(..., callbacks=[DeepscopeCallback("runs", "gpt2")])`.

Per-sample losses are found without user code for causal language models (per sequence:
the token losses of its valid target tokens, labels shifted as the model's loss does) and
sequence classification (per example, for every problem_type); for any other loss, pass
`compute_loss_func=callback.loss_function(fn)` to the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..hookstate import hooks_paused
from . import CallbackRecorder, require

_hf = require("transformers", "transformers")
_auto = require("transformers.models.auto.modeling_auto", "transformers")

__all__ = ["DeepscopeCallback", "per_sample_losses"]

IGNORE_INDEX = -100  # the label the Hugging Face losses skip
TOKENS_KPI = "tokens"  # valid target tokens of a causal-LM step, summed over micro-batches
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def per_sample_losses(model: nn.Module, logits: torch.Tensor,
                      labels: torch.Tensor) -> torch.Tensor | None:
    """The per-sample losses of a Hugging Face model's output, as its own loss computes them.

    Causal LM: (B, T-1) token losses in float32, labels shifted by one, 0 where the label is
    -100 (their mean or sum over valid tokens, divided by the token count the Trainer passes
    as num_items_in_batch, is the model's loss). Sequence classification: (B,) cross-entropy,
    (B,) or (B, L) squared error (regression) or (B, L) binary cross-entropy (multi-label).
    None for any other model (use `DeepscopeCallback.loss_function`).
    """
    name = type(model).__name__
    if name in _auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        shifted = labels[..., 1:]
        return F.cross_entropy(logits[..., :-1, :].float().transpose(1, -1), shifted,
                               ignore_index=IGNORE_INDEX, reduction="none")
    if name in _auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values():
        problem = getattr(model.config, "problem_type", None)
        if problem == "regression":
            target = labels.to(logits.dtype)
            squeezed = logits.squeeze(-1) if model.config.num_labels == 1 else logits
            return F.mse_loss(squeezed, target.reshape(squeezed.shape), reduction="none")
        if problem == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype),
                                                      reduction="none")
        return F.cross_entropy(logits.reshape(-1, model.config.num_labels), labels.reshape(-1),
                               reduction="none")
    return None


class DeepscopeCallback(CallbackRecorder, _hf.TrainerCallback):
    """Records a Hugging Face `Trainer.train()` into `path/run/`: one deepscope step per
    optimizer step (its `gradient_accumulation_steps` micro-batches are that step's
    `rec.loss` calls), instruments on the unwrapped model with the Trainer's optimizer.

    The loss registered per micro-batch is the model's `outputs.loss` (or what
    `loss_function` returns); a factor the Trainer applies before backward (÷ the
    accumulation steps, when the loss is not normalised by num_items_in_batch) is read
    from the gradient by the instruments, not assumed. The `loss` KPI is the sum of those
    losses over the step's micro-batches; causal LMs also log the `tokens` KPI.

    schedule / instruments / other keyword arguments: those of `deepscope.Scope`.
    activations: also record every module's output (see `Scope.watch`).
    """

    def __init__(self, path: str | Path = "runs", run: str = "run", **options: Any) -> None:
        super().__init__(path, run, **options)
        self.model: nn.Module | None = None
        self._per_sample_wanted = False  # recorded or instrumented: compute per-sample losses
        self._tokens: torch.Tensor | None = None
        self._hook: Any = None

    # --- Trainer events -----------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if self.scope is not None and not self.scope.closed:
            return
        model = _unwrap(model)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        self._open_scope().watch(model, activations=self.activations,
                         optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer)
                         else None)
        self.model = model
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scope is None or self._rec is not None:
            return
        inst = self.scope.instruments  # asked before the step starts (α's end step)
        wanted = inst is not None and bool(inst.wants(state.global_step, "default"))
        self._per_sample_wanted = self._open_step(state.global_step).recording or wanted
        self._tokens = None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After optimizer.step, before zero_grad: the step is complete."""
        if self._rec is None:
            return
        if self._tokens is not None:
            self._rec.kpi(TOKENS_KPI, self._tokens)
        self._end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # --- the loss ---------------------------------------------------------------------------
    def loss_function(self, fn: LossFn) -> Callable[..., torch.Tensor]:
        """Wrap `fn(outputs, labels, num_items_in_batch=None) -> (loss, per_sample)` into the
        Trainer's `compute_loss_func`: the loss is returned, both are registered."""
        def compute_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None
                         ) -> torch.Tensor:
            loss, per_sample = fn(outputs, labels, num_items_in_batch=num_items_in_batch)
            if self._rec is not None:
                self._rec.loss(loss, per_sample=per_sample)
            return loss
        return compute_loss

    def _on_forward(self, module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        rec = self._rec
        loss = getattr(output, "loss", None) if not isinstance(output, dict) \
            else output.get("loss")
        if rec is None or loss is None or not module.training or hooks_paused():
            return  # not a training micro-batch, or the loss is the Trainer's (loss_function)
        labels = kwargs.get("labels")
        per_sample = None
        if self._per_sample_wanted and labels is not None:
            logits = getattr(output, "logits", None)
            with torch.no_grad():
                per_sample = per_sample_losses(module, logits, labels)
            if per_sample is None and self.scope.instruments is not None:
                raise ValueError(f"deepscope cannot find per-sample losses of "
                                 f"{type(module).__name__}; pass compute_loss_func="
                                 "callback.loss_function(fn) to the Trainer")
        if labels is not None and type(module).__name__ in \
                _auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            tokens = labels[..., 1:].ne(IGNORE_INDEX).sum()
            self._tokens = tokens if self._tokens is None else self._tokens + tokens
        rec.loss(loss, per_sample=per_sample)

    # --- end ---------------------------------------------------------------------------------
    def close(self, error: BaseException | None = None) -> None:
        """Close the run (on_train_end does): an open step is dropped; with the `error`
        that stopped `train()`, the run gets the note "interrupted: ...". Idempotent."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._close_run(error)


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DataParallel / DistributedDataParallel wrappers."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model
