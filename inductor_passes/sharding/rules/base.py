"""The vocabulary every rule speaks: OpSpec, the tensor arguments of a node (``core.nodes``), and
the expansion of one-mesh-axis options to an N-D mesh."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Replicate

from ...core.nodes import node_arg, tensor_args, val_shape  # noqa: F401  (the rules' vocabulary)
from ...core.placements import Placements, valid_for

GETITEM = operator.getitem


class RuleKind(enum.Enum):
    """Which rule (or which stage of the planner) offered an OpSpec. Code branches on the kind;
    the value is what plans and reports print."""
    INPUT = "input"  # a program input's given placement
    COTANGENT = "cotangent"  # a tangent takes its forward output's placement
    GETITEM = "getitem"  # one output of a multi-output op
    OUTPUT = "output"  # the program's outputs: where forward outputs and gradients must land
    FALLBACK = "fallback"  # no rule applied: everything replicated (logged with its cost)
    CONSTRAINT = "constraint"  # a user's sharding constraint
    MANUAL = "manual"  # a local value of a manual region
    CONSTANT = "constant"
    FACTORY = "factory"
    RANDOM = "random"
    CHECK = "check"
    POINTWISE = "pointwise"
    REVERSE = "reverse"
    EINSUM = "einsum"  # detail: the equation
    DTENSOR = "dtensor"  # DTensor's own strategy; detail: the op
    STRIDED = "strided"
    MOMENTS = "moments"
    EMBEDDING = "embedding"
    VOCAB_EMBEDDING = "embedding:vocab"
    ATTENTION = "attention"
    CONV = "conv"
    POOL = "pool"
    GROUPED_MM = "grouped_mm"
    GROUPED_MM_FALLBACK = "grouped_mm_fallback"
    SLICE_SCATTER = "slice_scatter"
    INDEX_PUT = "index_put"
    INDEX_PUT_ACCUMULATE = "index_put_accumulate"
    MASKED_INDEX = "masked_index"
    SCATTER = "scatter"
    GATHER = "gather"
    HISTC = "histc"
    CUMSUM = "cumsum"


@dataclasses.dataclass(frozen=True)
class RuleSource:
    """The rule behind an OpSpec: its kind, and a detail where the kind has several (an einsum's
    equation, the op whose DTensor strategy it is). Prints as ``kind`` or ``kind:detail``."""
    kind: RuleKind
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.detail}" if self.detail else self.kind.value


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Input placements (one per tensor argument, in ``tensor_args`` order) -> output placements
    (a tuple of Placements for a single tensor output, or a tuple of those for several), and the
    rule that offered it (a ``RuleKind`` is taken as its ``RuleSource``; TypeError otherwise)."""

    inputs: tuple[Placements, ...]
    output: object
    source: RuleSource

    def __post_init__(self) -> None:
        if isinstance(self.source, RuleKind):
            object.__setattr__(self, "source", RuleSource(self.source))
        elif not isinstance(self.source, RuleSource):
            raise TypeError(f"OpSpec.source must be a RuleKind or RuleSource, got "
                            f"{self.source!r}")

    @property
    def kind(self) -> RuleKind:
        return self.source.kind


# ---------------------------------------------------------------------------------------------
# Expansion: per-axis options -> N-D OpSpecs
# ---------------------------------------------------------------------------------------------
AxisOption = tuple[tuple[Placement, ...], Placement]  # (per tensor arg, output) on one axis


def expand_to_mesh(options: Sequence[AxisOption], mesh_shape: Sequence[int], in_shapes, out_shape,
                   source: RuleKind | RuleSource) -> list[OpSpec]:
    """Cartesian product of one-axis options over the mesh axes, keeping only valid placements."""
    multi = [((ins, (out,))) for ins, out in options]
    return [OpSpec(s.inputs, s.output[0], source)
            for s in expand_multi_output(multi, mesh_shape, in_shapes, [out_shape], source)]


def expand_multi_output(options, mesh_shape: Sequence[int], in_shapes, out_shapes,
                        source: RuleKind | RuleSource) -> list[OpSpec]:
    """``expand_to_mesh`` for ops with several tensor outputs: each option is
    (per tensor arg, per output) on one axis; OpSpec.output is a tuple of Placements. An output
    whose shape is None (an output the op does not compute: convolution_backward's masked
    gradients) gets None."""
    return expand_per_axis([options] * len(mesh_shape), mesh_shape, in_shapes, out_shapes, source)


def expand_per_axis(per_axis, mesh_shape: Sequence[int], in_shapes, out_shapes,
                    source: RuleKind | RuleSource) -> list[OpSpec]:
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


def replicated_spec(node: fx.Node, ndim_mesh: int, source: RuleKind | RuleSource) -> OpSpec:
    """Every tensor input and output Replicate on every mesh axis."""
    rep = tuple(Replicate() for _ in range(ndim_mesh))
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        out: object = tuple(rep if isinstance(v, torch.Tensor) else None for v in val)
    else:
        out = rep
    return OpSpec(tuple(rep for _ in tensor_args(node)), out, source)
