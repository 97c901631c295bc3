"""Node order of a local graph before Inductor: which nodes may move, and moving the gradients'
landing collectives to where each gradient is ready.

Lowering emits a graph output's redistribute when it reaches the output node, so every
gradient's reduce_scatter to its parameter's placement (FSDP on a data axis) ran at the end of
the backward, and every layer's unsharded gradient lived until then. FSDP2 reduce-scatters a
layer's gradients right after that layer's backward; ``land_outputs_early`` gives the same order:
each node that only feeds graph outputs moves to right after the last of its inputs.
"""

from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
INVOKE_SUBGRAPH = getattr(torch.ops.higher_order, "invoke_subgraph", None)


def movable(node: fx.Node) -> bool:
    """A node whose place in the graph only its data edges fix: a functional ATen op that
    draws no random numbers (functional collectives and their waits included: every rank
    moves them alike), a getitem, an ``invoke_subgraph`` call (its body is made of such
    nodes: ``outline``)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or (INVOKE_SUBGRAPH is not None and target is INVOKE_SUBGRAPH):
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        # attention and dropout draw only with a nonzero probability
        return _no_dropout(node)
    return True


def _no_dropout(node: fx.Node) -> bool:
    """A dropout-capable op called with probability 0 (SDPA's ``dropout_p``, ``native_dropout``'s
    ``p``, or ``train=False``)."""
    schema = node.target._schema
    args = dict(zip((a.name for a in schema.arguments), node.args))
    args.update(node.kwargs)
    for a in schema.arguments:
        args.setdefault(a.name, a.default_value if a.has_default_value() else None)
    if args.get("train") is False:
        return True
    p = args.get("dropout_p", args.get("p"))
    return isinstance(p, (int, float)) and p == 0


# ops that only move or lay out data: what lowering wraps around a collective
_LAYOUT_OPS = {getattr(aten, name).default for name in (
    "view", "_unsafe_view", "reshape", "permute", "t", "clone", "alias", "expand",
    "unsqueeze", "stack", "cat", "constant_pad_nd")} | \
    {aten.slice.Tensor, aten.narrow.default, aten.transpose.int, aten.squeeze.dim,
     aten.squeeze.default, aten.unbind.int, aten.split.Tensor, aten.chunk.default}


def _landing(node: fx.Node) -> bool:
    """A collective, its wait, or an op that only moves or lays out data (the chain lowering
    builds around a collective), movable."""
    if not movable(node) or not isinstance(node.target, torch._ops.OpOverload):
        return node.target is operator.getitem
    return node.target in _LAYOUT_OPS or node.target.namespace == "_c10d_functional"


def land_outputs_early(gm: fx.GraphModule) -> int:
    """Move every landing node (``_landing``) whose users are graph outputs or other such nodes
    (a gradient's collectives to its parameter's placement, and the views around them) to
    right after the last of its inputs; such nodes ready at the same point keep their order.
    Returns how many nodes now follow another node than before. Every rank moves the same
    nodes, so collectives keep one order across ranks. In place (one pass over the graph);
    linted and recompiled when anything moved."""
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    tail: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.users and node.all_input_nodes and _landing(node) and \
                all(u is out or u in tail for u in node.users):
            tail.add(node)
    if not tail:
        return 0
    index = {n: k for k, n in enumerate(nodes)}
    missing = {t: len(set(t.all_input_nodes)) for t in tail}
    ready: list[int] = []
    seq: list[fx.Node] = []

    def emit(node: fx.Node) -> None:
        seq.append(node)
        for user in node.users:
            if user in tail:
                missing[user] -= 1
                if not missing[user]:
                    heapq.heappush(ready, index[user])

    for node in nodes:
        if node in tail:
            continue
        emit(node)
        while ready:
            emit(nodes[heapq.heappop(ready)])
    moved = sum(1 for a, b, c in zip(seq, seq[1:], nodes[1:]) if b is not c)
    if not moved:
        return 0
    for prev, node in zip(seq, seq[1:]):
        if prev.next is not node:
            prev.append(node)
    gm.graph.lint()
    gm.recompile()
    return moved
