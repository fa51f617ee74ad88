"""Record a Lightning training run with deepscope, then explore it.

    python examples/lightning_train.py [PROJECT]     # default project folder: runs
    deepscope serve runs

The two deepscope lines: `training_step` returns the per-sample losses under
"per_sample_loss", and the Trainer gets `DeepscopeCallback(...)`.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from deepscope.integrations.lightning import DeepscopeCallback


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        self.log("accuracy", (logits.argmax(1) == y).float().mean())
        return {"loss": losses.mean(), "per_sample_loss": losses}  # deepscope reads both

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(project: str = "runs") -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4  # a learnable rule
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64,
                                       shuffle=True)
    callback = DeepscopeCallback(project, "lightning", schedule=10, instruments="economy",
                                 instrument_schedule=2, activations=True, overwrite=True)
    trainer = pl.Trainer(max_steps=100, accumulate_grad_batches=2, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[callback])
    trainer.fit(Classifier(), data)
    print(f"recorded {project}/lightning; explore it with: deepscope serve {project}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
