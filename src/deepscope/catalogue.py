"""The quantity catalogue: one spec per quantity (its name, what it needs at a step, whether
it is shown per layer, its configuration, its GUI panel, its Cockpit name) and the GUI's
panels; the configurations, the instruments' needs, the GUI panels and layer choices derive
from it. No torch: the query API, the GUI and the dashboards read it without loading the
instruments.

Adding a quantity is one `register(QuantitySpec(...))` (or one entry in `_BUILT_IN`) plus its
compute function, which the instruments hold (`deepscope.instruments.suite.computes`).

The configurations are exactly Cockpit's (see QUANTITIES.md): economy, business (economy
plus TICDiag and HessTrace) and full (business plus HessMaxEV and GradHist2d). TICTrace,
MeanGSNR, CABS and EarlyStopping are in no configuration and are available by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .suggest import did_you_mean

# What a quantity may need at a step (the suite turns on only what the due ones need):
# "loss": rec.loss(...) was called; "engine": per-sample gradient statistics (needs the
# per-sample losses); "diagonal": the Hessian diagonal; "hessian": any Hessian-vector
# products; "snapshot": θₜ copied at the start of the step.
NEEDS = ("loss", "engine", "diagonal", "hessian", "snapshot")
LEVELS = ("economy", "business", "full")  # each configuration holds the ones before it


@dataclass(frozen=True)
class QuantitySpec:
    """One quantity.

    name: Cockpit's spelling (also the stored name). needs: a subset of `NEEDS`.
    per_layer: the GUI offers it per layer (layer choice, Graph tab colouring).
    level: the smallest configuration holding it ("economy", "business", "full"), or None.
    panel: the key of its GUI Instruments panel (`PANELS`), or None (not drawn there).
    dashboard: the key of its panel in the static (Cockpit-layout) dashboard
        (`DASHBOARD_PANELS`), or None (not drawn there).
    histogram: 0 for a scalar value; 1 or 2 for a 1-D or 2-D histogram stored as counts
        (read with `Run.histogram`; 1-D ones are exported as TensorBoard histograms).
    cockpit: the name of Cockpit's quantity class (default: `name`).
    cockpit_per_parameter: Cockpit's `get_output()` gives it as a list, one value per
        parameter tensor (else the whole-model value).
    """

    name: str
    needs: frozenset[str] = frozenset({"loss"})
    per_layer: bool = False
    level: str | None = None
    panel: str | None = None
    dashboard: str | None = None
    histogram: int = 0
    cockpit: str = ""
    cockpit_per_parameter: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.needs) - set(NEEDS)
        if unknown:
            raise ValueError(f"{self.name}: unknown needs {sorted(unknown)}; valid: {NEEDS}")
        if self.level is not None and self.level not in LEVELS:
            raise ValueError(f"{self.name}: level must be one of {LEVELS} or None")
        if self.panel is not None and self.panel not in PANELS:
            raise ValueError(f"{self.name}: panel must be one of {', '.join(PANELS)} or None")
        if self.dashboard is not None and self.dashboard not in DASHBOARD_PANELS:
            raise ValueError(f"{self.name}: dashboard must be one of "
                             f"{', '.join(DASHBOARD_PANELS)} or None")
        if self.histogram not in (0, 1, 2):
            raise ValueError(f"{self.name}: histogram must be 0 (scalar), 1 or 2 (dimensions)")
        if not self.cockpit:
            object.__setattr__(self, "cockpit", self.name)


@dataclass(frozen=True)
class PanelSpec:
    """One GUI Instruments panel: title, section, the quantities drawn on a right axis,
    markers instead of lines, height in pixels, and whether the run's KPIs join it."""

    title: str
    section: str
    right: tuple[str, ...] = ()
    markers: bool = False
    height: int = 240
    kpis: bool = False


# The GUI Instruments panels in display order; a quantity names its panel.
PANELS: dict[str, PanelSpec] = {
    "alpha": PanelSpec("Alpha (0: valley floor, >1: overshoot)", "Step size", markers=True),
    "distance": PanelSpec("Distance (left), UpdateSize (right)", "Step size",
                          right=("UpdateSize",)),
    "gradnorm": PanelSpec("Gradient norm", "Step size"),
    "tests": PanelSpec("Gradient tests (near 1: batch size fits)", "Gradients"),
    "hist1d": PanelSpec("Gradient elements (log counts)", "Gradients"),
    "snr": PanelSpec("GSNR, CABS, early stopping", "Gradients", height=360),
    "hessmaxev": PanelSpec("Hessian max eigenvalue", "Curvature"),
    "hesstrace": PanelSpec("Hessian trace", "Curvature"),
    "tic": PanelSpec("Takeuchi information criterion", "Curvature", height=360),
    "performance": PanelSpec("Loss and KPIs", "Performance", height=360, kpis=True),
}

# The static dashboard's instrument panels (Cockpit's fixed layout; dashboard/figure.py
# draws them, the quantities naming each decide what they show).
DASHBOARD_PANELS = ("alpha", "distance", "gradnorm", "tests", "hist1d", "hist2d", "hessmaxev",
                    "hesstrace", "tic")

_L = frozenset({"loss"})
_E = frozenset({"loss", "engine"})
_D = frozenset({"loss", "engine", "diagonal", "hessian"})
# Every built-in quantity, in the order the suite reports them.
_BUILT_IN: tuple[QuantitySpec, ...] = (
    QuantitySpec("Loss", _L, level="economy", panel="performance"),
    QuantitySpec("GradNorm", _E, per_layer=True, level="economy", panel="gradnorm",
                 dashboard="gradnorm", cockpit_per_parameter=True),
    QuantitySpec("Distance", frozenset(), per_layer=True, level="economy", panel="distance",
                 dashboard="distance", cockpit_per_parameter=True),
    QuantitySpec("UpdateSize", frozenset({"snapshot"}), per_layer=True, level="economy",
                 panel="distance", dashboard="distance", cockpit_per_parameter=True),
    QuantitySpec("NormTest", _E, level="economy", panel="tests", dashboard="tests"),
    QuantitySpec("InnerTest", _E, level="economy", panel="tests", dashboard="tests"),
    QuantitySpec("OrthoTest", _E, level="economy", panel="tests", dashboard="tests"),
    QuantitySpec("GradHist1d", _E, level="economy", panel="hist1d", dashboard="hist1d",
                 histogram=1),
    QuantitySpec("GradHist2d", _E | {"snapshot"}, level="full", dashboard="hist2d",
                 histogram=2),
    QuantitySpec("Alpha", _E | {"snapshot"}, level="economy", panel="alpha",
                 dashboard="alpha"),
    QuantitySpec("HessTrace", frozenset({"loss", "diagonal", "hessian"}), per_layer=True,
                 cockpit_per_parameter=True,
                 level="business", panel="hesstrace", dashboard="hesstrace"),
    QuantitySpec("TICDiag", _D, per_layer=True, level="business", panel="tic", dashboard="tic"),
    QuantitySpec("TICTrace", _D, panel="tic", dashboard="tic"),
    QuantitySpec("HessMaxEV", frozenset({"loss", "hessian"}), level="full", panel="hessmaxev",
                 dashboard="hessmaxev"),
    QuantitySpec("MeanGSNR", _E, panel="snr"),
    QuantitySpec("CABS", _E, panel="snr"),
    QuantitySpec("EarlyStopping", _E, panel="snr"),
)
_SPECS: dict[str, QuantitySpec] = {q.name: q for q in _BUILT_IN}
_NEEDING: dict[str, frozenset[str]] = {}  # `needing`'s answers, until the catalogue changes

# The built-in quantities, in the order the suite reports them (`names()`: with registered).
QUANTITY_NAMES: tuple[str, ...] = tuple(_SPECS)


def specs() -> tuple[QuantitySpec, ...]:
    """Every quantity's spec, built-in and registered, in report order."""
    return tuple(_SPECS.values())


def names() -> tuple[str, ...]:
    """Every quantity's name, built-in and registered, in report order."""
    return tuple(_SPECS)


def spec(name: str) -> QuantitySpec:
    """The spec of quantity `name` (KeyError with the valid names if unknown)."""
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(did_you_mean(name, list(_SPECS), "quantity")) from None


def register(new: QuantitySpec) -> None:
    """Add a quantity (its compute function goes to `deepscope.instruments.suite.computes`)."""
    if new.name in _SPECS:
        raise ValueError(f"quantity {new.name!r} is already in the catalogue")
    _SPECS[new.name] = new
    _NEEDING.clear()


def unregister(name: str) -> None:
    """Remove a registered quantity (built-in ones stay)."""
    if name in QUANTITY_NAMES:
        raise ValueError(f"{name!r} is built in and cannot be removed")
    _SPECS.pop(name, None)
    _NEEDING.clear()


def needing(need: str) -> frozenset[str]:
    """The quantities that need `need` (one of `NEEDS`)."""
    found = _NEEDING.get(need)
    if found is None:  # (asked several times in every instrumented step)
        found = _NEEDING[need] = frozenset(q.name for q in _SPECS.values() if need in q.needs)
    return found


def per_layer() -> tuple[str, ...]:
    """The quantities the GUI offers per layer, in report order."""
    return tuple(q.name for q in _SPECS.values() if q.per_layer)


def panel_quantities(key: str) -> tuple[str, ...]:
    """The quantities drawn in GUI panel `key`, in report order."""
    return tuple(q.name for q in _SPECS.values() if q.panel == key)


def dashboard_quantities(key: str) -> tuple[str, ...]:
    """The quantities drawn in static-dashboard panel `key`, in report order."""
    return tuple(q.name for q in _SPECS.values() if q.dashboard == key)


def histograms(dims: int | None = None) -> tuple[str, ...]:
    """The quantities stored as histograms (of `dims` dimensions; None: any)."""
    return tuple(q.name for q in _SPECS.values()
                 if q.histogram and (dims is None or q.histogram == dims))


def by_cockpit(cockpit: str) -> str | None:
    """The name of the quantity Cockpit calls `cockpit` (its class name), if there is one."""
    return next((q.name for q in _SPECS.values() if q.cockpit == cockpit), None)


def cockpit_per_parameter() -> frozenset[str]:
    """The quantities Cockpit reports as one value per parameter tensor."""
    return frozenset(q.name for q in _SPECS.values() if q.cockpit_per_parameter)


def _configuration(level: str) -> frozenset[str]:
    upto = set(LEVELS[:LEVELS.index(level) + 1])
    return frozenset(q.name for q in _SPECS.values() if q.level in upto)


ECONOMY: frozenset[str] = _configuration("economy")
BUSINESS: frozenset[str] = _configuration("business")
FULL: frozenset[str] = _configuration("full")

CONFIGURATIONS: dict[str, frozenset[str]] = {
    "economy": ECONOMY,
    "business": BUSINESS,
    "full": FULL,
}
# HessMaxEV's cadence by configuration: computed at the first step its schedule picks, then
# at every k-th one, not at the others (never a stale value). Its Lanczos (up to
# lanczos_iter HVPs, each 2-4 training steps on a CPU) is most of full's cost; k here
# keeps full within 25× a plain step on the CPU benchmarks. Restore every step with
# instrument_options={"max_ev_every": 1}.
MAX_EV_EVERY: dict[str, int] = {"full": 4}


def _valid_names_text() -> str:
    return (
        f"valid configurations: {', '.join(CONFIGURATIONS)}; "
        f"valid quantity names: {', '.join(names())}"
    )


def resolve_quantities(quantities: str | Sequence[str]) -> tuple[str, ...]:
    """The chosen quantity names, deduplicated, in catalogue order.

    Args:
        quantities: "economy" | "business" | "full" (any case), one quantity name, or a
            sequence of quantity names (exact Cockpit spelling, e.g. "GradNorm").

    Raises:
        TypeError: if `quantities` is neither a string nor a sequence of strings.
        ValueError: for an unknown or empty choice; the message lists the valid names.
    """
    if isinstance(quantities, str):
        if quantities.lower() in CONFIGURATIONS:
            chosen: set[str] = set(_configuration(quantities.lower()))
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
    known = names()
    unknown = sorted(chosen - set(known))
    if unknown:
        raise ValueError(did_you_mean(unknown[0], [*CONFIGURATIONS, *known],
                                      "quantity", known_as="valid configurations and names",
                                      shown=len(CONFIGURATIONS) + len(known)))
    if not chosen:
        raise ValueError(f"no quantity chosen; {_valid_names_text()}")
    return tuple(name for name in known if name in chosen)
