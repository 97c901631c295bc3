"""Pooling, forward and backward: any leading (sample or channel) dim splits, spatial dims never.

Every pooling op works on [*L, *S] tensors (L: one or two leading dims, samples and channels;
S: 1-3 spatial dims) and computes each leading index on its own, so every tensor operand and
output splits together on one leading dim. The indices a max pool returns are offsets inside
one spatial plane, so a split leading dim does not change them. A spatial split would cut
windows (a halo exchange we do not lower).

Partial: average pools are linear in their input, and every pooling backward is linear in
grad_output (the other operands Replicate): Partial(sum) in, Partial(sum) out.
``POOL`` lists the ops with their number of spatial dims and that linearity.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .base import OpSpec, RuleKind, expand_multi_output, tensor_args, val_shape

aten = torch.ops.aten
prims = torch.ops.prims

# op -> (spatial dims, or None: the length of the kernel_size argument (Inductor's low-memory max
# pool prims take 2-D and 3-D windows); linear in argument 0)
POOL: dict = {
    aten.max_pool2d_with_indices.default: (2, False),
    aten.max_pool3d_with_indices.default: (3, False),
    aten.max_pool2d_with_indices_backward.default: (2, True),
    aten.max_pool3d_with_indices_backward.default: (3, True),
    aten.avg_pool2d.default: (2, True),
    aten.avg_pool3d.default: (3, True),
    aten.avg_pool2d_backward.default: (2, True),
    aten.avg_pool3d_backward.default: (3, True),
    aten._adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool2d_backward.default: (2, True),
    aten._adaptive_avg_pool3d_backward.default: (3, True),
    aten.adaptive_max_pool2d.default: (2, False),
    aten.adaptive_max_pool3d.default: (3, False),
    aten.adaptive_max_pool2d_backward.default: (2, True),
    aten.adaptive_max_pool3d_backward.default: (3, True),
    aten.fractional_max_pool2d.default: (2, False),
    aten.fractional_max_pool3d.default: (3, False),
    aten.fractional_max_pool2d_backward.default: (2, True),
    aten.fractional_max_pool3d_backward.default: (3, True),
    prims._low_memory_max_pool_with_offsets.default: (None, False),
    prims._low_memory_max_pool_offsets_to_indices.default: (None, False),
}
# Inductor decomposes this op into a scatter_add over a view [N * C, H * W]: a batch split
# unevenly (3 samples on 2 ranks) has no placement there, and the plan gathered the gradient.
# Capture keeps it whole for planning (this rule); lowering decomposes it on local shapes.
POOL_PLANNED_WHOLE = {aten.max_pool2d_with_indices_backward.default}
_FRACTIONAL = {aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default}


def pool_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    spatial, linear = POOL[node.target]
    if spatial is None:
        spatial = len(node.args[1])  # kernel_size
    targs = tensor_args(node)
    shapes = [val_shape(a) for a in targs]
    val = node.meta["val"]
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals]
    lead = len(out_shapes[0]) - spatial
    if lead < 1 or any(len(s) != lead + spatial for s, a in zip(shapes, targs)
                       if not _is_samples(node, a)):
        return []
    R, P = Replicate(), Partial("sum")
    n_out = len(out_shapes)
    options = [(tuple(R for _ in targs), tuple(R for _ in range(n_out)))]
    for d in range(lead):
        ins = tuple(Shard(_samples_dim(s, lead, d)) if _is_samples(node, a) else Shard(d)
                    for a, s in zip(targs, shapes))
        options.append((ins, tuple(Shard(d) for _ in range(n_out))))
    if linear:
        options.append(((P,) + tuple(R for _ in targs[1:]), tuple(P for _ in range(n_out))))
    specs = expand_multi_output(options, mesh_shape, shapes, out_shapes, RuleKind.POOL)
    if isinstance(val, (tuple, list)):
        return specs
    return [OpSpec(s.inputs, s.output[0], s.source) for s in specs]


def _is_samples(node: fx.Node, a: fx.Node) -> bool:
    """fractional_max_pool's random_samples [N, C, len(S)] (N = 1 for an unbatched input)."""
    return node.target in _FRACTIONAL and a is node.args[3]


def _samples_dim(shape: Sequence[int], lead: int, d: int) -> int:
    """The dim of random_samples [N, C, k] that matches leading dim ``d`` of the input."""
    return d + (2 - lead)
