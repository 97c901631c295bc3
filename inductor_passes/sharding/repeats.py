"""Layer-invariant node signatures: what lets the planner's cost stay flat in model depth.

Two things are keyed here rather than by the node itself:

* ``LocalKeys``: everything an OpStrategy of a node depends on (its op, its non-tensor
  arguments, the shapes, dtypes and strides of its inputs and outputs, a pinned constraint, a
  manual region, forward or backward part). Layer 17's ``mm`` and layer 3's ``mm`` have one key,
  so the rules are asked once per distinct layer, not once per node.
* ``repeat_classes``: nodes that sit in the same place of identical layers, found by
  Weisfeiler-Lehman colour refinement (each round hashes a node's colour with its inputs' and
  users' colours). The ILP gives every class one set of choice variables (``ShardingILP``) and
  pays each member's costs on them, as AutoParallel's clustering links the variables of
  repeated layers (there found with torch's graph-region tracker). Nodes near a non-repeated
  part (the embedding, the loss) differ within a few hops and keep their own variables, so the
  first and last layer stay free.

Both are conservative by construction: an unknown argument type gives a key no other node has,
and the solver shares variables only between class members whose option lists are equal.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..core import roles

_PLAIN = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _val_key(v) -> object:
    if isinstance(v, torch.Tensor):
        try:
            stride = tuple(str(s) for s in v.stride())
        except RuntimeError:  # sparse or nested: no strides
            stride = None
        return ("T", tuple(str(s) for s in v.shape), v.dtype, stride, v.layout)
    if isinstance(v, (tuple, list)):
        return tuple(_val_key(x) for x in v)
    if v is None:
        return None
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return ("S", type(v).__name__, str(v))
    return ("id", id(v))  # unknown: a key no other node shares


def _arg_key(a, seen: dict) -> object:
    """``seen``: node -> its first-occurrence number among the arguments, so that ``mul(x, x)``
    and ``mul(x, y)`` differ (one value passed twice has one placement)."""
    if isinstance(a, fx.Node):
        return ("N", _val_key(a.meta.get("val")), seen.setdefault(a, len(seen)))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_arg_key(x, seen) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg_key(x, seen)) for k, x in a.items()))
    if isinstance(a, float):
        return ("float", repr(a))  # -0.0 and nan keep their identity
    if isinstance(a, _PLAIN):
        return (type(a).__name__, a)
    return ("id", id(a))


class LocalKeys:
    """node -> a hashable key equal for two nodes exactly when every input of the rules agrees
    (``rules.op_strategy`` reads a node's target, arguments, its inputs' and its own metadata,
    which of its arguments are the same value, its constraint and its manual mark;
    ``data_parallel_ok`` whether it is in the backward).
    Placeholders and get_attr constants are keyed by themselves."""

    def __init__(self, gm: fx.GraphModule, constraint_of: Callable[[fx.Node], object]) -> None:
        self._bwd = roles.tangent_dependent(gm.graph)
        self._constraint_of = constraint_of
        self._keys: dict[fx.Node, object] = {}

    def __call__(self, node: fx.Node) -> object:
        key = self._keys.get(node)
        if key is None:
            if node.op != "call_function":
                key = ("self", node)
            else:
                seen: dict = {}
                key = (node.target, _arg_key(node.args, seen), _arg_key(node.kwargs, seen),
                       _val_key(node.meta.get("val")), self._constraint_of(node),
                       _arg_key(node.meta.get(roles.MANUAL), seen), node in self._bwd)
            self._keys[node] = key
        return key


def repeat_classes(gm: fx.GraphModule, keys: LocalKeys, rounds: int,
                   extra: Callable[[fx.Node], object] = lambda n: None) -> dict[fx.Node, int]:
    """node -> colour after ``rounds`` of Weisfeiler-Lehman refinement over the graph's edges
    (both directions, with argument slots), starting from ``keys`` (placeholders: their value's
    metadata and primal or tangent) and ``extra(node)`` (what the caller knows that the graph
    does not show: pinned placements, where a graph output must land). Nodes with equal colours
    are in the same place of identical repeated structure as far as ``rounds`` hops see.
    ``rounds`` 0: every node has its own colour (nothing shared)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if rounds <= 0:
        return {n: i for i, n in enumerate(nodes)}
    intern: dict[object, int] = {}

    def colour(key) -> int:
        return intern.setdefault(key, len(intern))

    def start(n: fx.Node) -> object:
        if n.op == "placeholder":
            return ("ph", roles.is_primal(n), _val_key(n.meta.get("val")), extra(n))
        if n.op == "get_attr":
            return ("self", n)
        return keys(n), extra(n)

    col = {n: colour(start(n)) for n in nodes}
    # (``all_input_nodes`` builds a list per call: built once per node, not once per edge)
    slots = {n: {a: k for k, a in enumerate(n.all_input_nodes)} for n in nodes}
    ins = {n: [a for a in slots[n] if a in col] for n in nodes}
    outs = {n: [(u, slots[u][n]) for u in n.users if u in col] for n in nodes}
    for _ in range(rounds):
        intern = {}
        col = {n: colour((col[n], tuple(col[a] for a in ins[n]),
                          tuple(sorted((col[u], k) for u, k in outs[n])))) for n in nodes}
    return col
