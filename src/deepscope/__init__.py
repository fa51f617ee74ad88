"""deepscope: see inside a PyTorch network while it trains, and find out why training goes wrong.

Record with `Scope`, read with `open_run` / `open_project`, explore with `deepscope serve`.
"""

from .errors import CorruptRunError, DeepscopeError, DeepscopeWarning, RecordingError
from .query import Project, Run, open_project, open_run
from .recorder import Scope, StepRecorder, at, every, log_spaced, never, per_kind

__version__ = "0.1.0"

__all__ = ["CorruptRunError", "DeepscopeError", "DeepscopeWarning", "Project", "RecordingError",
           "Run", "Scope",
           "StepRecorder", "__version__", "at", "every", "log_spaced", "never", "open_project",
           "open_run", "per_kind"]
