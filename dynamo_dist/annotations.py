"""Sharding annotations that trace into the graph as one custom op.

``with_sharding_constraint(t, mesh, placements)`` pins the placement of a value. Eagerly it is a
copy; under torch.compile it is the op ``dynamo_dist::sharding_constraint(Tensor x, str spec)``,
whose string argument names the mesh and the placements, so Dynamo keeps it as a constant (no
graph break; a different spec is a different graph). The backend reads the spec back, pins the
value's placement in the plan and lowers the op to the redistribute it implies.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from . import _compat
from inductor_passes.sharding.placements import Placements, fmt, normalize, parse

_MESHES: "weakref.WeakValueDictionary[str, DeviceMesh]" = weakref.WeakValueDictionary()


_KEYS: "weakref.WeakKeyDictionary[DeviceMesh, str]" = weakref.WeakKeyDictionary()


@_compat.assume_constant_result
def mesh_key(mesh: DeviceMesh) -> str:
    """A stable name for a mesh: axis names, shape and the ranks it spans.

    Cached per mesh: the first call reads the rank tensor, which must not happen under a fake
    or tracing mode (the backend's capture asks again while tracing).
    """
    key = _KEYS.get(mesh)
    if key is None:
        names = ",".join(mesh.mesh_dim_names or ())
        ranks = mesh.mesh.flatten().tolist()
        key = f"{names}/{'x'.join(map(str, mesh.shape))}/{ranks[0]}-{ranks[-1]}:{len(ranks)}"
        _KEYS[mesh] = key
    _MESHES[key] = mesh
    return key


_DATA_AXES: dict[str, tuple[str, ...]] = {}


def register_data_axes(mesh: DeviceMesh, axes) -> None:
    """Record which mesh axes of ``mesh`` carry data parallelism (see ShardingPlan.data_axes)."""
    key = mesh_key(mesh)
    _DATA_AXES[key] = tuple(dict.fromkeys(_DATA_AXES.get(key, ()) + tuple(axes)))


def data_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    return _DATA_AXES.get(mesh_key(mesh), ())


def mesh_from_key(key: str) -> DeviceMesh:
    try:
        return _MESHES[key]
    except KeyError:
        raise KeyError(f"mesh '{key}' named by a sharding constraint no longer exists") from None


def encode_spec(mesh: DeviceMesh, placements: Placements) -> str:
    return f"{mesh_key(mesh)}|{fmt(placements)}"


def decode_spec(spec: str) -> tuple[str, Placements]:
    key, _, text = spec.partition("|")
    return key, parse(text)


@torch.library.custom_op("dynamo_dist::sharding_constraint", mutates_args=())
def sharding_constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@sharding_constraint.register_fake
def _(x: torch.Tensor, spec: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor):
    # The cotangent is left free: the plan puts it wherever the backward graph needs it.
    return grad, None


sharding_constraint.register_autograd(_backward)


def with_sharding_constraint(t: torch.Tensor, mesh: DeviceMesh,
                             placements: Sequence[Placement]) -> torch.Tensor:
    """Pin ``t`` (global shape) to ``placements`` (one per mesh axis) at this point of the program.

    Raises ValueError when the placements cannot apply to ``t`` (see ``validate_placements``).
    """
    from .plans import validate_placements

    placements = normalize(tuple(placements), t.ndim)
    validate_placements("with_sharding_constraint", tuple(t.shape), mesh, placements)
    return sharding_constraint(t, encode_spec(mesh, placements))


CONSTRAINT_OP = torch.ops.dynamo_dist.sharding_constraint.default
