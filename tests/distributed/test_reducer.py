"""deepscope's own collectives: packed sums, agreement, and a timeout that turns them off."""

from __future__ import annotations

import time

import torch

from tests.distributed.harness import launch


def reducer_basics(rank: int, world: int, out_dir, stall_rank: int) -> dict:
    from deepscope.distributed import CollectiveError, Reducer

    reducer = Reducer.create("auto", timeout_s=3)
    a, b = reducer.sum([torch.tensor([1.0 + rank, 2.0]), torch.full((2, 2), float(rank))])
    (m,) = reducer.max([torch.tensor([float(rank)])])
    ok = reducer.agree(rank != 1)
    text = reducer.broadcast_text(f"run-{rank}")
    calls = reducer.calls
    if rank == stall_rank:
        time.sleep(8)  # the other rank's collective times out
        return {"a": a.tolist(), "b": b.tolist(), "max": m.item(), "ok": ok, "text": text,
                "calls": calls}
    try:
        reducer.sum([torch.ones(1)])
        timed_out = None
    except CollectiveError:
        timed_out = reducer.disabled
    try:
        reducer.sum([torch.ones(1)])  # off: raises at once
        again = False
    except CollectiveError:
        again = True
    return {"a": a.tolist(), "b": b.tolist(), "max": m.item(), "ok": ok, "text": text,
            "calls": calls, "timed_out": timed_out, "again": again}


def test_packed_sum_max_agree_broadcast_and_timeout(tmp_path):
    results = [r.check() for r in launch("tests.distributed.test_reducer:reducer_basics",
                                         tmp_path, 1)]
    for r in results:
        assert r["a"] == [3.0, 4.0] and r["b"] == [[1.0, 1.0], [1.0, 1.0]]
        assert r["max"] == 1.0 and r["ok"] is False and r["text"] == "run-0"
        assert r["calls"] == 4
    assert "collective across ranks failed" in results[0]["timed_out"]
    assert results[0]["again"] is True


def test_off_without_a_process_group():
    from deepscope.distributed import Reducer

    assert Reducer.create("auto") is None and Reducer.create(False) is None
    try:
        Reducer.create(True)
    except ValueError as error:
        assert "init_process_group" in str(error)
    else:
        raise AssertionError("distributed=True without a group must raise")
