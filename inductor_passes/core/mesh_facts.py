"""What the planner knows of a mesh beyond its shape, carried by the DeviceMesh object itself.

Two facts: which mesh axes carry data parallelism (``ShardingPlan.data_axes``, recorded by
``shard_module``) and the relative cost of a byte on each mesh axis (a ``HybridMesh``'s axes that
cross slices are slower). They live on the very mesh object, not in a process-wide registry:
DeviceMesh compares by value (ranks, axis names), so a new mesh equal to an old one (a new
process group, another model) must not inherit the old one's facts, and the facts go when the
mesh goes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from . import compat

_ATTR = "_dynamo_dist_mesh_facts"


@dataclasses.dataclass(frozen=True)
class MeshFacts:
    data_axes: tuple[str, ...] = ()
    axis_weights: tuple[float, ...] | None = None  # None: 1.0 on every axis


def facts(mesh) -> MeshFacts:
    """The facts recorded on ``mesh`` (a DeviceMesh, or Dynamo's stand-in for one: the mesh
    behind it is read), or none."""
    return getattr(compat.real_object(mesh), _ATTR, None) or MeshFacts()


def add_data_axes(mesh, axes: Sequence[str]) -> None:
    """Record mesh axes of ``mesh`` that carry data parallelism (kept with those already there)."""
    old = facts(mesh)
    setattr(mesh, _ATTR, dataclasses.replace(
        old, data_axes=tuple(dict.fromkeys(old.data_axes + tuple(axes)))))


def data_axes(mesh) -> tuple[str, ...]:
    """The data-parallel mesh axes recorded on this very mesh object (``()`` if none)."""
    return facts(mesh).data_axes


def set_axis_weights(mesh, weights: Sequence[float]) -> None:
    """Per mesh axis of ``mesh``, the relative cost of one byte moved on it (1.0: fast links).
    Raises ValueError unless there is one positive number per mesh axis."""
    if len(weights) != mesh.ndim or any(w <= 0 for w in weights):
        raise ValueError(f"axis weights {tuple(weights)}: need {mesh.ndim} positive numbers")
    setattr(mesh, _ATTR, dataclasses.replace(facts(mesh),
                                             axis_weights=tuple(float(w) for w in weights)))


def axis_weights(mesh) -> tuple[float, ...]:
    """Per mesh axis, the relative cost of one byte (1.0 unless recorded)."""
    return facts(mesh).axis_weights or (1.0,) * mesh.ndim
