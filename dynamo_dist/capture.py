"""Capture: Dynamo FX graph + example inputs -> joint forward+backward ATen graph, global semantics.

Dynamo hands the backend a graph whose tensor inputs are DTensors (global shapes), plain tensors
(global values, identical on every rank) and opaque objects such as DeviceMesh. We bind the
non-tensor inputs as constants, retrace the graph on plain fake tensors of GLOBAL shape, and trace
forward and backward together (``torch.autograd.grad`` inside ``make_fx``), decomposed with
Inductor's table so that the graph we shard is the graph Inductor will compile.

The joint graph follows AOTAutograd's calling convention so its partitioners apply unchanged:
placeholders ``primals_1..n`` then ``tangents_1..m``; outputs ``(*forward_outputs, *input_grads)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DeviceMesh, DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from inductor_passes.core import compat, roles
from inductor_passes.core.annotation_ops import (CONSTRAINT_OP, encode_spec, enter_manual,
                                                 exit_manual, mesh_key)
from inductor_passes.core.errors import DistCompileError, source_of_failure, user_source
from inductor_passes.core.ops import attention_math, matmul_nd, under_autocast, wants_matmul_nd
from inductor_passes.core.placements import is_split, is_uneven, normalize, plannable, replicate
from inductor_passes import stamp
from inductor_passes.sharding.rules import PLANNED_WHOLE
from inductor_passes.sharding.rules.embedding import own_backward_indices

from .annotations import pin_placements, refuse_strided_nesting
from .layer_capture import LayerCapture
from .manual import mark_manual
from .spmd import input_annotation

log = logging.getLogger("dynamo_dist")


class ArgKind(enum.Enum):
    """What a graph input of the Dynamo graph is."""
    DTENSOR = "dtensor"  # a DTensor: its placements are its own
    TENSOR = "tensor"  # a plain tensor: a global value present on every rank
    SIZE = "size"  # a symbolic size Dynamo passes, read off the tensor inputs
    CONSTANT = "constant"  # a mesh, process group or Python value bound into the graph

    @property
    def is_tensor(self) -> bool:
        return self in (ArgKind.DTENSOR, ArgKind.TENSOR)


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """One graph input as the backend received it.

    ``kind``: an ``ArgKind``. ``shape`` is the GLOBAL shape, symbolic where Dynamo traced it
    so.
    """

    index: int
    name: str
    kind: ArgKind
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] | None = None
    stride: tuple[int, ...] | None = None  # GLOBAL strides as the tensor arrived (DTensor: its own)
    local_stride: tuple[int, ...] | None = None  # a DTensor's local tensor's strides, this rank
    parameter: bool = False  # an nn.Parameter: resident for the whole step, free to save
    computed: bool = False  # not a leaf: made by autograd-tracked code before this program

    def origin(self) -> roles.InputOrigin:
        """What the planner knows of this tensor input (a DTensor's gathers cost memory). A
        parameter to it is an ``nn.Parameter`` or a leaf that requires grad (a weight passed
        as an argument); a value computed before the program (a block's incoming
        activations) or a leaf that needs no gradient (data, optimizer state) is not."""
        return roles.InputOrigin(
            roles.InputKind.DTENSOR if self.kind is ArgKind.DTENSOR else roles.InputKind.PLAIN,
            self.name, self.parameter or (self.requires_grad and not self.computed))


@dataclasses.dataclass
class JointProgram:
    """The joint graph and what its placeholders and outputs mean.

    ``primal_inputs[i]`` is the InputInfo behind placeholder ``primals_{i+1}``;
    ``num_fwd_outputs`` outputs come first, then one gradient (or None) per primal;
    ``diff_outputs[j]`` is the forward output index that tangent ``tangents_{j+1}`` belongs to;
    ``local_outputs``: forward outputs the program turned into local tensors (``to_local`` /
    ``full_tensor``), which the runtime returns as plain tensors, not DTensors.
    """

    graph_module: fx.GraphModule
    inputs: list[InputInfo]
    primal_inputs: list[InputInfo]
    num_fwd_outputs: int
    diff_outputs: list[int]
    out_spec: Any
    mesh: DeviceMesh | None
    local_outputs: list[int] = dataclasses.field(default_factory=list)  # returned as plain tensors
    # primal index of each input the program updates in place; its new value is forward output
    # num_fwd_outputs - len(mutated_inputs) + j, written back by the runtime
    mutated_inputs: list[int] = dataclasses.field(default_factory=list)


def classify_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[InputInfo]:
    """Read each example input as metadata; the result is what the plan and runtime key on."""
    names = [n.target for n in gm.graph.find_nodes(op="placeholder")]
    infos = []
    for i, x in enumerate(example_inputs):
        name = str(names[i]) if i < len(names) else f"arg{i}"
        if isinstance(x, DTensor):
            infos.append(InputInfo(i, name, ArgKind.DTENSOR, _sizes(x.shape), x.dtype,
                                   x.requires_grad, compat.real_object(x.device_mesh),
                                   tuple(x.placements),
                                   _sizes(x.stride()), _sizes(x.to_local().stride()),
                                   isinstance(x, torch.nn.Parameter), not x.is_leaf))
        elif isinstance(x, torch.Tensor):
            # a plain tensor is a global value; ``spmd.mark_sharding`` may have given it a
            # placement eagerly (each rank then receives its own piece)
            mesh, pls = input_annotation(x) or (None, None)
            infos.append(InputInfo(i, name, ArgKind.TENSOR, _sizes(x.shape), x.dtype,
                                   x.requires_grad, mesh, pls, _sizes(x.stride()),
                                   parameter=isinstance(x, torch.nn.Parameter)))
        elif isinstance(x, torch.SymInt) and _sizes_of_tensors(x, example_inputs):
            # a symbolic size (dynamic shapes): the program reads it off its tensor inputs
            infos.append(InputInfo(i, name, ArgKind.SIZE))
        elif isinstance(x, (torch.SymInt, torch.SymFloat)):
            # Dynamo made a Python number that changed between calls a graph input
            raise DistCompileError(
                f"graph input {name} is a symbolic number ({x}): Dynamo made it dynamic after "
                f"it changed between calls; the dist backend plans static shapes and values",
                fix="compile with torch.compile(..., backend='dist', dynamic=False), which "
                    "recompiles per value instead")
        else:
            infos.append(InputInfo(i, name, ArgKind.CONSTANT))
    return infos




def _sizes(values) -> tuple:
    """Sizes or strides, those a guard fixed (``symbolic.specialise``) as the numbers."""
    return tuple(map(compat.fixed_size, values))


def _sizes_of_tensors(x: torch.SymInt, example_inputs: Sequence[Any]) -> bool:
    """Every symbol of ``x`` is a size of some tensor input (so a trace on those tensors can
    compute ``x``; a Python number Dynamo made dynamic is not)."""
    sizes = set()
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            for d in t.shape:
                if isinstance(d, torch.SymInt):
                    sizes |= d.node.expr.free_symbols
    return x.node.expr.free_symbols <= sizes


def _traced_size(x: torch.SymInt, tensors: Sequence[torch.Tensor]) -> "torch.SymInt":
    """A size input as arithmetic on the traced tensors' sizes (make_fx has a proxy only for
    what it computes from its inputs): a dim that is that size, else a dim ``c * x`` divided by
    ``c`` -- a DTensor's local size, whose global dim is the mesh axis size times it."""
    expr = x.node.expr
    dims = [d for t in tensors for d in t.shape if isinstance(d, torch.SymInt)]
    for d in dims:
        if d.node.expr == expr:
            return d
    for d in dims:
        c = d.node.expr / expr
        if c.is_Integer and c > 0:
            return d // int(c)
    return x


def symbolic_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """(Dynamo's fake mode, the inputs as Dynamo traced them) when it traced some input size
    as symbolic (``dynamic=True``, ``mark_dynamic`` or its automatic dynamic shapes), else
    (None, ``example_inputs``). Dynamo hands the backend real tensors; its fakes, with the
    symbolic sizes, are the placeholders' example values. Tracing in its mode keeps those sizes
    symbolic, and the guards a trace adds (a size compared with a number) join Dynamo's."""
    fakes = list(example_inputs)
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        seen = node.meta.get("example_value")
        if i < len(fakes) and isinstance(seen, (torch.Tensor, torch.SymInt)):
            fakes[i] = seen
    symbolic = False
    for t in fakes:
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(local, torch.Tensor) and compat.has_symbolic_shape(local):
            if getattr(local, "fake_mode", None) is not None:  # (a LocalTensor holds fakes)
                return local.fake_mode, fakes
            symbolic = True
    mode = compat.detect_fake_mode([t for t in fakes if type(t) is not DTensor]) \
        if symbolic else None
    return (mode, fakes) if mode is not None else (None, example_inputs)


def foreach_decompositions() -> dict:
    """``aten._foreach_<op>[_]`` (the optimizers' multi-tensor kernels) -> the same op on each
    list element: each element is then planned as the pointwise op it is, so a sharded
    parameter, its gradient and its optimizer state are updated where they live (as one
    replicated multi-tensor op, every list was gathered to every rank). Inductor fuses the
    per-element ops again. Out= overloads are left alone (functionalisation rewrites them)."""
    if _FOREACH:
        return _FOREACH
    aten = torch.ops.aten
    for name in dir(aten):
        if not name.startswith("_foreach_"):
            continue
        packet = getattr(aten, name)
        per_element = getattr(aten, name[len("_foreach_"):], None)
        if per_element is None:
            continue
        inplace = name.endswith("_")
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any(a.is_out for a in op._schema.arguments):
                continue
            _FOREACH[op] = _per_element(per_element, inplace)
    return _FOREACH


_FOREACH: dict = {}


def _per_element(op, inplace: bool):
    """A foreach overload as ``op`` (an overload packet) on each list element. Positionals past
    the most ``op`` takes are passed by keyword under ``op``'s own names for them
    (``_foreach_addcmul``'s ``value`` / ``scalars`` -> ``addcmul(..., *, value)``)."""
    schemas = [getattr(op, o)._schema for o in op.overloads()]
    widest = max((s for s in schemas if not any(a.is_out for a in s.arguments)),
                 key=lambda s: sum(not a.kwarg_only for a in s.arguments))
    positional = sum(not a.kwarg_only for a in widest.arguments)
    keywords = [a.name for a in widest.arguments if a.kwarg_only]

    def run(*args, **kwargs):
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))]
        outs = []
        for i in range(len(lists[0])):
            pick = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = {k: v[i] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
            kw.update(zip(keywords, pick[positional:]))
            outs.append(op(*pick[:positional], **kw))
        return None if inplace else outs
    return run


def lift_tensor_attributes(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """Dynamo keeps tensors it treats as static -- an optimizer's parameters and state, read
    from ``param_groups`` and ``state`` -- as graph attributes (``get_attr``), not inputs. When
    any of them is a DTensor, return a copy of ``gm`` (Dynamo reads its own graph's placeholders
    after the backend returns) in which every tensor attribute is a placeholder after the
    others, so capture plans it and an in-place update of it becomes an input mutation the
    runtime writes back; and those tensors in placeholder order, which the caller passes on
    every call (Dynamo guards their identity). Returns (``gm``, []) otherwise."""
    found = [(n, _attribute(gm, n.target)) for n in gm.graph.find_nodes(op="get_attr")]
    if not any(isinstance(v, DTensor) for _, v in found):
        return gm, []
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    gm = fx.GraphModule(gm, graph)
    nodes = [(copies[n], v) for n, v in found if isinstance(v, torch.Tensor)]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    anchor = placeholders[-1] if placeholders else None
    lifted = []
    for node, value in nodes:
        if anchor is None:
            with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                ph = gm.graph.placeholder(node.name)
        else:
            with gm.graph.inserting_after(anchor):
                ph = gm.graph.placeholder(node.name)
        ph.meta.update(node.meta)
        ph.meta.setdefault("example_value", value)
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        anchor = ph
        lifted.append(value)
    gm.recompile()
    return gm, lifted


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def find_mesh(infos: Sequence[InputInfo], example_inputs: Sequence[Any]) -> DeviceMesh | None:
    """The one DeviceMesh of this program; inputs on two different meshes are an error."""
    meshes: dict[int, tuple[DeviceMesh, str]] = {}
    for info, x in zip(infos, example_inputs):
        x = compat.real_object(x)
        mesh = info.mesh if info.kind is not ArgKind.CONSTANT else \
            (x if isinstance(x, DeviceMesh) else None)
        if mesh is not None:
            meshes.setdefault(id(mesh), (mesh, info.name))
    distinct: list[tuple[DeviceMesh, str]] = []
    for mesh, name in meshes.values():
        if not any(m == mesh for m, _ in distinct):
            distinct.append((mesh, name))
    if len(distinct) > 1:
        (m0, n0), (m1, n1) = distinct[:2]
        raise DistCompileError(
            f"inputs live on different device meshes: '{n0}' on {m0} and '{n1}' on {m1}",
            fix="put every DTensor of one compiled program on the same DeviceMesh "
            "(slice a larger mesh by axis name, e.g. mesh['tp'], only outside the compiled region)",
        )
    return distinct[0][0] if distinct else None


def _global_fake(fake_mode, info: InputInfo, x: torch.Tensor, symbolic: bool) -> torch.Tensor:
    """A fake of the input's GLOBAL value, laid out as it arrived (``info.stride``): the program
    is traced as one device would run it (a transposed or channels-last input keeps its layout,
    which decompositions and layout-reading ops see). ``symbolic``: made in Dynamo's own fake
    mode, its symbolic sizes kept."""
    device = x.device  # (a DTensor's: its local tensor's; read with no dispatch, since a
    # simulated rank's local tensor holds fakes of another mode)
    if symbolic:
        with fake_mode:
            t = torch.empty_strided(info.shape, info.stride, dtype=info.dtype, device=device)
    else:
        t = torch.empty_strided(info.shape, info.stride, dtype=info.dtype, device=device)
        t = fake_mode.from_tensor(t, static_shapes=True)
    return t.requires_grad_(info.requires_grad)


def _seeded_grad(outputs, inputs, grad_outputs=None, **kwargs):
    """``torch.autograd.grad`` inside the program (a traced ``loss.backward()``), its implicit
    ones made here under a ``BACKWARD_SEED`` mark: the planner then knows what follows as a
    backward (data parallelism holds gradients as pending sums there, as for a tangent)."""
    if grad_outputs is None:
        single = isinstance(outputs, torch.Tensor)
        with compat.node_annotation({roles.BACKWARD_SEED: True}):
            grad_outputs = [torch.ones_like(t) for t in _tensors(outputs)]
        grad_outputs = grad_outputs[0] if single else grad_outputs
    compat.preserve_backward_module_stacks([t.grad_fn for t in _tensors(outputs)])
    return torch.autograd.grad(outputs, inputs, grad_outputs, **kwargs)


def _check_backward_reaches_every_leaf(node: fx.Node, args, kwargs) -> None:
    """``loss.backward()`` traced into the program (Dynamo's ``trace_autograd_ops``) becomes
    ``autograd.grad(loss, leaves, allow_unused=True)`` over the leaves Dynamo knows as graph
    inputs. A parameter Dynamo read as a constant attribute is missing from that list, and it
    would get no gradient (silently not trained). So every leaf that requires grad and that the
    loss reaches must be listed; raises DistCompileError naming the first one missing."""
    if not kwargs.get("allow_unused") or "backward(" not in (user_source(node) or ""):
        return  # the user's own autograd.grad: its inputs are what they asked for
    outputs, inputs = args[0], args[1]
    listed = {id(t) for t in _tensors(inputs)}
    for leaf in compat.autograd_leaves(_tensors(outputs)):
        if id(leaf) not in listed:
            raise DistCompileError(
                f"backward() traced into the program does not reach a tensor that requires grad "
                f"(global shape {tuple(leaf.shape)}): Dynamo read it as a constant, so it "
                f"would get no gradient", source=user_source(node),
                shapes=[tuple(leaf.shape)],
                fix="reach the parameters through the model in the compiled function (not only "
                    "through the optimizer), or call backward() outside it")


class _GlobalInterpreter(fx.Interpreter):
    """Runs the Dynamo graph on plain global tensors, swapping in structure-keeping ops.

    DTensor calls in the program are read in global semantics: ``redistribute`` pins a
    placement (a sharding constraint), ``full_tensor`` pins Replicate (and at a graph output
    returns a plain tensor: ``local_outputs``). ``to_local`` and ``DTensor.from_local`` open and
    close a manual region (``annotations.enter_manual`` / ``exit_manual``): code on their local
    tensors is local code, run as written on every rank. A global value read by local code
    enters the region as Replicate (its gradient is then the sum of every rank's term).

    ``known``: id of a tensor -> (mesh, placements) for values whose placement the program has
    fixed (DTensor inputs, redistribute / from_local results); only those can be ``to_local``'d.
    """

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh | None,
                 known: dict[int, tuple[Any, tuple]], inputs: dict[int, int],
                 layers: LayerCapture | None = None, recording: bool = False) -> None:
        super().__init__(gm)
        self.layers = layers  # copies repeated layers (``layer_capture``)
        self.recording = recording  # a run before the trace: layers note their inputs
        self.mesh = mesh
        self.known = known
        self.inputs = inputs               # id of an input tensor -> its tensor-input position
        self.local_outputs: set[str] = set()
        self.manual_nodes: set[str] = set()  # Dynamo nodes whose value is a local tensor
        self.manual_inputs: set[int] = set()  # tensor inputs that from_local reads as local
        self._manual: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)
        self._known_alive: list[torch.Tensor] = []
        self._node: fx.Node | None = None

    def _know(self, t: torch.Tensor, mesh, placements) -> None:
        """Record ``t``'s placement, keeping ``t`` alive: the interpreter frees a value after
        its last use, and a later tensor given the same id would read this placement (seen as a
        capture failure on one rank only, at a different layer each run)."""
        self.known[id(t)] = (mesh, placements)
        self._known_alive.append(t)

    def run_node(self, n: fx.Node):
        self._node = n
        if self.layers is not None:
            if self.recording:
                if self.layers.skip(self.env, n, self._manual, self.manual_nodes):
                    return self.env[n]  # a later run of a layer: outputs like its first's
                self.layers.record(self.env, n)
            elif self.layers.stamp(self.env, n, self._manual):
                return self.env[n]  # the whole layer, copied from its group's layer joint
        out = super().run_node(n)
        if self.recording and self.layers is not None:
            self.layers.recorded(self.env, n, out)
        if n.op != "output" and any(id(t) in self._manual for t in _tensors(out)):
            self.manual_nodes.add(n.name)
        if n.op != "output" and torch.is_grad_enabled():
            # the backward of this node's ops is traced with its module stack: lowering and
            # the outlining of repeated layers (``inductor_passes.outline``) read it
            compat.tag_grad_fns(_tensors(out), n.meta.get("nn_module_stack"))
        return out

    def call_function(self, target, args, kwargs):
        if target is torch.autograd.grad:
            _check_backward_reaches_every_leaf(self._node, args, kwargs)
            return _seeded_grad(*args, **kwargs)
        if target is torch.baddbmm:
            args, kwargs = compat.baddbmm_self_expanded(args, kwargs)
        if target is DTensor.from_local:
            return self._from_local(*args, **kwargs)
        if target is getattr and len(args) == 2 and args[1] in _DTENSOR_METADATA and \
                isinstance(args[0], torch.Tensor):
            return self._dtensor_metadata(args[1])
        if target is torch.matmul and not kwargs and wants_matmul_nd(*args):
            return self._local_aware(lambda a, k: matmul_nd(*under_autocast(a, k)[0]),
                                     args, kwargs)
        if target is torch.nn.functional.scaled_dot_product_attention and \
                compat.sdpa_takes_math_path(*args, **kwargs):
            def math(a, k):
                a, k = under_autocast(a, k)
                return attention_math(*a, **k)
            return self._local_aware(math, args, kwargs)
        return self._local_aware(lambda a, k: super(_GlobalInterpreter, self).call_function(
            target, a, k), args, kwargs)

    def call_method(self, target, args, kwargs):
        if target == "baddbmm":
            args, kwargs = compat.baddbmm_self_expanded(args, kwargs)
        if target in ("redistribute", "full_tensor", "to_local") and args and \
                isinstance(args[0], torch.Tensor) and id(args[0]) not in self._manual:
            return self._dtensor_call(target, args, kwargs)
        return self._local_aware(lambda a, k: super(_GlobalInterpreter, self).call_method(
            target, a, k), args, kwargs)

    def _dtensor_metadata(self, attr: str):
        """``x.device_mesh`` / ``x.placements`` that Dynamo kept as a graph node (it does when
        the result flows on, e.g. into ``get_group``): the global value here is a plain tensor,
        so read the attribute off the DTensor Dynamo's example value was, which is what the
        user's Python saw."""
        node = self._node
        seen = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) \
            else None
        if isinstance(seen, DTensor):
            return getattr(seen, attr)
        raise DistCompileError(
            f"{attr} read at {node.name} from a value that is not a DTensor while Dynamo "
            f"traced it", source=user_source(node), mesh=self.mesh,
            fix=f"read {attr} from a DTensor (a parameter or a DTensor input)")

    def _local_aware(self, run, args, kwargs):
        """Run one op; if any tensor argument is local, the global ones enter as Replicate and
        the results are local."""
        if not any(id(t) in self._manual for t in _tensors((args, kwargs))):
            return run(args, kwargs)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t if id(t) in self._manual else
            self._enter(t, tuple(Replicate() for _ in range(self.mesh.ndim))), (args, kwargs))
        out = run(args, kwargs)
        for t in _tensors(out):
            self._manual[id(t)] = t
        return out

    def _enter(self, x: torch.Tensor, placements) -> torch.Tensor:
        refuse_strided_nesting("a manual region (to_local / enable_manual_sharding)",
                               tuple(x.shape), self.mesh, placements, user_source(self._node))
        if is_uneven(tuple(x.shape), placements, tuple(self.mesh.shape)):
            raise DistCompileError(
                f"a manual region (to_local / enable_manual_sharding) at {self._node.name} "
                f"splits a tensor of global shape {tuple(x.shape)} unevenly; local code needs "
                f"the same local shape on every rank", source=user_source(self._node),
                mesh=self.mesh, placements=list(placements),
                fix="pad the tensor to a multiple of the mesh axis size, or keep this code in "
                    "global semantics (no to_local)")
        out = enter_manual(x, encode_spec(self.mesh, placements))
        self._manual[id(out)] = out
        return out

    def _from_local(self, x, device_mesh=None, placements=None, *, run_check=False, shape=None,
                    stride=None):
        node = self._node
        device_mesh = compat.real_object(device_mesh)
        mesh = device_mesh if isinstance(device_mesh, DeviceMesh) else self.mesh
        if mesh is None:
            raise DistCompileError("DTensor.from_local inside the compiled region with no mesh",
                                   source=user_source(node), fix="pass device_mesh=")
        self.mesh = self.mesh or mesh
        pls = normalize(tuple(placements) if placements is not None else
                        tuple(Replicate() for _ in range(mesh.ndim)), x.ndim)
        if id(x) not in self._manual:
            if all(isinstance(p, Replicate) for p in pls):
                self._know(x, mesh, pls)  # a global value is its own replicated local
                return x
            if id(x) not in self.inputs:
                raise DistCompileError(
                    f"DTensor.from_local at {node.name} reads a value computed in global "
                    f"semantics as a local shard ({tuple(x.shape)} as {list(pls)})",
                    source=user_source(node), mesh=mesh, placements=list(pls),
                    fix="call from_local on a graph input or on the result of to_local()")
            self.manual_inputs.add(self.inputs[id(x)])  # a per-rank input: passed as is
            self._manual[id(x)] = x
        if shape is None:
            full = list(x.shape)
            for axis, p in enumerate(pls):
                if is_split(p):
                    full[p.dim] *= mesh.shape[axis]
            shape = full

        refuse_strided_nesting("DTensor.from_local", tuple(shape), mesh, pls, user_source(node))
        out = exit_manual(x, encode_spec(mesh, pls), [int(s) for s in shape])
        self._know(out, mesh, pls)
        return out

    def _dtensor_call(self, target, args, kwargs):
        node, x = self._node, args[0]
        if target == "redistribute":
            mesh = compat.real_object(args[1] if len(args) > 1 else kwargs.get("device_mesh"))
            placements = args[2] if len(args) > 2 else kwargs.get("placements")
            mesh = mesh if isinstance(mesh, DeviceMesh) else (self.known.get(id(x), (None,))[0]
                                                             or self.mesh)
            if placements is None or mesh is None:
                return x
            out = pin_placements(x, mesh, placements)
            self._know(out, mesh, normalize(tuple(placements), x.ndim))
            return out
        if target == "to_local":
            mesh, pls = self.known.get(id(x), (None, None))
            seen = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) \
                else None
            if pls is None and isinstance(seen, DTensor) and self.mesh is not None:
                # The placement Dynamo's example value had, which is what the user's Python saw
                # (branches such as parallelize_module's "redistribute unless already in the
                # output layout" were taken on it): eager DTensor's own choice, or Replicate
                # after an op DTensor has no strategy for
                # (``patches.install_dynamo_tracing_fallback``).
                pls = normalize(tuple(seen.placements), x.ndim)
                log.info("dynamo_dist: %s: to_local() of a value the planner places; read as "
                         "%s (pin it with redistribute for another local shard)",
                         user_source(node) or node.name, list(pls))
            if pls is None:
                raise DistCompileError(
                    f"DTensor.to_local() at {node.name} on a value whose placement the program "
                    f"leaves to the planner (global shape {tuple(x.shape)}): its local shard is "
                    f"not defined", source=user_source(node), mesh=self.mesh,
                    fix="call x.redistribute(mesh, placements) first so the local shard is the "
                        "one those placements name")
            self.mesh = self.mesh or mesh
            return self._enter(x, pls)
        if all(u.op == "output" for u in node.users):
            self.local_outputs.add(node.name)
        if self.mesh is not None:
            out = pin_placements(x, self.mesh, [Replicate()] * self.mesh.ndim)
            self._know(out, self.mesh, tuple(Replicate() for _ in range(self.mesh.ndim)))
            return out
        return x


_DTENSOR_METADATA = ("device_mesh", "placements")


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def trace_joint(gm: fx.GraphModule, example_inputs: Sequence[Any],
                symbolic: bool = True) -> JointProgram:
    """Trace ``gm`` forward+backward on global-shape fake tensors.

    Shapes: every placeholder and node value of the result carries its GLOBAL shape, symbolic
    where Dynamo traced a size as symbolic (``dynamic=True``, ``mark_dynamic``, automatic
    dynamic shapes), in Dynamo's ShapeEnv; with ``symbolic=False`` at the sizes of
    ``example_inputs`` (the caller has guarded them: ``symbolic.specialise``).
    In-place updates are functionalised; an updated input becomes an extra forward output
    (``mutated_inputs``). A ``backward()`` traced into the program (a whole training step) is
    recorded in the same graph, its seed marked ``BACKWARD_SEED``. Raises DistCompileError when
    an input that requires grad is updated in place by a program with a differentiable output,
    when a traced ``backward()`` misses a leaf the loss reaches, or when a value's shape depends
    on tensor data.
    """
    symbolic, example_inputs = symbolic_inputs(gm, example_inputs) if symbolic else \
        (None, [compat.static_size(x) if isinstance(x, torch.SymInt) else x
                for x in example_inputs])
    infos = classify_inputs(gm, example_inputs)
    # Called under no_grad / inference_mode (evaluation, generation, an optimizer step) the
    # program is forward only: no tangents, no gradients, and parameters may be updated in place.
    forward_only = not torch.is_grad_enabled()
    if forward_only:
        infos = [dataclasses.replace(i, requires_grad=False) for i in infos]
    mesh = find_mesh(infos, example_inputs)
    if mesh is not None:
        mesh_key(mesh)  # cached now: read under fake mode it would be data-dependent
    fake_mode = symbolic or compat.FakeTensorMode(allow_non_fake_inputs=True)
    tensor_infos = [i for i in infos if i.kind.is_tensor]
    with fake_mode:
        primals = [_global_fake(fake_mode, i, example_inputs[i.index], symbolic is not None)
                   for i in tensor_infos]

    local_outputs: set[str] = set()
    manual_nodes: set[str] = set()
    manual_inputs: set[int] = set()

    def run_forward(*tensors, recording: bool = False):
        # a size input that a guard fixed (symbolic.specialise) is that number from here on
        args = list(map(compat.fixed_size, example_inputs))
        for info in infos:
            if info.kind is ArgKind.SIZE and compat.static_size(args[info.index]) is None:
                args[info.index] = _traced_size(args[info.index], tensors)
        known, positions = {}, {}
        for k, (info, t) in enumerate(zip(tensor_infos, tensors)):
            args[info.index] = t
            positions[id(t)] = k
            if info.placements is not None:  # a DTensor, or a plain tensor mark_sharding annotated
                known[id(t)] = (info.mesh, info.placements)
        interp = _GlobalInterpreter(gm, mesh, known, positions, layers, recording)
        with torch.fx.traceback.preserve_node_meta():
            out = interp.run(*args)
        local_outputs.update(interp.local_outputs)
        manual_nodes.update(interp.manual_nodes)
        manual_inputs.update(interp.manual_inputs)
        return out

    # out= overloads stay as they are (functionalisation rewrites them); their decompositions
    # call the functional op with out= and fail. Ops whose decomposition merges the dims a plan
    # splits (max pool's backward views [N, C, ...] as [N * C, ...]) are planned whole; lowering
    # decomposes them on local shapes, so Inductor still sees the decomposed form.
    decomp = {op: fn for op, fn in compat.select_decomp_table().items()
              if not (hasattr(op, "_schema") and any(a.is_out for a in op._schema.arguments))
              and op not in PLANNED_WHOLE}
    decomp.update(foreach_decompositions())
    # repeated layers are traced once and copied (a forward-only program is traced as it is)
    layers = LayerCapture(gm) if not forward_only else None

    # Forward once on fakes to learn which outputs are differentiable.
    with fake_mode, torch.set_grad_enabled(not forward_only), \
            _leaf_mutation_explained(tensor_infos):
        outs = run_forward(*primals, recording=True)
    if layers is not None and layers.groups:
        with _leaf_mutation_explained(tensor_infos):
            layers.trace_joints(lambda sub: _GlobalInterpreter(sub, mesh, {}, {}), decomp,
                                manual_nodes)
    flat_outs, out_spec = pytree.tree_flatten(outs)
    diff_outputs = [i for i, o in enumerate(flat_outs)
                    if isinstance(o, torch.Tensor) and o.requires_grad]
    with fake_mode:
        tangents = [torch.empty_like(flat_outs[i], requires_grad=False) for i in diff_outputs]
        primals = [p.detach().requires_grad_(i.requires_grad) for p, i in zip(primals, tensor_infos)]
    grad_targets = [k for k, info in enumerate(tensor_infos) if info.requires_grad]
    if not diff_outputs:
        # no output needs a gradient: the program takes any gradients itself (a whole training
        # step: loss.backward() and opt.step() traced in, Dynamo's trace_autograd_ops), so
        # from outside it is forward only and may update its parameters in place
        infos = [dataclasses.replace(i, requires_grad=False) for i in infos]
        tensor_infos = [i for i in infos if i.kind.is_tensor]

    def joint(primals, tangents):
        # backward nodes take the stack trace of the forward node they differentiate, as in
        # AOTAutograd: anomaly mode records each forward node's trace on its grad_fn, and hooks
        # restore it while the backward is traced (ledger lines and errors name user code)
        with torch.fx.traceback.preserve_node_meta(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")
            with torch.autograd.detect_anomaly(check_nan=False):
                with torch.enable_grad():
                    out = run_forward(*primals)
                flat, _ = pytree.tree_flatten(out)
                diff = [flat[i] for i in diff_outputs]
                grads: list[Any] = [None] * len(primals)
                if diff and grad_targets:
                    compat.preserve_backward_stack_traces([t.grad_fn for t in diff])
                    compat.preserve_backward_module_stacks([t.grad_fn for t in diff])
                    got = torch.autograd.grad(diff, [primals[k] for k in grad_targets],
                                              tangents, allow_unused=True)
                    for k, g in zip(grad_targets, got):
                        grads[k] = g
        return (*flat, *grads)

    with compat.disable_local_tensor_mode(), _leaf_mutation_explained(tensor_infos), \
            compat.checkpoint_cache_may_be_mutated():
        joint_gm = compat.make_fx(
            joint,
            decomposition_table=decomp,
            tracing_mode="fake",
            record_stack_traces=True,
        )(primals, tangents)
        if _mutates(joint_gm):
            joint_gm = _functionalize(joint_gm, primals, tangents)
    if layers is not None and layers.stamped:
        stamp.check_no_fake_constants(joint_gm)  # a copy read untracked (_Emitter.exported)
    if layers is not None and layers.groups:
        # (layer runs copied, runs of a traced group traced op by op): tests and benchmarks
        joint_gm.meta["dynamo_dist_layer_capture"] = (layers.stamped, layers.traced)
        joint_gm.meta["dynamo_dist_layer_runs_skipped"] = layers.skipped  # recording run
        log.info("dynamo_dist: %d layer runs captured as copies of %d traced layer(s)",
                 layers.stamped, len(layers.joints))
    mutated = _lift_input_mutations(joint_gm, len(flat_outs), mesh, tensor_infos)
    names = {roles.primal_name(k): info.name for k, info in enumerate(tensor_infos)}
    _check_functional(joint_gm, names)
    joint_gm.graph.eliminate_dead_code()
    own_backward_indices(joint_gm)
    joint_gm.recompile()
    out_args = pytree.tree_leaves(next(iter(gm.graph.find_nodes(op="output"))).args[0])
    manual_outs = [i for i, a in enumerate(out_args)
                   if isinstance(a, fx.Node) and a.name in manual_nodes]
    local = sorted(set(manual_outs) | {i for i, a in enumerate(out_args)
                                       if isinstance(a, fx.Node) and a.name in local_outputs})
    if manual_nodes or manual_inputs:
        mark_manual(joint_gm, mesh, sorted(manual_inputs), manual_outs, diff_outputs)
    return JointProgram(joint_gm, infos, tensor_infos, len(flat_outs) + len(mutated), diff_outputs,
                        out_spec, mesh, local, mutated)


def planned_input_placements(info: InputInfo,
                             mesh_shape: Sequence[int]) -> tuple[tuple[Placement, ...], list[str]]:
    """The placement the plan gives an input, and why it differs from the input's own: a plain
    tensor is Replicate; a DTensor keeps its placement except on mesh axes the planner cannot
    hold (``placements.plannable``: unsupported types, a _StridedShard that is uneven or nested
    with another split), which become Replicate."""
    if info.placements is None:
        return replicate(len(mesh_shape)), []
    return plannable(info.shape, normalize(info.placements, len(info.shape)), tuple(mesh_shape))


def _lift_input_mutations(gm: fx.GraphModule, num_user_outputs: int, mesh,
                          tensor_infos: Sequence[InputInfo]) -> list[int]:
    """Turn each ``copy_(input, new)`` that functionalisation left at the end of the graph into
    an extra forward output (after the user's), pinned to the input's placement; the runtime
    writes it back into the input (as AOTAutograd does for input mutations). Inputs that
    require grad are left alone (``_check_functional`` rejects them). Returns the primal index
    of each lifted mutation, in output order."""
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    mutated, written = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        dst = node.args[0]
        if not roles.is_primal(dst) or node.users:
            continue
        k = roles.primal_index(dst)
        info = tensor_infos[k]
        if info.requires_grad:
            continue
        value = node.args[1]
        if mesh is not None:
            pls, _ = planned_input_placements(info, tuple(mesh.shape))
            with gm.graph.inserting_before(out_node):
                pinned = gm.graph.call_function(CONSTRAINT_OP, (value, encode_spec(mesh, pls)))
            pinned.meta.update(value.meta)
            value = pinned
        gm.graph.erase_node(node)
        mutated.append(k)
        written.append(value)
    if mutated:
        new_outs = tuple(outs[:num_user_outputs] + written + outs[num_user_outputs:])
        out_node.args = (new_outs,)
        codegen = gm.graph._codegen  # the pytree calling convention must count the new outputs
        if getattr(codegen, "pytree_info", None) is not None:
            codegen.pytree_info = codegen.pytree_info._replace(
                out_spec=pytree.tree_structure(tuple(range(len(new_outs)))))
        gm.recompile()
    return mutated


@contextlib.contextmanager
def _leaf_mutation_explained(tensor_infos: Sequence[InputInfo]):
    """autograd's "leaf Variable ... in-place operation" as a DistCompileError naming inputs;
    a data-dependent op on plain tensors (Dynamo let it through with
    ``capture_dynamic_output_shape_ops``) as one naming the op and its static-shape form (its
    error was the bare op name, "aten.nonzero.default")."""
    try:
        yield
    except compat.DATA_DEPENDENT_ERRORS as exc:
        raise compat.data_dependent_error(getattr(exc, "func", None),
                                          source_of_failure(exc)) from exc
    except RuntimeError as exc:
        if "in-place operation" not in str(exc):
            raise
        grads = [i.name for i in tensor_infos if i.requires_grad]
        raise DistCompileError(
            "the compiled program updates a tensor that requires grad in place (input mutation "
            "is not supported for tensors that require grad; candidates: " +
            ", ".join(grads[:6]) + (" ..." if len(grads) > 6 else "") + ")",
            fix="update parameters outside the compiled region (as an optimizer step does); "
                "buffers that do not require grad may be updated in place") from exc


def _mutates(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable for n in gm.graph.nodes)


def _functionalize(joint_gm: fx.GraphModule, primals, tangents) -> fx.GraphModule:
    """Retrace the joint graph without in-place updates of intermediates (decompositions write
    copy_, scatter_, logical_or_ into buffers they made). A program that updates one of its
    INPUTS keeps a copy_ into that input, which ``_check_functional`` then reports. Views stay
    views (our rules know them; ``*_copy`` ops they would not)."""
    _pair_inplace_by_name(joint_gm)

    def run(primals, tangents):
        # an Interpreter (not the generated code) under preserve_node_meta: each new node
        # takes the stack trace of the node it comes from, so ledger lines and errors keep
        # naming the user's source line rather than the generated forward
        return fx.Interpreter(joint_gm).run(*pytree.tree_leaves((primals, tangents)))

    functional = torch.func.functionalize(run, remove="mutations")

    def joint(primals, tangents):  # argument names give the AOT placeholder names
        return functional(primals, tangents)

    # the joint graph already holds its backward: nothing here needs autograd (and writing an
    # updated input back would trip over a leaf that requires grad)
    primals = [p.detach() for p in primals]
    with torch.fx.traceback.preserve_node_meta():
        return compat.make_fx(joint, tracing_mode="fake", record_stack_traces=True)(
            primals, tangents)


def _pair_inplace_by_name(gm: fx.GraphModule) -> None:
    """Rewrite in place the in-place ops whose functional twin orders its arguments otherwise
    (``polygamma_(self, n)`` vs ``polygamma(n, self)``): torch's functionalisation cannot pair
    them (stock AOTAutograd fails on them too). They become ``copy_(self, twin(...))``, with
    arguments matched by name, which functionalisation handles."""
    changed = False
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        name = op._schema.name.split("::")[-1]
        if not name.endswith("_") or name.endswith("__"):
            continue
        twin = getattr(getattr(torch.ops.aten, name[:-1], None), op._overloadname, None)
        if twin is None:
            continue
        mine = [a.name for a in op._schema.arguments]
        theirs = [a.name for a in twin._schema.arguments]
        if mine == theirs or sorted(mine) != sorted(theirs):
            continue
        named = {**dict(zip(mine, node.args)), **node.kwargs}
        with gm.graph.inserting_before(node):
            value = gm.graph.call_function(twin, (), named)
            write = gm.graph.call_function(torch.ops.aten.copy_.default, (named["self"], value))
        node.replace_all_uses_with(write)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def _check_static(gm: fx.GraphModule) -> None:
    """Plans are made for known shapes; a value whose shape depends on tensor data (nonzero,
    boolean-mask indexing) cannot be planned."""
    for node in gm.graph.nodes:
        vals = node.meta.get("val")
        for v in (vals if isinstance(vals, (tuple, list)) else [vals]):
            if isinstance(v, torch.Tensor) and compat.has_free_unbacked_symbols(v):
                raise DistCompileError(
                    f"{node.target} at {node.name} produces a tensor whose shape depends on "
                    f"tensor values ({tuple(v.shape)}); the dist backend plans static shapes",
                    op=node.target, source=user_source(node),
                    fix="index with integer tensors instead of boolean masks, or compute this "
                        "part outside the compiled region")


def _check_functional(gm: fx.GraphModule, input_names: dict[str, str]) -> None:
    _check_static(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target._schema.is_mutable:
                target = node.args[0] if node.args else None
                what = (f"updates its input {input_names.get(target.name, target.name)} "
                        f"({tuple(target.meta['val'].shape)}, "
                        f"global) in place" if isinstance(target, fx.Node) and
                        target.op == "placeholder" else "updates a tensor in place")
                raise DistCompileError(
                    f"the compiled program {what} with {node.target} (at {node.name}); input "
                    f"mutation is not supported by the dist backend yet",
                    op=node.target, source=user_source(node),
                    fix="return the new value instead of updating the input, or do the update "
                        "outside the compiled region (BatchNorm running statistics: "
                        "track_running_stats=False, or eval mode)",
                )
