"""Indexing and scatter ops: the embedding backward's accumulate, slice_scatter."""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .base import AxisOption, OpSpec, expand_to_mesh, tensor_args, val_shape

# ---------------------------------------------------------------------------------------------
# Embedding backward: accumulate rows of ``values`` into ``self`` at ``indices``
# ---------------------------------------------------------------------------------------------
def index_put_accumulate_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """``_unsafe_masked_index_put_accumulate(self, mask, [idx], values)``, self: [V, *F],
    idx and mask: [*I], values: [*I, *F].

    Per mesh axis: all Replicate; values split on an index dim (with idx and mask split the same
    way) accumulates partial sums (self and output Partial); values split on a feature dim splits
    self and the output on that dim.
    """
    self_n, mask_n, idx_list, values_n = node.args
    if len(idx_list) != 1 or not isinstance(idx_list[0], fx.Node):
        return []
    targs = tensor_args(node)
    shapes = [val_shape(a) for a in targs]
    n_index = len(shapes[1])
    n_feat = len(shapes[0]) - 1
    options: list[AxisOption] = [(tuple(Replicate() for _ in targs), Replicate())]
    for d in range(n_index):
        options.append(((Partial("sum"), Shard(d), Shard(d), Shard(d)), Partial("sum")))
    for f in range(n_feat):
        options.append(((Shard(1 + f), Replicate(), Replicate(), Shard(n_index + f)), Shard(1 + f)))
    options.append(((Partial("sum"), Replicate(), Replicate(), Partial("sum")), Partial("sum")))
    return expand_to_mesh(options, mesh_shape, shapes, val_shape(node), "index_put_accumulate")


# ---------------------------------------------------------------------------------------------
# slice_scatter(input, src, dim, start, end, step): src written into a slice of input
# ---------------------------------------------------------------------------------------------
def slice_scatter_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Both operands split on any dim but the scattered one; Partial in both (linear)."""
    if not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return []
    shape = val_shape(node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim % len(shape)
    src_shape = val_shape(node.args[1])
    options: list[AxisOption] = [((Replicate(), Replicate()), Replicate())]
    for d in range(len(shape)):
        if d != dim:
            options.append(((Shard(d), Shard(d)), Shard(d)))
    options.append(((Partial("sum"), Partial("sum")), Partial("sum")))
    return expand_to_mesh(options, mesh_shape, [shape, src_shape], shape, "slice_scatter")


