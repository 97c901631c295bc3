"""A tensor-parallel block with three planted graph breaks and a rank-dependent branch, for
tests/test_explain.py and as a demo:

    python -m dynamo_dist explain tests/data/explain_breaks.py

Runs on a `fake` process group (world of 2, rank 0): plans and ledgers are right, values not.
The marker comments name the lines the report must point at.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dynamo_dist.plans import ShardingPlan, shard_module


class Block(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x, temperature):
        h = self.up(x).relu()
        print("hidden", tuple(h.shape))  # BREAK: print
        if dist.get_rank() == 0:  # RANK-BRANCH
            h = h * 1.0
        t = temperature.item()  # BREAK: item
        bias = distribute_tensor(torch.zeros(8), self.mesh, [Replicate()])  # BREAK: distribute
        return self.down(h / t) + bias


def build(mesh):
    """The sharded block and its inputs (a batch and a temperature)."""
    torch.manual_seed(0)
    plan = ShardingPlan(plan={"up.weight": {"tp": Shard(0)}, "up.bias": {"tp": Shard(0)},
                              "down.weight": {"tp": Shard(1)}})
    return shard_module(Block(mesh), mesh, plan), (torch.randn(4, 8), torch.tensor(2.0))


def fake_mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def main():
    model, inputs = build(fake_mesh())
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    out = compiled(*inputs)
    print("output", type(out).__name__, tuple(out.shape))


if __name__ == "__main__":
    main()
