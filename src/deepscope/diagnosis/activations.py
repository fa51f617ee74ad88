"""Diagnoses from activations and inputs: dead_units, saturation, bad_input_scale."""

from __future__ import annotations

import math

import numpy as np

from .base import Diagnosis, Evidence, combine, first_step, fmt, ramp

DEAD = 0.4        # share of units zero for every batch item that starts to count
PINNED = 0.7      # saturation index (1 = every value at a bound) that starts to count
SQUASHED = 0.05   # one side of an output pre-activation this much smaller than the other
INPUT_RMS = (0.01, 10.0)  # RMS of a float input outside this range is far from unit scale


def _late(steps: np.ndarray) -> np.ndarray:
    """The recorded steps of the second half of the run (training has settled)."""
    return steps >= steps[0] + (steps[-1] - steps[0]) / 2 if len(steps) else steps.astype(bool)


def _activations(ev: Evidence) -> list[str]:
    return ev.role("activation")


def dead_units(ev: Evidence) -> list[Diagnosis]:
    """Units of a non-negative activation that are exactly zero for every batch item."""
    acts = _activations(ev)
    out: list[Diagnosis] = []
    judged = False
    computed = {t for _, t in ev.edges}
    for name in acts:
        rec = ev.records(name)
        if (len(rec) < 2 or rec["min"].min() < 0 or not (rec["zero_frac"] > 0).any()
                or (ev.edges and name not in computed)):
            continue  # not ReLU-like, or a leaf (a zero initial state): zeros mean nothing
        steps = rec["step"].to_numpy()
        fracs = []
        for step in steps[_late(steps)]:
            try:
                v = ev.run.values(name, int(step), view="neuron_abs_max", rank=ev.rank)
            except KeyError:
                continue
            fracs.append(float((v == 0).mean()) if v.size > 1 else math.nan)
        fracs = [f for f in fracs if math.isfinite(f)]
        if not fracs:
            continue
        judged = True
        frac = float(np.median(fracs))
        if frac < DEAD:
            continue
        out.append(Diagnosis(
            "dead_units", ramp(frac, DEAD, 1.0, 0.5, 0.95), int(steps[_late(steps)][0]), name,
            f"{frac:.0%} of the units of {name} are zero for every batch item (median over "
            f"{len(fracs)} recorded steps of the second half)",
            {"dead_fraction": frac, "steps_judged": len(fracs)},
            "initialise biases at 0 or slightly positive, use a leaky activation "
            "(LeakyReLU/GELU), lower the learning rate, or add normalisation before it"))
    if not judged:
        for _, a in ev.anomalies[ev.anomalies["detector"] == "dead_units"].iterrows():
            out.append(Diagnosis(
                "dead_units", ramp(float(a["value"]), 0.5, 1.0, 0.45, 0.7), int(a["step"]),
                str(a["tensor"]), str(a["message"]), {"dead_fraction": float(a["value"])},
                "initialise biases at 0 or slightly positive, use a leaky activation, or lower "
                "the learning rate"))
        if not acts:
            ev.need(("dead_units", "saturation"), "activation records",
                    "scope.watch(model, activations=True) or rec.tensor(name, activation)")
    return out


def _pinned(rec) -> np.ndarray:
    """Saturation index per record of a bounded activation: 1 when every value sits on a bound
    of [0, 1] (sigmoid-like: var / (m(1-m))) or of [-1, 1] (tanh-like: E[x²]); NaN when the
    values are not bounded like that."""
    m, var = rec["mean"].to_numpy(), rec["std"].to_numpy() ** 2
    lo, hi = rec["min"].to_numpy(), rec["max"].to_numpy()
    eps = 1e-6
    unit = (lo >= -eps) & (hi <= 1 + eps) & (m > 0) & (m < 1) & (rec["zero_frac"] < 0.5)
    sym = (lo >= -1 - eps) & (hi <= 1 + eps) & (lo < 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(unit, var / (m * (1 - m)), np.where(sym, var + m * m, np.nan))


def _one_sided(rec) -> np.ndarray:
    """Per record: the smaller side's mean magnitude over the larger's (0 = one-sided), for
    values of both signs; 0 for non-negative values with many exact zeros (ReLU'd logits);
    NaN otherwise."""
    a, m = rec["abs_mean"].to_numpy(), rec["mean"].to_numpy()
    lo, hi = -rec["min"].to_numpy(), rec["max"].to_numpy()
    pos, neg = (a + m) / 2, (a - m) / 2
    both = (lo > 0) & (hi > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        # the weaker side small both on average and at its extreme: a kink at 0
        ratio = np.maximum(np.minimum(pos, neg) / np.maximum(pos, neg),
                           np.minimum(lo, hi) / np.maximum(lo, hi))
    relu = (rec["min"].to_numpy() >= 0) & (rec["zero_frac"].to_numpy() >= 0.2)
    return np.where(both, ratio, np.where(relu, 0.0, np.nan))


def saturation(ev: Evidence) -> list[Diagnosis]:
    """Bounded activations pinned at their bounds, and one-sided pre-activations of the
    output (the tensors that feed the loss)."""
    out: list[Diagnosis] = []
    for name in _activations(ev):
        rec = ev.records(name)
        if len(rec) < 2:
            continue
        s = _pinned(rec)
        late = _late(rec["step"].to_numpy())
        if np.isnan(s[late]).all():
            continue
        level = float(np.nanmedian(s[late]))
        if level >= PINNED:
            out.append(Diagnosis(
                "saturation", ramp(level, PINNED, 1.0, 0.5, 0.95),
                first_step(rec["step"], s >= PINNED), name,
                f"{name} sits at its bounds: saturation index {fmt(level)} (1 = every value at "
                "±1 or 0/1; the gradient through it is near zero)",
                {"saturation_index": level, "mean": float(rec["mean"].iloc[-1]),
                 "std": float(rec["std"].iloc[-1])},
                "scale the layer's inputs/initialisation down or add normalisation before "
                "the nonlinearity"))
    losses = set(ev.role("loss"))
    shaped = set(ev.role("activation")) | set(ev.role("output"))
    feeds = sorted({s for s, t in ev.edges if t in losses} & shaped)
    for name in feeds:
        rec = ev.wide[(ev.wide["tensor"] == name) & (ev.wide["direction"] == "forward")]
        if rec.empty:
            continue
        r = _one_sided(rec)
        known = ~np.isnan(r)
        if known.sum() < max(2, len(r) / 2):
            continue  # mostly of one sign only: shifted logits (softmax), not a kink
        hit = known & (r < SQUASHED)
        share = float(hit.sum() / known.sum())
        if share < 0.8:
            continue
        level = float(np.nanmedian(r))
        out.append(Diagnosis(
            "saturation", ramp(share, 0.8, 1.0, 0.6, 0.95), first_step(rec["step"], hit),
            name,
            f"{name} feeds the loss but is one-sided: its weaker sign is {fmt(level)}× the "
            f"other (mean magnitude and extreme, median) in {share:.0%} of "
            f"{int(known.sum())} records",
            {"side_ratio": level, "records_one_sided": int(hit.sum()),
             "records": int(known.sum())},
            f"remove the activation (ReLU/leaky ReLU) applied to {name}: the output layer "
            "must be able to produce both signs"))
    return out


def bad_input_scale(ev: Evidence, saturated: list[Diagnosis]) -> list[Diagnosis]:
    """Floating-point inputs whose RMS is far from 1 (raw pixels 0–255, unscaled features);
    `saturated`: the saturation diagnoses, to name a layer the input saturates."""
    dtypes = dict(zip(ev.tensors["name"], ev.tensors["dtype"]))
    inputs = [n for n in ev.role("input") if "float" in str(dtypes.get(n, ""))]
    if not inputs:
        ev.need(("bad_input_scale",), "floating-point input record",
                "rec.tensor('input', x, role='input') in the step")
        return []
    out: list[Diagnosis] = []
    for name in inputs:
        rec = ev.records(name)
        rms = float(np.median(np.sqrt(rec["std"] ** 2 + rec["mean"] ** 2)))
        lo, hi = INPUT_RMS
        if not (rms > hi or 0 < rms < lo):
            continue
        dec = math.log10(rms / hi) if rms > hi else math.log10(lo / rms)
        near = {t for s, t in ev.edges if s == name}
        near |= {t for s, t in ev.edges if s in near}  # the layer and its nonlinearity
        sat = [d for d in saturated if d.where in near]
        conf = ramp(dec, 0, 1.5, 0.5, 0.85)
        if sat:  # the saturation it causes is its symptom: rank the cause above it
            conf = max(combine(conf, 0.3), min(0.99, sat[0].confidence + 0.01))
        out.append(Diagnosis(
            "bad_input_scale", conf, int(rec["step"].iloc[0]), name,
            f"input {name} has RMS {fmt(rms)} (range {fmt(float(rec['min'].min()))} to "
            f"{fmt(float(rec['max'].max()))}), far from unit scale"
            + (f"; it saturates {sat[0].where}" if sat else ""),
            {"rms": rms, "min": float(rec["min"].min()), "max": float(rec["max"].max())},
            "standardise the inputs (subtract the mean, divide by the std of the training "
            "set; e.g. pixels / 255)"))
    return out
