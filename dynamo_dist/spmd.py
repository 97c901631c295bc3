"""torch_xla-style sharding annotations (``torch_xla.distributed.spmd``), on DTensor placements.

A partition spec has one entry per TENSOR dim: None (not split), a mesh axis (index or name), or
a tuple of mesh axes (the dim split over several axes, outer axis first). It converts losslessly
to DTensor placements (one per mesh axis) and back, for Shard/Replicate; ``Partial`` has no
partition-spec form.

Every function works eagerly and inside a program compiled with ``backend="dist"``, where it
becomes graph nodes with constant arguments (no graph break; Dynamo guards on the spec, so a new
spec compiles a new graph):

  mark_sharding / with_sharding_constraint   pin a value's placement (a sharding constraint)
  enable_manual_sharding / disable_manual_sharding   enter / leave local code (GSPMD's
      full-to-shard / shard-to-full custom calls; DTensor's to_local / from_local)
  local_map                                  a function written on local shards, called on
                                             global values
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils.weak import WeakTensorKeyDictionary

from inductor_passes.core import compat
from inductor_passes.core.annotation_ops import PIN_ERROR, mesh_key, sharding_constraint
from inductor_passes.core.errors import DistCompileError
from inductor_passes.core.placements import is_split, is_strided, local_shape
from inductor_passes.layout import contiguous_strides

from .annotations import pin_placements as constrain, require_tensor, validate_placements
from .mesh import Mesh, as_device_mesh
from .plans import PartitionSpec
from .plans.spec import spec_placements, spec_problem

MeshLike = Mesh | DeviceMesh | None


def partition_spec_to_placements(mesh: MeshLike, partition_spec: Sequence[Any], ndim: int,
                                 shape: Sequence[int] | None = None) -> tuple[Placement, ...]:
    """Partition spec (one entry per tensor dim of an ``ndim``-D tensor) -> one placement per
    mesh axis. Raises ValueError (``spec_problem``: the spec, the mesh axes and a fix) on an
    unknown axis, an axis used twice, a spec longer than the tensor, or a tuple whose axes are
    not in mesh order (DTensor cannot express that split)."""
    dm = as_device_mesh(mesh)
    problem = spec_problem(dm, partition_spec, ndim, shape)
    if problem is not None:
        raise ValueError(problem)
    return spec_placements(dm, partition_spec)


def placements_to_partition_spec(mesh: MeshLike, placements: Sequence[Placement],
                                 ndim: int) -> PartitionSpec:
    """One placement per mesh axis -> partition spec of an ``ndim``-D tensor (axis names where
    the mesh has them). Raises ValueError for Partial, which a partition spec cannot express."""
    dm = as_device_mesh(mesh)
    names = dm.mesh_dim_names
    entries: list[list] = [[] for _ in range(ndim)]
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"placements {list(placements)}: Partial on mesh axis {axis} has no "
                             f"partition-spec form; fix: reduce it first (redistribute to "
                             f"Replicate)")
        if is_strided(p):
            raise ValueError(f"placements {list(placements)}: {p!r} on mesh axis {axis} (block-"
                             f"strided) has no partition-spec form; fix: use the placements as "
                             f"they are, or redistribute to Shard({p.dim})")
        if isinstance(p, Shard):
            entries[p.dim % ndim].append(names[axis] if names else axis)
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))


def _resolve(mesh: MeshLike, spec, shape: Sequence[int]) -> tuple[DeviceMesh, tuple]:
    """(DeviceMesh, one placement per mesh axis) from a partition spec or placements, for a
    tensor of GLOBAL ``shape``."""
    dm = as_device_mesh(mesh)
    if not torch.compiler.is_compiling():
        # plain tensors in our programs are global values: DTensor must read them as Replicate
        compat.allow_implicit_replication(True)
    if spec and all(isinstance(p, Placement) for p in spec):
        return dm, tuple(spec)
    return dm, partition_spec_to_placements(dm, spec, len(shape), shape)


# plain tensors annotated eagerly: inputs of a later compiled call (read by the backend)
_ANNOTATED = WeakTensorKeyDictionary()  # tensor -> (DeviceMesh, placements)


def input_annotation(t: torch.Tensor) -> tuple[DeviceMesh, tuple] | None:
    """(mesh, placements) that ``mark_sharding`` gave this plain tensor eagerly, if any."""
    return _ANNOTATED.get(t) if not isinstance(t, DTensor) else None


def mark_sharding(t: torch.Tensor, mesh: MeshLike, partition_spec: Sequence[Any]) -> torch.Tensor:
    """Annotate ``t`` (GLOBAL shape) with a partition spec (or placements, one per mesh axis).

    Inside a compiled program: a sharding constraint node; returns the constrained value, which
    the program must use. Eagerly on a plain tensor (a global value, the same on every rank):
    records the annotation, so that passing ``t`` to a compiled program plans it in that
    placement (each rank slices its piece; no communication), and returns the DTensor of it.
    Eagerly on a DTensor: returns ``t`` redistributed. ``mesh`` None: the global mesh.
    Raises TypeError when ``t`` is not a tensor, ValueError for a bad spec (see
    ``partition_spec_to_placements``), DistCompileError for placements that cannot apply.
    """
    require_tensor("mark_sharding", t)
    if torch.compiler.is_compiling():
        return _pin_in_program("mark_sharding", t, mesh, partition_spec)
    dm, pls = _resolve(mesh, partition_spec, tuple(t.shape))
    if isinstance(t, DTensor):
        return t.redistribute(dm, pls)

    validate_placements("mark_sharding", tuple(t.shape), dm, pls)
    _ANNOTATED[t] = (dm, pls)
    return DTensor.from_local(t, dm, [Replicate()] * dm.ndim, run_check=False).redistribute(dm, pls)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Drop an eager ``mark_sharding`` annotation: ``t`` is again a replicated global value
    (a DTensor is returned as its full value). Returns the plain tensor."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    _ANNOTATED.pop(t, None)
    return t


def with_sharding_constraint(t: torch.Tensor, mesh: MeshLike, spec: Sequence[Any]) -> torch.Tensor:
    """Pin ``t`` to a partition spec or to placements at this point of the program (JAX's
    ``with_sharding_constraint``). Returns the constrained value. Raises TypeError for a
    non-tensor, ValueError on a bad spec, DistCompileError for placements that cannot apply."""
    require_tensor("with_sharding_constraint", t)
    if torch.compiler.is_compiling():
        return _pin_in_program("with_sharding_constraint", t, mesh, spec)
    dm, pls = _resolve(mesh, spec, tuple(t.shape))
    return constrain(t, dm, pls)


def _pin_in_program(what: str, t: torch.Tensor, mesh: MeshLike, spec) -> torch.Tensor:
    """A pin traced by Dynamo: a bad partition spec is carried to the backend in the
    constraint node, which raises it naming the user's line (``annotations.PIN_ERROR``)."""
    dm = as_device_mesh(mesh)
    if spec and all(isinstance(p, Placement) for p in spec):
        return constrain(t, dm, tuple(spec))
    problem = spec_problem(dm, spec, t.ndim, tuple(t.shape))
    if problem is not None:
        return sharding_constraint(t, f"{mesh_key(dm)}|{PIN_ERROR}{what}: {problem}")
    return constrain(t, dm, partition_spec_to_placements(dm, spec, t.ndim))


def enable_manual_sharding(t: torch.Tensor, partition_spec: Sequence[Any], *,
                           mesh: MeshLike = None) -> torch.Tensor:
    """GLOBAL ``t`` -> this rank's LOCAL piece under ``partition_spec`` (GSPMD full-to-shard).
    Code on the result is local code: it runs as written on every rank, collectives included.
    Pair with ``disable_manual_sharding``. Raises TypeError for a non-tensor, ValueError on a
    bad spec; under compile, DistCompileError when the split is uneven."""
    require_tensor("enable_manual_sharding", t)
    dm, pls = _resolve(mesh, partition_spec, tuple(t.shape))
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, dm, [Replicate()] * dm.ndim, run_check=False)
    return t.redistribute(dm, pls).to_local()


def disable_manual_sharding(t: torch.Tensor, partition_spec: Sequence[Any],
                            full_shape: Sequence[int], *, mesh: MeshLike = None) -> torch.Tensor:
    """This rank's LOCAL ``t`` -> the GLOBAL value of ``full_shape`` it is a piece of under
    ``partition_spec`` (GSPMD shard-to-full). Returns a DTensor (a global value). Raises
    ValueError on a bad spec, DistCompileError when ``t``'s shape is no rank's piece of
    ``full_shape`` under the spec (a wrong ``full_shape`` made an inconsistent DTensor)."""
    require_tensor("disable_manual_sharding", t)
    dm, pls = _resolve(mesh, partition_spec, tuple(full_shape))
    _check_piece(tuple(t.shape), tuple(int(s) for s in full_shape), dm, pls)
    return DTensor.from_local(t, dm, pls, run_check=False, shape=torch.Size(full_shape),
                              stride=contiguous_strides(full_shape))


def _check_piece(local: tuple, full: tuple, dm: DeviceMesh, pls) -> None:
    """Raise DistCompileError unless ``local`` is the shape of some rank's piece of a value of
    GLOBAL shape ``full`` under ``pls`` (every coordinate is tried: the check must not depend on
    which rank runs it, so that all ranks raise alike)."""
    import itertools



    mesh_shape = tuple(dm.shape)
    pieces = set()
    if len(local) == len(full):
        pieces = {local_shape(full, pls, mesh_shape, c)
                  for c in itertools.product(*(range(n) for n in mesh_shape))}
    if local not in pieces:
        raise DistCompileError(
            f"disable_manual_sharding: a local tensor of shape {local} is not a piece of "
            f"full_shape {full} under {list(pls)} (pieces: {sorted(pieces)})",
            shapes=[full], mesh=dm, placements=list(pls),
            fix="pass the GLOBAL shape the pieces make up as full_shape (for an even split: "
                "the local size times the mesh axis size on each split dim)")


def local_map(out_specs: Any, in_specs: Sequence[Any], *, mesh: MeshLike = None,
              out_shapes: Callable[..., Any] | None = None) -> Callable:
    """Decorator: ``fn`` is written on LOCAL shards; the decorated function takes and returns
    GLOBAL values. Each positional tensor argument enters in its spec of ``in_specs`` (a
    partition spec, placements, or None: passed as is); each tensor result leaves in
    ``out_specs`` (one spec, or a tuple of specs for a tuple result). Global output shapes are
    the local ones scaled by the split (even splits), or ``out_shapes(*global_args)``.
    (DTensor's ``local_map`` and JAX's ``shard_map`` follow the same contract.)"""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            dm = as_device_mesh(mesh)
            local = [a if spec is None or not isinstance(a, torch.Tensor) else
                     enable_manual_sharding(a, spec, mesh=dm) for a, spec in zip(args, in_specs)]
            out = fn(*local, *args[len(in_specs):], **kwargs)
            single = isinstance(out, torch.Tensor)
            outs, specs = ((out,), (out_specs,)) if single else (tuple(out), tuple(out_specs))
            shapes = out_shapes(*args) if out_shapes is not None else None
            shapes = (shapes,) if single and shapes is not None else shapes
            res = []
            for k, (o, spec) in enumerate(zip(outs, specs)):
                if spec is None or not isinstance(o, torch.Tensor):
                    res.append(o)
                    continue
                shape = shapes[k] if shapes is not None else _global_shape(o, dm, spec)
                res.append(disable_manual_sharding(o, spec, shape, mesh=dm))
            return res[0] if single else type(out)(res)
        return run
    return wrap


def _global_shape(local: torch.Tensor, mesh: DeviceMesh, spec) -> list[int]:
    _, pls = _resolve(mesh, spec, tuple(local.shape))
    shape = list(local.shape)
    for axis, p in enumerate(pls):
        if is_split(p):
            shape[p.dim] *= mesh.shape[axis]
    return shape
