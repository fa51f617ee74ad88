"""Detectors: cheap per-step judgements of training health, each producing `Finding` rows.

The `HealthMonitor` runs them every `detector_every` steps (a *detector step*), except those
marked `every_step`, and those with a `period` > 1, which run on every period-th detector step
only (the update ratio's snapshot and the activation hooks cost ~10× the rest of a detector
step; what they watch moves slowly). Histories are kept per step kind (train and eval losses
differ) and compare a value with the median of the last `window` checks *before* it, so one
outlier does not move the baseline. A tensor is reported once per episode: when it turns
anomalous, not again until a check finds it normal. Defaults:

| finding              | value                                  | flagged when     | history | run |
|----------------------|----------------------------------------|------------------|---------|-----|
| `exploding_gradient` | ‖∇θ‖ / median of its past checks       | ratio ≥ 10       | 20 (5)  | 10  |
| `vanishing_gradient` | same ratio                             | ratio ≤ 0.01     | 20 (5)  | 10  |
| `loss_spike`         | loss / median of past losses           | ratio ≥ 3        | 50 (10) | 1   |
| `saturation`         | share of exact zeros, ReLU-like output | ≥ 0.95           | -       | 50  |
| `dead_units`         | units zero for every batch item        | ≥ 0.5, batch ≥ 8 | -       | 50  |
| `update_ratio`       | ‖Δθ‖ / ‖θ‖ per weight (dim ≥ 2)        | < 1e-6 or > 0.1  | -       | 50  |

history: window of past checks (minimum needed before judging); checks are per step kind.
run: every how many steps, with the default `detector_every=10` (`period` 5 for the last three).

`exploding_gradient` and `loss_spike` are *acute*: a finding makes the recorder record the
next steps in full (as `nonfinite` does). The loss spike runs every step because the loss
value reaches the host with the health check anyway, and the gradient norms are the ones the
health check computes: neither costs an extra pass or sync.

Write your own by subclassing `Detector`: `begin` (before the forward of a detector step),
`observe` (each module output of that forward), `measure` (after the optimiser step: device
tensors, fetched in the monitor's one host transfer) and `judge` (host floats -> findings).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from .findings import Finding

# Activations whose "off" state is an exact zero, so zero counts mean what they say.
RELU_LIKE: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.Hardswish, nn.Hardsigmoid)


@dataclass
class StepContext:
    """What a detector sees of one step.

    params: every watched trainable parameter by full dotted name. grads: names of those whose
    gradient changed in this step (a backward reached them), in model order (empty in
    `begin`). In `judge` only: loss, the loss as a float (None if no loss was given), and
    grad_norms, the L2 norm of each of those gradients (fetched with the health check).
    """

    step: int
    kind: str
    params: dict[str, Tensor]
    grads: list[str] = field(default_factory=list)
    loss: float | None = None
    loss_name: str = "loss"
    grad_norms: dict[str, float] = field(default_factory=dict)


class Detector:
    """Base class of the detectors; override the hooks you need.

    name: the detector's name (custom detectors report under it). acute: the finding detector
    names that make the recorder record the next steps in full. every_step: run on every
    step, not only on detector steps. period: run on every period-th detector step only
    (counting from the first; set it on an instance to change it, e.g. `d.period = 1`).
    observes_outputs: receive `observe` calls. shared: its
    findings rest on values the same on every rank of a DDP job (the averaged gradients, the
    parameters), so in a distributed run its acute findings still start `record_next`
    (default False: a custom detector's findings are reported there, not followed).
    """

    name: ClassVar[str] = "detector"
    acute: ClassVar[frozenset[str]] = frozenset()
    every_step: ClassVar[bool] = False
    period: int = 1
    observes_outputs: ClassVar[bool] = False
    shared: ClassVar[bool] = False

    def __init__(self) -> None:
        self._active: set[Hashable] = set()

    def begin(self, ctx: StepContext) -> None:
        """Before the forward of a step this detector runs on (e.g. snapshot parameters)."""

    def observes(self, module: nn.Module) -> bool:
        """Whether `observe` wants the outputs of `module` (default: every module); asked
        once per module. Modules no detector observes are not hooked on detector steps (a
        hook costs ~10-20 µs)."""
        return True

    def observe(self, path: str, module: nn.Module, output: Tensor) -> None:
        """One floating-point output of `module` (named `path`) in that step's forward."""

    def measure(self, ctx: StepContext) -> dict[str, Tensor]:
        """After the optimiser step: device tensors (any shape) to fetch with the health check.

        Never synchronise here: the monitor fetches everything in one transfer (deferred by a
        step on CUDA, so `judge` may run one step later)."""
        return {}

    def judge(self, ctx: StepContext, values: dict[str, list[float]]) -> list[Finding]:
        """Host side: the flattened values `measure` returned, by the same keys."""
        return []

    def abort(self) -> None:
        """Drop per-step state: the step failed or was not finite."""

    def _episode(self, key: Hashable, anomalous: bool) -> bool:
        """True when `key` turns anomalous; report once per episode, not once per check."""
        if not anomalous:
            self._active.discard(key)
            return False
        if key in self._active:
            return False
        self._active.add(key)
        return True


class _History:
    """The last `window` values per key; the median is over values before the current one.

    Each key keeps its values in arrival order and sorted (`bisect`), so the median is read,
    not computed: the loss spike judges every step."""

    def __init__(self, window: int, min_history: int) -> None:
        if window < 1 or not 1 <= min_history <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_history <= window, got "
                             f"window={window}, min_history={min_history}")
        self.window, self.min_history = window, min_history
        self._values: dict[Hashable, tuple[deque[float], list[float]]] = {}

    def ratio(self, key: Hashable, value: float) -> tuple[float | None, float, int]:
        """(value / median of the history, that median, history length), then remember
        `value`. The ratio is None while the history is shorter than `min_history` or its
        median is not positive (a ratio to zero or to a negative loss means nothing). A
        non-finite value is not remembered (the monitor judges finite steps only)."""
        entry = self._values.get(key)
        if entry is None:
            entry = self._values[key] = (deque(), [])
        past, ordered = entry
        n = len(past)
        median = math.nan
        if n >= self.min_history:
            half = n // 2
            median = ordered[half] if n % 2 else (ordered[half - 1] + ordered[half]) / 2
        if not math.isfinite(value):
            return (value / median if median > 0 else None), median, n
        if n == self.window:
            del ordered[bisect.bisect_left(ordered, past.popleft())]
        past.append(value)
        bisect.insort(ordered, value)
        return (value / median if median > 0 else None), median, n


class GradientNorm(Detector):
    """Exploding / vanishing gradients: each parameter's gradient norm against its own history.

    explode: ratio ≥ this is `exploding_gradient` (acute). vanish: ratio ≤ this is
    `vanishing_gradient`. window / min_history: how many past checks form the median, and how
    many are needed before judging.
    """

    name = "gradient_norm"
    acute = frozenset({"exploding_gradient"})
    shared = True  # .grad after DDP's all-reduce

    def __init__(self, explode: float = 10.0, vanish: float = 0.01, window: int = 20,
                 min_history: int = 5) -> None:
        super().__init__()
        if not 0 <= vanish < 1 < explode:
            raise ValueError(f"need 0 <= vanish < 1 < explode, got vanish={vanish}, "
                             f"explode={explode}")
        self.explode, self.vanish = explode, vanish
        self._history = _History(window, min_history)

    def judge(self, ctx: StepContext, values: dict[str, list[float]]) -> list[Finding]:
        found = []
        for name, norm in ctx.grad_norms.items():  # computed by the health check anyway
            ratio, median, n = self._history.ratio((ctx.kind, name), norm)
            if ratio is None:
                continue
            if self._episode((ctx.kind, name, "explode"), ratio >= self.explode):
                found.append(Finding(
                    ctx.step, name, "exploding_gradient", ratio, self.explode,
                    f"gradient norm of {name} is {norm:.3g}, {ratio:.3g}× the median "
                    f"{median:.3g} of its previous {n} checks"))
            if self._episode((ctx.kind, name, "vanish"), ratio <= self.vanish):
                found.append(Finding(
                    ctx.step, name, "vanishing_gradient", ratio, self.vanish,
                    f"gradient norm of {name} fell to {norm:.3g}, {ratio:.3g}× the median "
                    f"{median:.3g} of its previous {n} checks"))
        return found


class LossSpike(Detector):
    """The loss against the median of the last `window` losses of the same step kind.

    ratio: loss / median ≥ this is a `loss_spike` (acute). Losses whose median is not
    positive are not judged (the ratio would mean nothing).
    """

    name = "loss_spike"
    acute = frozenset({"loss_spike"})
    every_step = True

    def __init__(self, ratio: float = 3.0, window: int = 50, min_history: int = 10) -> None:
        super().__init__()
        if ratio <= 1:
            raise ValueError(f"a loss spike ratio must be > 1, got {ratio}")
        self.ratio = ratio
        self._history = _History(window, min_history)

    def judge(self, ctx: StepContext, values: dict[str, list[float]]) -> list[Finding]:
        if ctx.loss is None:
            return []
        ratio, median, n = self._history.ratio(ctx.kind, ctx.loss)
        if ratio is None or not self._episode(ctx.kind, ratio >= self.ratio):
            return []
        return [Finding(ctx.step, ctx.loss_name, "loss_spike", ratio, self.ratio,
                        f"loss {ctx.loss:.4g} is {ratio:.3g}× the median {median:.4g} of the "
                        f"previous {n} {ctx.kind!r} steps")]


class DeadUnits(Detector):
    """Saturated and dead ReLU-like activations (modules in `types`, default `RELU_LIKE`).

    saturation: fraction of exact zeros in the output ≥ this is `saturation`. dead: fraction
    of units (every position except the batch dimension 0) that are zero for every batch item
    ≥ this is `dead_units`; judged only with at least `min_batch` items (with fewer, a live
    unit is too often zero for all of them by chance). A module called several times in a
    step counts all its calls: a unit is dead if it is zero in every call.
    """

    name = "dead_units"
    observes_outputs = True
    period = 5

    def __init__(self, saturation: float = 0.95, dead: float = 0.5, min_batch: int = 8,
                 types: tuple[type[nn.Module], ...] = RELU_LIKE) -> None:
        super().__init__()
        if not (0 < saturation <= 1 and 0 < dead <= 1):
            raise ValueError(f"thresholds are fractions in (0, 1], got saturation={saturation},"
                             f" dead={dead}")
        self.saturation, self.dead, self.min_batch, self.types = saturation, dead, min_batch, types
        # path -> [non-zero count (device), element count, per unit 1 if alive else 0 (uint8,
        # device) or None]
        self._acc: dict[str, list] = {}
        # path -> (element count, unit count or 0) of the values measured last, for judge
        self._sizes: dict[str, tuple[int, int]] = {}

    def begin(self, ctx: StepContext) -> None:
        self._acc = {}

    def observes(self, module: nn.Module) -> bool:
        return isinstance(module, self.types)

    def observe(self, path: str, module: nn.Module, output: Tensor) -> None:
        if not isinstance(module, self.types) or output.dim() == 0 or output.numel() == 0:
            return
        # Three cheap ops (each costs ~10 µs right after a step's kernels; count_nonzero and
        # any(0) cost 20-30 µs each on a CPU): a bool copy (NaN is not zero), its sum, and
        # its per-unit max over the batch as bytes.
        nonzero_mask = output.detach().bool()
        nonzero = nonzero_mask.sum()
        alive = (nonzero_mask.view(torch.uint8).reshape(output.shape[0], -1).amax(0)
                 if output.dim() >= 2 and output.shape[0] >= self.min_batch else None)
        acc = self._acc.get(path)
        if acc is None:
            self._acc[path] = [nonzero, output.numel(), alive]
            return
        acc[0] = acc[0] + nonzero
        acc[1] += output.numel()
        same = alive is not None and acc[2] is not None and acc[2].shape == alive.shape
        # calls of different shapes: no unit view
        acc[2] = torch.maximum(acc[2], alive) if same else None

    def measure(self, ctx: StepContext) -> dict[str, Tensor]:
        values = {}
        self._sizes = {}
        for path, (nonzero, numel, alive) in self._acc.items():
            values[path] = nonzero.reshape(1) if alive is None else torch.stack(
                [nonzero, alive.sum()])  # uint8's sum is int64
            self._sizes[path] = (numel, 0 if alive is None else alive.numel())
        self._acc = {}
        return values

    def judge(self, ctx: StepContext, values: dict[str, list[float]]) -> list[Finding]:
        found = []
        for path, counts in values.items():
            numel, units = self._sizes[path]
            zero_frac = 1 - counts[0] / numel
            dead_frac = 1 - counts[1] / units if units else math.nan
            if self._episode((ctx.kind, path, "saturation"), zero_frac >= self.saturation):
                found.append(Finding(
                    ctx.step, path, "saturation", zero_frac, self.saturation,
                    f"{zero_frac:.1%} of the outputs of {path} are exactly zero"))
            dead = not math.isnan(dead_frac) and dead_frac >= self.dead
            if self._episode((ctx.kind, path, "dead"), dead):
                found.append(Finding(
                    ctx.step, path, "dead_units", dead_frac, self.dead,
                    f"{dead_frac:.1%} of the units of {path} are zero for every item of the "
                    "batch (dead)"))
        return found

    def abort(self) -> None:
        self._acc = {}  # _sizes stays: a deferred step's judge may still read it


class UpdateRatio(Detector):
    """‖Δθ‖ / ‖θ‖ of each weight over the step (the optimiser's relative update size).

    low / high: a ratio outside [low, high] is an `update_ratio` finding. min_dim: only
    parameters with at least this many dimensions (weights; zero-initialised biases would give
    meaningless ratios). Needs θ before the step: a snapshot of those parameters on detector
    steps only, into one copy of them kept between detector steps (allocating a fresh copy
    each time cost more than the rest of the check; the peak memory is the same). A step in
    which no parameter changed (no optimiser step, e.g. gradient accumulation) is not judged,
    nor are parameters without a gradient or with θ = 0.
    """

    name = "update_ratio"
    period = 5

    def __init__(self, low: float = 1e-6, high: float = 0.1, min_dim: int = 2) -> None:
        super().__init__()
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high, got low={low}, high={high}")
        self.low, self.high, self.min_dim = low, high, min_dim
        self._copies: dict[str, Tensor] = {}  # name -> θ at the detector step's start
        self._snapped = False
        self._measured: list[str] = []  # the names `judge` gets values of, in order

    def begin(self, ctx: StepContext) -> None:
        names, params, copies = [], [], []
        for n, p in ctx.params.items():
            if p.dim() < self.min_dim:
                continue
            copy = self._copies.get(n)
            if (copy is None or copy.shape != p.shape or copy.dtype != p.dtype
                    or copy.device != p.device):
                copy = self._copies[n] = torch.empty_like(p, requires_grad=False)
            names.append(n)
            params.append(p.detach())
            copies.append(copy)
        if len(self._copies) != len(names):  # parameters gone since: their copies too
            self._copies = {n: self._copies[n] for n in names}
        if copies:
            with torch.no_grad():
                torch._foreach_copy_(copies, params)
        self._snapped = True

    def measure(self, ctx: StepContext) -> dict[str, Tensor]:
        names = [n for n in ctx.grads if n in self._copies] if self._snapped else []
        self._snapped = False
        self._measured = []
        if not names:
            return {}
        before = [self._copies[n] for n in names]
        after = [ctx.params[n].detach() for n in names]
        weight_norms = torch._foreach_norm(before)
        torch._foreach_sub_(before, after)  # in place: refilled at the next detector step
        norms = [*torch._foreach_norm(before), *weight_norms]
        device = norms[0].device
        # one tensor for all: ‖Δθ‖ of each name, then ‖θ‖ of each
        stacked = torch.stack([t if t.device == device else t.to(device) for t in norms])
        self._measured = names
        return {"norms": stacked}

    def judge(self, ctx: StepContext, values: dict[str, list[float]]) -> list[Finding]:
        norms = values.get("norms", [])
        k = len(self._measured)
        pairs = [(name, norms[i], norms[k + i]) for i, name in enumerate(self._measured)]
        if not any(d > 0 for _, d, _ in pairs):
            return []  # nothing moved: no optimiser step in this step
        found = []
        for name, delta, weight in pairs:
            if weight <= 0:
                continue
            ratio = delta / weight
            bound = self.high if ratio > self.high else self.low
            if self._episode((ctx.kind, name), not self.low <= ratio <= self.high):
                side = "above" if bound == self.high else "below"
                found.append(Finding(
                    ctx.step, name, "update_ratio", ratio, bound,
                    f"update of {name} is {ratio:.3g} of its norm ‖Δθ‖/‖θ‖ = {delta:.3g}/"
                    f"{weight:.3g}, {side} the range [{self.low:g}, {self.high:g}]"))
        return found

    def abort(self) -> None:
        self._snapped = False


def default_detectors() -> list[Detector]:
    """A fresh set of the built-in detectors with their default thresholds."""
    return [GradientNorm(), LossSpike(), DeadUnits(), UpdateRatio()]
