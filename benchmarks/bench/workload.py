"""What a benchmark workload is: a model, its batches, its loss, its mesh and its two plans.

A workload knows nothing about contestants: it says how to build a fresh model (the same weights
every call), the GLOBAL batch of step ``i`` (the same on every rank), how to read the scalar loss
from the model's output, and the tensor-parallel plan in torch's own terms (``parallelize_module``
styles) plus which submodules FSDP2 wraps on a ``dp`` axis. Our own plan comes from the
project's planners (see contestants).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Batch:
    """Positional and keyword arguments of one forward call; tensors are GLOBAL (full batch)."""

    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)

    def shard(self, index: int, parts: int) -> "Batch":
        """Piece ``index`` of ``parts`` along dim 0 of every tensor (a data-parallel rank's)."""
        def cut(v):
            return v.chunk(parts, dim=0)[index].contiguous() if isinstance(v, torch.Tensor) else v
        return Batch(tuple(cut(a) for a in self.args), {k: cut(v) for k, v in self.kwargs.items()})

    def to(self, device: torch.device) -> "Batch":
        def move(v):
            return v.to(device) if isinstance(v, torch.Tensor) else v
        return Batch(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()})


def adamw(params) -> torch.optim.Optimizer:
    """The optimizer of every contestant: AdamW, lr 1e-3, torch's defaults otherwise."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    mesh:           mesh axis name -> size, e.g. {"tp": 2} or {"dp": 2, "tp": 2}; the run uses
                    prod(sizes) ranks.
    build_model:    () -> a fresh fp32 model with fixed-seed weights (same on every call).
    batch:          step index -> the GLOBAL Batch of that step (same on every rank).
    loss:           model output -> scalar loss tensor.
    torch_tp_plan:  model -> {module fqn: ColwiseParallel() | RowwiseParallel() ...}, the plan
                    ``parallelize_module`` applies on the ``tp`` axis (DTensor contestants).
    fsdp_units:     model -> submodules ``fully_shard`` wraps (before the root) on the ``dp``
                    axis; only used when the mesh has one.
    make_optimizer: parameters -> optimizer (the same for every contestant).
    """

    name: str
    description: str
    mesh: dict[str, int]
    build_model: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[Any], torch.Tensor]
    torch_tp_plan: Callable[[nn.Module], dict]
    fsdp_units: Callable[[nn.Module], list] = lambda model: []
    make_optimizer: Callable[[Any], torch.optim.Optimizer] = adamw

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values())
