"""Workload ``mlp``: a Megatron MLP, 1024 -> 4096 -> 1024 (Linear, GELU, Linear), batch 64, MSE loss
against a random target, tp=2 on 2 ranks (fc1 column-parallel, fc2 row-parallel).

    python -m benchmarks.mlp [options of benchmarks.run]
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from benchmarks.bench.workload import Batch, Workload

IN, HIDDEN, BATCH = 1024, 4096, 64


class MLP(nn.Module):
    """fc1 -> GELU -> fc2; ``forward(x, y)`` returns the MSE loss of the output against ``y``."""

    def __init__(self, width: int = IN, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(x))), y)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(1234 + step)
    return Batch((torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, IN, generator=g)))


def torch_tp_plan(model: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


WORKLOAD = Workload(
    name="mlp",
    description=f"MLP {IN}->{HIDDEN}->{IN} (GELU), batch {BATCH}, MSE loss, AdamW; tp=2",
    mesh={"tp": 2},
    build_model=build_model,
    batch=batch,
    loss=lambda out: out,
    torch_tp_plan=torch_tp_plan,
)

if __name__ == "__main__":
    from benchmarks import run

    sys.exit(run.main(["--workloads", WORKLOAD.name, *sys.argv[1:]]))
