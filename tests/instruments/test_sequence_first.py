"""Sequence-first models (batch_first=False): the batch is dim 1 of their activations.

nn.MultiheadAttention and the RNNs know their batch dim; a Linear or LayerNorm of the
user's applied to their (T, B, …) output does not. With T ≠ B its per-sample values are
missing (dim 0 is not the batch size); with T == B they used to be computed over the
sequence positions as if they were samples (a silently wrong NormTest and histogram): they
are missing with the reason. Modules whose dim 1 is channels (a Conv1d with B channels)
keep their values. The layers inside PyTorch's sequence-first transformers are known to
be (T, B, …): exact, whatever T is (they were missing, or wrong at T == B). Checked
against the float64 per-sample loop.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

import deepscope
from tests.instruments import reference as R

B = 4  # == T: the ambiguous case


class _SeqFirst(nn.Module):
    """x (B, B channels, L=B) -> Conv1d -> (T=L, B, E) -> seq-first core -> Linear head."""

    def __init__(self, core: str) -> None:
        super().__init__()
        self.conv = nn.Conv1d(B, 6, 1)
        self.core = (nn.MultiheadAttention(6, 2) if core == "mha" else nn.LSTM(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).permute(2, 0, 1)  # (T, B, E)
        h = self.core(h, h, h)[0] if isinstance(self.core, nn.MultiheadAttention) \
            else self.core(h)[0]
        return self.head(h).transpose(0, 1)  # (B, T, 2)


def _losses(model: nn.Module, x: Tensor) -> Tensor:
    return (model(x) - 0.5).square().flatten(1).mean(1)


@pytest.mark.parametrize("core", ["mha", "lstm"])
def test_sequence_as_long_as_the_batch_is_missing_not_wrong(tmp_path, core) -> None:
    torch.manual_seed(0)
    model = _SeqFirst(core)
    x = torch.randn(B, B, B)
    ref = R.batch_reference(copy.deepcopy(model).double(), lambda m: _losses(m, x.double()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1),
                         instruments=["NormTest", "GradHist1d"]) as scope:
        scope.watch(model, optimizer=opt)
        with pytest.warns(UserWarning, match="sequence-first"), scope.step(0) as rec:
            losses = _losses(model, x)
            rec.loss(losses.mean(), per_sample=losses)
            losses.mean().backward()
    q = deepscope.open_run(tmp_path / "r").quantities()
    q = q[q["name"] == "NormTest"].set_index("layer")
    for layer in ("head.weight", "head.bias", ""):
        assert math.isnan(q.loc[layer, "value"])
        assert "batch_first=True" in q.loc[layer, "meta"]["reason"]
    checked = [n for n in ref.names if not n.startswith("head.")]
    assert len(checked) >= 4
    for name in checked:  # the conv (channels at dim 1) and the seq-first core stay exact
        want = R.norm_test(ref.grads[name])
        assert math.isclose(q.loc[name, "value"], want, rel_tol=1e-4), name


def _record(tmp_path, model: nn.Module, x: Tensor, losses) -> tuple:
    ref = R.batch_reference(copy.deepcopy(model).double(), lambda m: losses(m, x.double()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with deepscope.Scope(tmp_path, "r", schedule=deepscope.every(1),
                         instruments=["NormTest"]) as scope:
        scope.watch(model, optimizer=opt)
        with scope.step(0) as rec:
            per_sample = losses(model, x)
            rec.loss(per_sample.mean(), per_sample=per_sample)
            per_sample.mean().backward()
    q = deepscope.open_run(tmp_path / "r").quantities()
    return ref, q[q["name"] == "NormTest"].set_index("layer")


@pytest.mark.parametrize("length", [3, B])
def test_layers_inside_a_sequence_first_transformer_are_exact(tmp_path, length) -> None:
    torch.manual_seed(0)
    # float64: its float32 backward through two LayerNorms is only good to ~1e-3 here
    model = nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0).double()  # batch_first=False

    def losses(m: nn.Module, x: Tensor) -> Tensor:
        return (m(x) - 0.5).square().mean((0, 2))

    ref, q = _record(tmp_path, model, torch.randn(length, B, 6, dtype=torch.float64), losses)
    assert {"linear1.weight", "norm2.bias"} <= set(ref.names)
    for name in ref.names:
        want = R.norm_test(ref.grads[name])
        assert math.isclose(q.loc[name, "value"], want, rel_tol=1e-4), (name, q.loc[name])
