"""Diagnoses of the optimisation as a whole: lr_too_high, lr_too_low, not_learning,
noisy_batch, missing_zero_grad — from the loss KPI and the instruments (α, update size,
gradient norm, norm test) when they were recorded."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .base import Diagnosis, Evidence, combine, fmt, ramp

FLAT = 0.05          # the loss fell by less than this fraction: it is not moving
TINY_UPDATE = 1e-4   # ‖Δθ‖/‖θ‖ per step below this: the optimiser barely moves
LARGE_UPDATE = 0.03  # ‖Δθ‖/‖θ‖ per step above this: every step rewrites the weights
NORM_TEST = 0.95     # norm test (median) above this: the batch gradient is mostly noise
JITTER = 0.3         # median |ΔL| / L above this: the loss jumps from batch to batch
ZERO_GRAD_GROWTH = 3.0  # ‖Δθ‖/‖g‖ this many times its first value: gradients accumulate


class LossShape:
    """The loss curve summarised: its early and late levels, progress and jitter."""

    def __init__(self, loss: pd.Series) -> None:
        v = loss.to_numpy()
        finite = np.isfinite(v)
        self.steps, self.v = loss.index.to_numpy()[finite], v[finite]
        n = len(self.v)
        self.ok = n >= 10
        if not self.ok:
            return
        k = max(3, n // 10)
        self.early = float(np.median(self.v[:k]))
        self.late = float(np.median(self.v[-max(3, n // 5):]))
        self.progress = 1 - self.late / self.early if self.early > 0 else math.nan
        roll = pd.Series(self.v).rolling(k, min_periods=1).median().to_numpy()
        self.low = float(roll.min())
        self.low_step = int(self.steps[int(roll.argmin())])
        half = self.v[n // 2:]
        level = float(np.median(np.abs(half))) or 1.0
        self.jitter = float(np.median(np.abs(np.diff(half)))) / level


def _update_ratio(ev: Evidence) -> pd.Series:
    """‖Δθ‖/‖θ‖ per instrument step: UpdateSize over the parameter norm recorded then."""
    upd = ev.quantity("UpdateSize")
    if upd.empty:
        return upd
    norms = []
    for name in ev.params:
        p = ev.records(name)
        norms.append(pd.Series(p["norm"].to_numpy() ** 2, index=p["step"].to_numpy()))
    if not norms:
        return pd.Series(dtype=float)
    total = np.sqrt(pd.concat(norms, axis=1).sum(axis=1, min_count=1))
    both = pd.concat([upd, total], axis=1, join="inner").dropna()
    both = both[both.iloc[:, 1] > 0]
    return both.iloc[:, 0] / both.iloc[:, 1]


def _ratio_findings(ev: Evidence, side: str) -> pd.DataFrame:
    a = ev.anomalies[ev.anomalies["detector"] == "update_ratio"]
    return a[a["value"] > a["threshold"]] if side == "high" else a[a["value"] < a["threshold"]]


def _chance(ev: Evidence) -> float | None:
    """log C of a classifier with C outputs feeding the loss (log 2 for one logit)."""
    losses = set(ev.role("loss"))
    shapes = dict(zip(ev.tensors["name"], ev.tensors["shape"]))
    for s, t in ev.edges:
        if t in losses and s not in losses and shapes.get(s):
            c = int(shapes[s][-1]) if len(shapes[s]) > 1 else 1
            return math.log(max(c, 2))
    return None


def learning_rate(ev: Evidence) -> list[Diagnosis]:
    """lr_too_high / lr_too_low / not_learning from the loss curve, α and the update ratio."""
    shape = LossShape(ev.loss)
    if not shape.ok:
        ev.need(("lr_too_high", "lr_too_low", "not_learning"), "loss on 10 or more steps",
                "rec.loss(loss) in every step")
        return []
    alpha, ratio = ev.quantity("Alpha"), _update_ratio(ev)
    if alpha.empty or ratio.empty:
        ev.need(("lr_too_high", "lr_too_low", "not_learning", "missing_zero_grad"),
                "α and the update size (instruments)",
                "Scope(..., instruments='economy') (or ['Alpha', 'UpdateSize', 'GradNorm'])")
    a_med = float(alpha.median()) if len(alpha) else math.nan
    u_med = float(ratio.median()) if len(ratio) else math.nan
    evidence = {"loss_early": shape.early, "loss_late": shape.late,
                "loss_progress": shape.progress, "loss_jitter": shape.jitter}
    if len(alpha):
        evidence["alpha_median"] = a_med
    if len(ratio):
        evidence["update_ratio_median"] = u_med
    out: list[Diagnosis] = []

    rising = shape.late > 1.3 * shape.low and shape.late > 0.9 * shape.early
    high = combine(
        ramp(a_med, 1.0, 3.0, 0.0, 0.6) if a_med > 1 else 0.0,
        ramp(math.log10(u_med / LARGE_UPDATE), 0, 1, 0.45, 0.85) if u_med > LARGE_UPDATE
        else 0.0,
        0.45 if rising else 0.0,
        ramp(shape.jitter, 0.5, 1.5, 0.0, 0.4),
        0.3 if len(_ratio_findings(ev, "high")) and math.isnan(u_med) else 0.0)
    if high > 0:
        step = shape.low_step if rising else int(shape.steps[0])
        out.append(Diagnosis(
            "lr_too_high", high, step, "model",
            "steps overshoot: " + ", ".join(filter(None, [
                f"median α {fmt(a_med)} (> 1 overshoots)" if a_med > 1 else "",
                f"update ‖Δθ‖/‖θ‖ {fmt(u_med)} per step" if u_med > LARGE_UPDATE else "",
                f"loss rose from its low {fmt(shape.low)} (step {shape.low_step}) to "
                f"{fmt(shape.late)}" if rising else "",
                f"loss jitter {fmt(shape.jitter)} of its level" if shape.jitter > 0.5 else ""])),
            evidence, "lower the learning rate 3-10× (or add warm-up and gradient clipping)"))

    flat = shape.progress < FLAT
    tiny = u_med < TINY_UPDATE or (math.isnan(u_med) and len(_ratio_findings(ev, "low")) > 0)
    if flat and tiny:
        low = combine(0.5, ramp(math.log10(TINY_UPDATE / u_med), 0, 2, 0.2, 0.6)
                      if u_med < TINY_UPDATE else 0.0,
                      0.3 if a_med < -0.8 else 0.0)
        out.append(Diagnosis(
            "lr_too_low", low, int(shape.steps[0]), "model",
            f"the loss barely moves ({fmt(shape.early)} → {fmt(shape.late)}) and each step "
            + (f"changes the weights by {fmt(u_med)} of their norm" if len(ratio) else
               "changes the weights by less than 1e-6 of their norm")
            + (f"; median α {fmt(a_med)} (≈ -1: far from the valley floor)"
               if a_med < -0.8 else ""),
            evidence, "raise the learning rate 10× (try a learning-rate range test)"))
    moving = u_med >= TINY_UPDATE if len(ratio) else not len(_ratio_findings(ev, "low"))
    if flat and moving and high < 0.5:
        chance = _chance(ev)
        near = chance is not None and abs(shape.late - chance) <= 0.1 * chance
        conf = combine(0.35, 0.45 if near else 0.0, 0.0 if math.isnan(u_med) else 0.1)
        evidence = {**evidence, **({"chance_level": chance} if chance is not None else {})}
        out.append(Diagnosis(
            "not_learning", conf, int(shape.steps[0]), ev.loss_name,
            f"the loss stays at {fmt(shape.late)} (from {fmt(shape.early)})"
            + (f", the chance level log C = {fmt(chance)}," if near else "")
            + " while the weights move"
            + (f" ({fmt(u_med)} of their norm per step)" if len(ratio) else ""),
            evidence, "check that targets match inputs (shuffled or misaligned labels, the "
            "wrong target column); try to overfit one small batch first"))
    return out


def noisy_batch(ev: Evidence) -> list[Diagnosis]:
    """The norm test persistently at 1 or above: the batch gradient is mostly noise.

    The norm test T² estimates noise / (signal + noise) of the batch gradient, so T ≈ 1 means
    the signal is lost in the noise; the batch that brings the noise down to the signal is
    about B·T² / (1 − T²)."""
    test = ev.quantity("NormTest")
    if test.empty:
        ev.need(("noisy_batch",), "norm test (instruments)",
                "Scope(..., instruments='economy') (or ['NormTest'])")
        return []
    med = float(test.median())
    shape = LossShape(ev.loss)
    jitter = shape.jitter if shape.ok else math.nan
    # T near 1 also when the mean gradient is simply small (converged, or nothing to learn):
    # only a loss that jumps from batch to batch says the batch is what is noisy
    if len(test) < 5 or med < NORM_TEST or not jitter >= JITTER:
        return []
    batch = ev.batch_size
    signal = max(1 - med ** 2, 0.05)  # T ≥ 1: the signal is below what the test resolves
    suggest = int(math.ceil(batch * med ** 2 / signal)) if batch else None
    return [Diagnosis(
        "noisy_batch", ramp(jitter, JITTER, 1.0, 0.55, 0.9), int(test.index[0]), "model",
        f"norm test {fmt(med)} (median of {len(test)} steps; near 1 the batch gradient is "
        f"mostly noise)" + (f" at batch size {batch}" if batch else "")
        + f", and the loss jumps by {fmt(jitter)} of its level from step to step",
        {"norm_test_median": med, "loss_jitter": jitter,
         **({"batch_size": batch, "suggested_batch_size": suggest} if batch else {})},
        f"increase the batch size (to about {suggest}) or lower the learning rate"
        if suggest else "increase the batch size or lower the learning rate")]


def missing_zero_grad(ev: Evidence) -> list[Diagnosis]:
    """Gradients accumulating across steps: the step taken per unit of batch gradient
    (UpdateSize / GradNorm) is several times what it was at the first instrumented step,
    when nothing had accumulated yet (for plain SGD it is the learning rate).

    With momentum μ a healthy step grows up to 1/(1 − μ) times the first, so the threshold
    grows with it; adaptive optimisers (Adam, ...) take steps that do not scale with ‖g‖, so
    the check does not apply to them (the run's meta "optimizer" says which was used)."""
    settings = ev.run.meta(ev.rank).get("optimizer")
    settings = settings if isinstance(settings, dict) else {}
    if settings and settings.get("type") != "SGD":
        ev.need(("missing_zero_grad",), f"SGD steps ({settings.get('type')}'s steps do not "
                "scale with the gradient norm)", "a run trained with SGD")
        return []
    momentum = float(settings.get("momentum") or 0.0)
    threshold = ZERO_GRAD_GROWTH / (1.0 - momentum) if momentum < 1 else float("inf")
    upd, grad = ev.quantity("UpdateSize"), ev.quantity("GradNorm")
    both = pd.concat([upd, grad], axis=1, join="inner").dropna()
    both = both[both.iloc[:, 1] > 0]
    if len(both) < 4:
        if not upd.empty:
            ev.need(("missing_zero_grad",), "update size and gradient norm at 4+ steps",
                    "an instrument_schedule that records more steps")
        return []
    eff = (both.iloc[:, 0] / both.iloc[:, 1]).to_numpy()
    growth = float(np.median(eff[1:]) / eff[0]) if eff[0] > 0 else 0.0
    if growth < threshold:
        return []
    return [Diagnosis(
        "missing_zero_grad", ramp(growth, threshold, 10 * threshold / ZERO_GRAD_GROWTH,
                                  0.55, 0.9),
        int(both.index[1]), "model",
        f"the step per unit gradient ‖Δθ‖/‖g‖ is {fmt(growth)}× its value at the first "
        f"instrumented step ({fmt(float(eff[0]))} → median {fmt(float(np.median(eff[1:])))}): "
        "gradients add up across steps",
        {"effective_lr_growth": growth, "effective_lr_first": float(eff[0]),
         "effective_lr_median": float(np.median(eff[1:]))},
        "call optimizer.zero_grad() once per optimiser step (before backward)")]
