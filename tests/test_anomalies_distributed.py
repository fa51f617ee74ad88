"""`HealthMonitor(distributed=True)`: `record_next` follows only evidence every rank of a DDP
job has alike (the synced gradients on steps every rank checks, shared detectors'
findings); a finding on the rank's own loss is reported but sets no recording."""

from __future__ import annotations

import torch
from torch import nn

from deepscope.anomalies import GradientNorm, HealthMonitor, LossSpike


def _step(monitor: HealthMonitor, model: nn.Module, step: int, *, told: float = 1.0,
          grad: float = 1.0, scale: float = 1.0) -> tuple[list, int]:
    """One step: the loss told to the monitor is the trained loss × `told`; the gradient
    is multiplied by `grad` (NaN: a non-finite synced gradient) and `scale`."""
    monitor.start(step, "train")
    loss = model(torch.ones(2, 3)).square().mean()
    monitor.loss(loss.detach() * told)
    model.zero_grad()
    (loss * grad * scale).backward()
    return monitor.finish(step)


def test_record_next_follows_shared_evidence_only():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    monitor = HealthMonitor(model, detectors=[LossSpike(min_history=2)], trace=False,
                            distributed=True)
    for step in range(3):
        assert _step(monitor, model, step) == ([], 0)
    # the rank's own loss only: reported, not followed
    findings, record_next = _step(monitor, model, 3, told=float("nan"))
    assert [f.detector for f in findings] == ["nonfinite"] and record_next == 0
    findings, record_next = _step(monitor, model, 4, told=1e6)  # loss_spike: not shared
    assert [f.detector for f in findings] == ["loss_spike"] and record_next == 0
    # a non-finite synced gradient: followed once per episode
    assert _step(monitor, model, 5, grad=float("nan"))[1] == 3
    assert _step(monitor, model, 6, grad=float("nan"))[1] == 0
    assert _step(monitor, model, 7)[1] == 0
    assert _step(monitor, model, 8, grad=float("nan"))[1] == 3
    monitor.close()
    # the same own-loss finding without distributed sets record_next, as before
    single = HealthMonitor(model, detectors=[], trace=False)
    assert _step(single, model, 0, told=float("nan"))[1] == 3
    single.close()


def test_a_shared_detector_sets_record_next():
    assert GradientNorm.shared and not LossSpike.shared
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    monitor = HealthMonitor(model, detectors=[GradientNorm()], detector_every=1, trace=False,
                            distributed=True)
    for step in range(12):
        assert _step(monitor, model, step)[1] == 0
    findings, record_next = _step(monitor, model, 12, scale=1e4)
    assert {f.detector for f in findings} == {"exploding_gradient"} and record_next == 3
    monitor.close()
