"""The demo's task and model: the comgra tutorial's sign-of-sum task and its recurrent net.

Task: a sequence of N tuples of 5 numbers in [-1, 1] is 5 independent sequences; the target
per sequence is 1 if its sum is positive, else 0. Model: three small submodules (pre, memory,
out) unrolled over the sequence. The *bugged* variant applies the activation (leaky ReLU,
slope 0.01) after the last layer of every submodule too, so the logits before the output
sigmoid can barely go negative: their negative values are ~100x smaller than the positive ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SLOPE = 0.01   # leaky ReLU negative slope, as in the comgra tutorial
FEATURES = 5   # independent sequences per sample


class SubNet(nn.Module):
    """Two linear layers with a leaky ReLU between them (and after them, if `bugged`)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, bugged: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_out)
        self.bugged = bugged

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (hidden activation, output)."""
        hidden = F.leaky_relu(self.fc1(x), SLOPE)
        out = self.fc2(hidden)
        if self.bugged:  # the bug: an activation on the last layer squashes negative outputs
            out = F.leaky_relu(out, SLOPE)
        return hidden, out


class RecurrentNet(nn.Module):
    """One iteration of the recurrent net: (input tuple, memory) -> named intermediate tensors.

    pre reads the input and the memory; memory writes the next memory; out gives the logits.
    """

    def __init__(self, hidden: int = 32, memory: int = 16, bugged: bool = False) -> None:
        super().__init__()
        self.memory_size = memory
        self.pre = SubNet(FEATURES + memory, hidden, hidden, bugged)
        self.memory = SubNet(hidden, hidden, memory, bugged)
        self.out = SubNet(hidden, hidden, FEATURES, bugged)

    def initial_memory(self, batch: int) -> torch.Tensor:
        """The memory before the first iteration: zeros."""
        return torch.zeros(batch, self.memory_size)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return the iteration's tensors by the names the demo records them under.

        "memory.out" is the next memory; "out.pre_sigmoid" are the logits.
        """
        pre_hidden, pre_out = self.pre(torch.cat([x, memory], dim=1))
        mem_hidden, mem_out = self.memory(pre_out)
        out_hidden, logits = self.out(pre_out)
        return {"pre.hidden": pre_hidden, "pre.out": pre_out, "memory.hidden": mem_hidden,
                "memory.out": mem_out, "out.hidden": out_hidden, "out.pre_sigmoid": logits}


def make_batch(batch: int, length: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (batch, length, 5) uniform in [-1, 1] and targets (batch, 5): 1 where sum > 0."""
    x = torch.rand(batch, length, FEATURES, generator=generator) * 2 - 1
    return x, (x.sum(dim=1) > 0).float()
