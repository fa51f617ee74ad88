"""Cockpit's API over deepscope: Cockpit code runs unchanged but for its import lines.

    from deepscope.compat.backpack import extend
    from deepscope.compat.cockpit import Cockpit, CockpitPlotter, quantities
    from deepscope.compat.cockpit.utils import schedules
    from deepscope.compat.cockpit.utils.configuration import configuration

Values are computed by deepscope's instruments and stored as a normal deepscope run
(`cockpit.run_path`), so `deepscope serve` and `deepscope plot` show them too.
"""

from . import quantities, utils
from .cockpit import Cockpit
from .plotter import CockpitPlotter

__all__ = ["Cockpit", "CockpitPlotter", "quantities", "utils"]
