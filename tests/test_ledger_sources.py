"""Every ledger entry names the user's source line, forward and backward, also for programs that
functionalisation retraces (dropout's in-place bernoulli_ makes it retrace)."""

import torch
import torch.nn as nn

from dynamo_dist import compile_records
from dynamo_dist.plans import TensorParallelPlanner, shard_module


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(torch.relu(self.up(x)))  # SOURCE-UP
        return self.down(h).pow(2).mean()      # SOURCE-DOWN


def test_forward_and_backward_collectives_name_user_lines(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    model = Block()
    shard_module(model, mesh, TensorParallelPlanner().build_plan(
        model, example_inputs=(torch.randn(4, 16),)))
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    x = torch.randn(4, 16, requires_grad=True)  # its gradient is a backward all_reduce
    compiled(x).backward()
    entries = compile_records()[-1].ledger.entries
    assert {e.phase for e in entries} == {"forward", "backward"}
    for e in entries:
        assert e.source and __file__ in e.source and "SOURCE-" in e.source, e
