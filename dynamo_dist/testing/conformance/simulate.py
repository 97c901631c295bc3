"""Run one compiled record's joint program on N simulated ranks with GLOBAL values in and out
(``run_spmd``), for op-level conformance: inputs are split per rank here, outputs reassembled
and replicas checked. The lockstep interpreter itself is ``dynamo_dist.simulate``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Shard

from dynamo_dist.symbolic import LocalSizes, fix_guarded_sizes, is_symbolic
from inductor_passes.core.placements import (Placements, is_placements, is_strided, shard_range,
                                             split_factor)
from inductor_passes.lowering import lower

from ...simulate import Groups, coordinates, run_lockstep

__all__ = ["ReplicaMismatch", "coordinates", "run_spmd", "shard_global", "strided_indices",
           "unshard"]


class ReplicaMismatch(AssertionError):
    """Ranks that should hold the same (Replicate) value hold different ones: a wrong plan."""


def shard_global(x: torch.Tensor, placements: Placements, coord: Sequence[int],
                 mesh_shape: Sequence[int]) -> torch.Tensor:
    """The local tensor of the rank at ``coord`` for GLOBAL ``x`` under ``placements``.

    Shard splits like torch.chunk (uneven sizes included); _StridedShard(d, k): piece c of each
    of the k blocks of dim d (written here from its definition, by index arithmetic, not by
    the lowering's reshapes: it is the reference they are tested against); Partial(sum)
    shares: ``_exact_share``.
    """
    out = x
    for axis, p in enumerate(placements):
        n, c = mesh_shape[axis], coord[axis]
        if isinstance(p, Shard):
            out = out.narrow(p.dim, *shard_range(out.shape[p.dim], n, c))
        elif is_strided(p):
            out = out.index_select(p.dim, strided_indices(out.shape[p.dim], split_factor(p), n, c))
        elif isinstance(p, Partial):
            out = _exact_share(out, c, n)
    return out.contiguous()


def strided_indices(size: int, k: int, n: int, r: int) -> torch.Tensor:
    """GLOBAL indices, in local order, that rank ``r`` of ``n`` holds of a dim of ``size``
    under _StridedShard(split_factor=k): for each block b, [b B + r c, b B + (r + 1) c) with
    B = size / k, c = B / n."""
    if size % (k * n):
        raise ValueError(f"_StridedShard(split_factor={k}) on {n} ranks: size {size} is not a "
                         f"multiple of {k * n}")
    block, c = size // k, size // (k * n)
    return torch.tensor([b * block + r * c + i for b in range(k) for i in range(c)],
                        dtype=torch.long)


def _exact_share(x: torch.Tensor, k: int, n: int = 2) -> torch.Tensor:
    """Rank k's share (of ``n`` ranks) of a Partial(sum) value: x = hi + lo exactly (hi: x
    rounded to a coarser float type, lo: the rounding error, which the finer type holds
    exactly), on ranks 0 and 1; zeros elsewhere; all of x on a mesh axis of one rank. The shares
    differ (a forgotten reduction leaves replicas disagreeing, a doubled one changes the value)
    and their sum is exact in any order, so ill-conditioned ops (tan near a pole) are not
    reported wrong for rounding in the split."""
    if n == 1:
        return x
    coarse = torch.bfloat16 if x.dtype == torch.float32 else torch.float32
    hi = torch.where(torch.isfinite(x), x.to(coarse).to(x.dtype), x)  # inf/nan: all on rank 0
    lo = torch.where(torch.isfinite(x), x - hi, torch.zeros_like(x))
    return hi if k == 0 else lo if k == 1 else torch.zeros_like(x)


def unshard(locals_: dict[tuple[int, ...], torch.Tensor], placements: Placements,
            mesh_shape: Sequence[int], what: str, atol: float = 1e-5,
            rtol: float = 1e-4) -> torch.Tensor:
    """GLOBAL value from every rank's local value; checks that replicas agree."""
    cur = dict(locals_)
    for axis in reversed(range(len(mesh_shape))):
        p = placements[axis]
        nxt: dict[tuple[int, ...], torch.Tensor] = {}
        for coord in {c[:axis] + c[axis + 1:] for c in cur}:
            group = [cur[coord[:axis] + (k,) + coord[axis:]] for k in range(mesh_shape[axis])]
            if isinstance(p, Shard):
                val = torch.cat(group, dim=p.dim)
            elif is_strided(p):
                size = sum(g.shape[p.dim] for g in group)
                idx = torch.cat([strided_indices(size, split_factor(p), len(group), r)
                                 for r in range(len(group))])
                val = torch.cat(group, dim=p.dim).index_select(p.dim, torch.argsort(idx))
            elif isinstance(p, Partial):
                val = torch.stack(group).sum(0).to(group[0].dtype)  # (sum promotes ints)
            else:
                for k, g in enumerate(group[1:], 1):
                    if g.shape != group[0].shape or not torch.allclose(
                            g, group[0], atol=atol, rtol=rtol, equal_nan=True):
                        raise ReplicaMismatch(f"{what}: replica {k} on mesh axis {axis} differs "
                                              f"from replica 0")
                val = group[0]
            nxt[coord] = val
        cur = nxt
    return cur[()]


def run_spmd(record, args: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor] | None,
             mesh) -> tuple[list[Any], list[Any]]:
    """Run a ``CompileRecord`` (its joint program and plan) on every rank of ``mesh``.

    ``args``: the GLOBAL values of the program's tensor inputs (one per primal, in order);
    ``tangents``: GLOBAL cotangents of its differentiable outputs (None: forward only).
    Returns (forward outputs, gradients of the primals), GLOBAL; raises ReplicaMismatch when
    replicas disagree and AssertionError when the ranks' collective schedules differ.
    """
    program, plan = record.program, record.plan
    mesh_shape = tuple(mesh.shape)

    fix_guarded_sizes(program.graph_module)  # sizes a guard fixed since the program was made
    gm = program.graph_module
    if is_symbolic(gm):  # lowered as the backend lowers it: in symbols of local sizes
        gm = LocalSizes(gm, plan).graph
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    primals = [n for n in placeholders if n.name.startswith("primals")]
    tangent_nodes = [n for n in placeholders if n.name.startswith("tangents")]
    tangents = list(tangents or [])
    if len(tangents) != len(tangent_nodes):
        tangents = [torch.zeros(tuple(n.meta["val"].shape), dtype=n.meta["val"].dtype)
                    for n in tangent_nodes]
    rng = torch.get_rng_state()  # random draws start from the caller's state, not lowering's
    graphs, inputs = {}, {}
    for coord in coordinates(mesh_shape):
        local_gm, _ = lower(gm, plan, mesh, program.num_fwd_outputs, coordinate=coord)
        graphs[coord] = local_gm
        inputs[coord] = [shard_global(x, plan.placement(n.name), coord, mesh_shape)
                         for n, x in zip(primals, args)] + \
                        [shard_global(t, plan.placement(n.name), coord, mesh_shape)
                         for n, t in zip(tangent_nodes, tangents)]
    names = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    torch.set_rng_state(rng)
    outs = run_lockstep(graphs, inputs, Groups(names, mesh_shape))
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    reqs = iter(plan.nodes[out_node.name].inputs)
    results = []
    for k, o in enumerate(out_node.args[0]):
        if not isinstance(o, fx.Node):
            results.append(o)
            continue
        pl = next(reqs)
        results.append(unshard({c: outs[c][k] for c in outs}, pl, mesh_shape, f"output {k}")
                       if is_placements(pl) else outs[next(iter(outs))][k])
    n = program.num_fwd_outputs
    return results[:n], results[n:]

