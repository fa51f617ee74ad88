"""`benchmarks/run.py --quick` runs end to end and writes well-formed results (no timing is
asserted: the numbers of a quick run mean nothing)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"


def load_run_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


def test_quick_benchmark_writes_well_formed_results(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    bench = load_run_module()

    assert results["version"] == bench.RESULTS_VERSION
    assert "benchmarks/run.py --quick" in results["command"]
    assert results["settings"]["quick"] is True
    assert results["settings"]["torch_threads"] == 1
    for key in ("cpu", "cores", "torch", "python", "load_average_start", "load_average_end"):
        assert key in results["machine"]
    assert [g["name"] for g in results["groups"]] == bench.group_names()
    scripted = results["groups"][len(bench.GROUPS):]
    for group, script_group in zip(scripted, bench.SCRIPT_GROUPS):
        assert "error" not in group, group["error"]
        rows = group["rows"]
        assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
        labels = {r["label"] for r in rows}
        assert {label for label, _ in script_group.targets} <= labels
        for row in rows:
            assert [t["target"] for t in row["targets"]] == [
                t.label for label, t in script_group.targets if label == row["label"]]

    for group, spec_group in zip(results["groups"], bench.GROUPS):
        rows = group["rows"]
        assert [r["spec"] for r in rows] == [e.spec for e in spec_group.entries]
        assert rows[0]["status"] == "ok", rows[0]  # plain training always runs
        for row in rows:
            status = row["status"]
            assert status == "ok" or status.startswith(("error: ", "skipped: ")), status
            assert "\n" not in status
            if status != "ok":
                continue
            assert row["ms"] > 0 and row["ratio"] > 0 and row["peak_rss_mb"] > 0
            assert len(row["repeats"]) == 1
            paired = spec_group.paired and row is not rows[0]
            assert (row["repeats"][0]["plain_ms_median"] is not None) == paired, row
            assert row["bytes_per_step"] is None or row["bytes_per_step"] > 0
            for target in row["targets"]:
                assert target["ok"] in (True, False, None)

    markdown = (tmp_path / "results.md").read_text()
    assert markdown.startswith("# deepscope benchmarks")
    assert "| group | configuration | target | measured | met |" in markdown
    for group in results["groups"]:
        assert f"## {group['title']}" in markdown


def test_an_only_run_keeps_the_other_groups_of_the_stored_results(tmp_path: Path) -> None:
    bench = load_run_module()
    first, second = bench.GROUPS[0].name, bench.GROUPS[1].name

    def results(date: str, names: list[str]) -> dict:
        return {"version": bench.RESULTS_VERSION, "command": f"run {date}", "date": date,
                "note": "", "groups": [{"name": n, "title": n, "note": "", "rows": [],
                                        "measured": {"command": f"run {date}", "date": date,
                                                     "note": ""}} for n in names]}

    stored = tmp_path / "results.json"
    stored.write_text(json.dumps(results("day 1", [first, second])))
    merged = bench.merge_previous(results("day 2", [second]), stored)
    assert [g["name"] for g in merged["groups"]] == [first, second]      # GROUPS order
    assert [g["measured"]["date"] for g in merged["groups"]] == ["day 1", "day 2"]
    # another results version, or none, is not merged
    stored.write_text(json.dumps({**results("day 1", [first]), "version": -1}))
    assert [g["name"] for g in bench.merge_previous(results("day 2", [second]), stored)
            ["groups"]] == [second]
    assert bench.merge_previous(results("day 2", [second]), tmp_path / "missing.json")


def test_paired_ratios_are_against_their_own_plain_step_and_show_their_spread() -> None:
    bench = load_run_module()
    group = next(g for g in bench.GROUPS if g.paired)
    plain, tool = group.entries[0], next(e for e in group.entries if e.targets)
    limit = next(t.limit for t in tool.targets if t.metric == "ratio")

    def record(spec: str, ms: float, plain_ms: float | None = None) -> dict:
        out = {"spec": spec, "ms_median": ms, "ms_mean": ms, "steps": 60, "warmup": 10,
               "close_s": 0.0, "bytes": 0, "stored_steps": 0, "peak_rss_mb": 1.0,
               "versions": {}}
        if plain_ms is not None:
            out.update(plain_ms_median=plain_ms, plain_ms_mean=plain_ms)
        return out

    # the separately measured plain step (5 ms) is ignored: each record has its own
    tool_ms = [2.0 * limit * 0.9, 2.0 * limit * 0.95, 2.0 * limit * 1.2]
    records = {e.spec: [record(e.spec, 5.0)] * 3 for e in group.entries}
    records[plain.spec] = [record(plain.spec, 5.0)] * 3
    records[tool.spec] = [record(tool.spec, ms, 2.0) for ms in tool_ms]
    row = next(r for r in bench.summarize(group, records) if r["spec"] == tool.spec)
    assert row["ratio"] == limit * 0.95
    assert row["ratio_range"] == [limit * 0.9, limit * 1.2]
    target = next(t for t in row["targets"] if t["metric"] == "ratio")
    assert target["ok"] is True and target["repeats_agree"] is False
    assert bench.verdict(target["ok"], target["repeats_agree"]) == "✓ — not in every repeat"
    assert bench.verdict(False, False) == "✗ (missed) — met in some repeats"
    assert bench.fmt_ratio(row) == (f"{limit * 0.95:.2f} ({limit * 0.9:.2f}–"
                                    f"{limit * 1.2:.2f})")


def test_check_fails_only_when_every_repeat_misses_a_target() -> None:
    bench = load_run_module()
    group = bench.ScriptGroup("g", "g", "script.py", targets=(
        ("tool", bench.ratio_target(4)), ("tool", bench.floor_target(1.5))))

    def results(ratios: list[float], floor: list[float]) -> dict:
        record = {"rows": [{"label": "plain", "ms": 1.0, "ratios": [1.0] * len(ratios)},
                           {"label": "tool", "ms": 4.0, "ratios": ratios,
                            "floor_ratios": floor}]}
        return {"groups": [bench.summarize_script(group, record)]}

    assert bench.check_failures(results([3.0, 4.5, 5.0], [1.2, 1.4, 1.6])) == []
    failed = bench.check_failures(results([4.2, 4.5, 5.0], [1.6, 1.7, 1.6]))
    assert failed == ["g | tool | ≤ 4× plain: measured 4.50 (4.20–5.00)",
                      "g | tool | ≤ 1.5× floor: measured 1.60 (1.60–1.70)"]
    broken = {"groups": [bench.summarize_script(group, {"error": "process died"})]}
    assert bench.check_failures(broken) == ["g: not measured (process died)"]
