"""Package attributes loaded on first use (PEP 562), so that importing a package for one
light name does not load its heavy siblings (torch, the recorder, the instruments)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's `__getattr__` and `__dir__` for `package`: each name in `homes` is imported
    from its module (relative to `package`, e.g. ".query") the first time it is asked for."""
    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)  # from now on a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
