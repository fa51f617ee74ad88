"""Instruments on real models: plain training, the floor any exact tool pays, and deepscope's
economy / business / full, taking turns in one process.

    PYTHONPATH=src python benchmarks/real_models.py gpt2 [--repeats 5] [--block 3] [--quick]

Models (realistic small sizes, random weights, nothing downloaded):
  gpt2  Hugging Face GPT-2 from a config: 4 layers, d=128, 4 heads, vocabulary 2048, tied
        embeddings, eager attention; next-token loss over T=64 tokens, B=16.
  cnn   a ResNet-style CNN (CIFAR ResNet-20 widths 16-32-64, 3 stages of 1 BasicBlock) on
        32×32 images, B=32; BatchNorm in eval mode (per-sample gradients exist only then).
  lstm  an LSTM language model: Embedding(2048, 128), LSTM(128, 256), Linear(256, 2048),
        T=64, B=16.
  mlp   workload.py's MLP 784-256-256-10 on random inputs, B=128 (its instruments group
        measures it in steps of 10; here in this script's turns, e.g. with --max-ev-every).
Every configuration trains its own copy of the model that shares the parameter tensors (so
memory layout is the same), with SGD. Configurations:
  plain     forward, per-sample losses, mean, backward, SGD step;
  floor     a plain step plus every per-sample gradient materialised with
            `torch.func.vmap(torch.func.grad(ℓᵢ))` over the batch (what an exact tool pays
            at least; nothing is done with them);
  economy / business / full   `Scope(schedule=never, instruments=level,
            instrument_schedule=every(1))`, `rec.loss(loss, per_sample=losses)`.
In each round every configuration runs `--block` steps (order rotating between rounds); a
configuration's ratio is its mean step over plain's mean step of the same round (the mean: a
quantity computed on every k-th instrumented step only is paid on average; take a block that
is a multiple of k). Steps are timed in CPU seconds of this process (`time.process_time`,
all its threads: deepscope's writer too), which other processes on a shared machine disturb
far less than wall time (torch runs on one thread, so on an idle machine the two agree).
Prints one JSON line: {"group", "rows": [{"label", "ms", "ratios", "floor_ratios"}], "memory"}.
The memory entry: peak bytes allocated above the start of one step (torch profiler, CPU), of
plain training and of each instrumented step (including `finish`), and the bytes of the
largest module's per-sample gradients (B × its parameters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from workload import _sharing_parameters, build_model  # this folder is on sys.path when run

import deepscope

LEVELS = ("economy", "business", "full")
CONFIGS = ("plain", "floor", *LEVELS)
# (vocabulary, tokens per sample, width, GPT-2 layers, batch scale); --quick: tiny sizes
SIZES = {False: (2048, 64, 128, 4, 1), True: (64, 8, 16, 1, 4)}
VOCAB, SEQ, WIDTH, LAYERS, SHRINK = SIZES[False]


def use_sizes(quick: bool) -> None:
    """Switch the models to the full or the --quick sizes (before building them)."""
    global VOCAB, SEQ, WIDTH, LAYERS, SHRINK
    VOCAB, SEQ, WIDTH, LAYERS, SHRINK = SIZES[quick]

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (model, x, y) -> (B,) losses


# -- models ----------------------------------------------------------------------------------
def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    # eager attention: sdpa's CPU kernel has no second derivative (curvature would be
    # missing, see docs/LIMITATIONS.md); every configuration runs the same model
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


class _Block(nn.Module):
    """ResNet BasicBlock: conv-bn-relu-conv-bn, plus the (projected) input, relu."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        _Block(16, 16, 1), _Block(16, 32, 2), _Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class LSTMLM(nn.Module):
    """Embedding → LSTM → Linear over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, 2 * WIDTH, batch_first=True)
        self.head = nn.Linear(2 * WIDTH, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def _next_token(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


def _classify(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def _tokens(batch: int, gen: torch.Generator) -> Batch:
    ids = torch.randint(VOCAB, (batch, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _vectors(batch: int, gen: torch.Generator) -> Batch:
    return torch.randn(batch, 784, generator=gen), torch.randint(10, (batch,), generator=gen)


def _images(batch: int, gen: torch.Generator) -> Batch:
    side = 32 // SHRINK
    return (torch.randn(batch, 3, side, side, generator=gen),
            torch.randint(10, (batch,), generator=gen))


# name -> (builder, batch size, batch maker, per-sample losses, title)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, Callable, LossFn, str]] = {
    "gpt2": (_gpt2, 16, _tokens, _next_token,
             "GPT-2 (HF, 4 layers, d=128, vocab 2048), T=64, B=16"),
    "cnn": (_cnn, 32, _images, _classify, "ResNet-style CNN (16-32-64), 32×32, B=32"),
    "lstm": (LSTMLM, 16, _tokens, _next_token,
             "LSTM LM (Embedding 2048×128, LSTM 128→256, Linear 256→2048), T=64, B=16"),
    "mlp": (lambda: build_model("mlp"), 128, _vectors, _classify,
            "MLP 784-256-256-10 (workload.py's), B=128"),
}


# -- configurations --------------------------------------------------------------------------
StepFn = Callable[[Tensor, Tensor], None]


def _plain(model: nn.Module, losses_of: LossFn) -> StepFn:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x: Tensor, y: Tensor) -> None:
        loss = losses_of(model, x, y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def _floor(model: nn.Module, losses_of: LossFn) -> StepFn:
    """A plain step, then every gᵢ by torch.func.vmap(grad) (materialised, then dropped)."""
    plain = _plain(model, losses_of)
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def one(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        def call(m: nn.Module, xs: Tensor, ys: Tensor) -> Tensor:
            return losses_of(lambda t: torch.func.functional_call(m, params, (t,)), xs, ys)
        return call(model, x.unsqueeze(0), y.unsqueeze(0))[0]

    per_sample = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))

    def step(x: Tensor, y: Tensor) -> None:
        params = {n: p.detach() for n, p in model.named_parameters() if n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ops without batching rules: slower, still exact
            per_sample(params, x, y)
        plain(x, y)
    return step


def _scoped(model: nn.Module, losses_of: LossFn, level: str, root: Path,
            options: dict | None = None) -> tuple[StepFn, Callable]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scope = deepscope.Scope(root, run=level, overwrite=True, schedule=deepscope.never,
                            instruments=level, instrument_schedule=deepscope.every(1),
                            instrument_options=options)
    scope.watch(model, optimizer=opt)
    done = [0]

    def step(x: Tensor, y: Tensor) -> None:
        with scope.step(done[0]) as rec:
            losses = losses_of(model, x, y)
            loss = losses.mean()
            rec.loss(loss, per_sample=losses)
            opt.zero_grad()
            loss.backward()
            opt.step()
        done[0] += 1
    return step, scope.close


# -- memory ----------------------------------------------------------------------------------
def peak_bytes(fn: Callable[[], None]) -> int:
    """Peak CPU bytes allocated by torch during fn() above what was allocated before it
    (from the torch profiler's allocation events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    current = peak = 0
    for _, delta in changes:
        current += delta
        peak = max(peak, current)
    return peak


def largest_module_grads(model: nn.Module, batch: int) -> int:
    """B × the bytes of the largest module's own trainable parameters."""
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)
                 if p.requires_grad) for m in model.modules()]
    return batch * max(sizes)


# -- measuring -------------------------------------------------------------------------------
def measure(name: str, repeats: int, block: int, warmup: int, configs: tuple[str, ...],
            memory: bool, options: dict | None = None) -> dict:
    build, batch, make, losses_of, title = MODELS[name]
    batch //= SHRINK
    torch.manual_seed(0)
    model = build()
    if name == "cnn":
        model.eval()  # BatchNorm with running statistics: per-sample gradients exist
    gen = torch.Generator().manual_seed(1)
    # 5 batches: a quantity on every k-th step (k = 2, 3, 4) meets a different one each
    # time, as in training (with 4, HessMaxEV every 4th step saw the same batch again)
    batches = [make(batch, gen) for _ in range(5)]
    closers = []
    with tempfile.TemporaryDirectory(prefix="deepscope-real-") as root:
        steps: dict[str, StepFn] = {}
        for config in configs:
            twin = _sharing_parameters(model)
            if config == "plain":
                steps[config] = _plain(twin, losses_of)
            elif config == "floor":
                steps[config] = _floor(twin, losses_of)
            else:
                steps[config], close = _scoped(twin, losses_of, config, Path(root), options)
                closers.append(close)
        times: dict[str, list[float]] = {c: [] for c in configs}  # per round: mean s/step
        order = list(configs)
        done = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the instruments' notes are not timed output
            for c in configs:  # warm-up: first calls compile, allocate, measure HVP costs
                for _ in range(warmup):
                    steps[c](*batches[0])
            for _ in range(repeats):
                for c in order:
                    spent = []
                    for _ in range(block):
                        x, y = batches[done % len(batches)]
                        start = time.process_time()
                        steps[c](x, y)
                        spent.append(time.process_time() - start)
                        done += 1
                    times[c].append(statistics.fmean(spent))
                order = order[1:] + order[:1]
            mem = {}
            if memory:
                x, y = batches[0]
                mem = {c: peak_bytes(lambda c=c: steps[c](x, y)) for c in configs
                       if c != "floor"}
                mem["largest_module_grads"] = largest_module_grads(model, batch)
        for close in closers:
            close()
    rows = []
    for c in configs:
        ratios = [t / p for t, p in zip(times[c], times["plain"])]
        floor = ([t / f for t, f in zip(times[c], times["floor"])] if "floor" in times
                 else [])
        rows.append({"label": c, "ms": 1e3 * statistics.median(times[c]), "ratios": ratios,
                     "floor_ratios": floor})
    return {"group": name, "title": title, "repeats": repeats, "block": block, "rows": rows,
            "memory": mem}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--block", type=int, default=3, help="steps per turn (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per config")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--no-memory", action="store_true", help="skip the memory step")
    parser.add_argument("--max-ev-every", type=int, default=None,
                        help="HessMaxEV's cadence (instrument_options max_ev_every; default: "
                             "the configuration's)")
    parser.add_argument("--quick", action="store_true",
                        help="harness check: tiny models, 1 round of 1 step, no memory")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.block, args.warmup, args.no_memory = 1, 1, 1, True
    configs = tuple(c for c in CONFIGS if c in args.configs or c == "plain")
    use_sizes(args.quick)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    options = {} if args.max_ev_every is None else {"max_ev_every": args.max_ev_every}
    result = measure(args.model, args.repeats, args.block, args.warmup, configs,
                     not args.no_memory, options)
    result["options"] = options
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
