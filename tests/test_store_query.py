"""Store and query: run folders, overwrite/resume, notes, live reading from another process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

import deepscope
from tests.helpers import train_mlp


def test_opening_a_scope_folder_names_the_runs_inside(tmp_path):
    with deepscope.Scope(tmp_path / "exp", schedule=1) as scope:  # records into exp/run
        train_mlp(scope, steps=1)
    with pytest.raises(ValueError, match=r"no deepscope run at .*exp: .*it holds the run\(s\) "
                                         r"run: pass .*exp[/\\]run$"):
        deepscope.open_run(tmp_path / "exp")
    with pytest.raises(ValueError, match=r"such as runs/baseline$"):  # nothing inside to name
        deepscope.open_run(tmp_path / "exp" / "run" / "missing")
    assert deepscope.open_run(tmp_path / "exp" / "run").steps() == [0]


def test_existing_run_refused_unless_overwrite_or_resume(tmp_path):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        train_mlp(scope, steps=2)
    with pytest.raises(ValueError, match="already exists.*overwrite=True.*resume=True"):
        deepscope.Scope(tmp_path, "r")
    with deepscope.Scope(tmp_path, "r", schedule=1, resume=True) as scope:
        with pytest.raises(ValueError, match="must increase"):
            scope.step(1)
        with scope.step(5) as rec:
            rec.tensor("x", torch.ones(3), role="input")
    assert deepscope.open_run(tmp_path / "r").steps() == [0, 1, 5]
    with deepscope.Scope(tmp_path, "r", schedule=1, overwrite=True) as scope:
        with scope.step(0) as rec:
            rec.tensor("x", torch.ones(3), role="input")
    assert deepscope.open_run(tmp_path / "r").steps() == [0]


def test_notes_kpis_project_and_meta(tmp_path):
    with deepscope.Scope(tmp_path, "a", schedule=2) as scope:
        scope.note("baseline, lr 0.1")
        train_mlp(scope, steps=3)
    with deepscope.Scope(tmp_path, "b", schedule=2) as scope:
        train_mlp(scope, steps=1)
    project = deepscope.open_project(tmp_path)
    assert project.runs() == ["a", "b"]
    run = project.run("a")
    assert run.notes()["text"].tolist() == ["baseline, lr 0.1"]
    assert set(run.kpis()["name"]) == {"loss", "accuracy"}
    assert run.meta()["schedule"] == "every(2, start=0)"
    assert run.meta()["schema_version"] == "4"
    with pytest.raises(ValueError, match="no run 'c'.*a, b"):
        project.run("c")
    tensors = run.tensors().set_index("name")
    assert tensors.loc["l1.weight", "node"] == "l1"
    assert tensors.loc["l1.weight", "role_in_node"] == "weight"
    assert tensors.loc["h1", "shape"] == [8, 8]


def test_gradient_snapshots_per_loss_group(tmp_path):
    lin = torch.nn.Linear(2, 1)
    with deepscope.Scope(tmp_path, "g", schedule=1) as scope:
        scope.watch(lin)
        with scope.step(0) as rec:
            x = torch.randn(4, 2)
            out = lin(x)
            rec.tensor("out", out)
            out.sum().backward(retain_graph=True)
            rec.gradients("first")
            (3 * out.sum()).backward()
    run = deepscope.open_run(tmp_path / "g")
    first = run.stats_wide("out", direction="grad:first").iloc[0]
    total = run.stats_wide("out", direction="grad").iloc[0]
    assert first["mean"] == pytest.approx(1.0) and total["mean"] == pytest.approx(4.0)
    w = run.stats_wide("weight", direction="grad").iloc[0]
    assert w["mean"] == pytest.approx(4 * x.sum(0).mean().item(), rel=1e-5)


WRITER = textwrap.dedent("""
    import sys, time, torch, deepscope
    scope = deepscope.Scope(sys.argv[1], "live", schedule=1)
    for step in range(40):
        with scope.step(step) as rec:
            rec.tensor("x", torch.randn(64, 64), role="input")
        scope.flush()
        time.sleep(0.05)
    scope.close()
""")


def test_reader_in_other_process_sees_steps_appear(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        seen: list[int] = []
        deadline = time.time() + 60
        while time.time() < deadline and (not seen or seen[-1] < 39):
            if (tmp_path / "live" / "rank0.sqlite").exists():
                try:
                    run = deepscope.open_run(tmp_path / "live")
                    seen.append(len(run.steps()))
                    run.close()
                except deepscope.CorruptRunError:
                    pass  # schema not written yet: the writer is just starting
            time.sleep(0.05)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    growing = sorted(set(seen))
    assert len(growing) >= 3 and growing[0] < 40       # saw partial progress while writing
    assert deepscope.open_run(tmp_path / "live").steps() == list(range(40))
