"""Instrument values over the global batch: 2 gloo ranks under DistributedDataParallel
equal one process on the concatenated batch (float64, rtol 1e-10), with a count of
deepscope's collectives per step and a failure on one rank only.

The reference runs in the same worker processes: a copy of the model (no DDP) sees the
whole global batch of each step at the same parameters and, after its backward, takes the
DDP model's updated parameters (so both record the same update, whatever DDP applied).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tests.distributed.harness import launch

QUANTITIES = ["Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest",
              "OrthoTest", "GradHist1d", "Alpha", "GradHist2d", "MeanGSNR", "EarlyStopping",
              "CABS"]
RTOL = 1e-10
STEPS = 5  # 0, 1, 2 recorded; 3 only ends step 2's α; 4 not instrumented


def _record(step: int, kind: str) -> bool:
    return step < 3


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    else:
        model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))
    return model.double()


def _data(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    shape = (n, 5) if kind == "mlp" else (n, 1, 6, 6)
    return torch.randn(shape, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=gen)


class _Counter:
    """Counts torch.distributed collectives issued on deepscope's own group."""

    NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
             "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "barrier")

    def __init__(self, group) -> None:
        import torch.distributed as dist

        self.group, self.calls = group, 0
        for name in self.NAMES:
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                if kwargs.get("group") is self.group:
                    self.calls += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)


def _key(v) -> tuple:
    return (v.name, v.step, v.layer)


def _compare(got: list, want: list) -> dict[str, float]:
    """Max relative error per quantity; raises on any other difference."""
    got_map = {_key(v): v for v in got if not v.local}
    want_map = {_key(v): v for v in want}
    assert set(got_map) == set(want_map), sorted(set(got_map) ^ set(want_map))
    errors: dict[str, float] = {}
    for key, w in want_map.items():
        g = got_map[key]
        assert (g.value is None) == (w.value is None), (key, g.meta, w.meta)
        assert "reason" not in w.meta, (key, w.meta)
        if w.array is not None:
            assert g.array is not None and (g.array == w.array).all(), key
            extras = {k: v for k, v in w.meta.items() if k != "edges"}
            assert {k: g.meta.get(k) for k in extras} == extras, key
            err = 0.0
        else:
            err = abs(g.value - w.value) / max(abs(w.value), 1e-12)
        errors[key[0]] = max(errors.get(key[0], 0.0), err)
    return errors


def reference_step(ref, reference: nn.Module, model: nn.Module, x: torch.Tensor,
                   y: torch.Tensor, step: int, kind: str) -> list:
    """The reference's step on the whole global batch (x, y), at the parameters the DDP
    `model` had before its update; then `reference` takes that update. Returns `ref`'s
    values ([] on a step its schedule skips)."""
    on = ref.wants(step, kind)
    if on:
        ref.start(step, kind)
    reference.zero_grad()
    losses = nn.functional.cross_entropy(reference(x), y, reduction="none")
    if on:
        ref.loss(losses.mean(), per_sample=losses)
    losses.mean().backward()
    with torch.no_grad():  # the update DDP applied
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q)
    return ref.finish() if on else []


def _run(rank: int, world: int, kind: str, optim: str, sizes: list[int],
         micro: int = 1, hist_range: tuple[float, float] | str = (-2.0, 2.0),
         clip: float | None = None) -> dict:
    """One scenario: DDP on `sizes` samples per rank (`micro` no_sync micro-batches each,
    gradients clipped to norm `clip`) against the reference on their concatenation; returns
    errors, calls per step, and the local values' checks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from deepscope.distributed import Reducer
    from deepscope.instruments.suite import Instruments

    model = _model(kind)
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if optim == "sgd" else (
        lambda p: torch.optim.Adam(p, lr=0.01))
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    reducer = Reducer.create(True, timeout_s=30)
    counter = _Counter(reducer.group)
    inst = Instruments(model, QUANTITIES, schedule=_record, optimizer=opt, reducer=reducer,
                       hist2d_per_layer=True, hist_range=hist_range)
    ref = Instruments(reference, QUANTITIES, schedule=_record, optimizer=ref_opt,
                      hist2d_per_layer=True, hist_range=hist_range)
    lo = sum(sizes[:rank])
    errors: dict[str, float] = {}
    calls, local_checks = [], []
    for step in range(STEPS):
        x, y = _data(kind, step, sum(sizes))
        xr, yr = x[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]
        # independent local reference: this rank's mean gradient, no DDP sync
        own = nn.functional.cross_entropy(model(xr), yr)
        local_grads = torch.autograd.grad(own, list(model.parameters()))
        before = counter.calls
        on = inst.wants(step, "train")
        assert on == ref.wants(step, "train")
        if on:
            inst.start(step, "train")
        opt.zero_grad()
        chunks = list(zip(xr.chunk(micro), yr.chunk(micro)))
        for j, (xm, ym) in enumerate(chunks):
            sync = j == len(chunks) - 1
            with ddp.no_sync() if not sync else torch.enable_grad():
                losses = nn.functional.cross_entropy(ddp(xm), ym, reduction="none")
                loss = losses.mean() / micro
                if on:
                    inst.loss(loss, per_sample=losses)
                loss.backward()
        if clip is not None:  # .grad = c·ḡ: InnerTest / OrthoTest still take one call
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert float(norm) > clip
        opt.step()
        got = inst.finish() if on else []
        calls.append(counter.calls - before)
        want = reference_step(ref, reference, model, x, y, step, "train")
        for name, err in _compare(got, want).items():
            errors[name] = max(errors.get(name, 0.0), err)
        local = {(v.name, v.layer): v.value for v in got if v.local}
        if step < 3:
            norms = [float(g.norm()) for g in local_grads]
            local_checks.append([
                local[("BatchSize", "")] == sizes[rank],
                math.isclose(local[("Loss", "")], float(own), rel_tol=1e-12),
                math.isclose(local[("GradNorm", "")], math.sqrt(sum(n * n for n in norms)),
                             rel_tol=1e-10),
                all(math.isclose(local[("GradNorm", name)], n, rel_tol=1e-10)
                    for (name, _), n in zip(model.named_parameters(), norms))])
    return {"errors": errors, "calls": calls, "local": local_checks,
            "warnings": inst.warnings}


def equivalence(rank: int, world: int, out_dir) -> dict:
    return {f"{kind}-{optim}": _run(rank, world, kind, optim, [8, 8])
            for kind in ("mlp", "cnn") for optim in ("sgd", "adam")}


def _faults(rank: int, world: int) -> dict:
    """GradHist1d's pass raises on rank 1 only; then the reducer is off. Without DDP each
    rank's .grad is its own gradient, so InnerTest takes the exact ḡ in a second call."""
    import deepscope.instruments.global_batch as global_batch
    from deepscope.distributed import Reducer
    from deepscope.instruments.suite import Instruments

    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("injected on rank 1")
        global_batch.histogram_counters = broken
    model = _model("mlp")
    reducer = Reducer.create(True, timeout_s=30)
    inst = Instruments(model, ["Loss", "GradNorm", "GradHist1d", "InnerTest"],
                       reducer=reducer)
    reference = copy.deepcopy(model)
    ref = Instruments(reference, ["InnerTest"])
    x, y = _data("mlp", 0, 16)
    ref.start(0, "train")
    losses = nn.functional.cross_entropy(reference(x), y, reduction="none")
    ref.loss(losses.mean(), per_sample=losses)
    losses.mean().backward()
    out = {"inner": [v.value for v in ref.finish() if v.layer == ""]}
    for step in range(2):
        if step == 1:
            reducer.disabled = "deepscope's collectives are off (test)"
        x, y = _data("mlp", step, 16)
        inst.start(step, "train")
        losses = nn.functional.cross_entropy(model(x[8 * rank:8 * rank + 8]),
                                             y[8 * rank:8 * rank + 8], reduction="none")
        inst.loss(losses.mean(), per_sample=losses)
        model.zero_grad()
        losses.mean().backward()
        got = [v for v in inst.finish() if v.layer == ""]
        out[step] = {f"{v.name}{'@local' if v.local else ''}": v.meta.get("reason") for v in got}
        if step == 0:
            out["calls"] = reducer.calls
            out["inner"] += [v.value for v in got if v.name == "InnerTest"]
    out["warnings"] = inst.warnings
    return out


class _FakeCurvature:
    """A curvature runner for a Linear(5, 1). Mode "partials": it leaves partial sums (each
    rank's is rank + 1) and finalize makes every trace their sum, the diagonal ones;
    "global": it leaves its values as they are (traces 5); "fails": it fails on rank 1."""

    mode = "partials"
    unreached: list = []  # every parameter reached (see CurvatureRunner.unreached)

    def run(self, mean_loss, params, due, step, forward_s, batch_size=None):
        import torch.distributed as dist

        one = torch.ones((), dtype=torch.float64)
        if self.mode == "global":
            return {"traces": torch.full((3,), 5.0, dtype=torch.float64),
                    "diagonal_meta": {"samples": "runner"},
                    "diagonal": [one.expand(1, 5), one.expand(1)]}, {}
        if self.mode == "fails" and dist.get_rank() == 1:
            return {}, dict.fromkeys(due - {"Loss"}, "RuntimeError: no curvature here")
        return {"partials": {"t": torch.tensor([dist.get_rank() + 1.0])}}, {}

    def finalize(self, partials, samples):
        one = torch.ones((), dtype=torch.float64)
        return {"traces": partials["t"].expand(3).clone(), "diagonal_meta": {"samples": samples},
                "diagonal": [one.expand(1, 5), one.expand(1)]}


def _curvature_hand_off(rank: int, world: int) -> dict:
    """The runner's partials travel in the one call, finalize gets their sums, and TIC
    takes the global batch's second moments; a runner that leaves none is taken as it is;
    a rank whose curvature failed still sends the partials' layout."""
    from deepscope.distributed import Reducer
    from deepscope.instruments.suite import Instruments

    model = nn.Linear(5, 1).double()
    reducer = Reducer.create(True, timeout_s=30)
    inst = Instruments(model, ["Loss", "HessTrace", "TICDiag", "TICTrace"], reducer=reducer)
    inst._curvature = runner = _FakeCurvature()
    x, y = _data("mlp", 0, 16)
    y = y.double()
    squares = 0.0  # Σᵢ Σₐ gᵢ,ₐ² over the global batch, sample by sample
    for i in range(16):
        loss = (model(x[i:i + 1]).squeeze(1) - y[i:i + 1]).square().sum()
        squares += sum(float(g.square().sum()) for g in torch.autograd.grad(loss, list(
            model.parameters())))
    out: dict = {"tic": [squares / 16 / (1 + 1e-7), squares / 16 / (3 + 1e-7)]}
    for step, mode in enumerate(("partials", "global", "fails")):
        runner.mode = mode
        inst.start(step, "train")
        losses = (model(x[8 * rank:8 * rank + 8]).squeeze(1) - y[8 * rank:8 * rank + 8]).square()
        inst.loss(losses.mean(), per_sample=losses)
        model.zero_grad()
        losses.mean().backward()
        out[mode] = {v.name: (v.value, v.meta) for v in inst.finish()
                     if not v.local and v.layer == ""}
    out["calls"] = reducer.calls
    return out


def special_cases(rank: int, world: int, out_dir) -> dict:
    return {"unequal": _run(rank, world, "mlp", "sgd", [7, 9]),
            "no_sync": _run(rank, world, "cnn", "adam", [8, 8], micro=2, hist_range="adaptive",
                            clip=1e-3),
            "faults": _faults(rank, world),
            "curvature": _curvature_hand_off(rank, world)}


def _check(result: dict, calls: int) -> None:
    for name in QUANTITIES:
        assert result["errors"][name] <= RTOL, (name, result["errors"])
    # steps 0-2 recorded, step 3 ends step 2's α, step 4 not instrumented
    assert result["calls"] == [calls, calls, calls, 1, 0], result["calls"]
    assert all(all(checks) for checks in result["local"]), result["local"]


@pytest.fixture(scope="module")
def main_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("equivalence")
    return [r.check() for r in launch("tests.distributed.test_equivalence:equivalence", path,
                                      timeout=240)]


@pytest.fixture(scope="module")
def special_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("special")
    return [r.check() for r in launch("tests.distributed.test_equivalence:special_cases",
                                      path, timeout=240)]


@pytest.mark.parametrize("scenario", ["mlp-sgd", "mlp-adam", "cnn-sgd", "cnn-adam"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(main_results, scenario):
    for result in main_results:  # every rank returns the global values
        _check(result[scenario], calls=1)


def test_unequal_batches_are_exact_with_a_second_call(special_results):
    # DDP applies the mean of the ranks' means, not ḡ: InnerTest / OrthoTest take ḡ's
    # products in a second call
    for result in special_results:
        _check(result["unequal"], calls=2)


def test_no_sync_micro_batches_compose(special_results):
    # with gradient clipping; an adaptive GradHist1d range adds one MAX call
    for result in special_results:
        _check(result["no_sync"], calls=2)


def test_curvature_partials_are_summed_in_the_same_call(special_results):
    for result in special_results:
        curvature = result["curvature"]
        assert curvature["calls"] == 3  # one per step
        got = curvature["partials"]
        assert got["HessTrace"] == [3.0, {"samples": 16}]
        assert got["Loss"][0] is not None
        tic_diag, tic_trace = curvature["tic"]
        assert math.isclose(got["TICDiag"][0], tic_diag, rel_tol=RTOL), (got, tic_diag)
        assert math.isclose(got["TICTrace"][0], tic_trace, rel_tol=RTOL), (got, tic_trace)
        assert curvature["global"]["HessTrace"] == [5.0, {"samples": "runner"}]
        failed = curvature["fails"]
        assert failed["Loss"][0] is not None and failed["HessTrace"][0] is None
        assert failed["HessTrace"][1]["reason"].startswith("failed on rank 1")
