"""Hugging Face GPT-2 and BERT (tiny stock configs, random init, nothing downloaded): the
position embedding is called on position ids of shape (1, T) broadcast over the batch, and
still gets exact per-sample gradients; totals are never NaN without a reason."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from deepscope.instruments import Instruments
from deepscope.instruments.engine import PerSampleEngine

from . import reference as R
from .test_suite import assert_close, check_layers

transformers = pytest.importorskip("transformers")
F64 = torch.float64
B, T, VOCAB = 3, 5, 20


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).to(F64)


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    return transformers.BertForSequenceClassification(config).to(F64)


def batch(step: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(1, VOCAB, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, -2:] = 0  # padding
    return ids, mask, torch.randint(0, 3, (B,), generator=gen)


def per_sample_losses(model: nn.Module, step: int = 0) -> Tensor:
    """(B, T - 1) next-token losses for GPT-2, (B,) classification losses for BERT."""
    ids, mask, labels = batch(step)
    if isinstance(model, transformers.GPT2LMHeadModel):
        logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                               reduction="none").view(B, T - 1)
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels,
                           reduction="none")


def per_sample_mean(model: nn.Module, step: int = 0) -> Tensor:
    losses = per_sample_losses(model, step)
    return losses.mean(1) if losses.dim() == 2 else losses


class Values:
    def __init__(self) -> None:
        self.values: dict = {}

    def value(self, name: str, step: int, layer: str = ""):
        return self.values[(name, step, layer)]


def train(model: nn.Module, losses_of, reference_losses, quantities: list[str],
          steps: int = 2) -> tuple[Values, list[R.BatchRef]]:
    """SGD steps with the instruments; the per-sample reference of each step's batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inst = Instruments(model, quantities, optimizer=opt)
    run, refs = Values(), []
    for step in range(steps):
        refs.append(R.batch_reference(model, lambda m, s=step: reference_losses(m, s)))
        inst.start(step, "train")
        losses = losses_of(model, step)
        inst.loss(losses.mean(), per_sample=losses)
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
        run.values.update({(v.name, v.step, v.layer): v for v in inst.finish()})
    return run, refs


POSITION = {"gpt2": "transformer.wpe.weight", "bert": "bert.embeddings.position_embeddings.weight"}
MODELS = {"gpt2": gpt2, "bert": bert}


@pytest.mark.parametrize("name", list(MODELS))
def test_broadcast_position_embedding_gets_exact_per_sample_gradients(name: str) -> None:
    model = MODELS[name]()
    ref = R.batch_reference(model, per_sample_mean)
    engine = PerSampleEngine(model)
    engine.start()
    losses = per_sample_losses(model)
    engine.add_loss(losses.mean(), B, losses, 1 / losses.numel())
    losses.mean().backward()
    engine.stop()
    assert engine.batch_size == B
    grads = dict(engine.per_sample_grads())
    assert engine.unavailable == {}, engine.unavailable
    assert POSITION[name] in grads
    for pname, want in ref.grads.items():
        got = grads[pname].reshape(B, -1).detach().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-10, err_msg=pname)
    norms = engine.sq_norms()
    for pname, want in ref.grads.items():
        np.testing.assert_allclose(norms[pname].numpy(), (want**2).sum(1), rtol=1e-7,
                                   atol=1e-12, err_msg=pname)


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_quantities_are_exact_and_finite(name: str) -> None:
    model = MODELS[name]()
    quantities = ["Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest",
                  "Alpha", "GradHist1d"]
    run, refs = train(model, per_sample_losses, per_sample_mean, quantities)
    values = run.values
    for t, ref in enumerate(refs):
        assert_close(run.value("Loss", t), float(ref.losses.mean()), rtol=1e-12)
        check_layers(run, "GradNorm", t, R.per_layer(R.grad_norm, ref), rtol=1e-7)
        # the attention key bias's gradient is zero up to round-off: its ratios are noise
        signal = {layer: value for layer, value in R.per_layer(R.norm_test, ref).items()
                  if R.grad_norm(ref.layers()[layer]) > 1e-10}
        check_layers(run, "NormTest", t, signal, rtol=1e-7)
    alpha = run.value("Alpha", 0)
    assert alpha.value is not None and math.isfinite(alpha.value), alpha.meta
    assert "reason" not in alpha.meta
    for v in values.values():
        if v.array is None:
            assert v.value is not None and math.isfinite(v.value), v


class MulBroadcast(nn.Module):
    """A (1, T) position embedding *multiplied* into the batch: no per-sample split."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, 4), nn.Embedding(T, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) * self.pos(torch.arange(T)[None])
        return self.head(torch.tanh(h).mean(1))


def test_unavailable_layers_leave_totals_honest() -> None:
    torch.manual_seed(0)
    model = MulBroadcast().to(F64)
    ids, _, labels = batch(0)

    def losses_of(m: nn.Module) -> Tensor:
        return F.cross_entropy(m(ids), labels, reduction="none")

    run, (ref, _) = train(model, lambda m, step: losses_of(m), lambda m, step: losses_of(m),
                          ["Loss", "GradNorm", "NormTest", "Alpha", "UpdateSize"])
    # ḡ needs no per-sample gradients: exact in every layer and in total
    check_layers(run, "GradNorm", 0, R.per_layer(R.grad_norm, ref), rtol=1e-9)
    layer = run.value("NormTest", 0, "pos.weight")
    assert layer.value is None and "MulBackward0" in layer.meta["reason"]
    total = run.value("NormTest", 0)
    assert total.value is None and "pos.weight" in total.meta["reason"]
    assert "MulBackward0" in total.meta["reason"]
    assert_close(run.value("NormTest", 0, "tok.weight"), R.norm_test(ref.grads["tok.weight"]))
    alpha = run.value("Alpha", 0)
    assert alpha.value is None and "pos.weight" in alpha.meta["reason"]
    assert "non-finite" not in alpha.meta["reason"]
    assert run.value("UpdateSize", 0).value > 0 and run.value("Loss", 0).value > 0


class Wave(nn.Module):
    """A custom module (the generic rule) with a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x * self.freq)


class Broadcasts(nn.Module):
    """Batch-size-1 outputs of an Embedding, a Linear and a generic module, added to and
    subtracted (with alpha) from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, 4), nn.Embedding(T, 4)
        self.ctx, self.wave, self.head = nn.Linear(3, 4), Wave(), nn.Linear(4, 3)
        self.register_buffer("c", torch.randn(1, 1, 3))
        self.register_buffer("grid", torch.randn(1, T, 4))

    def forward(self, ids: Tensor) -> Tensor:
        h = self.pos(torch.arange(T)[None]) + self.tok(ids)
        h = torch.sub(h, self.ctx(self.c), alpha=2.0)
        h = self.wave(self.grid) - torch.tanh(h)
        return self.head(h.mean(1))


def test_batch_size_one_outputs_added_or_subtracted_are_split_per_sample() -> None:
    torch.manual_seed(0)
    model = Broadcasts().to(F64)
    ids, _, labels = batch(0)
    ref = R.batch_reference(model, lambda m: F.cross_entropy(m(ids), labels, reduction="none"))
    engine = PerSampleEngine(model)
    engine.start()
    losses = F.cross_entropy(model(ids), labels, reduction="none")
    engine.add_loss(losses.sum(), 1.0, losses, 1.0)
    losses.sum().backward()
    engine.stop()
    grads = dict(engine.per_sample_grads())
    assert engine.unavailable == {} and engine.warnings == []
    for pname, want in ref.grads.items():
        np.testing.assert_allclose(grads[pname].reshape(B, -1).detach().numpy(), want,
                                   rtol=1e-7, atol=1e-12, err_msg=pname)
