"""Outline repeated layers of a local graph into one shared ``invoke_subgraph`` body.

A local forward or backward graph holds every layer of the model one after another, so Inductor
generated, compiled and loaded the same kernels once per layer: 355 kernels and 66 of 88 s of
the 4-layer demo Llama's cold compile (``benchmarks/results/llama_dp_tp.md``). Here the nodes of
each layer become one ``torch.ops.higher_order.invoke_subgraph`` call; identical layers share
one body (one ``get_attr`` node), which Inductor lowers and generates code for once
(``ir.InvokeSubgraph``) and calls once per layer. This is what Dynamo's graph deduplication
does for a user's ``nested_compile_region``; DTensor + FSDP2 gets it from compiling each
``TransformerBlock`` on its own.

Which nodes make a layer: the module that made them (``nn_module_stack``; capture gives
backward nodes their forward module's stack). A node belongs to the first numbered entry of
its module path (``model.layers.3.self_attn.q_proj`` -> family ``model.layers``, instance 3).
Lowering's collectives and the partitioner's copies with no module join the one layer their
neighbours all belong to. Two instances share a body only when their nodes are the same ops
with the same constants, wired the same way, on inputs of the same shapes, strides, dtypes and
devices (``_signature``: compared whole, never by hash alone): sharing is then exact, since
Inductor compiles the body for those input layouts and constrains every call's inputs to them.

Before matching, an all_reduce of a view is rewritten as the view of the all_reduce
(``reduce_before_views``): the planner breaks that cost tie differently in the first and last
layers, which are otherwise the same as the rest.

An instance is left in place (never an error) when outlining it could change what the program
computes or the order of its effects: an op that draws random numbers or mutates (RNG offsets
and in-place writes are not per-call), a higher-order op or symbolic size inside it, a path
that leaves it and comes back (not convex), an effectful node between its first and last
node, or an output that is a view of one of its inputs (Inductor would reuse the input's
buffer after the call while the view still reads it). Nodes between them that use its results move after the call, in their order; every rank
rewrites its graph the same way, so collectives stay in one order on every rank.
``DYNAMO_DIST_OUTLINE=0`` turns the pass off.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core.collectives import collective_op
from inductor_passes.core.layers import layer_of
from inductor_passes.core.switches import switch

from .schedule import INVOKE_SUBGRAPH, movable

log = logging.getLogger("dynamo_dist.outline")

# fewer nodes than this: the call costs more than the kernels it would spare
MIN_NODES = 8
WAIT = torch.ops._c10d_functional.wait_tensor.default
# node meta key: a node of a layer that stays in the calling graph, never in the layer's body
# (``prefetch``: a gather issued one layer early, and its wait)
OUTSIDE = "dynamo_dist_outside_layer"
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
              torch.memory_format)


def enabled() -> bool:
    """``DYNAMO_DIST_OUTLINE`` (default on; 0 turns the pass off). Raises ValueError for another
    value."""
    return switch("DYNAMO_DIST_OUTLINE", "outline repeated layers", "off") and \
        INVOKE_SUBGRAPH is not None


@dataclasses.dataclass
class Outlined:
    """What ``outline_repeats`` did to one graph: per shared body (its attribute name), the
    layers (family, index) it was called for and its node count."""

    bodies: dict[str, tuple[list[tuple[str, int]], int]] = dataclasses.field(
        default_factory=dict)

    @property
    def calls(self) -> int:
        return sum(len(layers) for layers, _ in self.bodies.values())


class _Unsupported(Exception):
    """An instance that cannot be outlined (the reason is the message)."""


def assign_layers(gm: fx.GraphModule) -> dict[fx.Node, tuple[str, int]]:
    """Each call_function node's layer: its own module's, else the one layer every tagged
    neighbour (inputs and users) belongs to (repeated to a fixed point) when it was made by no
    module at all. Code of an unnumbered module (an embedding, the final norm) stays outside
    and counts as a neighbour of its own: a gradient sum between the final norm and the last
    layer stays outside as the one between two layers does, so the last layer can match the
    others."""
    layer: dict[fx.Node, tuple[str, int] | None] = {}
    loose = []  # made by no module (a collective lowering added, autograd's gradient sums)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("nn_module_stack"):
            layer[node] = layer_of(node)  # None: an unnumbered module's code, a neighbour too
        else:
            loose.append(node)
    changed = True
    while changed and loose:
        changed, still = False, []
        for node in loose:
            around = {layer[m] for m in (*node.all_input_nodes, *node.users) if m in layer}
            if len(around) == 1:
                layer[node] = around.pop()
                changed = True
            else:
                still.append(node)
        loose = still
    return {n: k for n, k in layer.items() if k is not None}


def _sig(value: Any) -> Any:
    """A value's signature: a tensor's shape, strides, dtype and device; constants as they are.
    Raises _Unsupported for a symbolic size or an object of another type."""
    if isinstance(value, torch.Tensor):
        if any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
            raise _Unsupported("symbolic size")
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_sig(v) for v in value))
    if isinstance(value, torch.SymInt):
        raise _Unsupported("symbolic size")
    if isinstance(value, _CONSTANTS):
        return (type(value).__name__, value)
    raise _Unsupported(f"value of type {type(value).__name__}")


def _signature(nodes: list[fx.Node]) -> tuple[Any, list[fx.Node]]:
    """(signature, external inputs in first-use order) of one instance. Two instances with
    equal signatures compute the same function of their external inputs, which have the same
    layouts. Raises _Unsupported."""
    index = {n: k for k, n in enumerate(nodes)}
    external: dict[fx.Node, int] = {}

    def canon(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in index:
                return ("node", index[a])
            if a.op not in ("placeholder", "call_function", "get_attr"):
                raise _Unsupported(f"input {a.op}")
            return ("input", external.setdefault(a, len(external)))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(canon(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, canon(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", canon(a.start), canon(a.stop), canon(a.step))
        if isinstance(a, float):  # repr: -0.0 is not 0.0 (1 / x tells them apart)
            return ("float", repr(a))
        if isinstance(a, _CONSTANTS):
            return (type(a).__name__, a)
        raise _Unsupported(f"argument of type {type(a).__name__}")

    body = []
    for n in nodes:
        if any(u not in index for u in n.users) and not isinstance(n.meta.get("val"),
                                                                     torch.Tensor):
            raise _Unsupported(f"{n.name} is used outside and is not one tensor")
        if not movable(n):
            raise _Unsupported(f"{n.target} (random, mutating or not an ATen op)")
        body.append((n.target, canon(n.args), canon(n.kwargs), _sig(n.meta.get("val"))))
    if not all(isinstance(x.meta.get("val"), torch.Tensor) for x in external):
        raise _Unsupported("an input is not one tensor")
    inputs = tuple(_sig(x.meta.get("val")) for x in external)
    return (tuple(body), inputs), list(external)


@dataclasses.dataclass
class _Instance:
    key: tuple[str, int]
    nodes: list[fx.Node]
    inputs: list[fx.Node]


def instances(gm: fx.GraphModule, include: Callable[[fx.Node], bool] = lambda n: True
              ) -> dict[Any, list[_Instance]]:
    """Instances grouped by (family, signature), in graph order; groups of one dropped. Only
    the nodes ``include`` accepts make up an instance (``align_saves``: the forward part), never
    one marked ``OUTSIDE``."""
    members: dict[tuple[str, int], list[fx.Node]] = {}
    for node, key in assign_layers(gm).items():
        if include(node) and not node.meta.get(OUTSIDE):
            members.setdefault(key, []).append(node)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    groups: dict[Any, list[_Instance]] = {}
    for key, nodes in members.items():
        if len(nodes) < MIN_NODES:
            continue
        nodes.sort(key=order.__getitem__)
        try:
            sig, inputs = _signature(nodes)
        except _Unsupported as why:
            log.debug("dynamo_dist: layer %s.%d not outlined: %s", key[0], key[1], why)
            continue
        groups.setdefault((key[0], sig), []).append(_Instance(key, nodes, inputs))
    return {k: v for k, v in groups.items() if len(v) > 1}


def _storage(value: Any) -> int | None:
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


def storage_of(node: fx.Node) -> int | None:
    """An id of the storage ``node``'s traced value lives in (views share their base's), or
    None for a value that is not one tensor."""
    return _storage(node.meta.get("val"))


def _outputs_own_storage(inst: _Instance, outputs: list[int]) -> None:
    """Raise _Unsupported when an output of the body would be a view of one of its inputs.
    Inductor plans the calling graph's memory as if a call's outputs were new buffers: after
    the call it reused the input's buffer while the output view (an activation saved for the
    backward) still read it. Mixtral on dp=2 x tp=2 at 4 layers trained to gradients 82x off
    (a body returned a batch slice of its input), with the loss right."""
    held = {_storage(x.meta.get("val")) for x in inst.inputs} - {None}
    for j in outputs:
        if _storage(inst.nodes[j].meta.get("val")) in held:
            raise _Unsupported(f"output {inst.nodes[j].name} is a view of an input")


def _later_users(nodes: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """Nodes between an instance's first and last node (``nodes``, in graph order) that use its
    results (transitively), in graph order: they move after the call. Raises _Unsupported when
    a path leaves the instance and comes back, or an effectful node lies in between."""
    members = set(nodes)
    first, last = order[nodes[0]], order[nodes[-1]]
    later: set[fx.Node] = set()
    todo = [u for n in nodes for u in n.users if u not in members]
    while todo:
        node = todo.pop()
        if node in later or order.get(node, last + 1) > last:
            continue
        later.add(node)
        for user in node.users:
            if user in members:
                raise _Unsupported("a path leaves it and comes back")
            todo.append(user)
    between = [n for n in nodes[0].graph.nodes if first < order[n] < last and n not in members]
    if any(not movable(n) for n in between):
        raise _Unsupported("an effectful node lies between its nodes")
    return [n for n in between if n in later]


def _body(inst: _Instance, outputs: list[int]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(inst.inputs):
        p = graph.placeholder(f"arg{k}")
        p.meta["val"] = x.meta["val"]
        env[x] = p
    for n in inst.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[inst.nodes[j]] for j in outputs))
    return compat.graph_module(torch.nn.Module(), graph)


def _replace(gm: fx.GraphModule, inst: _Instance, attr: fx.Node, name: str,
             outputs: list[int]) -> None:
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    # where its nodes are now: an earlier call may have moved some after itself (the body
    # keeps their first order, which is topological too)
    now = sorted(inst.nodes, key=order.__getitem__)
    later = _later_users(now, order)
    last = now[-1]
    with gm.graph.inserting_after(last):
        call = gm.graph.call_function(INVOKE_SUBGRAPH, (attr, name, *inst.inputs))
    call.meta["val"] = tuple(inst.nodes[j].meta["val"] for j in outputs)
    anchor = call
    members = set(inst.nodes)
    for k, j in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            item = gm.graph.call_function(operator.getitem, (call, k))
        item.meta["val"] = inst.nodes[j].meta["val"]
        inst.nodes[j].replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
        anchor = item
    for node in later:
        anchor.append(node)
        anchor = node
    for node in reversed(inst.nodes):
        gm.graph.erase_node(node)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.reshape.default)


def reduce_before_views(gm: fx.GraphModule) -> int:
    """Rewrite ``wait(all_reduce(view(x)))`` as ``view(wait(all_reduce(x)))`` where the view is
    the all_reduce's only reason to exist (its one user) and ``x`` is contiguous; returns how
    many. The two compute the same values (an all_reduce is elementwise across ranks); the
    planner, between equal costs, reduces before the view in some layers and after it in
    others (the first and last layers of a Llama under tp), which made their signatures differ
    and kept them out of the shared body. One form for all: every layer can then match."""
    count = 0
    for ar in list(gm.graph.nodes):
        if collective_op(ar) != "all_reduce" or len(ar.users) != 1:
            continue
        view = ar.args[0]
        wait = next(iter(ar.users))
        if not (isinstance(view, fx.Node) and view.op == "call_function" and view.target in _VIEWS
                and len(view.users) == 1 and wait.target is WAIT):
            continue
        src = view.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        with gm.graph.inserting_before(ar):
            new_ar = gm.graph.call_function(ar.target, (src, *ar.args[1:]), dict(ar.kwargs))
            new_wait = gm.graph.call_function(WAIT, (new_ar,))
            new_view = gm.graph.call_function(view.target, (new_wait, *view.args[1:]),
                                              dict(view.kwargs))
        new_ar.meta = {**ar.meta, "val": val}
        new_wait.meta = {**wait.meta, "val": val}
        new_view.meta = dict(wait.meta)
        wait.replace_all_uses_with(new_view)
        for node in (wait, ar, view):
            gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def outline_repeats(gm: fx.GraphModule) -> Outlined:
    """Rewrite ``gm`` (a local forward or backward graph) in place: each group of identical
    layers becomes calls of one shared ``invoke_subgraph`` body (attribute ``dd_layer_<k>``).
    Returns what was outlined (nothing when the pass is off, torch lacks the higher-order op,
    or no layer repeats). Local shapes throughout; no error is raised for a layer that cannot
    be outlined: it stays inline."""
    done = Outlined()
    if not enabled():
        return done
    reduce_before_views(gm)
    for k, ((family, sig), group) in enumerate(instances(gm).items()):
        users = [{j for j, n in enumerate(i.nodes) if any(u not in set(i.nodes) for u in n.users)}
                 for i in group]
        outputs = sorted(set().union(*users))
        name = f"dd_layer_{k}"
        attr, called = None, []
        for inst in group:
            try:
                # read again: an earlier group's calls replaced some of these inputs
                again, inst.inputs = _signature(inst.nodes)
                if again != sig:
                    raise _Unsupported("changed by an earlier rewrite")
                _outputs_own_storage(inst, outputs)
                if attr is None:
                    gm.add_submodule(name, _body(inst, outputs))
                    placed = next(n for n in gm.graph.nodes if n.op != "placeholder")
                    with gm.graph.inserting_before(placed):
                        attr = gm.graph.get_attr(name)
                _replace(gm, inst, attr, name, outputs)
            except _Unsupported as why:
                log.debug("dynamo_dist: layer %s.%d not outlined: %s", *inst.key, why)
                continue
            called.append(inst.key)
        if called:
            done.bodies[name] = (called, len(group[0].nodes))
        elif attr is not None:
            gm.graph.erase_node(attr)
            delattr(gm, name)
    if done.bodies:
        gm.graph.lint()
        gm.recompile()
        log.info("dynamo_dist: %d layer(s) outlined into %d shared bodies",
                 done.calls, len(done.bodies))
    return done
