"""Overhead of the HF Trainer callback on steps it neither records nor instruments.

Trains a small GPT-2 (from a config) with `Trainer.train()` for STEPS optimizer steps,
alternating runs without and with `DeepscopeCallback(schedule=never, instruments=None)`
(the per-step cost: a scope step, the forward hook, the loss KPI, the health check), also
with anomalies=False, and prints the median wall time of each and the overheads. On a
noisy machine the difference of whole runs drowns in the noise, so it also prints the time
spent inside the callback's own hooks (step open / close, the forward hook) as a share of
train() — a lower bound of the overhead that the noise does not move much.

Run:  python benchmarks/hf_callback_overhead.py [--steps 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from deepscope import never
from deepscope.integrations.transformers import DeepscopeCallback


class TimedCallback(DeepscopeCallback):
    """Adds up the seconds spent in the callback's per-step hooks."""

    seconds = 0.0

    def _timed(self, method, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            TimedCallback.seconds += time.perf_counter() - start

    def on_step_begin(self, *args, **kwargs):
        return self._timed(super().on_step_begin, *args, **kwargs)

    def on_optimizer_step(self, *args, **kwargs):
        return self._timed(super().on_optimizer_step, *args, **kwargs)

    def _on_forward(self, *args, **kwargs):
        return self._timed(super()._on_forward, *args, **kwargs)


def train_seconds(steps: int, folder: str, callback: str, run: str) -> float:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2,
                                       n_head=2))
    ids = torch.randint(0, 128, (steps * 16, 64))
    data = [{"input_ids": i, "labels": i} for i in ids]
    args = TrainingArguments(output_dir=f"{folder}/hf", max_steps=steps,
                             per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             report_to="none", save_strategy="no", logging_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    options = {"": None, "callback": {}, "no health check": {"anomalies": False}}[callback]
    callbacks = [] if options is None else [TimedCallback(folder, run, schedule=never,
                                                          **options)]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"": [], "callback": [], "no health check": []}
    inside: dict[str, list[float]] = {"callback": [], "no health check": []}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeats):
            for variant, seconds in times.items():
                TimedCallback.seconds = 0.0
                seconds.append(train_seconds(args.steps, folder, variant, f"r{i}{variant[:2]}"))
                if variant:
                    inside[variant].append(TimedCallback.seconds / seconds[-1])
    base = statistics.median(times[""])
    print(f"Trainer.train(), {args.steps} steps x 2 micro-batches, median of {args.repeats}: "
          f"without the callback {base:.3f} s")
    for variant in ("callback", "no health check"):
        t = statistics.median(times[variant])
        label = "with the callback" + (" (anomalies=False)" if variant != "callback" else "")
        print(f"  {label}: {t:.3f} s, overhead {100 * (t / base - 1):+.1f}%; inside its "
              f"hooks: {100 * statistics.median(inside[variant]):.1f}% of train()")


if __name__ == "__main__":
    main()
