"""`benchmarks/core_sharing.py` runs and returns well-formed figures (no timing is asserted:
the numbers of so short a run mean nothing)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.platform != "linux", reason="the benchmark's background uses fork")
def test_core_sharing_returns_a_ratio_per_load() -> None:
    spec = importlib.util.spec_from_file_location("core_sharing",
                                                  ROOT / "benchmarks" / "core_sharing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        result = module.measure(rounds=2, steps=3, busy_ms=0.5, idle_ms=0.5)
    finally:
        sys.modules.pop(spec.name, None)
        sys.modules.pop("workload", None)
    assert result["alone_ms"] > 0
    for load in module.LOADS:
        s = result[load]
        assert s["min"] <= s["q25"] <= s["median"] <= s["q75"] <= s["max"]
        assert math.isfinite(s["median"]) and s["median"] > 0
        assert f"with {load}" in module.describe(result)
