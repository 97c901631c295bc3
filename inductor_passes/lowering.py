"""Lowering: a joint graph in global semantics + its Plan -> a local joint graph for one rank.

We re-run the global graph node by node on local fake tensors under ``make_fx``: each edge whose
placement differs from what the consumer's OpSpec needs becomes a redistribute (local ops +
``_c10d_functional`` collectives, reused when two consumers need the same placement), shape
arguments are rewritten from global to local, and every produced local shape is checked against
the global shape divided by the planned placement -- a mismatch is an error naming the op, never
a silently wrong program. Identical layers are lowered once and copied (``stamp``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from . import layout, stamp
from .stamp import MoveCopies
from .core import compat, roles
from .core.annotation_ops import CONSTRAINT_OP, ENTER_OP, EXIT_OP
from .core.errors import DistCompileError, describe_mesh, user_source
from .core.ledger import CollectiveEntry, CollectiveLedger
from .core.ops import MATMUL_ND
from .core.placements import Placements, fmt, is_placements, is_strided, local_shape, replicate
from .redistribute import AxisGroup, mesh_axes, redistribute
from .sharding.propagate import Plan, replicate_source
from .sharding.rules import GETITEM, OpSpec, local_impl, tensor_args
from .sharding.rules.moments import lower_split, splits_reduced_dim

aten = torch.ops.aten
log = logging.getLogger("dynamo_dist.lowering")
# ops whose argument at this index is the GLOBAL output size
SIZE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
    aten.expand.default: 1, aten.new_zeros.default: 1, aten.new_empty.default: 1,
    aten.new_ones.default: 1, aten.new_full.default: 1,
    aten.full.default: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0,
}
# backward ops name their result's global shape in the schema (upsample_*_backward's
# input_size, select_backward's input_sizes, ...)
_SIZE_ARG_NAMES = ("input_size", "input_sizes", "self_sizes")


def size_arg(op) -> int | None:
    """Index of ``op``'s argument that is its output's GLOBAL shape, or None."""
    if op in SIZE_ARG:
        return SIZE_ARG[op]
    if not isinstance(op, torch._ops.OpOverload) or not op._schema.name.endswith("_backward"):
        return None
    for i, a in enumerate(op._schema.arguments):
        if a.name in _SIZE_ARG_NAMES:
            return i
    return None


# multi-output ops whose argument at this index is the GLOBAL shape of one output:
# convolution_backward's bias_sizes (the bias gradient, split with the output channels)
_OUTPUT_SIZE_ARG = {aten.convolution_backward.default: (3, 2)}


# ops run differently on local shards: views may need a copy (a gathered or re-sliced shard can
# have other strides than the global value had); our structure-keeping ops become plain torch.
_LOCAL_IMPL = {aten.view.default: aten.reshape.default, MATMUL_ND: torch.matmul,
               # needs a unit-stride last dim, which a re-sliced shard may not have
               aten.view_as_complex.default: lambda x: aten.view_as_complex(x.contiguous())}


# ops that cut a dim at GLOBAL offsets: (index of the dim argument, indices of the cut
# arguments); when the input's dim is _StridedShard(d, k) they cut at block boundaries, and
# every local block is 1/n of the global one, so the local op cuts at offset / n
_CUTS = {aten.split.Tensor: (2, (1,)), aten.split_with_sizes.default: (2, (1,)),
         aten.slice.Tensor: (1, (2, 3)), aten.slice_scatter.default: (2, (3, 4))}


def _local_cuts(node: fx.Node, args: list, np, mesh_shape: Sequence[int]) -> list:
    """``args`` of a split/slice/slice_scatter with the cut offsets made local where the cut dim
    of its first input is block-strided (``rules.strided``: the cuts are block-aligned)."""
    dim_i, cut_is = _CUTS[node.target]
    size = _global_shape(node.args[0].meta["val"])
    dim = args[dim_i] if len(args) > dim_i else 0
    dim %= len(size)
    n = next((mesh_shape[a] for a, p in enumerate(np.inputs[0])
              if is_strided(p) and p.dim == dim), None)
    if n is None:
        return args
    args = list(args)

    def local(v):
        if v is None:
            return None
        v = min(v + size[dim] if v < 0 else v, size[dim])
        if v % n:
            raise DistCompileError(f"internal: {node.name} cuts dim {dim} at {v}, which is not a "
                                   f"block boundary of {fmt(np.inputs[0])}", op=node.target,
                                   source=user_source(node))
        return v // n

    for i in cut_is:
        if i < len(args):
            args[i] = [local(v) for v in args[i]] if isinstance(args[i], (list, tuple)) \
                else local(args[i])
    return args


# ops that read their input's memory layout (strides, storage offset), not only its values
_LAYOUT_READERS = {aten.as_strided.default, aten.as_strided_copy.default,
                   aten.as_strided_scatter.default}


def _on_global_layout(target, meta: torch.Tensor, args, kwargs):
    """Run an as_strided-family op on a replicated local value laid out as the GLOBAL value
    was traced (a gathered value has other strides: as_strided on it reads other elements).
    The layout is rebuilt functionally: the values scattered into a fresh flat storage."""
    x = args[0]
    n = meta.untyped_storage().nbytes() // meta.element_size()
    flat = aten.as_strided_scatter(x.new_zeros(n), x, meta.shape, meta.stride(),
                                   meta.storage_offset())
    out = target(flat, *args[1:], **kwargs)
    if target is aten.as_strided_scatter.default:  # its result has the input's layout
        out = out.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    return out


def lower(gm: fx.GraphModule, plan: Plan, mesh, num_fwd_outputs: int,
          coordinate: Sequence[int] | None = None,
          primal_strides: Sequence[Sequence[int]] | None = None
          ) -> tuple[fx.GraphModule, CollectiveLedger]:
    """Return the local joint graph of this rank (placeholders ``primals_*``, ``tangents_*``;
    outputs in the joint's order) and the ledger of the collectives it contains.
    ``coordinate``: lower for the rank at this mesh coordinate instead of this process's.
    ``primal_strides``: the LOCAL strides each primal arrives with (default: the global strides
    for a value passed whole, else dense in the global dim order: ``layout``)."""
    axes = mesh_axes(mesh, coordinate)
    coord = [ax.coordinate for ax in axes]  # local shapes differ by rank where splits are uneven
    mesh_shape = plan.mesh_shape
    ledger = CollectiveLedger()
    bwd = roles.tangent_dependent(gm.graph)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    primals = [n for n in placeholders if roles.is_primal(n)]
    tangents = [n for n in placeholders if roles.is_tangent(n)]

    # a program with symbolic sizes is lowered in the fake mode that made them: they stay
    # symbolic in the local graph (a dim the plan splits at an input is a symbol of its local
    # size there: dynamo_dist.symbolic.LocalSizes)
    vals = [n.meta.get("val") for n in placeholders]
    symbolic = any(isinstance(v, torch.Tensor) and compat.has_symbolic_shape(v) for v in vals)
    sized = compat.foreign_fake_mode(vals) if symbolic else None
    fake_mode = sized or compat.detect_fake_mode(vals)
    if fake_mode is None or fake_mode.shape_env is None:
        fake_mode = compat.FakeTensorMode(allow_non_fake_inputs=True)

    def local_fake(node: fx.Node) -> torch.Tensor:
        """A primal laid out as the runtime passes it (``layout.input_local_strides``); a
        tangent contiguous (the runtime makes it so)."""
        val = node.meta["val"]
        pls = plan.placement(node.name)
        shape = local_shape(_global_shape(val), pls, mesh_shape, coord)
        if node in primals:
            k = primals.index(node)
            stride = layout.input_local_strides(
                tuple(val.shape), val.stride(), pls, mesh_shape, coord,
                primal_strides[k] if primal_strides is not None else None)
        else:
            stride = layout.contiguous_strides(shape)
        with fake_mode:
            return torch.empty_strided(shape, tuple(map(compat.fixed_size, stride)),
                                       dtype=val.dtype,
                                       device=val.device)

    def local_joint(primals_in, tangents_in):
        env: dict[fx.Node, Any] = dict(zip(primals, primals_in))
        env.update(zip(tangents, tangents_in))
        traced = _sizes_from(primals_in)
        cache: dict[tuple[fx.Node, Placements], torch.Tensor] = {}
        placements = {n: plan.placement(n.name) for n in gm.graph.nodes if n.name in plan.nodes}
        stamper = stamp.LayerStamper(
            segs, env, cache, ledger, fake_mode,
            direct=lambda a, req: replicate_source(a, req, placements) is a) if segs else None
        # the outputs' moves (each gradient to its parameter's placement) are alike: each kind
        # is made once and copied (``stamp.MoveCopies``), where layers are copied too
        copies = MoveCopies(fake_mode) if segs else None

        def read(key: tuple) -> bool:
            """Whether the cache holds ``key`` (told to the stamper: a copy must find it alike)."""
            if stamper is not None:
                stamper.read(key, key in cache)
            return key in cache

        def store(key: tuple, make) -> None:
            """Cache ``make()`` (a move) under ``key``; the stamper learns which local nodes
            it made."""
            mark = stamper.mark_move() if stamper is not None else None
            cache[key] = make()
            if stamper is not None:
                stamper.made_move(key, mark)

        def add(entry: CollectiveEntry, value: fx.Node | None, consumer: fx.Node) -> None:
            if stamper is not None:
                stamper.entry(entry, value, consumer)
            else:
                ledger.add(entry)

        def moved(a: fx.Node, req: Placements, consumer: fx.Node, k: int,
                  phase: str | None = None) -> torch.Tensor:
            cur = plan.placement(a.name)
            if cur == req:
                return env[a]
            src = replicate_source(a, req, placements)
            if src is not a:
                # replicate the re-indexed value upstream and re-apply the re-indexing (global
                # arguments are right: a replicated local tensor is the global one)
                if not read((a, req)):
                    def reindexed():
                        x = moved(a.args[0], req, consumer, k, phase)
                        rest, kw = pytree.tree_map_only(fx.Node, env.__getitem__,
                                                        (a.args[1:], a.kwargs))  # sizes
                        return _LOCAL_IMPL.get(a.target, a.target)(x, *rest, **kw)
                    store((a, req), reindexed)
                return cache[(a, req)]
            if not read((a, req)):
                def sent(kind: str, ax: AxisGroup, nbytes: int) -> None:
                    add(CollectiveEntry(
                        kind, ax.name, nbytes, consumer.name,
                        f"input {k} of {consumer.target}: {a.name} {fmt(cur)} -> {fmt(req)}",
                        phase or ("backward" if consumer in bwd else "forward"),
                        user_source(a if consumer.op == "output" else consumer), a.name),
                        a, consumer)

                shape = traced(tuple(a.meta["val"].shape))
                key = MoveCopies.key(env[a], cur, req, shape) \
                    if copies is not None and consumer.op == "output" else None
                got = copies.copy(key, env[a]) if key is not None else None
                if got is not None:  # the same move as an earlier output's: copied
                    cache[(a, req)] = got[0]
                    for kind, ax, nbytes in got[1]:
                        sent(kind, ax, nbytes)
                    return cache[(a, req)]
                made: list[tuple] = []

                def record(kind: str, ax: AxisGroup, t: torch.Tensor) -> None:
                    made.append((kind, ax, _bytes(t)))
                    sent(kind, ax, _bytes(t))

                mark = copies.mark() if key is not None else None
                store((a, req), lambda: redistribute(env[a], cur, req, axes, record, shape))
                if key is not None:
                    copies.made(key, env[a], mark, cache[(a, req)], made)
            return cache[(a, req)]

        def in_op_reduce(node: fx.Node):
            """Redistribute for collectives an OpSpec runs inside its op, recorded as the op's."""
            def reduce(t: torch.Tensor, cur: Placements, req: Placements, shape) -> torch.Tensor:
                def record(kind: str, ax: AxisGroup, x: torch.Tensor) -> None:
                    add(CollectiveEntry(
                        kind, ax.name, _bytes(x), node.name,
                        f"{node.target} over a split dim: partial sums {fmt(cur)} -> {fmt(req)}",
                        "backward" if node in bwd else "forward", user_source(node)),
                        None, node)
                return redistribute(t, cur, req, axes, record, traced(tuple(shape)))
            return reduce

        def lower_node(node: fx.Node) -> None:
            np = plan.nodes[node.name]
            if node.target is GETITEM:
                env[node] = env[node.args[0]][node.args[1]]
                return
            targs = tensor_args(node)
            local_in = {a: moved(a, req, node, k) for k, (a, req) in enumerate(zip(targs, np.inputs))}
            if node.target in (CONSTRAINT_OP, ENTER_OP, EXIT_OP):  # the local tensor is the value
                env[node] = local_in[targs[0]]
                return
            args, kwargs = pytree.tree_map_only(
                fx.Node, lambda a: local_in[a] if a in local_in else env[a], (node.args, node.kwargs))
            idx = size_arg(node.target)
            # a size argument's local sizes are computed on the global sizes rebuilt from this
            # trace's primals (``traced``): arithmetic on a global size the trace never made (a
            # reshape to 8*s0**2) fails in make_fx ("is not tracked with proxy")
            if idx is not None and idx < len(args) and is_placements(np.output):
                args = list(args)
                args[idx] = list(local_shape(traced(_global_shape(node.meta["val"])), np.output,
                                             mesh_shape, coord))
            idx, out_idx = _OUTPUT_SIZE_ARG.get(node.target, (None, None))
            if idx is not None and args[idx] is not None and np.output[out_idx] is not None:
                args = list(args)
                args[idx] = list(local_shape(traced(_global_shape(node.meta["val"][out_idx])),
                                             np.output[out_idx], mesh_shape, coord))
            if node.target in _CUTS:
                args = _local_cuts(node, args, np, mesh_shape)
            target = _LOCAL_IMPL.get(node.target, node.target)
            spec = OpSpec(np.inputs, np.output, np.source)
            if node.target in _LAYOUT_READERS and np.inputs[0] == replicate(len(mesh_shape)):
                out = _on_global_layout(target, targs[0].meta["val"], args, kwargs)
            elif splits_reduced_dim(node, spec):  # a variance over a split dim (batch norm)
                out = lower_split(node, local_in[targs[0]], spec, in_op_reduce(node))
            elif (own := local_impl(node, spec)) is not None:  # a vocabulary-split embedding
                out = own(args, kwargs, mesh_shape, coord)
            else:
                out = target(*args, **kwargs)
            _check_local(node, out, np.output, mesh_shape, mesh, coord, traced)
            env[node] = out

        for node in gm.graph.nodes:
            if node.op == "get_attr":  # a constant: every rank holds all of it (Replicate)
                env[node] = getattr(gm, node.target)
                continue
            if node.op != "call_function":
                continue
            if stamper is not None and stamper.before(node):
                continue  # lowered as a copy of an identical layer's local nodes
            if isinstance(node.meta.get("val"), (torch.SymInt, int)) and \
                    node.name not in plan.nodes:
                # a size (sym_size, size arithmetic) is a GLOBAL number: rebuilt from the
                # primals' unsplit sizes, never read off a local value (a dim such as heads x
                # batch may be split evenly, and its local size is a fraction of it)
                env[node] = traced(node.meta["val"])
                continue
            # the local nodes carry the global node's meta: the user's stack trace, and
            # activation checkpointing's recompute tags, which the partitioner reads
            with fx_traceback.set_current_meta(node):
                lower_node(node)
            if stamper is not None:
                stamper.after(node)

        output = next(iter(gm.graph.find_nodes(op="output")))
        results = []
        reqs = iter(plan.nodes[output.name].inputs)
        for k, o in enumerate(output.args[0]):
            if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), (torch.SymInt, int)):
                results.append(env[o])  # a size the program returns (of an unsplit dim)
            elif isinstance(o, fx.Node):
                phase = "forward" if k < num_fwd_outputs else "backward"
                req = next(reqs)
                out = moved(o, req, output, k, phase)
                if k < num_fwd_outputs and isinstance(out, torch.Tensor) and is_placements(req):
                    out = _laid_out(out, o.meta["val"], req, mesh_shape, coord, traced)
                results.append(out)
            else:
                results.append(o)
        if stamper is not None:
            log.debug("dynamo_dist: lowering copied %d layer segments and %d output moves, "
                      "lowered %d segments node by node", stamper.stamped, copies.copied,
                      stamper.lowered)
            stamps.append((stamper.stamped, stamper.lowered, copies.copied))
        return results

    # identical layers are lowered once and copied (``stamp``); not where sizes are symbolic
    segs = stamp.segments(gm, plan, bwd) if stamp.enabled() and not symbolic else {}
    stamps: list[tuple[int, int, int]] = []
    with compat.disable_local_tensor_mode():
        primal_fakes = [local_fake(n) for n in primals]
        tangent_fakes = [local_fake(n) for n in tangents]
        # Inductor needs its own decompositions applied (redistribute adds zeros_like, ...)
        # the trace's fake mode is the one its sizes live in (Dynamo's own tracing context
        # would otherwise win: dynamo_dist.symbolic.LocalSizes gives them a ShapeEnv of their own)
        in_mode = compat.tracing_in(sized)
        dispatch = compat.python_dispatcher() if sized is not None else \
            contextlib.nullcontext()
        with fx_traceback.preserve_node_meta(), in_mode, dispatch:
            local_gm = compat.make_fx(local_joint,
                                       decomposition_table=compat.select_decomp_table(),
                                       tracing_mode="fake", record_stack_traces=True,
                                       )(primal_fakes, tangent_fakes)
    if segs:
        stamp.check_no_fake_constants(local_gm)
    # flat calling convention (one placeholder per tensor), as the partitioner and Inductor expect
    local_gm.graph._codegen = fx.graph.CodeGen()
    compat.binary_size_arithmetic(local_gm)
    local_gm.recompile()
    if stamps:  # (layer segments copied, segments lowered node by node though they
        # repeat, output moves copied)
        local_gm.meta["dynamo_dist_stamps"] = stamps[0]
    return local_gm, ledger


def _bytes(t: torch.Tensor) -> int:
    """Bytes of a local tensor, at the sizes traced where they are symbolic (a ledger figure:
    comparing a symbolic size would add a guard)."""
    return compat.size_hint(t.numel()) * t.element_size()


def _global_shape(val: torch.Tensor) -> tuple:
    """A global value's shape, sizes a guard has fixed as ints (one may be added while this
    very graph is lowered: arithmetic on a constant SymInt would then have no proxy)."""
    return tuple(map(compat.fixed_size, val.shape))


def _sizes_from(primals: Sequence[torch.Tensor]):
    """A function that rewrites the symbolic sizes in a shape or argument list (read off the
    GLOBAL graph's values) as arithmetic on this trace's primals' sizes. make_fx finds the
    value of a symbolic size by its expression; one first seen on a tangent (a gradient of
    shape [2*s0, ...]) would make a forward view read the tangent, and the forward/backward
    partition fails. Identity on a program without symbolic sizes."""
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    symbols: dict[Any, torch.SymInt] = {}
    for t in primals:
        for d in (t.shape if isinstance(t, torch.Tensor) else ()):
            if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                symbols.setdefault(d.node.expr, d)
    if not symbols:  # sizes a guard fixed are numbers from here on
        return lambda value: pytree.tree_map_only(torch.SymInt, compat.fixed_size, value)

    def rebuild(v):
        v = compat.fixed_size(v)  # a size a guard fixed: the number
        if not isinstance(v, torch.SymInt):
            return v
        expr = v.node.expr
        if not expr.free_symbols <= symbols.keys():
            return v
        return sympy_interp(PythonReferenceAnalysis, symbols, expr)

    return lambda value: pytree.tree_map(rebuild, value)


def _laid_out(out: torch.Tensor, val: torch.Tensor, placements: Placements,
              mesh_shape: Sequence[int], coord: Sequence[int], traced) -> torch.Tensor:
    """A forward output's local value in the layout the runtime declares for it (dense, in the
    dim order of the GLOBAL value the program traced: ``layout.output_strides``); a copy only
    where lowering produced another layout (a gathered value is contiguous). ``traced``:
    rebuilds global sizes on the trace's primals (``_sizes_from``)."""
    want, _ = layout.output_strides(traced(tuple(map(compat.fixed_size, val.shape))),
                                    traced(tuple(map(compat.fixed_size, val.stride()))),
                                    placements, mesh_shape, coord)
    if layout.same_layout(tuple(out.shape), out.stride(), want):
        return out
    return torch.ops.prims.copy_strided.default(out, list(want))


def _check_local(node: fx.Node, out, placements, mesh_shape: Sequence[int], mesh,
                 coord: Sequence[int], traced) -> None:
    """Raise an internal DistCompileError when ``out`` (local) is not the piece at ``coord`` of
    ``node``'s GLOBAL value under ``placements``. ``traced``: rebuilds global sizes on the
    trace's primals (``_sizes_from``), so that the expected shape's arithmetic is traced."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    outs = out if isinstance(out, (tuple, list)) else [out]
    pls = placements if not is_placements(placements) else [placements]
    for v, o, p in zip(vals, outs, pls):
        if not isinstance(v, torch.Tensor) or p is None:
            continue
        want = local_shape(traced(_global_shape(v)), p, mesh_shape, coord)
        if tuple(o.shape) != want:
            raise DistCompileError(
                f"internal: local shape {tuple(o.shape)} of {node.name} does not match global "
                f"{tuple(v.shape)} under {fmt(p)} (expected {want})",
                op=node.target, source=user_source(node), mesh=describe_mesh(mesh),
                fix="report this; as a workaround pin the value with with_sharding_constraint "
                    "to Replicate()")
