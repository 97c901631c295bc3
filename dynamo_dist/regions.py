"""A check of the ``torch.compiler.nested_compile_region`` calls in a Dynamo graph: each layer's
call must be handed that layer's own parameters and buffers.

Dynamo traces a region once and stamps out later calls of the same function with the tensors
it reads on each call (its subgraph reuse). On torch 2.13, a region marked on each layer
separately (``layer.forward = types.MethodType(region, layer)``, a closure or lambda per
layer) is stamped out with the tensors of the first layer it traced: every later layer
computes with that one layer's weights, in eager Inductor and ``dist`` alike, with no error.
A region marked on the class (``forward`` decorated in the class body) is stamped out right.
This check turns the wrong graph into an error before anything is planned.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError, user_source


def check_region_operands(gm: fx.GraphModule) -> None:
    """Raise DistCompileError where a region call of ``gm`` (Dynamo's graph, inside its
    trace) is handed a tensor of another call's module in place of its own module's tensor of
    the same name. Tied weights (one tensor held by two layers) and tensors a parent passes
    to every layer are not flagged. A call whose module Dynamo's path does not resolve to
    (outside a trace, another spelling) is not checked."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    calls = [] if hop is None else gm.graph.find_nodes(op="call_function", target=hop)
    frame = compat.dynamo_frame_locals() if len(calls) > 1 else None
    if frame is None:
        return
    sites: dict[object, list[tuple[fx.Node, str, torch.nn.Module]]] = {}
    for call in calls:
        stack = call.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else None
        module = compat.module_at_path(path, frame) if path else None
        if isinstance(module, torch.nn.Module):
            sites.setdefault(call.args[0].target, []).append((call, path, module))
    for body_sites in sites.values():
        # every tensor of the body's call sites, by identity: (module path, name in it)
        held: dict[int, tuple[str, str]] = {}
        for _, path, module in body_sites:
            for name, t in _tensors(module):
                held.setdefault(id(t), (path, name))
        for call, path, module in body_sites:
            own = dict(_tensors(module))
            for operand in call.args[2:]:
                if not isinstance(operand, fx.Node) or operand.op != "placeholder":
                    continue
                value = compat.graph_input_value(operand)
                other_path, name = held.get(id(value), (path, ""))
                mine = own.get(name)
                if other_path != path and mine is not None and mine is not value:
                    raise DistCompileError(
                        f"the nested_compile_region call of {path} was handed {other_path}'s "
                        f"'{name}' in place of its own: torch {torch.__version__}'s Dynamo "
                        f"reuses a region marked on each layer separately with another "
                        f"layer's tensors, so every such layer would compute with one "
                        f"layer's weights",
                        op="torch.ops.higher_order.invoke_subgraph",
                        source=user_source(call),
                        shapes=[tuple(value.shape), tuple(mine.shape)],
                        fix=f"mark the layer class once instead: decorate "
                            f"{type(module).__name__}.forward with "
                            f"@torch.compiler.nested_compile_region in its class body (or "
                            f"set {type(module).__name__}.forward = "
                            f"torch.compiler.nested_compile_region("
                            f"{type(module).__name__}.forward)), not each layer's forward")


def _tensors(module: torch.nn.Module):
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))
