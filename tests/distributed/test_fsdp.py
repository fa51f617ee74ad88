"""Sharded parameters. FSDP2 (`fully_shard`) on 2 gloo ranks: Loss, GradNorm, Distance and
UpdateSize equal one process's values on the concatenated batch (float64, rtol 1e-10) from
one packed collective per instrumented step; every other quantity is missing with one
reason; unequal batch sizes or a sum loss miss GradNorm only; a Scope records FSDP2 steps
(the shards skipped with one warning). FSDP1 and tensor-parallel DTensor parameters are
refused in one line. One harness launch runs every scenario."""

from __future__ import annotations

from tests.distributed.harness import launch
from tests.distributed.test_equivalence import RTOL, _Counter, _data, _model

SHARDED = ("Loss", "GradNorm", "Distance", "UpdateSize")
# samples of rank 0 and rank 1 at each step, and the loss's reduction
STEPS = [(8, 8, "mean"), (8, 8, "mean"), (8, 8, "mean"), (7, 9, "mean"), (8, 8, "sum")]
# step -> why GradNorm is missing there (FSDP2's gradient is not the global batch's mean)
GRAD_MISSING = {3: "batch sizes differ (7, 9)", 4: "the loss is a sum of the per-sample"}


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model):  # Linear(8, 3): uneven shards (2 + 1 rows)
        fully_shard(layer)
    return model


def _values(values) -> list:
    return [[v.name, v.step, v.layer, v.value, v.meta.get("reason"), v.local] for v in values]


def _equivalence(rank: int, world: int) -> dict:
    """The FSDP2 model's values, and a plain reference's on the concatenated batch that
    takes the FSDP2 model's update after its backward (the same parameters at every step,
    whatever FSDP2 applied)."""
    import torch
    from torch import nn

    from deepscope.distributed import Reducer
    from deepscope.instruments import Instruments

    reducer = Reducer.create()
    counter = _Counter(reducer.group)
    model, reference = _fsdp2(_model("mlp")), _model("mlp")
    inst = Instruments(model, "business", reducer=reducer)  # curvature must not run
    ref = Instruments(reference, list(SHARDED))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    got, want, calls = [], [], []
    for step, (*sizes, reduction) in enumerate(STEPS):
        x, y = _data("mlp", step, sum(sizes))
        start = sum(sizes[:rank])
        for net, suite, (xs, ys) in ((model, inst, (x[start:start + sizes[rank]],
                                                    y[start:start + sizes[rank]])),
                                     (reference, ref, (x, y))):
            before = counter.calls
            net.zero_grad()  # before the forward: nothing may add to .grad after it
            suite.start(step, "train")
            losses = nn.functional.cross_entropy(net(xs), ys, reduction="none")
            loss = losses.mean() if reduction == "mean" else losses.sum()
            suite.loss(loss, per_sample=losses)
            loss.backward()
            if net is model:
                opt.step()
            else:
                with torch.no_grad():
                    for p, q in zip(reference.parameters(), model.parameters()):
                        p.copy_(q.full_tensor())
            (got if suite is inst else want).extend(suite.finish())
            if suite is inst:
                calls.append(counter.calls - before)
    return {"got": _values(got), "want": _values(want), "calls": calls,
            "warnings": inst.warnings}


def _recording(rank: int, out_dir) -> dict:
    """Two recorded steps of an FSDP2 model under a Scope ("business": curvature is due and
    must not run on the shards); what it logged and
    warned, and what rank 0's file holds."""
    import logging
    import warnings

    import torch
    from torch import nn

    import deepscope

    model = _fsdp2(_model("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = deepscope.Scope(out_dir, "fsdp", schedule=1, instruments="business",
                            instrument_schedule=1)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("deepscope").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope.watch(model, optimizer=opt)
        for step in range(2):
            x, y = _data("mlp", step, 4)
            with scope.step(step) as rec:
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
        scope.close()
    logging.getLogger("deepscope").removeHandler(handler)
    run = deepscope.open_run(out_dir / "fsdp")
    return {"warnings": [str(w.message) for w in caught], "logged": logged,
            "steps": run.steps(rank=rank), "tensors": run.tensors(rank)["name"].tolist(),
            "loss": run.quantities("Loss")["value"].tolist()}


def _refusals(world: int) -> dict:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import Shard, distribute_tensor

    from deepscope.instruments import Instruments

    def refusal(make) -> str:
        try:
            make()
        except ValueError as error:
            return str(error)
        return "accepted"

    fsdp1 = FullyShardedDataParallel(_model("mlp"), device_id=torch.device("cpu"))
    tensor_parallel = _model("mlp")
    mesh = init_device_mesh("cpu", (world,))
    tensor_parallel[0].weight = nn.Parameter(
        distribute_tensor(tensor_parallel[0].weight.detach(), mesh, [Shard(0)]))
    return {
        "fsdp1": refusal(lambda: Instruments(fsdp1, "business")),
        "dtensor": refusal(lambda: Instruments(tensor_parallel, "economy")),
        "no reducer": refusal(lambda: Instruments(_fsdp2(_model("mlp")), "economy")),
        "plain": refusal(lambda: Instruments(_model("mlp"), "economy")),
    }


def scenarios(rank: int, world: int, out_dir) -> dict:
    return {"equivalence": _equivalence(rank, world),
            "recording": _recording(rank, out_dir),
            "refusals": _refusals(world)}


def test_fsdp2_and_refusals(tmp_path):
    results = [r.check() for r in launch("tests.distributed.test_fsdp:scenarios", tmp_path)]
    for rank, result in enumerate(results):
        _check_equivalence(rank, result["equivalence"])
        _check_refusals(result["refusals"])
        _check_recording(result["recording"])


def _check_equivalence(rank: int, result: dict) -> None:
    from deepscope.instruments.sharded import NOT_SHARDED

    want = {(n, s, layer): value for n, s, layer, value, reason, _ in result["want"]}
    assert all(v is not None for v in want.values())
    got, others, local = {}, set(), []
    for name, step, layer, value, reason, is_local in result["got"]:
        if is_local:
            local.append((name, step, value))
        elif name in SHARDED:
            got[(name, step, layer)] = (value, reason)
        else:
            assert value is None and reason == NOT_SHARDED, (name, reason)
            others.add(name)
    assert others == {"NormTest", "InnerTest", "OrthoTest", "GradHist1d", "Alpha",
                      "HessTrace", "TICDiag"}
    # a missing quantity is one row (layer ""): GradNorm's per-parameter rows of that step
    assert set(got) == {k for k in want if k[0] != "GradNorm" or k[1] not in GRAD_MISSING
                        or k[2] == ""}
    for key, (value, reason) in got.items():
        w = want[key]
        name, step, _ = key
        if name == "GradNorm" and step in GRAD_MISSING:
            assert value is None and GRAD_MISSING[step] in reason, reason
        else:
            assert value is not None and abs(value - w) <= RTOL * abs(w), (key, value, w)
    assert result["calls"] == [1] * len(STEPS)
    sizes = [s[rank] for s in STEPS]
    assert [v for n, _, v in local if n == "BatchSize"] == sizes
    assert sorted({n for n, _, _ in local}) == ["BatchSize", "Loss"]
    assert sum(NOT_SHARDED in w for w in result["warnings"]) == 1, result["warnings"]


def _check_refusals(result: dict) -> None:
    assert result["plain"] == "accepted"
    for key, found in (("fsdp1", "(the model has FullyShardedDataParallel module '<root>')"),
                       ("dtensor", "(the model has a DTensor parameter '0.weight')")):
        message = result[key]
        assert message.startswith("deepscope's instruments: parameters sharded across "
                                  "ranks are not supported"), message
        assert found in message and "\n" not in message
        assert "instrument a DDP run" in message and "LIMITATIONS.md" in message
    message = result["no reducer"]
    assert "needs distributed instruments" in message and "\n" not in message


def _check_recording(result: dict) -> None:
    from deepscope.instruments.sharded import NOT_SHARDED

    assert result["steps"] == [0, 1]  # recorded, not dropped by a failure
    assert not [m for m in result["logged"] if "recording failed" in m], result["logged"]
    shards = [m for m in result["logged"] if "not recorded" in m]
    assert len(shards) == 1 and "sharded across ranks" in shards[0], shards
    assert sorted(result["tensors"]) == ["loss", "loss_per_sample"]  # no shard as a whole
    assert len(result["loss"]) == 2 and all(v > 0 for v in result["loss"])
    missed = [w for w in result["warnings"] if NOT_SHARDED in w]
    assert len(missed) == 1 and "HessTrace" in missed[0] and "TICDiag" in missed[0], missed
