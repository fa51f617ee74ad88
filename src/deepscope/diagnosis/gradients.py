"""Diagnoses from parameter values and gradients: non_finite, exploding_gradients,
vanishing_gradients, not_updated."""

from __future__ import annotations

import math

import numpy as np

from .base import Diagnosis, Evidence, combine, first_step, fmt, ramp

# A weight's relative gradient ‖g‖/‖θ‖ this many times the median over weights (or this many
# times smaller) means the gradient grows (shrinks) by that much on its way to the input.
DEPTH_RATIO = 100.0
GROWTH = 100.0  # a gradient norm this many times its early value: explosion over time
HUGE = 10.0     # a gradient this many times the norm of its weight: one step rewrites it


def non_finite(ev: Evidence) -> list[Diagnosis]:
    """The first NaN/±Inf: the monitor's traced origin if any, else the loss, else a record."""
    fix = ("find the operation at {where} that made it (log or division of 0, sqrt of a "
           "negative, overflow in float16) and guard it with an epsilon or clamp; if the "
           "values grew first, lower the learning rate or clip gradients")
    found = ev.anomalies[ev.anomalies["detector"] == "nonfinite"]
    if not found.empty:
        row = found.iloc[0]
        return [Diagnosis("non_finite", 0.99, int(row["step"]), str(row["tensor"]),
                          f"first non-finite value at step {int(row['step'])} in "
                          f"{row['tensor']}: {row['message']}",
                          {"episodes": len(found)}, fix.format(where=row["tensor"]))]
    loss = ev.loss
    bad = ~np.isfinite(loss.to_numpy())
    if bad.any():
        step = first_step(loss.index, bad)
        return [Diagnosis("non_finite", 0.95, step, ev.loss_name,
                          f"the loss is not finite from step {step} "
                          f"({int(bad.sum())} of {len(loss)} steps)",
                          {"nonfinite_steps": int(bad.sum())}, fix.format(where="the loss"))]
    w = ev.wide
    counts = w["nan"] + w["posinf"] + w["neginf"]
    if (counts > 0).any():
        row = w[counts > 0].iloc[0]
        where = f"{row['tensor']} ({row['direction']})"
        return [Diagnosis("non_finite", 0.9, int(row["step"]), str(row["tensor"]),
                          f"{int(counts[counts > 0].iloc[0])} non-finite values in {where} at "
                          f"step {int(row['step'])}", {"nan": row["nan"],
                                                        "posinf": row["posinf"],
                                                        "neginf": row["neginf"]},
                          fix.format(where=where))]
    return []


def _relative_grads(ev: Evidence) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per weight (dim >= 2, model order): recorded steps, ‖g‖ and ‖g‖/‖θ‖ at those steps."""
    shapes = dict(zip(ev.tensors["name"], ev.tensors["shape"]))
    out = {}
    for name in ev.params:
        if len(shapes.get(name) or []) < 2:
            continue
        g, p = ev.records(name, "grad"), ev.records(name)
        both = g.merge(p, on="step", suffixes=("_g", "_p"))
        both = both[np.isfinite(both["norm_g"]) & (both["norm_p"] > 0)]
        if len(both):
            out[name] = (both["step"].to_numpy(), both["norm_g"].to_numpy(),
                         (both["norm_g"] / both["norm_p"]).to_numpy())
    return out


def _steady(ratios: list[float], falling: bool) -> bool:
    """Ratios (toward the output) in order: rank correlation with depth >= 0.8 (<= -0.8)."""
    r = np.nan_to_num(np.asarray(ratios, dtype=float), nan=1.0)
    rho = float(np.corrcoef(np.argsort(np.argsort(r)), np.arange(len(r)))[0, 1])
    return rho <= -0.8 if falling else rho >= 0.8


def gradient_scale(ev: Evidence) -> list[Diagnosis]:
    """exploding_gradients / vanishing_gradients per layer: through depth (a weight's relative
    gradient ‖g‖/‖θ‖ against the median over weights), in absolute terms (a gradient larger
    than its weight) and over time (a gradient norm against its start)."""
    rel = _relative_grads(ev)
    if len(rel) < 1 or all(len(v[0]) < 3 for v in rel.values()):
        ev.need(("exploding_gradients", "vanishing_gradients"),
                "parameter gradients at 3 or more recorded steps",
                "scope.watch(model) and a schedule that records at least 3 steps")
        return []
    out: list[Diagnosis] = []
    names = list(rel)
    last = names[-1]
    ref = float(np.median([np.median(v[2]) for v in rel.values()]))
    flagged = set(ev.anomalies.loc[ev.anomalies["detector"].isin(
        ["exploding_gradient", "vanishing_gradient"]), "tensor"])
    ratios = [float(np.median(rel[n][2])) / ref if ref > 0 else math.nan for n in names]
    for explode in (True, False):
        # a weight off by DEPTH_RATIO from which the gradient changes steadily along depth
        # to the output: not one layer of another scale (an embedding, attention)
        hits = [i for i, r in enumerate(ratios[:-2]) if math.isfinite(r) and r > 0
                and (r >= DEPTH_RATIO if explode else r <= 1 / DEPTH_RATIO)
                and _steady(ratios[i:], falling=explode)]
        if not hits:
            continue
        i = hits[0]
        name, ratio = names[i], ratios[i]
        steps, _, r = rel[name]
        dec = math.log10(ratio if explode else 1 / ratio)
        conf = combine(ramp(dec, 2, 4, 0.55, 0.9), 0.3 if name in flagged else 0.0)
        code = "exploding_gradients" if explode else "vanishing_gradients"
        side = "larger" if explode else "smaller"
        fix = ("scale the initialisation down (e.g. Kaiming/Xavier for the activation), add "
               "normalisation or residual connections, and clip gradients"
               if explode else
               "use a non-saturating activation (ReLU/GELU) with a matching initialisation, "
               "or add normalisation / residual connections so gradients reach early layers")
        out.append(Diagnosis(code, conf, int(steps[0]), name,
                             f"relative gradient ‖g‖/‖θ‖ of {name} is {10 ** dec:.0f}× "
                             f"{side} than the median over the {len(names)} weights "
                             f"(output layer {last}: {fmt(float(np.median(rel[last][2])))}); "
                             f"{len(hits)} weights are off by {DEPTH_RATIO:g}× or more",
                             {"relative_grad": float(np.median(r)),
                              "relative_grad_median": ref, "ratio": ratio,
                              "layers_affected": len(hits)}, fix))
    worst = max(names, key=lambda n: float(np.median(rel[n][2])))
    level = float(np.median(rel[worst][2]))
    if level >= HUGE and not any(d.where == worst for d in out):
        big = [n for n in names if float(np.median(rel[n][2])) >= HUGE]
        out.append(Diagnosis(
            "exploding_gradients", ramp(math.log10(level), 1, 3, 0.55, 0.9),
            int(rel[worst][0][0]), worst,
            f"the gradient of {worst} is {fmt(level)}× the weight itself (‖g‖/‖θ‖, median); "
            f"{len(big)} of {len(names)} weights have ‖g‖/‖θ‖ ≥ {HUGE:g}",
            {"relative_grad": level, "layers_affected": len(big)},
            "scale the initialisation down (Kaiming/Xavier for the activation) or normalise "
            "the activations, and clip gradients"))
    for name in names:
        steps, norms, r = rel[name]
        if len(norms) < 3 or any(d.where == name for d in out):
            continue
        start = float(np.median(norms[:3]))
        growth = norms / start if start > 0 else np.full_like(norms, math.nan)
        # grown, and large against the weight: not a path that merely starts being used
        grown = (growth >= GROWTH) & (r >= 1.0)
        tail = grown[-max(1, len(grown) // 3):]
        if tail.mean() >= 0.5:  # sustained over the last third, not a spike
            peak = float(np.nanmax(growth))
            conf = combine(ramp(math.log10(peak), 2, 4, 0.55, 0.9),
                           0.3 if name in flagged else 0.0)
            out.append(Diagnosis(
                "exploding_gradients", conf, first_step(steps, grown), name,
                f"gradient norm of {name} grew to {fmt(peak)}× its early value {fmt(start)}",
                {"growth": peak, "early_norm": start},
                "lower the learning rate and clip gradients (torch.nn.utils."
                "clip_grad_norm_); check the initialisation scale"))
    return out


def not_updated(ev: Evidence) -> list[Diagnosis]:
    """Parameters that receive gradients but never change, or never receive one."""
    out: list[Diagnosis] = []
    moved, still, no_grad = [], [], []
    for name in ev.params:
        p = ev.records(name)
        if len(p) < 2:
            continue
        cols = ["mean", "std", "min", "max", "norm"]
        same = bool((p[cols].nunique(dropna=False) == 1).all())
        g = ev.records(name, "grad")
        has_grad = bool(len(g) and (g["norm"] > 0).any())
        if not same:
            moved.append(name)
        elif has_grad:
            still.append((name, p, g))
        else:
            no_grad.append((name, p))
    if not moved:
        return out  # nothing changed anywhere: no optimiser step (or lr 0), not this bug
    for name, p, g in still:
        out.append(Diagnosis(
            "not_updated", 0.9, int(p["step"].iloc[0]), name,
            f"{name} receives gradients (norm up to {fmt(float(g['norm'].max()))}) but its "
            f"value is identical at all {len(p)} recorded steps while {len(moved)} other "
            "parameters change",
            {"recorded_steps": len(p), "grad_norm_max": float(g["norm"].max())},
            "pass this parameter to the optimiser (e.g. optimizer = Adam(model.parameters())"
            " after building the whole model) and check it is not frozen by mistake"))
    used = {s for s, _ in ev.edges}
    for name, p in no_grad:
        disconnected = bool(ev.edges) and name not in used
        out.append(Diagnosis(
            "not_updated", 0.6 if disconnected else 0.4, int(p["step"].iloc[0]), name,
            f"{name} never receives a gradient and never changes"
            + (" (it feeds nothing in the dependency graph: disconnected)"
               if disconnected else " (frozen: requires_grad=False, maybe on purpose)"),
            {"recorded_steps": len(p), "in_graph": int(not disconnected)},
            "use the module in forward (or remove it); if it is frozen by mistake, set "
            "requires_grad=True and give it to the optimiser"))
    return out
