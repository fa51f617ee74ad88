"""Train and record the demo's two runs (bugged and fixed), then optionally serve the GUI."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..recorder import Scope, StepRecorder, every, per_kind
from .config import DEFAULT_PATH, DEFAULT_PORT, DemoConfig
from .task import RecurrentNet, make_batch

RUNS = {"bugged": True, "fixed": False}  # run name -> activation on the last layers
class DemoResult(TypedDict):
    """What `run_demo` returns."""

    path: Path                     # the project folder
    runs: dict[str, Path]          # run name -> run folder
    final_loss: dict[str, float]   # run name -> loss of the last step (same batch in both)
    tail_loss: dict[str, float]    # run name -> mean loss over the last 10 % of steps
    tail_accuracy: dict[str, float]  # run name -> mean accuracy over the last 10 % of steps
    instruments: str | tuple[str, ...] | None  # the instruments used; None if unavailable
    seconds: float                 # wall time of the training and recording
    size_bytes: int                # recorded size on disk of the project folder


def run_demo(path: str | Path = DEFAULT_PATH, *, steps: int | None = None,
             serve: bool = False, port: int = DEFAULT_PORT, progress: bool = True,
             config: DemoConfig | None = None) -> DemoResult:
    """Record the comgra tutorial's bug hunt: runs `bugged` and `fixed` into `path`.

    Both runs see the same data and start from the same weights; only the bug differs.
    steps: training steps per run (default: `config.steps`). Existing demo runs in `path`
    are replaced. With `serve`, the GUI is started on `port` afterwards (blocks until
    interrupted).
    """
    cfg = config or DemoConfig()
    if steps is not None:
        cfg = dataclasses.replace(cfg, steps=steps)
    if isinstance(cfg.steps, bool) or not isinstance(cfg.steps, int) or cfg.steps < 10:
        raise ValueError(f"steps must be an integer >= 10, got {cfg.steps!r}")
    project = Path(path)
    instruments = _instrument_config(cfg.instruments)
    started = time.perf_counter()
    tails: dict[str, list[float]] = {}
    accs: dict[str, list[float]] = {}
    with _single_thread():
        for name, bugged in RUNS.items():
            tails[name], accs[name] = _train(project, name, bugged, cfg, instruments, progress)
    result = DemoResult(
        path=project, runs={name: project / name for name in RUNS},
        final_loss={n: t[-1] for n, t in tails.items()},
        tail_loss={n: sum(t) / len(t) for n, t in tails.items()},
        tail_accuracy={n: sum(a) / len(a) for n, a in accs.items()},
        instruments=instruments, seconds=time.perf_counter() - started,
        size_bytes=sum(f.stat().st_size for f in project.rglob("*") if f.is_file()))
    if serve:
        serve_demo(project, port)
    return result


def serve_demo(path: Path, port: int = DEFAULT_PORT) -> None:
    """Serve the GUI on the demo's project folder (it prints the URL), or say how to once the
    GUI can be imported."""
    try:
        from ..gui import serve
    except ImportError as exc:  # the GUI extra (dash) is not installed
        print(f"the GUI is not available here ({exc}); install it with "
              f"pip install 'deepscope[gui]', then run:\n  deepscope serve {path} --port {port}")
        return
    serve(path, host="127.0.0.1", port=port)


def _instrument_config(wanted: str | tuple[str, ...]) -> str | tuple[str, ...] | None:
    """`wanted` when the instrument suite is importable; otherwise warn and record without."""
    try:
        importlib.import_module("deepscope.instruments.suite")
    except ImportError as exc:
        warnings.warn(f"deepscope demo: instruments unavailable ({exc}); recording without "
                      "them", RuntimeWarning, stacklevel=3)
        return None
    return wanted


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """Run with one intra-op thread: for matrices this small, thread hand-offs cost ~10x
    more than the arithmetic, especially on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(project: Path, name: str, bugged: bool, cfg: DemoConfig,
           instruments: str | tuple[str, ...] | None, progress: bool
           ) -> tuple[list[float], list[float]]:
    """Train and record one run; return the losses and accuracies of the last 10 % of steps."""
    torch.manual_seed(cfg.seed)  # same initial weights in both runs
    data = torch.Generator().manual_seed(cfg.seed + 1)  # same batches in both runs
    pick = random.Random(cfg.seed)  # same sequence lengths in both runs
    model = RecurrentNet(cfg.hidden, cfg.memory, bugged=bugged)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    # Each kind recorded about `recordings_per_kind` times, however many steps: bounded size.
    every_n = max(1, cfg.steps // cfg.recordings_per_kind)
    scope = Scope(project, run=name, schedule=per_kind(every_n), instruments=instruments,
                  instrument_schedule=every(max(10, cfg.steps // cfg.instrument_points)),
                  max_samples=4, overwrite=True, seed=cfg.seed,
                  # the exact Hessian diagonal would cost one HVP per parameter (4,565)
                  instrument_options={"curvature": "hutchinson"})
    tail_from = cfg.steps - max(1, cfg.steps // 10)
    losses: list[float] = []
    accuracies: list[float] = []
    try:
        scope.watch(model, optimizer=opt, node_depth=1)  # one parameter node per submodule
        scope.note(f"{name}: " + ("leaky ReLU also on the last layer of pre, memory and out "
                                  "(the bug)" if bugged else "no activation on last layers"))
        scope.note(f"task: sign of the sum of 5 sequences; lengths {list(cfg.lengths)}, "
                   f"batch {cfg.batch}, Adam lr {cfg.lr}, {cfg.steps} steps, seed {cfg.seed}")
        with tqdm(range(cfg.steps), desc=f"{name:>6}", unit="step", disable=not progress,
                  dynamic_ncols=True) as bar:
            for step in bar:
                length = pick.choice(cfg.lengths)
                x, y = make_batch(cfg.batch, length, data)
                with scope.step(step, kind=f"len_{length:02d}") as rec:
                    loss, acc = _step(rec, model, opt, x, y)
                if step >= tail_from:
                    losses.append(loss)
                    accuracies.append(acc)
                if step % 50 == 0 or step == cfg.steps - 1:
                    bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}", refresh=False)
        scope.note(f"{name}: final loss {losses[-1]:.4f}, mean loss over the last "
                   f"{len(losses)} steps {sum(losses) / len(losses):.4f}")
    finally:
        scope.close()
    return losses, accuracies


def _step(rec: StepRecorder, model: RecurrentNet, opt: torch.optim.Optimizer,
          x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One training step over a whole sequence, unrolled: one recorded iteration per element."""
    length = x.shape[1]
    memory = model.initial_memory(x.shape[0])
    for i in range(length):
        with rec.iteration():
            x_i = x[:, i]
            rec.tensor("input", x_i, role="input")
            if i == 0:
                rec.tensor("initial_memory", memory)
            # A helper next to the target: the sum so far, whose sign the net must learn.
            rec.tensor("partial_sum", x[:, :i + 1].sum(dim=1))
            named = model(x_i, memory)
            for tensor_name, t in named.items():
                rec.tensor(tensor_name, t)
            logits = named["out.pre_sigmoid"]
            rec.tensor("output", torch.sigmoid(logits), role="output")
            # torch.cat hides its no-grad inputs from autograd, and the helper is computed
            # from the input: draw these edges by hand. Later iterations read memory.out of
            # the previous one, an edge autograd shows (lag 1).
            rec.connect("input", "pre.hidden")
            rec.connect("input", "partial_sum")
            if i == 0:
                rec.connect("initial_memory", "pre.hidden")
            memory = named["memory.out"]
    rec.tensor("target", y, role="target")
    per_sample = F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(dim=1)
    loss = per_sample.mean()
    rec.loss(loss, per_sample=per_sample)
    opt.zero_grad()
    loss.backward()
    opt.step()
    acc = ((logits > 0).float() == y).float().mean()
    rec.kpi("accuracy", acc)
    return loss.item(), acc.item()
