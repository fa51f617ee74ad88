"""Hugging Face Trainer callback: per-sample losses found without user code for a tiny GPT-2
and a tiny BERT classifier (models from configs, tensors for data), gradient accumulation
as micro-batches, the same quantities as a hand-written loop doing what the Trainer does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import deepscope

STEPS, BATCH, SEQ, VOCAB, CLIP = 3, 4, 8, 40, 1.0
# instruments every 2nd step: step 1 is instrumented only as α's end point of step 0
SCOPE = dict(schedule=2, instruments="economy", instrument_schedule=2)


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


def _gpt2(hf):
    config = hf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf.GPT2LMHeadModel(config)


def _bert(hf):
    config = hf.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32,
                           max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, num_labels=3)
    return hf.BertForSequenceClassification(config)


def _data(task: str, k: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    n = STEPS * k * BATCH
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    if task == "gpt2":  # the last tokens of some sequences are padding: label -100
        labels = ids.clone()
        labels[::3, -3:] = -100
    else:
        labels = torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": y}
            for i, y in zip(ids, labels)]


def _optimizer(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _train(hf, model, tmp_path, run: str, k: int, training: dict | None = None,
           **extra) -> None:
    from deepscope.integrations.transformers import DeepscopeCallback

    class InOrder(hf.Trainer):  # the hand-written loop takes the batches in order too
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = hf.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS,
                                per_device_train_batch_size=BATCH,
                                gradient_accumulation_steps=k, max_grad_norm=CLIP,
                                report_to="none", save_strategy="no", logging_strategy="no",
                                use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                **(training or {}))
    callback = DeepscopeCallback(tmp_path, run, **SCOPE)
    if extra.pop("wrap_loss", False):
        extra["compute_loss_func"] = callback.loss_function(_hand_losses)
    task = "gpt2" if "GPT2" in type(model).__name__ else "bert"
    InOrder(model=model, args=args, train_dataset=_data(task, k),
            optimizers=_optimizer(model), callbacks=[callback], **extra).train()


def _hand_losses(outputs, labels, num_items_in_batch=None):
    """(loss, per-sample losses) as the Trainer backpropagates them, written out by hand:
    GPT-2 divides the sum of its valid token losses by the Trainer's num_items_in_batch;
    BERT takes the mean of each micro-batch (no ÷ k: the model accepts loss kwargs, so the
    Trainer leaves the loss as it is)."""
    logits = outputs.logits
    if logits.dim() == 3:
        tokens = torch.stack([F.cross_entropy(logits[i, :-1].float(), labels[i, 1:],
                                              ignore_index=-100, reduction="none")
                              for i in range(len(labels))])
        return tokens.sum() / num_items_in_batch, tokens
    losses = F.cross_entropy(logits, labels, reduction="none")
    return losses.mean(), losses


def _hand_loop(model, tmp_path, run: str, task: str, k: int) -> None:
    opt, _ = _optimizer(model)
    data = _data(task, k)
    batches = [{key: torch.stack([d[key] for d in data[i:i + BATCH]]) for key in data[0]}
               for i in range(0, len(data), BATCH)]
    model.train()
    with deepscope.Scope(tmp_path, run, **SCOPE) as scope:
        scope.watch(model, optimizer=opt)
        for step in range(STEPS):
            micro = batches[step * k:(step + 1) * k]
            # The Trainer's num_items_in_batch: for a GPT-2 config naming no loss_type,
            # transformers 5.24 counts the unshifted labels (here 55 per step), not the 47
            # tokens the loss predicts; the callback reads that from the loss, we copy it.
            n_items = (sum(int(b["labels"].ne(-100).sum()) for b in micro)
                       if task == "gpt2" else None)
            with scope.step(step) as rec:
                for b in micro:
                    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                    loss, per_sample = _hand_losses(out, b["labels"], n_items)
                    rec.loss(loss, per_sample=per_sample)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()


def _assert_same_run(a_path, b_path, rtol: float) -> None:
    with deepscope.open_run(a_path) as a, deepscope.open_run(b_path) as b:
        qa, qb = a.quantities(), b.quantities()
        assert len(qa) == len(qb) and qa["value"].notna().sum() > 20
        assert qa[["step", "name", "layer"]].equals(qb[["step", "name", "layer"]])
        np.testing.assert_allclose(qa["value"], qb["value"], rtol=rtol, equal_nan=True)
        la, lb = a.kpis("loss"), b.kpis("loss")
        assert la.step.tolist() == list(range(STEPS))
        np.testing.assert_allclose(la.value, lb.value, rtol=rtol)
        assert a.steps() == b.steps() == [0, 2]


@pytest.mark.parametrize("task, k", [
    ("gpt2", 2),
    ("bert", 1),
    ("bert", 2)])
def test_callback_equals_hand_written_loop(hf, tmp_path, task, k):
    torch.manual_seed(0)
    model = _gpt2(hf) if task == "gpt2" else _bert(hf)
    hand = copy.deepcopy(model)
    _train(hf, model, tmp_path, "trainer", k)
    _hand_loop(hand, tmp_path, "hand", task, k)
    _assert_same_run(tmp_path / "trainer", tmp_path / "hand", rtol=1e-5)
    if task == "gpt2":
        with deepscope.open_run(tmp_path / "trainer") as run:
            tokens = run.kpis("tokens").value.tolist()
        labels = torch.stack([d["labels"] for d in _data(task, k)])[:, 1:]
        per_step = labels.ne(-100).sum(1).reshape(STEPS, k * BATCH).sum(1)
        assert tokens == per_step.tolist() == [47, 47, 50]  # predicted tokens, shifted


def test_activation_checkpointing_changes_nothing(hf, tmp_path):
    """The Trainer's activation checkpointing with reentrant checkpoints: each GPT-2 block's
    gradients arrive in a backward pass of its own (GradNorm and the gradient tests were
    silently wrong before 2026-12-02); the values are the hand-written loop's without it."""
    torch.manual_seed(0)
    model = _gpt2(hf)
    hand = copy.deepcopy(model)
    _train(hf, model, tmp_path, "trainer", 2, training=dict(
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": True}))
    _hand_loop(hand, tmp_path, "hand", "gpt2", 2)
    _assert_same_run(tmp_path / "trainer", tmp_path / "hand", rtol=1e-5)


def test_explicit_loss_function(hf, tmp_path):
    torch.manual_seed(0)
    model = _bert(hf)
    hand = copy.deepcopy(model)
    _train(hf, model, tmp_path, "wrapped", 1, wrap_loss=True)
    _hand_loop(hand, tmp_path, "hand", "bert", 1)
    _assert_same_run(tmp_path / "wrapped", tmp_path / "hand", rtol=1e-5)


def test_unknown_model_names_the_loss_function(hf, tmp_path):
    from deepscope.integrations.transformers import per_sample_losses
    model = hf.BertForMaskedLM(hf.BertConfig(vocab_size=VOCAB, hidden_size=16,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32))
    assert per_sample_losses(model, torch.zeros(2, 3, VOCAB), torch.zeros(2, 3)) is None


def test_close_with_the_error_marks_the_run_interrupted(hf, tmp_path):
    from deepscope.integrations import INTERRUPTED
    from deepscope.integrations.transformers import DeepscopeCallback
    calls = []

    def failing(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in the loss")
        return _hand_losses(outputs, labels)

    torch.manual_seed(0)
    model = _bert(hf)
    callback = DeepscopeCallback(tmp_path, "crash", **SCOPE)
    args = hf.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS,
                                per_device_train_batch_size=BATCH, report_to="none",
                                save_strategy="no", logging_strategy="no", use_cpu=True,
                                disable_tqdm=True)
    trainer = hf.Trainer(model=model, args=args, train_dataset=_data("bert", 1),
                         optimizers=_optimizer(model), callbacks=[callback],
                         compute_loss_func=callback.loss_function(failing))
    try:
        trainer.train()
    except RuntimeError as error:
        callback.close(error)
    with deepscope.open_run(tmp_path / "crash") as run:
        assert run.notes().text.tolist() == [f"{INTERRUPTED}: RuntimeError: boom in the loss"]
        assert run.status() == f"{INTERRUPTED}: RuntimeError: boom in the loss"
        assert run.kpis("loss").step.tolist() == [0, 1]
        assert run.steps() == [0]
