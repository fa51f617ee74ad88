"""BackPACK's `extend`: deepscope needs no model extension, so it returns its argument.

It remembers (weakly) the modules it was given: Cockpit code passes only
`model.parameters()` to `Cockpit(...)`, and `compat.cockpit` finds the model owning them
among the extended modules.
"""

from __future__ import annotations

import weakref
from typing import TypeVar

from torch import nn

T = TypeVar("T")
_extended: list[weakref.ref[nn.Module]] = []


def extend(module: T, *_, **__) -> T:
    """Return `module` unchanged (deepscope hooks what it needs itself); remember a module."""
    if isinstance(module, nn.Module):
        _extended[:] = [r for r in _extended if r() is not None and r() is not module]
        _extended.append(weakref.ref(module))
    return module


def extended_modules() -> list[nn.Module]:
    """The modules given to `extend` that are still alive, most recent first."""
    return [m for r in reversed(_extended) if (m := r()) is not None]
