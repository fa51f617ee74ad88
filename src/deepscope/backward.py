"""What the running backward pass is, for deepscope's hooks: whether one is running (a forward
inside it is a checkpoint's recomputation) and whether it accumulates into `.grad`.

A hook fires in every pass that reaches its tensor: `loss.backward()`, but also a
`torch.autograd.grad(loss, params)` that reads gradients without touching `.grad` (a gradient
norm for logging, a gradient penalty, an inner step of meta-learning). The recorder and the
per-sample engine count only passes that accumulate into a parameter's `.grad`, as the
optimiser's gradient is made of those.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import get_gradient_edge

# Present since torch 2.1; without them every pass counts and no forward is a recomputation.
_will_execute = getattr(torch._C, "_will_engine_execute_node", None)
_current_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether a backward pass is running: a forward now is a checkpoint's recomputation
    (torch.utils.checkpoint runs the block's forward again inside backward)."""
    return graph_task() != -1


def graph_task() -> int:
    """The id of the backward pass now running (-1 outside one, and without the query)."""
    return -1 if _current_task is None else _current_task()


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
