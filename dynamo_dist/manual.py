"""Manual regions in the joint graph: which values are LOCAL tensors, and which of them vary
across ranks.

``enter_manual`` / ``exit_manual`` (from ``to_local`` / ``from_local``, enable/disable_manual_
sharding, local_map) bound local code. ``mark_manual`` flags every joint-graph node whose value
is local (``node.meta[MANUAL]``: planned Replicate, lowered as written) and tracks, per mesh
axis, whether the value can differ between the ranks of that axis ("varying", as JAX's
shard_map tracks replication). The tracking decides one thing: the gradient of a value that
entered local code as Replicate is a sum over ranks (Partial) only if the local code's gradient
varies over that axis; redundant local code (every rank computing the same, as the residual
stream between parallelize_module's layers) contributes once.

Known gap: a rank-dependent Python constant in local code (``x + dist.get_rank()``, folded by
Dynamo) is not seen as varying.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate

from inductor_passes.core import roles
from inductor_passes.core.collectives import collective_op
from inductor_passes.core.annotation_ops import (ENTER_OP, EXIT_OP, decode_spec, encode_spec,
                                                 mesh_from_key)
from inductor_passes.core.roles import MANUAL, VARYING, tangent_dependent

_REDUCING = ("all_reduce", "all_gather_into_tensor", "all_reduce_coalesced",
             "all_gather_into_tensor_coalesced")


def mark_manual(gm: fx.GraphModule, mesh, manual_primals: Sequence[int],
                manual_outputs: Sequence[int], diff_outputs: Sequence[int]) -> None:
    """Flag local values (see module doc) and set the placements of each gradient that leaves
    local code (the backward's ``exit_manual``) from what varies. ``manual_primals``: input
    positions read as per-rank values; ``manual_outputs``: forward outputs that are local."""
    axes_all = frozenset(range(mesh.ndim))
    groups = _group_axes(mesh)
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    fwd_outs = out_node.args[0]
    tangent_of = {roles.tangent_name(j): fwd_outs[i] for j, i in enumerate(diff_outputs)
                  if i in manual_outputs}
    primals = {roles.primal_name(k) for k in manual_primals}
    bwd = tangent_dependent(gm.graph)
    # forward first: a tangent takes the variance of its forward output, which comes later in
    # graph order than the tangent placeholders
    nodes = list(gm.graph.nodes)
    for node in [n for n in nodes if n not in bwd] + [n for n in nodes if n in bwd]:
        varying: frozenset | None = None
        if node.op == "placeholder":
            if node.name in primals:
                varying = axes_all
            elif node.name in tangent_of and isinstance(tangent_of[node.name], fx.Node):
                varying = tangent_of[node.name].meta.get(VARYING, axes_all)
        elif node.op == "call_function" and node.target is ENTER_OP:
            _, pls = decode_spec(node.args[1])
            varying = frozenset(a for a, p in enumerate(pls) if not isinstance(p, Replicate))
        elif node.op == "call_function" and node.target is EXIT_OP:
            if node in bwd:
                _settle_gradient_exit(node)
        elif node.op == "call_function":
            inputs = [a.meta[VARYING] for a in node.all_input_nodes if a.meta.get(MANUAL)]
            if inputs:
                varying = frozenset().union(*inputs)
                # a reduced result is the same on every rank of the group
                if collective_op(node) in _REDUCING:
                    varying -= groups.get(next((a for a in node.args if isinstance(a, str)
                                                and a in groups), None), frozenset())
        if varying is not None:
            node.meta[MANUAL] = True
            node.meta[VARYING] = varying


def _settle_gradient_exit(node: fx.Node) -> None:
    """A gradient leaving local code is Partial(sum) on an axis only where it varies."""
    key, pls = decode_spec(node.args[1])
    src = node.args[0]
    varying = src.meta.get(VARYING, frozenset()) if src.meta.get(MANUAL) else frozenset()
    settled = tuple(Replicate() if isinstance(p, Partial) and a not in varying else p
                    for a, p in enumerate(pls))
    if settled != pls:
        node.args = (src, encode_spec(mesh_from_key(key), settled), *node.args[2:])


def _group_axes(mesh) -> dict[str, frozenset]:
    """Process-group name -> the mesh axes it spans (1-D groups of each axis, and the whole
    mesh's group where the mesh is 1-D)."""
    out: dict[str, frozenset] = {}
    for axis in range(mesh.ndim):
        try:
            out[mesh.get_group(axis).group_name] = frozenset({axis})
        except Exception:  # a fake or partial mesh without groups: nothing is known reduced
            continue
    return out
