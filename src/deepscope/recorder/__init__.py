"""The training-side API: scopes, steps, schedules, statistics and the dependency graph."""

from .schedule import at, every, log_spaced, never, per_kind
from .scope import Scope
from .step import ROLES, StepRecorder

__all__ = ["ROLES", "Scope", "StepRecorder", "at", "every", "log_spaced", "never", "per_kind"]
