"""Reading an FX node of the global joint graph: its arguments and its traced value.

Shared by the op rules, the cost model and the lowering (each asks these many times per node).
"""

from __future__ import annotations

import torch
import torch.fx as fx


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The FX nodes holding tensors among a node's args and kwargs, in pytree order (FX
    arguments nest only lists, tuples and dicts; walked by hand: the planner asks this hundreds
    of thousands of times, and pytree's generic walk was a quarter of the planning time)."""
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
