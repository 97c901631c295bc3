"""Pointwise ops (``torch.Tag.pointwise`` and a few more), reversals and random draws.

Partial is kept only through ops linear in that argument: add(P, P) = P, mul(P, R) = P,
add(P, 1.0) is not linear.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .base import (AxisOption, OpSpec, RuleKind, expand_multi_output, expand_to_mesh, tensor_args,
                   val_shape)

aten = torch.ops.aten
prims = torch.ops.prims

_EXTRA_POINTWISE = {
    prims.convert_element_type.default, prims.fma.default, aten.clone.default,
    aten.alias.default, aten._to_copy.default, aten.where.self, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.fill.Scalar, aten.copy.default, aten.lift_fresh_copy.default,
}
# Ops linear in a set of arguments jointly: Partial(sum/avg) in exactly those (all others
# Replicate) gives a Partial output. add(P, P) = P; mul(P, R) = P; add(P, 1.0) is NOT linear.
_LINEAR_JOINT = {aten.add.Tensor, aten.sub.Tensor}
# a*b + c: linear jointly in (b, c) with a Replicate, or in (a, c) with b Replicate
_LINEAR_SETS = {prims.fma.default: [(1, 2), (0, 2)]}
_LINEAR_ANY_ONE = {aten.mul.Tensor}
_LINEAR_FIRST = {aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default,
                 aten.clone.default, aten.alias.default, prims.convert_element_type.default,
                 aten._to_copy.default, aten.lift_fresh_copy.default}
# reversal along some dims (flip decomposes to prims.rev): any other dim may be split, and a
# pending sum stays pending (a permutation of elements is linear)
REVERSE = {prims.rev.default: 1, aten.flip.default: 1}


def reverse_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    shape = val_shape(node)
    dims = {d % max(len(shape), 1) for d in node.args[REVERSE[node.target]]}
    options: list[AxisOption] = [((Replicate(),), Replicate()), ((Partial(),), Partial())]
    options += [((Shard(d),), Shard(d)) for d in range(len(shape)) if d not in dims]
    return expand_to_mesh(options, mesh_shape, [shape], shape, RuleKind.REVERSE)


def is_random(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def is_pointwise(op) -> bool:
    return op in _EXTRA_POINTWISE or (
        isinstance(op, torch._ops.OpOverload) and
        (torch.Tag.pointwise in op.tags or _prim_with_pointwise_twin(op)))


@functools.lru_cache(maxsize=None)
def _prim_with_pointwise_twin(op) -> bool:
    """prims.sqrt, prims.bitwise_and, ... carry no pointwise tag; their aten twin does. Prims
    take same-shape operands (no broadcasting), so the pointwise rule holds for them as is."""
    if op.namespace != "prims":
        return False
    twin = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
    return twin is not None and any(torch.Tag.pointwise in getattr(twin, o).tags
                                    for o in twin.overloads())


def _linear_sets(node: fx.Node, n_tensors: int) -> list[tuple[int, ...]]:
    op = node.target
    positional_tensors = sum(isinstance(a, fx.Node) for a in node.args[:2])
    if op in _LINEAR_JOINT and n_tensors == 2 and positional_tensors == 2:
        return [(0, 1)]
    if op in _LINEAR_SETS and n_tensors == 3 and all(isinstance(a, fx.Node) for a in node.args[:3]):
        return _LINEAR_SETS[op]
    if op in _LINEAR_ANY_ONE and n_tensors == 2:
        return [(0,), (1,)]
    if op in _LINEAR_ANY_ONE and n_tensors == 1:
        return [(0,)]
    if op in _LINEAR_FIRST and isinstance(node.args[0], fx.Node):
        return [] if _narrows(node) else [(0,)]
    return []


_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
# ops that move the elements of their one input without arithmetic: a sum pending on their
# output is the one pending on their input, re-indexed
_MOVES = {aten.permute.default, aten.t.default, aten.view.default, aten._unsafe_view.default,
          aten.reshape.default, aten.alias.default, aten.clone.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims}


def widened_dtypes(gm: fx.GraphModule) -> dict[fx.Node, torch.dtype]:
    """Float values whose every use casts them to a wider float dtype, directly or through
    re-indexing (under autocast, the bf16 gradient of an fp32 parameter, transposed, then the
    backward of the cast), mapped to the widest of those dtypes. ``EdgePricer`` prices their
    reduction there (``widening_reduction_factor``)."""
    out: dict[fx.Node, torch.dtype] = {}
    for node in reversed(gm.graph.nodes):  # users first
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or not node.users:
            continue
        wide = []
        for user in node.users:
            uval = user.meta.get("val")
            if user.op == "call_function" and user.target in _MOVES and user in out:
                wide.append(out[user])
            elif user.op == "call_function" and user.target in _CASTS and \
                    user.args[0] is node and isinstance(uval, torch.Tensor) and \
                    uval.dtype != val.dtype and not _narrows(user):
                wide.append(uval.dtype)
            else:
                break
        else:
            out[node] = max(wide, key=lambda d: d.itemsize)
    return out


def _narrows(node: fx.Node) -> bool:
    """Whether this op casts its first argument to a dtype that cannot hold every value of the
    input's (fp32 -> bf16, fp16 <-> bf16, float -> int). A pending sum is then reduced before
    the cast: rounding each rank's partial term and summing in the narrow dtype rounds terms
    the program never rounds (a row-parallel fp32 output cast to bf16 under autocast, summed
    in bf16, moved a tp=2 loss by 1e-4 where the reduction in fp32 matches one device to
    1e-7). DTensor's own ``_to_copy`` rule keeps Partial through float casts; the planner, free
    to move the reduction past the cast because the narrow one is cheaper, must not."""
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    return torch.promote_types(src.dtype, out.dtype) != out.dtype


def pointwise_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    if isinstance(node.meta["val"], (tuple, list)):
        return _pointwise_multi_output(node, mesh_shape)
    targs = tensor_args(node)
    in_shapes = [val_shape(a) for a in targs]
    out_shape = val_shape(node)
    nd = len(out_shape)
    n = len(targs)
    options: list[AxisOption] = [(tuple(Replicate() for _ in targs), Replicate())]
    for d in range(nd):
        options.append((_broadcast_shards(in_shapes, out_shape, d), Shard(d)))
    # Partial(avg) is kept by the same ops, but nothing here produces it except a mean, whose
    # consumers DTensor's rules cover; offering it on every pointwise op only grows the search.
    for group in _linear_sets(node, n):
        ins = tuple(Partial("sum") if i in group else Replicate() for i in range(n))
        options.append((ins, Partial("sum")))
    return expand_to_mesh(options, mesh_shape, in_shapes, out_shape, RuleKind.POINTWISE)


def _pointwise_multi_output(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """frexp-like ops: every output (all of one shape) split like the inputs; no Partial."""
    targs = tensor_args(node)
    in_shapes = [val_shape(a) for a in targs]
    out_shapes = [tuple(v.shape) for v in node.meta["val"]]
    options = [(tuple(Replicate() for _ in targs), tuple(Replicate() for _ in out_shapes))]
    for d in range(len(out_shapes[0])):
        options.append((_broadcast_shards(in_shapes, out_shapes[0], d),
                        tuple(Shard(d) for _ in out_shapes)))
    return expand_multi_output(options, mesh_shape, in_shapes, out_shapes, RuleKind.POINTWISE)


def _broadcast_shards(in_shapes, out_shape, d: int) -> tuple[Placement, ...]:
    """Each input's placement when the output is split on dim ``d``: the input dim broadcasting
    aligns with it (trailing dims align) if it has the full size there, else Replicate."""
    nd = len(out_shape)
    ins = []
    for s in in_shapes:
        k = d - (nd - len(s))
        ins.append(Shard(k) if k >= 0 and s[k] == out_shape[d] else Replicate())
    return tuple(ins)

