"""The one place where dynamo_dist touches private torch APIs.

Each entry names the torch version it was checked on. Everything else in the package imports
these names from here, so a torch upgrade is a change to this file (and its test,
``tests/test_compat.py``), not a hunt through the tree.

Checked on: torch 2.13.0 (CPU build); import also checked on 2.11.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

TORCH_CHECKED = ("2.11", "2.13")

# -- FX / tracing (2.13) ------------------------------------------------------------------
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402,F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402,F401
from torch._guards import TracingContext, tracing, detect_fake_mode  # noqa: E402,F401

# -- Inductor (2.13) ------------------------------------------------------------------------
from torch._inductor.compile_fx import compile_fx_inner  # noqa: E402,F401
from torch._inductor.decomposition import select_decomp_table  # noqa: E402,F401
from torch._functorch.partitioners import default_partition  # noqa: E402,F401

# -- DTensor internals (2.13): spec classes and the strategy registry ----------------------
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402,F401
from torch.distributed.tensor._op_schema import (  # noqa: E402,F401
    OpSchema,
    OpSpec,
    OpStrategy,
    OutputSharding,
    TupleStrategy,
)


def sharding_propagator():
    """DTensor's global ShardingPropagator (holds the per-op strategy registry)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def dtensor_op_strategy(op_schema: OpSchema, out_tensor_meta: Any) -> Any:
    """Ask DTensor's registry for the full OpStrategy of ``op_schema`` (args hold DTensorSpecs).

    Returns an ``OpStrategy``/``TupleStrategy``, or ``None`` when DTensor has no strategy for the op
    (its rule-based and decomposition paths are not used: they decide, they do not enumerate).
    """
    prop = sharding_propagator()
    op = op_schema.op
    single = getattr(prop, "op_single_dim_strategy_funcs", {}).get(op)
    func = prop.op_strategy_funcs.get(op)
    if single is None and func is None:
        return None
    if op in prop.op_to_schema_info:
        op_schema.schema_info = prop.op_to_schema_info[op]
    elif op in getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}):
        op_schema.schema_info = prop.op_to_schema_info_for_single_dim_strategy[op]
    strategy_schema = prop._wrap_with_op_strategy(op_schema)
    if single is not None:
        from torch.distributed.tensor._ops.single_dim_strategy import (
            _expand_single_dim_strategy_to_mesh,
        )

        mesh = op_schema.get_mesh_from_args(validate=False)
        expand = _expand_single_dim_strategy_to_mesh(mesh, strategy_schema, single, out_tensor_meta)
        return expand(op, strategy_schema.args_meta, strategy_schema.kwargs_meta)
    return func(strategy_schema)


# -- Dynamo (2.13) ---------------------------------------------------------------------------
def assume_constant_result(fn: Callable) -> Callable:
    """Dynamo calls ``fn`` while tracing and bakes its result in as a constant (guarded)."""
    return torch._dynamo.assume_constant_result(fn)


# -- Local tensor simulation (2.13) ----------------------------------------------------------
def disable_local_tensor_mode() -> contextlib.AbstractContextManager:
    """A backend must not run its own tracing under LocalTensorMode (it would recurse)."""
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # torch 2.11 has no LocalTensorMode
        return contextlib.nullcontext()
    return maybe_disable_local_tensor_mode()


def allow_implicit_replication(enabled: bool = True) -> None:
    """Let DTensor treat plain tensors mixed with DTensors as Replicate.

    Dynamo computes example values of a program with DTensor parameters by running DTensor's own
    dispatch on fake tensors; single-device-style code (rotary tables, masks, labels built from plain
    tensors) mixes plain tensors in, and plain tensors are replicated global values in our semantics.
    """
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._allow_implicit_replication = enabled


def implicit_replication_enabled() -> bool:
    from torch.distributed.tensor import DTensor

    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def dist_backend_is_tracing() -> bool:
    """True while Dynamo traces a frame for the ``dist`` backend (not for any other backend)."""
    from torch._dynamo import symbolic_convert

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    for _ in range(8):  # unwrap Dynamo's debug wrapper and torch.compile's options wrapper
        if fn is None:
            return False
        if getattr(fn, "_dynamo_dist_backend", False):
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return False


def _dist_tracing() -> bool:
    """Dynamo is tracing (fake values, possibly a proxy) a frame for the ``dist`` backend."""
    from torch.distributed._functional_collectives import _are_we_tracing

    return _are_we_tracing() and dist_backend_is_tracing()


def install_dynamo_tracing_fallback() -> None:
    """Make DTensor's sharding propagation replicate everything while Dynamo traces.

    Dynamo builds example values of a program with DTensor inputs by running DTensor's own
    dispatch on fake tensors. DTensor's per-op choices there are slow (its SDPA decomposition
    path takes minutes) and fail on cases our compiler handles (a view over a 2-D mesh gives a
    ``_StridedShard`` that ``bmm`` rejects; local strides that a global view does not allow).
    The ``dist`` backend ignores those placements -- it re-plans the whole program in global
    semantics -- and global shapes and dtypes do not depend on placements, so while Dynamo traces
    for the ``dist`` backend we propagate with every input replicated. Other backends and eager
    DTensor are unchanged. Idempotent.
    """
    from torch.distributed.tensor.placement_types import Replicate

    prop = sharding_propagator()
    if getattr(prop, "_dynamo_dist_fallback", False):
        return
    original = prop.propagate_op_sharding_non_cached

    def replicated(spec):
        if isinstance(spec, DTensorSpec):
            return DTensorSpec(spec.mesh, tuple(Replicate() for _ in spec.placements),
                               tensor_meta=spec.tensor_meta)
        if isinstance(spec, (list, tuple)):
            return type(spec)(replicated(s) for s in spec)
        return spec

    def propagate(op_schema):
        if not _dist_tracing():
            return original(op_schema)
        if op_schema.is_inplace_op() or op_schema.is_out_variant_op():
            # the written tensor keeps its own placement (its local fake can't change shape)
            try:
                return original(op_schema)
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
        op = op_schema.op
        if torch.Tag.dynamic_output_shape in op.tags or torch.Tag.data_dependent_output in op.tags:
            raise _untraceable(op_schema, RuntimeError(
                "its output shape or value depends on tensor data, which a plan made at "
                "compile time cannot know"))
        rep = _replicated_schema(op_schema, replicated)
        state["substituted"] = True
        try:
            result = original(rep)
        except Exception as exc:
            # No DTensor strategy (aten._scaled_dot_product_flash_attention_for_cpu), or one
            # that fails on these arguments (aten._chunk_cat's tensor list): Dynamo only needs
            # global metadata, which the op on replicated fakes gives. A real error in the
            # user's program (mismatched shapes) fails there too, and is reported as such.
            try:
                result = OutputSharding(_replicated_output_specs(prop, rep))
            except Exception:
                raise _untraceable(op_schema, exc) from exc
        # (specs inside tensor lists too: OpSchema.args_spec skips them for ops DTensor has no
        # schema info for, such as aten._chunk_cat)
        if _flat_specs(rep) != _flat_specs(op_schema) or result.redistribute_schema is not None:
            result.redistribute_schema = result.redistribute_schema or rep
            result.needs_redistribute = True
        return result

    from torch._dynamo.callback import callback_handler

    prop.propagate_op_sharding_non_cached = propagate
    prop._dynamo_dist_fallback = True
    # DTensor runs some ops through handlers of its own (convolution, as_strided, argmax...)
    # that bypass propagation: while tracing for dist they run on replicated values too.
    handlers = _dtensor_dispatcher()._custom_op_handlers
    for op, handler in list(handlers.items()):
        handlers[op] = _replicating_handler(handler)
    state = {"substituted": False}

    # DTensor's C++ dispatch caches what this returned under the ORIGINAL placements: left there,
    # later eager DTensor calls would replicate too (seen: an unevenly sharded view that DTensor
    # rejects eagerly passed after a dist compile). Dropped when the Dynamo compile ends.
    def forget(_args=None) -> None:
        if state["substituted"]:
            _clear_dtensor_sharding_caches()
            state["substituted"] = False

    # The other way round: entries cached by eager DTensor calls before a compile would be hits
    # while Dynamo traces, so this fallback never ran for them (seen: tensor_split's eager rule
    # read tensor data under Dynamo). Dropped when any Dynamo compile starts.
    def fresh(_args=None) -> None:
        _clear_dtensor_sharding_caches()

    _keep_callbacks(callback_handler, fresh, forget)


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

def _clear_dtensor_sharding_caches() -> None:
    """DTensor's Python and C++ sharding-propagation caches (2.13: one debug helper; older
    builds: the Python LRU cache, and the C++ one where it exists)."""
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

        if not _dist_tracing():
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

    run._dynamo_dist_original = handler
    return run


def _untraceable(op, exc: Exception) -> Exception:
    """A clear error for an op Dynamo cannot trace with DTensor inputs even when replicated
    (data-dependent output shapes, Python scalars from tensors)."""
    from .errors import DistCompileError

    name = getattr(op, "op", op)
    return DistCompileError(
        f"{name} cannot be traced for the dist backend: {type(exc).__name__}: "
        f"{(str(exc).splitlines() or [''])[0][:300]}",
        op=name, fix="compute it outside the compiled region (for example when its output shape "
                     "depends on tensor values), or on plain tensors")


def _replicated_output_specs(prop, op_schema):
    """Replicated DTensorSpecs for an op's outputs, metadata from running it on fakes."""
    from torch.distributed.tensor.placement_types import Replicate

    mesh = next(s.mesh for s in pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema))
                if isinstance(s, DTensorSpec))
    reps = tuple(Replicate() for _ in range(mesh.ndim))
    meta = prop._propagate_tensor_meta_non_cached(op_schema)
    if isinstance(meta, TensorMeta):
        return DTensorSpec(mesh, reps, tensor_meta=meta)
    if isinstance(meta, (tuple, list)):
        return tuple(None if m is None else DTensorSpec(mesh, reps, tensor_meta=m) for m in meta)
    return None
