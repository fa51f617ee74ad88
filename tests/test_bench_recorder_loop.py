"""`benchmarks/recorder_loop.py` runs and returns well-formed figures (no timing is asserted:
the numbers of so short a run mean nothing)."""

from __future__ import annotations

import math
import time

from tests.helpers import benchmark_module


def test_recorder_loop_returns_ratios_for_every_clock() -> None:
    with benchmark_module("recorder_loop") as module:
        result = module.measure(rounds=2, block=2, warmup_rounds=0)
    for clock in ("wall", "thread", "process"):
        s = result[f"ratio_{clock}"]
        assert s["min"] <= s["q25"] <= s["median"] <= s["q75"] <= s["max"]
        assert math.isfinite(s["median"]) and s["median"] > 0
        assert result["plain_ms"][clock] > 0 and result["recorded_ms"][clock] > 0
    if hasattr(time, "pthread_getcpuclockid"):  # the writer thread's CPU time, measured apart
        s = result["ratio_writer"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and result["recorded_ms"]["writer"] > 0
        assert "recorded / plain, writer" in module.describe(result)
    assert "target: 2.0x wall" in module.describe(result)
    record = module.script_record(result)  # run.py's "recorder-loop" group reads this
    assert [row["label"] for row in record["rows"]] == ["plain", "recorded every step"]
    assert record["rows"][1]["ratios"] == result["ratios_wall"]
    assert len(record["rows"][1]["ratios"]) == 2
