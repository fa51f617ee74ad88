"""How the recorder names what it records: one watched model's modules and parameters
(`ModelNames`, built once in `Scope.watch` and handed to the health monitor and the
instruments, so that tensors, quantity layers, findings and warnings carry the same names),
and the tensors inside module outputs (`named_leaves`), so that a finding names exactly the
graph node the recorder drew."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelNames:
    """The recorded names of one watched model.

    root: the root module's name (`watch(model, name=...)`, default "model").
    modules: module path in the model ("" the root) -> recorded name: `name.path`
        (`path` without a name), the root `root`.
    params: parameter name in `model.named_parameters()` -> recorded name: `name.param`
        (`param` without a name).
    """

    root: str
    modules: dict[str, str]
    params: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module, name: str | None = None,
           root_name: str = "model") -> ModelNames:
        """The names `scope.watch(model, name=name)` records; root_name: the root's name
        when `name` is empty."""
        prefix = f"{name}." if name else ""
        root = name or root_name
        modules = {path: prefix + path if path else root for path, _ in model.named_modules()}
        params = {p: prefix + p for p, _ in model.named_parameters()}
        return cls(root, modules, params)

    def module(self, path: str) -> str:
        """The recorded name of the module at `path` ("" the root)."""
        return self.modules[path]

    def param(self, name: str) -> str:
        """The recorded name of parameter `name` (as `model.named_parameters()` gives it)."""
        return self.params[name]


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
