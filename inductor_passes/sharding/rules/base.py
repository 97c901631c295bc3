"""The vocabulary every rule speaks: OpSpec, the tensor arguments of a node (``core.nodes``), and
the expansion of one-mesh-axis options to an N-D mesh."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Replicate

from ...core.nodes import node_arg, tensor_args, val_shape  # noqa: F401  (the rules' vocabulary)
from ...core.placements import Placements, valid_for

GETITEM = operator.getitem


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Input placements (one per tensor argument, in ``tensor_args`` order) -> output placements
    (a tuple of Placements for a single tensor output, or a tuple of those for several)."""

    inputs: tuple[Placements, ...]
    output: object
    source: str


# ---------------------------------------------------------------------------------------------
# Expansion: per-axis options -> N-D OpSpecs
# ---------------------------------------------------------------------------------------------
AxisOption = tuple[tuple[Placement, ...], Placement]  # (per tensor arg, output) on one axis


def expand_to_mesh(options: Sequence[AxisOption], mesh_shape: Sequence[int], in_shapes, out_shape,
                   source: str) -> list[OpSpec]:
    """Cartesian product of one-axis options over the mesh axes, keeping only valid placements."""
    multi = [((ins, (out,))) for ins, out in options]
    return [OpSpec(s.inputs, s.output[0], source)
            for s in expand_multi_output(multi, mesh_shape, in_shapes, [out_shape], source)]


def expand_multi_output(options, mesh_shape: Sequence[int], in_shapes, out_shapes,
                        source: str) -> list[OpSpec]:
    """``expand_to_mesh`` for ops with several tensor outputs: each option is
    (per tensor arg, per output) on one axis; OpSpec.output is a tuple of Placements. An output
    whose shape is None (an output the op does not compute: convolution_backward's masked
    gradients) gets None."""
    return expand_per_axis([options] * len(mesh_shape), mesh_shape, in_shapes, out_shapes, source)


def expand_per_axis(per_axis, mesh_shape: Sequence[int], in_shapes, out_shapes,
                    source: str) -> list[OpSpec]:
    """``expand_multi_output`` with its own option list per mesh axis (options whose legality
    depends on the axis's size, as a head split in grouped-query attention)."""
    specs = []
    for combo in itertools.product(*per_axis):
        ins = tuple(tuple(opt[0][i] for opt in combo) for i in range(len(in_shapes)))
        outs = tuple(tuple(opt[1][j] for opt in combo) if out_shapes[j] is not None else None
                     for j in range(len(out_shapes)))
        if all(valid_for(s, p, mesh_shape) for s, p in zip(out_shapes, outs) if s is not None) \
                and all(valid_for(s, p, mesh_shape) for s, p in zip(in_shapes, ins)):
            specs.append(OpSpec(ins, outs, source))
    return specs


def replicated_spec(node: fx.Node, ndim_mesh: int, source: str) -> OpSpec:
    """Every tensor input and output Replicate on every mesh axis."""
    rep = tuple(Replicate() for _ in range(ndim_mesh))
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        out: object = tuple(rep if isinstance(v, torch.Tensor) else None for v in val)
    else:
        out = rep
    return OpSpec(tuple(rep for _ in tensor_args(node)), out, source)
