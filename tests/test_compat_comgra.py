"""The comgra minimal example from the seed runs with only its import lines changed."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.optim as optim

import deepscope
import deepscope.compat.comgra as comgra
from deepscope.compat.comgra.objects import (
    DecisionMakerForRecordingsFrequencyPerType,
    DecisionMakerForRecordingsHardcoded,
)
from deepscope.compat.comgra.recorder import ComgraRecorder
from tests.helpers import edges


def run_seed_example(root: str) -> None:
    # ---- the seed's code, verbatim but for the imports above and the path ----
    class SimpleModel(nn.Module):
        def __init__(self):
            super(SimpleModel, self).__init__()  # noqa: UP008 - seed code kept verbatim
            self.layer0 = nn.Linear(5, 5)
            self.layer1 = nn.Linear(5, 5)

        def forward(self, x):
            x = self.layer0(x)
            return self.layer1(x)

    comgra.my_recorder = ComgraRecorder(
        comgra_root_path=root,
        group="name_of_experiment_group",
        trial_id="example_trial",
        decision_maker_for_recordings=DecisionMakerForRecordingsFrequencyPerType(
            min_training_steps_difference=10),
    )
    comgra.my_recorder.add_note("This is an optional log message that will show up in the "
                                "'Notes' tab.")
    model = SimpleModel()
    criterion = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    comgra.my_recorder.track_module("main_model", model)
    inputs = torch.randn(100, 5)
    targets = 2 * inputs + torch.randn(100, 5) * 0.1
    num_epochs = 100
    for epoch in range(num_epochs):
        comgra.my_recorder.start_batch(epoch, inputs.shape[0])
        comgra.my_recorder.start_iteration()
        comgra.my_recorder.register_tensor("inputs", inputs, is_input=True)
        outputs = model(inputs)
        comgra.my_recorder.register_tensor("outputs", outputs)
        comgra.my_recorder.register_tensor("targets", targets, is_target=True)
        loss = criterion(outputs, targets)
        comgra.my_recorder.register_tensor("loss", loss, is_loss=True)
        comgra.my_recorder.record_kpi_in_graph("loss", "", loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        comgra.my_recorder.record_current_gradients("gradients")
        comgra.my_recorder.finish_iteration()
        comgra.my_recorder.finish_batch()
    comgra.my_recorder.finalize()


def test_seed_minimal_example(tmp_path):
    run_seed_example(str(tmp_path))
    run = deepscope.open_run(tmp_path / "name_of_experiment_group" / "example_trial")
    assert run.steps() == list(range(0, 100, 10))
    assert len(run.kpis("loss")) == 100
    assert run.notes()["text"].str.contains("Notes").all()
    g = run.graph(90)
    assert edges(g) == {
        ("inputs", "outputs"), ("main_model.layer0.weight", "outputs"),
        ("main_model.layer0.bias", "outputs"), ("main_model.layer1.weight", "outputs"),
        ("main_model.layer1.bias", "outputs"), ("outputs", "loss"), ("targets", "loss"),
    }
    nodes = {n["id"] for n in g["nodes"]}
    assert {"main_model.layer0", "main_model.layer1", "inputs", "loss"} <= nodes
    assert "grad:gradients" in set(run.stats("main_model.layer0.weight")["direction"])
    # loss falls: the run trained normally
    k = run.kpis("loss")["value"].to_numpy()
    assert k[-1] < k[0]


def test_dynamic_recording_decided_at_end(tmp_path):
    rec = ComgraRecorder(tmp_path, "g", "t",
                         decision_maker_for_recordings=DecisionMakerForRecordingsHardcoded([2]))
    lin = nn.Linear(2, 1)
    rec.track_module("m", lin)
    for step in range(4):
        rec.start_batch(step, 3, type_of_execution=None)
        rec.start_iteration()
        out = lin(torch.randn(3, 2))
        rec.register_tensor("out", out)
        out.sum().backward()
        rec.finish_iteration()
        rec.decide_recording_of_batch("late_type")
        rec.finish_batch()
    rec.finalize()
    run = deepscope.open_run(tmp_path / "g" / "t")
    assert run.steps() == [2] and run.kinds() == ["late_type"]


def test_inactive_recorder_is_a_no_op(tmp_path):
    rec = ComgraRecorder(tmp_path, "g", "t", comgra_is_active=False)
    rec.start_batch(0, 1)
    rec.register_tensor("x", torch.ones(1))
    rec.finish_batch()
    rec.finalize()
    assert not (tmp_path / "g").exists()
