"""Grouped GEMM (a mixture of experts' expert matmuls): ``aten._grouped_mm`` and the custom op
transformers' ``grouped_mm`` experts path emits under torch.compile for non-bf16 weights
(``transformers::grouped_mm_fallback`` and its backward; torch 2.13's ``_grouped_mm`` meta
function accepts bf16 only).

``_grouped_mm(A, B, offs)`` has four forms (``offs``: cumulative group ends, int32):

===========  ==============  ===============  ==============  =======================
form         A               B                out             groups
===========  ==============  ===============  ==============  =======================
2d x 3d      [M, K]          [G, K, N]        [M, N]          rows of A (offs over M)
3d x 3d      [G, M, K]       [G, K, N]        [G, M, N]       batch (no offs)
2d x 2d      [M, K]          [K, N]           [G, M, N]       K (offs over K)
3d x 2d      [G, M, K]       [K, N]           [M, N]          columns (offs over N)
===========  ==============  ===============  ==============  =======================

A dim that ``offs`` cuts into groups is never split (offs names GLOBAL positions), nor is the
group dim G unless every operand has it (3d x 3d). The other dims split as in a matmul: M
(rows), N (columns), K (contraction: Partial), and Partial passes through A or B alone
(linear in each). The transformers ops are the 2d x 3d form; its backward
``(input [M, K], weight [G, K, N], offs, grad [M, N]) -> (grad_input, grad_weight)`` splits K
or N with the forward, and Partial passes through any one of input, weight, grad.

torch's kernel needs 16-byte aligned strides: a split of one of the last two dims of an
``aten._grouped_mm`` operand is kept only if its even pieces stay aligned.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .base import OpSpec, RuleKind, expand_multi_output, expand_to_mesh, tensor_args, val_shape

P = Partial("sum")
R = Replicate()
ATEN = "aten::_grouped_mm.default"
FALLBACK = "transformers::grouped_mm_fallback.default"
FALLBACK_BWD = "transformers::grouped_mm_fallback_backward.default"
GROUPED_MM = (ATEN, FALLBACK, FALLBACK_BWD)

# per form: (A placement, B placement) -> out placement, on one mesh axis, beside all-Replicate
# and the linear Partials
_FORMS = {
    (2, 3): [((R, Shard(2)), Shard(1)),                 # N
             ((Shard(1), Shard(1)), P)],                # K
    (3, 3): [((Shard(0), Shard(0)), Shard(0)),          # G (batch)
             ((Shard(1), R), Shard(1)),                 # M
             ((R, Shard(2)), Shard(2)),                 # N
             ((Shard(2), Shard(1)), P)],                # K
    (2, 2): [((Shard(0), R), Shard(1)),                 # M
             ((R, Shard(1)), Shard(2))],                # N
    (3, 2): [((Shard(1), R), Shard(0)),                 # M
             ((Shard(2), Shard(0)), P)],                # K
}


def grouped_mm_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    name = f"{node.target._schema.name}.{node.target._schema.overload_name or 'default'}"
    targs = tensor_args(node)
    shapes = [val_shape(a) for a in targs]
    if name == FALLBACK_BWD:
        return _fallback_backward(node, shapes, mesh_shape)
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    if bias is not None:
        return []  # (not supported by torch 2.13's kernels either)
    form = (len(shapes[0]), len(shapes[1]))
    if form not in _FORMS:
        return []
    rest = (R,) * (len(targs) - 2)  # offs: always whole
    options = [((R, R, *rest), R), ((P, R, *rest), P), ((R, P, *rest), P)]
    options += [((pa, pb, *rest), out) for (pa, pb), out in _FORMS[form]]
    specs = expand_to_mesh(options, mesh_shape, shapes, val_shape(node), RuleKind.GROUPED_MM)
    if name == ATEN:
        specs = [s for s in specs if _aligned(shapes + [val_shape(node)],
                                              [*s.inputs, s.output], targs[0], mesh_shape)]
    return specs


def _fallback_backward(node: fx.Node, shapes, mesh_shape) -> list[OpSpec]:
    """(input [M, K], weight [G, K, N], offs [G], grad [M, N]) -> (grad_input [M, K],
    grad_weight [G, K, N]): grad_input = grad @ weight^T per group, grad_weight = input^T @
    grad per group."""
    out_shapes = [tuple(v.shape) for v in node.meta["val"]]
    options = [
        ((R, R, R, R), (R, R)),
        ((R, Shard(2), R, Shard(1)), (P, Shard(2))),          # N split with the forward
        ((Shard(1), Shard(1), R, R), (Shard(1), Shard(1))),   # K split with the forward
        ((R, R, R, P), (P, P)),                               # linear in grad
        ((P, R, R, R), (R, P)),                               # grad_weight linear in input
        ((R, P, R, R), (P, R)),                               # grad_input linear in weight
    ]
    return expand_multi_output(options, mesh_shape, shapes, out_shapes,
                               RuleKind.GROUPED_MM_FALLBACK)


def _aligned(shapes, placements, a: fx.Node, mesh_shape) -> bool:
    """Even pieces whose last two dims keep torch's 16-byte stride alignment."""
    align = 16 // a.meta["val"].element_size()
    for shape, pls in zip(shapes, placements):
        for axis, p in enumerate(pls):
            if type(p) is Shard and p.dim >= len(shape) - 2:
                n = mesh_shape[axis]
                if shape[p.dim] % n or (shape[p.dim] // n) % align:
                    return False
    return True
