"""Run a compiled program on N simulated ranks in one process, with real values.

The backend compiles one joint graph per rank (rank coordinates are constants). Local shapes may
differ by rank (uneven splits), and with them the ops a decomposition picks, but the collectives
are the same on every rank, in the same order (lowering guarantees it; the partitioner never
recomputes a collective). So the N local graphs are interpreted side by side: each rank runs its
ordinary ops on its own values up to its next collective; there all ranks meet, and the
collective is computed across the ranks of its mesh-axis group from all of their inputs. This is what ``torch.distributed._local_tensor.LocalTensorMode``
does for DTensor eager, applied to our rank-specialised graphs (which one LocalTensor program
cannot express), and it checks the exact local graphs a real run would compile (without Inductor).

Shapes: ``run_spmd`` takes GLOBAL tensors and returns GLOBAL tensors.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Shard

from inductor_passes.lowering import lower
from inductor_passes.sharding.placements import Placements, is_placements, shard_range

c10d = torch.ops._c10d_functional
_COLLECTIVES = {c10d.all_gather_into_tensor.default, c10d.all_reduce.default,
                c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default}


class ReplicaMismatch(AssertionError):
    """Ranks that should hold the same (Replicate) value hold different ones: a wrong plan."""


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def shard_global(x: torch.Tensor, placements: Placements, coord: Sequence[int],
                 mesh_shape: Sequence[int]) -> torch.Tensor:
    """The local tensor of the rank at ``coord`` for GLOBAL ``x`` under ``placements``.

    Shard splits like torch.chunk (uneven sizes included); Partial(sum) shares: ``_exact_share``.
    """
    out = x
    for axis, p in enumerate(placements):
        n, c = mesh_shape[axis], coord[axis]
        if isinstance(p, Shard):
            out = out.narrow(p.dim, *shard_range(out.shape[p.dim], n, c))
        elif isinstance(p, Partial):
            out = _exact_share(out, c)
    return out.contiguous()


def _exact_share(x: torch.Tensor, k: int) -> torch.Tensor:
    """Rank k's share of a Partial(sum) value: x = hi + lo exactly (hi: x rounded to a coarser
    float type, lo: the rounding error, which the finer type holds exactly), on ranks 0 and 1;
    zeros elsewhere. The shares differ (a forgotten reduction leaves replicas disagreeing, a
    doubled one changes the value) and their sum is exact in any order, so ill-conditioned ops
    (tan near a pole) are not reported wrong for rounding in the split."""
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
            elif isinstance(p, Partial):
                val = torch.stack(group).sum(0)
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


class _Groups:
    """Maps a collective's group name to the mesh axis it spans (names are those lowering used)."""

    def __init__(self, axis_group_names: Sequence[str], mesh_shape: Sequence[int]) -> None:
        self.axis_of = {name: i for i, name in enumerate(axis_group_names)}
        self.mesh_shape = tuple(mesh_shape)

    def members(self, group_name: str, coord: tuple[int, ...]) -> list[tuple[int, ...]]:
        axis = self.axis_of[group_name]
        return [coord[:axis] + (k,) + coord[axis + 1:] for k in range(self.mesh_shape[axis])]


def _collective(target, args_by_rank: dict, groups: _Groups) -> dict:
    out = {}
    for coord, args in args_by_rank.items():
        group_name = args[-1]
        peers = [args_by_rank[m][0] for m in groups.members(group_name, coord)]
        k = groups.members(group_name, coord).index(coord)
        if target is c10d.all_gather_into_tensor.default:
            out[coord] = torch.cat(peers, dim=0)
        elif target is c10d.all_reduce.default:
            op = args[1]
            stacked = torch.stack(peers)
            # only the op asked for: an integer sum (a count of labels) has no mean
            out[coord] = {"sum": lambda: stacked.sum(0), "avg": lambda: stacked.mean(0),
                          "max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0)}[op]()
        elif target is c10d.reduce_scatter_tensor.default:
            total = torch.stack(peers).sum(0) if args[1] == "sum" else torch.stack(peers).mean(0)
            out[coord] = total.chunk(len(peers), dim=0)[k].contiguous()
        else:  # all_to_all_single(x, output_split_sizes, input_split_sizes, group)
            splits = [list(p.split(args_by_rank[m][2] or [p.shape[0] // len(peers)] * len(peers)))
                      for p, m in zip(peers, groups.members(group_name, coord))]
            out[coord] = torch.cat([s[k] for s in splits], dim=0)
    return out


def _seeded(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


def run_lockstep(graphs: dict[tuple[int, ...], fx.GraphModule], inputs: dict[tuple[int, ...], list],
                 groups: _Groups) -> dict[tuple[int, ...], list]:
    """Interpret one local graph per rank; returns each rank's flat outputs.

    Ranks run on their own between collectives and meet at each one. Every rank must issue the
    same collective on the same group next (else a real run would hang: AssertionError).
    """
    start = torch.get_rng_state()
    runners = {c: _rank_program(g, inputs[c], start) for c, g in graphs.items()}
    pending = {c: next(r) for c, r in runners.items()}
    step = 0
    while True:
        done = {c for c, p in pending.items() if p[0] == "done"}
        if len(done) == len(pending):
            return {c: p[1] for c, p in pending.items()}
        issued = {c: (str(p[1]), p[2][-1]) for c, p in pending.items() if p[0] != "done"}
        if done or len(set(issued.values())) != 1:
            raise AssertionError(f"ranks' collective schedules differ at collective {step}: "
                                 f"{issued}, finished: {sorted(done)}")
        target = next(iter(pending.values()))[1]
        res = _collective(target, {c: p[2] for c, p in pending.items()}, groups)
        pending = {c: runners[c].send(res[c]) for c in runners}
        step += 1


def _rank_program(gm: fx.GraphModule, inputs: Sequence, rng: torch.Tensor):
    """One rank's interpreter: yields ("collective", op, args) and is sent the result, then
    yields ("done", outputs). Random draws use this rank's own generator state, which starts
    as every other rank's (the same seed everywhere)."""
    env: dict[fx.Node, Any] = {}
    feed = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(feed)
            continue
        if node.op == "get_attr":
            env[node] = getattr(gm, node.target)
            continue
        if node.op == "output":
            yield "done", list(fx.node.map_arg(node.args[0], lambda a: env[a]))
            return
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        if node.target in _COLLECTIVES:
            res = yield "collective", node.target, args
        elif node.target is c10d.wait_tensor.default:
            res = args[0]
        elif _seeded(node.target):
            torch.set_rng_state(rng)
            res = node.target(*args, **kwargs)
            rng = torch.get_rng_state()
        else:
            res = node.target(*args, **kwargs)
        env[node] = res
    raise AssertionError("local graph has no output node")


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
    gm = program.graph_module
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
    outs = run_lockstep(graphs, inputs, _Groups(names, mesh_shape))
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

