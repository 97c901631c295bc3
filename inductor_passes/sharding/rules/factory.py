"""Factory ops that fill a fresh tensor with one value (``full``, ``zeros``, ``ones``, ``empty``).

Every element is the same, so each rank can make its own piece: the output may be split on any
dim (lowering rewrites the size argument to the local shape: ``lowering.SIZE_ARG``). A zero fill
may also be a pending sum (every rank's zeros add up to zeros), so an accumulator can start
where its Partial contributions are. Without this rule a factory with no tensor input is
Replicate: at Llama-3-8B shapes the loss gradient's ``full([B*S, vocab])`` was 8 GiB on every
rank. Random draws and ``iota`` are not here (their elements differ by position).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .base import OpSpec, RuleKind, expand_to_mesh, node_arg, val_shape

aten = torch.ops.aten

# op -> how to read its fill value (None: the op leaves values undefined, so no Partial)
FILLS = {aten.full.default: lambda n: node_arg(n, 1, "fill_value"),
         aten.zeros.default: lambda n: 0, aten.ones.default: lambda n: 1,
         aten.empty.memory_format: lambda n: None}


def factory_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Replicate, Shard(d) for every dim d, and Partial(sum) for a zero fill, on each mesh axis
    (global output shape: the node's traced value). Replicate first: the plan of an op nobody
    splits stays what it was."""
    shape = val_shape(node)
    options = [((), Replicate())] + [((), Shard(d)) for d in range(len(shape))]
    fill = FILLS[node.target](node)
    if fill is not None and not isinstance(fill, fx.Node) and fill == 0:
        options.append(((), Partial("sum")))
    return expand_to_mesh(options, mesh_shape, [], shape, RuleKind.FACTORY)
