"""Typed roles of a joint graph's values, and the ``node.meta`` keys the stages share.

Capture (``dynamo_dist.capture``) names the joint graph's placeholders ``primals_1..n`` (the
program's tensor inputs, in order) then ``tangents_1..m`` (the cotangents of the differentiable
forward outputs), as AOTAutograd does. Every stage that needs to know which is which asks here,
so that convention is written once.
"""

from __future__ import annotations

import dataclasses
import enum

import torch.fx as fx

# node.meta keys set by one stage and read by another
MANUAL = "dynamo_dist_manual"  # the value is a LOCAL tensor (a manual region; dynamo_dist.manual)
VARYING = "dynamo_dist_varying"  # mesh axes over which such a local value differs between ranks
# node.meta["custom"] key marking the gradient seed of a backward traced inside the program
# (``loss.backward()`` in a compiled training step): a tangent made in the graph, not passed in
BACKWARD_SEED = "dynamo_dist_backward_seed"

_PRIMAL, _TANGENT = "primals_", "tangents_"


def primal_name(k: int) -> str:
    """The placeholder name of the program's ``k``-th tensor input (0-based)."""
    return f"{_PRIMAL}{k + 1}"


def tangent_name(j: int) -> str:
    """The placeholder name of the ``j``-th cotangent (0-based)."""
    return f"{_TANGENT}{j + 1}"


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith(_PRIMAL)


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith(_TANGENT)


def primal_index(node: fx.Node) -> int:
    """The 0-based input position of a primal placeholder (ValueError for another node)."""
    if not is_primal(node):
        raise ValueError(f"{node.name} is not a primal placeholder")
    return int(node.name[len(_PRIMAL):].split("_")[0]) - 1


def primals(graph: fx.Graph) -> list[fx.Node]:
    """The program-input placeholders, in input order."""
    return [n for n in graph.find_nodes(op="placeholder") if is_primal(n)]


def tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on any tangent placeholder or in-graph gradient seed: the backward
    part of a joint graph."""
    bwd: set[fx.Node] = set()
    for node in graph.nodes:
        if is_tangent(node) or \
                (node.meta.get("custom") or {}).get(BACKWARD_SEED):
            bwd.add(node)
        elif any(a in bwd for a in node.all_input_nodes):
            bwd.add(node)
    return bwd


class InputKind(enum.Enum):
    """What a program input is to the planner."""
    DTENSOR = "DTensor input"  # a parameter or a value the user sharded: its gathers cost memory
    PLAIN = "plain tensor input"  # a plain tensor: a global value present on every rank


@dataclasses.dataclass(frozen=True)
class InputOrigin:
    """Where a primal came from: its kind, the user's name for it (for reports), and whether
    it is a parameter (an ``nn.Parameter``, or a leaf that requires grad). A DTensor input that
    is not one is priced as data on a data axis: a block compiled on its own (torchtitan's
    per-layer compile) receives the previous block's activations as a DTensor split over the
    batch, and gathering those is not data parallelism."""
    kind: InputKind
    name: str
    parameter: bool = True

    def __str__(self) -> str:
        if self.kind is InputKind.PLAIN:
            return f"{self.kind.value} {self.name} (a global value on every rank)"
        return f"{self.kind.value} {self.name}"
