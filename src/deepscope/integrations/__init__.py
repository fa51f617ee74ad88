"""Callbacks that record training run by a framework's loop into a deepscope run.

- `deepscope.integrations.lightning.DeepscopeCallback`: a `lightning` Callback
  (`deepscope.integrations.pytorch_lightning` for the `pytorch_lightning` namespace).
- `deepscope.integrations.transformers.DeepscopeCallback`: a Hugging Face TrainerCallback.

Each module imports its framework when it is imported; `import deepscope` imports none.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

INTERRUPTED = "interrupted"  # the note that marks a run whose training raised


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise ImportError in one line naming the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"this needs the {module.split('.')[0]} package: "
                          f"pip install 'deepscope[{extra}]'") from None


class StepLeftOpen(Exception):
    """Ends a step that training left before its optimizer step (nothing of it is stored)."""


def close_run(scope: Any, steps: contextlib.ExitStack | None,
              error: BaseException | None) -> None:
    """Close a callback's run: drop the open step (`steps` holds it), note
    "interrupted: <ErrorType>: <message>" if training raised `error`, close the scope."""
    if steps is not None:  # the step's half-done data is dropped, as in a raising `with`
        reason = error or StepLeftOpen("training ended inside the step")
        steps.__exit__(type(reason), reason, reason.__traceback__)
    if scope is None or scope.closed:
        return
    if error is not None:
        first_line = (str(error).splitlines() or [""])[0][:500]
        scope.note(f"{INTERRUPTED}: {type(error).__name__}: {first_line}")
    scope.close()
