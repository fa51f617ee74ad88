"""`Scope` in a 2-rank DDP job: rank files and their meta, local values, rank-named health
findings, agreed dynamic decisions, the collectives each step costs (a counting shim around
torch.distributed), economy over the global batch with an instrument failing on one rank,
a collective timeout that turns them off while training goes on, the user's DDP left as it
is, and a Scope created on one rank only. One harness launch runs every scenario (each in
its own run folder)."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path

import pytest

from tests.distributed.harness import launch

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "barrier", "reduce", "gather",
               "scatter", "all_to_all", "all_to_all_single", "broadcast_object_list",
               "all_gather_object")


class CountingShim:
    """Counts every call of torch.distributed's Python collectives (deepscope's own: DDP's
    gradient all-reduce runs inside its C++ reducer and is not counted)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls = 0
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counted(original))

    def _counted(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted


def ddp_mlp(seed: int = 0):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    return ddp, opt


def batch(rank: int, step: int, size: int = 6):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(size, 4, generator=g), torch.randn(size, 1, generator=g)


def train_step(scope, ddp, opt, rank: int, step: int, *, nan_at: tuple[int, int] | None = None,
               size: int = 6, record_input: bool = False, stall: float = 0.0,
               told_nan_at: tuple[int, int] | None = None) -> int:
    """One DDP step inside `scope.step(step)`; returns the collectives it cost. stall:
    seconds to wait after the update, before the step's end (deepscope's collectives).
    told_nan_at: (rank, step) where the loss told to the recorder is NaN, not the one
    trained on (a finding on the rank's own loss alone)."""
    x, y = batch(rank, step, size)
    if nan_at == (rank, step):
        x[0, 0] = float("nan")
    shim = SHIM
    before = shim.calls
    with scope.step(step) as rec:
        if record_input:
            rec.tensor("x", x, role="input")
        losses = ((ddp(x) - y) ** 2).mean(1)
        if told_nan_at == (rank, step):
            rec.loss(losses.mean() * float("nan"))
        else:
            rec.loss(losses.mean(), per_sample=losses)
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
        time.sleep(stall)
    return shim.calls - before


SHIM: CountingShim


def accumulating_ddp(scope, rank: int):
    """3 steps of 2 micro-batches (the first under no_sync) through a DDP with
    gradient_as_bucket_view, small buckets and a counting comm hook; with `scope`, every step
    recorded (activations too); returns the model and how often the hook ran."""
    import contextlib

    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                                  gradient_as_bucket_view=True, bucket_cap_mb=1e-4)
    calls = []

    def hook(state, bucket):
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if scope is not None:
        assert scope.watch(ddp, activations=True) is ddp
    for step in range(3):
        with (scope.step(step) if scope is not None else contextlib.nullcontext()) as rec:
            opt.zero_grad()
            for micro in range(2):
                x, y = batch(rank, 10 * step + micro, 3)
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    losses = ((ddp(x) - y) ** 2).mean(1)
                    if rec is not None:
                        rec.loss(losses.mean() / 2, per_sample=losses / 2)
                    (losses.mean() / 2).backward()
            opt.step()
    return ddp, len(calls)


def rows(path: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def scope_scenarios(rank: int, world: int, out_dir: str) -> dict:
    global SHIM
    import deepscope
    from deepscope import Scope

    SHIM = CountingShim()
    out: dict = {}
    root = Path(out_dir)

    # 1. Scope() defaults (health check on, every(10)): a NaN on rank 1 only at step 4.
    before = SHIM.calls
    scope = Scope(root, "defaults")
    out["init_calls"] = SHIM.calls - before
    ddp, opt = ddp_mlp()
    assert scope.watch(ddp) is ddp
    out["steps"] = [train_step(scope, ddp, opt, rank, s, nan_at=(1, 4), record_input=True)
                    for s in range(12)]
    scope.close()

    # 1b. A NaN in rank 1's own loss only (the gradients stay finite): reported, not followed
    scope = Scope(root, "own_loss")
    ddp, opt = ddp_mlp()
    scope.watch(ddp)
    out["grad_every"] = scope.monitor.grad_every
    for s in range(12):
        train_step(scope, ddp, opt, rank, s, told_nan_at=(1, 4))
    scope.close()
    own = deepscope.open_run(root / "own_loss")
    out["own_loss_steps"] = own.steps(rank=rank)
    found = own.anomalies(rank=rank)
    out["own_loss_nonfinite"] = found[found.detector == "nonfinite"][
        ["step", "tensor", "message"]].values.tolist()

    # 1c. The user checks gradients every 10th step: rank 1 finds it at step 4 (its loss),
    # rank 0 at step 5 (its loss, the parameters non-finite); only step 10's check, which
    # every rank makes, starts the recording (the same steps on every rank)
    scope = Scope(root, "grad_every_10")
    ddp, opt = ddp_mlp()
    scope.watch(ddp)
    scope.monitor.grad_every = 10
    for s in range(12):
        train_step(scope, ddp, opt, rank, s, nan_at=(1, 4))
    scope.close()
    out["every_10_steps"] = deepscope.open_run(root / "grad_every_10").steps(rank=rank)

    # 2. Dynamic recording (a tentative step on every rank, kept where rank 1 wants it).
    ddp, opt = ddp_mlp()
    scope = Scope(root, "dynamic", schedule=10**9, dynamic=1, anomalies=False,
                  keep_if=lambda rec: rank == 1 and rec.step == 2)
    scope.watch(ddp)
    out["dynamic_calls"] = [train_step(scope, ddp, opt, rank, s) for s in range(4)]
    scope.close()

    # 2b. Economy through Scope; GradHist1d's pass raises on rank 1 at step 3 only
    import deepscope.instruments.global_batch as global_batch

    counters, at = global_batch.histogram_counters, {"step": -1}

    def fails_on_rank1_at_3(*args, **kwargs):
        if rank == 1 and at["step"] == 3:
            raise RuntimeError("injected on rank 1")
        return counters(*args, **kwargs)

    global_batch.histogram_counters = fails_on_rank1_at_3
    ddp, opt = ddp_mlp()
    scope = Scope(root, "economy", schedule=4, instruments="economy",
                  instrument_schedule=deepscope.at([0, 3]))
    scope.watch(ddp, optimizer=opt)
    out["economy_calls"] = []
    for s in range(6):
        at["step"] = s
        out["economy_calls"].append(train_step(scope, ddp, opt, rank, s, record_input=True))
    scope.close()
    global_batch.histogram_counters = counters

    # 3. A collective timeout: rank 1 stalls before step 1's collectives (the instruments',
    # then the dynamic keep's); rank 0's time out.
    ddp, opt = ddp_mlp()
    scope = Scope(root, "timeout", schedule=10**9, dynamic=1, anomalies=False,
                  keep_if=lambda rec: True, distributed_timeout_s=2,
                  instruments=["Loss", "GradNorm"], instrument_schedule=1)
    scope.watch(ddp)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("deepscope").addHandler(handler)
    for s in range(5):
        train_step(scope, ddp, opt, rank, s, stall=5.0 if (rank, s) == (1, 1) else 0.0)
    scope.close()
    out["timeout_messages"] = [m for m in messages if "collective" in m]
    out["timeout_disabled"] = scope.reducer.disabled

    # 4. The user's DDP is left as it is: bucket views, a comm hook, no_sync micro-batches
    plain, plain_hooks = accumulating_ddp(None, rank)
    scope = Scope(root, "untouched", schedule=1, anomalies="trace")
    scoped, scoped_hooks = accumulating_ddp(scope, rank)
    scope.close()
    out["untouched_same"] = all(a.equal(b) for a, b in zip(plain.parameters(),
                                                            scoped.parameters()))
    out["untouched_hooks"] = [plain_hooks, scoped_hooks]
    out["untouched_steps"] = deepscope.open_run(root / "untouched").steps(rank=rank)
    # 4b. Re-running into a finished run with overwrite=True, several times: every rank
    # replaces its file (ranks probing the same lock files at once saw each other as writers)
    out["overwrites"] = []
    for _ in range(4):
        Scope(root, "overwritten", overwrite=True).close()
        out["overwrites"].append(sorted(p.name for p in (root / "overwritten").glob("*.sqlite")))

    run = deepscope.open_run(root / "defaults")
    out["defaults_steps"] = run.steps(rank=rank)
    out["defaults_status"] = run.rank_status()[["rank", "status", "steps"]].values.tolist()
    # 5. (last: the ranks' group counters differ after it) A Scope on rank 0 only
    if rank == 0:
        try:
            Scope(root, "alone", distributed_timeout_s=2)
        except ValueError as error:
            out["alone"] = str(error)
    else:
        time.sleep(4)

    found = run.anomalies(rank=rank)
    out["defaults_nonfinite"] = found[found.detector == "nonfinite"][
        ["step", "tensor", "message"]].values.tolist()
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("scope_ddp")
    results = [r.check() for r in launch("tests.distributed.test_scope_ddp:scope_scenarios",
                                         root, timeout=180)]
    return root, results


def test_rank_files_carry_the_agreed_meta_and_local_values(scenarios):
    root, results = scenarios
    metas = []
    for rank in (0, 1):
        path = root / "defaults" / f"rank{rank}.sqlite"
        meta = dict(rows(path, "SELECT key, value FROM meta"))
        metas.append(json.loads(meta["distributed"]))
        assert metas[-1]["rank"] == rank and metas[-1]["world_size"] == 2
        assert metas[-1]["backend"] == "gloo"
        local = rows(path, "SELECT name, step, value FROM local_quantities "
                           "WHERE step = 0 ORDER BY name")
        x, y = _batch_values(rank, 0)
        assert local[0][:2] == ("BatchSize", 0) and local[0][2] == 6
        # the rank's own loss: mean ℓᵢ of its micro-batch, with the initial parameters
        assert local[1][:2] == ("Loss", 0) and local[1][2] == pytest.approx(
            _initial_loss(x, y), rel=1e-6)
        assert rows(path, "SELECT count(*) FROM quantities") == [(0,)]
    own = json.loads(dict(rows(root / "defaults" / "rank0.sqlite",
                               "SELECT key, value FROM meta"))["run_id"])
    assert metas[0]["run_id"] == metas[1]["run_id"] == own  # rank 0's run id everywhere
    assert results[0]["init_calls"] == results[1]["init_calls"] == 3  # agree, agree, id


def test_every_rank_overwrites_a_finished_run_together(scenarios):
    _, results = scenarios
    for r in results:
        assert r["overwrites"] == [["rank0.sqlite", "rank1.sqlite"]] * 4


def test_no_collective_on_any_step_of_scope_defaults(scenarios):
    _, results = scenarios
    for r in results:
        assert r["steps"] == [0] * 12  # recorded (0, 10), unrecorded and forced ones alike


def test_a_nan_on_one_rank_is_found_and_named_with_its_rank(scenarios):
    _, results = scenarios
    # rank 1's own loss is where it appeared (its input held the NaN)
    (step, tensor, message), = results[1]["defaults_nonfinite"]
    assert (step, tensor) == (4, "loss")
    assert message.startswith("rank 1: first non-finite value of step 4: the loss loss is nan")
    # DDP's averaged gradient carries it to rank 0, which checks the gradients on every step
    # in a distributed run: found there in step 4 too, said under rank 0, naming the gradient
    (step, tensor, message), = results[0]["defaults_nonfinite"]
    assert step == 4 and tensor == "2.weight"
    assert message.startswith("rank 0: first non-finite gradient of step 4")


def test_record_next_records_the_same_steps_on_every_rank(scenarios):
    _, results = scenarios
    for r in results:
        assert r["grad_every"] == 1  # the distributed default (10 in a single process)
        # the non-finite synced gradient of step 4: record_next=3 steps after it, everywhere
        assert r["defaults_steps"] == [0, 5, 6, 7, 10]
        assert r["defaults_status"] == [[0, "finished", 5], [1, "finished", 5]]
        # a NaN in rank 1's own loss alone is reported there but moves no schedule
        assert r["own_loss_steps"] == [0, 10]
        # gradients checked every 10th step (set by the user): the first check every rank
        # makes (step 10) starts the recording on every rank alike
        assert r["every_10_steps"] == [0, 10, 11]
    (step, tensor, message), = results[1]["own_loss_nonfinite"]
    assert (step, tensor) == (4, "loss") and message.startswith("rank 1: ")
    assert results[0]["own_loss_nonfinite"] == []


def test_dynamic_keep_is_agreed_with_one_flag_per_dynamic_step(scenarios):
    root, results = scenarios
    for rank, r in enumerate(results):
        assert r["dynamic_calls"] == [1, 1, 1, 1]
        steps = [s for (s,) in rows(root / "dynamic" / f"rank{rank}.sqlite",
                                    "SELECT step FROM steps")]
        assert steps == [0, 2]  # 0: the schedule's; 2: rank 1 kept it, so does rank 0


def test_a_collective_timeout_turns_them_off_with_one_line_and_training_goes_on(scenarios):
    root, results = scenarios
    assert len(results[0]["timeout_messages"]) == 1
    assert "collective across ranks failed" in results[0]["timeout_messages"][0]
    assert results[0]["timeout_disabled"]
    for rank in (0, 1):
        path = root / "timeout" / f"rank{rank}.sqlite"
        assert rows(path, "SELECT count(DISTINCT step) FROM kpis") == [(5,)]
    warned = rows(root / "timeout" / "rank0.sqlite", "SELECT message FROM warnings")
    assert len(warned) == 1 and "distributed instruments are off" in warned[0][0]
    # rank 0's global values: step 0's, then missing with the reason
    values = rows(root / "timeout" / "rank0.sqlite", "SELECT step, name, value, meta FROM "
                  "quantities WHERE layer = '' ORDER BY step, name")
    assert [(s, n) for s, n, _, _ in values] == [(s, n) for s in range(5)
                                                 for n in ("GradNorm", "Loss")]
    assert all(v is not None for s, _, v, _ in values if s == 0)
    for _, _, value, meta in values[2:]:
        assert value is None
        assert "collective across ranks failed" in json.loads(meta)["reason"]
    for rank in (0, 1):  # every rank's own values on every step, and every dynamic step kept
        path = root / "timeout" / f"rank{rank}.sqlite"
        assert rows(path, "SELECT DISTINCT step FROM local_quantities WHERE name = 'Loss' "
                          "AND value IS NOT NULL ORDER BY step") == [(s,) for s in range(5)]
        assert rows(path, "SELECT step FROM steps ORDER BY step") == [(s,) for s in range(5)]


def test_a_scope_on_one_rank_only_fails_in_one_line_after_the_timeout(scenarios):
    _, results = scenarios
    assert results[0]["alone"] == (
        "the other ranks did not create their Scope within distributed_timeout_s=2 s "
        "(DistStoreError); create a Scope on every rank at the same point, or pass "
        "distributed=False to record on some ranks only")


def test_economy_through_scope_one_call_per_instrumented_step(scenarios):
    root, results = scenarios
    for r in results:
        # instrumented: 0 and 3 (due), 1 and 4 (α's end point); 2 and 5: none, recorded or not
        assert r["economy_calls"] == [1, 1, 0, 1, 1, 0]
    rank0, rank1 = (root / "economy" / f"rank{r}.sqlite" for r in (0, 1))
    steps = rows(rank0, "SELECT DISTINCT step FROM quantities ORDER BY step")
    assert steps == [(0,), (3,)]  # steps 1 and 4 add α of 0 and 3, stored under 0 and 3
    assert rows(rank1, "SELECT count(*) FROM quantities") == [(0,)]
    for path in (rank0, rank1):
        local = rows(path, "SELECT step, name FROM local_quantities WHERE layer = '' "
                           "ORDER BY step, name")
        by_step = {s: {n for t, n in local if t == s} for s in range(6)}
        for s in (0, 1, 3, 4):  # the instruments' own local values
            assert by_step[s] == {"BatchSize", "GradNorm", "Loss"}, (s, by_step)
        assert by_step[2] == by_step[5] == set()  # neither recorded nor instrumented
    # an instrument failing on rank 1 only: skipped on every rank, the reason recorded
    hist = rows(rank0, "SELECT step, value, meta FROM quantities WHERE name = 'GradHist1d' "
                       "AND layer = '' ORDER BY step")
    assert [s for s, _, _ in hist] == [0, 3]
    assert json.loads(hist[1][2])["reason"] == "failed on rank 1 (see its warnings)"
    assert "reason" not in json.loads(hist[0][2])
    others = rows(rank0, "SELECT name, meta FROM quantities WHERE step = 3 AND layer = '' "
                         "AND name != 'GradHist1d'")
    assert others and all("reason" not in json.loads(m) for _, m in others)
    warned = [m for (m,) in rows(rank1, "SELECT message FROM warnings")]
    assert any("GradHist1d failed on rank 1: RuntimeError: injected on rank 1" in m
               for m in warned)


def test_the_users_ddp_is_left_as_it_is(scenarios):
    _, results = scenarios
    for r in results:
        assert r["untouched_same"] is True  # bit-identical to the same DDP run without deepscope
        plain, scoped = r["untouched_hooks"]
        assert plain == scoped >= 3  # the comm hook ran on every bucket of every synced step
        assert r["untouched_steps"] == [0, 1, 2]


def _batch_values(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


def _initial_loss(x, y) -> float:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    with torch.no_grad():
        return float(((model(x.double()) - y.double()) ** 2).mean())
