"""Callbacks that record training run by a framework's loop into a deepscope run.

- `deepscope.integrations.lightning.DeepscopeCallback`: a `lightning` Callback
  (`deepscope.integrations.pytorch_lightning` for the `pytorch_lightning` namespace).
- `deepscope.integrations.transformers.DeepscopeCallback`: a Hugging Face TrainerCallback.

Each module imports its framework when it is imported; `import deepscope` imports none.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from ..recorder.scope import Scope, interrupted_status
from ..recorder.step import StepRecorder
from ..store.writer import INTERRUPTED as INTERRUPTED  # a run whose training raised


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise ImportError in one line naming the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"this needs the {module.split('.')[0]} package: "
                          f"pip install 'deepscope[{extra}]'") from None


class CallbackRecorder:
    """What the callbacks share: the `Scope` they open, and a step kept open across the
    micro-batches of one optimizer step (a `with scope.step(n)` spread over hooks)."""

    def __init__(self, path: str | Path = "runs", run: str = "run", *, schedule: Any = None,
                 instruments: Any = None, activations: bool = False,
                 **scope_options: Any) -> None:
        super().__init__()
        self.path = path
        self.run = run
        self.activations = activations
        self._scope_options = dict(schedule=schedule, instruments=instruments,
                                   **scope_options)
        self.scope: Scope | None = None
        self._rec: StepRecorder | None = None

    def _open_scope(self) -> Scope:
        self.scope = Scope(self.path, self.run, **self._scope_options)
        return self.scope

    def _open_step(self, step: int) -> StepRecorder:
        self._rec = self.scope.begin_step(step)
        return self._rec

    def _end_step(self) -> None:
        rec, self._rec = self._rec, None
        if rec is not None:
            self.scope.end_step()

    def _close_run(self, error: BaseException | None) -> None:
        """Drop the open step, note "interrupted: <ErrorType>: <message>" if training raised
        `error`, close the scope. Idempotent."""
        rec, self._rec = self._rec, None
        if rec is not None:  # left before its optimizer step: its half-done data is dropped
            self.scope.end_step(discard=True)
        scope = self.scope
        if scope is None or scope.closed:
            return
        if error is not None:
            scope.note(interrupted_status(error))
        scope.close(error)
