"""The write side under misuse and hostile neighbours (issue 20): one writer per run and rank,
fork, bad values refused at the call, another program's database lock, StopTraining, what
flush() promises, a -wal file of another database, unchecked arguments, a deleted run folder.

Multi-process cases run small scripts in subprocesses with timeouts (a hang fails the test,
it never blocks the suite).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import deepscope
from deepscope.anomalies import StopTraining
from deepscope.store import writer as writer_module
from deepscope.store.writer import StepPayload, StoreWriter
from tests.stress import workload

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def script(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=timeout)


def record(scope: deepscope.Scope, steps: range, value: float = 1.0) -> None:
    for step in steps:
        with scope.step(step) as rec:
            rec.tensor("x", torch.full((2, 3), value + step), role="input")
            rec.kpi("k", float(step))


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# --- 1. one writer per run and rank --------------------------------------------------------

HOLDER = """
import sys, time, torch, deepscope
scope = deepscope.Scope(sys.argv[1], "r", schedule=1)
for step in range(20):
    with scope.step(step) as rec:
        rec.tensor("x", torch.full((2, 3), float(step)), role="input")
scope.flush()
print("ready", flush=True)
time.sleep(120)
"""


def test_a_second_writer_is_refused_and_resume_appends_after_a_killed_one(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        for kwargs in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(ValueError, match="being written by another process") as info:
                deepscope.Scope(tmp_path, "r", schedule=1, **kwargs)
            assert "\n" not in str(info.value)
        assert deepscope.open_run(tmp_path / "r").steps() == list(range(20))  # untouched
        assert deepscope.open_run(tmp_path / "r").status() == "recording"
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel releases a dead holder's lock
        holder.wait(30)
    assert deepscope.open_run(tmp_path / "r").status() == "crashed"  # killed, never closed
    with deepscope.Scope(tmp_path, "r", schedule=1, resume=True) as scope:
        with pytest.raises(ValueError, match="must increase: got 19 after 19"):
            scope.step(19)  # a committed step is never rewritten
        record(scope, range(20, 23), value=100.0)
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == list(range(23))
    for step in (0, 19):
        assert (run.values("x", step, view="samples") == step).all()  # the first writer's
    assert (run.values("x", 22, view="samples") == 122).all()


def test_a_run_says_whether_it_finished_or_was_interrupted(tmp_path):
    with deepscope.Scope(tmp_path, "ok", schedule=1) as scope:
        record(scope, range(2))
    assert deepscope.open_run(tmp_path / "ok").status() == "finished"
    with pytest.raises(KeyError), deepscope.Scope(tmp_path, "bad", schedule=1) as scope:
        record(scope, range(2))
        raise KeyError("no such batch")
    run = deepscope.open_run(tmp_path / "bad")
    assert run.status() == "interrupted: KeyError: 'no such batch'"
    assert run.steps() == [0, 1]
    with deepscope.Scope(tmp_path, "bad", schedule=1, resume=True) as scope:
        assert run.status() == "recording"  # resumed: recording again until closed
    assert run.status() == "finished"


def test_two_scopes_in_one_process_on_one_rank(tmp_path):
    first = deepscope.Scope(tmp_path, "r", schedule=1)
    with pytest.raises(ValueError, match="being written by another process"):
        deepscope.Scope(tmp_path, "r", schedule=1, resume=True)
    deepscope.Scope(tmp_path, "r", schedule=1, resume=True, rank=1).close()  # other rank: fine
    first.close()
    deepscope.Scope(tmp_path, "r", schedule=1, resume=True).close()  # released on close


def test_a_committed_step_is_never_rewritten_by_the_writer(tmp_path, caplog):
    """Below the Scope's step check: the steps row is a plain INSERT, so a step number that
    exists loses only the new step, never the committed one."""
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(2))
        scope.flush()
        scope._last_step = None  # pretend another writer's counter
        with caplog.at_level(logging.WARNING, logger="deepscope"):
            record(scope, range(1, 3), value=50.0)
            with pytest.raises(deepscope.RecordingError, match="step 1 skipped"):
                scope.flush()
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1, 2]
    assert (run.values("x", 1, view="samples") == 2).all()  # the committed step 1, 1 + 1
    assert (run.values("x", 2, view="samples") == 52).all()


# --- 7. fork --------------------------------------------------------------------------------

FORK = """
import os, sys, torch, deepscope
scope = deepscope.Scope(sys.argv[1], "r", schedule=1, queue_size=2)
with scope.step(0) as rec:
    rec.tensor("x", torch.ones(2, 3), role="input")
scope.flush()
pid = os.fork()
if pid == 0:  # the child records more steps than the queue holds: it must never block
    for step in range(1, 40):
        with scope.step(step) as rec:
            rec.tensor("x", torch.ones(2, 3), role="input")
            rec.kpi("k", 1.0)
    scope.note("from the child")
    try:
        scope.flush()
    except deepscope.RecordingError as exc:
        print("child flush:", exc, flush=True)
    scope.close()
    os._exit(0)
for step in range(1, 5):
    with scope.step(step) as rec:
        rec.tensor("x", torch.full((2, 3), float(step)), role="input")
_, status = os.waitpid(pid, 0)
scope.close()
print("child status", status, flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_recording_after_fork_never_hangs_and_the_parent_records_on(tmp_path):
    proc = script(FORK, str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "child status 0" in proc.stdout
    assert "child flush:" in proc.stdout and "forked" in proc.stdout
    assert proc.stderr.count("recording is off in the child") == 1  # one warning
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1, 2, 3, 4]
    assert (run.values("x", 4, view="samples") == 4).all()
    assert run.kpis().empty and run.notes().empty  # nothing of the child's


# --- 8. one bad value refused at the call, the rest recorded ---------------------------------

def test_bad_values_are_refused_at_the_call_and_the_rest_is_recorded(tmp_path, caplog):
    bad_calls = [
        (ValueError, "float64's range", lambda rec: rec.kpi("k", 10**400)),
        (ValueError, "meta device", lambda rec: rec.kpi("k", torch.empty((), device="meta"))),
        (ValueError, "lone surrogate", lambda rec: rec.kpi("x\ud800y", 1.0)),
        (ValueError, "lone surrogate", lambda rec: rec.tensor("x\ud800y", torch.ones(2))),
        (ValueError, "lone surrogate", lambda rec: rec.tensor("t", torch.ones(2),
                                                              node="n\udfffn")),
        (ValueError, "lone surrogate", lambda rec: rec.loss(torch.ones(()), name="l\ud800")),
        (TypeError, "role_in_node must be", lambda rec: rec.tensor("t", torch.ones(2),
                                                                   role_in_node=[1])),
        (ValueError, "lone surrogate", lambda rec: rec.scope.note("x\ud800y")),
    ]
    with caplog.at_level(logging.WARNING, logger="deepscope"), \
            deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        with scope.step(0) as rec:
            rec.kpi("before", 1.0)
            for error, message, call in bad_calls:
                with pytest.raises(error, match=message) as info:
                    call(rec)
                assert "\n" not in str(info.value)
            rec.tensor("x", torch.ones(2, 3), role="input")
            rec.kpi("after", 2.0)
        with pytest.raises(ValueError, match="lone surrogate"):
            scope.step(1, kind="k\ud800")
        with pytest.raises(ValueError, match="2\\*\\*63"):
            scope.step(2**63)
        record(scope, range(1, 3))
        scope.note("fine")
        scope.flush()  # returns: nothing was lost
    assert not warnings_of(caplog, "failed")
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1, 2]
    kpis = run.kpis()
    assert set(kpis[kpis["step"] == 0]["name"]) == {"before", "after"}
    assert list(kpis[kpis["name"] == "k"]["step"]) == [1, 2]
    assert list(run.notes()["text"]) == ["fine"]


@pytest.mark.parametrize("stage", ["summary", "write"])
def test_a_failure_of_one_step_skips_that_step_not_the_run(tmp_path, monkeypatch, caplog,
                                                           stage):
    """Steps 1 and 3 fail, in their summary (writer thread) or inside their transaction:
    each is skipped alone, warned about, and named by the next flush()."""
    from deepscope.recorder import summary as summary_module
    summarise, write_step = summary_module.summarise_steps, StoreWriter._write_step

    def failing_summary(steps: list) -> object:  # fails steps 1 and 3, and a group with one
        if any(c.tensor[0, 0] in (2.0, 4.0) for s in steps for c in s.captures):
            raise RuntimeError("crafted failure")
        return summarise(steps)

    def failing_write(self: StoreWriter, p: StepPayload, summary: object) -> None:
        write_step(self, p, summary)
        if p.step in (1, 3):
            raise sqlite3.IntegrityError("crafted failure")

    if stage == "summary":
        monkeypatch.setattr(summary_module, "summarise_steps", failing_summary)
    else:
        monkeypatch.setattr(StoreWriter, "_write_step", failing_write)
    error = "RuntimeError" if stage == "summary" else "IntegrityError"
    with caplog.at_level(logging.WARNING, logger="deepscope"), \
            deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(3))
        with pytest.raises(deepscope.RecordingError, match=rf"step 1 skipped \({error}"):
            scope.flush()
        scope.flush()  # said once: nothing new was lost since
        record(scope, range(3, 5))
        with pytest.raises(deepscope.RecordingError, match="step 3 skipped"):
            scope.flush()
    assert scope.writer.skipped_steps == 2 and not scope.writer.failed
    assert len(warnings_of(caplog, "crafted failure")) == 1  # once per kind of failure
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 2, 4]
    assert workload.orphan_steps(tmp_path / "r" / "rank0.sqlite") == {}
    assert list(run.kpis()["step"]) == [0, 1, 2, 3, 4]  # KPIs are their own transactions


# --- 9. another program holds the database's write lock --------------------------------------

def record_through_a_lock(root: Path, monkeypatch: pytest.MonkeyPatch, wait: float,
                          held: float) -> tuple[deepscope.Scope, threading.Thread]:
    """Record steps 0-1, then steps 2-7 while another connection (as another program would)
    holds the database's write lock for `held` s; the writer waits up to `wait` s."""
    monkeypatch.setattr(writer_module, "LOCK_WAIT_SECONDS", wait)
    monkeypatch.setattr(writer_module, "LOCK_PROBE_SECONDS", 0.1)
    scope = deepscope.Scope(root, "r", schedule=1)
    record(scope, range(2))
    scope.flush()
    locked = threading.Event()

    def hold() -> None:
        con = sqlite3.connect(scope.writer.path, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        locked.set()
        time.sleep(held)
        con.execute("ROLLBACK")
        con.close()

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(30)
    record(scope, range(2, 8))
    return scope, thread


def test_a_lock_held_for_a_while_is_waited_for(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="deepscope"):
        scope, thread = record_through_a_lock(tmp_path, monkeypatch, wait=10.0, held=1.5)
        scope.flush()  # returns: every step written once the lock was free
        thread.join()
        scope.close()
    assert not caplog.records
    assert deepscope.open_run(tmp_path / "r").steps() == list(range(8))


def test_a_lock_held_past_the_limit_skips_steps_then_recording_resumes(tmp_path, monkeypatch,
                                                                      caplog):
    with caplog.at_level(logging.WARNING, logger="deepscope"):
        scope, thread = record_through_a_lock(tmp_path, monkeypatch, wait=0.3, held=2.0)
        with pytest.raises(deepscope.RecordingError, match="skipped \\(database locked\\)"):
            scope.flush()
        thread.join()
        record(scope, range(8, 10))
        scope.flush()  # free again: written, nothing new lost
        scope.close()
    assert len(warnings_of(caplog, "held the write lock")) == 1
    assert len(warnings_of(caplog, "free again")) == 1
    assert not scope.writer.failed and scope.writer.skipped_steps >= 1
    steps = deepscope.open_run(tmp_path / "r").steps()
    assert steps[:2] == [0, 1] and steps[-2:] == [8, 9] and len(steps) < 10


# --- 10. StopTraining from on_anomaly --------------------------------------------------------

def test_the_step_that_stops_training_is_committed(tmp_path):
    model = torch.nn.Linear(3, 1)

    def stop(finding: object) -> None:
        raise StopTraining(finding)

    scope = deepscope.Scope(tmp_path, "r", schedule=1, on_anomaly=stop)
    scope.watch(model)
    with pytest.raises(StopTraining):
        for step in range(10):
            with scope.step(step) as rec:
                x = torch.ones(4, 3) * (float("nan") if step == 5 else 1.0)
                loss = model(x).pow(2).mean()
                rec.loss(loss)
                loss.backward()
    scope.close()
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == list(range(6))  # 5, the non-finite step, included
    assert 5 in set(run.kpis()["step"])
    assert 5 in set(run.anomalies()["step"])


# --- 12. a -wal file of another database -----------------------------------------------------

def test_a_wal_file_of_another_run_is_refused(tmp_path):
    with deepscope.Scope(tmp_path, "a", schedule=1) as scope:
        record(scope, range(3))
    other = deepscope.Scope(tmp_path, "b", schedule=1)
    record(other, range(5), value=7.0)
    other.flush()
    wal = tmp_path / "b" / "rank0.sqlite-wal"
    assert wal.stat().st_size > 0
    shutil.copy(wal, tmp_path / "a" / "rank0.sqlite-wal")
    other.close()
    with pytest.raises(deepscope.CorruptRunError, match="reads as another run") as info:
        deepscope.open_run(tmp_path / "a").steps()
    assert "\n" not in str(info.value)
    with pytest.raises(deepscope.CorruptRunError, match="reads as another run"):
        deepscope.Scope(tmp_path, "a", schedule=1, resume=True)
    (tmp_path / "a" / "rank0.sqlite-wal").unlink()  # the fix the message names
    assert deepscope.open_run(tmp_path / "a").steps() == [0, 1, 2]


# --- 17. unchecked arguments -----------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": -1}, "rank must be an integer >= 0"),
    ({"rank": "7x"}, "rank must be an integer >= 0"),
    ({"rank": True}, "rank must be an integer >= 0"),
    ({"queue_size": 0}, "queue_size must be an integer >= 1"),
    ({"queue_size": -5}, "queue_size must be an integer >= 1"),
    ({"max_neurons": -3}, "max_neurons must be an integer >= 0"),
    ({"max_samples": 4097}, "max_samples must be at most 4096"),
])
def test_scope_arguments_are_checked(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        deepscope.Scope(tmp_path, "r", **kwargs)
    assert not (tmp_path / "r").exists()


def test_iterations_past_the_readers_cap_are_refused_at_the_call(tmp_path):
    # A reader refuses a step of more than 10,000 iterations (a crafted file's guard), so the
    # recorder must never write one: the iteration over the cap is refused, the step is kept.
    from deepscope.store.limits import MAX_ITERATIONS
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope, scope.step(0) as rec:
        for _ in range(MAX_ITERATIONS):
            with rec.iteration():
                pass
        with pytest.raises(ValueError, match="at most 10000 iterations"), rec.iteration():
            pass
        rec.tensor("x", torch.ones(2, 3), role="input")
    assert deepscope.open_run(tmp_path / "r").steps() == [0]


def test_tensor_arguments_are_checked_and_the_step_goes_on(tmp_path, caplog):
    sparse = torch.eye(3).to_sparse()
    bad_calls = [
        (TypeError, "batch_dim of tensor 'b' must be an int", dict(batch_dim="0")),
        (TypeError, "batch_dim of tensor 'b' must be an int", dict(batch_dim=0.0)),
        (TypeError, "batch_dim of tensor 'b' must be an int", dict(batch_dim=True)),
        (TypeError, "tensor node must be", dict(node=7)),
    ]
    with caplog.at_level(logging.WARNING, logger="deepscope"), \
            deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        with scope.step(0) as rec:
            for error, message, kwargs in bad_calls:
                with pytest.raises(error, match=message):
                    rec.tensor("b", torch.ones(2, 3), **kwargs)
            for tensor, message in ((torch.empty(2, device="meta"), "meta device"),
                                    (sparse, "to_dense"),
                                    (torch.ones(2, dtype=torch.complex64), "tensor.real")):
                with pytest.raises(ValueError, match=message):
                    rec.tensor("c", tensor)
            rec.tensor("x", torch.ones(2, 3), role="input")
        with pytest.raises(ValueError, match="between 0 and 2\\*\\*63 - 1, got -1"):
            scope.step(-1)
    assert not caplog.records
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0] and set(run.stats_wide()["tensor"]) == {"x"}
    assert run.graph(0)["tensors"][0]["name"] == "x"


def test_a_sparse_activation_is_skipped_with_a_warning(tmp_path, caplog):
    class Sparse(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.to_sparse()

    with caplog.at_level(logging.WARNING, logger="deepscope"), \
            deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        model = scope.watch(Sparse(), activations=True)
        for step in range(2):
            with scope.step(step):
                model(torch.ones(2, 3))
    assert len(warnings_of(caplog, "record tensor.to_dense()")) == 1
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1]
    assert set(run.stats_wide()["tensor"]) == {"model.0"}


# --- 18. the run folder deleted while recording ----------------------------------------------

def test_a_deleted_run_folder_stops_recording_with_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deepscope"):
        scope = deepscope.Scope(tmp_path, "r", schedule=1)
        record(scope, range(2))
        scope.flush()
        shutil.rmtree(tmp_path / "r")
        record(scope, range(2, 6))  # training goes on
        with pytest.raises(deepscope.RecordingError, match="was deleted or replaced"):
            scope.flush()
        with scope.step(6) as rec:
            assert not rec.recording
        scope.close()
    assert len(warnings_of(caplog, "was deleted or replaced")) == 1
    assert not (tmp_path / "r").exists()  # nothing written into a folder nobody sees


def test_float64_beyond_float32_range_is_stored_exactly_without_warnings(tmp_path):
    """Values near 1e300: squares overflow float64 and float32 views saturate; statistics,
    views and samples must still be the exact values (reference: math.fsum / math.hypot in
    Python floats, which do not overflow here)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 7, generator=g, dtype=torch.float64) * 1e300)
    x[0, 0], x[1, 1] = 0.0, 1e-300  # a zero and a tiny value stay what they are
    small = torch.tensor([3e299, -4e299], dtype=torch.float64)  # the small-tensor path
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warnings were the symptom
        scope = deepscope.Scope(tmp_path, "r", schedule=1)
        with scope.step(0) as rec:
            rec.tensor("x", x, role="input")
            rec.tensor("small", small)
        scope.close()
    run = deepscope.open_run(tmp_path / "r")
    for name, t in (("x", x), ("small", small)):
        values = t.reshape(-1).tolist()
        mean = math.fsum(values) / len(values)
        stats = run.stats_wide(name).iloc[0]
        assert stats["mean"] == pytest.approx(mean, rel=1e-12)
        assert stats["norm"] == pytest.approx(math.hypot(*values), rel=1e-12)
        std = math.hypot(*(v - mean for v in values)) / math.sqrt(len(values))
        assert stats["std"] == pytest.approx(std, rel=1e-12)
        assert stats["abs_max"] == max(map(abs, values))
    for j in range(7):  # per neuron over the batch
        column = x[:, j].tolist()
        mean = math.fsum(column) / 5
        assert run.values("x", 0, view="neuron_mean")[j] == pytest.approx(mean, rel=1e-12)
        std = math.hypot(*(v - mean for v in column)) / math.sqrt(5)
        assert run.values("x", 0, view="neuron_std")[j] == pytest.approx(std, rel=1e-12)
    samples = run.values("x", 0, view="samples")
    assert samples.dtype == np.float64 and np.array_equal(samples, x[:4].numpy())
    assert samples[0, 0] == 0.0 and samples[1, 1] == 1e-300


def test_a_complex_parameter_is_skipped_with_a_warning_not_stored_as_its_real_part(
        tmp_path, caplog):
    model = torch.nn.Linear(2, 2)
    model.register_parameter("phase", torch.nn.Parameter(torch.ones(2, dtype=torch.complex64)))
    with caplog.at_level(logging.WARNING, logger="deepscope"), \
            deepscope.Scope(tmp_path, "r", schedule=1, anomalies=False) as scope:
        scope.watch(model)
        for step in range(2):
            with scope.step(step):
                (model(torch.ones(1, 2)).sum() + model.phase.abs().sum()).backward()
    assert len(warnings_of(caplog, "parameter phase: it is complex")) == 1
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == [0, 1]
    assert set(run.stats_wide()["tensor"]) == {"weight", "bias"}
