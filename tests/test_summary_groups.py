"""Steps summarised together (the writer's groups of queued steps): each step's summary is
bitwise the one it gets alone; the writer waits briefly for a group, never past a flush or
for ever."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import deepscope
from deepscope.recorder import fast
from deepscope.recorder.summary import Capture, StepCaptures, SummarySettings, summarise_steps
from deepscope.store import writer as writer_module
from tests.test_stats_fast import _random_mix

PLAIN = SummarySettings(3, 5, False, True)


def mlp_step(seed: int, bad: bool = False) -> list[tuple[torch.Tensor, int | None, bool]]:
    """(tensor, batch_dim, is_parameter) of an MLP-like step; `bad`: a NaN in an activation
    and an Inf in a gradient."""
    gen = torch.Generator().manual_seed(seed)
    out = [(torch.randn(16, 32, generator=gen), 0, False),
           (torch.randn(64, 32, generator=gen), None, True),
           (torch.randn(64, generator=gen), None, True),
           (torch.randn(16, 64, generator=gen).relu(), 0, False),
           (torch.randn(16, 64, generator=gen), 0, False),
           (torch.randn(64, 32, generator=gen) * 1e-3, None, True),
           (torch.randn(2, 16, 8, generator=gen), 1, False)]
    if bad:
        out[3][0][2, 5] = float("nan")
        out[5][0][0, 0] = float("inf")
    return out


def random_step(seed: int) -> list[tuple[torch.Tensor, int | None, bool]]:
    """Every kind of tensor (float16/32/64, wide, ints, bools, empty, non-finite)."""
    mix = _random_mix(seed) + [(torch.randn(5, 7).half(), 0), (torch.randn(300).bfloat16(), None)]
    return [(x, bd, x.dim() == 2 and k % 3 == 0) for k, (x, bd) in enumerate(mix)]


def jobs(steps: list[list[tuple[torch.Tensor, int | None, bool]]], settings: SummarySettings,
         released: list | None = None) -> list[StepCaptures]:
    """Fresh captures of the steps (copies: nothing shared between calls)."""
    out = []
    for tensors in steps:
        caps = [Capture(f"t{k}", "forward", 0, x.clone(), bd, param)
                for k, (x, bd, param) in enumerate(tensors)]
        caps.append(Capture("again", "grad", 0, caps[0].tensor, caps[0].batch_dim, False))
        out.append(StepCaptures(caps, settings, None if released is None else released.extend))
    return out


def assert_bitwise(got, want) -> None:
    assert got.keys == want.keys
    assert got.stats.tobytes() == want.stats.tobytes()
    assert got.arrays == want.arrays
    assert got.parts == want.parts and got.compress == want.compress


@pytest.mark.parametrize("transfer", [False, True], ids=["in place", "transfer"])
@pytest.mark.parametrize("case", ["one layout, bad step inside", "mixed layouts and dtypes",
                                  "singular values, bfloat16 views"])
def test_a_group_summary_equals_each_steps_own(case, transfer, monkeypatch):
    if transfer:  # the CUDA way to the host, forced on the CPU
        monkeypatch.setattr(fast, "_HOST", ())
    settings = PLAIN
    if case == "one layout, bad step inside":
        steps = [mlp_step(0), mlp_step(1), mlp_step(2, bad=True), mlp_step(3)]
    elif case == "mixed layouts and dtypes":
        steps = [random_step(0), mlp_step(4), random_step(1), random_step(2, )]
    else:
        steps = [mlp_step(5), mlp_step(6, bad=True), random_step(3)]
        settings = SummarySettings(2, 64, True, False)
    released: list = []
    together = summarise_steps(jobs(steps, settings, released))
    alone = [summarise_steps(jobs([s], settings))[0] for s in steps]
    assert len(together) == len(steps)
    for got, want in zip(together, alone):
        assert_bitwise(got, want)
    assert len(released) == sum(len(s) for s in steps)  # each tensor once ("again" shares)
    bad = np.isnan(together[2 if len(steps) == 4 else 1].stats[:, 0]).any() or \
        together[2 if len(steps) == 4 else 1].stats[:, -3:].any()
    assert bad  # the non-finite step's counts say so (general path)


def test_steps_of_other_settings_do_not_join_a_group():
    a, b = jobs([mlp_step(0)], PLAIN)[0], jobs([mlp_step(0)], SummarySettings(2, 5, False, True))[0]
    assert a.key != b.key
    with pytest.raises(ValueError, match="settings differ"):
        summarise_steps([a, b])


def record(scope: deepscope.Scope, steps: range) -> None:
    for step in steps:
        with scope.step(step) as rec:
            rec.tensor("x", torch.full((4, 3), float(step)), role="input")


def test_the_writer_groups_steps_and_each_reads_back_as_recorded(tmp_path, monkeypatch):
    sizes: list[int] = []

    def counted(steps: list[StepCaptures]) -> list:
        sizes.append(len(steps))
        return summarise_steps(steps)

    monkeypatch.setattr(StepCaptures, "together", staticmethod(counted))
    monkeypatch.setattr(writer_module, "GROUP_WAIT", 60.0)  # ends by the group's size
    monkeypatch.setattr(writer_module, "GROUP_STEPS", 3)
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(6))
        scope.flush()
    assert sizes and max(sizes) >= 3  # (more when queued before the writer woke)
    run = deepscope.open_run(tmp_path / "r")
    assert run.steps() == list(range(6))
    for step in range(6):
        np.testing.assert_array_equal(run.values("x", step, view="samples"),
                                      np.full((4, 3), float(step), np.float32))


def test_a_flush_does_not_wait_for_a_group_to_fill(tmp_path, monkeypatch):
    """One step queued, the writer waiting up to 10 minutes for more: flush() ends the wait."""
    monkeypatch.setattr(writer_module, "GROUP_WAIT", 600.0)
    monkeypatch.setattr(writer_module, "GROUP_STEPS", 8)
    scope = deepscope.Scope(tmp_path, "r", schedule=1)
    scope.flush()
    record(scope, range(1))
    flushed = threading.Thread(target=scope.flush, daemon=True)
    flushed.start()
    flushed.join(120)
    alive = flushed.is_alive()
    monkeypatch.setattr(writer_module, "GROUP_WAIT", 0.0)
    scope.close()
    assert not alive
    assert deepscope.open_run(tmp_path / "r").steps() == [0]


def test_the_group_wait_never_holds_a_step(tmp_path, monkeypatch):
    """Nothing flushes, no more steps come: the step is committed once the wait is over."""
    monkeypatch.setattr(writer_module, "GROUP_WAIT", 0.2)
    monkeypatch.setattr(writer_module, "GROUP_STEPS", 8)
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        record(scope, range(1))
        deadline = time.monotonic() + 120
        while scope.writer.committed_steps < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scope.writer.committed_steps == 1
