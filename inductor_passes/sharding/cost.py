"""The planner's cost model: communication of a redistribute (alpha-beta model per mesh axis),
matmul and attention compute, and the memory a plan keeps for the backward, in one unit.

_StridedShard is priced as the Shard it is lowered like (the same collectives, plus local block
reorders, which are free here as local slices are).

Cost unit: bytes-equivalent on the wire per rank (the beta term), plus a fixed latency of
``PlannerConfig.latency_bytes`` per collective (the alpha term, expressed in bytes so the two
add). Ring algorithms' volumes follow Thakur et al., "Optimization of Collective Communication
Operations in MPICH" (2005): all_gather and reduce_scatter move (n-1)/n of the full buffer,
all_reduce twice that, all_to_all (n-1)/n of the local buffer.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..core import roles
from ..core.nodes import tensor_args
from ..core.placements import Placements, is_placements, is_split, local_shape, nbytes
from .config import DEFAULT, PlannerConfig


def _walk_shape(shape: Sequence[int], cur: list, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The largest local piece in a state the cost walk passes through. The walk moves one axis
    at a time, so it can pass a state lowering never holds (a _StridedShard nested with another
    split of its dim: lowering goes through Replicate there), which ``local_shape`` refuses;
    every split is then priced as a ceil division."""
    try:
        return local_shape(shape, tuple(cur), mesh_shape)
    except ValueError:
        out = list(shape)
        for axis, p in enumerate(cur):
            if is_split(p):
                out[p.dim] = -(-out[p.dim] // mesh_shape[axis])
        return tuple(out)


def redistribute_cost(shape: Sequence[int], dtype: torch.dtype, src: Placements, dst: Placements,
                      mesh_shape: Sequence[int], greedy: bool = False,
                      weights: Sequence[float] | None = None,
                      config: PlannerConfig = DEFAULT) -> float:
    """Estimated cost of moving a value of GLOBAL ``shape`` from ``src`` to ``dst`` placements.

    Axes are costed one at a time from the current placements (the order lowering uses: reduce or
    gather from the last axis to the first, then re-slice); the buffer each step moves is the
    local size at that step. ``greedy``: price a reduce_scatter as the all_reduce it turns into
    for a one-pass walk (see below); the ILP sees the later all_gather itself and does not need it.
    ``weights``: per mesh axis, the relative cost of a byte on it
    (``core.mesh_facts.axis_weights``); latency and bytes on a slow axis are both scaled.
    ``config``: the latency and re-slice prices (a free local re-slice still changes the value;
    ties are broken towards fewer changes).
    """
    if src == dst:
        return 0.0
    latency = config.latency_bytes
    cost = 0.0
    cur = list(src)
    for axis in reversed(range(len(mesh_shape))):
        s, d, n = cur[axis], dst[axis], mesh_shape[axis]
        if s == d or type(s) is Replicate:
            continue
        local = nbytes(_walk_shape(shape, cur, mesh_shape), dtype)
        before = cost
        if is_split(s) and is_split(d) and s.dim == d.dim:
            # one dim in two layouts (Shard <-> _StridedShard, or two split factors): lowered
            # as a gather and a local slice (redistribute.py)
            cost += latency + local * (n - 1)
            cur[axis] = Replicate()
        elif is_split(s) and is_split(d):
            cost += latency + local * (n - 1) / n
            cur[axis] = d
        elif isinstance(s, Partial) and is_split(d) and s.reduce_op in ("sum", "avg"):
            # A reduce_scatter moves half an all_reduce's bytes, but a greedy walk that takes it
            # for that reason pays the other half (an all_gather) at the next replicated
            # consumer, plus a latency. Priced as reduce_scatter + that all_gather.
            if greedy:
                cost += 2 * latency + 2 * local * (n - 1) / n
            else:
                cost += latency + local * (n - 1) / n
            cur[axis] = d
        elif isinstance(s, Partial):
            cost += latency + 2 * local * (n - 1) / n
            cur[axis] = Replicate()
        else:  # Shard / _StridedShard -> Replicate / Partial
            cost += latency + local * (n - 1)
            cur[axis] = Replicate()
        if weights is not None:
            cost = before + (cost - before) * weights[axis]
    for axis in range(len(mesh_shape)):
        if cur[axis] != dst[axis]:
            cost += config.reslice_cost
    return cost


# Compute, priced in the same unit (``PlannerConfig.bytes_per_flop``, whose default is argued
# there)

MATMUL_OPS = ("aten.mm.default", "aten.bmm.default", "dynamo_dist.matmul_nd.default",
               "aten.addmm.default", "aten.baddbmm.default")


# Fused attention: two matmuls of [L, E] x [E, S] per batch row and head, forward; the backward
# does about 2.5x the forward's matmul work (FlashAttention-2, Dao 2023, sec. 3.2)
ATTENTION_OPS = {"aten._scaled_dot_product_flash_attention_for_cpu.default": 1.0,
                 "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": 2.5}


def node_compute_cost(node, output, mesh_shape: Sequence[int],
                      config: PlannerConfig = DEFAULT) -> float:
    """Flops one rank spends on ``node`` (an FX node of a global graph) when it produces
    ``output`` placements, in bytes-equivalent; 0 for ops whose compute is not priced.
    Matmuls (``compute_cost``) and fused attention: without the latter a replicated attention
    looked free, and the solver traded a head split for gathers of the queries (Gemma's
    multi-query attention on tp=2)."""
    op = str(node.target)
    if op in MATMUL_OPS:
        if not is_placements(output):
            return 0.0
        # addmm(bias, x, w) / baddbmm(self, x, w): the contracted size is x's last dim
        k = node.args[1].meta["val"].shape[-1] if op in ("aten.addmm.default",
                                                         "aten.baddbmm.default") else \
            _first_tensor(node).shape[-1]
        return compute_cost(op, tuple(node.meta["val"].shape), k, output, mesh_shape, config)
    factor = ATTENTION_OPS.get(op)
    if factor is None or is_placements(output) or not output or output[0] is None:
        return 0.0
    q = _first_tensor(node) if factor == 1.0 else node.args[1].meta["val"]
    k = node.args[1 if factor == 1.0 else 2].meta["val"]
    *batch, length, width = q.shape
    flops = 4.0 * factor * length * k.shape[-2] * width
    for s in batch:
        flops *= s
    return flops / _split_degree(output[0], mesh_shape) * config.bytes_per_flop


def _first_tensor(node):
    return tensor_args(node)[0].meta["val"]


def _split_degree(output: Placements, mesh_shape: Sequence[int]) -> int:
    degree = 1
    for axis, p in enumerate(output):
        if is_split(p) or isinstance(p, Partial):
            degree *= mesh_shape[axis]
    return degree


def compute_cost(op: str, out_shape: Sequence[int], contracted: int, output: Placements,
                 mesh_shape: Sequence[int], config: PlannerConfig = DEFAULT) -> float:
    """Matmul flops one rank performs under ``output`` placements (bytes-equivalent).

    A Shard or Partial output on a mesh axis means the work is split over that axis.
    """
    if op not in MATMUL_OPS:
        return 0.0
    flops = 2.0 * contracted
    for s in out_shape:
        flops *= s
    return flops / _split_degree(output, mesh_shape) * config.bytes_per_flop


# Memory, priced in the same unit (``PlannerConfig.saved_memory_weight``)

def saved_values(graph) -> frozenset:
    """The values a joint ``graph`` (global semantics) keeps from the forward to the backward,
    before the partitioner trades some for recomputation: for each forward value a backward
    node reads, the node that made its storage (a view is followed to its base, so a value and
    its transpose count once). Bases that are program inputs are left out: their placement is
    pinned, and a gathered parameter is priced by ``PlannerConfig.param_gather_factor``. All of
    them are alive where the forward ends, so their bytes are the part of a rank's peak that
    the plan decides."""
    bwd = roles.tangent_dependent(graph)
    saved = set()
    for node in bwd:
        if node.op == "output":  # forward outputs are the caller's, held either way
            continue
        for a in node.all_input_nodes:
            if a not in bwd:
                base = _storage_base(a)
                if base.op == "call_function":
                    saved.add(base)
    return frozenset(saved)


def _storage_base(node):
    """The node whose storage ``node``'s value lives in (itself unless it is a view)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        src = node.args[0]
        if node.target is operator.getitem:  # a piece of a multi-output op: a view if it is
            if not (src.op == "call_function" and getattr(src.target, "is_view", False)):
                break
            node = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else src
        elif getattr(node.target, "is_view", False):
            node = src
        else:
            break
    return node


def held_bytes(node, output, mesh_shape: Sequence[int]) -> int:
    """Bytes one rank holds of ``node``'s value under ``output`` placements: its largest local
    piece (a Partial value is held whole). 0 for a non-tensor value or a size that is not an int
    (a symbolic program is planned at its hints, so its sizes are ints). The planner prices it
    at ``PlannerConfig.saved_memory_weight`` for a member of ``saved_values``."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not is_placements(output) or \
            not all(isinstance(s, int) for s in val.shape):
        return 0
    return nbytes(_walk_shape(tuple(val.shape), list(output), mesh_shape), val.dtype)


def saved_bytes(graph, output_of, mesh_shape: Sequence[int]) -> int:
    """Bytes one rank keeps for the backward under a plan: ``held_bytes`` of every
    ``saved_values`` member, ``output_of(node)`` giving its placements (a plan's output for
    it), before the partitioner's recomputation."""
    return sum(held_bytes(node, output_of(node), mesh_shape) for node in saved_values(graph))
