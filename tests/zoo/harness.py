"""Train a zoo case under deepscope and check it against a float64 per-sample loop.

`train_case` trains with `activations=True` and `instruments="full"` (curvature by
Hutchinson with few HVPs: the exact Hessian diagonal costs one HVP per parameter, far beyond
the zoo's time budget; curvature is checked elsewhere) and keeps, for the last step (always
in eval mode), the float64 brute-force reference of the batch (all micro-batches of the step
as one batch). The checks are plain functions so that each
test states which of them it makes.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

import deepscope
from deepscope.instruments import CONFIGURATIONS
from tests.instruments import reference as R

from .models import Batch, ZooCase

LR = 0.05
STEPS = 2
# max_ev_every 1: HessMaxEV at every step (full's cadence would skip it at some), as the
# zoo checks every quantity at every step
CURVATURE = {"curvature": "hutchinson", "hutchinson_samples": 1, "lanczos_iter": 3,
             "max_ev_every": 1}
HIST = (100, -2.0, 2.0)  # the suite's default GradHist1d bins
# The suite's per-sample quantities and their float64 definitions (QUANTITIES.md).
PER_SAMPLE = {"GradNorm": R.grad_norm, "NormTest": R.norm_test, "InnerTest": R.inner_test,
              "OrthoTest": R.ortho_test}


@dataclass
class ZooRun:
    case: ZooCase
    run: deepscope.Run
    refs: dict[int, R.BatchRef] = field(default_factory=dict)  # checked step -> reference
    steps: int = STEPS

    def table(self):
        return self.run.quantities()


def _double(batch: Batch) -> Batch:
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


def _reference(case: ZooCase, model: nn.Module, batches: list[Batch]) -> R.BatchRef:
    """ℓᵢ and gᵢ of all the step's samples, one autograd.grad per sample, in float64."""
    ref_model = copy.deepcopy(model).double()

    def losses(m: nn.Module) -> Tensor:
        return torch.cat([case.losses(m, _double(b)) for b in batches])

    return R.batch_reference(ref_model, losses)


def build(case: ZooCase) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(the eager model, the one trained: compiled or the same, its SGD optimiser)."""
    torch.manual_seed(0)
    model = case.build()
    for prefix in case.frozen:
        model.get_submodule(prefix).requires_grad_(False)
    trained = torch.compile(model, backend="eager") if case.compiled else model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    return model, trained, opt


def train_step(case: ZooCase, trained: nn.Module, opt: torch.optim.Optimizer,
               batches: list[Batch], rec=None) -> None:
    """One optimiser step over the micro-batches (loss / k each), told to `rec` if given."""
    opt.zero_grad()
    for batch in batches:
        with (torch.autocast("cpu", dtype=case.autocast) if case.autocast
              else contextlib.nullcontext()):
            losses = case.losses(trained, batch)
        loss = losses.mean() / len(batches)
        if rec is not None:
            rec.loss(loss, per_sample=losses)
        loss.backward()
    opt.step()


def train_case(case: ZooCase, path: Path, steps: int = STEPS) -> ZooRun:
    model, trained, opt = build(case)
    scope = deepscope.Scope(path, case.name, schedule=deepscope.every(1), instruments="full",
                            instrument_options=CURVATURE)
    refs: dict[int, R.BatchRef] = {}
    with scope:
        scope.watch(trained, activations=True, optimizer=opt)
        for step in range(steps):
            model.train(step < case.train_steps)
            batches = [case.batch(step, m) for m in range(case.micro_batches)]
            if step == steps - 1:
                assert not model.training, "the checked step must be in eval mode"
                refs[step] = _reference(case, model, batches)
            with scope.step(step) as rec:
                train_step(case, trained, opt, batches, rec)
    return ZooRun(case, deepscope.open_run(path / case.name), refs, steps)


# -- checks ---------------------------------------------------------------------------------
def block_edges(zr: ZooRun, iteration: int = 0) -> set[tuple[str, str]]:
    """The last step's edges into the case's block (its modules' outputs and its own output),
    in one iteration (micro-batch m of an accumulated step is iteration m)."""
    block = zr.case.block
    g = zr.run.graph(zr.steps - 1, iteration=iteration)
    return {(e["source"], e["target"]) for e in g["edges"]
            if not block or e["target"] == block or e["target"].startswith(block + ".")}


def missing_values(zr: ZooRun) -> dict[str, set[str]]:
    """{quantity: reasons} of every value stored without a number; asserts each says why.

    Every quantity of "full" must have a row for the whole model at every step, except α at
    the last step (it needs the next step's loss). A histogram carries counts, not a value.
    """
    q = zr.table()
    for name in CONFIGURATIONS["full"]:
        have = set(q[(q["name"] == name) & (q["layer"] == "")]["step"])
        want = set(range(zr.steps - 1 if name == "Alpha" else zr.steps))
        assert want <= have, f"{name}: no whole-model row at steps {sorted(want - have)}"
    missing: dict[str, set[str]] = {}
    for row in q.itertuples(index=False):
        meta = row.meta
        if "edges" in meta and row.name.startswith("GradHist"):
            continue
        if math.isfinite(row.value):
            continue
        reason = meta.get("reason")
        assert reason, (f"{row.name} (layer {row.layer!r}, step {row.step}) is "
                        f"{row.value} without a reason: {meta}")
        missing.setdefault(row.name, set()).add(reason)
    return missing


def _value(q, name: str, step: int, layer: str) -> float:
    rows = q[(q["name"] == name) & (q["step"] == step) & (q["layer"] == layer)]
    assert len(rows) == 1, f"{name} step {step} layer {layer!r}: {len(rows)} rows"
    value = float(rows["value"].iloc[0])
    assert math.isfinite(value), f"{name} step {step} layer {layer!r}: {rows['meta'].iloc[0]}"
    return value


def _mean_at_round_off(G: np.ndarray, whole: np.ndarray) -> bool:
    """Whether a layer's gradients (G: (B, D) per-sample, float64) are zero in exact
    arithmetic (an attention key bias: softmax ignores a shift shared by all keys; 1e-22 of
    the model's here): the gradient tests divide by ‖ḡ‖, so a float32 computation of them is
    round-off there, in any implementation."""
    return bool(np.linalg.norm(G.mean(0)) < 1e-12 * np.linalg.norm(whole, axis=1).max())


def check_numbers(zr: ZooRun) -> None:
    """Loss, GradNorm, Norm/Inner/OrthoTest per layer and in total, and GradHist1d counts
    equal the float64 per-sample loop within the case's rtol at every eval-mode step."""
    assert zr.refs, "no eval-mode step to check"
    q = zr.table()
    rtol = zr.case.rtol
    for step, ref in zr.refs.items():
        assert math.isclose(_value(q, "Loss", step, ""), float(ref.losses.mean()), rel_tol=rtol)
        for name, fn in PER_SAMPLE.items():
            for layer, G in ref.layers().items():
                if _mean_at_round_off(G, ref.layers()[""]):
                    continue
                got, want = _value(q, name, step, layer), fn(G)
                assert math.isclose(got, want, rel_tol=rtol, abs_tol=1e-12), (
                    f"{name} step {step} layer {layer!r}: {got} != {want}")
        G = ref.layers()[""]
        counts, extras = R.histogram_1d(G, *HIST)
        got, meta = zr.run.histogram("GradHist1d", step)
        assert int(got.sum()) + sum(meta[k] for k in extras) == G.size
        # an element within rtol of a bin edge may fall on either side in float32
        edges = np.linspace(HIST[1], HIST[2], HIST[0] + 1)
        near = np.abs(G.reshape(-1, 1) - edges[None, :]) <= rtol * np.maximum(np.abs(G), 1e-3
                                                                              ).reshape(-1, 1)
        ambiguous = int(near.any(axis=1).sum())
        assert np.abs(got - counts).sum() <= 2 * ambiguous, (got, counts)
