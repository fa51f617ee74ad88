"""One benchmark measurement: train a small model with one tool and print one JSON line.

Usage (one spec per process is what `run.py` does; several specs share one process in
`run.py --quick`)::

    python benchmarks/workload.py --steps 60 --warmup 10 --max-seconds 10 --dir /tmp/bench \
        [--paired] TOOL:MODEL:MODE ...

A slow tool stops early: after --max-seconds of timed steps (at least 3). With --paired,
plain training takes turns with each spec in the same process (see `measure`). TOOL is
plain, deepscope, comgra or cockpit; MODEL is linear, mlp or transformer; MODE says what the
tool records (see `MODES`). Each spec prints one JSON object on its own line: median and mean
milliseconds per timed step, peak RSS, bytes on disk and stored steps, or
`{"error": "<one line>"}`. Torch runs on one thread. This file imports only torch at the top,
so it runs both in the project's `.venv` (plain, deepscope) and in `.venv-peers` (comgra,
Cockpit).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import json
import resource
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

BATCH = {"linear": 128, "mlp": 128, "transformer": 32}
# An odd count of batches: a quantity on every 2nd or 4th step (HessMaxEV in full) sees them all.
SEQ_LEN, VOCAB, D_MODEL, N_CLASSES, N_BATCHES = 32, 512, 64, 10, 9
LR = 1e-2

MODES: dict[str, tuple[str, ...]] = {
    "plain": ("train",),
    "deepscope": ("recorder", "named4", "unrecorded", "check", "trace", "defaults",
                  "defaults-economy", "tests-alpha", "economy", "business", "full"),
    "comgra": ("recorder",),
    "cockpit": ("economy", "business", "full"),
}

StepFn = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class Setup:
    """What a tool needs to train: the step function, a finisher that closes the tool's
    store and returns (bytes on disk, steps that stored something), and `drain`, which
    blocks until what the tool recorded so far is written (deepscope: `scope.flush`)."""

    step: StepFn
    finish: Callable[[int], tuple[int, int]]
    drain: Callable[[], None] = lambda: None


class TinyTransformer(nn.Module):
    """One pre-norm transformer block over token sequences, mean-pooled into class logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, num_heads=4, batch_first=True)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.ff = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(),
                                nn.Linear(4 * D_MODEL, D_MODEL))
        self.head = nn.Linear(D_MODEL, N_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        a = self.norm1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.ff(self.norm2(h))
        return self.head(h.mean(dim=1))


def build_model(name: str) -> nn.Module:
    """The benchmark models: linear 784-10 (as in the Cockpit seed), MLP 784-256-256-10, and
    a transformer block (Embedding + LayerNorm + attention + GELU)."""
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, N_CLASSES))
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, N_CLASSES))
    if name == "transformer":
        return TinyTransformer()
    raise ValueError(f"unknown model {name!r}; use linear, mlp or transformer")


def make_batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed pool of synthetic batches (same for every tool)."""
    gen = torch.Generator().manual_seed(1)
    batch = BATCH[model]
    out = []
    for _ in range(N_BATCHES):
        if model == "transformer":
            x = torch.randint(VOCAB, (batch, SEQ_LEN), generator=gen)
        else:
            x = torch.randn(batch, 784, generator=gen)
        out.append((x, torch.randint(N_CLASSES, (batch,), generator=gen)))
    return out


def dir_bytes(path: Path) -> int:
    """Bytes of all files under `path` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- tools -------------------------------------------------------------------------------
def setup_plain(model: nn.Module, mode: str, workdir: Path) -> Setup:
    """Plain training: forward, per-sample loss, mean, backward, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        losses = F.cross_entropy(model(x), y, reduction="none")
        opt.zero_grad()
        losses.mean().backward()
        opt.step()

    return Setup(step, lambda steps: (0, 0))


def deepscope_config(mode: str) -> tuple[dict[str, object], dict[str, object]]:
    """(Scope keyword arguments, watch keyword arguments) of a deepscope mode."""
    import deepscope

    every_step = deepscope.every(1)
    if mode == "recorder":  # comgra's tutorial setting: activations, gradients, 5 samples
        return {"schedule": every_step, "max_samples": 5}, {"activations": True}
    if mode == "unrecorded":  # the same set-up, on steps the schedule does not choose
        return ({"schedule": deepscope.every(10**9), "max_samples": 5, "anomalies": False},
                {"activations": True})
    if mode in ("check", "trace"):  # the always-on health check alone, nothing recorded
        return {"schedule": deepscope.never, "anomalies": mode}, {}
    if mode == "named4":
        return {"schedule": every_step, "max_samples": 4}, {}
    if mode == "defaults":
        return {}, {}
    if mode == "defaults-economy":
        return {"instruments": "economy"}, {}
    # "tests-alpha": the first-order tests and α alone
    quantities = FIRST_ORDER if mode == "tests-alpha" else mode
    return ({"schedule": deepscope.never, "instruments": quantities,
             "instrument_schedule": every_step}, {})


FIRST_ORDER = ["NormTest", "InnerTest", "OrthoTest", "Alpha"]


NAMED4 = {0: "fc1", 1: "h1", 3: "h2", 4: "logits"}  # MLP layer index -> registered name


def setup_deepscope(model: nn.Module, mode: str, workdir: Path) -> Setup:
    """deepscope in one of its `MODES["deepscope"]` configurations; the loop follows the
    design's example (input, output for the defaults, loss with per-sample losses)."""
    import deepscope

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scope_kwargs, watch_kwargs = deepscope_config(mode)
    scope = deepscope.Scope(workdir, run=mode, overwrite=True, **scope_kwargs)
    scope.watch(model, optimizer=opt, **watch_kwargs)

    def forward_named4(rec: deepscope.StepRecorder, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(model):
            x = layer(x)
            if k in NAMED4:
                rec.tensor(NAMED4[k], x, role="output" if k == 4 else "activation")
        return x

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with scope.step(i) as rec:
            if mode == "named4":
                out = forward_named4(rec, x)
            else:
                rec.tensor("input", x, role="input")
                out = model(x)
            if mode.startswith("defaults"):
                rec.tensor("output", out, role="output")
            losses = F.cross_entropy(out, y, reduction="none")
            loss = losses.mean()
            rec.loss(loss, per_sample=losses)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def finish(steps: int) -> tuple[int, int]:
        scope.close()
        with deepscope.open_run(workdir / mode) as run:
            stored = set(run.steps())
            if "instruments" in scope_kwargs:
                stored |= set(run.quantities()["step"].tolist())
            return run.size_bytes(), len(stored)

    return Setup(step, finish, scope.flush)


def setup_comgra(model: nn.Module, mode: str, workdir: Path) -> Setup:
    """comgra 0.11.5 as in its tutorial (5 batch items in detail, SVD of parameters), with
    every step recorded: input, every layer's output, per-sample loss, loss, gradients."""
    import comgra
    from comgra.objects import DecisionMakerForRecordingsFrequencyPerType
    from comgra.recorder import ComgraRecorder

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    workdir.mkdir(parents=True, exist_ok=True)
    comgra.my_recorder = recorder = ComgraRecorder(
        comgra_root_path=workdir, group="bench", trial_id=mode,
        decision_maker_for_recordings=DecisionMakerForRecordingsFrequencyPerType(
            min_training_steps_difference=1),
        max_num_batch_size_to_record=5,
        calculate_svd_and_other_expensive_operations_of_parameters=True)
    recorder.track_module("model", model)
    layers = list(model.children())

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        recorder.start_batch(i, x.shape[0], type_of_execution="train",
                             record_all_tensors_per_batch_index_by_default=True)
        recorder.start_iteration()
        recorder.register_tensor("input", x, is_input=True)
        out = x
        for k, layer in enumerate(layers):
            out = layer(out)
            recorder.register_tensor(f"layer{k}", out)
        # (B, 1): comgra asserts on a 1-D tensor that has a batch dimension
        losses = F.cross_entropy(out, y, reduction="none").unsqueeze(1)
        recorder.register_tensor("loss_per_sample", losses)
        loss = losses.mean()
        recorder.register_tensor("loss", loss, is_loss=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        recorder.record_current_gradients("gradients")
        recorder.finish_iteration()
        recorder.finish_batch()

    def finish(steps: int) -> tuple[int, int]:
        recorder.finalize()
        return dir_bytes(workdir / "bench"), steps

    return Setup(step, finish)


def setup_cockpit(model: nn.Module, mode: str, workdir: Path) -> Setup:
    """Cockpit 1.0.2 as in its seed: BackPACK-extended model and loss, `configuration(mode)`
    tracked every step, the info dict, `create_graph` when a quantity asks for it."""
    from backpack import extend
    from cockpit import Cockpit
    from cockpit.utils.configuration import configuration

    model = extend(model)
    loss_fn = extend(nn.CrossEntropyLoss(reduction="mean"))
    individual_loss_fn = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model.parameters(), quantities=configuration(mode))

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        losses = individual_loss_fn(outputs, y)
        info = {"batch_size": x.shape[0], "individual_losses": losses, "loss": loss,
                "optimizer": opt}
        with cockpit(i, info=info):
            loss.backward(create_graph=cockpit.create_graph(i))
        opt.step()

    def finish(steps: int) -> tuple[int, int]:
        workdir.mkdir(parents=True, exist_ok=True)
        cockpit.write(str(workdir / mode))
        return dir_bytes(workdir), steps

    return Setup(step, finish)


SETUPS: dict[str, Callable[[nn.Module, str, Path], Setup]] = {
    "plain": setup_plain, "deepscope": setup_deepscope, "comgra": setup_comgra,
    "cockpit": setup_cockpit,
}
PEER_DISTRIBUTIONS = {"comgra": ("comgra",),
                      "cockpit": ("cockpit-for-pytorch", "backpack-for-pytorch")}


# --- measuring ---------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, str, str]:
    """'tool:model:mode' -> (tool, model, mode), checked against `MODES` and the models."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"bad spec {spec!r}: write TOOL:MODEL:MODE, e.g. deepscope:mlp:recorder")
    tool, model, mode = parts
    if mode not in MODES.get(tool, ()):
        raise ValueError(f"bad spec {spec!r}: tool {tool!r} has modes "
                         f"{', '.join(MODES.get(tool, ())) or 'none (unknown tool)'}")
    if model not in BATCH:
        raise ValueError(f"bad spec {spec!r}: model must be one of {', '.join(BATCH)}")
    return tool, model, mode


def versions(tool: str) -> dict[str, str]:
    """Installed versions of torch and of the tool's distributions."""
    names = {"deepscope": ("deepscope",)}.get(tool, PEER_DISTRIBUTIONS.get(tool, ()))
    out = {"torch": torch.__version__}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


MIN_TIMED_STEPS = 3
PAIRED_BLOCK = 10  # steps per turn when a tool alternates with plain training


def _sharing_parameters(model: nn.Module) -> nn.Module:
    """A copy of `model` (no hooks yet) whose parameters are `model`'s own tensors."""
    twin = copy.deepcopy(model)
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(twin.get_submodule(owner), leaf, param)
    return twin


class _Trainer:
    """One tool training the benchmark model it is given (built with the same seed and fed
    the same batches for every tool), one step at a time."""

    def __init__(self, spec: str, root: Path, model: nn.Module) -> None:
        tool, model_name, mode = parse_spec(spec)
        self.tool = tool
        self.batches = make_batches(model_name)
        workdir = root / f"{tool}-{model_name}-{mode}"
        shutil.rmtree(workdir, ignore_errors=True)
        self.setup = SETUPS[tool](model, mode, workdir)
        self.done = 0
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        x, y = self.batches[self.done % len(self.batches)]
        x, y = x.clone(), y.clone()  # fresh tensors: comgra sets requires_grad on inputs
        start = time.perf_counter()
        self.setup.step(self.done, x, y)
        elapsed = time.perf_counter() - start
        self.done += 1
        if timed:
            self.times.append(elapsed)

    def milliseconds(self) -> dict[str, float]:
        return {"ms_median": 1e3 * statistics.median(self.times),
                "ms_mean": 1e3 * statistics.fmean(self.times)}


def measure(spec: str, steps: int, warmup: int, max_seconds: float, root: Path,
            paired: bool = False) -> dict[str, object]:
    """Run one spec: `warmup` untimed steps, then `steps` timed steps; return its record.

    Slow tools stop early: warm-up after max_seconds / 4 (at least one step), timing after
    max_seconds (at least `MIN_TIMED_STEPS` steps). The record says how many steps ran.
    paired: plain training takes turns with the tool every `PAIRED_BLOCK` steps, in this
    process, on a copy of the model that shares its parameter tensors (the tool's hooks are
    not on it); its times come as plain_ms_median/_mean. A ratio of the two is free of the
    ~10% by which a plain step varies from one process (and memory layout) to the next.
    """
    model_name = parse_spec(spec)[1]
    torch.manual_seed(0)
    model = build_model(model_name)
    # the same parameter tensors: where a model's memory lands alone moves a step by ~10%
    twin = _sharing_parameters(model) if paired else None
    trainer = _Trainer(spec, root, model)
    trainers = [trainer]
    plain = _Trainer(f"plain:{model_name}:train", root, twin) if twin is not None else None
    if plain is not None:
        trainers.append(plain)

    def more() -> bool:
        return len(trainer.times) < steps and (len(trainer.times) < MIN_TIMED_STEPS
                                               or time.perf_counter() - begin < max_seconds)

    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON lines
        begin = time.perf_counter()
        while trainer.done < warmup and (trainer.done == 0
                                         or time.perf_counter() - begin < max_seconds / 4):
            for t in trainers:
                t.step(timed=False)
        warmed, begin = trainer.done, time.perf_counter()
        while more():
            for t in trainers:  # who goes first alternates: neither always follows the other
                for _ in range(PAIRED_BLOCK if paired else 1):
                    if t is trainer and not more():
                        break
                    t.step(timed=True)
            trainers.reverse()
        start = time.perf_counter()
        size, stored = trainer.setup.finish(trainer.done)
        close_s = time.perf_counter() - start
    record: dict[str, object] = {"spec": spec, **trainer.milliseconds(),
                                 "steps": len(trainer.times), "warmup": warmed}
    if plain is not None:
        record.update({f"plain_{k}": v for k, v in plain.milliseconds().items()})
    record.update({"close_s": close_s, "bytes": size, "stored_steps": stored,
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "versions": versions(trainer.tool)})
    return record


def one_line(exc: BaseException) -> str:
    """The exception as one line, with the innermost frame that raised it."""
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" [{Path(frame.filename).name}:{frame.lineno}]" if frame else ""
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}{where}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", metavar="TOOL:MODEL:MODE")
    parser.add_argument("--steps", type=int, default=60, help="timed steps (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument("--max-seconds", type=float, default=10,
                        help="stop timing after this long (at least 3 timed steps)")
    parser.add_argument("--dir", type=Path, required=True, help="folder for the stores")
    parser.add_argument("--paired", action="store_true",
                        help="plain training takes turns with each spec in the same process "
                             f"({PAIRED_BLOCK} steps each)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    for spec in args.specs:
        try:
            record = measure(spec, args.steps, args.warmup, args.max_seconds, args.dir,
                             args.paired)
        except Exception as exc:  # noqa: BLE001 - reported as one line, the next spec runs
            record = {"spec": spec, "error": one_line(exc)}
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
