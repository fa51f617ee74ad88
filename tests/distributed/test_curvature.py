"""Curvature over the global batch: 2 ranks × 8 (and 7 + 9) samples equal 1 process × 16.

The workers drive `CurvatureRunner` directly and sum its "partials" with one `reducer.sum`,
as the suite does; the references are the single-process runner on the concatenated batch
and a dense float64 Hessian of it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from deepscope.instruments.quantities.curvature import MAX_EV_TOL
from tests.distributed.harness import launch

BATCH = 16
SPLITS = {"equal": [(0, 8), (8, 16)], "unequal": [(0, 7), (7, 16)]}
# (diagonal estimator, due quantities): a D-sized diagonal partial with Lanczos, the exact
# diagonal, and per-tensor traces only (no TICDiag due)
CASES = {
    "hutchinson": ("hutchinson", frozenset({"HessTrace", "TICDiag", "HessMaxEV"})),
    "exact": ("exact", frozenset({"HessTrace", "TICDiag"})),
    "traces": ("hutchinson", frozenset({"HessTrace"})),
    "max_ev": ("hutchinson", frozenset({"HessMaxEV"})),  # no partials: {} travels
}
SAMPLES, SEED, STEP = 3, 5, 2


def model_and_data(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny float64 network (D = 75 / 77 parameters) and its 16 samples."""
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        x = torch.randn(BATCH, 5)
    else:
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3))
        x = torch.randn(BATCH, 1, 5, 5)
    return model.double(), x.double(), torch.randint(0, 3, (BATCH,))


def runner(mode: str, dim: int, reducer=None, timer=None):
    from deepscope.instruments.quantities.curvature import diagonal_budget
    from deepscope.instruments.quantities.curvature_runner import CurvatureRunner, hvp_seconds

    return CurvatureRunner(mode, SAMPLES, dim, SEED, warn=lambda message: None,
                           timer=timer or hvp_seconds, budget=diagonal_budget, reducer=reducer)


def curvature_of(run, model: nn.Module, x, y, due, lo: int, hi: int, step: int = STEP,
                 broken: bool = False):
    """`run.run` on samples lo:hi; broken: a loss without a graph (the operator fails)."""
    losses = nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi], reduction="none")
    loss = losses.mean().detach() if broken else losses.mean()
    kwargs = {"batch_size": hi - lo} if run.reducer is not None else {}
    return run.run(loss, list(model.parameters()), due, step, 0.0, **kwargs)


def finalized(run, curvature, failed, samples: int):
    """Sum the partials and the samples over ranks in one call and finalize, as the suite
    does; a failure of `finalize` is every diagonal quantity's reason."""
    keys = sorted(curvature["partials"])
    *reduced, total = run.reducer.sum([*(curvature["partials"][k] for k in keys),
                                       torch.tensor([float(samples)])])
    try:
        return run.finalize(dict(zip(keys, reduced)), int(total.item())), failed
    except RuntimeError as error:
        return {}, {**dict.fromkeys(("HessTrace", "TICDiag"), str(error)), **failed}


def as_json(curvature, failed) -> dict:
    diagonal = curvature.get("diagonal")
    return {
        "traces": curvature["traces"].tolist() if "traces" in curvature else None,
        "diagonal": torch.cat([d.reshape(-1) for d in diagonal]).tolist() if diagonal else None,
        "max_ev": curvature["max_ev"][0] if "max_ev" in curvature else None,
        "max_ev_meta": curvature["max_ev"][1] if "max_ev" in curvature else None,
        "meta": curvature.get("diagonal_meta"), "failed": failed,
    }


def curvature_scenarios(rank: int, world: int, out_dir) -> dict:
    from deepscope.distributed import Reducer

    reducer = Reducer.create("auto", timeout_s=30)
    out: dict = {}
    for name in ("mlp", "cnn"):
        model, x, y = model_and_data(name)
        dim = sum(p.numel() for p in model.parameters())
        for split, bounds in SPLITS.items():
            lo, hi = bounds[rank]
            for case, (mode, due) in CASES.items():
                run = runner(mode, dim, reducer)
                before = reducer.calls
                curvature, failed = curvature_of(run, model, x, y, due, lo, hi)
                calls = reducer.calls - before
                out[f"{name}/{split}/{case}"] = {
                    **as_json(*finalized(run, curvature, failed, hi - lo)), "calls": calls}
        # gradient accumulation: 3 + 5 samples per rank, merged, then summed over ranks
        run = runner("hutchinson", dim, reducer)
        lo = 8 * rank
        due = CASES["hutchinson"][1]
        first, _ = curvature_of(run, model, x, y, due, lo, lo + 3)
        second, _ = curvature_of(run, model, x, y, due, lo + 3, lo + 8)
        merged, merge_failed = run.merge(first, second, 3, 5, due)
        out[f"{name}/accumulated"] = as_json(*finalized(run, merged, merge_failed, 8))

    model, x, y = model_and_data("mlp")
    dim = sum(p.numel() for p in model.parameters())
    # "auto": rank 0 measures slow HVPs (Hutchinson), rank 1 fast ones (exact) alone; both
    # must take the slowest rank's choice, with one collective at the first step only
    run = runner("auto", dim, reducer, timer=lambda op: 1.0 if rank == 0 else 1e-9)
    calls = []
    for step in (0, 1):
        before = reducer.calls
        curvature, failed = curvature_of(run, model, x, y, frozenset({"HessTrace"}),
                                         8 * rank, 8 * rank + 8, step)
        calls.append(reducer.calls - before)
    out["auto"] = {**as_json(*finalized(run, curvature, failed, 8)), "calls": calls}
    # rank 1's operator cannot be built: both ranks stop Lanczos at its first product and
    # miss the diagonal, with rank 1's reason
    run = runner("hutchinson", dim, reducer)
    before = reducer.calls
    curvature, failed = curvature_of(run, model, x, y, CASES["hutchinson"][1], 8 * rank,
                                     8 * rank + 8, broken=rank == 1)
    calls = reducer.calls - before
    out["failure"] = {**as_json(*finalized(run, curvature, failed, 8)), "calls": calls}
    return out


def dense_hessian(model: nn.Module, x, y) -> torch.Tensor:
    """The (D, D) float64 Hessian of the mean loss over all samples, by autograd."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    sizes = [p.numel() for p in params.values()]

    def loss(flat):
        tensors = {n: t.view(p.shape) for (n, p), t in zip(params.items(), flat.split(sizes))}
        out = torch.func.functional_call(model, tensors, (x,))
        return nn.functional.cross_entropy(out, y)

    flat = torch.cat([p.reshape(-1) for p in params.values()])
    return torch.autograd.functional.hessian(loss, flat)


def rel_error(a, b) -> float:
    """max |a − b| / max |b|."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def references() -> dict:
    """1 process × 16 samples: the runner without a reducer, and dense Hessians."""
    out = {}
    for name in ("mlp", "cnn"):
        model, x, y = model_and_data(name)
        dim = sum(p.numel() for p in model.parameters())
        for case, (mode, due) in CASES.items():
            out[f"{name}/{case}"] = as_json(*curvature_of(runner(mode, dim), model, x, y, due,
                                                          0, BATCH))
        dense = dense_hessian(model, x, y)
        out[f"{name}/dense"] = {"max_ev": float(torch.linalg.eigvalsh(dense).max()),
                                "diagonal": dense.diagonal().tolist()}
    return out


def test_curvature_over_the_global_batch(tmp_path):
    results = [r.check() for r in launch("tests.distributed.test_curvature:curvature_scenarios",
                                         tmp_path, timeout=240)]
    ref = references()
    errors: dict[str, float] = {}
    for key in results[0]:
        assert results[0][key] == results[1][key], f"{key}: ranks differ"
    for name in ("mlp", "cnn"):
        dense = ref[f"{name}/dense"]
        for split in SPLITS:
            for case in CASES:
                got, want = results[0][f"{name}/{split}/{case}"], ref[f"{name}/{case}"]
                assert got["failed"] == {} and got["meta"] == want["meta"]
                if want["traces"] is None:
                    assert got["traces"] is None
                else:
                    errors[f"{case} traces"] = max(errors.get(f"{case} traces", 0.0),
                                                   rel_error(got["traces"], want["traces"]))
                if want["diagonal"] is not None:
                    errors[f"{case} diagonal"] = max(errors.get(f"{case} diagonal", 0.0),
                                                     rel_error(got["diagonal"],
                                                               want["diagonal"]))
                else:
                    assert got["diagonal"] is None  # traces-only partials: K values travel
                if want["max_ev"] is not None:
                    errors["HessMaxEV"] = max(errors.get("HessMaxEV", 0.0),
                                              rel_error(got["max_ev"], want["max_ev"]))
                    # Lanczos stops at its tolerance: within it of the dense top eigenvalue
                    assert rel_error(got["max_ev"], dense["max_ev"]) <= MAX_EV_TOL
                    # one all-reduce per Lanczos iteration (at most min(lanczos_iter, D) =
                    # D; fewer once converged, at the same one on both ranks: compared
                    # above), none for the diagonal: its partials travel in the caller's call
                    assert got["max_ev_meta"]["converged"]
                    assert got["calls"] == got["max_ev_meta"]["samples"] <= len(dense["diagonal"])
                else:
                    assert got["calls"] == 0
                if case == "exact":
                    errors["exact vs dense"] = max(errors.get("exact vs dense", 0.0),
                                                   rel_error(got["diagonal"], dense["diagonal"]))
        accumulated, want = results[0][f"{name}/accumulated"], ref[f"{name}/hutchinson"]
        assert rel_error(accumulated["diagonal"], want["diagonal"]) < 1e-8
        assert rel_error(accumulated["traces"], want["traces"]) < 1e-8
        assert "gradient accumulation" in accumulated["failed"]["HessMaxEV"]
        assert accumulated["max_ev"] is None
    assert max(errors.values()) < 1e-8, errors

    auto = [r["auto"] for r in results]
    assert auto[0]["meta"]["estimator"] == auto[1]["meta"]["estimator"] == "hutchinson"
    assert auto[0]["meta"]["choice"] == auto[1]["meta"]["choice"]
    assert auto[0]["calls"] == auto[1]["calls"] == [1, 0]  # the choice's MAX, first step only

    for r in results:
        failure = r["failure"]
        assert failure["max_ev"] is None and failure["traces"] is None
        assert failure["calls"] == 1  # Lanczos stopped at its first product on both ranks
        for quantity in ("HessMaxEV", "HessTrace", "TICDiag"):
            assert "failed on rank 1 (ValueError: loss does not require grad" in \
                failure["failed"][quantity], failure["failed"]
        assert failure["failed"]["HessTrace"].startswith("the Hessian diagonal failed on rank 1")
        assert failure["failed"]["HessMaxEV"].startswith(
            "a Hessian-vector product of the global batch failed on rank 1")


def test_failure_reasons_travel_summed_as_codes():
    from deepscope.instruments.curvature.global_hessian import (
        REASON_CHARS,
        rank_failures,
        reason_codes,
    )

    summed = (reason_codes(0, 3, "ValueError: x ‖ y") + reason_codes(1, 3, "")
              + reason_codes(2, 3, "E" * 500))
    assert rank_failures(summed) == (
        f"failed on rank 0 (ValueError: x ? y); rank 2 ({'E' * (REASON_CHARS - 3)}...)")
    assert rank_failures(reason_codes(1, 3, "")) == ""
