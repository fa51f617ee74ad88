"""deepscope: see inside a PyTorch network while it trains, and find out why training goes wrong.

Record with `Scope`, read with `open_run` / `open_project`, explore with `deepscope serve`.

The names load on first use, so reading a run (`deepscope.query`, the GUI) never imports the
recorder, the instruments or torch.
"""

from typing import TYPE_CHECKING

from .errors import CorruptRunError, DeepscopeError, DeepscopeWarning, RecordingError
from .lazy import lazy_attributes

__version__ = "0.1.0"

# Each lazily loaded public name and the module that defines it.
_HOMES = {
    "Project": ".query", "Run": ".query", "open_project": ".query", "open_run": ".query",
    "Scope": ".recorder", "StepRecorder": ".recorder", "at": ".recorder", "every": ".recorder",
    "log_spaced": ".recorder", "never": ".recorder", "per_kind": ".recorder",
}

__all__ = ["CorruptRunError", "DeepscopeError", "DeepscopeWarning", "Project", "RecordingError",
           "Run", "Scope",
           "StepRecorder", "__version__", "at", "every", "log_spaced", "never", "open_project",
           "open_run", "per_kind"]

if TYPE_CHECKING:
    from .query import Project, Run, open_project, open_run
    from .recorder import Scope, StepRecorder, at, every, log_spaced, never, per_kind


__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
