"""The one gate to torch's private APIs, for the front end and the graph passes alike.

Each entry names the torch versions it was checked on. Everything else in the project imports
these names from here, so a torch upgrade is a change to this file (and its test,
``tests/test_compat.py``), not a hunt through the tree. What this module holds reads or wraps
torch; it patches nothing. Dynamo and DTensor patches live in ``dynamo_dist/patches.py``
(installed by the backend), Inductor's in ``inductor_passes/core/inductor_fix.py``.

Checked on: torch 2.13.0 (CPU build); import also checked on 2.11.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from .errors import DistCompileError

TORCH_CHECKED = ("2.11", "2.13")

# -- FX / tracing (2.13) ------------------------------------------------------------------
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402,F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402,F401
from torch._guards import TracingContext, tracing, detect_fake_mode  # noqa: E402,F401
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols  # noqa: E402,F401

# -- Inductor (2.13) ------------------------------------------------------------------------
# compile_fx: Inductor's whole-graph entry (AOTAutograd included), for graphs that are local
# code already (compiled-autograd backwards, programs with no mesh); compile_fx_inner: one
# forward or backward graph (our joint is partitioned by us)
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402,F401
from torch._inductor.decomposition import select_decomp_table  # noqa: E402,F401
from torch._functorch.partitioners import (  # noqa: E402,F401
    default_partition, min_cut_rematerialization_partition)

# -- DTensor internals (2.13): spec classes and the strategy registry ----------------------
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402,F401
from torch.distributed.tensor._op_schema import (  # noqa: E402,F401
    OpSchema,
    OpSpec,
    OpStrategy,
    OutputSharding,
    TupleStrategy,
)
# block-strided sharding (Megatron's layout of a fused projection): on a mesh axis of size n
# the dim is k blocks, each split in n, and rank r holds piece r of every block
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: E402,F401

# -- compiled autograd (2.13): the carrier of module backward hooks -------------------------
from torch.fx.experimental._backward_state import BackwardState  # noqa: E402,F401 (hooks' carrier)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default; 2.11, 2.13)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def sharding_propagator():
    """DTensor's global ShardingPropagator (holds the per-op strategy registry)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def dtensor_custom_op_handlers() -> dict:
    """DTensor's ops run by handlers of their own instead of sharding propagation
    (convolution and its backward, as_strided, argmax, ...): op -> handler(op_call, args,
    kwargs). Replacing an entry changes eager DTensor dispatch (2.11, 2.13)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def redistribute_planner_class() -> Any:
    """DTensor's redistribute planner class (``_redistribute.DTensorRedistributePlanner``, with
    ``generate_graph_based_transform_infos`` and ``generate_greedy_transform_infos``; 2.11,
    2.13), or None."""
    from torch.distributed.tensor import _redistribute

    cls = getattr(_redistribute, "DTensorRedistributePlanner", None)
    names = ("generate_graph_based_transform_infos", "generate_greedy_transform_infos")
    return cls if cls is not None and all(hasattr(cls, n) for n in names) else None


def dtensor_rng_modules() -> tuple[Any, Any] | None:
    """(``distributed.tensor._dispatch``, ``distributed.tensor._random``) when they have what the
    tracing patch for random ops replaces: the dispatch's own ``is_rng_supported_mesh`` and the
    tracker class's ``distribute_region_enabled`` property (2.11, 2.13); else None."""
    from torch.distributed.tensor import _dispatch, _random

    tracker = getattr(_random, "_RNGStateTracker", None)
    if not hasattr(_dispatch, "is_rng_supported_mesh") or not isinstance(
            getattr(tracker, "distribute_region_enabled", None), property):
        return None
    return _dispatch, _random


def dynamo_setattr_variable() -> tuple[Any, Any] | None:
    """(Dynamo's tracker class for the ``setattr`` builtin, ``TensorVariable``) when the first
    has the hook the ``requires_grad`` setattr patch wraps, ``_call_setattr(tx, obj, name_var,
    val)`` (torch 2.13's ``SetAttrBuiltinVariable``); else None (a torch without them is
    left unpatched: the setattr stays a graph break there)."""
    from torch._dynamo.variables import builtin
    from torch._dynamo.variables.tensor import TensorVariable

    cls = getattr(builtin, "SetAttrBuiltinVariable", None)
    if cls is None or not callable(getattr(cls, "_call_setattr", None)):
        return None
    return cls, TensorVariable


try:  # 2.11 and 2.13
    from torch._library.fake_class_registry import FakeScriptObject as _FakeScriptObject
except ImportError:  # pragma: no cover - no such wrapper: nothing to unwrap
    _FakeScriptObject = ()


def real_object(value: Any) -> Any:
    """The object behind ``value`` when it is Dynamo's stand-in for an opaque object, else
    ``value``. Torch 2.13 registers DeviceMesh as an opaque type: a mesh that is a graph input
    (a closure variable of the traced code) reaches the backend, and every DTensor fakeified
    with it afterwards, as a ``FakeScriptObject`` that forwards only registered members, so
    attributes set on the real mesh (``mesh_facts``) read as absent through it."""
    return getattr(value, "real_obj", value) if isinstance(value, _FakeScriptObject) else value


def dtensor_of_local(local: torch.Tensor, spec: DTensorSpec) -> Any:
    """A DTensor over ``local`` with ``spec`` as it is (no autograd node, no check): what
    ``DTensor.from_local`` builds, without its autograd Function and spec construction, for
    the runtime's per-parameter gradients. DTensor's internal constructor (2.11, 2.13)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def dtensor_spec_key(x: Any) -> tuple[Any, int]:
    """What identifies a DTensor's spec (mesh, placements, global shape, strides, dtype) without
    reading it: the spec object and its hash, which DTensorSpec caches and recomputes on any
    such field's assignment (``DTensorSpec.__setattr__``; 2.11, 2.13). Two keys name the same,
    unchanged spec when their objects are one (``is``) and their hashes are equal."""
    spec = x._spec
    return spec, hash(spec)


def release_saved_tensors(ctx: Any) -> None:
    """Drop an autograd.Function's references to its saved tensors inside its backward, unless
    the graph is kept (``retain_graph``): what AOTAutograd's backward does before calling its
    compiled backward (``ctx.maybe_clear_saved_tensors``; 2.11, 2.13)."""
    ctx.maybe_clear_saved_tensors()


def global_stride(local: torch.Tensor, mesh: Any, placements: Any) -> tuple[int, ...]:
    """The GLOBAL strides DTensor declares for a tensor whose local piece is ``local``
    (``compute_global_tensor_info``; 2.11, 2.13)."""
    from torch.distributed.tensor._utils import compute_global_tensor_info

    return tuple(compute_global_tensor_info(local, mesh, placements)[1])


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
        from torch.distributed.tensor._ops.single_dim_strategy import \
            _expand_single_dim_strategy_to_mesh

        mesh = op_schema.get_mesh_from_args(validate=False)
        expand = _expand_single_dim_strategy_to_mesh(mesh, strategy_schema, single, out_tensor_meta)
        with _unpriced_expansion():
            return expand(op, strategy_schema.args_meta, strategy_schema.kwargs_meta)
    return func(strategy_schema)


@contextlib.contextmanager
def _unpriced_expansion():
    """DTensor's expansion of a single-mesh-dim rule to the whole mesh
    (``_ops.utils.expand_to_full_mesh_op_strategy``) prices every OpSpec's input redistributes
    with DTensor's own cost model (``generate_redistribute_costs``), which the planner never
    reads (it prices its own): 30% of planning BLOOM on dp=2 x tp=2 (2026-11-28). Inside this
    context the expansion attaches zeros; the OpStrategy comes back to us only (DTensor caches
    the expansion's closure, not its result), so DTensor's own dispatch never sees them."""
    from torch.distributed.tensor._ops import utils

    real = getattr(utils, "generate_redistribute_costs", None)
    if real is None:  # another torch: nothing to skip
        yield
        return
    utils.generate_redistribute_costs = lambda src, dst: [0.0] * len(src.strategies)
    try:
        yield
    finally:
        utils.generate_redistribute_costs = real


# -- Dynamo (2.13) ---------------------------------------------------------------------------
def assume_constant_result(fn: Callable) -> Callable:
    """Dynamo calls ``fn`` while tracing and bakes its result in as a constant (guarded)."""
    return torch._dynamo.assume_constant_result(fn)


# -- Dynamo bookkeeping read by ``explain`` (2.13) ---------------------------------------------
# Dynamo keeps every GraphCompileReason (reason text + user FrameSummary stack) of a graph break
# in a process-wide list (cleared by torch._dynamo.reset()), and one CompilationMetrics per frame
# compile (co_name/co_filename/co_firstlineno, recompile_reason, fail_reason, compile_id) in a
# bounded deque. CompileContext.current_compile_id() names the frame a backend call belongs to.
# Also read there: ``gm.compile_subgraph_reason`` (set on the graph a backend receives),
# ``exc.real_stack`` (user frames of a Dynamo exception), ``_orig_mod`` /
# ``_torchdynamo_orig_callable`` (the function behind a compiled callable).
def graph_break_reasons() -> list:
    import torch._dynamo.utils as dynamo_utils

    return list(dynamo_utils.graph_break_reasons)


def compilation_metrics() -> list:
    import torch._dynamo.utils as dynamo_utils

    return dynamo_utils.get_compilation_metrics()


def raise_compilation_metrics_limit(limit: int = 100_000) -> None:
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.set_compilation_metrics_limit(limit)


def current_compile_id() -> str | None:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return None if cid is None else str(cid)


def sdpa_takes_math_path(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False) -> bool:
    """Whether ``F.scaled_dot_product_attention`` on these (fake) tensors dispatches to its math
    path: ``torch._fused_sdp_choice`` (0 is math; checked on torch 2.11 and 2.13) asked about
    real probe tensors with the same shapes, dtypes, requires_grad and unit last-dim strides --
    under a fake mode it answers math for everything. A probe is one row expanded (no memory);
    a meta tensor is probed on the CPU, the device a meta-device plan stands for."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    from .ops import autocast_dtype

    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return False

    def probe(t):
        if not isinstance(t, torch.Tensor):
            return t
        device = "cpu" if t.device.type == "meta" else t.device
        shape = [size_hint(s) for s in t.shape]  # symbolic sizes at their hints: no guard
        # under autocast, the dtype SDPA is called with (it is on autocast's list)
        row = torch.empty((1,) * (t.dim() - 1) + tuple(shape[-1:]), dtype=autocast_dtype(t),
                          device=device, requires_grad=t.requires_grad and t.is_floating_point())
        return row.expand(shape)

    kwargs = {"scale": scale, "enable_gqa": enable_gqa} if enable_gqa else {"scale": scale}
    # a question about the call, not part of the program: nothing here is traced or faked
    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        args = [probe(t) for t in (query, key, value, attn_mask)]
        return int(torch._fused_sdp_choice(*args, dropout_p, is_causal, **kwargs)) == 0


def rng_state_ops() -> tuple[Any, Any]:
    """(``run_and_save_rng_state``, ``run_with_rng_state``): the higher-order ops AOTAutograd's
    RNG functionalization puts in a graph whose backward recomputes a random op (activation
    checkpointing): the first runs an op and returns the generator state it drew from, the
    second runs an op from a given state."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    return run_and_save_rng_state, run_with_rng_state


@contextlib.contextmanager
def checkpoint_cache_may_be_mutated():
    """Inside: a checkpointed region traced for compile (``tag_activation_checkpoint``, whose
    vanilla form is selective checkpointing that caches every op's output for the recompute)
    accepts a cached output that a later op of the region mutated in place. AOTAutograd
    traces functionalized, so no version counter moves; capture traces the ops as they are
    (functionalized afterwards), and CPU dropout is ``empty_like().bernoulli_().div_()``: the
    recompute raised "Tensor cached during selective activation checkpoint has been mutated".
    The trace reads the mutated tensor through its latest node, so the value is right."""
    from torch.utils import checkpoint

    cls = checkpoint._CachedTorchDispatchMode
    init = cls.__init__

    def allowing(self, policy_fn, storage, allow_cache_entry_mutation=False):
        init(self, policy_fn, storage, True)

    cls.__init__ = allowing
    try:
        yield
    finally:
        cls.__init__ = init


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) for each device type autocast is on for in this thread."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in torch._C._autocast_supported_devices()
                 if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]):
    """Autocast on for exactly the (device type, dtype) pairs of ``state`` (an
    ``autocast_state()``) inside, off for every other device type. Flags, not a dispatch-key
    guard: a ``torch.autocast`` entered inside still takes effect (capture re-enters the
    user's state within a compile that runs with autocast off)."""
    with contextlib.ExitStack() as stack:
        for device, _ in autocast_state():
            stack.enter_context(torch.autocast(device, enabled=False))
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def autocast_disabled() -> contextlib.AbstractContextManager:
    """Autocast off for the ops run inside, whatever the caller set (a dispatch-key guard,
    cheap enough for every call of a compiled program): a traced program's casts are explicit
    ops, and autocast applied again would cast what the user ran in an
    ``autocast(enabled=False)`` region. AOTAutograd runs its compiled programs under it too."""
    return torch._C._DisableAutocast()


def preserve_backward_stack_traces(grad_fns: list) -> None:
    """Autograd hooks that give each backward node the forward node's stack trace while a joint
    graph is traced (AOTAutograd's own mechanism; checked on torch 2.11 and 2.13)."""
    from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks

    setup_stacktrace_preservation_hooks([g for g in grad_fns if g is not None])


# grad_fn.metadata key: the module stack (Dynamo's ``nn_module_stack``) of the forward node
# that made the grad_fn
_MODULE_STACK = "dynamo_dist_nn_module_stack"


def tag_grad_fns(tensors, module_stack) -> None:
    """Record ``module_stack`` on every grad_fn the forward just made for ``tensors`` (a walk
    from their grad_fns that stops at grad_fns already recorded, so each is visited once).
    ``preserve_backward_module_stacks`` gives the backward nodes traced from them that stack.
    Public autograd API (``Node.metadata``)."""
    todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or _MODULE_STACK in fn.metadata:
            continue
        fn.metadata[_MODULE_STACK] = module_stack
        todo.extend(f for f, _ in fn.next_functions)


def preserve_backward_module_stacks(grad_fns: list) -> None:
    """Autograd hooks that give each backward node traced under ``preserve_node_meta`` the
    ``nn_module_stack`` of the forward node that made its grad_fn (``tag_grad_fns``), as
    AOTAutograd's ``copy_fwd_metadata_to_bw_nodes`` does after tracing (its ``seq_nr`` key is
    not set by our trace). A grad_fn with no record leaves the stack as it was. Writes
    ``torch.fx.traceback.current_meta`` (checked on torch 2.11 and 2.13)."""
    import torch.fx.traceback as fx_traceback

    saved: list = []
    missing = object()

    def prehook(fn):
        def hook(grad_outputs):
            meta = fx_traceback.current_meta
            saved.append(meta.get("nn_module_stack", missing))
            stack = fn.metadata.get(_MODULE_STACK)
            if stack is not None:
                meta["nn_module_stack"] = stack
        return hook

    def posthook(grad_inputs, grad_outputs):
        if not saved:
            return
        meta, previous = fx_traceback.current_meta, saved.pop()
        if previous is missing:
            meta.pop("nn_module_stack", None)
        else:
            meta["nn_module_stack"] = previous

    seen: set = set()
    todo = [g for g in grad_fns if g is not None]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        fn.register_prehook(prehook(fn))
        fn.register_hook(posthook)
        todo.extend(f for f, _ in fn.next_functions if f is not None)


log = logging.getLogger("dynamo_dist")


# -- compiled autograd (2.13; BackwardState above) --------------------------------------------
def compiled_autograd_id() -> int | None:
    """The compiled-autograd graph id of the Dynamo compile in progress (None: not one)."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return getattr(cid, "compiled_autograd_id", None) if cid is not None else None


def compiled_autograd_disabled():
    """Context manager: compiled autograd off inside it (AOTAutograd does the same while it
    traces a joint graph)."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd._disable()


# -- c10d (2.13, 2.11) -----------------------------------------------------------------------
def resolve_process_group(name: str):
    """The ProcessGroup registered under ``name`` (functional collectives name groups so).
    Raises when no group has that name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def default_store():
    """The default process group's key-value store (used to compare ranks' compiled programs)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# -- Local tensor simulation (2.13) ----------------------------------------------------------
def disable_local_tensor_mode() -> contextlib.AbstractContextManager:
    """A backend must not run its own tracing under LocalTensorMode (it would recurse)."""
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # torch 2.11 has no LocalTensorMode
        return contextlib.nullcontext()
    return maybe_disable_local_tensor_mode()


def local_tensor_mode_active() -> bool:
    """Whether an enabled LocalTensorMode (simulated ranks in one process) is on (2.11, 2.13)."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:
        return False
    return enabled_local_tensor_mode() is not None


def holds_local_tensors(module: torch.nn.Module) -> bool:
    """Whether a parameter or buffer of ``module`` is a LocalTensor, or a DTensor over one (the
    values of simulated ranks; 2.13)."""
    try:
        from torch.distributed._local_tensor import LocalTensor
    except ImportError:  # torch 2.11 has no LocalTensorMode
        return False
    for t in (*module.parameters(), *module.buffers()):
        if isinstance(getattr(t, "_local_tensor", t), LocalTensor):
            return True
    return False


def local_tensor_rng_states() -> dict[int, torch.Tensor] | None:
    """Rank -> CPU generator state of the enabled LocalTensorMode (2.13: each simulated rank
    draws from its own state, set from the global one when the mode is entered or seeded), or
    None when no mode (or no per-rank state) is on."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:
        return None
    mode = enabled_local_tensor_mode()
    states = getattr(mode, "_per_rank_rng_states", None)
    return {r: s[0] for r, s in states.items()} if states else None


def set_local_tensor_rng_states(states: dict[int, torch.Tensor]) -> None:
    """Give the enabled LocalTensorMode's ranks these CPU generator states (their other
    devices' states kept), as its own ops leave them after a draw."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    for r, cpu in states.items():
        old = mode._per_rank_rng_states.get(r, (None, {}))
        mode._per_rank_rng_states[r] = (cpu, old[1])


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


def dist_tracing() -> bool:
    """Dynamo is tracing (fake values, possibly a proxy) a frame for the ``dist`` backend."""
    from torch.distributed._functional_collectives import _are_we_tracing

    return _are_we_tracing() and dist_backend_is_tracing()


def _current_tx():
    """Dynamo's translator of the frame it is compiling, or None outside a trace (2.11, 2.13)."""
    from torch._dynamo import symbolic_convert

    return getattr(symbolic_convert.tls, "current_tx", None)


def dist_backend_is_tracing() -> bool:
    """True while Dynamo traces a frame for the ``dist`` backend (not for any other backend)."""
    return is_dist_compiler(getattr(getattr(_current_tx(), "output", None), "compiler_fn", None))


def is_dist_compiler(fn) -> bool:
    """``fn`` (a compiler function as Dynamo holds it) is the ``dist`` backend."""
    return any(getattr(f, "_dynamo_dist_backend", False) for f in _compiler_chain(fn))


def _compiler_chain(fn):
    """``fn`` and what it wraps: Dynamo's debug wrapper, torch.compile's options wrapper
    (``_TorchCompileWrapper``), the backend function (the unwrapping ``is_dist_compiler`` did
    before: 2.11, 2.13)."""
    for _ in range(8):
        if fn is None:
            return
        yield fn
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)


def wrap_frame_compile(wrap: Callable) -> bool:
    """Replace Dynamo's compile of one frame (``convert_frame._compile``: its trace, the
    backend's call and its guards) by ``wrap(original, compiler_fn, args, kwargs)``. Idempotent
    per ``wrap``; False where Dynamo has no such function or it takes no ``compiler_fn`` (the
    argument is found by name; checked on torch 2.13)."""
    import functools
    import inspect

    from torch._dynamo import convert_frame

    original = getattr(convert_frame, "_compile", None)
    if original is None:
        return False
    if wrap in getattr(original, "_dynamo_dist_wraps", ()):
        return True
    try:
        slot = list(inspect.signature(original).parameters).index("compiler_fn")
    except (ValueError, TypeError):
        return False

    @functools.wraps(original)
    def _compile(*args, **kwargs):
        fn = kwargs["compiler_fn"] if "compiler_fn" in kwargs else \
            args[slot] if len(args) > slot else None
        return wrap(original, fn, args, kwargs)

    _compile._dynamo_dist_wraps = (*getattr(original, "_dynamo_dist_wraps", ()), wrap)
    convert_frame._compile = _compile
    return True


def dynamo_frame_file() -> str | None:
    """The file of the frame Dynamo is compiling (the backend runs inside its trace), or None
    outside one (2.11, 2.13)."""
    return getattr(getattr(_current_tx(), "f_code", None), "co_filename", None)


def dynamo_frame_locals() -> dict | None:
    """The locals of the frame Dynamo is compiling (the backend runs inside its trace), or None
    outside one: the roots Dynamo's sources and module paths start from (``L['self']``)
    (2.13)."""
    found = getattr(_current_tx(), "f_locals", None)
    return found if isinstance(found, dict) else None


def graph_input_value(node: "torch.fx.Node") -> Any:
    """The real value a placeholder of a Dynamo graph was read from (a parameter is the
    ``nn.Parameter`` itself), or None where Dynamo recorded none (``meta["grapharg"]``,
    2.13)."""
    arg = node.meta.get("grapharg")
    try:
        return None if arg is None else arg.example
    except Exception:  # noqa: BLE001 (a dead weak reference, an argument with no example)
        return None


def module_at_path(path: str, frame_locals: dict) -> Any:
    """The module an ``nn_module_stack`` entry's path names (``L['self'].model.layers.2``, or
    ``L['args'][0].model.layers.2`` where the compiled frame is a wrapper taking ``*args``: a
    local of the compiled frame, then attribute names and subscripts), or None where it does
    not resolve (2.13's spelling)."""
    import re

    found = re.match(r"L\[(['\"])(.+?)\1\]", path)
    if found is None or found.group(2) not in frame_locals:
        return None
    obj, rest = frame_locals[found.group(2)], path[found.end():]
    step = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[(['\"])(.+?)\3\]")
    while rest:
        m = step.match(rest)
        if m is None:
            return None
        try:
            obj = getattr(obj, m.group(1)) if m.group(1) is not None else \
                obj[int(m.group(2))] if m.group(2) is not None else obj[m.group(4)]
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        rest = rest[m.end():]
    return obj


def data_dependent(op, args, kwargs) -> bool:
    """Whether ``op`` on these arguments has an output shape (or a Python value) that depends on
    tensor DATA, which a plan made at compile time cannot know.

    ``args``/``kwargs``: the op's arguments; tensors may be DTensorSpecs, tensors or FX nodes
    (anything with a dtype: ``tensor_meta.dtype``, ``dtype`` or ``meta["val"].dtype``).
    Ops tagged ``data_dependent_output`` (allclose, equal, item) always are. Of those tagged
    ``dynamic_output_shape``, three are data dependent only for some arguments (torch 2.13's
    fake tensors give them a static shape otherwise: ``_subclasses/fake_impls.py`` excludes
    index.Tensor, nonzero and repeat_interleave.Tensor from its blanket ``dyn_shape`` rule,
    and ``meta_index_Tensor`` calls nonzero only on boolean/byte masks):

    - ``aten.index.Tensor``: only with a bool/uint8 mask among the indices (``x[perm]`` with
      integer indices has the indices' shape);
    - ``aten.repeat_interleave.Tensor``: only without ``output_size``;
    - ``aten.nonzero``: always.
    """
    if torch.Tag.data_dependent_output in op.tags:
        return True
    if torch.Tag.dynamic_output_shape not in op.tags:
        return False
    aten = torch.ops.aten
    if op is aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(_dtype_of(i) in (torch.bool, torch.uint8) for i in indices if i is not None)
    if op is aten.repeat_interleave.Tensor:
        return (kwargs.get("output_size") if len(args) < 3 else args[2]) is None
    return True


def _dtype_of(x):
    meta = getattr(x, "tensor_meta", None)
    if meta is not None:
        return meta.dtype
    if hasattr(x, "meta") and isinstance(getattr(x, "meta"), dict):  # an FX node
        return getattr(x.meta.get("val"), "dtype", None)
    return getattr(x, "dtype", None)


# how to write each data-dependent op with a static shape (the fix of its error)
STATIC_FIX = {
    "index": "boolean-mask indexing x[mask] has as many rows as mask has True values: keep "
             "the shape with torch.where(mask[..., None], x, 0), or index with integer "
             "indices of a fixed count (topk/sort/argsort results)",
    "masked_select": "use torch.where(mask, x, 0) (same shape as x)",
    "nonzero": "use torch.nonzero_static(x, size=N, fill_value=-1), or a mask with torch.where "
               "(a mixture of experts' token dispatch: a static-shape experts path, e.g. "
               "transformers' experts_implementation=\"grouped_mm\" or \"batched_mm\")",
    "argwhere": "use torch.nonzero_static(x, size=N, fill_value=-1)",
    "bincount": "use torch.histc(x.float(), bins=N, min=0, max=N - 1), or "
                "torch.zeros(N).scatter_add_(0, x, torch.ones_like(x, dtype=torch.float))",
    "repeat_interleave": "pass output_size= (the total number of repeats) so the shape is known",
    "unique": "compute it outside the compiled region; unique has no static-shape form",
    "unique_consecutive": "compute it outside the compiled region",
    "_local_scalar_dense": "keep the value a tensor (x.item(), x.tolist(), int(x) read a number "
                           "the plan cannot know), or compute it outside the compiled region",
    "_unique2": "compute it outside the compiled region; unique has no static-shape form",
}


# what fake tensors raise for an op whose output shape or value depends on tensor data
DATA_DEPENDENT_ERRORS = (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                         torch._subclasses.fake_tensor.DataDependentOutputException)


def data_dependent_error(op, source: str | None = None) -> Exception:
    """The DistCompileError for a data-dependent ``op`` (an OpOverload, or None) met while the
    backend traces plain tensors: the op, the user's line ``source`` and its static-shape form."""

    name = op._schema.name.split("::")[-1] if hasattr(op, "_schema") else ""
    return DistCompileError(
        f"{op} cannot be compiled for the dist backend: its output depends on tensor data "
        f"(data-dependent shape or value), which a plan made at compile time cannot know",
        op=op, source=source,
        fix=STATIC_FIX.get(name, "compute it outside the compiled region, or write it with a "
                                 "static output shape"))



# -- Inductor's FX collective bucketing (torch._inductor.fx_passes.bucketing, 2.11 and 2.13) ---
# per kind: the bucketing module's test for the collective's node, its grouping key, its merge
# of one bucket. Inductor's own order: all_gather last, since its merge introduces a mutation
_BUCKETERS = (
    ("reduce_scatter", "is_reduce_scatter_tensor", "_rs_group_key",
     "merge_reduce_scatter_bucket"),
    ("all_reduce", "is_all_reduce_tensor", "_ar_group_key", "merge_all_reduce_bucket"),
    ("all_gather", "is_all_gather_into_tensor", "_ag_group_key", "merge_all_gather_bucket"),
)


def _bucketing_module():
    """torch's bucketing module when it has every function ``bucket_collectives`` uses, else
    None."""
    from torch._inductor.fx_passes import bucketing

    names = ["greedy_bucket_collective_by_mb"]
    for _, test, key, merge in _BUCKETERS:
        names += [test, key, merge]
    return bucketing if all(hasattr(bucketing, n) for n in names) else None


# Inductor's bucketing functions are used from torch 2.13 on: torch 2.11 has them too, but the
# zoo's BERT on dp=2 x tp=2 trained with them to gradients 47% off one process (parity with
# bucketing off, and on 2.13), so they are not trusted there
BUCKETING_FROM = "2.13"


def can_bucket() -> bool:
    """Whether this torch has the bucketing functions ``bucket_collectives`` uses, in a release
    they are trusted in (``BUCKETING_FROM``)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= BUCKETING_FROM and \
        _bucketing_module() is not None


def find_buckets(gm: "torch.fx.GraphModule", cap_mb_by_bucket: Callable[[int], float],
                 extra_key: Callable[["torch.fx.Node"], Any]
                 ) -> dict[str, list[list["torch.fx.Node"]]]:
    """Per kind, the buckets (collective nodes, two or more) of ``gm``: Inductor's greedy
    grouping (runs, in graph order, of one group, reduce op and dtype, with no path between
    members, up to the cap in MiB by bucket index), with ``extra_key(node)`` as one more part of
    the group. Reads the graph, changes nothing; empty when this torch lacks the functions."""
    bucketing = _bucketing_module()
    if bucketing is None:
        return {}
    return {kind: _find(bucketing, gm, cap_mb_by_bucket, test, key, extra_key)
            for kind, test, key, _ in _BUCKETERS}


def _find(bucketing, gm, cap_mb_by_bucket, test: str, key: str, extra_key) -> list:
    """One kind's buckets (see ``find_buckets``)."""
    base = getattr(bucketing, key)
    return bucketing.greedy_bucket_collective_by_mb(
        gm, cap_mb_by_bucket, getattr(bucketing, test), lambda n: (base(n), extra_key(n)))


# Inductor's merge mode that copies a bucket's inputs into its flat buffer eagerly, in one
# custom op per bucket (``bucketing::_pre_bucket_reduce_scatter`` / ``_pre_bucket_all_gather``:
# a ``cat`` / ``_foreach_copy_``, as FSDP2 copies in), rather than in generated kernels: one
# kernel per input shape and offset, each compiled. The custom ops read any strides.
EAGER_COPY_IN_MODE = "custom_ops"


def eager_copy_in_ops() -> tuple:
    """The custom ops that copy a bucket's inputs in under ``EAGER_COPY_IN_MODE``: their first
    argument is the list of the bucket's inputs."""
    if _bucketing_module() is None:  # (importing it registers ``torch.ops.bucketing``)
        return ()
    ops = torch.ops.bucketing
    return tuple(getattr(ops, name).default for name in
                 ("_pre_bucket_reduce_scatter", "_pre_bucket_all_gather") if hasattr(ops, name))


def bucket_collectives(gm: "torch.fx.GraphModule", cap_mb_by_bucket: Callable[[int], float],
                       extra_key: Callable[["torch.fx.Node"], Any]) -> None:
    """Merge the buckets ``find_buckets`` forms, kind by kind in Inductor's order, with
    Inductor's own merge functions (one collective over a flat buffer per bucket; inputs copied
    in eagerly, ``EAGER_COPY_IN_MODE``). A bucket's wait goes where its members' first wait was
    when that is after its last member (a gather issued a layer early, ``prefetch``, is still
    waited for where the layer starts); else right after the merged collective, as Inductor
    places it."""
    bucketing = _bucketing_module()
    for _, test, key, merge in _BUCKETERS:
        # found again after each kind's merge: the graph changed
        for bucket in _find(bucketing, gm, cap_mb_by_bucket, test, key, extra_key):
            getattr(bucketing, merge)(gm.graph, bucket, mode=EAGER_COPY_IN_MODE,
                                      wait_insertion_point=_first_wait_after(gm, bucket))
    # a merged collective sits where its first member was; users of a later member's inputs
    # may come before it (Inductor's own bucketing sorts the same way after merging)
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(gm.graph)
    gm.graph.lint()


def _first_wait_after(gm: "torch.fx.GraphModule", bucket: list["torch.fx.Node"]
                      ) -> "torch.fx.Node | None":
    """The first wait of ``bucket``'s members in graph order, when it comes after the last
    member; else None."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    waits = [u for n in bucket for u in n.users]
    first = min(waits, key=order.__getitem__)
    return first if order[first] > max(order[n] for n in bucket) else None


def post_grad_pass(fn: Callable[["torch.fx.Graph"], None], uuid: Any) -> dict:
    """Inductor config entries that run ``fn`` on every graph Inductor compiles (subgraph
    bodies included) after its post-grad passes and before its own bucketing, as
    ``post_grad_custom_post_pass``, after a user's pass there. ``uuid`` goes into the FX graph
    cache key: it must change whenever ``fn`` would rewrite a graph differently."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    user = config.post_grad_custom_post_pass  # one pass, or (2.13) a list of them
    users = tuple(user) if isinstance(user, (list, tuple)) else (user,) if user else ()

    class _Pass(CustomGraphPass):
        def __call__(self, graph):
            for user in users:
                user(graph)
            fn(graph)

        def uuid(self):
            theirs = tuple(u.uuid() if isinstance(u, CustomGraphPass) else None for u in users)
            # a user's pass without a uuid keeps Inductor's cache off, as it would alone
            return None if None in theirs else ("dynamo_dist", uuid, theirs)

    return {"post_grad_custom_post_pass": _Pass()}


def joint_graph_passes(gm: "torch.fx.GraphModule") -> None:
    """Inductor's joint-graph passes on ``gm`` in place: what Inductor's own partition step runs
    before the min-cut partitioner (canonicalisation, no-op removal, uniform-constant folding,
    its pattern rewrites: a scatter into a constant becomes a pointwise select that fuses), so
    a program partitioned here is rewritten as torch.compile's would be. Random draws are left
    as they are (``fallback_random``): the planner made every draw whole on each rank, in
    ATen's stream, for one-device numerics."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes as run

    # a rewrite traces its replacement: its factories (an iota) must make fakes of this graph
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")])
    with config.patch(fallback_random=True), mode or contextlib.nullcontext():
        run(gm)


def mark_must_save(node: "torch.fx.Node") -> None:
    """Tag a joint-graph node so the min-cut partitioner saves it for the backward rather than
    recompute it (the tag activation checkpointing's policies set)."""
    from torch.utils.checkpoint import CheckpointPolicy

    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def functorch_config_patch(**entries) -> contextlib.AbstractContextManager:
    from torch._functorch import config

    return config.patch(**{k: v for k, v in entries.items() if hasattr(config, k)})


def dynamo_settings_for_dist() -> contextlib.AbstractContextManager:
    """A context in which Dynamo specialises Python ints and floats (a new value recompiles)
    whatever ``dynamic=`` says; tensor sizes follow ``dynamic=`` as usual (checked on torch
    2.11 and 2.13), and traces ``backward()`` into the program (a whole training step)."""
    from torch._dynamo import config

    # trace_autograd_ops: ``loss.backward()`` inside a compiled function is traced into the
    # program (as autograd.grad + the .grad updates) instead of splitting it (torch 2.13;
    # absent in 2.11, where the step splits at backward as before)
    return config.patch(specialize_int=True, specialize_float=True,
                        **({"trace_autograd_ops": True} if hasattr(config, "trace_autograd_ops")
                           else {}))


def node_annotation(entries: dict) -> contextlib.AbstractContextManager:
    """Nodes traced (make_fx under ``preserve_node_meta``) inside this context carry ``entries``
    in ``node.meta["custom"]`` (``torch.fx.traceback.annotate``; 2.11, 2.13)."""
    return torch.fx.traceback.annotate(entries)


def reported_output_strides():
    """Context manager yielding the list Inductor fills, on leaving ``compile_fx_inner``, with the
    strides its compiled graph gives each output (None where unknown). Layout optimisation (a
    channels-last convolution on CPU) may choose other strides than the FX graph traced; the
    backward must be compiled for the strides the forward really saves (AOTAutograd does this
    in ``_aot_stage2b_bw_compile``). Needs an active ``tracing`` context. (2.11, 2.13)"""
    return TracingContext.report_output_strides()


# Inductor keeps the traced strides only for outputs listed under this key of the output node's
# meta ("user-visible"; compile_fx_forward/backward set it, compile_fx_inner does not). (2.13)
USER_VISIBLE_OUTPUTS_META = "user_visible_output_idxs"


def pick_cpu_vec_isa():
    """Inductor's choice of the CPU's vector ISA (``torch._inductor.cpu_vec_isa.pick_vec_isa``,
    checked on 2.13): the first call in a process builds and loads a probe per candidate ISA
    (g++ and a Python child each; kept in Inductor's cache directory), later calls read
    ``functools`` caches. Raises what Inductor raises (ImportError where torch lacks it)."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa.pick_vec_isa()


def python_wrapper_codegen():
    """Inductor's Python wrapper code generator class
    (``torch._inductor.codegen.wrapper.PythonWrapperCodegen``, checked on 2.13; None where torch
    has no such class): its ``define_kernel(name, body, ...)`` writes ``name = body`` into a
    graph's wrapper module."""
    try:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    except ImportError:
        return None
    return PythonWrapperCodegen


def async_compile():
    """A new ``torch._inductor.async_compile.AsyncCompile``: what a wrapper module names
    ``async_compile`` (checked on 2.13)."""
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile()


def wait_for_kernels(waiter, scope: dict) -> None:
    """Bind each kernel build still pending in ``scope`` (a wrapper module's globals) to its
    result, as ``AsyncCompile.wait`` does (``_wait_futures``, checked on 2.13); raises a failed
    build's error."""
    type(waiter)._wait_futures(waiter, scope)


@contextlib.contextmanager
def kernels_left_pending(waiter):
    """Inside, ``waiter.wait(scope)`` (an ``AsyncCompile``) does its bookkeeping but binds no
    kernel: its ``_wait_futures`` is shadowed on the instance (checked on 2.13)."""
    waiter._wait_futures = lambda scope: None
    try:
        yield
    finally:
        del waiter._wait_futures


def can_leave_kernels_pending() -> bool:
    """Whether ``AsyncCompile`` has the ``wait`` / ``_wait_futures`` pair the two functions
    above rely on."""
    from torch._inductor.async_compile import AsyncCompile

    return callable(getattr(AsyncCompile, "wait", None)) and \
        callable(getattr(AsyncCompile, "_wait_futures", None))


def inductor_compiles_async() -> bool:
    """Whether Inductor builds kernels on its compile threads (more than one), not in the
    calling thread (``async_compile.get_compile_threads``, checked on 2.13; False where torch
    has no such function)."""
    try:
        from torch._inductor.async_compile import get_compile_threads
    except ImportError:
        return False
    return get_compile_threads() > 1


def compile_options(compiler_fn) -> dict:
    """The ``options`` ``torch.compile`` hands a backend with ``compiler_fn`` (as Dynamo holds
    it: its debug wrapper around ``_TorchCompileWrapper``, whose ``kwargs`` carry them); {} when
    there are none (checked on 2.13)."""
    for fn in _compiler_chain(compiler_fn):
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and isinstance(kwargs.get("options"), dict):
            return kwargs["options"]
    return {}


def inductor_config_patch(entries: dict) -> contextlib.AbstractContextManager:
    from torch._inductor import config

    return config.patch(entries) if entries else contextlib.nullcontext()


def lazy_graph_modules() -> contextlib.AbstractContextManager:
    """Graph modules made inside (``graph_module`` below, and torch's partitioner's) generate
    their Python code only when it is read or run, as in Inductor's own compile (torch's
    ``_LazyGraphModule``; checked on 2.13). The partitioned halves, their copies and the
    per-layer graphs are rewritten and handed to Inductor, which never runs their code: at 32
    layers of the demo-width Llama their code generation was about 1.6 s of the compile."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def graph_module(root, graph: "torch.fx.Graph") -> "torch.fx.GraphModule":
    """``fx.GraphModule(root, graph)``, lazy inside ``lazy_graph_modules``."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module
    except ImportError:
        return torch.fx.GraphModule(root, graph)
    return _make_graph_module(root, graph)


def as_lazy(gm: "torch.fx.GraphModule") -> "torch.fx.GraphModule":
    """``gm`` as a lazy graph module (``lazy_graph_modules``): ``gm`` itself, marked for a
    new code generation, where it is one; otherwise a new one over the same graph, holding the
    attributes its nodes name and ``gm.meta``. Callers use the result in place of ``gm``."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        gm.recompile()
        return gm
    if isinstance(gm, _LazyGraphModule):
        gm.recompile()
        return gm
    new = _LazyGraphModule(gm, gm.graph)
    new.meta.update(gm.meta)
    return new


def fast_region_fingerprints(active: Callable[[], bool]) -> bool:
    """Dynamo's fingerprint of a region call's arguments (``invoke_subgraph``'s reuse lookup)
    built in Python while ``active()``: the argument containers (tuples, lists, plain dicts
    with constant keys) are walked as variable trackers and flattened by torch's pytree, which
    gives the spec Dynamo's own path gets by tracing ``pytree.tree_flatten`` through its
    interpreter. That trace was about 48 ms a layer call on transformers' decoder layers
    (keyword arguments and the rotary ``(cos, sin)`` tuple): 1.5 s of a 32-layer trace. Any
    other argument (a custom class, an unknown leaf) takes Dynamo's path. Idempotent; False
    where this torch lacks the function (checked on 2.13)."""
    try:
        from torch._dynamo.variables import invoke_subgraph as isg
    except ImportError:
        return False
    original = getattr(isg, "build_fingerprint_with_pytree", None)
    if original is None or not hasattr(isg, "InputFingerprint") or \
            not hasattr(isg, "classify_vt"):
        return False
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    import functools

    @functools.wraps(original)
    def build(tx, fn_args_vt, kwargs):
        if active():
            fingerprint = _fingerprint_in_python(isg, fn_args_vt, kwargs)
            if fingerprint is not None:
                return fingerprint
        return original(tx, fn_args_vt, kwargs)

    build._dynamo_dist_patch = True
    isg.build_fingerprint_with_pytree = build
    return True


class _NotFlat(Exception):
    """An argument the Python fingerprint does not take."""


def region_arguments_plain(args: list, kwargs: dict) -> bool:
    """Whether a call's arguments (Dynamo's variable trackers) are tensors, numbers, constants
    and modules, or tuples, lists and plain dicts of them: what a region's reuse can compare
    (``fast_region_fingerprints``). A Python object (transformers' KV cache, which each layer
    updates in place) is not (checked on 2.13)."""
    try:
        from torch._dynamo.variables import invoke_subgraph as isg
    except ImportError:
        return False
    return _fingerprint_in_python(isg, args, kwargs) is not None


def _fingerprint_in_python(isg, fn_args_vt, kwargs):
    """``isg.InputFingerprint`` of ``(list(fn_args_vt), kwargs)``, or None (see
    ``fast_region_fingerprints``)."""
    from torch._dynamo.variables.dicts import ConstDictVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker
    from torch._dynamo.variables.lists import ListVariable, TupleVariable
    from torch.utils import _pytree as pytree

    leaves: list = []

    class _Leaf:  # a placeholder pytree takes as a leaf; it names its tracker by position
        __slots__ = ("i",)

        def __init__(self, i: int) -> None:
            self.i = i

    def skeleton(vt):
        if isinstance(vt, LazyVariableTracker):
            vt = vt.realize()
        if type(vt) is TupleVariable:
            return tuple(skeleton(v) for v in vt.items)
        if type(vt) is ListVariable:
            return [skeleton(v) for v in vt.items]
        if type(vt) is ConstDictVariable and getattr(vt, "user_cls", dict) is dict:
            out = {}
            for key, value in vt.items.items():
                k = getattr(key, "vt", None)
                if k is None or not k.is_python_constant():
                    raise _NotFlat
                out[k.as_python_constant()] = skeleton(value)
            return out
        tag = isg.classify_vt(vt)
        if tag is None:
            raise _NotFlat
        leaves.append((tag, vt))
        return _Leaf(len(leaves) - 1)

    try:
        tree = ([skeleton(v) for v in fn_args_vt], {k: skeleton(v) for k, v in kwargs.items()})
    except _NotFlat:
        return None
    flat, spec = pytree.tree_flatten(tree)
    flat_vts = [leaves[leaf.i] for leaf in flat]
    return isg.InputFingerprint(flat_vts, [getattr(vt, "source", None) for _, vt in flat_vts],
                                False, spec)


def inline_nested_compile_regions(gm: "torch.fx.GraphModule") -> "torch.fx.GraphModule":
    """``gm`` with every ``invoke_subgraph`` (a ``torch.compiler.nested_compile_region`` call)
    replaced by its body, nested regions included, through torch's own pass
    (``torch._higher_order_ops.passes.inline_invoke_subgraph``, checked on torch 2.13). The
    planner then sees the body's ops and plans them like any other code; without this it had
    no rule for the higher-order op and ran every region replicated, all-gathering its
    parameters. A copy: Dynamo's graph and its region bodies are left as they were. Returns
    ``gm`` itself when it has no region. Raises ``DistCompileError`` on a torch without the
    pass (2.11)."""
    import copy

    import torch.fx as fx

    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    calls = 0 if hop is None else sum(
        len(m.graph.find_nodes(op="call_function", target=hop))
        for m in gm.modules() if isinstance(m, fx.GraphModule))
    if not calls:
        return gm
    try:
        from torch._higher_order_ops.passes.inline_invoke_subgraph import (
            inline_invoke_subgraph, inline_invoke_subgraph_nodes)
    except ImportError as e:

        raise DistCompileError(
            f"torch {torch.__version__} has no pass to inline nested_compile_region bodies",
            fix="remove torch.compiler.nested_compile_region, or use torch 2.13") from e
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    root = fx.GraphModule(gm, graph)
    for name, child in gm.named_children():  # the pass edits region bodies in place
        if isinstance(child, fx.GraphModule):
            setattr(root, name, copy.deepcopy(child))
            inline_invoke_subgraph(getattr(root, name))  # regions nested in a body first
    for node in list(root.graph.find_nodes(op="call_function", target=hop)):
        before = set(root.graph.nodes)
        body = getattr(root, str(node.args[0].target))
        call_stack = node.meta.get("nn_module_stack")
        inline_invoke_subgraph_nodes(root, [node])
        _restack([n for n in root.graph.nodes if n not in before], body, call_stack)
    root.delete_all_unused_submodules()
    root.recompile()
    logging.getLogger("dynamo_dist").info(
        "dynamo_dist: %d nested_compile_region call(s) inlined: their bodies are planned and "
        "compiled with the rest of the program (each call compiled again)", calls)
    return root


def _restack(nodes: list, body, call_stack: dict | None) -> None:
    """Give a region body's inlined ``nodes`` the module stack of the call they came from.
    Dynamo traced the body once, at its first call, so every copy says it was made by that
    call's module (``model.layers.0``); the stack prefix of that first call is swapped for this
    call's (its entries' paths re-prefixed), so each layer's copy names its own layer (read by
    ``inductor_passes.outline``). Nodes whose stack does not start with the traced call's are
    left as they are."""
    if not call_stack:
        return
    stacks = [n.meta.get("nn_module_stack") for n in body.graph.nodes
              if n.meta.get("nn_module_stack")]
    if not stacks:
        return
    depth = len(call_stack)
    traced = list(stacks[0].items())[:depth]
    if len(traced) < depth:
        return
    old_path, new_path = traced[-1][1][0], list(call_stack.values())[-1][0]
    for node in nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack or list(stack.items())[:depth] != traced:
            continue
        restacked = dict(call_stack)
        for key, (path, *info) in list(stack.items())[depth:]:
            if path.startswith(old_path):
                key, path = f"{key}@{new_path}", new_path + path[len(old_path):]
            restacked[key] = (path, *info)
        node.meta["nn_module_stack"] = restacked


def size_hint(value: "int | torch.SymInt", fallback: int = 0) -> int:
    """A concrete value for a size that may be symbolic, for estimates only (no guard added):
    the partitioner's saved RNG state of a checkpointed region (``run_and_save_rng_state``) has
    a symbolic length. ``fallback`` where there is no hint (checked on torch 2.13; 2.11 reads
    the node's own hint)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(value, fallback=fallback))
    except ImportError:
        hint = getattr(value.node, "hint", None)
        return int(hint) if hint is not None else fallback


def static_size(size: "int | torch.SymInt") -> int | None:
    """``size`` as an int where it is one or its ShapeEnv has fixed it (a guard made it
    equal to a number), else None (checked on torch 2.11 and 2.13)."""
    if isinstance(size, int):
        return size
    return size.node.maybe_as_int()


def fixed_size(size):
    """``size`` as an int where it is one or a guard has fixed it (``static_size``), else
    ``size`` itself (a symbolic size, or anything that is not a size)."""
    if not isinstance(size, torch.SymInt):
        return size
    n = static_size(size)
    return size if n is None else n


def has_symbolic_shape(t: torch.Tensor) -> bool:
    return any(static_size(s) is None for s in t.shape)


def guard_equal(size: "torch.SymInt", value: int) -> None:
    """Guard ``size == value`` in its ShapeEnv: Dynamo, which owns that ShapeEnv, re-checks it
    on every call and recompiles when it fails (checked on torch 2.11 and 2.13)."""
    if not bool(size == value):  # bool() of a symbolic comparison records it as a guard
        raise AssertionError(f"{size} is not {value} where it was traced")


def guard_divisible(size: "torch.SymInt", n: int) -> None:
    """Guard ``size % n == 0`` in its ShapeEnv (a Dynamo guard, re-checked per call: a size that
    is not a multiple recompiles; checked on torch 2.11 and 2.13)."""
    if not bool(size % n == 0):
        raise AssertionError(f"{size} is not a multiple of {n} where it was traced")


def fresh_size_env() -> FakeTensorMode:
    """A fake mode with a ShapeEnv of its own (sizes made there never guard Dynamo's)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def new_size(mode: FakeTensorMode, hint: int, name: str) -> "torch.SymInt | int":
    """A new backed symbolic size in ``mode``'s ShapeEnv traced at ``hint`` (an int where the
    ShapeEnv specialises it: 0 and 1). ``name`` labels it in messages only: no guard on it is
    ever turned into code (checked on torch 2.11 and 2.13)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env, source = mode.shape_env, ConstantSource(name)
    symbol = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=hint, source=source)


def size_of_expr(mode: FakeTensorMode, expr, hint: int) -> "torch.SymInt | int":
    """A SymInt of ``mode``'s ShapeEnv whose value is the sympy ``expr`` (of its symbols)."""
    import sympy

    if isinstance(expr, (int, sympy.Integer)) or getattr(expr, "is_number", False):
        return int(expr)
    return mode.shape_env.create_symintnode(expr, hint=hint)


def foreign_fake_mode(values) -> "FakeTensorMode | None":
    """The fake mode of the fake tensors in ``values`` where it is not the one the tracing
    context names (``detect_fake_mode`` would pick the context's: while Dynamo compiles, its
    own), else None. A local program sized in a ShapeEnv of its own
    (``dynamo_dist.symbolic.LocalSizes``) must be traced and compiled in its own mode."""
    mode = next((v.fake_mode for v in values if isinstance(v, torch.Tensor) and
                 getattr(v, "fake_mode", None) is not None), None)
    ctx = TracingContext.try_get()
    return mode if mode is not None and mode is not getattr(ctx, "fake_mode", None) else None


def binary_size_arithmetic(gm: "torch.fx.GraphModule") -> None:
    """Rewrite size arithmetic nodes with more than two arguments (``operator.mul(2, a, b)``)
    as chains of two-argument ones, in place. make_fx records such a node where it rebuilds
    a size it was not tracing from the pieces of its sympy expression (``proxy_tensor.
    _build_proxy_for_sym_expr`` passes all of a product's factors at once), and the node then
    fails to run ("mul expected 2 arguments, got 3"; checked on torch 2.13)."""
    import operator

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (operator.mul, operator.add) or \
                len(node.args) <= 2 or node.kwargs:
            continue
        def val(a):
            return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

        with gm.graph.inserting_before(node):
            acc = node.args[0]
            for arg in node.args[1:-1]:
                new = gm.graph.call_function(node.target, (acc, arg))
                new.meta = dict(node.meta)
                if val(acc) is not None and val(arg) is not None:  # the partitioner reads it
                    new.meta["val"] = node.target(val(acc), val(arg))
                acc = new
        node.args = (acc, node.args[-1])
    gm.recompile()


def tracing_in(mode: "FakeTensorMode | None") -> contextlib.AbstractContextManager:
    """A tracing context naming ``mode`` (what ``foreign_fake_mode`` found), so that make_fx
    and Inductor use it rather than Dynamo's; nothing for None."""
    return tracing(TracingContext(mode)) if mode is not None else contextlib.nullcontext()


def python_dispatcher() -> contextlib.AbstractContextManager:
    """Ops dispatch through their Python meta functions and decompositions, which keep
    symbolic sizes; some C++ kernels read ``sizes()`` and fix every size they see
    (``constant_pad_nd``). AOTAutograd traces in this mode; checked on torch 2.11 and 2.13."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


def symbol_size(like: "torch.SymInt", symbol) -> "torch.SymInt":
    """A SymInt that is the sympy ``symbol`` of ``like``'s ShapeEnv, with its traced value as
    hint (a symbol may appear only inside expressions: a DTensor's global ``2*s0``)."""
    env = like.node.shape_env
    values = getattr(env, "backed_var_to_val", None)  # torch 2.13; 2.11 has var_to_val only
    return env.create_symintnode(symbol, hint=int((values or env.var_to_val)[symbol]))


def size_guards(mode: FakeTensorMode) -> list:
    """The guards ``mode``'s ShapeEnv has recorded, as sympy booleans, oldest first."""
    return [g.expr for g in mode.shape_env.guards]


def add_size_guard(like: "torch.SymInt", expr) -> None:
    """Record the sympy boolean ``expr`` (of the symbols of ``like``'s ShapeEnv) as a guard
    there: Dynamo, which owns that ShapeEnv, re-checks it on every call. It must hold at the
    traced sizes (AssertionError otherwise)."""
    env = like.node.shape_env
    if not bool(env.evaluate_expr(expr)):
        raise AssertionError(f"{expr} does not hold at the traced sizes")


def baddbmm_self_expanded(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``baddbmm(self, batch1, batch2)`` arguments (positional or by name; returned positional
    where changed) with ``self`` expanded to the output shape
    where its sizes are symbolic and it broadcasts: the op's meta function expands it through
    a kernel that takes only concrete sizes ("SymIntArrayRef expected to contain only concrete
    integers", torch 2.13; Bloom's ALiBi scores hit it), while an expand beforehand traces. The
    values are the same."""
    bound = dict(zip(("self", "batch1", "batch2"), args))
    bound.update({"self" if k == "input" else k: v for k, v in kwargs.items()})
    x, b1, b2 = bound.pop("self", None), bound.pop("batch1", None), bound.pop("batch2", None)
    if not all(isinstance(t, torch.Tensor) for t in (x, b1, b2)) or \
            not any(has_symbolic_shape(t) for t in (x, b1, b2)):
        return args, kwargs
    shape = (b1.shape[0], b1.shape[1], b2.shape[2])
    if tuple(x.shape) == shape:
        return args, kwargs
    return (x.expand(shape), b1, b2), bound  # (beta, alpha by keyword)


def autograd_leaves(tensors) -> list[torch.Tensor]:
    """The leaf tensors that requires-grad ``tensors`` reach through their autograd graphs
    (each ``AccumulateGrad`` node's variable), each once, in no set order."""
    seen, todo, out = set(), [t.grad_fn for t in tensors], []
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        todo.extend(f for f, _ in fn.next_functions)
    return out


# --- lowering's copies of a repeated layer (inductor_passes/stamp.py): make_fx's proxy tracker.
# Checked on 2.11 and 2.13 (tests/test_compat.py).
from torch.fx.experimental import proxy_tensor as _proxy_tensor  # noqa: E402
from torch.fx.proxy import _COPY_META_FIELDS as TRACED_META_FIELDS  # noqa: E402,F401


def proxy_tracer():
    """The tracer of the make_fx trace running now, or None."""
    mode = _proxy_tensor.get_proxy_mode()
    return mode.tracer if mode is not None else None


def proxy_node(t: torch.Tensor, tracer) -> "torch.fx.Node | None":
    """The node of ``tracer``'s graph that computes ``t``, or None for an untracked tensor."""
    slot = _proxy_tensor.get_proxy_slot(t, tracer, None)
    return slot.proxy.node if slot is not None else None


def track_value(value: torch.Tensor, node: "torch.fx.Node", tracer, tensor_meta) -> None:
    """Make ``node`` (already in ``tracer``'s graph) the node that computes ``value``, as make_fx
    does for an op's result: its ``val`` a detached snapshot, its ``tensor_meta`` the one given
    (a copy's is its original's: computing it is most of the cost)."""
    _proxy_tensor.track_tensor(value, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)
    node.meta["val"] = _proxy_tensor.snapshot_fake(value)
    if tensor_meta is not None:
        node.meta["tensor_meta"] = tensor_meta


def fake_tensor(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` on ``device`` over the meta tensor ``meta`` (its storage: two
    over views of one meta storage alias), made without a trip through the dispatcher."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, meta, device)


def untraced() -> contextlib.AbstractContextManager:
    """Run tensor code inside a make_fx trace without recording it, and without make_fx's
    torch-function mode (it sees every ``.shape`` and ``.stride()``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(_proxy_tensor.disable_proxy_modes_tracing())
    stack.enter_context(_proxy_tensor._temp_remove_metadata_torch_function_mode())
    return stack


def no_dispatch_modes() -> contextlib.AbstractContextManager:
    """No dispatch mode at all (the trace's fake mode included): meta tensors made here are
    made by their C++ kernels directly."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
