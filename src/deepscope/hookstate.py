"""One switch for every deepscope autograd hook: off while deepscope runs its own backward passes.

Curvature (Hessian-vector products) runs extra backward passes through the user's graph; the
recorder's gradient hooks, the per-sample engine and the health monitor must not mistake those
for the user's backward. Wrap such passes in `with paused():`; hooks return at once when
`hooks_paused()`. The flag is process-wide because autograd runs hooks on its own worker
threads for accelerator work.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0


def hooks_paused() -> bool:
    """True while deepscope's own backward passes run: hooks must then do nothing."""
    return _depth > 0


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pause all deepscope hooks (nesting allowed)."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
