"""Cockpit's histogram bin adaptation policies (`cockpit.quantities.bin_adaptation`).

They are accepted so that Cockpit code imports and runs, but deepscope does not move the
bins: passing `GradAbsMax` or `ParamAbsMax` as `adapt=` to `GradHist1d` / `GradHist2d`
warns that the range stays as given. deepscope's own adaptive range is
`Scope(..., instrument_options={"hist_range": "adaptive"})` (each step's largest |gᵢ,ₐ|).
"""

from __future__ import annotations

from collections.abc import Callable


class BinAdaptation:
    """A policy that would move a histogram's bin range on the steps of `track_schedule`.

    Args:
        track_schedule: global_step -> bool, when the range would be updated.
        verbose: accepted for Cockpit compatibility.
    """

    def __init__(self, track_schedule: Callable[[int], bool], verbose: bool = False) -> None:
        if not callable(track_schedule):
            raise TypeError(f"{type(self).__name__}(track_schedule=...) needs a callable "
                            f"global_step -> bool, got {type(track_schedule).__name__}")
        self._track_schedule = track_schedule
        self._verbose = verbose

    def should_compute(self, global_step: int) -> bool:
        """Whether the range would be updated at `global_step`."""
        return bool(self._track_schedule(global_step))

    def extensions(self, global_step: int) -> list:
        """No BackPACK extensions: deepscope needs none."""
        return []


class NoAdaptation(BinAdaptation):
    """Leave the bin range as it is (Cockpit's default)."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__(lambda global_step: False, verbose=verbose)


class _AbsMax(BinAdaptation):
    """Cockpit: range [−m, m]·(1 + padding), m the largest absolute value, at least
    min_size / 2. Not applied by deepscope."""

    def __init__(self, track_schedule: Callable[[int], bool], verbose: bool = False,
                 padding: float = 0.0, min_size: float = 1e-6) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._padding = padding
        self._min_size = min_size


class GradAbsMax(_AbsMax):
    """Cockpit: adapt to the largest |per-sample gradient element|. Not applied."""


class ParamAbsMax(_AbsMax):
    """Cockpit: adapt to the largest |parameter element|. Not applied."""


__all__ = ["BinAdaptation", "GradAbsMax", "NoAdaptation", "ParamAbsMax"]
