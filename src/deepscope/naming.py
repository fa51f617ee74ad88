"""How tensors inside module outputs are named, shared by the recorder and the health monitor
so that a finding names exactly the graph node the recorder drew."""

from __future__ import annotations

from typing import Any

import torch


def named_leaves(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(suffix, tensor) for every tensor in a module output: "" for a tensor, ".key" for dict
    entries and ".i" for tuple/list items, nested."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in named_leaves(v, f"{prefix}.{k}")]
    if isinstance(obj, (tuple, list)):
        return [leaf for i, v in enumerate(obj) for leaf in named_leaves(v, f"{prefix}.{i}")]
    return []
