"""Sharded parameters (FSDP2, FSDP1, a DTensor parameter): the instruments refuse them in one
line instead of computing each rank's shard as if it were the whole model."""

from __future__ import annotations

from tests.distributed.harness import launch


def refusals(rank: int, world: int, out_dir) -> dict:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import deepscope
    from deepscope.instruments import Instruments

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def refusal(make) -> str:
        try:
            make()
        except ValueError as error:
            return str(error)
        return "accepted"

    fsdp2 = mlp()
    for layer in (fsdp2[0], fsdp2[2], fsdp2):
        fully_shard(layer)
    fsdp2(torch.randn(3, 4)).sum().backward()  # it trains on CPU with gloo
    fsdp1 = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
    tensor_parallel = mlp()
    mesh = init_device_mesh("cpu", (world,))
    tensor_parallel[0].weight = nn.Parameter(
        distribute_tensor(tensor_parallel[0].weight.detach(), mesh, [Shard(0)]))
    scope = deepscope.Scope(out_dir / f"rank{rank}", "fsdp", instruments="economy")
    try:
        through_scope = refusal(lambda: scope.watch(fsdp2))
    finally:
        scope.close()
    return {
        "fsdp2": refusal(lambda: Instruments(fsdp2, "economy")),
        "scope": through_scope,
        "fsdp1": refusal(lambda: Instruments(fsdp1, "business")),
        "dtensor": refusal(lambda: Instruments(tensor_parallel, "economy")),
        "plain": refusal(lambda: Instruments(mlp(), "economy")),
    }


def test_sharded_models_are_refused_in_one_line(tmp_path):
    for result in (r.check() for r in launch("tests.distributed.test_fsdp:refusals", tmp_path)):
        assert result["plain"] == "accepted"
        for key, found in (("fsdp2", "FSDP2 (fully_shard) module '<root>'"),
                           ("scope", "FSDP2 (fully_shard) module '<root>'"),
                           ("fsdp1", "FullyShardedDataParallel module '<root>'"),
                           ("dtensor", "a DTensor parameter '0.weight'")):
            message = result[key]
            assert message.startswith("deepscope's instruments: parameters sharded across "
                                      "ranks are not supported"), message
            assert f"(the model has {found})" in message and "\n" not in message
            assert "instrument a DDP run" in message and "LIMITATIONS.md" in message
