"""The recorder's private copies (`BufferPool`): exact, detached, contiguous, reused, and
taken together in one batched copy for a list of tensors of any dtypes, layouts and shapes."""

from __future__ import annotations

import torch

from deepscope.recorder.buffers import BufferPool


def test_copies_of_mixed_tensors_are_exact_private_and_detached():
    pool = BufferPool()
    w = torch.randn(3, 4, requires_grad=True)
    tensors = [w, w * 2, torch.arange(6).reshape(2, 3).t(), torch.ones(1).expand(5),
               torch.randn(2, dtype=torch.bfloat16), torch.tensor(True)]
    copies = pool.copy_all(tensors)
    for t, c in zip(tensors, copies):
        assert torch.equal(c, t.detach()) and c.dtype == t.dtype and c.shape == t.shape
        assert c.is_contiguous() and not c.requires_grad and c.grad_fn is None
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    with torch.no_grad():
        w.add_(1)  # the user's in-place change after the copy does not reach it
    assert torch.equal(copies[0] + 1, w.detach())
    assert pool.copy_all([]) == []


def test_released_buffers_are_reused_by_the_next_copy():
    pool = BufferPool()
    first = pool.copy_all([torch.zeros(4, 5), torch.zeros(3)])
    pool.release(first)
    again = pool.copy_all([torch.ones(3), torch.ones(4, 5)])
    assert {id(t) for t in again} == {id(t) for t in first}
    assert torch.equal(again[0], torch.ones(3)) and torch.equal(again[1], torch.ones(4, 5))
    assert torch.equal(pool.copy(torch.full((2,), 7.0)), torch.full((2,), 7.0))


def test_a_single_copy_is_exact_private_and_detached():
    pool = BufferPool()
    w = torch.randn(3, 4, requires_grad=True)
    c = pool.copy(w * 2)
    assert torch.equal(c, (w * 2).detach()) and not c.requires_grad and c.grad_fn is None
    assert c.is_contiguous() and c.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    pool.release([c])
    assert pool.copy(torch.ones(3, 4)) is c  # reused


def test_gradients_nobody_else_holds_are_kept_without_a_copy(tmp_path, monkeypatch):
    """After backward, the activation and loss gradients autograd made are the recorder's
    alone: kept as they are (a stray reference held while they are snapshotted, e.g. by the
    loss-scale check, made each step copy the loss's gradient)."""
    from torch import nn

    import deepscope
    from deepscope.recorder.step import StepRecorder

    copied: list[tuple[str, str]] = []
    record = StepRecorder._record_values

    def watched(self, records):
        copied.extend((r[0], r[1]) for r in records if r[1] != "forward")
        return record(self, records)

    monkeypatch.setattr(StepRecorder, "_record_values", watched)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1)) as scope:
        scope.watch(model, optimizer=opt)
        for step in range(2):
            with scope.step(step) as rec:
                h = model[0](torch.randn(3, 4))
                rec.tensor("h", h)
                losses = model[2](model[1](h)).pow(2).sum(1)
                loss = losses.mean()
                rec.loss(loss, per_sample=losses)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert copied == []  # h's, the loss's and the per-sample losses' gradients kept
