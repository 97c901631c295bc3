"""Compiled without autograd (torch.no_grad): forward-only graph, DTensor outputs."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from dynamo_dist import compile_records
from dynamo_dist.plans import TensorParallelPlanner, shard_module


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_no_grad_forward_only(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    model = MLP()
    shard_module(model, mesh, TensorParallelPlanner().build_plan(model))
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    with torch.no_grad():
        out = compiled(torch.randn(8, 16))
    assert isinstance(out, DTensor) and tuple(out.shape) == (8, 16)
    assert not any(isinstance(p, Partial) for p in out.placements)
    record = compile_records()[-1]
    assert record.step.joint.backward is None
    # one all_reduce after the row-parallel layer, nothing in a backward
    assert record.ledger.count(phase="forward") == 1 and record.ledger.count(phase="backward") == 0
