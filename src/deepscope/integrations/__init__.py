"""Callbacks that record training run by a framework's loop into a deepscope run.

- `deepscope.integrations.lightning.DeepscopeCallback`: a `lightning` Callback
  (`deepscope.integrations.pytorch_lightning` for the `pytorch_lightning` namespace).
- `deepscope.integrations.transformers.DeepscopeCallback`: a Hugging Face TrainerCallback.

Each module imports its framework when it is imported; `import deepscope` imports none.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise ImportError in one line naming the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"this needs the {module.split('.')[0]} package: "
                          f"pip install 'deepscope[{extra}]'") from None
