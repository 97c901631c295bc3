"""Whole-graph sharding propagation over the joint forward+backward graph.

Every node gets an OpSpec. The walk follows the graph in topological order, forward part first
(nodes that do not depend on a tangent), then backward, so that each cotangent takes the
placement of its forward output (as JAX does: cotangent sharding follows primal sharding).
At each node the rules enumerate an OpStrategy and we pick the OpSpec whose input redistributes
are cheapest under ``cost.redistribute_cost`` -- DTensor's per-op choice, made at compile time on
the whole program. Pinned placements (user DTensor inputs, sharding constraints, parameter
gradients that must land in the parameter's placement) are never overwritten.

The result is a ``Plan``: plain data, printable, diffable, and the input to lowering.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate

from .cost import redistribute_cost
from .placements import Placements, fmt, nbytes, replicate
from .rules import GETITEM, OpSpec, op_strategy, replicated_spec, tensor_args

log = logging.getLogger("dynamo_dist.sharding")


@dataclasses.dataclass
class NodePlan:
    """The chosen OpSpec of one node and where it came from."""

    name: str
    op: str
    inputs: tuple[Placements, ...]      # required placement of each tensor arg
    output: object                      # Placements, or a tuple of them for multi-output ops
    source: str                         # rule that produced the OpSpec
    cost: float                         # redistribute cost paid on its inputs (bytes-equivalent)
    candidates: int                     # size of the OpStrategy it was chosen from
    origin: str = ""                    # why: annotation, propagated, fallback


@dataclasses.dataclass
class Plan:
    """node name -> NodePlan for a joint graph, plus the mesh it refers to."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    nodes: dict[str, NodePlan]
    fallbacks: list[str]

    def placement(self, name: str):
        return self.nodes[name].output

    def to_text(self) -> str:
        lines = [f"# plan over mesh {dict(zip(self.axis_names, self.mesh_shape))}"]
        for p in self.nodes.values():
            ins = " ".join(fmt(i) for i in p.inputs)
            if p.output is None or _is_placements(p.output):
                out = fmt(p.output)
            else:
                out = "(" + ", ".join(fmt(o) for o in p.output) + ")"
            lines.append(f"{p.name:<28} {p.op:<40} {ins:<30} -> {out:<14} "
                         f"[{p.source}; cost {p.cost:.0f}] {p.origin}")
        return "\n".join(lines)


def _is_placements(x) -> bool:
    return isinstance(x, tuple) and (not x or hasattr(x[0], "is_shard"))


def tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on any tangent placeholder: the backward part of a joint graph."""
    bwd: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            bwd.add(node)
        elif any(a in bwd for a in node.all_input_nodes):
            bwd.add(node)
    return bwd


def propagate(gm: fx.GraphModule, mesh, primal_placements: Sequence[Placements],
              num_fwd_outputs: int, diff_outputs: Sequence[int],
              grad_placements: Sequence[Placements | None],
              constraint_of: Callable[[fx.Node], Placements | None],
              origins: Sequence[str] = ()) -> Plan:
    """Give every node of ``gm`` (a joint graph in global semantics) an OpSpec.

    ``primal_placements[i]``: the fixed placement of placeholder ``primals_{i+1}``;
    ``grad_placements[i]``: where the gradient of primal i must land (None: no gradient).
    Forward outputs end non-Partial (a Partial output is reduced to Replicate).
    """
    mesh_shape = tuple(mesh.shape)
    ndim = len(mesh_shape)
    env: dict[fx.Node, object] = {}
    nodes: dict[str, NodePlan] = {}
    fallbacks: list[str] = []
    bwd = tangent_dependent(gm.graph)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    primals = [n for n in placeholders if n.name.startswith("primals")]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    output_node = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output_node.args[0])

    for k, (node, pl) in enumerate(zip(primals, primal_placements)):
        env[node] = pl
        origin = origins[k] if k < len(origins) else "input"
        nodes[node.name] = NodePlan(node.name, "input", (), pl, "input", 0.0, 1, origin)

    def visit(node: fx.Node) -> None:
        if node.op != "call_function":
            return
        targs = tensor_args(node)
        current = [env[a] for a in targs]
        if node.target is GETITEM:
            src = env[node.args[0]]
            out = src[node.args[1]] if isinstance(src, tuple) and not _is_placements(src) else src
            env[node] = out
            nodes[node.name] = NodePlan(node.name, "getitem", (), out, "getitem", 0.0, 1)
            return
        specs = op_strategy(node, current, mesh, mesh_shape, constraint_of)
        origin = "propagated"
        if not specs:
            specs = [replicated_spec(node, ndim, "fallback")]
            origin = "fallback: no rule"
        best, best_key = None, None
        for spec in specs:
            cost = sum(_edge_cost(a, c, r, mesh_shape) for a, c, r in zip(targs, current, spec.inputs))
            changed = sum(c != r for c, r in zip(current, spec.inputs))
            key = (cost, changed, -_sharding_degree(spec.output, mesh_shape))
            if best_key is None or key < best_key:
                best, best_key = spec, key
        assert best is not None
        if best.source == "fallback":
            gathered = sum(nbytes(a.meta["val"].shape, a.meta["val"].dtype) for a in targs)
            msg = (f"no sharding rule for {node.target} ({node.name}); it runs replicated: "
                   f"inputs {' '.join(fmt(c) for c in current)} are gathered "
                   f"({gathered} bytes global), cost {best_key[0]:.0f}")
            log.warning("dynamo_dist: %s", msg)
            fallbacks.append(msg)
        env[node] = best.output
        nodes[node.name] = NodePlan(node.name, str(node.target), best.inputs, best.output,
                                    best.source, best_key[0], len(specs), origin)

    fwd_nodes = [n for n in gm.graph.nodes if n not in bwd]
    for node in fwd_nodes:
        visit(node)

    final: list[Placements | None] = []
    for i, o in enumerate(outs[:num_fwd_outputs]):
        if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
            final.append(tuple(Replicate() if isinstance(p, Partial) else p for p in env[o]))
        else:
            final.append(None)
    for node, j in zip(tangents, diff_outputs):
        env[node] = final[j]
        nodes[node.name] = NodePlan(node.name, "tangent", (), final[j], "cotangent", 0.0, 1,
                                    f"follows forward output {j}")
    for node in gm.graph.nodes:
        if node in bwd:
            visit(node)

    out_inputs: list[Placements] = []
    total = 0.0
    for i, o in enumerate(outs):
        if not isinstance(o, fx.Node):
            continue
        want = final[i] if i < num_fwd_outputs else grad_placements[i - num_fwd_outputs]
        want = want if want is not None else replicate(ndim)
        out_inputs.append(want)
        total += _edge_cost(o, env[o], want, mesh_shape)
    nodes[output_node.name] = NodePlan(output_node.name, "output", tuple(out_inputs), None,
                                       "output", total, 1, "forward outputs non-Partial; "
                                       "gradients in their parameter's placement")
    return Plan(mesh_shape, tuple(mesh.mesh_dim_names or [f"axis{i}" for i in range(ndim)]),
                nodes, fallbacks)


def _edge_cost(node: fx.Node, cur, req, mesh_shape) -> float:
    val = node.meta["val"]
    return redistribute_cost(tuple(val.shape), val.dtype, cur, req, mesh_shape)


def _sharding_degree(output, mesh_shape) -> int:
    pls = output if _is_placements(output) else next((o for o in output if o), ())
    deg = 1
    for axis, p in enumerate(pls or ()):
        if p.is_shard():
            deg *= mesh_shape[axis]
    return deg
