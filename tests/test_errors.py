"""Bad input gets one clear line; failures inside recording never stop training."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import deepscope
from deepscope.cli.main import main as cli


@pytest.fixture
def scope(tmp_path):
    s = deepscope.Scope(tmp_path, "r", schedule=1)
    yield s
    s.close()


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_non_tensor(scope):
    with scope.step(0) as rec, pytest.raises(TypeError) as e:
        rec.tensor("x", [1, 2, 3])
    assert "torch.as_tensor" in one_line(e)


def test_unknown_role(scope):
    with scope.step(0) as rec, pytest.raises(ValueError) as e:
        rec.tensor("x", torch.ones(2), role="hidden")
    assert "use one of input, target, activation" in one_line(e)


def test_duplicate_name_in_iteration(scope):
    with scope.step(0) as rec:
        rec.tensor("x", torch.ones(2))
        with pytest.raises(ValueError) as e:
            rec.tensor("x", torch.ones(2))
        assert "rec.iteration()" in one_line(e)


def test_tensor_outside_a_step(scope):
    with scope.step(0) as rec:
        pass
    with pytest.raises(ValueError) as e:
        rec.tensor("x", torch.ones(2))
    assert "inside" in one_line(e)


def test_steps_going_backwards_and_nesting(scope):
    with scope.step(3):
        with pytest.raises(ValueError) as e:
            scope.step(4)
        assert "still open" in one_line(e)
    with pytest.raises(ValueError) as e:
        scope.step(2)
    assert "must increase: got 2 after 3" in one_line(e)
    with pytest.raises(TypeError):
        scope.step("4")


def test_bad_arguments(tmp_path, scope):
    with pytest.raises(ValueError, match="invalid run name"):
        deepscope.Scope(tmp_path, "../escape")
    with pytest.raises(TypeError, match="nn.Module"):
        scope.watch("model")
    with scope.step(0) as rec:
        with pytest.raises(TypeError, match="number"):
            rec.kpi("acc", "high")
        with pytest.raises(ValueError, match="single number"):
            rec.kpi("acc", torch.ones(3))
        with pytest.raises(TypeError, match="reduction='none'"):
            rec.loss(torch.tensor(1.0), per_sample=torch.tensor(1.0))  # no batch dim
        with pytest.raises(ValueError, match="out of range"):
            rec.tensor("y", torch.ones(2), batch_dim=3)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_path_non_root(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="writable"):
        deepscope.Scope(ro / "sub", "r")


def test_unwritable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError) as e:
        deepscope.Scope(blocker, "r")
    assert "writable path" in one_line(e)


def test_internal_failure_logged_once_training_continues(tmp_path, monkeypatch, caplog):
    import deepscope.recorder.summary as summary_mod

    def broken(*a, **k):
        raise RuntimeError("boom in stats")
    monkeypatch.setattr(summary_mod, "fused_summaries", broken)
    lin = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="deepscope"):
        with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
            scope.watch(lin)
            for step in range(3):
                with scope.step(step) as rec:
                    out = lin(torch.randn(4, 3))
                    rec.tensor("out", out)
                    loss = out.pow(2).mean()
                    rec.loss(loss)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    assert not torch.equal(before, lin.weight)          # training happened
    warnings = [r for r in caplog.records if "boom in stats" in r.getMessage()]
    assert len(warnings) == 1                            # reported once
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [] and len(run.kpis("loss")) == 3  # KPIs still logged


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli(["ls", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "runs" / "bad").mkdir(parents=True)
    (tmp_path / "runs" / "bad" / "rank0.sqlite").write_bytes(b"garbage" * 10)
    assert cli(["ls", str(tmp_path / "runs")]) == 2
    assert "not a deepscope store" in capsys.readouterr().err
