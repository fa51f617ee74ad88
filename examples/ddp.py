"""Record a DistributedDataParallel training run with deepscope, then explore it.

    torchrun --nproc_per_node=2 examples/ddp.py [PROJECT]    # default project folder: runs
    deepscope serve runs

Every rank runs this script (gloo on CPUs, NCCL on GPUs) and writes its own file,
PROJECT/ddp/rank<N>.sqlite. The deepscope lines are the same as in a single process: a
`Scope` (created by every rank at the same point), `scope.watch(ddp)` (it watches the module
inside DDP and leaves the DDP wrapper as it is) and `rec.loss(..., per_sample=...)`. The
instrument values mean the global batch of every step (all ranks' samples; rank 0's file
holds them); each rank's file also holds its own loss, gradient norm and batch size
(docs/distributed.md).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from deepscope import Scope


def main(project: str = "runs") -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))  # torchrun's rank on this machine
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same data and initial model on every rank
    x = torch.randn(1024, 20)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4  # a learnable rule
    shard = torch.arange(rank, len(x), world)  # this rank's samples
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    picks = torch.Generator().manual_seed(rank)
    with Scope(project, "ddp", schedule=10, instruments="economy", instrument_schedule=5,
               overwrite=True) as scope:
        scope.watch(ddp, optimizer=opt)
        for step in range(40):
            batch = shard[torch.randint(len(shard), (32,), generator=picks)]
            xb, yb = x[batch].to(device), y[batch].to(device)
            with scope.step(step) as rec:
                rec.tensor("x", xb, role="input")
                losses = F.cross_entropy(ddp(xb), yb, reduction="none")
                rec.loss(losses.mean(), per_sample=losses)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
    if rank == 0:
        print(f"recorded {project}/ddp ({world} ranks); explore it with: deepscope serve "
              f"{project}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:2])
