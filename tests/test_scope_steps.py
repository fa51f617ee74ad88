"""Steps opened and closed without a `with` block: `Scope.begin_step` / `Scope.end_step`
store exactly what the `with` form stores, and a discarded step stores nothing."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest
import torch
from torch import nn

import deepscope

SRC = Path(__file__).resolve().parents[1] / "src"


def _train(scope: deepscope.Scope, model: nn.Module, step: int, with_block: bool,
           discard: bool = False) -> None:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
    if with_block:
        with scope.step(step) as rec:
            _body(rec, model, x)
        return
    rec = scope.begin_step(step)
    _body(rec, model, x)
    scope.end_step(discard=discard)


def _body(rec: deepscope.StepRecorder, model: nn.Module, x: torch.Tensor) -> None:
    rec.tensor("x", x, role="input")
    loss = model(x).pow(2).mean()
    rec.loss(loss)
    rec.kpi("accuracy", 0.5)
    loss.backward()


def _record(path: Path, run: str, with_block: bool) -> deepscope.Run:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with deepscope.Scope(path, run, schedule=deepscope.every(1)) as scope:
        scope.watch(model)
        for step in range(3):
            _train(scope, model, step, with_block, discard=step == 1 and not with_block)
    return deepscope.open_run(path / run)


def test_begin_and_end_step_store_what_a_with_block_stores(tmp_path: Path) -> None:
    with_block, by_call = _record(tmp_path, "with", True), _record(tmp_path, "calls", False)
    assert with_block.steps() == [0, 1, 2]
    assert by_call.steps() == [0, 2]  # step 1 discarded: none of its data
    assert sorted(by_call.kpis()["step"].unique()) == [0, 2]
    for step in (0, 2):
        a, b = with_block.stats(step=step), by_call.stats(step=step)
        assert len(a) > 0
        pd_cols = [c for c in a.columns if c != "run"]
        assert a[pd_cols].reset_index(drop=True).equals(b[pd_cols].reset_index(drop=True))


def test_end_step_needs_an_open_step_and_begin_step_a_closed_one(tmp_path: Path) -> None:
    with deepscope.Scope(tmp_path, "r") as scope:
        with pytest.raises(ValueError, match="no step open; open one with scope.begin_step"):
            scope.end_step()
        rec = scope.begin_step(0, "train")
        assert (rec.step, rec.kind, rec.scope) == (0, "train", scope)
        with pytest.raises(ValueError, match="still open"):
            scope.begin_step(1)
        scope.end_step()
        with pytest.raises(ValueError, match="outside its step"):
            rec.kpi("late", 1.0)


def test_no_import_cycle_among_deepscope_modules() -> None:
    """Module-level imports (those under `if TYPE_CHECKING:` included) form no cycle."""
    modules = {".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): f
               for f in (SRC / "deepscope").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        nodes = [*tree.body, *(n for t in tree.body if isinstance(t, ast.If) for n in t.body)]
        deps = graph.setdefault(name, set())
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base) \
                    if node.level else node.module or ""
                for alias in node.names:
                    deps.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                             else target)
        graph[name] = {d for d in deps if d in modules and d != name}
    assert graph["deepscope.recorder.scope"] >= {"deepscope.recorder.step"}  # the probe works
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_a_parameter_whose_dtype_changes_between_steps_is_described_anew(tmp_path: Path) -> None:
    """TensorInfo is reused across steps only while the parameter stays alike."""
    model = nn.Linear(3, 2)
    payloads = []
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1)) as scope:
        scope.watch(model)
        scope.writer.submit_step = lambda payload: payloads.append(payload) or True
        for step in range(3):
            if step == 2:
                model.double()
            x = torch.randn(4, 3, dtype=model.weight.dtype)
            with scope.step(step) as rec:
                rec.tensor("x", x, role="input")
                model(x).sum().backward()
    dtypes = [{t.name: t.dtype for t in p.tensors} for p in payloads]
    assert dtypes[0] == dtypes[1] == {"weight": "float32", "bias": "float32", "x": "float32"}
    assert dtypes[2] == {"weight": "float64", "bias": "float64", "x": "float64"}
    assert payloads[0].tensors[0] is payloads[1].tensors[0]  # reused while alike
