"""A stored histogram (GradHist1d, GradHist2d) as one typed value, decoded here only: the
query API, the GUI, the static dashboard, the Cockpit compat layer and the TensorBoard export
all read histograms through `Histogram`.

The stored format (`instruments.histograms.bins`): int64 counts, shape (bins,) for 1-D or
(param bins, grad bins) for 2-D, and metadata {"edges": [lo, hi, bins] (1-D) or one such
triple per axis (2-D: θ axis first), the counts outside the bins (underflow, overflow, nan,
posinf, neginf; 2-D also param_*), ...}. A histogram recorded as missing has no counts and
meta["reason"].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The counts outside the bins, as stored beside them (1-D; 2-D adds param_<same>).
EXTRAS = ("underflow", "overflow", "nan", "posinf", "neginf")


@dataclass(frozen=True)
class Histogram:
    """One histogram of a quantity at a step and layer ("" = whole model).

    counts: (bins,) or (param bins, grad bins) counts; None when recorded as missing.
    edges: bin edges per axis, each (bins + 1,) (2-D: θ axis first); () when missing.
    extras: counts outside the bins by kind (`EXTRAS`, 2-D also param_*), those stored.
    meta: the stored metadata as is. reason: why it is missing ("" when it has counts).

    Unpacks and indexes as the pair `(counts, meta)` (what `Run.histogram` returned before
    it was typed).
    """

    name: str
    step: int
    layer: str
    counts: np.ndarray | None
    meta: dict[str, Any]
    edges: tuple[np.ndarray, ...] = ()
    extras: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    @classmethod
    def decode(cls, name: str, step: int, layer: str, counts: np.ndarray | None,
               meta: dict[str, Any]) -> Histogram:
        """The typed value of stored `counts` (None: recorded as missing) and `meta`."""
        if counts is None:
            reason = str(meta.get("reason") or "no histogram was stored at this step")
            return cls(name, step, layer, None, meta, reason=reason)
        spec = meta["edges"]
        axes = spec if isinstance(spec[0], (list, tuple)) else [spec]
        edges = tuple(np.linspace(lo, hi, int(n) + 1) for lo, hi, n in axes)
        kinds = [*EXTRAS, *(f"param_{k}" for k in EXTRAS)]
        extras = {k: meta[k] for k in kinds if k in meta}
        return cls(name, step, layer, counts, meta, edges, extras)

    @property
    def missing(self) -> bool:
        """Whether it was recorded as missing (then `reason` says why)."""
        return self.counts is None

    @property
    def outside(self) -> int:
        """How many values fell outside the bins or were not finite (all axes)."""
        return int(sum(v or 0 for v in self.extras.values()))

    def __iter__(self) -> Iterator[Any]:
        return iter((self.counts, self.meta))

    def __getitem__(self, index: int) -> Any:
        return (self.counts, self.meta)[index]

    def __len__(self) -> int:
        return 2
