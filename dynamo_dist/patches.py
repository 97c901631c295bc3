"""Patches to Dynamo and DTensor that let ``backend="dist"`` trace distributed programs.

Each acts only while Dynamo traces a frame for ``dist`` (``compat.dist_backend_is_tracing``)
unless its docstring says otherwise, and each is idempotent. ``install()`` applies them all;
the backend calls it when it is imported (``torch.compile(backend="dist")`` imports it), so
importing the graph passes or the user API alone patches nothing. Private torch names they
need come from the gate, ``inductor_passes.core.compat``; the Dynamo and DTensor internals they
replace are named in each docstring, with the torch versions checked (2.11, 2.13).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import Placement

from inductor_passes import cpu_probe
from inductor_passes.core import compat
from inductor_passes.core.compat import (STATIC_FIX, DTensorSpec, OpSchema, OutputSharding,
                                         StridedShard, TensorMeta, TracingContext, data_dependent,
                                         dist_backend_is_tracing, has_symbolic_shape, log,
                                         sharding_propagator)
from inductor_passes.core.errors import DistCompileError
from inductor_passes.layout import contiguous_strides

from . import gc_pause, regions
from .mesh import Mesh


def install() -> None:
    """Apply every patch of this module (idempotent). Metadata folding and the process-group
    guard also serve other backends (see their docstrings), and eager DTensor convolutions
    with split weights run (``eager_conv``: DTensor's own handler fails on them); the rest act
    for ``dist`` only."""
    if torch.distributed.is_available():
        from . import eager_conv

        eager_conv.install()
        install_dead_mesh_lookup_removal()
        install_process_group_guard()
        install_sharding_cache_clear_on_destroy()
        install_metadata_attr_folding()
    install_backend_ctx_with_options()
    install_frame_compile_gc_pause()
    install_cpu_probe_at_frame_compile()
    regions.install_layer_regions()
    install_whole_step()
    install_symbolic_plain_tensor_wrapping()
    install_dynamo_tracing_fallback()
    install_strided_redistribute_fallback()
    install_plain_random_while_tracing()
    install_requires_grad_setattr()


def _paused_for_dist(original, compiler_fn, args, kwargs):
    if not compat.is_dist_compiler(compiler_fn):
        return original(*args, **kwargs)
    with gc_pause.full_collections_paused():
        return original(*args, **kwargs)


def install_frame_compile_gc_pause() -> bool:
    """While Dynamo compiles a frame for ``dist`` (its trace, our backend, its guards), Python's
    full garbage collections are paused (``gc_pause``): at 32 layers those in Dynamo's part
    took about 0.8 s beyond the backend's own. Other backends' compiles, and every call of a
    compiled function, keep Python's schedule. Returns whether it is installed."""
    return compat.wrap_frame_compile(_paused_for_dist)


def _probe_for_dist(original, compiler_fn, args, kwargs):
    if compat.is_dist_compiler(compiler_fn) and will_compile_cpu_kernels(
            compat.compile_options(compiler_fn)):
        cpu_probe.start()
    return original(*args, **kwargs)


def will_compile_cpu_kernels(options: dict, devices: set[str] | None = None) -> bool:
    """Whether a ``dist`` compile with these backend ``options`` will have Inductor generate
    C++ kernels: Inductor on (``inductor``, not ``simulate``) and the program on the CPU
    (``devices``: its inputs' device types; before Dynamo has made them, a machine with no
    CUDA device)."""
    if not options.get("inductor", True) or options.get("simulate", False):
        return False
    if devices is None:
        return not torch.cuda.is_available()
    return devices == {"cpu"}


def install_cpu_probe_at_frame_compile() -> bool:
    """When Dynamo starts compiling a frame for ``dist`` on a CPU-only machine, Inductor's probe
    of the CPU's vector instructions starts on a thread (``inductor_passes.cpu_probe``), so its
    g++ builds (about 8 s on an empty cache) run while Dynamo and our stages run. Returns
    whether it is installed."""
    return compat.wrap_frame_compile(_probe_for_dist)


def install_plain_random_while_tracing() -> bool:
    """While Dynamo traces for ``dist``, DTensor's random ops (dropout's bernoulli, rand, ...)
    run on their fake local tensors as plain ops, past DTensor's RNG tracker.

    On a CUDA mesh DTensor creates an ``OffsetBasedRNGTracker`` at the first random op and
    runs the op in its ``_distribute_region``, which reads and writes the GPU's real generator
    state. Under Dynamo's fake tensors torch 2.11 then failed ("Please convert all Tensors to
    FakeTensors first", on ``aten.to`` of the 16-byte Philox state): every model with dropout
    (GPT-2, OPT, BERT, T5) crashed on a GPU; a generator passed by the user takes that path on
    2.13 too. Dynamo only needs the op's global shape and dtype here, and the ``dist`` backend
    draws random values by its own rule (Replicate: every rank draws the global tensor; design
    notes, "Random numbers"), so the tracker has nothing to do while tracing. Eager DTensor and
    other backends keep it: the dispatch's ``is_rng_supported_mesh`` answers False (no tracker
    is made while tracing) and a tracker made eagerly reads as disabled, for ``dist`` tracing
    only. Returns whether it is installed (False where DTensor lacks those names)."""
    modules = compat.dtensor_rng_modules()
    if modules is None:
        return False
    dispatch, random = modules
    tracker = random._RNGStateTracker
    enabled = tracker.distribute_region_enabled
    if getattr(enabled.fget, "_dynamo_dist_original", None) is not None:
        return True
    supported = dispatch.is_rng_supported_mesh

    def is_rng_supported_mesh(mesh) -> bool:
        return False if compat.dist_tracing() else supported(mesh)

    def region_enabled(self) -> bool:
        return False if compat.dist_tracing() else enabled.fget(self)

    dispatch.is_rng_supported_mesh = is_rng_supported_mesh
    patched = property(region_enabled, enabled.fset, enabled.fdel, enabled.__doc__)
    patched.fget._dynamo_dist_original = enabled
    tracker.distribute_region_enabled = patched
    return True


def install_requires_grad_setattr() -> bool:
    """While Dynamo traces for ``dist``: ``t.requires_grad = flag`` on a tensor the traced code
    made (no source: not an input, parameter or global) is traced as ``t.requires_grad_(flag)``,
    which Dynamo supports on such tensors; the setattr form is a graph break in torch 2.13
    (``SetAttrBuiltinVariable._call_setattr``: "setattr() on Tensor.requires_grad"), although
    both do the same thing in eager code.

    Why it matters: transformers' T5 runs ``position_bias.requires_grad = True`` on a fresh
    ``torch.zeros`` inside each checkpointed layer under ``gradient_checkpointing_enable()``.
    The break made Dynamo run every checkpointed layer uncompiled, on DTensors, where a
    row-parallel output stays ``Partial`` and dropout's in-place ``bernoulli_`` on it raised
    (tp), or compiled the layers' inner frames one by one. Dynamo's ``requires_grad_`` path
    keeps its own guard: should the tensor leak out of the graph, it graph-breaks there.
    A tensor with a source keeps Dynamo's own handling (a graph break). Returns whether it is
    installed (False where Dynamo lacks the hook: ``compat.dynamo_setattr_variable``)."""
    found = compat.dynamo_setattr_variable()
    if found is None:
        return False
    cls, tensor_variable = found
    original = cls._call_setattr
    if getattr(original, "_dynamo_dist", False):
        return True

    def _call_setattr(self, tx, obj, name_var, val):
        if (isinstance(obj, tensor_variable) and obj.source is None
                and name_var.is_python_constant()
                and name_var.as_python_constant() == "requires_grad"
                and val.is_python_constant() and dist_backend_is_tracing()):
            obj.call_method(tx, "requires_grad_", [val], {})
            return val
        return original(self, tx, obj, name_var, val)

    _call_setattr._dynamo_dist = True
    cls._call_setattr = _call_setattr
    return True


def install_strided_redistribute_fallback() -> bool:
    """torch before 2.13 only, and in eager code too: a redistribute from or to a
    ``_StridedShard`` whose split factor is no product of mesh sizes (the blocks of a fused
    projection: GPT-2's q|k|v in 3, Mixtral's gate|up in 2) raised ValueError ("unable to be
    interpreted into a corresponding shard_order"): torch 2.11 reads every _StridedShard as
    FSDP's shard-order encoding when it plans a redistribute
    (``DTensorRedistributePlanner.generate_graph_based_transform_infos``). torch 2.13 catches
    that case and plans the redistribute greedily, as a strided split
    (``_gen_transform_infos_non_cached``); this does the same on 2.11. Without it 2.11 failed
    GPT-2 and Mixtral on dp x tp while Dynamo traced them (every input replicated by the
    tracing fallback above) and in ``full_tensor()`` of their parameters. Returns whether it
    is installed."""
    planner = compat.redistribute_planner_class()
    if planner is None or torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        return False
    original = planner.generate_graph_based_transform_infos
    if getattr(original, "_dynamo_dist", False):
        return True

    def graph_based(self, src_spec, dst_spec, full_tensor_shape):
        try:
            return original(self, src_spec, dst_spec, full_tensor_shape)
        except ValueError as exc:
            if "shard_order" not in str(exc):
                raise
            return self.generate_greedy_transform_infos(src_spec, dst_spec)

    graph_based._dynamo_dist = True
    planner.generate_graph_based_transform_infos = graph_based
    return True


def install_dynamo_tracing_fallback() -> None:
    """Make DTensor's sharding propagation total while Dynamo traces for ``dist``.

    Dynamo builds example values of a program with DTensor inputs by running DTensor's own
    dispatch on fake tensors, and user Python reads them (``.placements``, ``to_local()``,
    torchtitan's asserts, ``local_map(..., x.placements)``). So an op DTensor has a strategy
    for is propagated as DTensor does eagerly, and the program sees the placements it would
    see without compiling. Where DTensor cannot run the op -- no strategy of its own (SDPA on
    CPU: its search through the decomposition took ~50 s per call), a strategy that raises, or
    one that fails later in dispatch (``_redistribution_applies``) -- the op is read with every
    input replicated, which only needs global shapes and dtypes: the ``dist`` backend re-plans
    the whole program in global semantics and never uses these placements. Other backends and
    eager DTensor are unchanged. Idempotent.
    """
    from torch.distributed.tensor.placement_types import Replicate

    prop = sharding_propagator()
    if getattr(prop, "_dynamo_dist_fallback", False):
        return
    original = prop.propagate_op_sharding_non_cached

    def replicated(spec):
        if isinstance(spec, DTensorSpec):
            meta = spec.tensor_meta
            if meta is not None and not all(p.is_replicate() for p in spec.placements):
                # gathered, the local tensor is contiguous whatever the global strides were;
                # the op's output metadata must come from the layout it really runs on
                meta = TensorMeta(meta.shape, contiguous_strides(meta.shape), meta.dtype)
            return DTensorSpec(spec.mesh, tuple(Replicate() for _ in spec.placements),
                               tensor_meta=meta)
        if isinstance(spec, (list, tuple)):
            return type(spec)(replicated(s) for s in spec)
        return spec

    def propagate(op_schema):
        if not compat.dist_tracing():
            return original(op_schema)
        # DTensor's rules test sizes (a view's divisibility by the mesh axis); on symbolic
        # sizes each test would become a Dynamo guard, and an odd batch would recompile, for
        # placements the dist backend does not use (it plans the program itself)
        with _guards_suppressed():
            return _propagate_for_dist(op_schema)

    def _propagate_for_dist(op_schema):
        if op_schema.is_inplace_op() or op_schema.is_out_variant_op():
            # the written tensor keeps its own placement (its local fake can't change shape)
            try:
                own = original(op_schema)
                if op_schema.is_inplace_op() and _moves_self(own, op_schema):
                    # it cannot run in place (torch 2.11 refused T5's ``ids[..., 0] = start``
                    # over a batch split on dp at dispatch): read on replicated fakes, as below
                    return _inplace_keeping_placements(
                        prop, op_schema, replicated,
                        RuntimeError(f"{op_schema.op} would move its input"))
                return own
            except NotImplementedError as exc:
                if _all_replicated(op_schema):  # all replicated: metadata from fakes
                    return OutputSharding(_replicated_output_specs(prop, op_schema))
                if not op_schema.is_inplace_op():
                    raise _untraceable(op_schema, exc) from exc
                return _inplace_keeping_placements(prop, op_schema, replicated, exc)
            except Exception as exc:  # e.g. a nonlinear update of a Partial value
                if not op_schema.is_inplace_op():
                    raise _untraceable(op_schema, exc) from exc
                return _inplace_keeping_placements(prop, op_schema, replicated, exc)
        if data_dependent(op_schema.op, op_schema.args_schema, op_schema.kwargs_schema):
            raise _data_dependent_error(op_schema)
        own = _eager_choice(prop, original, op_schema)
        if own is not None:
            return own
        rep = _replicated_schema(op_schema, replicated)
        state["substituted"] = True
        try:
            result = original(rep)
        except Exception:
            # No DTensor strategy (aten._scaled_dot_product_flash_attention_for_cpu), or one
            # that fails on these arguments (aten._chunk_cat's tensor list): Dynamo only needs
            # global metadata, which the op on replicated fakes gives. A real error in the
            # user's program (mismatched shapes) fails there too, and is reported as such.
            try:
                result = OutputSharding(_replicated_output_specs(prop, rep))
            except Exception as meta_exc:
                raise _fails_on_one_device(op_schema, meta_exc) from meta_exc
        # (specs inside tensor lists too: OpSchema.args_spec skips them for ops DTensor has no
        # schema info for, such as aten._chunk_cat)
        if _flat_specs(rep) != _flat_specs(op_schema) or result.redistribute_schema is not None:
            result.redistribute_schema = result.redistribute_schema or rep
            result.needs_redistribute = True
        return result

    from torch._dynamo.callback import callback_handler

    # Eager DTensor calls between two compiled graphs (``.item()`` after a graph break) run
    # while Dynamo's frame hook is active, and it would try to compile this frame.
    prop.propagate_op_sharding_non_cached = torch.compiler.disable(propagate)
    prop._dynamo_dist_fallback = True
    _argminmax_negative_dim_fix()
    _strided_gather_while_tracing()
    # DTensor runs some ops through handlers of its own (convolution, as_strided, argmax...)
    # that bypass propagation: while tracing for dist they run on replicated values too.
    handlers = compat.dtensor_custom_op_handlers()
    for op, handler in list(handlers.items()):
        handlers[op] = _replicating_handler(handler)
    state = {"substituted": False}

    # DTensor's C++ dispatch caches what this returned under the ORIGINAL placements: left there,
    # later eager DTensor calls would replicate too (seen: an unevenly sharded view that DTensor
    # rejects eagerly passed after a dist compile). Dropped when the Dynamo compile ends.
    def forget(_args=None) -> None:
        if state["substituted"] or _cache_clear_pending:
            _clear_dtensor_sharding_caches()
            state["substituted"] = False

    # The other way round: entries cached by eager DTensor calls before a compile would be hits
    # while Dynamo traces, so this fallback never ran for them (seen: tensor_split's eager rule
    # read tensor data under Dynamo). Dropped when any Dynamo compile starts.
    def fresh(_args=None) -> None:
        _clear_dtensor_sharding_caches()

    # Dynamo's frame hook may be active when these run (eager code between two graphs, or
    # AOTAutograd compiling a backward lazily inside a compiled step): it would try to compile
    # them and deadlock on its own callback lock
    _keep_callbacks(callback_handler, torch.compiler.disable(fresh),
                    torch.compiler.disable(forget))
    _no_compiles_inside_dtensor_dispatch()


def _guards_suppressed() -> contextlib.AbstractContextManager:
    """Size tests made in this context are not recorded as guards of the frame Dynamo traces
    (checked on torch 2.11 and 2.13)."""
    ctx = TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


def _has_own_strategy(prop, op) -> bool:
    """Whether DTensor registers a strategy or rule for ``op`` itself (2.11 and 2.13 keep them
    in these three tables)."""
    return any(op in getattr(prop, table, {}) for table in
               ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules"))


def _eager_choice(prop, original, op_schema):
    """DTensor's own propagation of ``op_schema``, or None where it cannot run while Dynamo
    traces. Tried first, so user code that reads ``.placements`` (or passes them on, or
    to_local()s) sees what it would see eagerly and branches the same way (torchtitan asserts
    an output's placements, and local_map reads them). Only for ops with a strategy of their
    own: for the others (SDPA on CPU) DTensor searches strategies through the op's
    decomposition, which took ~50 s per SDPA."""
    if op_schema.op is torch.ops.aten.cat.default:
        own = _cat_skipping_legacy_empties(original, op_schema)
        if own is not None:
            return own
    if not _has_own_strategy(prop, op_schema.op):
        return None
    try:
        own = original(op_schema)
    except Exception:  # noqa: BLE001 -- any failure: the caller's replicated reading
        return None
    return own if _redistribution_applies(own) else None


def _cat_skipping_legacy_empties(original, op_schema):
    """``torch.cat([torch.tensor([]), k], dim=-2)``, transformers' DynamicCache on its first
    update: cat skips a 1-D empty operand, but DTensor's cat strategy (2.13) asks to split it
    and is refused, and the replicated reading would gather the whole KV cache. DTensor's
    strategy on the other operands, with the empties left replicated (their local tensor is
    themselves), is what the op computes. None when it does not apply."""
    tensors = op_schema.args_schema[0] if op_schema.args_schema else None
    if not isinstance(tensors, (list, tuple)) or \
            not all(isinstance(s, DTensorSpec) and s.tensor_meta is not None for s in tensors):
        return None
    empty = [tuple(s.tensor_meta.shape) == (0,) for s in tensors]
    if not any(empty) or all(empty):
        return None
    kept = type(tensors)(s for s, e in zip(tensors, empty) if not e)
    try:
        result = original(OpSchema(op_schema.op, (kept, *op_schema.args_schema[1:]),
                                   op_schema.kwargs_schema, schema_info=op_schema.schema_info))
    except Exception:  # noqa: BLE001 -- the replicated reading applies
        return None
    if not _redistribution_applies(result):
        return None
    wanted = result.redistribute_schema
    if wanted is not None:  # the asked-for layouts, the empties put back in their places
        asked = iter(wanted.args_schema[0])
        full = type(tensors)(s if e else next(asked) for s, e in zip(tensors, empty))
        result.redistribute_schema = OpSchema(op_schema.op, (full, *wanted.args_schema[1:]),
                                              wanted.kwargs_schema,
                                              schema_info=op_schema.schema_info)
        result.needs_redistribute = True
    return result


def _redistribution_applies(result) -> bool:
    """Whether DTensor's own choice can be run while Dynamo traces: its outputs hold plain
    Shard / Replicate / Partial only (a ``_MaskPartial`` from a vocab-split embedding fails
    later in dispatch, its mask buffer unset under fakes; a ``_StridedShard`` is rejected by
    bmm), and every input placement it asks for fits its tensor (2.13's cat strategy asks to
    split a legacy empty 1-D operand, shape [0], on dim 1). Both failures happen inside
    dispatch, after propagation returned, where no fallback can catch them."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    plain = (Shard, Replicate, Partial)
    outs = result.output_spec if isinstance(result.output_spec, (tuple, list)) else \
        [result.output_spec]
    if any(isinstance(o, DTensorSpec) and any(type(p) not in plain for p in o.placements)
           for o in outs):
        return False
    schema = result.redistribute_schema
    if schema is None:
        return True
    for spec in _flat_specs(schema):
        ndim = len(spec.tensor_meta.shape) if spec.tensor_meta is not None else None
        if ndim is not None and any(p.is_shard() and not -ndim <= p.dim < ndim
                                    for p in spec.placements):
            return False
    return True


def _argminmax_negative_dim_fix() -> None:
    """DTensor's argmax/argmin over a split dim (2.13, ``_nonlinear_redux``) all_gathers with
    the user's ``dim``; a negative one (``logits.argmax(-1)``, every greedy decode step over
    vocabulary-split logits) breaks ``_maybe_view_chunk_cat`` ("shape [1, 2, 2, 1] is invalid
    for input of size 2"). The handler gets the dim counted from the front. Eager DTensor is
    fixed too (the bug is the same there)."""
    handlers = compat.dtensor_custom_op_handlers()
    for op in (torch.ops.aten.argmax.default, torch.ops.aten.argmin.default):
        handler = handlers.get(op)
        if handler is None or getattr(handler, "_dynamo_dist_dim_fix", False):
            continue

        def counted_from_front(op_call, args, kwargs, _handler=handler):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and dim < 0 and isinstance(args[0], torch.Tensor):
                dim += max(args[0].ndim, 1)
                if len(args) > 1:
                    args = (args[0], dim, *args[2:])
                else:
                    kwargs = {**kwargs, "dim": dim}
            return _handler(op_call, args, kwargs)

        counted_from_front._dynamo_dist_dim_fix = True
        handlers[op] = counted_from_front


def _strided_gather_while_tracing() -> None:
    """Replicating a ``_StridedShard`` value while Dynamo traces for dist (the fallback above
    replicates every input) goes through ``_StridedShard._to_replicate_tensor``, which (2.13)
    builds its reorder indices with ``torch.arange``: there it runs outside the fake mode and
    index_select then mixes a real index with a fake tensor (an error). Evenly split values
    are gathered and their blocks reordered with views instead (rank-major [n, k, c] ->
    block-major [k, n, c]); anything else, and every eager call, runs DTensor's own code."""
    from torch.distributed import _functional_collectives as funcol

    original = StridedShard._to_replicate_tensor
    if getattr(original, "_dynamo_dist", False):
        return

    def to_replicate(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        n, k, dim = mesh.size(mesh_dim), int(self.split_factor), self.dim
        size = current_logical_shape[dim]
        if not compat.dist_tracing() or not isinstance(size, int) or size % (k * n):
            return original(self, local_tensor, mesh, mesh_dim, current_logical_shape)
        out = funcol.all_gather_tensor(local_tensor.contiguous(), gather_dim=dim,
                                       group=(mesh, mesh_dim))  # (2.11 and 2.13)
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out = out.wait()
        return out.unflatten(dim, (n, k, size // (k * n))).transpose(dim, dim + 1) \
            .reshape(list(current_logical_shape)).contiguous()

    to_replicate._dynamo_dist = True
    StridedShard._to_replicate_tensor = to_replicate


def _keep_callbacks(handler, start, end) -> None:
    """Register Dynamo compile start/end callbacks that survive ``torch._dynamo.reset()``
    (which clears every callback)."""
    handler.register_start_callback(start)
    handler.register_end_callback(end)
    clear = handler.clear

    def clear_and_keep() -> None:
        clear()
        handler.register_start_callback(start)
        handler.register_end_callback(end)

    handler.clear = clear_and_keep

# The C++ methods of DTensor's dispatcher that run Python between taking a pointer to this
# thread's sharding cache and inserting the op's sharding into it (2.13's python_variable.cpp,
# dispatchDTensorOp, on a cache miss).
_DISPATCH_CACHE_WINDOW = ("unwrap_to_op_info", "_unwrap_to_op_info_impl",
                          "_propagate_op_sharding_dispatch_slow_path")
# DTensor's own sources: frames there are DTensor's code, not the user's
DTENSOR_DIR = os.path.dirname(torch.distributed.tensor.__file__) + os.sep
_cache_clear_pending = False


def _no_compiles_inside_dtensor_dispatch() -> None:
    """Dynamo never compiles frames DTensor's eager dispatch runs on a cache miss.

    Eager DTensor code between two graphs of a split step runs under Dynamo's frame hook, which
    compiled the frames these methods call; each compile's start and end callbacks clear
    DTensor's caches, and freeing the C++ cache under the dispatch that is about to insert into
    it crashed real ranks at random (SIGSEGV in dispatchDTensorOp on ``ones_like(loss)`` in
    ``loss.backward()``). Idempotent; a missing method (another torch) is left alone."""
    cls = type(_dtensor_dispatcher())
    for name in _DISPATCH_CACHE_WINDOW:
        method = getattr(cls, name, None)
        if method is not None and not getattr(method, "_dynamo_dist_no_compile", False):
            wrapped = torch.compiler.disable(method)
            wrapped._dynamo_dist_no_compile = True
            setattr(cls, name, wrapped)


def _inside_dtensor_code() -> bool:
    """Whether DTensor's own Python is on this thread's stack (its C++ dispatch may be below it,
    holding a pointer into the sharding cache)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(DTENSOR_DIR):
            return True
        frame = frame.f_back
    return False


def _clear_dtensor_sharding_caches() -> None:
    """DTensor's Python and C++ sharding-propagation caches (2.13: one debug helper; older
    builds: the Python LRU cache, and the C++ one where it exists).

    Deferred to the next call made outside DTensor's code when DTensor's Python is on the
    stack: clearing there frees the C++ cache an enclosing dispatch still writes to."""
    global _cache_clear_pending
    if _inside_dtensor_code():
        _cache_clear_pending = True
        log.debug("dist: DTensor sharding-cache clear deferred (inside DTensor's dispatch)")
        return
    _cache_clear_pending = False
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        sharding_propagator().propagate_op_sharding.cache_clear()
        clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if clear_cpp is not None:
            clear_cpp()
        return
    _clear_sharding_prop_cache()


def _replicated_schema(op_schema, replicated):
    """``op_schema`` with every DTensorSpec argument replicated (``replicated`` maps one)."""
    return OpSchema(op_schema.op, tuple(replicated(a) for a in op_schema.args_schema),
                    {k: replicated(v) for k, v in op_schema.kwargs_schema.items()},
                    schema_info=op_schema.schema_info)


def _inplace_keeping_placements(prop, op_schema, replicated, exc):
    """Tracing an in-place op DTensor cannot run in place (``x.clamp_()`` on a Partial ``x``):
    Dynamo only needs the result's global metadata, which an in-place op leaves as it was, so
    it runs on replicated fakes and ``x`` keeps its placements. The dist backend plans the
    functionalised program (reduce, clamp, write back) in global semantics."""
    rep = _replicated_schema(op_schema, replicated)
    try:
        out = _replicated_output_specs(prop, rep)
    except Exception:
        raise _untraceable(op_schema, exc) from exc
    self_spec = op_schema.args_schema[0]
    if not isinstance(out, DTensorSpec) or not isinstance(self_spec, DTensorSpec):
        raise _untraceable(op_schema, exc) from exc
    result = OutputSharding(DTensorSpec(self_spec.mesh, self_spec.placements,
                                        tensor_meta=out.tensor_meta))
    result.redistribute_schema = rep
    result.needs_redistribute = True
    return result


def _moves_self(result, op_schema) -> bool:
    """Whether DTensor's propagation of an in-place op moves its input to another kind of
    placement on some mesh axis (Shard -> Replicate: data would have to move, which an in-place
    op cannot do; torch 2.11 refuses it at dispatch, 2.13 relabels the input without moving
    it). A Shard whose dim is only renumbered (``squeeze_``, ``transpose_``) is DTensor's own
    business (2.13 re-indexes the spec)."""
    out, self_spec = result.output_spec, op_schema.args_schema[0]
    return isinstance(out, DTensorSpec) and isinstance(self_spec, DTensorSpec) and \
        any(type(a) is not type(b) for a, b in zip(out.placements, self_spec.placements))


def _flat_specs(op_schema) -> tuple:
    return tuple(s for s in pytree.tree_leaves(op_schema.args_schema) if isinstance(s, DTensorSpec))


def _all_replicated(op_schema) -> bool:
    """Every DTensor argument of ``op_schema`` is replicated on every mesh axis."""
    return all(p.is_replicate() for spec in op_schema.args_spec for p in spec.placements)


def _dtensor_dispatcher():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher


def _replicating_handler(handler):
    def run(op_call, args, kwargs):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Replicate

        if not compat.dist_tracing():
            return handler(op_call, args, kwargs)
        meshes = [a.device_mesh for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, DTensor)]
        reps = [Replicate()] * meshes[0].ndim

        def local(a):
            return a.redistribute(a.device_mesh, reps).to_local() if isinstance(a, DTensor) else a

        try:
            out = op_call(*pytree.tree_map(local, args), **pytree.tree_map(local, kwargs))
        except Exception as exc:
            raise _untraceable(op_call, exc) from exc
        return pytree.tree_map_only(
            torch.Tensor, lambda o: DTensor.from_local(o, meshes[0], reps, run_check=False), out)

    run = torch.compiler.disable(run)
    run._dynamo_dist_original = handler
    return run


def _data_dependent_error(op_schema) -> Exception:
    """The DistCompileError for a data-dependent op met while Dynamo traces for dist: names the
    op, the argument shapes/dtypes (global), mesh, placements, and the static-shape form."""

    op = op_schema.op
    specs = [s for s in pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema))
             if isinstance(s, DTensorSpec)]
    shapes = [tuple(s.tensor_meta.shape) for s in specs if s.tensor_meta is not None]
    dtypes = ", ".join(str(s.tensor_meta.dtype).replace("torch.", "") for s in specs
                       if s.tensor_meta is not None)
    name = op._schema.name.split("::")[-1]
    fix = STATIC_FIX.get(name, "compute it outside the compiled region, or write it with a "
                                "static output shape")
    what = ("its output shape depends on tensor data" if torch.Tag.dynamic_output_shape in op.tags
            else "its output (a Python value) depends on tensor data")
    return DistCompileError(
        f"{op} cannot be traced for the dist backend: {what} ({dtypes}), which a plan made at "
        f"compile time cannot know", op=op, shapes=shapes,
        mesh=specs[0].mesh if specs else None,
        placements=", ".join(str(tuple(s.placements)) for s in specs), fix=fix)


def _untraceable(op, exc: Exception) -> Exception:
    """A clear error for an op Dynamo cannot trace with DTensor inputs even when replicated
    (data-dependent output shapes, Python scalars from tensors)."""

    name = getattr(op, "op", op)
    return DistCompileError(
        f"{name} cannot be traced for the dist backend: {type(exc).__name__}: "
        f"{(str(exc).splitlines() or [''])[0][:300]}",
        op=name, fix="compute it outside the compiled region (for example when its output shape "
                     "depends on tensor values), or on plain tensors")


def _fails_on_one_device(op_schema, exc: Exception) -> Exception:
    """The op fails on the GLOBAL (replicated) arguments: a bug of the program itself
    (mismatched shapes), which the same call on one device raises too. Says so, with torch's
    own message, rather than blaming the backend."""

    specs = [s for s in pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema))
             if isinstance(s, DTensorSpec)]
    return DistCompileError(
        f"{op_schema.op} fails on these arguments as it would on one device: "
        f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}", op=op_schema.op,
        shapes=[tuple(s.tensor_meta.shape) for s in specs if s.tensor_meta is not None],
        mesh=specs[0].mesh if specs else None,
        placements=", ".join(str(tuple(s.placements)) for s in specs),
        fix="correct the call (its shapes or arguments): the program fails without dist too")


def _replicated_output_specs(prop, op_schema):
    """Replicated DTensorSpecs for an op's outputs, metadata from running it on fakes of the
    global arguments on the mesh's device type (DTensor's own metadata propagation makes CPU
    fakes: on a CUDA mesh an op whose CPU kernel lacks a dtype, ``histc`` of int32 as
    transformers' MoE calls it on GPUs, failed there)."""
    from torch.distributed.tensor.placement_types import Replicate

    mesh = next(s.mesh for s in pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema))
                if isinstance(s, DTensorSpec))
    reps = tuple(Replicate() for _ in range(mesh.ndim))
    meta = _fake_output_meta(prop, op_schema, mesh.device_type)
    if isinstance(meta, TensorMeta):
        return DTensorSpec(mesh, reps, tensor_meta=meta)
    if isinstance(meta, (tuple, list)):
        return tuple(None if m is None else DTensorSpec(mesh, reps, tensor_meta=m) for m in meta)
    return None



def _fake_output_meta(prop, op_schema, device_type: str):
    """TensorMeta (or a list of them, None for non-tensors) of the op's outputs, run on fake
    global arguments made on ``device_type``."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    def fake(spec: DTensorSpec) -> torch.Tensor:
        m = spec.tensor_meta
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=device_type)

    def fakes(tree):
        return pytree.tree_map_only(DTensorSpec, fake, tree,
                                    is_leaf=lambda x: isinstance(x, DTensorSpec))

    # DTensor serialises its own fake runs with this lock (multi-threaded tests)
    with getattr(type(prop), "_fake_mode_lock", contextlib.nullcontext()):
        with detect_fake_mode() or FakeTensorMode(), disable_proxy_modes_tracing():
            out = op_schema.op(*fakes(op_schema.args_schema), **fakes(op_schema.kwargs_schema))

    def meta(t):
        return TensorMeta(t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None

    return [meta(t) for t in out] if isinstance(out, (tuple, list)) else meta(out)


# == Dynamo: distributed metadata folded with correct guards ================================
# Appended for "distributed metadata constant-folded with correct guards" (tests:
# tests/test_metadata_folding.py). Checked on torch 2.13.0; on builds without these Dynamo
# internals (2.11) each install_* below returns False and patches nothing.
#
# torch 2.13 already folds the metadata queries of DeviceMesh, ProcessGroup and placements
# (they are registered as "opaque" types whose USE_REAL members run on the real object), and
# dist.get_rank / get_world_size. Three gaps remain, each fixed here:
#   1. Slicing (``mesh["tp"]``) and ``get_group`` on a slice are recorded as FX call_method
#      nodes that Dynamo keeps even when only a folded constant was read from their result
#      (``x * mesh["tp"].size()``). The dead node keeps the whole mesh as a graph input, and our
#      capture then plans the program over that mesh: a plain-tensor program returns DTensors,
#      and one on a slice of it fails with "inputs live on different device meshes".
#   2. A ProcessGroup is guarded on its type only (torch registers it with no guard_fn), so
#      ``g.rank()``, ``g.size()``, ``dist.get_rank(g)``, ``dist.get_world_size(g)`` on a group
#      passed in keep the first group's values when another group of the same type comes.
#   3. An int read off a placement or a dynamo_dist Mesh passed as an argument
#      (``p.dim``, ``m.mesh_shape[0]``) gets a source, so after a change Dynamo makes it a
#      dynamic SymInt graph input (automatic dynamic) -- a placement dim or mesh size is not a
#      runtime value, and the dist backend rejects such inputs. Read while tracing for
#      ``dist``, these become constants guarded by equality on their owner.
MESH_LOOKUP_METHODS = frozenset({"__getitem__", "get_group", "_get_root_mesh"})
MESH_VALUE_ATTRS = ("device_ids", "mesh_shape", "axis_names")  # what Mesh.__eq__ compares


def drop_dead_mesh_lookups(graph: "torch.fx.Graph", remove: Callable | None = None) -> int:
    """(1) Remove ``call_method`` nodes in ``MESH_LOOKUP_METHODS`` on a DeviceMesh whose result
    is unused (slicing and group lookup have no side effects: a slice reuses its parent's
    process groups). ``remove`` erases a node (Dynamo's ``OutputGraph.remove_node``; default
    ``graph.erase_node``). Returns how many nodes were removed."""
    from torch.distributed.device_mesh import DeviceMesh

    remove = remove or graph.erase_node
    removed = 0
    for node in reversed(list(graph.nodes)):
        receiver = node.args[0] if node.op == "call_method" and node.args else None
        if (node.target in MESH_LOOKUP_METHODS and not node.users
                and isinstance(receiver, torch.fx.Node)
                and isinstance(compat.real_object(receiver.meta.get("example_value")),
                                   DeviceMesh)):
            remove(node)
            removed += 1
    return removed


def install_dead_mesh_lookup_removal() -> bool:
    """(1) While Dynamo traces for ``dist``, drop dead mesh lookups just before it prunes unused
    graph inputs (so the mesh input goes too; the guards installed on the mesh when it was read
    stay). Other backends are unchanged. Idempotent; False where this torch lacks the hook."""
    try:
        from torch._dynamo.output_graph import OutputGraph
    except ImportError:
        return False
    original = getattr(OutputGraph, "remove_unused_graphargs", None)
    if original is None:
        return False
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    def remove_unused_graphargs(self, *args, **kwargs):
        if dist_backend_is_tracing():
            drop_dead_mesh_lookups(self.graph, self.remove_node)
        return original(self, *args, **kwargs)

    remove_unused_graphargs._dynamo_dist_patch = True
    OutputGraph.remove_unused_graphargs = remove_unused_graphargs
    return True


def install_sharding_cache_clear_on_destroy() -> bool:
    """After ``torch.distributed.destroy_process_group``, clear DTensor's sharding-propagation
    caches. Their keys compare meshes by value (shape, axis names, ranks), so a new mesh equal
    to a destroyed one hit entries holding the old mesh: an op's output DTensor came back on
    the destroyed mesh, and a later compile failed in Dynamo with "Group ... is not registered"
    (a process that tears its process group down and builds it again, as the tests do).
    Idempotent; applies to callers that look the function up on ``torch.distributed`` or
    ``distributed_c10d`` (a name imported before this ran keeps the original)."""
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            _clear_dtensor_sharding_caches()

    destroy_process_group._dynamo_dist_patch = True
    distributed_c10d.destroy_process_group = destroy_process_group
    torch.distributed.destroy_process_group = destroy_process_group
    return True


def process_group_guard_values(pg: Any) -> list:
    """(2) What a compiled frame that read ``pg`` depends on: its name (unique among live
    groups), this process's rank in it and its size."""
    return [pg.group_name, pg.rank(), pg.size()]


def install_process_group_guard() -> bool:
    """(2) Give torch's opaque-type registration of ProcessGroup a guard_fn, so a frame that
    folded a group's rank/size recompiles for another group. Applies to every backend (it only
    adds recompiles where a folded value would be stale). Idempotent; False where ProcessGroup
    is not an opaque type (torch 2.11)."""
    try:
        from torch._library.opaque_object import get_opaque_obj_info
        from torch.distributed import ProcessGroup
        from torch.distributed.device_mesh import _register_distributed_opaque_types
    except ImportError:
        return False
    _register_distributed_opaque_types()  # torch's own (once); ours refines it
    info = get_opaque_obj_info(ProcessGroup)
    if info is None or getattr(info, "opaque_typ", None) != "reference" \
            or not hasattr(info, "guard_fn"):
        return False
    if info.guard_fn is None:  # (registering again is refused by torch's C++ side)
        try:
            info.guard_fn = process_group_guard_values
        except AttributeError:  # a frozen registration record on some other build
            return False
    return True


def _folded_metadata_attr(var: Any, tx: Any, name: str) -> Any:
    """(3) The attribute ``name`` of a placement or a dynamo_dist Mesh as a guarded constant
    VariableTracker, or None to let Dynamo read it as usual."""
    obj = getattr(var, "value", None)
    if not isinstance(obj, (Mesh, Placement)):  # every user-defined object's reads pass here
        return None
    from torch._dynamo.variables.base import VariableTracker

    if isinstance(obj, Mesh):
        # only a mesh made before the compiled region (it has a source) and not written to in
        # it: one made inside is traced as usual (its attributes are constants there anyway)
        if (name not in MESH_VALUE_ATTRS or var.source is None or not dist_backend_is_tracing()
                or tx.output.side_effects.has_pending_mutation_of_attr(var, name)):
            return None
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import AttrSource

        # guarded on exactly what is read, by equality
        install_guard(AttrSource(var.source, name).make_guard(GuardBuilder.CONSTANT_MATCH))
        return VariableTracker.build(tx, getattr(obj, name))
    # a placement: a value-type opaque object, which Dynamo guards by equality (CONSTANT_MATCH)
    # wherever it has a source; that fixes every attribute
    from torch._library.opaque_object import is_opaque_value_type

    value = getattr(obj, name, None)
    if (not is_opaque_value_type(type(obj)) or callable(value) or name.startswith("__")
            or not dist_backend_is_tracing()):
        return None
    return VariableTracker.build(tx, value)


def install_metadata_attr_folding() -> bool:
    """(3) While Dynamo traces for ``dist``, read placement attributes and the value attributes
    of dynamo_dist Mesh (``MESH_VALUE_ATTRS``) as constants guarded by equality. Idempotent;
    False where this torch lacks what it needs (torch 2.11)."""
    try:
        from torch._dynamo.variables.user_defined import UserDefinedObjectVariable
        from torch._library.opaque_object import is_opaque_value_type  # noqa: F401
    except ImportError:
        return False
    original = UserDefinedObjectVariable.var_getattr
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    def var_getattr(self, tx, name):
        folded = _folded_metadata_attr(self, tx, name)
        return folded if folded is not None else original(self, tx, name)

    var_getattr._dynamo_dist_patch = True
    UserDefinedObjectVariable.var_getattr = var_getattr
    return True


# == end: distributed metadata folded with correct guards ===================================


# A whole training step in one program (issue 15). With ``trace_autograd_ops`` Dynamo traces
# ``loss.backward()`` as ``autograd.grad`` + ``.grad`` updates, but three things in torch 2.13
# still split a step written as ``loss = model(x); loss.backward(); opt.step()``:
#   1. ``torch.optim``'s ``_use_grad`` calls ``torch._dynamo.graph_break()`` before and after
#      every ``step`` (so that AOTAutograd sees the update under no_grad; our capture traces
#      grad mode as written, so the break buys nothing here);
#   2. Dynamo runs ``_init_group`` in Python on the real parameters, and breaks while a
#      parameter's ``.grad`` is a pending in-graph update (the backward just traced);
#   3. its check that no returned tensor needs a grad_fn the traced backward consumed asserts
#      every example value is a FakeTensor, and ours are DTensors.
# Each patch below acts only while Dynamo traces for ``dist``.
def install_whole_step() -> bool:
    """Let Dynamo trace forward, ``backward()`` and a ``torch.optim`` step as one program for
    ``dist`` (see above). Returns False where this torch lacks what it patches (2.11: no
    ``trace_autograd_ops``; the step then splits at ``backward()`` as before). Idempotent
    (checked on torch 2.13)."""
    from torch._dynamo import config, output_graph
    from torch._dynamo.variables import functions, optimizer
    from torch.optim.optimizer import _use_grad_for_differentiable

    if not hasattr(config, "trace_autograd_ops") or \
            not hasattr(output_graph.OutputGraph, "_validate_outputs_safe_for_autograd_nodes"):
        return False
    if getattr(optimizer.OptimizerVariable, "_dynamo_dist_whole_step", False):
        return True
    use_grad_code = _use_grad_for_differentiable(lambda self: None).__code__
    skip_call = functions.SkipFunctionVariable.call_function

    def call_function(self, tx, args, kwargs):
        if self.value is torch._dynamo.graph_break and tx.f_code is use_grad_code and \
                dist_backend_is_tracing():
            from torch._dynamo.variables.constant import ConstantVariable

            return ConstantVariable.create(None)
        return skip_call(self, tx, args, kwargs)

    functions.SkipFunctionVariable.call_function = call_function
    _install_init_group_with_pending_grads(optimizer)
    _install_zero_grad_in_graph(optimizer)
    _install_dtensor_output_check(output_graph)
    _install_backward_reaches_every_leaf()
    optimizer.OptimizerVariable._dynamo_dist_whole_step = True
    return True


def _install_init_group_with_pending_grads(optimizer) -> None:
    """Dynamo's fast ``_init_group`` calls the optimizer's own ``_init_group`` on the real
    parameters and maps what it lists back to graph values. When the program's backward has
    just set ``p.grad`` (pending in the graph, not yet on ``p``), give each such parameter a
    stand-in ``.grad`` (a detached alias of ``p``: same shape, dtype and layout, no copy) for
    the call, and map each stand-in back to the pending gradient. Other pending parameter
    updates still split the step, as Dynamo does."""
    cls = optimizer.OptimizerVariable
    call_method, graph_break_if_pending, wrap_tensor = \
        cls.call_method, cls.graph_break_if_pending_mutation, cls.wrap_tensor

    def pending_grads(self, tx) -> dict | None:
        effects, out = tx.output.side_effects, {}
        for group in self.value.param_groups:
            for p in group["params"]:
                var = effects.id_to_variable.get(id(p))
                if var is None or not effects.has_pending_mutation(var):
                    continue
                if set(effects.store_attr_mutations.get(var, ())) != {"grad"}:
                    return None  # another pending update: Dynamo's own graph break
                out[p] = effects.load_attr(var, "grad")
        return out

    def patched_call_method(self, tx, name, args, kwargs):
        pending = pending_grads(self, tx) if name == "_init_group" and \
            dist_backend_is_tracing() else None
        if not pending:
            return call_method(self, tx, name, args, kwargs)
        from torch._dynamo.variables.constant import ConstantVariable

        saved = {p: p.grad for p in pending}
        self._dist_stand_ins = {}
        try:
            for p, grad in pending.items():
                if isinstance(grad, ConstantVariable) and grad.value is None:
                    p.grad = None
                else:
                    stand_in = p.detach()
                    self._dist_stand_ins[id(stand_in)] = (stand_in, grad)
                    p.grad = stand_in
            return call_method(self, tx, name, args, kwargs)
        finally:
            self._dist_stand_ins = None
            for p, grad in saved.items():
                p.grad = grad

    def patched_graph_break_if_pending(self, tx):
        if getattr(self, "_dist_stand_ins", None) is None:
            return graph_break_if_pending(self, tx)

    def patched_wrap_tensor(self, tx, value):
        found = (getattr(self, "_dist_stand_ins", None) or {}).get(id(value))
        if found is not None and found[0] is value:
            return found[1]
        return wrap_tensor(self, tx, value)

    cls.call_method = patched_call_method
    cls.graph_break_if_pending_mutation = patched_graph_break_if_pending
    cls.wrap_tensor = patched_wrap_tensor


def _install_zero_grad_in_graph(optimizer) -> None:
    """``opt.zero_grad()`` after the traced ``backward()`` and ``step()``: Dynamo never traces
    ``zero_grad`` (it splits there, and ``backward()`` with it: the loss is still live). When
    every parameter's ``.grad`` is either a pending in-graph gradient or None now (guarded to
    stay None), ``zero_grad()`` (``set_to_none=True``) is just "each pending gradient becomes
    None", done here. Anything else (nothing pending: ``zero_grad()`` at the top of the step,
    where the split costs nothing; ``set_to_none=False``; a real ``.grad`` Dynamo has no graph
    value for) goes to Dynamo's own handling."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, GetItemSource, GradSource
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.misc import LambdaVariable

    cls = optimizer.OptimizerVariable
    var_getattr = cls.var_getattr

    def in_graph(self, tx, set_to_none) -> bool:
        if not (isinstance(set_to_none, ConstantVariable) and set_to_none.value is True):
            return False
        effects, pending, stay_none = tx.output.side_effects, [], []
        for g, group in enumerate(self.value.param_groups):
            for k, p in enumerate(group["params"]):
                var = effects.id_to_variable.get(id(p))
                if var is not None and effects.has_pending_mutation_of_attr(var, "grad"):
                    pending.append(var)
                elif p.grad is None:
                    stay_none.append(GetItemSource(GetItemSource(GetItemSource(
                        AttrSource(self.source, "param_groups"), g), "params"), k))
                else:
                    return False
        if not pending:
            return False
        for source in stay_none:
            install_guard(GradSource(source, "grad").make_guard(GuardBuilder.CONSTANT_MATCH))
        for var in pending:
            effects.store_attr(var, "grad", ConstantVariable.create(None))
        return True

    def patched_var_getattr(self, tx, name):
        found = var_getattr(self, tx, name)
        if name != "zero_grad" or self.source is None or not dist_backend_is_tracing():
            return found

        def zero_grad(set_to_none=None, **kwargs):
            flag = ConstantVariable.create(True) if set_to_none is None else set_to_none
            if not kwargs and in_graph(self, tx, flag):
                return ConstantVariable.create(None)
            args = [] if set_to_none is None else [set_to_none]
            return found.call_function(tx, args, kwargs)

        # the source rebuilds the bound method where Dynamo splits at the call
        return LambdaVariable(zero_grad, source=AttrSource(self.source, "zero_grad"))

    cls.var_getattr = patched_var_getattr


def _install_backward_reaches_every_leaf() -> None:
    """Dynamo's traced ``loss.backward()`` differentiates with respect to the leaves it holds as
    graph inputs. A parameter it first met through ``opt.param_groups`` (the step reads the
    learning rate before the forward) is a constant attribute to it, so it is left out, and
    with no leaf left the backward is dropped: no gradient, no error, the model silently not
    trained. For ``dist``, a backward that would miss a leaf the loss reaches is split from
    the program instead (Dynamo's behaviour without ``trace_autograd_ops``: correct)."""
    from itertools import chain

    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables.tensor import TensorVariable

    method_backward = TensorVariable.method_backward

    def patched(self, tx, gradient=None, retain_graph=None, create_graph=None, inputs=None):
        value = self.as_proxy().node.meta.get("example_value")
        if inputs is None and dist_backend_is_tracing() and \
                isinstance(value, torch.Tensor) and value.grad_fn is not None:
            held = self._collect_backward_inputs(chain(tx.output.leaf_var_creation_order,
                                                       tx.output.input_source_to_var.values()))
            held_ids = {id(v.as_proxy().node.meta.get("example_value")) for v in held}
            missing = [leaf for leaf in compat.autograd_leaves([value]) if id(leaf) not in held_ids]
            if missing:
                unimplemented(
                    gb_type="dist: backward() would miss a parameter",
                    context=f"{len(missing)} leaf tensor(s) the loss reaches are not graph "
                            f"inputs (first: shape {tuple(missing[0].shape)})",
                    explanation="Dynamo holds these parameters as constants (it met them "
                                "through the optimizer first), so a traced backward() would "
                                "give them no gradient; the step is split at backward() "
                                "instead",
                    hints=["read opt.param_groups (learning rate, logging) after the forward, "
                           "or outside the compiled function"])
        return method_backward(self, tx, gradient, retain_graph, create_graph, inputs)

    TensorVariable.method_backward = patched


def _install_dtensor_output_check(output_graph) -> None:
    """Dynamo's check that a returned tensor does not need a grad_fn the traced backward
    consumed (then it splits at ``backward()``; ``return loss.detach()`` avoids that) asserts
    FakeTensor example values: DTensor ones are checked here the same way and left out of
    Dynamo's own loop."""
    from torch._dynamo import exc
    from torch._dynamo.variables.tensor import TensorVariable
    from torch.distributed.tensor import DTensor

    cls = output_graph.OutputGraph
    validate = cls._validate_outputs_safe_for_autograd_nodes

    def dtensor_valued(var) -> bool:
        return isinstance(var, TensorVariable) and \
            isinstance(var.as_proxy().node.meta.get("example_value"), DTensor)

    def patched(self, rv, tx):
        consumed = self.autograd_grad_consumed_grad_fns
        if not consumed:
            return None
        for var in rv:
            if dtensor_valued(var) and var.requires_grad:
                value = var.as_proxy().node.meta["example_value"]
                if value.grad_fn is not None and \
                        output_graph.collect_reachable_grad_fns([(value, None)]) & consumed:
                    tx.speculation_log.autograd_grad_leaked_tensors.append(
                        str(var.source) if var.source else var.proxy.node.name)
        if tx.speculation_log.autograd_grad_leaked_tensors:
            tx.speculation_log.graph_break_on_autograd_grad = True
            raise exc.AutogradGradRestartAnalysis(
                restart_reason="autograd.grad consumed grad_fns of returned tensors")
        return validate(self, [v for v in rv if not dtensor_valued(v)], tx)

    cls._validate_outputs_safe_for_autograd_nodes = patched


def install_backend_ctx_with_options() -> None:
    """``torch.compile(backend=..., options=...)`` wraps the backend in ``_TorchCompileWrapper``,
    which hides the backend's ``backend_ctx_ctor`` from Dynamo (without options Dynamo finds
    it: ``WrapBackendDebug`` copies the backend function's ``__dict__``). Forward it for
    backends marked ``_dynamo_dist_backend`` only, on the wrapper instance, when
    ``eval_frame._optimize`` receives it: that runs after ``"dist"`` was resolved (and this
    module imported), so the first compile is covered too (a patched wrapper ``__init__``
    missed it: its Python numbers were not specialised). Idempotent (checked on torch 2.11 and
    2.13)."""
    from torch._dynamo import eval_frame

    original = getattr(eval_frame, "_optimize", None)
    if original is None or getattr(original, "_dynamo_dist_ctx", False):
        return

    @functools.wraps(original)
    def _optimize(rebuild_ctx, backend="inductor", **kwargs):
        fn = getattr(backend, "compiler_fn", None)
        if isinstance(backend, torch._TorchCompileWrapper) and \
                getattr(fn, "_dynamo_dist_backend", False) and hasattr(fn, "backend_ctx_ctor"):
            backend.backend_ctx_ctor = fn.backend_ctx_ctor
        return original(rebuild_ctx, backend, **kwargs)

    _optimize._dynamo_dist_ctx = True
    eval_frame._optimize = _optimize


def install_symbolic_plain_tensor_wrapping() -> bool:
    """While Dynamo traces for ``dist`` with symbolic sizes, a plain tensor of symbolic shape
    that meets a DTensor in one call enters it as a replicated DTensor, as implicit replication
    would read it. DTensor's C++ dispatch reads a plain argument's ``numel()`` and cannot on a
    symbolic shape ("Cannot call numel() on tensor with symbolic sizes/strides"). Dynamo runs
    each traced call on fake values in ``torch._dynamo.utils.run_node``; the wrapping is a
    TorchFunctionMode around that call only (checked on torch 2.11 and 2.13). Idempotent;
    returns False where Dynamo has no such function."""
    from torch._dynamo import utils as dynamo_utils
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate
    from torch.overrides import TorchFunctionMode

    original = getattr(dynamo_utils, "run_node", None)
    if original is None:
        return False
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    class _ReplicateSymbolicPlain(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat = pytree.tree_leaves((args, kwargs))
            mesh = next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
            if mesh is not None and any(isinstance(a, torch.Tensor) and
                                        not isinstance(a, DTensor) and has_symbolic_shape(a)
                                        for a in flat):
                def enter(a):
                    return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim,
                                              run_check=False)
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda a: a if isinstance(a, DTensor) else enter(a),
                    (args, kwargs))
            return func(*args, **kwargs)

    @functools.wraps(original)
    def run_node(tracer, node, args, kwargs, nnmodule):
        if not dist_backend_is_tracing():
            return original(tracer, node, args, kwargs, nnmodule)
        with _ReplicateSymbolicPlain():
            return original(tracer, node, args, kwargs, nnmodule)

    run_node._dynamo_dist_patch = True
    dynamo_utils.run_node = run_node
    return True
