"""Adapter: ask DTensor's strategy registry for the OpSpecs of one FX node.

DTensor's rules enumerate; the choice among them stays ours (``propagate``). OpSpecs using
placements we do not lower (``MaskPartial``...) are dropped here; ``_StridedShard`` is kept where
``placements.valid_for`` holds it (``rules.strided`` says which rules are asked with it); which
uneven splits an op may compute on is decided in ``rules.op_strategy``.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from inductor_passes.core import compat

from ...core.placements import Placements, is_placements, normalize, valid_for
from .base import OpSpec, RuleKind, RuleSource, tensor_args

log = logging.getLogger(__name__)


def _meta(val: torch.Tensor):
    return compat.TensorMeta(val.shape, val.stride(), val.dtype)


def dtensor_strategy(node: fx.Node, current: Sequence[Placements], mesh,
                      mesh_shape: Sequence[int]) -> list[OpSpec]:
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return []
    targs = tensor_args(node)
    if any(isinstance(a, fx.Node) for a in pytree.tree_leaves(node.kwargs)):
        return []  # DTensor's input_specs only cover positional args
    spec_of = {a: compat.DTensorSpec(mesh, tuple(p), tensor_meta=_meta(a.meta["val"]))
               for a, p in zip(targs, current)}

    def to_schema_arg(a):
        if isinstance(a, fx.Node):
            return spec_of.get(a, a.meta.get("val"))
        return a

    args = pytree.tree_map(to_schema_arg, node.args,
                           is_leaf=lambda x: isinstance(x, fx.Node))
    kwargs = pytree.tree_map(to_schema_arg, dict(node.kwargs),
                             is_leaf=lambda x: isinstance(x, fx.Node))
    schema = compat.OpSchema(op, tuple(args), kwargs)
    val = node.meta["val"]
    out_meta = tuple(_meta(v) if isinstance(v, torch.Tensor) else None for v in val) \
        if isinstance(val, (tuple, list)) else _meta(val)
    try:
        strategy = compat.dtensor_op_strategy(schema, out_meta)
    except Exception as e:  # a rule that cannot handle these inputs enumerates nothing
        log.debug("DTensor strategy for %s failed: %s", op, e)
        return []
    if not isinstance(strategy, compat.OpStrategy):
        return []
    in_shapes = [tuple(a.meta["val"].shape) for a in targs]
    specs = []
    for s in strategy.strategies:
        out = _convert_out(s.output_specs, val, mesh_shape)
        if out is None:
            continue
        if s.input_specs is None:
            if not is_placements(out) or not out:
                continue
            ins = tuple(out for _ in targs)
        else:
            if len(s.input_specs) != len(targs):
                continue
            ins = tuple(normalize(spec.placements, len(sh))
                        for spec, sh in zip(s.input_specs, in_shapes))
        if all(valid_for(sh, p, mesh_shape) for sh, p in zip(in_shapes, ins)):
            specs.append(OpSpec(ins, out, RuleSource(RuleKind.DTENSOR, str(op))))
    return specs


def _convert_out(output_specs, val, mesh_shape):
    """DTensorSpec(s) -> our output placements; None if any is unsupported."""
    if isinstance(val, (tuple, list)):
        specs = output_specs if isinstance(output_specs, (tuple, list)) else [output_specs] * len(val)
        out = []
        for spec, v in zip(specs, val):
            if not isinstance(v, torch.Tensor):
                out.append(None)
                continue
            if spec is None:
                return None
            p = normalize(spec.placements, v.ndim)
            if not valid_for(v.shape, p, mesh_shape):
                return None
            out.append(p)
        return tuple(out)
    spec = output_specs[0] if isinstance(output_specs, (tuple, list)) else output_specs
    if spec is None:
        return None
    p = normalize(spec.placements, val.ndim)
    return p if valid_for(val.shape, p, mesh_shape) else None
