"""``shard_module``: apply a ShardingPlan to a module (parameters become DTensors, inputs and
outputs get sharding constraints)."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import inspect
import logging
import types
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .. import eager_conv, patches
from inductor_passes.core import compat, mesh_facts
from inductor_passes.core.errors import DistCompileError, describe_mesh
from inductor_passes.core.placements import is_strided
from inductor_passes.redistribute import mesh_axes, redistribute

from ..annotations import pin_placements, validate_placements
from .spec import ShardingPlan, to_placements

log = logging.getLogger("dynamo_dist")


def parameter_groups(module: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    """Every distinct parameter of ``module`` with all the names it has (a tied parameter, such
    as GPT-2's ``transformer.wte.weight`` = ``lm_head.weight``, has several), in module order."""
    groups: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, []))[1].append(name)
    return list(groups.values())


def _spec_for(plan: ShardingPlan, names: Sequence[str], mesh: DeviceMesh, ndim: int
              ) -> tuple[Placement, ...] | None:
    """The placements the plan gives a parameter known by ``names``: the specs its names match,
    merged mesh axis by mesh axis. Raises DistCompileError when two names of one (tied)
    parameter ask for different placements on one mesh axis."""
    merged: list[Placement | None] = [None] * mesh.ndim
    said: list[str | None] = [None] * mesh.ndim
    for name in names:
        spec = plan.placement_for(name)
        if spec is None:
            continue
        pls = to_placements(spec, mesh, ndim, f"parameter '{name}'")
        for axis in _explicit_axes(spec, mesh):
            if merged[axis] is not None and merged[axis] != pls[axis]:
                axis_name = (mesh.mesh_dim_names or [str(axis)] * mesh.ndim)[axis]
                raise DistCompileError(
                    f"tied parameter {' = '.join(names)}: the plan gives '{said[axis]}' "
                    f"{merged[axis]} and '{name}' {pls[axis]} on mesh axis '{axis_name}'; a tied "
                    f"parameter is one tensor with one placement", mesh=describe_mesh(mesh),
                    fix=f"give '{said[axis]}' and '{name}' the same placement (or name only one "
                        f"of them in the plan)")
            merged[axis], said[axis] = pls[axis], name
    if all(p is None for p in merged):
        return None
    return tuple(p if p is not None else Replicate() for p in merged)


def _explicit_axes(spec: Any, mesh: DeviceMesh) -> list[int]:
    """The mesh axes a spec says something about: a dict names its axes; a sequence or a
    partition spec says something about every axis."""
    if isinstance(spec, Mapping):
        names = list(mesh.mesh_dim_names or ())
        return [names.index(a) if isinstance(a, str) and a in names else int(a) for a in spec]
    return list(range(mesh.ndim))


def check_plan_keys(model: nn.Module, plan: ShardingPlan) -> None:
    """Every parameter pattern of ``plan`` must match a parameter of ``model`` (a typo would
    otherwise leave the parameter replicated without a word). Raises DistCompileError naming
    the unmatched patterns and the nearest parameter names."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    unmatched = [k for k in plan.plan if not any(fnmatch.fnmatchcase(n, k) for n in names)]
    if not unmatched:
        return
    hints = []
    for k in unmatched:
        close = difflib.get_close_matches(k, names, n=3, cutoff=0.5)
        hints.append(f"'{k}' (nearest: {', '.join(close) if close else 'none'})")
    raise DistCompileError(
        f"plan entries match no parameter of {type(model).__name__}: {'; '.join(hints)}",
        fix="use the names model.named_parameters() gives (fnmatch patterns: '*.q_proj.weight')")


def check_input_keys(model: nn.Module, plan: ShardingPlan) -> None:
    """Every named input_plan / output key must be an argument of ``model.forward``; positions
    and ``"*"`` are always accepted. Raises DistCompileError naming the nearest arguments."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # forward(**kwargs): any name may arrive
    names = list(params)
    bad = [k for k in plan.input_plan if isinstance(k, str) and k != "*" and k not in names]
    if bad:
        hints = [f"'{k}' (nearest: {', '.join(difflib.get_close_matches(k, names, n=3)) or 'none'})"
                 for k in bad]
        raise DistCompileError(
            f"input_plan names arguments that {type(model).__name__}.forward does not take: "
            f"{'; '.join(hints)}", fix=f"use argument names of forward: {names}")


def shard_module(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Parameters become DTensors (GLOBAL shape, the plan's placements; unmatched: replicated).
    Every name of a tied parameter (``lm_head.weight`` = ``transformer.wte.weight``) gets the
    SAME DTensor parameter, so the tie holds: one placement, one gradient, one optimizer state.
    Buffers stay plain tensors (global values). Inputs named in ``plan.input_plan`` get a
    sharding constraint each call. An ``nn.Embedding`` whose weight is split by rows (the
    vocabulary) gets a forward hook that settles its output when it runs eagerly (see
    ``_settle_pending_output``; split on two or more mesh axes, also a forward that looks up
    on one split when run eagerly: ``_one_row_split_forward``), and every sharded parameter a
    post-accumulate-grad hook that puts a gradient computed eagerly in the parameter's
    placement (``_gradient_in_parameter_placement``), so the model's blocks can be compiled
    one by one. Forwards it wraps stay methods of their module (``copy.deepcopy`` of the model
    gives a copy that runs its own weights).

    Raises TypeError when ``model`` is not an nn.Module; DistCompileError for a placement that
    cannot apply (Partial included), a plan entry that matches no
    parameter, an input key forward does not take, or a tied parameter whose names the plan
    gives different placements.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_module: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}; fix: wrap the function in an nn.Module, or "
                        f"annotate its tensors with mark_sharding / distribute_tensor")
    check_plan_keys(model, plan)
    check_input_keys(model, plan)
    compat.allow_implicit_replication(True)
    patches.install_dynamo_tracing_fallback()
    eager_conv.install()  # parts of the model may run eagerly on the split parameters
    for param, names in parameter_groups(model):
        placements = _spec_for(plan, names, mesh, param.ndim) or \
            tuple(Replicate() for _ in range(mesh.ndim))
        # (an uneven split is fine: torch.chunk's pieces, as DTensor's; the compiler pads them
        # where a collective needs equal sizes)
        validate_placements(f"parameter '{names[0]}'", tuple(param.shape), mesh, placements)
        if any(isinstance(p, Partial) for p in placements):
            raise DistCompileError(
                f"parameter '{names[0]}': a parameter cannot be Partial (a pending reduction: "
                f"each rank would hold and update a share of it)", shapes=[tuple(param.shape)],
                mesh=describe_mesh(mesh), placements=list(placements),
                fix="give parameters Shard(d) or Replicate(); a gradient's pending sum is "
                    "planned by the compiler")
        if isinstance(param, DTensor):
            if param.device_mesh != mesh:
                raise DistCompileError(f"parameter '{names[0]}' is already a DTensor on another "
                                       f"mesh", mesh=describe_mesh(mesh),
                                       fix="shard each module once")
            dt = param.redistribute(mesh, placements)
        elif any(is_strided(p) for p in placements):
            dt = _strided_parameter(param.detach(), mesh, tuple(placements))
        else:
            dt = distribute_tensor(param.detach(), mesh, list(placements))
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        for fqn in names:
            owner_name, _, leaf = fqn.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, leaf, new)

    if plan.input_plan or plan.output_plan or plan.return_local_tensor:
        model.forward = _constrained_forward(model, mesh, plan)
    mesh_facts.add_data_axes(mesh, plan.data_axes)
    for param in {id(p): p for p in model.parameters()}.values():
        if isinstance(param, DTensor) and param.requires_grad \
                and not getattr(param, _HOOKED, False):
            param.register_post_accumulate_grad_hook(_gradient_in_parameter_placement)
            setattr(param, _HOOKED, True)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        rows = _row_split_axes(weight) if isinstance(weight, DTensor) else []
        if isinstance(module, nn.Embedding) and rows and not getattr(module, _HOOKED, False):
            module.register_forward_hook(functools.partial(_settle_pending_output, mesh=mesh))
            if len(rows) > 1 and "forward" not in vars(module):
                module.forward = types.MethodType(_one_row_split_forward, module)
            setattr(module, _HOOKED, True)
    model._dynamo_dist_plan = plan  # read by tools (explain); not used by the compiler
    return model


_HOOKED = "_dynamo_dist_hooked"  # set on what shard_module gave a hook (once)


def _settle_pending_output(module: nn.Module, args: Any, out: Any, *, mesh: DeviceMesh) -> Any:
    """Forward hook of a row-split embedding: run eagerly (outside a compiled region, e.g.
    when only the blocks are compiled, torchtitan's way), DTensor returns the lookup as a
    pending sum (``_MaskPartial``: each rank looked up its own rows), and Dynamo cannot make a
    fake of such a DTensor for the next compiled block (it holds the real mask). The sum is
    taken here: on a data axis as a reduce_scatter over the batch (dim 0: the activations of
    data parallelism), elsewhere as an all_reduce (Megatron's vocabulary-parallel embedding).
    Inside a compiled program it does nothing: the planner places that value with the rest."""
    if torch.compiler.is_compiling() or not isinstance(out, DTensor) \
            or not any(isinstance(p, Partial) for p in out.placements):
        return None
    names, data = out.device_mesh.mesh_dim_names or (), mesh_facts.data_axes(mesh)
    split0 = any(isinstance(p, Shard) and p.dim == 0 for p in out.placements)
    target: list[Placement] = []
    for axis, p in enumerate(out.placements):
        if not isinstance(p, Partial):
            target.append(p)
        elif axis < len(names) and names[axis] in data and out.ndim and not split0 \
                and out.shape[0] >= out.device_mesh.size(axis):
            target.append(Shard(0))
            split0 = True
        else:
            target.append(Replicate())
    settled = out.redistribute(out.device_mesh, target)
    # the gradient must come back in ``target`` (no pending sum): DTensor cannot move a
    # Partial gradient to the _MaskPartial the redistribute started from. GPT-2's position
    # embedding (batch 1, so Replicate here) gets the batch's sum of gradients, Partial on dp.
    # ``from_local``'s backward reduces it to ``target`` first.
    return DTensor.from_local(settled.to_local(), settled.device_mesh, target, run_check=False,
                              shape=settled.shape, stride=settled.stride())


def _row_split_axes(weight: DTensor) -> list[int]:
    """The mesh axes that split ``weight``'s dim 0 (an embedding's vocabulary rows)."""
    return [a for a, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]


def _one_row_split_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """The forward ``shard_module`` binds to an embedding whose rows are split on two or more
    mesh axes (FSDP on dp and a vocabulary-parallel split on tp: ``[Shard(0), Shard(0)]``).
    Eagerly, DTensor (torch 2.13) labels such a lookup with one ``_MaskPartial`` per axis
    sharing one mask buffer, and fails ("MaskBuffer has been materialized with conflicting
    data"). So run eagerly, the class's forward (a subclass's too: Gemma scales its lookup)
    reads the weight gathered on every such axis but the innermost (what FSDP gathers): one
    vocabulary split, one pending sum, which ``_settle_pending_output`` then takes. The
    gather's backward puts the gradient back in the weight's placement. Inside a compiled
    program, and with ``max_norm`` (it renormalises the weight in place), the class's forward
    reads the weight itself. A bound method, not a closure: ``copy.deepcopy`` of the module
    rebinds it to the copy."""
    w = self.weight
    axes = _row_split_axes(w) if isinstance(w, DTensor) else []
    if torch.compiler.is_compiling() or len(axes) < 2 or self.max_norm is not None:
        return type(self).forward(self, input)
    target = [Replicate() if a in axes[:-1] else p for a, p in enumerate(w.placements)]
    self._parameters["weight"] = w.redistribute(w.device_mesh, target)  # for this call only
    try:
        return type(self).forward(self, input)
    finally:
        self._parameters["weight"] = w


def _gradient_in_parameter_placement(param: DTensor) -> None:
    """Post-accumulate-grad hook of a sharded parameter: its gradient in its own placement.
    A compiled program hands gradients over placed so (the hook finds nothing to do); code run
    eagerly on DTensors (the embedding, norm and head when only the blocks are compiled) gets
    DTensor's choice: a pending sum (a norm's weight: Partial on every axis) or a whole
    gradient (a row-split embedding's: Replicate). Kept so, every rank would hold the whole
    gradient (and a pending sum would be summed by whatever reads it next); moved here, a data
    axis's sum is a reduce_scatter, as FSDP's."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _strided_parameter(value: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """``value`` (a whole parameter, GLOBAL shape) as a DTensor in ``placements``, some of them
    ``_StridedShard``: the other axes are distributed from rank 0 as usual (not DTensor's
    scatter for a strided one: under LocalTensorMode, torch 2.13, it gives every simulated rank
    rank 0's piece), then each rank cuts its strided pieces locally with lowering's own slicing
    (``redistribute``: Replicate -> _StridedShard moves no data), the layout the compiled
    program reads. Not DTensor's redistribute: torch 2.11's cannot express (Shard(0),
    _StridedShard(1, k)) as a shard order (ValueError; GPT-2's and Mixtral's fused projections
    on dp x tp). Under LocalTensorMode (simulated ranks: one coordinate cannot serve them all)
    DTensor's redistribute does the cut, as before."""
    plain = [Replicate() if is_strided(p) else p for p in placements]
    whole = distribute_tensor(value, mesh, plain)
    if compat.local_tensor_mode_active():
        return whole.redistribute(mesh, placements)

    def no_collective(kind: str, *_: Any) -> None:
        raise AssertionError(f"cutting a parameter to {placements} issued a {kind}")

    local = redistribute(whole.to_local(), tuple(plain), placements, mesh_axes(mesh),
                         no_collective, tuple(value.shape))
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _constrained_forward(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan):
    """``model.forward`` wrapped so that each call pins the inputs ``plan.input_plan`` names (a
    wrapper, not forward hooks: with hooks Dynamo compiles the hook and the forward as separate
    graphs) and applies ``plan.output_plan``. Returned as a method bound to ``model`` whose
    function holds no reference to it, so ``copy.deepcopy(model)`` rebinds it to the copy (a
    closure over ``model`` made the copy run the original's forward: its outputs from the
    original's weights, silently)."""
    bound = model.forward
    func = bound.__func__ if getattr(bound, "__self__", None) is model else None
    if func is None:  # a forward the user set on the instance: wrapped as it is
        func = lambda self, *args, **kwargs: bound(*args, **kwargs)  # noqa: E731
    specs = dict(plan.input_plan)
    wildcard = specs.pop("*", None)
    try:
        arg_names = list(inspect.signature(bound).parameters)
    except (TypeError, ValueError):
        arg_names = []

    def constrain(keys, a, batch):
        if not isinstance(a, torch.Tensor) or isinstance(a, DTensor):
            return a
        spec = next((specs[k] for k in keys if k in specs), None)
        if spec is None and wildcard is not None and a.ndim and a.shape[0] == batch:
            spec = wildcard  # "*": the tensor arguments that carry the batch (dim 0 = its size)
        if spec is None:
            return a
        pls = to_placements(spec, mesh, a.ndim, f"input {keys[0]!r}")
        return pin_placements(a, mesh, pls)

    named = {k for k in specs if isinstance(k, str)}
    warned: set[str] = set()

    @functools.wraps(func)
    def forward(self, *args, **kwargs):
        unseen = named - set(kwargs) - set(arg_names[:len(args)]) - warned
        if unseen:  # forward(**kwargs) takes any name: a typo shows only here
            warned.update(unseen)
            log.warning("dynamo_dist: input_plan names %s, which this call of %s does not pass "
                        "(it passed %s); those entries apply to nothing here", sorted(unseen),
                        type(self).__name__, sorted(set(kwargs) | set(arg_names[:len(args)])))
        first = next((a for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor) and a.ndim), None)
        batch = first.shape[0] if first is not None else None
        args = tuple(constrain((i, *arg_names[i:i + 1]), a, batch) for i, a in enumerate(args))
        kwargs = {k: constrain((k,), a, batch) for k, a in kwargs.items()}
        return _apply_output_plan(func(self, *args, **kwargs), mesh, plan)

    return types.MethodType(forward, model)


def _apply_output_plan(out: Any, mesh: DeviceMesh, plan: ShardingPlan) -> Any:
    """Redistribute the forward's outputs named in ``plan.output_plan`` and turn those named by
    ``plan.return_local_tensor`` into local tensors. Inside a compiled region both calls trace
    as DTensor methods, which the backend reads as constraints (see capture)."""
    def finish(key, v):
        if not isinstance(v, DTensor):
            return v
        if key in plan.output_plan:
            pls = to_placements(plan.output_plan[key], mesh, v.ndim, f"output {key!r}")
            validate_placements(f"output {key!r}", tuple(v.shape), mesh, pls)
            v = v.redistribute(mesh, pls)
        local = plan.return_local_tensor
        if local is True or (local and key in local):
            v = v.to_local()
        return v

    if isinstance(out, Mapping):  # dicts and transformers' ModelOutput (an OrderedDict)
        for key in list(out.keys()):
            out[key] = finish(key, out[key])
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(finish(i, v) for i, v in enumerate(out))
    return finish(0, out)
