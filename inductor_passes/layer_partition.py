"""Partitioning each distinct repeated layer once: the other copies get its forward/backward split.

The min-cut partitioner (``compile._min_cut``) decides, over the whole local joint graph, which
forward values the backward reads saved and which it recomputes. Its time grows with the graph:
two runs (``align_saves`` partitions again) were 16 of the 115 profiled backend seconds of the
32-layer demo Llama's compile, against 1.2 at 2 layers. Copies of one layer are the same
computation on inputs of the same layouts, so they can take the same split, which is also
what outlining wants (one shared backward body, ``align_saves``'s reason to exist).

Here, for each group of layers whose joint part (forward and backward nodes together) has one
signature (``outline.instances``), one representative -- an interior layer, since the first and
last differ in what their neighbours let them recompute -- is cut out as a joint graph of its
own and partitioned: a forward body (its inputs -> its outputs and saved values) and a backward
body (saved values and the incoming gradients -> its gradients). Every copy's forward and
backward nodes are then replaced, in the whole joint graph, by one opaque call of these bodies
each, and that much smaller graph is partitioned (the calls are never recomputed: their saved
outputs must be saved). Last, each call is expanded back into its body's nodes, which take the
metadata (module stack, traced value, tags) of the copy's own nodes at the same position, so
the forward and backward graphs are flat as before and every later pass reads them unchanged.

The result is a valid partition of the same program: each body is the partitioner's own answer
for the representative, and the copies compute the same function of the same inputs
(``outline._signature``: same ops, constants, wiring and layouts). It may differ from the
whole-graph min-cut where that one chose differently at a layer boundary (it saves per layer,
as a per-layer compile -- DTensor + FSDP2's ``torch.compile`` of each block -- does).

Inductor's joint-graph rewrites (``rewrite``: ``compile._joint_rewrites``) run on each
representative's joint graph and on the outer graph, not over the whole joint graph; the nodes
they make are named apart from the joint's and get values of their own in each copy.

A layer whose forward is a group's but whose backward is not (the first or last of a stack)
is partitioned with the outer graph, marked to save what the representative saves, so that
its forward still shares the group's compiled body and no second partition is needed.

Left to the whole-graph partition (``partition_by_layer`` returns None, never an error): no
group repeats, a layer draws random numbers or mutates (``outline.movable``), a size is
symbolic, a copy is not convex in the graph, the partitioner saves a size, or the backward
body takes an input that is neither a saved value nor an incoming gradient (the RNG state the
partitioner threads through a layer under activation checkpointing).
``DYNAMO_DIST_LAYER_PARTITION=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .core import compat, roles
from .core.switches import switch
from .outline import INVOKE_SUBGRAPH, _Instance, instances
from .stamp import FakeCopier, NotStamped

log = logging.getLogger("dynamo_dist.layer_partition")

_FORWARD = "is_forward"
_PREFIX = "dd_part_"
_OWN_NAME = "dynamo_dist_layer_partition_name"  # meta: the copy's node a body output stands for
# meta: a cut-out node's position in its instance, carried by the partitioner's copies of it
# (names are not: two layers' equal values can swap names between graphs)
_POSITION = "dynamo_dist_layer_partition_position"
_PLAN = "dynamo_dist_layer_partition_plan"  # meta of a body call: the copy it stands for


def enabled() -> bool:
    """``DYNAMO_DIST_LAYER_PARTITION`` (default on; 0: one partition of the whole graph).
    ValueError for another value."""
    return switch("DYNAMO_DIST_LAYER_PARTITION", "partition each distinct layer once",
                  "partition the whole graph") and INVOKE_SUBGRAPH is not None


class _Refused(Exception):
    """The graph is left to the whole-graph partition (the reason is the message)."""


def _forward(node: fx.Node) -> bool:
    if node.op == "placeholder":
        return not roles.is_tangent(node)
    if node.op == "get_attr":
        return True
    return node.meta.get("partitioner_tag") == _FORWARD


@dataclasses.dataclass
class _Split:
    """One group's representative, partitioned. ``fw_inputs``/``bw_inputs``: positions in an
    instance's external inputs that the forward body takes and that the backward call takes
    besides the saved values (incoming gradients); ``saved``: per backward-body saved input, the
    forward body's output position or ("input", k) for an external input saved as it is."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    fw_inputs: list[int]
    bw_inputs: list[int]
    fw_outputs: list[int]  # positions in the instance's nodes
    bw_outputs: list[int]
    saved: list[Any]
    num_saved: int
    saved_forward: tuple[int, ...]  # positions, among its forward nodes, of the values saved


def _rewrite(gm: fx.GraphModule, rewrite: Callable) -> None:
    """``rewrite(gm)``, the nodes it makes renamed apart from the joint graph's names: the
    expanded graphs name each copy's nodes as its own, and ``align_saves`` matches saved values
    to the joint graph's nodes by name (a rewritten node named ``view_default`` took a layer
    node's name, which then read as another layer's value saved)."""
    before = set(gm.graph.nodes)
    rewrite(gm)
    for node in gm.graph.nodes:
        if node not in before and node.op != "output":
            node._rename(f"{_PREFIX}{node.name}")
            node.meta.pop(_POSITION, None)  # it stands for no node of the joint graph
    gm.recompile()


def _cut_out(rep: _Instance, static_nodes: set[fx.Node]
             ) -> tuple[fx.GraphModule, list[int], list[int], list[int], list[int], list[int]]:
    """The representative as a joint graph of its own: forward inputs as primals, backward
    inputs as tangents, outputs (its values used elsewhere: forward ones first)."""
    members = set(rep.nodes)
    fw_inputs = [k for k, x in enumerate(rep.inputs) if _forward(x)]
    bw_inputs = [k for k, x in enumerate(rep.inputs) if not _forward(x)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    static: list[int] = []
    for j, k in enumerate(fw_inputs):
        x = rep.inputs[k]
        p = graph.placeholder(f"primals_{j + 1}")
        p.meta["val"] = x.meta["val"]
        env[x] = p
        if x in static_nodes:
            static.append(j)
    for j, k in enumerate(bw_inputs):
        p = graph.placeholder(f"tangents_{j + 1}")
        p.meta["val"] = rep.inputs[k].meta["val"]
        env[rep.inputs[k]] = p
    for j, n in enumerate(rep.nodes):
        env[n] = graph.node_copy(n, env.__getitem__)
        env[n].meta[_POSITION] = j
    used_outside = [j for j, n in enumerate(rep.nodes) if any(u not in members for u in n.users)]
    fw_outputs = [j for j in used_outside if _forward(rep.nodes[j])]
    bw_outputs = [j for j in used_outside if not _forward(rep.nodes[j])]
    graph.output(tuple(env[rep.nodes[j]] for j in (*fw_outputs, *bw_outputs)))
    return (compat.graph_module(torch.nn.Module(), graph), fw_inputs, bw_inputs, fw_outputs,
            bw_outputs, static)


def _split(rep: _Instance, static_nodes: set[fx.Node], partition: Callable,
           rewrite: Callable | None) -> _Split:
    joint, fw_inputs, bw_inputs, fw_outputs, bw_outputs, static = _cut_out(rep, static_nodes)
    if not fw_outputs or not any(not _forward(n) for n in rep.nodes):
        raise _Refused("not a layer with both a forward and a backward part")
    if rewrite is not None:  # the joint-graph rewrites, once for the whole group
        _rewrite(joint, rewrite)
    fw, bw = partition(joint, num_fwd_outputs=len(fw_outputs), static=static)
    for gm in (fw, bw):
        gm.graph.eliminate_dead_code()
    fw_out = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])
    saved_nodes = fw_out[len(fw_outputs):]
    if any(not isinstance(a, fx.Node) or not isinstance(a.meta.get("val"), torch.Tensor)
           for a in saved_nodes):
        raise _Refused("a saved value is not a tensor (a size)")
    fw_ph = {p.name: j for j, p in enumerate(fw.graph.find_nodes(op="placeholder"))}
    saved_at = {a.name: len(fw_outputs) + s for s, a in enumerate(saved_nodes)}
    saved: list[Any] = []
    tangents = 0
    for p in bw.graph.find_nodes(op="placeholder"):
        if p.name.startswith("tangents_"):
            if int(p.name.split("_")[1]) != tangents + 1:
                raise _Refused("the backward body's incoming gradients are out of order")
            tangents += 1
            continue
        if p.name not in saved_at:
            raise _Refused(f"backward body input {p.name} is not a saved value")
        source = next(a for a in saved_nodes if a.name == p.name)
        # an input saved as it is: the call takes the input itself, not a copy out of the body
        saved.append(("input", fw_inputs[fw_ph[p.name]]) if source.op == "placeholder"
                     else saved_at[p.name])
    if tangents != len(bw_inputs):
        raise _Refused("the backward body dropped an incoming gradient")
    kept = {a.meta[_POSITION] for a in saved_nodes if _POSITION in a.meta}
    forward = [j for j, n in enumerate(rep.nodes) if _forward(n)]
    saved_forward = tuple(k for k, j in enumerate(forward) if j in kept)
    return _Split(fw, bw, fw_inputs, bw_inputs, fw_outputs, bw_outputs, saved,
                  len(saved_nodes), saved_forward)


def _align_the_rest(joint: fx.GraphModule, plans: list[tuple[_Instance, _Split, str]]) -> int:
    """Mark ``MUST_SAVE``, in each layer whose forward part is the same computation as a
    partitioned group's but whose backward differs (the first or last layer: its incoming
    gradient or its input's role is another), the values the group's representative saves.
    Such a layer is partitioned with the rest of the graph; marked so, it saves alike and its
    forward shares the group's body, as ``align_saves`` would arrange with a second partition
    of everything. Returns how many were marked."""
    split_of = {inst.key: split for inst, split, _ in plans}
    marked = 0
    for group in instances(joint, _forward).values():
        splits = [split_of[i.key] for i in group if i.key in split_of]
        if not splits:
            continue
        for inst in group:
            if inst.key not in split_of:
                for k in splits[0].saved_forward:
                    compat.mark_must_save(inst.nodes[k])
                    marked += 1
    return marked


def _outer(joint: fx.GraphModule, plans: list[tuple[_Instance, _Split, str]]
           ) -> fx.GraphModule:
    """``joint`` with each planned instance's forward and backward nodes replaced by one call
    of its group's bodies each (attributes ``<name>_fw`` / ``<name>_bw``)."""
    # the joint's own attributes (a tensor constant: GPT-Neo's local-attention mask) and the
    # bodies, by qualified name
    root: dict[str, Any] = {n.target: operator.attrgetter(n.target)(joint)
                            for n in joint.graph.find_nodes(op="get_attr")}
    graph = fx.Graph()
    unit_of: dict[fx.Node, tuple[int, bool]] = {}  # node -> (plan index, forward part)
    for p, (inst, _, _) in enumerate(plans):
        for n in inst.nodes:
            unit_of[n] = (p, _forward(n))
    attrs: dict[str, fx.Node] = {}
    env: dict[fx.Node, fx.Node] = {}
    saved_of: dict[int, list[fx.Node]] = {}
    deferred: list = []

    def attr(name: str, gm: fx.GraphModule) -> fx.Node:
        if name not in attrs:  # moved ahead of every call at the end
            root[name] = gm
            attrs[name] = graph.get_attr(name)
        return attrs[name]

    def call(name: str, body: fx.GraphModule, args: list[fx.Node], tag: str,
             outs: list[fx.Node | None], p: int) -> list[fx.Node]:
        inst, split, _ = plans[p]
        node = graph.call_function(INVOKE_SUBGRAPH, (attr(name, body), name, *args))
        body_out = list(next(iter(body.graph.find_nodes(op="output"))).args[0])
        inputs = dict(zip(body.graph.find_nodes(op="placeholder"), args))
        # each output as this copy's own value (its own fake: storages are told apart by
        # the memory estimate and by outlining), named after its own node
        own = [inst.nodes[b.meta[_POSITION]] if _POSITION in b.meta else None
               for b in body_out]
        vals = [o.meta.get("val") if o is not None else
                inputs[b].meta.get("val") if b in inputs else b.meta.get("val")
                for o, b in zip(own, body_out)]
        node.meta["val"] = tuple(vals)
        node.meta["partitioner_tag"] = tag
        node.meta[_PLAN] = p
        compat.mark_must_save(node)  # never recomputed: the cut lies at its outputs
        items = []
        for k, val in enumerate(vals):
            item = graph.create_node("call_function", operator.getitem, (node, k), {},
                                     name=f"{name}_out")
            item.meta["val"] = val
            item.meta["partitioner_tag"] = tag
            if own[k] is not None:  # the backward's placeholder for it takes this name
                item.meta[_OWN_NAME] = own[k].name
            items.append(item)
        for k, orig in enumerate(outs):
            if orig is not None:
                env[orig] = items[k]
        return items

    def unit_args(key: tuple[int, bool]) -> list[fx.Node] | None:
        """The unit's external inputs, or None while one is not emitted yet."""
        p, forward = key
        inst, split, _ = plans[p]
        args = [inst.inputs[k] for k in (split.fw_inputs if forward else split.bw_inputs)]
        if not forward and p not in saved_of:
            return None
        return args if all(a in env for a in args) else None

    def emit(key: tuple[int, bool], args: list[fx.Node]) -> None:
        p, forward = key
        inst, split, name = plans[p]
        if forward:
            outs = [inst.nodes[j] for j in split.fw_outputs] + [None] * split.num_saved
            items = call(f"{name}_fw", split.fw, [env[a] for a in args], _FORWARD, outs, p)
            saved_of[p] = [env[inst.inputs[s[1]]] if isinstance(s, tuple) else items[s]
                           for s in split.saved]
            for item in items:  # a tuple is never saved: the cut lies at these
                compat.mark_must_save(item)
        else:
            outs = [inst.nodes[j] for j in split.bw_outputs]
            call(f"{name}_bw", split.bw, saved_of[p] + [env[a] for a in args],
                 "is_backward", outs, p)

    def place(item) -> bool:
        """Emit ``item`` (an outer node or a unit's key) if its inputs are there."""
        if isinstance(item, tuple):
            args = unit_args(item)
            if args is None:
                return False
            emit(item, args)
            return True
        if not all(a in env for a in item.all_input_nodes):
            return False
        env[item] = graph.node_copy(item, env.__getitem__)
        return True

    # In graph order, a unit where its first node was, each item as soon as its inputs are
    # there: a unit's last node can lie after other units' nodes that need it (lowering puts a
    # gradient's reduce_scatter at the end), and loose nodes between two layers wait for both.
    seen: set[tuple[int, bool]] = set()
    output = None
    for n in joint.graph.nodes:
        if n.op == "output":
            output = n
            continue
        item = unit_of.get(n, n)
        if isinstance(item, tuple):
            if item in seen:
                continue
            seen.add(item)
        if deferred or not place(item):
            deferred.append(item)
        progress = True
        while progress and deferred:  # in order: an item placed may free the ones after it
            progress = False
            for d in list(deferred):
                if place(d):
                    deferred.remove(d)
                    progress = True
    if deferred:
        raise _Refused("a path leaves a layer and comes back")
    env[output] = graph.node_copy(output, env.__getitem__)
    # get_attr nodes first, ahead of their calls
    for node in attrs.values():
        first = next(n for n in graph.nodes if n.op != "placeholder")
        if node is not first:
            first.prepend(node)
    gm = compat.graph_module(root, graph)
    gm.graph.lint()
    return gm


class _Values:
    """Fake values, for one body call, of the body's nodes that stand for no node of the copy
    (made by a rewrite): aliasing the copy's values as the body's alias the representative's
    (``stamp.FakeCopier``), never shared between copies (the peak prediction and outlining tell
    storages apart)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copier: FakeCopier | None = None

    def pair(self, body: Any, own: Any) -> None:
        if isinstance(body, torch.Tensor) and isinstance(own, torch.Tensor):
            if self.copier is None:
                self.pairs.append((body, own))
            else:
                self.copier.pair(body, own)

    def copy(self, val: Any) -> Any:
        if not any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(val)):
            return val
        if self.copier is None:
            mode = next(t.fake_mode for t in torch.utils._pytree.tree_leaves(val)
                        if isinstance(t, torch.Tensor))
            self.copier = FakeCopier(mode, self.pairs)
        try:
            return self.copier.copy(val)
        except NotStamped as why:
            raise _Refused(f"a rewritten value: {why}") from why


def _expand(gm: fx.GraphModule, plans: list[tuple[_Instance, _Split, str]]
            ) -> fx.GraphModule:
    """Each body call in ``gm`` (a partitioned forward or backward) replaced by its body's
    nodes, which take the calling copy's own node metadata; the graph module to use in place
    of ``gm`` (``compat.as_lazy``)."""
    calls = [n for n in gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)
             if _PLAN in n.meta]
    for c in calls:
        # the copy it was made for (the backward calls come in the reverse order)
        inst, split, _ = plans[c.meta[_PLAN]]
        body = split.fw if c.args[1].endswith("_fw") else split.bw
        env: dict[fx.Node, Any] = {}
        values = _Values()
        for p, a in zip(body.graph.find_nodes(op="placeholder"), c.args[2:]):
            env[p] = a
            values.pair(p.meta.get("val"), a.meta.get("val"))
        out = None
        for b in body.graph.nodes:
            if b.op == "placeholder":
                continue
            if b.op == "output":
                out = b
                break
            j = b.meta.get(_POSITION)
            own = inst.nodes[j] if j is not None else None
            if own is not None and isinstance(b.meta.get("val"), torch.Tensor):
                values.pair(b.meta["val"], own.meta.get("val"))
            with gm.graph.inserting_before(c):
                # named as the copy's own node from the start (a name once taken stays taken)
                new = gm.graph.create_node(
                    b.op, b.target, fx.map_arg(b.args, env.__getitem__),
                    fx.map_arg(b.kwargs, env.__getitem__),
                    own.name if own is not None else b.name, b.type)
            new.meta = dict(b.meta)
            if own is not None:  # the copy's own node: its module stack, value, tags
                new.meta = {**own.meta, "partitioner_tag": b.meta.get(
                    "partitioner_tag", own.meta.get("partitioner_tag"))}
            elif "val" in b.meta:  # a node a rewrite made: a value of this copy's own
                new.meta["val"] = values.copy(b.meta["val"])
            env[b] = new
        results = [env.get(a, a) if isinstance(a, fx.Node) else a for a in out.args[0]]
        for user in list(c.users):
            if user.target is not operator.getitem:
                raise _Refused("a body call read other than by index")
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        attr = c.args[0]
        gm.graph.erase_node(c)
        if not attr.users:
            gm.graph.erase_node(attr)
    for name in {n.args[1] for n in calls}:
        if hasattr(gm, name):
            delattr(gm, name)
    for p in gm.graph.find_nodes(op="placeholder"):  # a saved value, named as its own node
        if _OWN_NAME in p.meta:
            p._rename(p.meta.pop(_OWN_NAME))
            p.target = p.name
    gm.graph.lint()
    # (lazy: every later pass edits the graph before Inductor, which never runs this code)
    return compat.as_lazy(gm)


def partition_by_layer(joint: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int],
                       partition: Callable, rewrite: Callable | None = None
                       ) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """Forward and backward graphs of ``joint`` (a local joint graph, forward-tagged by
    ``compile._tag_forward``), each group of identical layers partitioned once (module
    docstring); None where nothing repeats or the graph is left to the whole-graph partition.
    ``partition(gm, num_fwd_outputs=, static=)`` is the partitioner (``compile._min_cut``);
    ``static``: positions of the placeholders that live all along (parameters). ``rewrite(gm)``,
    if given, rewrites each representative's joint graph and the outer graph in place before
    they are partitioned (Inductor's joint-graph passes, ``compile._joint_rewrites``): the
    copies get the representative's rewritten nodes, so ``joint`` itself is left as it is."""
    if not enabled():
        return None
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    static_nodes = {placeholders[k] for k in static if k < len(placeholders)}
    plans: list[tuple[_Instance, _Split, str]] = []
    # a dead node (a view lowering made and nothing read) is a difference between copies that
    # the partitioner would drop anyway (Gemma's layers on tp=2)
    joint.graph.eliminate_dead_code()
    try:
        for g, group in enumerate(instances(joint).values()):
            rep = group[len(group) // 2]
            try:
                split = _split(rep, static_nodes, partition, rewrite)
            except _Refused as why:
                log.debug("dynamo_dist: layers %s not partitioned once: %s", rep.key[0], why)
                continue
            plans += [(inst, split, f"{_PREFIX}{g}") for inst in group]
        if not plans:
            return None
        _align_the_rest(joint, plans)
        outer = _outer(joint, plans)
        if rewrite is not None:
            _rewrite(outer, rewrite)
        fw, bw = partition(outer, num_fwd_outputs=num_fwd_outputs, static=list(static))
        fw, bw = _expand(fw, plans), _expand(bw, plans)
    except _Refused as why:
        log.info("dynamo_dist: whole-graph partition: %s", why)
        return None
    log.info("dynamo_dist: %d layer copies partitioned as %d representative(s)", len(plans),
             len({name for _, _, name in plans}))
    return fw, bw
