"""Reading an FX node of the global joint graph: its arguments and its traced value.

Shared by the op rules, the cost model and the lowering (each asks these many times per node).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx


_frozen: dict[fx.Node, tuple[fx.Node, ...]] | None = None  # see ``frozen_graph``


@contextlib.contextmanager
def frozen_graph():
    """Within it, ``tensor_args`` is memoised per node: for passes that read a graph and never
    edit it (the planner asks each node's inputs about 30 times; the walk was 15% of planning
    a 32-layer Llama)."""
    global _frozen
    outer, _frozen = _frozen, {} if _frozen is None else _frozen
    try:
        yield
    finally:
        _frozen = outer


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The FX nodes holding tensors among a node's args and kwargs, in pytree order (FX
    arguments nest only lists, tuples and dicts; walked by hand: the planner asks this hundreds
    of thousands of times, and pytree's generic walk was a quarter of the planning time)."""
    if _frozen is not None:
        found = _frozen.get(node)
        if found is None:
            found = _frozen[node] = tuple(_walk_args(node))
        return list(found)
    return _walk_args(node)


def _walk_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    _collect_tensor_nodes(node.args, out)
    _collect_tensor_nodes(node.kwargs, out)
    return out


def _collect_tensor_nodes(value, out: list[fx.Node]) -> None:
    if isinstance(value, fx.Node):
        if isinstance(value.meta.get("val"), torch.Tensor):
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_tensor_nodes(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_tensor_nodes(v, out)


def node_arg(node: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` of ``node``, passed positionally or as keyword ``name``, else ``default``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def val_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)
