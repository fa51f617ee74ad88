"""Which backward passes of a step count for its recorded gradients.

A tensor hook fires in every pass that reaches its tensor: `loss.backward()`, but also a
`torch.autograd.grad(loss, params)` that reads gradients without touching `.grad` (a
gradient-norm penalty, a norm for logging, an inner step of meta-learning). Summing them all
recorded twice the gradient the optimiser used. A pass counts when it accumulates into the
`.grad` of a watched parameter, as `backward()` does; an `autograd.grad` pass does not.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import get_gradient_edge

# Present since torch 2.1; without it every pass counts (the sum, as before).
_will_execute = getattr(torch._C, "_will_engine_execute_node", None)
_current_task = getattr(torch._C, "_current_graph_task_id", None)


def accumulates(params: Iterable[torch.Tensor]) -> bool:
    """Whether the backward pass now running (call it from a hook inside one) accumulates into
    the `.grad` of any of `params`. True when that cannot be told (no parameters requiring
    gradients, a torch without the engine's query): every pass counts then."""
    if _will_execute is None:
        return True
    asked = False
    for p in params:
        if not p.requires_grad or p.grad_fn is not None:
            continue
        asked = True
        try:
            if _will_execute(get_gradient_edge(p).node):
                return True
        except RuntimeError as exc:
            # The engine refuses to answer for a leaf that autograd.grad captures (its
            # gradient is returned, not accumulated): the answer is no. Anything else is not
            # understood: count the pass, as without the query.
            if "autograd.grad" not in str(exc):
                return True
    return not asked


class PassFilter:
    """`accumulates(params)` once per backward pass (the engine's graph task), for the hooks
    of one step: each hook of a pass asks, the first one computes."""

    __slots__ = ("_params", "_task", "_counts")

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = params
        self._task: int | None = None
        self._counts = True

    def counts(self) -> bool:
        """Whether the running pass counts (see the module's docstring)."""
        if _current_task is None:
            return True
        task = _current_task()
        if task != self._task:
            self._task = task
            self._counts = accumulates(self._params)
        return self._counts
