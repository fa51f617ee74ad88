"""The zoo's models: small configurations of networks people train, built on the CPU.

Each case gives a model builder, a batch for every (step, micro-batch), and the per-sample
losses ℓᵢ (B,) of a model on a batch; the harness does the rest. Hugging Face models are
built from configs with random weights (nothing is downloaded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

Batch = tuple[Tensor, ...]


@dataclass
class ZooCase:
    """One model of the zoo and how to train it.

    batch(step, micro) -> tensors; losses(model, batch) -> (B,) float per-sample losses.
    block: a module path whose incoming edges the graph check asserts exactly (`block_edges`);
    "" for the whole graph.
    train_steps: steps run in train mode before the eval-mode steps (BatchNorm, Dropout:
    their per-sample gradients exist in eval mode only).
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], Batch]
    losses: Callable[[nn.Module, Batch], Tensor]
    block: str
    block_edges: set[tuple[str, str]]
    micro_batches: int = 1
    train_steps: int = 0
    autocast: torch.dtype | None = None
    compiled: bool = False
    rtol: float = 1e-4
    frozen: tuple[str, ...] = ()
    # quantity -> a phrase its reason must hold, for what is rightly missing on this model
    missing: dict[str, str] = field(default_factory=dict)


def _generator(step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * step + micro)


# -- ResNet-style CNN: conv-bn-relu(inplace)-conv-bn, out += identity, relu(inplace) ---------
class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(out), 1))


def _image_batch(step: int, micro: int, b: int = 6, classes: int = 5) -> Batch:
    g = _generator(step, micro)
    return torch.randn(b, 3, 6, 6, generator=g), torch.randint(0, classes, (b,), generator=g)


def _classify(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _block_edges(block: str, pairs: list[tuple[str, str]], params: list[str]) -> set:
    """Edges named relative to `block`, plus each parameter into its module's output."""
    edges = {(_abs(block, s), _abs(block, t)) for s, t in pairs}
    for p in params:
        edges.add((f"{block}.{p}", f"{block}.{p.rsplit('.', 1)[0]}"))
    return edges


def _abs(block: str, name: str) -> str:
    """`name` inside `block`; names starting with "/" are outside it (absolute)."""
    if name.startswith("/"):
        return name[1:]
    return block if name == "" else f"{block}.{name}"


# -- Hugging Face GPT-2 and BERT: stock position ids, tied embeddings, a padding mask -------
VOCAB, T = 40, 8


def _tokens(step: int, micro: int, b: int = 4) -> tuple[Tensor, Tensor]:
    """Token ids (b, T) and an attention mask that pads the tail of every other row."""
    g = _generator(step, micro)
    ids = torch.randint(1, VOCAB, (b, T), generator=g)
    mask = torch.ones(b, T, dtype=torch.long)
    mask[1::2, T - 3:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(config)


def _lm_batch(step: int, micro: int) -> Batch:
    return _tokens(step, micro)


def _gpt2_losses(model: nn.Module, batch: Batch) -> Tensor:
    """Next-token cross-entropy averaged over each sequence's real (unpadded) targets."""
    ids, mask = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    keep = mask[:, 1:].to(ce.dtype)
    return (ce * keep).sum(1) / keep.sum(1)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=T,
                        num_labels=3, pad_token_id=0)
    return BertForSequenceClassification(config)


def _bert_batch(step: int, micro: int) -> Batch:
    ids, mask = _tokens(step, micro)
    return ids, mask, torch.randint(0, 3, (ids.shape[0],), generator=_generator(step, micro))


def _bert_losses(model: nn.Module, batch: Batch) -> Tensor:
    ids, mask, y = batch
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y,
                           reduction="none")


# -- LSTM language model -------------------------------------------------------------------
class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def _token_losses(model: nn.Module, batch: Batch) -> Tensor:
    """Next-token cross-entropy, the mean over each sequence."""
    ids = batch[0]
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


# -- nn.TransformerEncoder (batch_first) ---------------------------------------------------
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=mask == 0)
        return self.head(h[:, 0])


def _encoder_losses(model: nn.Module, batch: Batch) -> Tensor:
    ids, mask, y = batch
    return F.cross_entropy(model(ids, mask), y, reduction="none")


# -- CNN + BatchNorm + Dropout -------------------------------------------------------------
def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(4 * 3 * 3, 5))


# -- a small MLP for bf16 autocast, accumulation and torch.compile -------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 5))


def _vector_batch(step: int, micro: int, b: int = 4) -> Batch:
    g = _generator(step, micro)
    return torch.randn(b, 6, generator=g), torch.randint(0, 5, (b,), generator=g)



# -- frozen layers: a frozen block on 3-D input feeding a Linear (which saves a view) ------
def _frozen() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh()),      # block 1, frozen
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),      # block 2
        nn.Linear(8, 5))


def _sequence_batch(step: int, micro: int, b: int = 4) -> Batch:
    g = _generator(step, micro)
    return torch.randn(b, 3, 6, generator=g), torch.randint(0, 5, (b, 3), generator=g)


def _sequence_losses(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)


# -- the exact edges of one block of each model (checked against the models' code) ---------
def _whole(pairs: list[tuple[str, str]], params: list[str]) -> set:
    """A small model's whole graph: `pairs`, each parameter into its module, and the loss."""
    edges = set(pairs) | {(p, p.rsplit(".", 1)[0]) for p in params}
    last = pairs[-1][1]
    return edges | {(last, "model"), (last, "loss_per_sample"), ("loss_per_sample", "loss")}


# ResNet: out += identity is the edge from the previous block's output into relu#2.
RESNET_BLOCK = _block_edges("layer1.1", [
    ("/layer1.0.relu#2", "conv1"), ("conv1", "bn1"), ("bn1", "relu"), ("relu", "conv2"),
    ("conv2", "bn2"), ("bn2", "relu#2"), ("/layer1.0.relu#2", "relu#2"), ("relu#2", ""),
], ["conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias"])

# GPT-2: two residual sums (unnamed) feed ln_2 and the block output; attention (sdpa) and the
# GELU inside c_fc -> act are functional, so c_attn -> c_proj crosses the attention.
GPT2_BLOCK = _block_edges("transformer.h.0", [
    ("/transformer.drop", "ln_1"), ("ln_1", "attn.c_attn"), ("attn.c_attn", "attn.c_proj"),
    ("attn.c_proj", "attn.resid_dropout"), ("attn.resid_dropout", "attn.0"),
    ("attn.resid_dropout", "ln_2"), ("/transformer.drop", "ln_2"), ("ln_2", "mlp.c_fc"),
    ("mlp.c_fc", "mlp.act"), ("mlp.act", "mlp.c_proj"), ("mlp.c_proj", "mlp.dropout"),
    ("mlp.dropout", "mlp"), ("mlp.dropout", ""), ("attn.resid_dropout", ""),
    ("/transformer.drop", ""),
], ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
    "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"])

# BERT: post-LN residuals into attention.output.LayerNorm and output.LayerNorm.
BERT_BLOCK = _block_edges("bert.encoder.layer.0", [
    ("/bert.embeddings.dropout", "attention.self.query"),
    ("/bert.embeddings.dropout", "attention.self.key"),
    ("/bert.embeddings.dropout", "attention.self.value"),
    ("attention.self.query", "attention.self.0"), ("attention.self.key", "attention.self.0"),
    ("attention.self.value", "attention.self.0"),
    ("attention.self.0", "attention.output.dense"),
    ("attention.output.dense", "attention.output.dropout"),
    ("attention.output.dropout", "attention.output.LayerNorm"),
    ("/bert.embeddings.dropout", "attention.output.LayerNorm"),
    ("attention.output.LayerNorm", "attention.output"),
    ("attention.output.LayerNorm", "attention.0"),
    ("attention.output.LayerNorm", "intermediate.dense"),
    ("intermediate.dense", "intermediate.intermediate_act_fn"),
    ("intermediate.intermediate_act_fn", "intermediate"),
    ("intermediate.intermediate_act_fn", "output.dense"),
    ("output.dense", "output.dropout"), ("output.dropout", "output.LayerNorm"),
    ("attention.output.LayerNorm", "output.LayerNorm"),
    ("output.LayerNorm", "output"), ("output.LayerNorm", ""),
], [f"{m}.{w}" for m in ("attention.self.query", "attention.self.key",
                         "attention.self.value", "attention.output.dense",
                         "attention.output.LayerNorm", "intermediate.dense", "output.dense",
                         "output.LayerNorm") for w in ("weight", "bias")])

# LSTM: output, h_n and c_n all come from the embedding and the four parameters.
LSTM_BLOCK = {(s, f"lstm.{t}") for t in ("0", "1.0", "1.1")
              for s in ("embed", "lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.bias_ih_l0",
                        "lstm.bias_hh_l0")}

# nn.TransformerEncoderLayer (post-LN): MultiheadAttention uses its out_proj weights
# directly (out_proj is never called), the ReLU between linear1 and dropout is functional.
ENCODER_BLOCK = _block_edges("encoder.layers.0", [
    ("/embed", "self_attn.0"), ("self_attn.0", "dropout1"), ("dropout1", "norm1"),
    ("/embed", "norm1"), ("norm1", "linear1"), ("linear1", "dropout"), ("dropout", "linear2"),
    ("linear2", "dropout2"), ("dropout2", "norm2"), ("norm1", "norm2"), ("norm2", ""),
], ["linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias", "norm1.weight",
    "norm1.bias", "norm2.weight", "norm2.bias"]) | {
    (f"encoder.layers.0.self_attn.{p}", "encoder.layers.0.self_attn.0")
    for p in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")}

CNN_GRAPH = _whole([("0", "1"), ("1", "2"), ("2", "3"), ("3", "4"), ("4", "5"), ("5", "6")],
                   ["0.weight", "0.bias", "1.weight", "1.bias", "6.weight", "6.bias"])
MLP_GRAPH = _whole([("0", "1"), ("1", "2"), ("2", "3")],
                   ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"])
# The frozen block has no autograd node: its edges come from its modules' inputs and
# parameters, and block 2's Linear saved a 2-D view of block 1's 3-D output.
FROZEN_GRAPH = _whole([("0.1", "0"), ("0.0", "0.1"), ("0.1", "1.0"), ("1.0", "1.1"),
                       ("1.1", "1"), ("1.1", "2")],
                      ["0.0.weight", "0.0.bias", "1.0.weight", "1.0.bias", "2.weight",
                       "2.bias"])
