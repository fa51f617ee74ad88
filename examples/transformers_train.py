"""Record a Hugging Face Trainer run (a tiny GPT-2 from a config, nothing downloaded).

    python examples/transformers_train.py [PROJECT]  # default project folder: runs
    deepscope serve runs

The one deepscope line: `callbacks=[DeepscopeCallback(...)]`. The per-sample losses (per
sequence, over its valid tokens) are found from the model's logits and labels.
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from deepscope.integrations.transformers import DeepscopeCallback


def main(project: str = "runs") -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (256, 32))
    ids[:, 1::2] = (ids[:, 0::2] + 1) % 64  # every second token follows from the one before
    labels = ids.clone()
    labels[::4, -8:] = -100  # padding: no loss on these tokens
    data = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    args = TrainingArguments(output_dir=f"{project}/.hf", max_steps=60,
                             per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             learning_rate=1e-3, report_to="none", save_strategy="no",
                             logging_strategy="no", use_cpu=True, disable_tqdm=True)
    callback = DeepscopeCallback(project, "gpt2", schedule=10, instruments="economy",
                                 instrument_schedule=2, overwrite=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    print(f"recorded {project}/gpt2; explore it with: deepscope serve {project}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
