"""Errors deepscope raises on purpose; every message names the problem and the fix."""


class DeepscopeError(Exception):
    """A recording or reading problem that is not a misuse of the API (e.g. a corrupt file)."""


class CorruptRunError(DeepscopeError, ValueError):
    """A stored run cannot be read: truncated, foreign, or from an unknown schema version."""
