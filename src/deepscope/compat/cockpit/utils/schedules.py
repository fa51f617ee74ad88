"""Cockpit's tracking schedules: callables global_step -> bool."""

from __future__ import annotations

import torch


class linear:  # noqa: N801 - Cockpit's name
    """Track at steps offset + n·interval, n >= 0."""

    def __init__(self, interval: int, offset: int = 0) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"linear(interval) needs a positive integer, got {interval!r}")
        self.interval, self.offset = interval, offset

    def __call__(self, global_step: int) -> bool:
        shifted = global_step - self.offset
        return shifted >= 0 and shifted % self.interval == 0

    def __repr__(self) -> str:
        return f"linear({self.interval}, offset={self.offset})"


class logarithmic:  # noqa: N801 - Cockpit's name
    """Track at `steps` log-spaced steps from base**start to base**end (and step 0 if
    `init`), truncated to integers exactly as Cockpit does."""

    def __init__(self, start: float, end: float, steps: int = 300, base: float = 10,
                 init: bool = True) -> None:
        scheduled = torch.logspace(start, end, steps, base=base, dtype=torch.int64).tolist()
        self.steps = frozenset(scheduled) | ({0} if init else frozenset())
        self._repr = f"logarithmic({start}, {end}, steps={steps}, base={base}, init={init})"

    def __call__(self, global_step: int) -> bool:
        return global_step in self.steps

    def __repr__(self) -> str:
        return self._repr
