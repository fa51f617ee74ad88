"""The bug zoo: small models trained with one classic bug injected, and the same loop healthy.

Each case trains for at most a few hundred steps of tiny models on fresh synthetic batches
(a fixed random teacher labels the inputs), recorded sparsely: statistics and the economy
instruments every 10th step, activations by hooks, the input by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import deepscope

INSTRUMENTS = ["Alpha", "UpdateSize", "GradNorm", "NormTest"]
FEATURES, CLASSES = 10, 4


@dataclass
class Loop:
    """What differs between cases: the model, the optimiser, the data and the bug switches."""

    model: nn.Module
    opt: Callable[[nn.Module], torch.optim.Optimizer]
    steps: int = 150
    batch: int = 32
    data: str = "teacher"  # teacher | images | sequences | tokens | token_labels
    scale: float = 1.0           # multiplies the inputs (bad_input_scale)
    zero_grad: bool = True
    nan_at: int | None = None    # step from which the input normalisation divides by 0
    loss: str = "ce"


def _mlp(sizes: list[int], act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def _scaled(model: nn.Module, factor: float) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                p.mul_(factor)
    return model


def _he(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return model


class CNN(nn.Module):
    """8×8 one-channel images -> conv -> tanh -> pool -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.act = nn.Tanh()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.act(self.conv(x))).flatten(1))


class RNN(nn.Module):
    """An Elman net unrolled by hand over a sequence of FEATURES-vectors, last state -> head."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.inp, self.rec = nn.Linear(FEATURES, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], self.rec.in_features)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.head(h)


class Transformer(nn.Module):
    """Tokens -> embedding -> one small encoder layer -> mean pool -> head."""

    def __init__(self, vocab: int = 16, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


def _batch(loop: Loop, gen: torch.Generator, teacher: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    n = loop.batch
    if loop.data == "images":
        x = torch.rand(n, 1, 8, 8, generator=gen)
        y = ((x[:, 0, :4].mean((1, 2)) > x[:, 0, 4:].mean((1, 2))).long()
             + 2 * (x[:, 0, :, :4].mean((1, 2)) > x[:, 0, :, 4:].mean((1, 2))).long())
        return x * loop.scale, y
    if loop.data == "sequences":
        x = torch.randn(n, 6, FEATURES, generator=gen)
        return x, (x.sum(1) @ teacher).argmax(1)
    if loop.data in ("tokens", "token_labels"):
        x = torch.randint(0, 16, (n, 8), generator=gen)
        if loop.data == "tokens":  # labels that do not depend on the tokens
            return x, torch.randint(0, CLASSES, (n,), generator=gen)
        return x, ((x < 8).sum(1) > 4).long() + 2 * ((x % 2 == 0).sum(1) > 4).long()
    x = torch.randn(n, FEATURES, generator=gen)
    y = (x @ teacher).argmax(1)
    return x * loop.scale, y


def train(path: Path, name: str, loop: Loop, seed: int = 0) -> deepscope.Run:
    """Train and record `loop`; return the run (open it with `with`)."""
    torch.set_num_threads(1)  # tiny matrices: threads cost more than they save
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    model = loop.model
    opt = loop.opt(model)
    scope = deepscope.Scope(path, run=name, schedule=deepscope.every(10), overwrite=True,
                            instruments=INSTRUMENTS, instrument_schedule=deepscope.every(10),
                            max_samples=2, seed=seed)
    try:
        scope.watch(model, activations=True, optimizer=opt)
        for step in range(loop.steps):
            x, y = _batch(loop, gen, teacher)
            if loop.nan_at is not None:
                # the bug: standardise by the std of a column that became constant
                if step >= loop.nan_at:
                    x[:, 0] = 1.0
                x = (x - x.mean(0)) / x.std(0)
            with scope.step(step) as rec:
                rec.tensor("input", x, role="input")
                out = model(x)
                losses = F.cross_entropy(out, y, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                if loop.zero_grad:
                    opt.zero_grad()
                losses.mean().backward()
                opt.step()
    finally:
        scope.close()
    return deepscope.open_run(path / name)


def _sgd(lr: float, **kw: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, **kw)


def _adam(lr: float = 1e-3) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.Adam(m.parameters(), lr=lr)


def _last_layer_only(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(list(m)[-1].parameters(), lr=1e-3)  # the bug: first layers left out


MLP = [FEATURES, 32, 32, CLASSES]
DEEP = [FEATURES] + [32] * 8 + [CLASSES]


def cases() -> dict[str, tuple[str, Callable[[], Loop], Callable[[], Loop]]]:
    """code -> (description, bugged loop, healthy loop). Models are built on call."""
    torch.manual_seed(0)
    return {
        "lr_too_high": ("MLP, SGD lr 2 (healthy 0.1)",
                        lambda: Loop(_mlp(MLP), _sgd(2.0)), lambda: Loop(_mlp(MLP), _sgd(0.1))),
        "lr_too_low": ("MLP, SGD lr 1e-5 (healthy 0.1)",
                       lambda: Loop(_mlp(MLP), _sgd(1e-5)), lambda: Loop(_mlp(MLP), _sgd(0.1))),
        "exploding_gradients": (
            "deep ReLU MLP, weights 2.5× He init (healthy He init)",
            lambda: Loop(_scaled(_he(_mlp(DEEP)), 2.5), _sgd(1e-6)),
            lambda: Loop(_he(_mlp(DEEP)), _sgd(1e-2))),
        "vanishing_gradients": (
            "deep sigmoid MLP (healthy: ReLU, He init)",
            lambda: Loop(_mlp(DEEP, nn.Sigmoid), _adam()),
            lambda: Loop(_he(_mlp(DEEP)), _adam())),
        "dead_units": ("MLP, first-layer biases -4 (healthy 0)",
                       lambda: Loop(_biased(_mlp(MLP), -4.0), _adam()),
                       lambda: Loop(_mlp(MLP), _adam())),
        "saturation": ("tanh MLP, weights ×8 (healthy default init)",
                       lambda: Loop(_scaled(_mlp(MLP, nn.Tanh), 8.0), _adam()),
                       lambda: Loop(_mlp(MLP, nn.Tanh), _adam())),
        "missing_zero_grad": ("RNN, SGD lr 0.01, no zero_grad (healthy: zero_grad)",
                              lambda: Loop(RNN(), _sgd(0.01), data="sequences",
                                           zero_grad=False),
                              lambda: Loop(RNN(), _sgd(0.01), data="sequences")),
        "not_updated": ("MLP, optimiser given the last layer only (healthy: all)",
                        lambda: Loop(_mlp(MLP), _last_layer_only),
                        lambda: Loop(_mlp(MLP), _adam())),
        "not_learning": ("transformer, labels independent of the tokens (healthy: labels "
                         "from token counts)",
                         lambda: Loop(Transformer(), _adam(), data="tokens"),
                         lambda: Loop(Transformer(), _adam(), data="token_labels")),
        "noisy_batch": ("MLP, batch 2, SGD lr 0.1 (healthy batch 64)",
                        lambda: Loop(_mlp(MLP), _sgd(0.1), batch=2),
                        lambda: Loop(_mlp(MLP), _sgd(0.1), batch=64)),
        "non_finite": ("MLP, inputs standardised by a std that becomes 0 at step 60 "
                       "(healthy: never)",
                       lambda: Loop(_mlp(MLP), _adam(), nan_at=60),
                       lambda: Loop(_mlp(MLP), _adam(), nan_at=10 ** 9)),
        "bad_input_scale": ("CNN on raw 0-255 pixels (healthy: /255)",
                            lambda: Loop(CNN(), _adam(1e-2), data="images", scale=255.0),
                            lambda: Loop(CNN(), _adam(1e-2), data="images")),
    }


def _biased(model: nn.Sequential, bias: float) -> nn.Sequential:
    with torch.no_grad():
        model[0].bias.fill_(bias)
    return model


