"""The training step the stress scripts record, and the checks that a recorded step is whole.

Each step's batch is a pure function of (seed, step), so a checker in another process can
recompute it and prove that what a run holds for step `s` is step `s`'s data — not a mix of
steps, not a half-written step.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

import deepscope
from deepscope.store.reader import StoreReader

BATCH = 8
MAX_SAMPLES = 2
PARAMETERS = ("0.weight", "0.bias", "2.weight", "2.bias")
ACTIVATIONS = ("0", "1", "2", "model")       # module outputs, recorded by watch hooks
# Every (tensor, direction) a whole step holds. The loss is registered from the same tensor
# backward starts at, so it has a gradient record too.
EXPECTED_RECORDS = frozenset(
    {(n, d) for n in (*PARAMETERS, *ACTIVATIONS, "loss", "loss_per_sample")
     for d in ("forward", "grad")} | {("input", "forward"), ("target", "forward")})
KPIS = ("accuracy", "loss")
# Tables whose rows belong to one step: a step missing from `steps` must have none of them.
STEP_TABLES = ("records", "arrays", "step_arrays", "step_blobs", "iterations")


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of `step`: deterministic, so any process can recompute them."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def sgd(model: nn.Module, lr: float = 0.05) -> None:
    """Plain SGD by hand: torch.optim imports torch._dynamo, seconds per process."""
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def open_scope(root: Path, run: str, **kwargs: object) -> tuple[deepscope.Scope, nn.Module]:
    """A scope recording every step into `root/run` (resumed if it exists), and its model."""
    scope = deepscope.Scope(root, run, schedule=deepscope.every(1), resume=True,
                            max_samples=MAX_SAMPLES, **kwargs)
    model = make_model()
    scope.watch(model, activations=True)
    return scope, model


def next_step(scope: deepscope.Scope) -> int:
    """The first step number after everything the run already holds (steps or KPIs)."""
    last = scope.writer.last_step()
    return 0 if last is None else last + 1


def train_step(scope: deepscope.Scope, model: nn.Module, seed: int, step: int) -> None:
    """One recorded training step: input, target, activations, loss, gradients, KPIs."""
    x, y = batch(seed, step)
    with scope.step(step) as rec:
        rec.tensor("input", x, role="input")
        rec.tensor("target", y, role="target")
        out = model(x)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        loss = losses.mean()
        rec.loss(loss, per_sample=losses)
        model.zero_grad()
        loss.backward()
        sgd(model)
        rec.kpi("accuracy", (out.argmax(1) == y).float().mean())


def warm_up(root: Path) -> None:
    """Record and close one step in `root`, so that lazy imports and first-call set-up
    happen once, before the writers fork."""
    scope, model = open_scope(root, "warm-up")
    train_step(scope, model, 0, 0)
    scope.close()


def check_steps(run: deepscope.Run, seed: int, steps: Iterable[int]) -> None:
    """Raise AssertionError unless each recorded step in `steps` is whole and holds its data.

    Whole: a statistics row for every (tensor, direction), every array view decodable, the
    graph, both KPIs; its data: the stored input sample and mean are those of `batch(step)`,
    and the loss KPI equals the loss record (two tables written at different times agree).
    """
    wide, kpis = run.stats_wide(), run.kpis()
    for step in steps:
        rows = wide[wide["step"] == step]
        got = set(zip(rows["tensor"], rows["direction"]))
        assert got == EXPECTED_RECORDS, \
            f"step {step}: records {sorted(got ^ EXPECTED_RECORDS)} differ from a whole step"
        assert not rows[["numel", "mean", "norm"]].isna().any().any(), \
            f"step {step}: empty statistics"
        for tensor, direction in got:
            views = run.views(tensor, step, direction=direction)
            assert views or tensor == "loss", f"step {step}: {tensor}/{direction} has no arrays"
            for view in views:
                arr = run.values(tensor, step, view=view, direction=direction)
                assert arr.size and np.isfinite(arr).all(), f"step {step}: bad {tensor}/{view}"
        x, _ = batch(seed, step)
        samples = run.values("input", step, view="samples")
        assert np.array_equal(samples, x[:MAX_SAMPLES].numpy()), f"step {step}: not its input"
        stat = rows.set_index(["tensor", "direction"])["mean"]
        # float32 sums: exact to ~1e-7 of the values' scale
        assert math.isclose(stat["input", "forward"], x.double().mean().item(), rel_tol=1e-6,
                            abs_tol=1e-6 * x.abs().mean().item()), \
            f"step {step}: input mean differs"
        graph = run.graph(step)
        assert {t["name"] for t in graph["tensors"]} >= {n for n, _ in EXPECTED_RECORDS}, \
            f"step {step}: graph lacks tensors"
        assert ("input", "0") in {(e["source"], e["target"]) for e in graph["edges"]}
        at = kpis[kpis["step"] == step].set_index("name")["value"]
        assert sorted(at.index) == list(KPIS), f"step {step}: KPIs {sorted(at.index)}"
        assert math.isclose(at["loss"], stat["loss", "forward"], rel_tol=1e-6), \
            f"step {step}: loss KPI differs from the loss record"


def orphan_steps(path: Path) -> dict[str, list[int]]:
    """Per step table, the steps with rows there but no `steps` row (a partial step)."""
    reader = StoreReader(path)
    try:
        found = {t: [s for (s,) in reader.query(
            f"SELECT DISTINCT step FROM {t} WHERE step NOT IN (SELECT step FROM steps)")]
            for t in STEP_TABLES}
    finally:
        reader.close()
    return {t: steps for t, steps in found.items() if steps}


def last_any_step(run: deepscope.Run) -> int | None:
    """The highest step with tensor data or KPIs (what `resume=True` continues after)."""
    steps = run.steps()
    kpi_steps = run.kpis()["step"].tolist()
    return max([*steps, *kpi_steps], default=None)


def crashed_copy(root: Path) -> Path:
    """`root/crashed/live`: a run as a killed writer leaves it, step 0 committed to its
    write-ahead log only (copied while the writer is still open, as a crash would freeze it)."""
    scope, model = open_scope(root, "live")
    train_step(scope, model, 0, 0)
    scope.flush()
    copy = root / "crashed" / "live"
    copy.mkdir(parents=True)
    for f in (root / "live").iterdir():
        shutil.copy(f, copy / f.name)
    scope.close()
    return copy
