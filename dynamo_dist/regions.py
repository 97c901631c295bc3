"""Repeated layers as ``torch.compiler.nested_compile_region`` calls: Dynamo traces each
distinct layer once, and each call is checked to be handed its own layer's tensors.

**Layers made regions** (``install_layer_regions``; ``DYNAMO_DIST_LAYER_REGIONS=0`` turns it
off). While Dynamo traces a frame for ``dist``, a call of a block (a module holding modules)
that has a sibling of its class in an ``nn.ModuleList`` or ``nn.Sequential`` (a decoder
layer) is traced as an
``invoke_subgraph`` call, as if the class's ``forward`` were marked: Dynamo traces the first
layer and stamps out the others (its subgraph reuse), instead of inlining every layer's
Python again (at 32 layers of the demo Llama, Dynamo's part went from 8.5 to 5.0 s). The
backend inlines every call before capture (``compat.inline_nested_compile_regions``), so the
program planned and compiled is the one Dynamo would have traced inline. The user's classes
and modules are not touched, and other backends trace as before. A module with hooks or a
patched ``forward`` is called as usual (a region would skip its hooks), and so is one inside
another higher-order op's body, one handed a Python object (a KV cache), and one holding a
simulated rank's ``LocalTensor`` values. Modules are found from the compiled frame's locals (a model
reached only through a global is traced inline). When the frame fails to trace with regions
(a graph break inside a layer, a layer returning one of its inputs, inputs that are views of
one tensor: torch's ``invoke_subgraph`` takes none of these), it is traced again with every
layer inline, a warning says why, and that layer class is called inline for the rest of the
process. vLLM's ``use_nested_compile_regions`` marks decoder layers alike, on the class and
opt-in.

**Each call handed its own tensors** (``check_region_operands``). Dynamo stamps out later
calls with the tensors each call reads. On torch 2.13, a region marked on each layer
separately (``layer.forward = types.MethodType(region, layer)``, a closure or lambda per
layer) is stamped out with the tensors of the first layer it traced: every later layer
computes with that one layer's weights, under torch's own backends too, with no error. A
region marked on the class (``forward`` decorated in the class body) is stamped out right.
The check turns the wrong graph into an error before anything is planned.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import logging
import types

import torch
import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError, user_source
from inductor_passes.core.switches import switch

log = logging.getLogger("dynamo_dist")

# per frame compile for ``dist``: None (no regions) or the state of its layer regions
_FRAME: contextvars.ContextVar["_Regions | None"] = contextvars.ContextVar(
    "dynamo_dist_layer_regions", default=None)


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
    # per body: (call, its module's path, the module, the module's tensors by name)
    sites: dict[object, list[tuple[fx.Node, str, torch.nn.Module, dict]]] = {}
    for call in calls:
        stack = call.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else None
        module = compat.module_at_path(path, frame) if path else None
        if isinstance(module, torch.nn.Module):
            sites.setdefault(call.args[0].target, []).append(
                (call, path, module, dict(_tensors(module))))
    for body_sites in sites.values():
        # every tensor of the body's call sites, by identity: (module path, name in it)
        held: dict[int, tuple[str, str]] = {}
        for _, path, _, own in body_sites:
            for name, t in own.items():
                held.setdefault(id(t), (path, name))
        for call, path, module, own in body_sites:
            for operand in call.args[2:]:
                if not isinstance(operand, fx.Node) or operand.op != "placeholder":
                    continue
                value = compat.graph_input_value(operand)
                other_path, name = held.get(id(value), (path, ""))
                mine = own.get(name)
                if other_path != path and mine is not None and mine is not value:
                    raise _OperandMismatch(
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


class _OperandMismatch(DistCompileError):
    """A region call handed another layer's tensor (``check_region_operands``)."""


def _tensors(module: torch.nn.Module):
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))


def enabled() -> bool:
    """``DYNAMO_DIST_LAYER_REGIONS`` (default on; 0: Dynamo inlines every layer). Raises
    ValueError for another value."""
    return switch("DYNAMO_DIST_LAYER_REGIONS", "trace each repeated layer once",
                  "every layer inlined") and \
        getattr(torch.ops.higher_order, "invoke_subgraph", None) is not None


# layer classes whose region torch refused in this process (a layer returning its input,
# inputs that alias each other): called inline from then on, by later frame compiles too
_REFUSED: set[type] = set()


class _Regions:
    """One frame compile's layer regions: which modules are layers (found at the first module
    call, from the frame's locals), whether any call was made a region, and the class of the
    last region call that raised."""

    def __init__(self) -> None:
        self.layers: set[int] | None = None
        self.used = False
        self.raised: type | None = None

    def is_layer(self, module: torch.nn.Module) -> bool:
        if self.layers is None:
            self.layers = _repeated_children(compat.dynamo_frame_locals() or {})
        return id(module) in self.layers


def _repeated_children(frame_locals: dict) -> set[int]:
    """ids of the modules reachable from the frame's locals that sit in an ``nn.ModuleList`` or
    ``nn.Sequential`` beside another module of their class and hold modules of their own (a
    block; a lone ``nn.Linear`` or activation is one op, cheaper for Dynamo inline than as a
    region)."""
    found: set[int] = set()
    # (a wrapper's ``*args``/``**kwargs`` hold the model: transformers' deprecation wrapper
    # is the frame Dynamo compiles for ``torch.compile(hf_model)``)
    values = [*frame_locals.values(), *(v for c in frame_locals.values()
                                        if isinstance(c, (tuple, list, dict))
                                        for v in (c.values() if isinstance(c, dict) else c))]
    roots = [v for v in values if isinstance(v, torch.nn.Module)]
    for container in {id(m): m for r in roots for m in r.modules()}.values():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = list(container.children())
            counts: dict[type, int] = {}
            for kid in kids:
                counts[type(kid)] = counts.get(type(kid), 0) + 1
            found.update(id(k) for k in kids
                         if counts[type(k)] > 1 and next(k.children(), None) is not None)
    return found


_HOOKS = ("_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks")


def _plain_call(module: torch.nn.Module) -> bool:
    """``module(...)`` runs its class's ``forward`` and nothing else: no hook of its own or
    global, no ``forward`` or ``__call__`` patched on it, and the class's ``forward`` is not a
    region the user marked already."""
    from torch.nn.modules import module as nn_module

    return not any(getattr(module, a, None) for a in _HOOKS) and \
        not any(getattr(nn_module, f"_global{a}", None) for a in _HOOKS) and \
        "forward" not in module.__dict__ and "__call__" not in module.__dict__ and \
        type(module).__call__ is torch.nn.Module.__call__ and \
        isinstance(inspect.getattr_static(module, "forward"), types.FunctionType) and \
        not hasattr(type(module).forward, "__marked_compile_region_fn__")  # the user's own


_CLONES: dict[types.FunctionType, types.FunctionType] = {}


def _region_forward(forward: types.FunctionType) -> types.FunctionType:
    """A copy of a class's ``forward`` (same code, globals, defaults and closure) that carries
    the marks Dynamo reads from a region's function, so that the class's own function is not
    written to. Reuse is keyed by the code, so every layer of the class shares one entry
    list; no cap on its length (a layer that differs in a guarded value gets an entry of its
    own, where Dynamo's default cap of 8 would raise)."""
    clone = _CLONES.get(forward)
    if clone is None:
        clone = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__,
                                   forward.__defaults__, forward.__closure__)
        clone.__kwdefaults__ = forward.__kwdefaults__
        clone.__qualname__ = forward.__qualname__
        clone.__marked_compile_region_max_reuse_entries__ = 1 << 30
        _CLONES[forward] = clone
    return clone


def install_layer_regions() -> bool:
    """Trace repeated layers as regions while Dynamo traces for ``dist`` (module docstring).
    Idempotent; False where this torch lacks what it needs (checked on torch 2.13)."""
    try:
        from torch._dynamo.utils import build_invoke_subgraph_variable
        from torch._dynamo.variables import nn_module
        from torch._dynamo.variables.functions import UserFunctionVariable
    except ImportError:
        return False
    cls = nn_module.UnspecializedNNModuleVariable
    original = cls.call_function
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    def call_function(self, tx, args, kwargs):
        frame, module = _FRAME.get(), self.value
        if frame is None or self.source is None or \
                tx.output.current_tracer.parent is not None or \
                type(module) in _REFUSED or not frame.is_layer(module) or \
                not _plain_call(module) or compat.local_tensor_mode_active() or \
                compat.holds_local_tensors(module) or \
                not compat.region_arguments_plain(args, kwargs):
            # (simulated ranks: torch 2.13's region tracing takes fake tensors only, and
            # refuses the LocalTensors a simulated program's values are)
            return original(self, tx, args, kwargs)
        frame.used = True
        # what Dynamo's own module call installs and records (``call_function`` above)
        nn_module.guard_to_detect_forward_monkeypatching(self.source, module)
        with nn_module.record_nn_module_stack(str(id(module)), self.get_nn_module_stack_source(),
                                              tx, module):
            forward = UserFunctionVariable(_region_forward(type(module).forward))
            try:
                return build_invoke_subgraph_variable().call_function(
                    tx, [forward, self, *args], kwargs)
            except Exception:
                frame.raised = type(module)
                raise

    call_function._dynamo_dist_patch = True
    cls.call_function = call_function
    # the reuse lookup of every later layer: its arguments fingerprinted in Python
    compat.fast_region_fingerprints(lambda: _FRAME.get() is not None)
    return compat.wrap_frame_compile(_with_layer_regions)


def _with_layer_regions(original, compiler_fn, args, kwargs):
    """Dynamo's compile of one frame, for ``dist`` with layer regions; traced again with every
    layer inline when it fails after making one."""
    if not compat.is_dist_compiler(compiler_fn) or not enabled():
        return original(*args, **kwargs)
    frame = _Regions()
    token = _FRAME.set(frame)
    try:
        return original(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (whatever torch raises on a region it cannot take)
        inner = getattr(exc, "inner_exception", None)  # the backend's own error: not a region's
        if not frame.used or (inner is not None and not isinstance(inner, _OperandMismatch)):
            raise
        if frame.raised is not None:
            _REFUSED.add(frame.raised)
        log.warning("dynamo_dist: tracing repeated layers once failed (%s%s: %s); tracing every "
                    "layer inline%s (DYNAMO_DIST_LAYER_REGIONS=0 skips the attempt)",
                    f"{frame.raised.__name__}, " if frame.raised else "", type(exc).__name__,
                    " ".join([ln for ln in str(exc).splitlines() if ln.strip()][:2])[:300],
                    f", and {frame.raised.__name__} from now on" if frame.raised else "")
        _FRAME.set(None)
        return original(*args, **kwargs)
    finally:
        _FRAME.reset(token)
