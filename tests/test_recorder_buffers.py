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


def test_cpu_pool_keeps_as_many_buffers_per_shape_as_were_out_at_once():
    # Regression: the pool kept at most 4 per shape, so a step with more tensors of one shape
    # (activations and their gradients) allocated afresh every step (page faults on the CPU).
    pool = BufferPool()
    xs = [torch.full((3, 2), float(i)) for i in range(10)]
    first = pool.copy_all(xs)
    pool.release(first)
    again = pool.copy_all(xs[::-1])
    assert {id(t) for t in again} == {id(t) for t in first}  # all 10 reused, none new
    assert all(torch.equal(c, x) for c, x in zip(again, xs[::-1]))
    pool.release(again)
    # never more than were out at once: one more released buffer of that shape is dropped
    pool.release([torch.empty(3, 2)])
    assert len(pool._free[((3, 2), torch.float32, torch.device("cpu"))]) == 10


def test_pool_forgets_shapes_it_does_not_keep(monkeypatch):
    monkeypatch.setattr("deepscope.recorder.buffers._MAX_KEYS", 2)
    pool = BufferPool()
    for n in range(1, 50):  # a new shape every step: the pool's bookkeeping stays bounded
        pool.release(pool.copy_all([torch.zeros(n), torch.zeros(n)]))
    assert len(pool._free) == 2 and len(pool._lent) == 2 and len(pool._peak) == 2
