"""Capturing each distinct repeated layer once: the other layers' ATen nodes are copies of it.

Capture (``capture.trace_joint``) re-runs the Dynamo graph op by op under ``make_fx``, forward
and ``torch.autograd.grad``: about a millisecond an ATen node, so 9.9 of the 32-layer
demo-width Llama's 67 s compile against 0.9 s at 2 layers. Layers that run the same code on
inputs of the same layouts trace to the same ATen nodes. Here:

- **Segments.** The Dynamo graph's nodes are cut into runs made by one numbered module
  (``core.layers.layer_of``: ``model.layers.3``). Two runs are copies when their nodes call the
  same functions with the same constants and wiring (internal edges by position, external
  inputs in first-use order). A run holding a DTensor call, a graph attribute (a higher-order
  op's body: activation checkpointing) or ``torch.autograd.grad`` is never copied.
- **The layer joint.** For each group of copies, its first run is traced alone on fakes of its
  inputs, forward and backward (``autograd.grad`` of its outputs), as capture traces the whole
  program: the same decompositions, module stacks and stack traces. Its tensor constants (a KV
  cache's ``torch.tensor([])``) are made anew for each copy; in-place writes to values made
  inside the layer (a dropout's ``bernoulli_``, Mixtral's router ``div_``) and random draws are
  copied in order. It is refused (the group is traced op by op, as before) when an op is not
  an ATen op or writes one of the layer's inputs, a size is symbolic, an input is neither a
  tensor nor a constant, an output is a view of an input, or autocast is on where the run
  starts (a layer traced alone takes its activations as leaves, whose casts autocast caches).
- **Stamping.** In the whole-program trace every run of the group is one
  ``torch.autograd.Function``: its forward adds the layer joint's forward nodes to the trace
  with this run's inputs, fresh fake values (aliasing as the layer joint's do) and this run's
  own metadata (module stack, source function names); its backward, called by the autograd
  engine when the run's outputs have their gradients, adds the backward nodes. The program's
  graph holds the same ATen nodes as the op-by-op trace (``tests/test_layer_capture.py``
  compares them), so planning, lowering and partitioning see no difference.

A run whose inputs differ at trace time from the layer joint's (layout, ``requires_grad``, a
local tensor of a manual region, a constant's value) is traced op by op. An output that gets no
gradient gets zeros; an incoming gradient of another layout is made contiguous first (both are
a node more than the op-by-op trace, with the same numbers). ``DYNAMO_DIST_CAPTURE_STAMP=0``
traces every layer op by op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from inductor_passes.core import compat
from inductor_passes.core.layers import layer_of
from inductor_passes.core.switches import switch
from inductor_passes.stamp import FakeCopier, NotStamped, place

log = logging.getLogger("dynamo_dist.layer_capture")

_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
              torch.memory_format)
# call_method targets the capture interpreter gives DTensor meaning (placements, manual regions)
_DTENSOR_METHODS = ("redistribute", "full_tensor", "to_local")
_MIN_NODES = 4  # smaller runs are not worth a layer joint


def enabled() -> bool:
    """``DYNAMO_DIST_CAPTURE_STAMP`` (default on; 0: every layer traced op by op). ValueError
    for another value."""
    return switch("DYNAMO_DIST_CAPTURE_STAMP", "capture each distinct layer once",
                  "trace every layer op by op")


class _Unsupported(Exception):
    """A run or group traced op by op (the reason is the message)."""


@dataclasses.dataclass(eq=False)
class Run:
    """One module's contiguous nodes in the Dynamo graph: its nodes, external inputs (first-use
    order) and the positions of the nodes used outside it."""

    key: tuple[str, int]
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[int]


@dataclasses.dataclass(eq=False)
class LayerJoint:
    """A group's first run traced alone, forward and backward. ``graph``: placeholders (the
    run's tensor inputs, then one gradient per differentiable output), forward nodes, backward
    nodes, output (the run's outputs, then a gradient or None per tensor input). ``split``: the
    first backward node (None: no backward)."""

    graph: fx.Graph
    tensor_inputs: list[int]      # positions among the run's inputs
    constants: dict[int, Any]     # position -> the value every copy must have
    input_layouts: list[tuple]
    differentiable: list[bool]    # per run output
    split: fx.Node | None
    names: dict[str, int]         # the run's node names in the traced graph -> position
    attrs: dict[str, torch.Tensor]  # its tensor constants, by attribute name


def _canon(a: Any, index: dict[fx.Node, int], external: dict[fx.Node, int]) -> Any:
    if isinstance(a, fx.Node):
        if a in index:
            return ("node", index[a])
        return ("input", external.setdefault(a, len(external)))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_canon(x, index, external) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _canon(v, index, external)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", *(_canon(x, index, external) for x in (a.start, a.stop, a.step)))
    if isinstance(a, float):  # repr: -0.0 is not 0.0
        return ("float", repr(a))
    if a is Ellipsis or isinstance(a, _CONSTANTS):
        return (type(a).__name__, a)
    raise _Unsupported(f"an argument of type {type(a).__name__}")


def _signature(nodes: list[fx.Node]) -> tuple[Any, list[fx.Node], list[int]]:
    """(signature, external inputs, output positions) of a run; _Unsupported for a run that
    is never copied."""
    index = {n: k for k, n in enumerate(nodes)}
    external: dict[fx.Node, int] = {}
    body = []
    for n in nodes:
        if n.op == "call_method" and n.target in _DTENSOR_METHODS:
            raise _Unsupported(f"DTensor method {n.target}")
        if n.op == "call_function" and (n.target is getattr or n.target is torch.autograd.grad
                                        or n.target is DTensor.from_local):
            raise _Unsupported(f"{n.target}")
        if n.op not in ("call_function", "call_method"):
            raise _Unsupported(f"a {n.op} node")
        try:
            hash(n.target)
        except TypeError as e:
            raise _Unsupported("an unhashable target") from e
        body.append((n.op, n.target, _canon(n.args, index, external),
                     _canon(n.kwargs, index, external)))
    outputs = [k for k, n in enumerate(nodes) if any(u not in index for u in n.users)]
    return (tuple(body), tuple(outputs)), list(external), outputs


def find_groups(gm: fx.GraphModule) -> list[list[Run]]:
    """Groups of two or more runs of the Dynamo graph ``gm`` that are copies of each other,
    each in graph order."""
    runs: list[tuple[tuple[str, int], list[fx.Node]]] = []
    for node in gm.graph.nodes:
        key = layer_of(node) if node.op in ("call_function", "call_method") else None
        if key is not None and runs and runs[-1][0] == key and runs[-1][1][-1].next is node:
            runs[-1][1].append(node)
        elif key is not None:
            runs.append((key, [node]))
    groups: dict[Any, list[Run]] = {}
    for key, nodes in runs:
        if len(nodes) < _MIN_NODES:
            continue
        try:
            sig, inputs, outputs = _signature(nodes)
        except _Unsupported as why:
            log.debug("dynamo_dist: layer %s.%d captured op by op: %s", *key, why)
            continue
        groups.setdefault((key[0], sig), []).append(Run(key, nodes, inputs, outputs))
    return [g for g in groups.values() if len(g) > 1]


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


# the non-tensor inputs two runs must hold equal for the recording run to skip one
_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "fake_mode", None) is not None and \
        not compat.has_symbolic_shape(t)


def _sub_module(gm: fx.GraphModule, run: Run) -> tuple[fx.GraphModule, dict[str, int]]:
    """The run as a graph of its own: its inputs as placeholders, its nodes (with their
    metadata), its used-outside values as outputs; and each node's name there (the graph may
    rename it) -> its position in the run."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(run.inputs):
        env[x] = graph.placeholder(f"input_{k}")
    for n in run.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[run.nodes[j]] for j in run.outputs))
    return fx.GraphModule(gm, graph), {env[n].name: k for k, n in enumerate(run.nodes)}


def _copyable(node: fx.Node, inputs_held: set[int]) -> bool:
    """``node`` is an ATen op (or a getitem) that writes in place, if at all, only values made
    inside the layer (Mixtral's router normalises its weights with ``div_``, a dropout fills
    its mask with ``bernoulli_``). Copied as it is, the program is functionalised as a whole
    afterwards, as the op-by-op trace is, and random draws run in the same order."""
    op = node.target
    if node.op != "call_function":
        return False
    if op is operator.getitem:
        return True
    if not isinstance(op, torch._ops.OpOverload):
        return False
    for arg, value in zip(op._schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            val = value.meta.get("val") if isinstance(value, fx.Node) else None
            if not isinstance(val, torch.Tensor) or \
                    val.untyped_storage()._cdata in inputs_held:
                return False
    return not any(a.alias_info is not None and a.alias_info.is_write and a.kwarg_only
                   for a in op._schema.arguments)


def trace_layer_joint(gm: fx.GraphModule, run: Run, values: list[Any], interpreter: Callable,
                      decomp: dict) -> LayerJoint:
    """Trace ``run`` alone on ``values`` (its inputs' fakes from a forward run of the program):
    forward, then ``autograd.grad`` of its differentiable outputs. ``interpreter(gm)``: the
    capture interpreter for a graph. _Unsupported where the group must be traced op by op."""
    tensor_inputs = [k for k, v in enumerate(values) if isinstance(v, torch.Tensor)]
    constants = {k: v for k, v in enumerate(values) if not isinstance(v, torch.Tensor)}
    if any(not _plain(values[k]) for k in tensor_inputs):
        raise _Unsupported("an input is not a fake tensor of static shape")
    if any(not isinstance(v, _CONSTANTS) for v in constants.values()):
        raise _Unsupported("an input is neither a tensor nor a constant")
    sub, names = _sub_module(gm, run)

    def args_of(tensors):
        args = dict(constants)
        args.update(zip(tensor_inputs, tensors))
        return [args[k] for k in range(len(values))]

    ins = [values[k].detach().requires_grad_(values[k].requires_grad) for k in tensor_inputs]
    with torch.enable_grad():  # the outputs' layouts and which are differentiable
        outs = interpreter(sub).run(*args_of(ins))
    if not all(_plain(o) for o in outs):
        raise _Unsupported("an output is not one tensor")
    held = {v.untyped_storage()._cdata for v in ins}
    if any(o.untyped_storage()._cdata in held for o in outs):
        raise _Unsupported("an output is a view of an input")
    differentiable = [o.requires_grad for o in outs]
    with outs[0].fake_mode if outs else contextlib.nullcontext():
        tangents = [torch.empty(o.shape, dtype=o.dtype, device=o.device)
                    for o, d in zip(outs, differentiable) if d]
    split: dict[str, fx.Node] = {}

    def joint(ins, tangents):
        with torch.fx.traceback.preserve_node_meta(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")
            with torch.autograd.detect_anomaly(check_nan=False):
                with torch.enable_grad():
                    got = interpreter(sub).run(*args_of(ins))
                split["last"] = next(iter(reversed(compat.proxy_tracer().graph.nodes)))
                diff = [o for o, d in zip(got, differentiable) if d]
                wanted = [x for x in ins if x.requires_grad]
                grads: list[Any] = [None] * len(ins)
                if diff and wanted:
                    compat.preserve_backward_stack_traces([t.grad_fn for t in diff])
                    compat.preserve_backward_module_stacks([t.grad_fn for t in diff])
                    g = iter(torch.autograd.grad(diff, wanted, tangents, allow_unused=True))
                    grads = [next(g) if x.requires_grad else None for x in ins]
        return (*got, *grads)

    with compat.disable_local_tensor_mode(), compat.checkpoint_cache_may_be_mutated():
        traced = compat.make_fx(joint, decomposition_table=decomp, tracing_mode="fake",
                                record_stack_traces=True)(ins, tangents)
    graph = traced.graph
    attrs: dict[str, torch.Tensor] = {}
    inputs_held = {p.meta["val"].untyped_storage()._cdata
                   for p in graph.find_nodes(op="placeholder")
                   if isinstance(p.meta.get("val"), torch.Tensor)}
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":  # a tensor the layer made from data (``torch.tensor([])``)
            value = getattr(traced, n.target)
            if not isinstance(value, torch.Tensor) or _plain(value) or \
                    getattr(value, "fake_mode", None) is not None:
                raise _Unsupported(f"attribute {n.target} is not a constant tensor")
            attrs[n.target] = value
            continue
        if not _copyable(n, inputs_held):
            raise _Unsupported(f"{n.target} (writes an input, or not an ATen op)")
        if any(isinstance(t, torch.Tensor) and compat.has_symbolic_shape(t)
               for t in pytree.tree_leaves(n.meta.get("val"))):
            raise _Unsupported("a symbolic size")
    last = split["last"]
    first_bw = last.next if last.op != "placeholder" else \
        next(n for n in graph.nodes if n.op != "placeholder")
    first_bw = None if first_bw.op == "output" else first_bw
    return LayerJoint(graph, tensor_inputs, constants,
                      [_layout(values[k]) for k in tensor_inputs], differentiable, first_bw,
                      names, attrs)


def _freeze(stack: Any) -> Any:
    return tuple(stack.items()) if isinstance(stack, dict) else None


def _names(functions: Any) -> Any:
    return tuple(name for name, _ in functions) if functions else None


class _Emitter:
    """Adds one run's copy of a layer joint's nodes to the running trace: the forward part when
    the run is called, the backward part when the autograd engine reaches it."""

    def __init__(self, joint: LayerJoint, rep: Run, run: Run, fake_mode) -> None:
        self.joint, self.run, self.fake_mode = joint, run, fake_mode
        self.tracer = compat.proxy_tracer()
        self.stacks = {_freeze(r.meta.get("nn_module_stack")): c.meta.get("nn_module_stack")
                       for r, c in zip(rep.nodes, run.nodes)}
        # what the layer joint's metadata names (source functions, node sources) -> this run's
        self.names = {name: run.nodes[k] for name, k in joint.names.items()}
        # Dynamo's source-function records are its own trace's names: mapped by position
        self.functions = {_names(r.meta.get("source_fn_stack")): c.meta.get("source_fn_stack")
                          for r, c in zip(rep.nodes, run.nodes)}
        self.sources: dict[tuple[str, str], Any] = {}
        self.env: dict[fx.Node, fx.Node] = {}
        self.vals: dict[fx.Node, Any] = {}
        self.fakes: FakeCopier | None = None
        placeholders = list(joint.graph.find_nodes(op="placeholder"))
        self.inputs = placeholders[:len(joint.tensor_inputs)]
        self.tangents = placeholders[len(joint.tensor_inputs):]
        self.output = next(iter(joint.graph.find_nodes(op="output")))
        # the values handed back to the program (outputs, gradients): the only copies make_fx
        # must track; the rest are read by other copies, through ``env`` (``stamp.place``)
        self.exported = {a for a in self.output.args[0] if isinstance(a, fx.Node)}

    def _bind(self, pairs: list[tuple[fx.Node, torch.Tensor]]) -> None:
        for ph, t in pairs:
            node = compat.proxy_node(t, self.tracer)
            if node is None:
                raise NotStamped("a value the trace does not track")
            self.env[ph], self.vals[ph] = node, t
        if self.fakes is None:
            self.fakes = FakeCopier(self.fake_mode, [])
        for ph, t in pairs:
            self.fakes.pair(ph.meta["val"], t)

    def _meta(self, meta: dict) -> dict:
        out = {k: v for k, v in meta.items() if k not in ("val", "tensor_meta", "eager_input_vals")}
        key = _freeze(meta.get("nn_module_stack"))
        if key in self.stacks:
            out["nn_module_stack"] = self.stacks[key]
        functions = _names(meta.get("source_fn_stack"))
        if functions in self.functions:
            out["source_fn_stack"] = self.functions[functions]
        if meta.get("from_node"):
            out["from_node"] = [self._source(s) for s in meta["from_node"]]
        return out

    def _source(self, source: Any) -> Any:
        node = self.names.get(getattr(source, "name", None))
        if node is None:
            return source
        key = (node.name, source.pass_name)
        if key not in self.sources:
            self.sources[key] = torch.fx.traceback.NodeSource(node, source.pass_name,
                                                               list(source.action))
        return self.sources[key]

    def _emit(self, start: fx.Node | None, stop: fx.Node | None) -> None:
        graph = self.tracer.graph
        nodes = []
        n = start
        while n is not None and n is not stop and n.op != "output":
            nodes.append(n)
            n = n.next
        copies = {}  # the fresh values first, in order, in one batch (``FakeCopier.batch``)
        with self.fakes.batch():
            for n in nodes:
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor) or n.op != "get_attr" and \
                        isinstance(val, (tuple, list)) and \
                        any(isinstance(v, torch.Tensor) for v in val):
                    copies[n] = self.fakes.copy(val)
        for n in nodes:
            if n.op == "get_attr":  # each run makes its constant anew, as the layer's code does
                new = self._constant(self.joint.attrs[n.target])
                new.meta.update(self._meta(n.meta))
                val = copies.get(n, n.meta.get("val"))
                if isinstance(val, torch.Tensor):
                    new.meta["val"] = val
                    if "tensor_meta" in n.meta:
                        new.meta["tensor_meta"] = n.meta["tensor_meta"]
                self.env[n], self.vals[n] = new, val
                continue
            args, kwargs = fx.map_arg((n.args, n.kwargs), self.env.__getitem__)
            # named as make_fx names an op's node (by its overload packet)
            packet = getattr(n.target, "overloadpacket", None)
            name = graph._target_to_str(packet.__name__) if packet is not None else None
            meta = self._meta(n.meta)
            if "eager_input_vals" in n.meta:  # a custom op's inputs as it saw them: this run's
                meta["eager_input_vals"] = fx.map_arg(
                    (tuple(args), dict(kwargs)), lambda a: a.meta.get("val"))
            val = copies.get(n, n.meta.get("val"))
            new = place(self.tracer, n, args, kwargs, val, meta, name,
                        track=n in self.exported)
            self.env[n], self.vals[n] = new, val

    def _constant(self, value: torch.Tensor) -> fx.Node:
        """A ``get_attr`` of a copy of ``value``, registered as make_fx registers a tensor
        constant it meets (``Tracer.create_arg``)."""
        with compat.no_dispatch_modes():  # a real tensor, as the layer's code made it
            value = value.clone()
        qualname = self.tracer.get_fresh_qualname("_tensor_constant")
        self.tracer.tensor_attrs[value] = qualname
        setattr(self.tracer.root, qualname, value)
        return self.tracer.graph.create_node("get_attr", qualname, (), {})

    def forward(self, tensors: tuple) -> tuple:
        with compat.untraced():
            self._bind(list(zip(self.inputs, tensors)))
            first = next(iter(self.joint.graph.nodes))
            while first.op == "placeholder":
                first = first.next
            self._emit(first, self.joint.split)
        outs = self.output.args[0][:len(self.joint.differentiable)]
        return tuple(self.vals[a] for a in outs)

    def backward(self, grads: tuple) -> tuple:
        tangents = []
        for g, ph in zip([g for g, d in zip(grads, self.joint.differentiable) if d],
                         self.tangents):
            want = ph.meta["val"]
            if g is None:  # an output nothing read: its gradient is zero
                g = torch.zeros(want.shape, dtype=want.dtype, device=want.device)
            elif (g.stride(), g.storage_offset()) != (want.stride(), want.storage_offset()):
                g = g.contiguous()
            tangents.append(g)
        with compat.untraced():
            self._bind(list(zip(self.tangents, tangents)))
            self._emit(self.joint.split, None)
        grads_out = self.output.args[0][len(self.joint.differentiable):]
        return tuple(self.vals[a] if isinstance(a, fx.Node) else None for a in grads_out)


class _Stamp(torch.autograd.Function):
    """One run of a layer, its nodes copied from its group's layer joint (``_Emitter``)."""

    @staticmethod
    def forward(ctx, emitter: _Emitter, *tensors):
        outs = emitter.forward(tensors)
        ctx.emitter = emitter
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, emitter.joint.differentiable)
                                      if not d])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.emitter.backward(grads))


def _settle(env: dict, run: Run, outs: Any) -> None:
    """The interpreter's environment after ``run``: its outputs' values, None for its other
    nodes (the interpreter skips the nodes it already holds)."""
    for n in run.nodes:
        env[n] = None
    for j, out in zip(run.outputs, outs):
        env[run.nodes[j]] = out


class LayerCapture:
    """Drives copying from the capture interpreter: ``record`` during the forward run that
    precedes the trace (the first run of each group notes its input values), ``trace_joints``
    after it, ``stamp`` during the whole-program trace."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.groups = find_groups(gm) if enabled() else []
        self.first: dict[fx.Node, tuple[int, Run]] = {
            run.nodes[0]: (g, run) for g, group in enumerate(self.groups) for run in group}
        self.values: dict[int, list] = {}
        self.joints: dict[int, LayerJoint] = {}
        self.stamped = self.traced = 0
        # the recording run: each group's first run's output values, for its later runs
        self.last: dict[fx.Node, tuple[int, Run]] = {
            group[0].nodes[-1]: (g, group[0]) for g, group in enumerate(self.groups)}
        self.first_outs: dict[int, list] = {}
        self.skipped = 0
        # a backward traced into the program must reach every layer's parameters in the
        # recording run (``capture._check_backward_reaches_every_leaf``): nothing is skipped
        self.may_skip = not any(
            n.target in (torch.autograd.grad, torch.autograd.backward) or
            n.op == "call_method" and n.target == "backward" for n in gm.graph.nodes)

    def recorded(self, env: dict, node: fx.Node, value: Any) -> None:
        """``node`` ran in the recording run, giving ``value``: the last node of a group's first
        run notes the run's output values (``skip``)."""
        hit = self.last.get(node)
        if hit is None or self.values.get(hit[0]) is None:
            return
        g, run = hit
        self.first_outs[g] = [value if run.nodes[j] is node else env[run.nodes[j]]
                              for j in run.outputs]

    def skip(self, env: dict, node: fx.Node, manual: set[int], manual_nodes: set[str]) -> bool:
        """In the recording run (which learns which outputs are differentiable and notes each
        group's first inputs), a later run of a group is not run op by op: its outputs are
        fresh fakes laid out, aliased and requiring grad as its first run's were, given the
        same input layouts, constants and gradient needs. False (run it) otherwise: about 1 s
        of op-by-op fake execution at 32 layers of the demo-width Llama."""
        hit = self.first.get(node)
        if hit is None or not self.may_skip:
            return False
        g, run = hit
        first = self.groups[g][0]
        if run is first or g not in self.first_outs or \
                any(n.name in manual_nodes for n in first.nodes):
            return False
        theirs, mine = self.values[g], [env[x] for x in run.inputs]
        pairs = []
        for a, b in zip(theirs, mine):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (_plain(a) and _plain(b)) or id(b) in manual or \
                        _layout(a) != _layout(b):
                    return False
                pairs.append((a, b))
            elif type(a) is not type(b) or type(a) not in _CONSTANT_TYPES or a != b:
                return False
        outs = self.first_outs[g]
        if not pairs or not all(_plain(t) for o in outs
                                for t in (o if isinstance(o, (tuple, list)) else (o,))):
            return False
        fakes = FakeCopier(pairs[0][1].fake_mode, pairs)
        try:
            copies = [fakes.copy(o) for o in outs]
        except NotStamped:
            return False
        for o, c in zip(outs, copies):
            for t, u in zip(o if isinstance(o, (tuple, list)) else (o,),
                            c if isinstance(c, (tuple, list)) else (c,)):
                if t.requires_grad and not u.requires_grad:
                    u.requires_grad_(True)
        _settle(env, run, copies)
        self.skipped += 1
        return True

    def record(self, env: dict, node: fx.Node) -> None:
        hit = self.first.get(node)
        if hit is not None and hit[0] not in self.values:
            g, run = hit
            # under autocast, a layer traced alone takes its activations as leaves, whose
            # casts autocast caches (once, and across traces), unlike the op-by-op trace's:
            # other casts, other numbers (HF Llama under bf16 on dp=2). Traced op by op.
            self.values[g] = None if compat.autocast_state() else \
                [env[x] for x in run.inputs]

    def trace_joints(self, interpreter: Callable, decomp: dict, manual: set[str]) -> None:
        """Trace each group's layer joint from the values ``record`` noted. ``manual``: the
        Dynamo nodes whose values were a manual region's local tensors in that run (a group
        with one is traced op by op: the interpreter must see its values made)."""
        for g, values in self.values.items():
            if values is None:
                log.debug("dynamo_dist: layers %s captured op by op: autocast is on",
                          self.groups[g][0].key[0])
                continue
            if any(n.name in manual for run in self.groups[g] for n in run.nodes):
                log.debug("dynamo_dist: layers %s captured op by op: local (manual) values",
                          self.groups[g][0].key[0])
                continue
            try:
                self.joints[g] = trace_layer_joint(self.gm, self.groups[g][0], values,
                                                   interpreter, decomp)
            except (_Unsupported, NotStamped) as why:
                log.debug("dynamo_dist: layers %s captured op by op: %s",
                          self.groups[g][0].key[0], why)
        self.values.clear()

    def stamp(self, env: dict, node: fx.Node, manual: set[int]) -> bool:
        """Copy the run that starts at ``node`` into the trace, its values into ``env``; False
        (nothing added) where it must be traced op by op."""
        hit = self.first.get(node)
        if hit is None or hit[0] not in self.joints:
            return False
        g, run = hit
        joint = self.joints[g]
        if compat.autocast_state():  # see ``record``
            self.traced += 1
            return False
        values = [env[x] for x in run.inputs]
        for k, want in joint.constants.items():
            if isinstance(values[k], torch.Tensor) or type(values[k]) is not type(want) or \
                    values[k] != want:
                self.traced += 1
                return False
        tensors = [values[k] for k in joint.tensor_inputs]
        if any(not _plain(t) or id(t) in manual for t in tensors) or \
                [_layout(t) for t in tensors] != joint.input_layouts:
            self.traced += 1
            return False
        emitter = _Emitter(joint, self.groups[g][0], run, tensors[0].fake_mode)
        outs = _Stamp.apply(emitter, *tensors)
        _settle(env, run, outs)
        self.stamped += 1
        return True
