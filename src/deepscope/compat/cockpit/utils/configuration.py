"""Cockpit's configurations: economy, business (+ curvature diagonal), full (+ max
eigenvalue and the 2-D histogram). The lists are deepscope's own (`CONFIGURATIONS`), which
are exactly Cockpit's."""

from __future__ import annotations

from collections.abc import Callable

from ....instruments.config import CONFIGURATIONS, resolve_quantities
from .. import quantities
from ..quantities import Quantity


def quantities_cls_for_configuration(label: str) -> list[type[Quantity]]:
    """The quantity classes of configuration `label` ("economy", "business" or "full").

    Raises:
        ValueError: for another label (the message lists the valid ones).
    """
    if label not in CONFIGURATIONS:
        raise ValueError(f"unknown configuration {label!r}; use one of "
                         f"{', '.join(CONFIGURATIONS)}")
    return [getattr(quantities, name) for name in resolve_quantities(label)]


def configuration(label: str, track_schedule: Callable[[int], bool] | None = None,
                  verbose: bool = False) -> list[Quantity]:
    """Instances of the quantities of configuration `label`, all on `track_schedule`
    (default: every step)."""
    return [cls(track_schedule=track_schedule, verbose=verbose)
            for cls in quantities_cls_for_configuration(label)]
