"""`benchmarks/core_sharing.py` runs and returns well-formed figures (no timing is asserted:
the numbers of so short a run mean nothing)."""

from __future__ import annotations

import math
import sys

import pytest

from tests.helpers import benchmark_module


@pytest.mark.skipif(sys.platform != "linux", reason="the benchmark's background uses fork")
def test_core_sharing_returns_a_ratio_per_load() -> None:
    with benchmark_module("core_sharing") as module:
        result = module.measure(rounds=2, steps=3, busy_ms=0.5, idle_ms=0.5)
    assert result["alone_ms"] > 0
    for load in module.LOADS:
        s = result[load]
        assert s["min"] <= s["q25"] <= s["median"] <= s["q75"] <= s["max"]
        assert math.isfinite(s["median"]) and s["median"] > 0
        assert f"with {load}" in module.describe(result)
