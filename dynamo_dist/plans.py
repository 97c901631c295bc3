"""Module sharding plans: which placement each parameter and input gets.

``ShardingPlan`` is plain data (fqn pattern -> placement spec); a ``ShardingPlanner`` builds one
from a module's structure; ``shard_module`` applies it (parameters become DTensors, inputs get
sharding constraints). The compiler then plans every other value of the program.

A placement spec is any of:
  * a sequence of torch Placements, one per mesh axis: ``(Replicate(), Shard(0))``
  * a dict mesh-axis-name -> Placement (axes not named are Replicate): ``{"tp": Shard(0)}``
  * a ``PartitionSpec``: one entry per TENSOR dim naming the mesh axis (or axes, or None) it is
    split over, torch_xla/JAX style: ``PartitionSpec("dp", None)``
"""

from __future__ import annotations

import abc
import dataclasses
import fnmatch
import functools
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from . import _compat
from .errors import DistCompileError, describe_mesh


class PartitionSpec(tuple):
    """Per tensor dim: None, a mesh axis name (or index), or a tuple of them."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return f"PartitionSpec{tuple(self)!r}"


def _axis_index(mesh: DeviceMesh, axis: str | int, what: str) -> int:
    names = list(mesh.mesh_dim_names or ())
    if isinstance(axis, int) and 0 <= axis < mesh.ndim:
        return axis
    if axis in names:
        return names.index(axis)
    raise DistCompileError(f"{what}: unknown mesh axis {axis!r}", mesh=mesh,
                           fix=f"use one of the mesh's axis names {names} or an index below "
                               f"{mesh.ndim}")


def to_placements(spec: Any, mesh: DeviceMesh, ndim: int, what: str) -> tuple[Placement, ...]:
    """Any placement spec (see module doc) -> one Placement per mesh axis."""
    if isinstance(spec, PartitionSpec):
        out: list[Placement] = [Replicate()] * mesh.ndim
        if len(spec) > ndim:
            raise DistCompileError(f"{what}: partition spec {spec} has {len(spec)} entries for a "
                                   f"{ndim}-D tensor", mesh=mesh,
                                   fix="give one entry per tensor dim (None for unsharded)")
        for d, entry in enumerate(spec):
            for axis in (entry if isinstance(entry, tuple) else (entry,)):
                if axis is None:
                    continue
                out[_axis_index(mesh, axis, what)] = Shard(d)
        return tuple(out)
    if isinstance(spec, Mapping):
        out = [Replicate()] * mesh.ndim
        for axis, p in spec.items():
            out[_axis_index(mesh, axis, what)] = p
        return tuple(out)
    return tuple(spec)


def validate_placements(what: str, shape: Sequence[int], mesh: DeviceMesh,
                        placements: Sequence[Placement]) -> None:
    """Raise DistCompileError unless ``placements`` can apply to a tensor of GLOBAL ``shape``."""
    def fail(why: str, fix: str):
        raise DistCompileError(f"{what}: {why}", shapes=[shape], mesh=describe_mesh(mesh),
                               placements=list(placements), fix=fix)

    if len(placements) != mesh.ndim:
        fail(f"{len(placements)} placements for a {mesh.ndim}-axis mesh",
             "give one placement per mesh axis")
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                fail(f"Shard({p.dim}) on mesh axis '{names[axis]}' but the tensor has "
                     f"{len(shape)} dims",
                     f"use Shard(d) with 0 <= d < {len(shape)}, or Replicate()")
        elif not isinstance(p, (Replicate, Partial)):
            fail(f"unsupported placement {p!r}", "use Shard(d), Replicate() or Partial()")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Placements for a module's parameters, inputs and outputs.

    plan:         fqn pattern (fnmatch, e.g. ``"*.q_proj.weight"``) -> placement spec; the first
                  matching pattern wins; unmatched parameters are replicated.
    input_plan:   forward argument (position or keyword name) -> placement spec; a sharding
                  constraint on that input (the value passed is the GLOBAL tensor).
    output_plan:  forward output -> placement spec: the output (a DTensor of GLOBAL shape) is
                  redistributed to it inside the compiled program. Keys: a position in a
                  returned tuple/list (0 for a single tensor), or a key of a returned dict or
                  transformers ``ModelOutput`` (``"logits"``).
    return_local_tensor: True (every DTensor output) or the keys of the outputs to return as
                  this rank's LOCAL tensor (``DTensor.to_local()``: local shape) rather than as
                  a DTensor; with ``output_plan`` the local shard is the one that plan names.
    data_axes:    mesh axes that carry data parallelism: the compiler gathers parameters there
                  at use without a memory price (ZeRO-3 / FSDP), and keeps them sharded on the
                  other axes.
    """

    plan: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    input_plan: Mapping[int | str, Any] = dataclasses.field(default_factory=dict)
    output_plan: Mapping[int | str, Any] = dataclasses.field(default_factory=dict)
    return_local_tensor: bool | tuple[int | str, ...] = False
    data_axes: tuple[str, ...] = ()

    def placement_for(self, fqn: str) -> Any | None:
        for pattern, spec in self.plan.items():
            if fnmatch.fnmatchcase(fqn, pattern):
                return spec
        return None

    def merged(self, other: "ShardingPlan") -> "ShardingPlan":
        """Per-axis union of two plans (dict specs merge axis by axis; ``other`` wins ties)."""
        keys = list(dict.fromkeys([*self.plan, *other.plan]))
        plan = {}
        for k in keys:
            a, b = self.plan.get(k), other.plan.get(k)
            plan[k] = {**a, **b} if isinstance(a, Mapping) and isinstance(b, Mapping) else \
                (b if b is not None else a)
        local = self.return_local_tensor, other.return_local_tensor
        if True in local:
            local_keys: bool | tuple = True
        else:
            local_keys = tuple(dict.fromkeys((local[0] or ()) + (local[1] or ()))) or False
        return ShardingPlan(plan=plan, input_plan={**self.input_plan, **other.input_plan},
                            output_plan={**self.output_plan, **other.output_plan},
                            return_local_tensor=local_keys,
                            data_axes=tuple(dict.fromkeys(self.data_axes + other.data_axes)))


class ShardingPlanner(abc.ABC):
    """Builds a ShardingPlan from a module's structure; ``base`` is a plan to extend (planners
    compose: a later planner sees which tensor dims earlier ones already shard)."""

    @abc.abstractmethod
    def build_plan(self, module: nn.Module, base: ShardingPlan | None = None) -> ShardingPlan:
        ...


_COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "gate_proj",
            "up_proj", "fc1", "c_fc", "w1", "w3", "in_proj", "wq", "wk", "wv")
_ROWWISE = ("o_proj", "out_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "dense")


@dataclasses.dataclass(frozen=True)
class TensorParallelPlanner(ShardingPlanner):
    """Megatron-style tensor parallelism (Shoeybi et al., 2019) on mesh axis ``axis``.

    Column/row pairs are found from the module structure: inside one parent module, Linear layers
    that read the parent's input width and widen it are column-parallel (weight ``Shard(0)``,
    bias ``Shard(0)``), the Linear that maps back to that width is row-parallel (weight
    ``Shard(1)``, bias replicated). Well-known projection names are used first. Everything else
    (embeddings, norms, output head unless ``shard_output_head``) is replicated.
    """

    axis: str = "tp"
    shard_output_head: bool = False

    def build_plan(self, module: nn.Module, base: ShardingPlan | None = None) -> ShardingPlan:
        plan: dict[str, Any] = {}
        for parent_name, parent in module.named_modules():
            linears = [(n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
            if len(linears) < 2:
                continue
            roles = self._roles(linears)
            for (name, lin), role in zip(linears, roles):
                fqn = f"{parent_name}.{name}" if parent_name else name
                if role == "col":
                    plan[f"{fqn}.weight"] = {self.axis: Shard(0)}
                    if lin.bias is not None:
                        plan[f"{fqn}.bias"] = {self.axis: Shard(0)}
                elif role == "row":
                    plan[f"{fqn}.weight"] = {self.axis: Shard(1)}
        if self.shard_output_head:
            for name, m in module.named_modules():
                if name.endswith(("lm_head", "output")) and isinstance(m, nn.Linear):
                    plan[f"{name}.weight"] = {self.axis: Shard(0)}
        result = ShardingPlan(plan=plan)
        return base.merged(result) if base is not None else result

    @staticmethod
    def _roles(linears) -> list[str | None]:
        names = [n for n, _ in linears]
        if any(n in _COLWISE for n in names) and any(n in _ROWWISE for n in names):
            return ["col" if n in _COLWISE else "row" if n in _ROWWISE else None for n in names]
        first, last = linears[0][1], linears[-1][1]
        width = first.in_features
        if last.out_features == width and all(m.in_features == width for _, m in linears[:-1]):
            return ["col"] * (len(linears) - 1) + ["row"]
        return [None] * len(linears)


@dataclasses.dataclass(frozen=True)
class DataParallelPlanner(ShardingPlanner):
    """Data parallelism on mesh axis ``axis``: inputs split on the batch dim (``Shard(0)``).

    ``shard_params=True`` is fully-sharded data parallel (ZeRO-3 / FSDP, Rajbhandari et al. 2020):
    each parameter is sharded on the first tensor dim that no other mesh axis already splits and
    that divides evenly; the compiler all-gathers it where it is used and reduce-scatters its
    gradient. ``shard_params=False`` replicates parameters (DDP: gradients all-reduced).
    ``inputs`` names the forward arguments that carry the batch.
    """

    axis: str = "dp"
    shard_params: bool = True
    inputs: tuple[int | str, ...] = (0, "input_ids", "labels")
    mesh_axis_size: int | None = None

    def build_plan(self, module: nn.Module, base: ShardingPlan | None = None) -> ShardingPlan:
        base = base or ShardingPlan()
        plan: dict[str, Any] = {}
        if self.shard_params:
            for fqn, p in module.named_parameters():
                taken = base.placement_for(fqn)
                used = {pl.dim for pl in (taken.values() if isinstance(taken, Mapping) else ())
                        if isinstance(pl, Shard)}
                for d in range(p.ndim):
                    if d in used:
                        continue
                    if self.mesh_axis_size and p.shape[d] % self.mesh_axis_size:
                        continue
                    plan[fqn] = {**(taken or {}), self.axis: Shard(d)}
                    break
        input_plan = {k: {self.axis: Shard(0)} for k in self.inputs}
        return base.merged(ShardingPlan(plan=plan, input_plan=input_plan, data_axes=(self.axis,)))


def shard_module(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Parameters become DTensors (GLOBAL shape, the plan's placements; unmatched: replicated);
    buffers stay plain tensors (global values). Inputs named in ``plan.input_plan`` get a sharding
    constraint each call. Raises DistCompileError for a placement that cannot apply.
    """
    from .annotations import register_data_axes, with_sharding_constraint

    _compat.allow_implicit_replication(True)
    _compat.install_dynamo_tracing_fallback()
    for fqn, param in list(model.named_parameters()):
        spec = plan.placement_for(fqn)
        placements = to_placements(spec, mesh, param.ndim, f"parameter '{fqn}'") if spec is not None \
            else tuple(Replicate() for _ in range(mesh.ndim))
        # (an uneven split is fine: torch.chunk's pieces, as DTensor's; the compiler pads them
        # where a collective needs equal sizes)
        validate_placements(f"parameter '{fqn}'", tuple(param.shape), mesh, placements)
        owner_name, _, leaf = fqn.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if isinstance(param, DTensor):
            dt = param.redistribute(mesh, placements) if param.device_mesh == mesh else None
            if dt is None:
                raise DistCompileError(f"parameter '{fqn}' is already a DTensor on another mesh",
                                       mesh=describe_mesh(mesh), fix="shard each module once")
        else:
            dt = distribute_tensor(param.detach(), mesh, list(placements))
        setattr(owner, leaf, nn.Parameter(dt, requires_grad=param.requires_grad))

    if plan.input_plan or plan.output_plan or plan.return_local_tensor:
        # A wrapper around forward, not forward hooks: with hooks Dynamo compiles the hook and
        # the forward as separate graphs.
        specs, inner = dict(plan.input_plan), model.forward

        def constrain(key, a):
            if key in specs and isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                pls = to_placements(specs[key], mesh, a.ndim, f"input {key!r}")
                return with_sharding_constraint(a, mesh, pls)
            return a

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            args = tuple(constrain(i, a) for i, a in enumerate(args))
            kwargs = {k: constrain(k, a) for k, a in kwargs.items()}
            return _apply_output_plan(inner(*args, **kwargs), mesh, plan)

        model.forward = forward
    register_data_axes(mesh, plan.data_axes)
    model._dynamo_dist_plan = plan  # read by tools (explain); not used by the compiler
    return model


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
