"""Errors deepscope raises on purpose; every message names the problem and the fix."""


class DeepscopeError(Exception):
    """A recording or reading problem that is not a misuse of the API (e.g. a corrupt file)."""


class CorruptRunError(DeepscopeError, ValueError):
    """A stored run cannot be read: truncated, foreign, or from an unknown schema version."""


class RecordingError(DeepscopeError):
    """`Scope.flush()` could not promise what it promises: some of what was recorded before it
    is not on disk (the writer failed, or steps were skipped). Training may go on; catch it
    to continue without the guarantee."""


class DeepscopeWarning(UserWarning):
    """Something about a recording the user may want to change (an instrument that cannot be
    exact for a module, a missing rec.loss, a costly estimator replaced): each distinct one is
    warned once per run and stored in it (`Run.warnings()`)."""
