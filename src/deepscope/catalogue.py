"""The quantity catalogue: every quantity's name and Cockpit's configurations, and validation
of a user's choice. No torch: the query API, the GUI and the dashboards check names here
without loading the instruments.

The configurations are exactly Cockpit's (see QUANTITIES.md): economy, business (economy
plus TICDiag and HessTrace) and full (business plus HessMaxEV and GradHist2d). TICTrace,
MeanGSNR, CABS and EarlyStopping are in no configuration and are available by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from .suggest import did_you_mean

# Every quantity, in the order the suite reports them.
QUANTITY_NAMES: tuple[str, ...] = (
    "Loss",
    "GradNorm",
    "Distance",
    "UpdateSize",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "GradHist1d",
    "GradHist2d",
    "Alpha",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "HessMaxEV",
    "MeanGSNR",
    "CABS",
    "EarlyStopping",
)

ECONOMY: frozenset[str] = frozenset(
    {"Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest",
     "OrthoTest", "UpdateSize"}
)
BUSINESS: frozenset[str] = ECONOMY | {"TICDiag", "HessTrace"}
FULL: frozenset[str] = BUSINESS | {"HessMaxEV", "GradHist2d"}

CONFIGURATIONS: dict[str, frozenset[str]] = {
    "economy": ECONOMY,
    "business": BUSINESS,
    "full": FULL,
}


def _valid_names_text() -> str:
    return (
        f"valid configurations: {', '.join(CONFIGURATIONS)}; "
        f"valid quantity names: {', '.join(QUANTITY_NAMES)}"
    )


def resolve_quantities(quantities: str | Sequence[str]) -> tuple[str, ...]:
    """The chosen quantity names, deduplicated, in `QUANTITY_NAMES` order.

    Args:
        quantities: "economy" | "business" | "full" (any case), one quantity name, or a
            sequence of quantity names (exact Cockpit spelling, e.g. "GradNorm").

    Raises:
        TypeError: if `quantities` is neither a string nor a sequence of strings.
        ValueError: for an unknown or empty choice; the message lists the valid names.
    """
    if isinstance(quantities, str):
        if quantities.lower() in CONFIGURATIONS:
            chosen: set[str] = set(CONFIGURATIONS[quantities.lower()])
        else:
            chosen = {quantities}
    elif isinstance(quantities, Sequence):
        chosen = set()
        for name in quantities:
            if not isinstance(name, str):
                raise TypeError(
                    f"quantities must hold strings, got {type(name).__name__}; "
                    "pass names such as ['GradNorm', 'Alpha']"
                )
            chosen.add(name)
    else:
        raise TypeError(
            "quantities must be a configuration name or a list of quantity names, "
            f"got {type(quantities).__name__}"
        )
    unknown = sorted(chosen - set(QUANTITY_NAMES))
    if unknown:
        raise ValueError(did_you_mean(unknown[0], [*CONFIGURATIONS, *QUANTITY_NAMES],
                                      "quantity", known_as="valid configurations and names",
                                      shown=len(CONFIGURATIONS) + len(QUANTITY_NAMES)))
    if not chosen:
        raise ValueError(f"no quantity chosen; {_valid_names_text()}")
    return tuple(name for name in QUANTITY_NAMES if name in chosen)
