"""Which backward passes of a step make its recorded gradients, and at what scale.

A pass counts when it accumulates into the `.grad` of a watched parameter, as `backward()`
does; an `autograd.grad` pass does not (`deepscope.backward.accumulates`): summing it in
recorded twice the gradient the optimiser used.

A `GradScaler`'s `scale(loss).backward()` multiplies every gradient by its scale until
`unscale_` divides `.grad`; the recorder divides what it keeps by the scale of the pass
(given the scaler), and says so when a loss arrives scaled without one (`ScaleCheck`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..backward import accumulates, graph_task

SCALED_LOSS = ("the registered loss reached backward() multiplied by {factor:g} (a GradScaler's "
               "scale?): the recorded gradients are {factor:g}x those of the loss, and change "
               "with the scale; pass the scaler, scope.watch(model, optimizer=opt, "
               "scaler=scaler), to record them unscaled")


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The scale `scaler` multiplies losses by now, as a 0-dim tensor on its device (a copy:
    `update()` changes it in place; no host sync), or None when it scales nothing."""
    scale = getattr(scaler, "_scale", None)  # set by its first scale(); None when disabled
    if not isinstance(scale, torch.Tensor) or not scaler.is_enabled():
        return None
    return scale.detach().reshape(()).clone()


class PassFilter:
    """Per backward pass (the engine's graph task), for the hooks of one step: whether it
    counts (`accumulates(params)`) and, with a GradScaler, the scale it ran at. Each hook of
    a pass asks; the first one works it out."""

    __slots__ = ("_params", "_scaler", "_task", "_counts", "scale")

    def __init__(self, params: Iterable[torch.Tensor], scaler: Any = None) -> None:
        self._params = params
        self._scaler = scaler
        self._task: int | None = None
        self._counts = True
        self.scale: torch.Tensor | None = None  # of the running pass: divide its gradients

    def counts(self) -> bool:
        """Whether the running pass counts (see the module's docstring); sets `scale`."""
        task = graph_task()
        if task == -1:  # no engine query (torch < 2.1): every pass counts
            return True
        if task != self._task:
            self._task = task
            self._counts = accumulates(self._params)
            self.scale = (scaler_scale(self._scaler) if self._counts and self._scaler is not None
                          else None)
        return self._counts


class ScaleCheck:
    """Warns (`warn`, once) when a recorded step's loss reached backward() multiplied by more
    than 1 and no scaler was given, judged on the first `CHECKS` recorded steps whose factor
    is finite (a scaler is there from the start; later ones pay nothing). On the CPU the
    factor is read at once; on an accelerator it is copied to the host without a sync and
    read at the next recorded step."""

    CHECKS = 8

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._judged = 0
        self.done = False

    def note(self, factor: torch.Tensor) -> None:
        """`factor`: ∂(backpropagated root)/∂loss of this step (the loss's recorded gradient)."""
        self._read_pending()
        if self.done:
            return
        if factor.device.type == "cpu":
            self._judge(float(factor))
        elif factor.device.type == "cuda":
            host = torch.empty((), dtype=factor.dtype, pin_memory=True)
            host.copy_(factor.detach().reshape(()), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(factor.device))
            self._pending = (host, event)

    def _read_pending(self) -> None:
        if self._pending is not None and self._pending[1].query():
            host, self._pending = self._pending[0], None
            self._judge(float(host))

    def _judge(self, factor: float) -> None:
        if not math.isfinite(factor):
            return
        self._judged += 1
        self.done = self._judged >= self.CHECKS
        if factor > 1.0 + 1e-6:  # (1 / k of accumulation is the loss's own: .grad keeps it)
            self.done = True
            self._warn(SCALED_LOSS.format(factor=factor))
