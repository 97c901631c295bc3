"""The user's sharding annotations, validated, and the mesh facts a plan records.

``pin_placements(t, mesh, placements)`` pins the placement of a value (the user API,
``spmd.with_sharding_constraint``, is built on it). Eagerly it is a
copy; under torch.compile it is the op ``dynamo_dist::sharding_constraint(Tensor x, str spec)``
(``inductor_passes.core.annotation_ops``), whose string argument names the mesh and the
placements, so Dynamo keeps it as a constant (no graph break; a different spec is a different
graph). The backend reads the spec back, pins the value's placement in the plan and lowers the
op to the redistribute it implies.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from inductor_passes.core.annotation_ops import encode_spec, sharding_constraint
from inductor_passes.core.errors import DistCompileError, describe_mesh
from inductor_passes.core.placements import SUPPORTED_PARTIAL_OPS, Placements, is_strided, normalize


def pin_placements(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                   what: str = "with_sharding_constraint") -> torch.Tensor:
    """Pin ``t`` (global shape) to ``placements`` (one per mesh axis) at this point of the program:
    the one primitive behind the user's ``with_sharding_constraint`` / ``mark_sharding``
    (``spmd``, which also take partition specs and a dynamo_dist Mesh), plans' input pins and
    capture's manual-region exits. ``what`` names the caller in errors.

    Raises TypeError when ``t`` is not a tensor; DistCompileError when the placements cannot
    apply to ``t`` (``validate_placements``: a dim out of range, a Partial op other than sum,
    avg, max, min) or nest a block-strided split with another split of one tensor dim. Several
    mesh axes may Shard one dim (``[Shard(0), Shard(0)]``): nested in mesh-axis order, as DTensor.
    """
    require_tensor(what, t)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the raise of our error (fullgraph=True turned it into "Attempted
        # to call a super() attribute"): the backend checks the placements as written
        # (``backend._constraints`` calls ``checked_placements``), naming the user's line
        return sharding_constraint(t, encode_spec(mesh, tuple(placements)))
    return sharding_constraint(t, encode_spec(mesh, checked_placements(
        what, tuple(t.shape), mesh, tuple(placements))))


def checked_placements(what: str, shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple,
                       source: str | None = None) -> Placements:
    """``placements`` validated for a value of GLOBAL ``shape`` on ``mesh`` and normalised
    (Shard(-1) -> Shard(ndim - 1)). Raises DistCompileError (``validate_placements``,
    ``refuse_strided_nesting``) naming ``what`` and the user's ``source`` line."""
    # validated before normalising: Shard(-3) of a 2-D tensor must not become Shard(-1)
    validate_placements(what, shape, mesh, placements, source)
    placements = normalize(placements, len(shape))
    refuse_strided_nesting(what, shape, mesh, placements, source)
    return placements


def require_tensor(what: str, t) -> None:
    """Raise TypeError unless ``t`` is a tensor (a list or a number has no shape to shard)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: the value to annotate must be a torch.Tensor, got "
                        f"{type(t).__name__} ({t!r:.60}); fix: pass a tensor "
                        f"(torch.as_tensor(value)), or leave a non-tensor unannotated")


def validate_placements(what: str, shape: Sequence[int], mesh: DeviceMesh,
                        placements: Sequence[Placement], source: str | None = None) -> None:
    """Raise DistCompileError unless ``placements`` can apply to a tensor of GLOBAL ``shape``
    (``source``: the user's line, for a pin inside a compiled program)."""
    def fail(why: str, fix: str):
        raise DistCompileError(f"{what}: {why}", source=source, shapes=[shape],
                               mesh=describe_mesh(mesh), placements=list(placements), fix=fix)

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
        elif is_strided(p):
            k, n = p.split_factor, mesh.size(axis)
            if not -len(shape) <= p.dim < len(shape):
                fail(f"{p!r} on mesh axis '{names[axis]}' but the tensor has {len(shape)} dims",
                     f"use a dim d with 0 <= d < {len(shape)}")
            elif not isinstance(k, int) or k < 1 or shape[p.dim] % (k * n):
                fail(f"{p!r} on mesh axis '{names[axis]}' (size {n}): dim {p.dim} of size "
                     f"{shape[p.dim]} is not {k} blocks each split evenly in {n}",
                     f"use a split_factor k (the number of fused parts) with k x {n} dividing "
                     f"{shape[p.dim]}, or Shard({p.dim})")
        elif isinstance(p, Partial):
            if p.reduce_op not in SUPPORTED_PARTIAL_OPS:
                fail(f"Partial({p.reduce_op!r}) on mesh axis '{names[axis]}': only pending "
                     f"{', '.join(SUPPORTED_PARTIAL_OPS)} reductions are planned",
                     f"use Partial() (a pending sum) or one of {list(SUPPORTED_PARTIAL_OPS)}, or "
                     f"reduce before pinning (Replicate())")
        elif not isinstance(p, Replicate):
            fail(f"unsupported placement {p!r}",
                 "use Shard(d), _StridedShard(d, split_factor=k), Replicate() or Partial()")


def _split_axes_by_dim(shape: Sequence[int],
                       placements: Sequence[Placement]) -> dict[int, list[int]]:
    """Tensor dim -> the mesh axes that split it (Shard or _StridedShard), in mesh-axis order."""
    by_dim: dict[int, list[int]] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) or is_strided(p):
            by_dim.setdefault(p.dim % max(len(shape), 1), []).append(axis)
    return by_dim


def refuse_strided_nesting(what: str, shape: Sequence[int], mesh: DeviceMesh,
                           placements: Sequence[Placement], source: str | None = None) -> None:
    """Raise DistCompileError when a tensor dim is split by two mesh axes and one of them is a
    _StridedShard (DTensor's right-to-left FSDP2-over-TP layout): a value pinned inside the
    program must be one the compiler lowers exactly, and nested strided splits are not (a
    parameter in that layout is fine: DTensor regathers it at the program boundary)."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    for dim, axes in _split_axes_by_dim(shape, placements).items():
        if len(axes) > 1 and any(is_strided(placements[a]) for a in axes):
            raise DistCompileError(
                f"{what}: tensor dim {dim} is split by mesh axes "
                f"{', '.join(repr(names[a]) for a in axes)} and one of them is block-strided "
                f"(_StridedShard); nested splits of a dim are not planned", source=source,
                shapes=[shape], mesh=describe_mesh(mesh), placements=list(placements),
                fix="split that dim on one mesh axis only (another dim on the other), or pin "
                    "Replicate on one of them")
