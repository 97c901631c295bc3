"""What a sharding plan is: ``ShardingPlan`` (plain data: fqn pattern -> placement spec), the
record of each planner decision (``ParamDecision``), and how a placement spec reads.

A placement spec is any of:
  * a sequence of torch Placements, one per mesh axis: ``(Replicate(), Shard(0))``
  * a dict mesh-axis-name -> Placement (axes not named are Replicate): ``{"tp": Shard(0)}``
  * a ``PartitionSpec``: one entry per TENSOR dim naming the mesh axis (or axes, or None) it is
    split over, torch_xla/JAX style: ``PartitionSpec("dp", None)``
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Mapping, Sequence

from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from inductor_passes.core.errors import DistCompileError
from inductor_passes.core.placements import fmt


class PartitionSpec(tuple):
    """Per tensor dim: None, a mesh axis name (or index), or a tuple of them."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return f"PartitionSpec{tuple(self)!r}"


def mesh_axis(mesh: DeviceMesh, axis: Any) -> int | None:
    """The index of mesh axis ``axis`` (its name, or an index below ``mesh.ndim``), or None."""
    names = list(mesh.mesh_dim_names or ())
    if isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < mesh.ndim:
        return axis
    if isinstance(axis, str) and axis in names:
        return names.index(axis)
    return None


def spec_problem(mesh: DeviceMesh, partition_spec: Sequence[Any], ndim: int,
                 shape: Sequence[int] | None = None) -> str | None:
    """Why ``partition_spec`` cannot describe an ``ndim``-D tensor (GLOBAL ``shape``, when
    known) on ``mesh``, ending with a fix ("...; fix: ..."), or None: a length other than
    ``ndim``, an unknown mesh axis, a mesh axis used twice, or one dim's axes out of mesh order
    (DTensor cannot express that split). Returned, not raised: inside a compiled program the
    backend raises it (Dynamo cannot trace the raise), naming the user's line."""
    spec, axes_of = tuple(partition_spec), list(mesh.mesh_dim_names or range(mesh.ndim))
    tensor = f"a {ndim}-D tensor" + (f" of shape {tuple(shape)}" if shape is not None else "")
    where = f"partition spec {spec} for {tensor} on mesh axes {axes_of}"
    if len(spec) != ndim:
        return (f"{where}: {len(spec)} entries; fix: give one entry per tensor dim (None for a "
                f"dim that is not split)")
    used: set[int] = set()
    for d, entry in enumerate(spec):
        entries = entry if isinstance(entry, (tuple, list)) else (entry,)
        named = [a for a in entries if a is not None]
        axes = [mesh_axis(mesh, a) for a in named]
        if None in axes:
            bad = named[axes.index(None)]
            return (f"{where}: unknown mesh axis {bad!r}; fix: name one of {axes_of} (or give "
                    f"placements, one Shard / Replicate / Partial per mesh axis)")
        if axes != sorted(axes):
            return (f"{where}: dim {d} is split over mesh axes {axes} out of mesh order; fix: "
                    f"list them outer axis first, {sorted(axes)}")
        for a in axes:
            if a in used:
                return (f"{where}: mesh axis {axes_of[a]!r} is used twice; fix: split each "
                        f"mesh axis over one tensor dim at most")
            used.add(a)
    return None


def spec_placements(mesh: DeviceMesh, partition_spec: Sequence[Any]) -> tuple[Placement, ...]:
    """A partition spec ``spec_problem`` accepts -> one placement per mesh axis."""
    out: list[Placement] = [Replicate()] * mesh.ndim
    for d, entry in enumerate(partition_spec):
        for a in (entry if isinstance(entry, (tuple, list)) else (entry,)):
            if a is not None:
                out[mesh_axis(mesh, a)] = Shard(d)
    return tuple(out)


def to_placements(spec: Any, mesh: DeviceMesh, ndim: int, what: str) -> tuple[Placement, ...]:
    """Any placement spec (see module doc) -> one Placement per mesh axis. A ``PartitionSpec``
    shorter than the tensor leaves its trailing dims whole (JAX's rule); anything else
    ``spec_problem`` names raises DistCompileError (a repeated mesh axis used to overwrite the
    first silently)."""
    if isinstance(spec, PartitionSpec):
        full = tuple(spec) + (None,) * (ndim - len(spec))  # (a longer spec: spec_problem's)
        problem = spec_problem(mesh, full, ndim)
        if problem is not None:
            why, _, fix = problem.partition("; fix: ")
            raise DistCompileError(f"{what}: {why}", mesh=mesh, fix=fix or None)
        return spec_placements(mesh, full)
    if isinstance(spec, Mapping):
        out = [Replicate()] * mesh.ndim
        for axis, p in spec.items():
            index = mesh_axis(mesh, axis)
            if index is None:
                names = list(mesh.mesh_dim_names or ())
                raise DistCompileError(f"{what}: unknown mesh axis {axis!r}", mesh=mesh,
                                       fix=f"use one of the mesh's axis names {names} or an "
                                           f"index below {mesh.ndim}")
            out[index] = p
        return tuple(out)
    return tuple(spec)


# the pending reductions lowering completes exactly (a product would need x ** (1 / n) pieces)
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
    decisions:    what the planners decided for each parameter and why (``ParamDecision``);
                  ``summary()`` prints them. Not read by ``shard_module``.

    An input_plan key ``"*"`` stands for every tensor argument the other keys do not name.
    """

    plan: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    input_plan: Mapping[int | str, Any] = dataclasses.field(default_factory=dict)
    output_plan: Mapping[int | str, Any] = dataclasses.field(default_factory=dict)
    return_local_tensor: bool | tuple[int | str, ...] = False
    data_axes: tuple[str, ...] = ()
    decisions: tuple["ParamDecision", ...] = ()

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
                            data_axes=tuple(dict.fromkeys(self.data_axes + other.data_axes)),
                            decisions=self.decisions + other.decisions)

    def summary(self) -> str:
        """One line per planner decision: parameter, GLOBAL shape, mesh axis, placement, role
        and reason; replicated parameters last."""
        return format_decisions(self.decisions)


@dataclasses.dataclass(frozen=True)
class ParamDecision:
    """One planner's decision for one parameter on one mesh axis.

    ``names``: every name the parameter has in the module (tied parameters have several);
    ``shape``: GLOBAL; ``placement``: on ``axis``; ``role``: what the planner took the parameter
    for (``column``, ``row``, ``fsdp``, ``replicated``...); ``reason``: why, in words.
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    axis: str
    placement: Placement
    role: str
    reason: str

    @property
    def sharded(self) -> bool:
        return not isinstance(self.placement, Replicate)


def format_decisions(decisions: Sequence[ParamDecision]) -> str:
    rows = sorted(decisions, key=lambda d: (not d.sharded, d.axis))
    lines = [f"{'parameter':<48} {'shape':<16} {'axis':<5} {'placement':<10} {'role':<11} reason"]
    for d in rows:
        name = d.names[0] + (f" (= {', '.join(d.names[1:])})" if len(d.names) > 1 else "")
        pl = fmt((d.placement,))[1:-1]
        lines.append(f"{name:<48} {str(d.shape):<16} {d.axis:<5} {pl:<10} {d.role:<11} "
                     f"{d.reason}")
    return "\n".join(lines)


