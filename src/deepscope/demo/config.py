"""The demo's settings, apart from its training code so that the command line can show
them without loading torch."""

from __future__ import annotations

import dataclasses

DEFAULT_PATH = "deepscope-demo"
DEFAULT_PORT = 8050


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes chosen so both runs record in well under a minute of CPU time and under 20 MB.

    lengths: sequence lengths; each is a step kind ("len_04"). recordings_per_kind: about how
    often each kind is recorded with all its tensors. instrument_points: about how many steps
    get instrument values (a curve of that many points per quantity), at most one step in 10.
    instruments: a configuration name or quantity names; by default every quantity, so
    that no dashboard panel is empty.
    """

    steps: int = 1500
    batch: int = 64
    hidden: int = 32
    memory: int = 16
    lengths: tuple[int, ...] = (1, 2, 4, 6, 8)
    lr: float = 1e-3
    recordings_per_kind: int = 8
    instrument_points: int = 75
    instruments: str | tuple[str, ...] = (
        "Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest", "OrthoTest",
        "GradHist1d", "GradHist2d", "Alpha", "HessTrace", "TICDiag", "TICTrace", "HessMaxEV",
        "MeanGSNR", "CABS", "EarlyStopping")
    seed: int = 0
