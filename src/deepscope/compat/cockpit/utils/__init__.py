"""Cockpit's `cockpit.utils`: `schedules`, and `configuration` (economy / business / full,
imported as `from deepscope.compat.cockpit.utils.configuration import configuration`)."""

from . import schedules

__all__ = ["schedules"]
