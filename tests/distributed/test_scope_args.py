"""`Scope(distributed=...)` arguments, and the local values a recorded step gives a rank file
(no process group needed)."""

from __future__ import annotations

import pytest
import torch

from deepscope import Scope
from deepscope.recorder.ranks import local_values
from deepscope.records import TensorInfo


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"distributed": True}, "distributed=True needs an initialised torch.distributed"),
    ({"distributed": "yes"}, "distributed must be 'auto', True or False, got 'yes'"),
    ({"distributed_timeout_s": 0}, "distributed_timeout_s must be a number of seconds > 0"),
])
def test_bad_distributed_arguments_fail_in_one_line(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scope(tmp_path, "r", **kwargs)
    assert not (tmp_path / "r" / "rank0.sqlite").exists()


def test_without_a_process_group_a_scope_records_alone(tmp_path):
    with Scope(tmp_path, "r") as scope:
        assert scope.reducer is None
    import deepscope

    assert "distributed" not in deepscope.open_run(tmp_path / "r").meta()


def info(name, role, shape, batch_dim):
    return TensorInfo(name, role, name, name, list(shape), "float32", batch_dim)


def by_name(values):
    assert all(v.local for v in values)
    return {v.name: v for v in values}


def test_local_loss_is_the_mean_of_every_micro_batchs_samples():
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0, 6.0]])  # 3 + 1 samples
    values = by_name(local_values(7, [(a.mean() / 2, a), (b.mean() / 2, b)], [], 2))
    assert values["BatchSize"].value == 4 and values["BatchSize"].step == 7
    assert values["Loss"].value == pytest.approx((1 + 2 + 3 + 5) / 4)


def test_batch_size_from_the_first_recorded_input_without_per_sample_losses():
    infos = [info("h", "activation", (9, 3), 0), info("x", "input", (2, 5, 8), 1)]
    values = by_name(local_values(0, [(torch.tensor(0.5), None)], infos, 1))
    assert values["BatchSize"].value == 5
    assert values["Loss"].value == 0.5  # one call without per_sample: the loss as passed


def test_what_cannot_be_counted_is_missing_with_the_reason():
    infos = [info("x", "input", (4, 2), 0), info("w", "parameter", (3, 2), None)]
    values = by_name(local_values(1, [(torch.tensor(1.0), None)] * 2, infos, 2))
    assert values["Loss"].value is None and "per_sample" in values["Loss"].meta["reason"]
    assert values["BatchSize"].value is None
    assert "per_sample" in values["BatchSize"].meta["reason"]
    assert local_values(1, [], [], 1) == []
