"""Run the per-rank local programs of one compilation side by side in one process.

The backend specialises each rank's local graph (its mesh coordinate is a constant). Local shapes
may differ by rank (uneven splits), and with them the ops a decomposition picks, but the
collectives are the same on every rank, in the same order (lowering guarantees it; the
partitioner never recomputes a collective). So the N local graphs are interpreted side by side:
each rank runs its ordinary ops on its own values up to its next collective; there all ranks
meet, and the collective is computed across the ranks of its mesh-axis group from all of their
inputs. This is what ``torch.distributed._local_tensor.LocalTensorMode`` does for DTensor eager,
applied to our rank-specialised graphs (which one LocalTensor program cannot express).

``SimulatedJoint`` plugs that into the runtime: ``torch.compile(model, backend="dist",
options={"simulate": True})`` under ``LocalTensorMode(N)`` on a ``fake`` process group lowers the
plan for every rank, and each call runs the N local graphs (FX, no Inductor) on the LocalTensor
shards the caller's DTensors hold, so a whole training loop (forward, backward, optimizer)
runs on N simulated ranks with real values.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Sequence

import torch
import torch.fx as fx

from inductor_passes.compile import compile_joint, sizes_first
from inductor_passes.core.compat import (disable_local_tensor_mode, local_tensor_rng_states,
                                         rng_state_ops, set_local_tensor_rng_states)
from inductor_passes.lowering import lower

c10d = torch.ops._c10d_functional
# a checkpointed region's random op, saved in the forward and recomputed in the backward
_RUN_AND_SAVE_RNG, _RUN_WITH_RNG = rng_state_ops()
_COLLECTIVES = {c10d.all_gather_into_tensor.default, c10d.all_reduce.default,
                c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default}


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


class Groups:
    """Maps a collective's group name to the mesh axis it spans (names are those lowering used)."""

    def __init__(self, axis_group_names: Sequence[str], mesh_shape: Sequence[int]) -> None:
        self.axis_of = {name: i for i, name in enumerate(axis_group_names)}
        self.mesh_shape = tuple(mesh_shape)

    def members(self, group_name: str, coord: tuple[int, ...]) -> list[tuple[int, ...]]:
        axis = self.axis_of[group_name]
        return [coord[:axis] + (k,) + coord[axis + 1:] for k in range(self.mesh_shape[axis])]


def _collective(target, args_by_rank: dict, groups: Groups) -> dict:
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
            if stacked.dtype is torch.complex32:  # CPU has no reduction kernels for it
                stacked = stacked.to(torch.complex64)
            reduced = {"sum": stacked.sum, "avg": stacked.mean, "max": stacked.amax,
                       "min": stacked.amin}[op](0)
            out[coord] = reduced.to(peers[0].dtype)  # a collective keeps its dtype (sum of
            #                                          ints promotes to int64 in torch)
        elif target is c10d.reduce_scatter_tensor.default:
            stacked = torch.stack(peers)
            if stacked.dtype is torch.complex32:
                stacked = stacked.to(torch.complex64)
            total = stacked.sum(0) if args[1] == "sum" else stacked.mean(0)
            out[coord] = total.chunk(len(peers), dim=0)[k].to(peers[0].dtype).contiguous()
        else:  # all_to_all_single(x, output_split_sizes, input_split_sizes, group)
            splits = [list(p.split(args_by_rank[m][2] or [p.shape[0] // len(peers)] * len(peers)))
                      for p, m in zip(peers, groups.members(group_name, coord))]
            out[coord] = torch.cat([s[k] for s in splits], dim=0)
    return out


def _seeded(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


def run_lockstep(graphs: dict[tuple[int, ...], fx.GraphModule], inputs: dict[tuple[int, ...], list],
                 groups: Groups, rng: dict[tuple[int, ...], torch.Tensor] | None = None
                 ) -> dict[tuple[int, ...], list]:
    """Interpret one local graph per rank; returns each rank's flat outputs.

    Ranks run on their own between collectives and meet at each one. Every rank must issue the
    same collective on the same group next (else a real run would hang: AssertionError).
    ``rng``: each rank's CPU generator state to draw from (default: the global state, for
    every rank); each rank's state after its draws is written back into it, and the global
    generator is left where the last rank's draws left it (a program's draws advance it, as
    one device's do).
    """
    rng = rng if rng is not None else {c: torch.get_rng_state() for c in graphs}
    runners = {c: _rank_program(g, inputs[c], rng[c]) for c, g in graphs.items()}
    pending = {c: next(r) for c, r in runners.items()}
    step = 0
    while True:
        done = {c for c, p in pending.items() if p[0] == "done"}
        if len(done) == len(pending):
            for c, p in pending.items():
                rng[c] = p[2]
            torch.set_rng_state(rng[max(rng)])
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
            yield "done", list(fx.node.map_arg(node.args[0], lambda a: env[a])), rng
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
        elif node.target is _RUN_AND_SAVE_RNG:  # (op, *args): this rank's state, then draw
            torch.set_rng_state(rng)
            res = (rng, args[0](*args[1:], **kwargs))
            rng = torch.get_rng_state()
        elif node.target is _RUN_WITH_RNG:  # (state, op, *args): the forward's draw again
            # higher-order ops are run by the op they hold: LocalTensorMode, still on the mode
            # stack while disabled, has no rule for them
            torch.set_rng_state(args[0])
            res = args[1](*args[2:], **kwargs)
        else:
            res = node.target(*args, **kwargs)
        env[node] = res
    raise AssertionError("local graph has no output node")



def _piece(x: Any, rank: int) -> Any:
    """This rank's tensor of a LocalTensor (a plain tensor is the same on every rank)."""
    from torch.distributed._local_tensor import LocalTensor

    return x._local_tensors[rank] if isinstance(x, LocalTensor) else x


def _pack(values: dict[int, Any]) -> Any:
    """Per-rank results -> one LocalTensor (None stays None; a Python value the program
    returns, such as the placements user code read, is the same on every rank)."""
    from torch.distributed._local_tensor import LocalTensor

    first = next(iter(values.values()))
    if not isinstance(first, torch.Tensor):
        return first
    values = {r: v.detach() for r, v in values.items()}
    if len({(v.stride(), v.storage_offset()) for v in values.values()}) > 1:
        # ranks' local layouts may differ (rank 1's slice starts further into the buffer); a
        # LocalTensor then has a symbolic layout, which Dynamo cannot take as a graph input
        values = {r: v.clone(memory_format=torch.contiguous_format) for r, v in values.items()}
    return LocalTensor(values)


class SimulatedJoint:
    """A ``CompiledJoint`` (forward, backward, boxed) over the per-rank local graphs of every
    mesh coordinate: arguments are LocalTensors (one local tensor per rank) or plain tensors
    (the same on every rank); results are LocalTensors. The graphs run as FX (no Inductor).

    What each rank's forward saves for its backward stays per rank, behind one token tensor
    (the one saved value the runtime sees): ranks' partitions may save different values (a
    symbolic size one rank computes and another does not)."""

    def __init__(self, joints: dict, ranks: dict, groups: Groups) -> None:
        self.joints, self.ranks, self.groups = joints, ranks, groups
        first = next(iter(joints.values()))
        self.num_fwd_outputs = first.num_fwd_outputs
        self.num_saved, self.num_saved_sizes = (1 if first.bw_graph is not None else 0), 0
        self.fw_graph, self.bw_graph = first.fw_graph, first.bw_graph
        self.buckets, self.issued = first.buckets, first.issued
        self.outlined, self.predicted_peak = first.outlined, first.predicted_peak  # rank 0's
        self.backward = self._backward if first.bw_graph is not None else None
        self._saved: dict[int, dict] = {}

    def forward(self, args: list) -> list:
        outs = self._run({c: j.fw_graph for c, j in self.joints.items()},
                         {c: [_piece(a, self.ranks[c]) for a in args] for c in self.joints})
        n = self.num_fwd_outputs
        user = [_pack({self.ranks[c]: outs[c][k] for c in outs}) for k in range(n)]
        if self.backward is None:
            return user
        token = torch.empty(0)
        key = id(token)
        self._saved[key] = {c: outs[c][n:] for c in outs}
        weakref.finalize(token, self._saved.pop, key, None)  # a backward that never runs
        return [*user, token]

    def _backward(self, args: list) -> list:
        saved = self._saved.pop(id(args[0]))
        inputs = {}
        for c, j in self.joints.items():
            mine = [*saved[c], *(_piece(a, self.ranks[c]) for a in args[1:])]
            inputs[c] = sizes_first(mine, j.num_saved - j.num_saved_sizes, j.num_saved_sizes)
        outs = self._run({c: j.bw_graph for c, j in self.joints.items()}, inputs)
        n = len(next(iter(outs.values())))
        return [_pack({self.ranks[c]: outs[c][k] for c in outs}) for k in range(n)]

    def _run(self, graphs: dict, inputs: dict) -> dict:
        # each simulated rank draws from its own generator state, as LocalTensorMode's eager
        # ops do, and the draws advance it: a program compiled per block draws the second
        # block's dropout masks after the first block's, not the same ones again
        states = local_tensor_rng_states()
        rng = None if states is None else \
            {c: states.get(r, torch.get_rng_state()) for c, r in self.ranks.items()}
        with disable_local_tensor_mode(), torch.no_grad():
            outs = run_lockstep(graphs, inputs, self.groups, rng)
        if rng is not None:
            set_local_tensor_rng_states({self.ranks[c]: s for c, s in rng.items()})
        return outs


def simulated_joint(gm: fx.GraphModule, plan, mesh, num_fwd_outputs: int,
                    has_backward: bool):
    """Lower ``plan`` for every mesh coordinate and partition each local joint graph; returns
    (SimulatedJoint, the ledger of the rank at coordinate 0)."""
    joints, ranks, ledger = {}, {}, None
    for coord in coordinates(tuple(mesh.shape)):
        local_gm, rank_ledger = lower(gm, plan, mesh, num_fwd_outputs, coordinate=coord)
        ledger = ledger or rank_ledger
        joints[coord] = compile_joint(local_gm, num_fwd_outputs, has_backward, inductor=False)
        ranks[coord] = int(mesh.mesh[coord].item())
    names = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    return SimulatedJoint(joints, ranks, Groups(names, tuple(mesh.shape))), ledger
