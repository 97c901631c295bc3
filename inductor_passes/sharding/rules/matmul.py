"""The matmul family as einsum strings: batch and free letters shard through, a split
contraction letter gives Partial(sum)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .base import AxisOption, OpSpec, RuleKind, RuleSource, expand_to_mesh, tensor_args, val_shape

aten = torch.ops.aten

EINSUM = {aten.mm.default: "mk,kn->mn", aten.bmm.default: "bmk,bkn->bmn"}


def einsum_strategy(node: fx.Node, equation: str, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Rule for a two-operand einsum: batch/free letters shard through, contraction -> Partial."""
    lhs_rhs, out = equation.split("->")
    lhs, rhs = lhs_rhs.split(",")
    options: list[AxisOption] = [((Replicate(), Replicate()), Replicate())]
    for letter in dict.fromkeys(lhs + rhs):
        in_l, in_r, in_o = letter in lhs, letter in rhs, letter in out
        a = Shard(lhs.index(letter)) if in_l else Replicate()
        b = Shard(rhs.index(letter)) if in_r else Replicate()
        if in_o:
            options.append(((a, b), Shard(out.index(letter))))
        elif in_l and in_r:
            options.append(((a, b), Partial("sum")))
    options.append(((Partial("sum"), Replicate()), Partial("sum")))
    options.append(((Replicate(), Partial("sum")), Partial("sum")))
    targs = tensor_args(node)
    return expand_to_mesh(options, mesh_shape, [val_shape(a) for a in targs], val_shape(node),
                          RuleSource(RuleKind.EINSUM, equation))

