"""Watched activations of sequence modules are split per sample along their batch dim.

PyTorch's RNNs, MultiheadAttention and transformers with batch_first=False put the batch at
dim 1 (T, B, …), and an RNN's states are (layers·directions, B, H) either way; their
per-sample views used to be taken along dim 0 (time steps or layers as "samples"). Checked
against the tensors cloned in the loop, forward and backward, with T ≠ B.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import deepscope

T, B, E = 3, 5, 6


class _Seq(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.lstm = nn.LSTM(4, E, batch_first=batch_first)
        self.att = nn.MultiheadAttention(E, 2, batch_first=batch_first)
        self.enc = nn.TransformerEncoderLayer(E, 2, 8, dropout=0.0, batch_first=batch_first)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(x)
        h = self.att(h, h, h)[0]
        return self.enc(h).mean(1 if self.batch_first else 0)


@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_modules_samples_along_their_batch_dim(tmp_path, batch_first) -> None:
    torch.manual_seed(0)
    model = _Seq(batch_first)
    x = torch.randn(B, T, 4) if batch_first else torch.randn(T, B, 4)
    # name -> (tensor, its batch dim): the expected layouts
    want_dims = {"lstm.0": 0 if batch_first else 1, "lstm.1.0": 1, "lstm.1.1": 1,
                 "att.0": 0 if batch_first else 1, "att.1": 0,
                 "enc.linear1": 0 if batch_first else 1, "enc": 0 if batch_first else 1}
    seen: dict[str, Tensor] = {}

    def keep(name: str, value: Tensor) -> None:
        seen[name] = value
        if value.requires_grad:
            value.register_hook(lambda g: seen.__setitem__(name + ":grad", g.clone()))

    def lstm(m, i, o) -> None:
        keep("lstm.0", o[0]), keep("lstm.1.0", o[1][0]), keep("lstm.1.1", o[1][1])

    def att(m, i, o) -> None:
        keep("att.0", o[0]), keep("att.1", o[1])

    hooks = [model.lstm.register_forward_hook(lstm), model.att.register_forward_hook(att),
             model.enc.linear1.register_forward_hook(lambda m, i, o: keep("enc.linear1", o)),
             model.enc.register_forward_hook(lambda m, i, o: keep("enc", o))]
    with deepscope.Scope(tmp_path, "r") as scope:
        scope.watch(model, activations=True)
        with scope.step(0) as rec:
            out = model(x)
            states = seen["lstm.1.0"] * seen["lstm.1.1"]  # (1, B, E): h_n, c_n get gradients
            losses = (out ** 2).mean(1) + states.mean((0, 2))
            rec.loss(losses.mean(), per_sample=losses)
            losses.mean().backward()
    for h in hooks:
        h.remove()
    run = deepscope.open_run(tmp_path / "r")
    dims = dict(zip(run.tensors()["name"], run.tensors()["batch_dim"]))
    for name, dim in want_dims.items():
        assert dims[name] == dim, (name, dims[name])
        checks = [("forward", seen[name])]
        if name != "att.1":  # the attention weights get no gradient here
            checks.append(("grad", seen[name + ":grad"]))
        for direction, value in checks:
            want = value.detach().movedim(dim, 0).flatten(1).abs().amax(1).double().numpy()
            got = run.samples(name, 0, view="sample_abs_max", direction=direction)
            got = got["value"].to_numpy()
            assert got.shape == (B,), (name, direction, got.shape)
            # stored as bfloat16: 3 significant digits
            np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=f"{name} {direction}")
