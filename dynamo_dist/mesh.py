"""torch_xla-style logical meshes: ``Mesh``, ``HybridMesh`` and a process-wide global mesh.

A ``Mesh`` names a logical arrangement of devices (global ranks) with axis names, as
``torch_xla.distributed.spmd.Mesh`` and ``jax.sharding.Mesh`` do. It converts losslessly to and
from torch's ``DeviceMesh``, which is what the compiler and DTensor use; the conversion keeps the
axis names and the rank arrangement. ``HybridMesh`` (torch_xla's name; GSPMD's "ICI x DCN" mesh)
builds a mesh whose axes span fast links inside a slice (ICI: NVLink, one host) and slow links
between slices (DCN: the data-centre network); the cost model prices collectives on an axis that
crosses slices ``DCN_SLOWDOWN`` times higher per byte.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from inductor_passes.core import mesh_facts

# Bytes on a DCN link cost this many times a byte on ICI: ~400 GB/s NVLink vs ~50 GB/s
# (400 Gb/s) per-host network. A single constant until calibrated per machine.
DCN_SLOWDOWN = 8.0


class Mesh:
    """A logical device mesh.

    Args:
        device_ids: global ranks, ``prod(mesh_shape)`` of them, in row-major mesh order.
        mesh_shape: size of each mesh axis.
        axis_names: one unique name per mesh axis (optional; axes are then "0", "1", ...).
        axis_slowdown: per mesh axis, the relative cost of a byte moved on it (1.0: fast links).
    Raises:
        ValueError: wrong id count, duplicate ids or names, or a name count that does not match.
    """

    def __init__(self, device_ids: Sequence[int] | torch.Tensor, mesh_shape: Sequence[int],
                 axis_names: Sequence[str] | None = None,
                 axis_slowdown: Sequence[float] | None = None) -> None:
        ids = [int(i) for i in (device_ids.flatten().tolist()
                                if isinstance(device_ids, torch.Tensor) else device_ids)]
        shape = tuple(int(s) for s in mesh_shape)
        if len(ids) != math.prod(shape):
            raise ValueError(f"Mesh: {len(ids)} device ids for mesh shape {shape} "
                             f"({math.prod(shape)} devices); fix: give one id per device")
        if len(set(ids)) != len(ids):
            raise ValueError(f"Mesh: device ids repeat: {ids}; fix: list each rank once")
        names = tuple(axis_names) if axis_names is not None else None
        if names is not None and (len(names) != len(shape) or len(set(names)) != len(names)):
            raise ValueError(f"Mesh: axis names {names} must be {len(shape)} unique names, one "
                             f"per mesh axis of {shape}; fix: name each mesh axis once")
        self.device_ids = tuple(ids)
        self.mesh_shape = shape
        self.axis_names = names
        self.axis_slowdown = tuple(float(w) for w in axis_slowdown) if axis_slowdown \
            else (1.0,) * len(shape)
        self._device_mesh: DeviceMesh | None = None
        if dist.is_initialized() and max(ids) < dist.get_world_size():
            # built now (every rank builds the same meshes, in the same order), so code compiled
            # later only reads it: building one inside a compiled region would break the graph
            self.to_device_mesh()

    def size(self) -> int:
        """Number of devices."""
        return len(self.device_ids)

    def shape(self) -> "OrderedDict[str, int]":
        """Axis name -> axis size, in mesh order (torch_xla's convention)."""
        return OrderedDict(zip(self._names(), self.mesh_shape))

    def get_logical_mesh(self) -> torch.Tensor:
        """The device ids arranged in ``mesh_shape`` (int64 tensor)."""
        return torch.tensor(self.device_ids, dtype=torch.int64).reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> int | None:
        """The mesh axis index of ``name`` (None when the mesh has no axis of that name)."""
        names = self._names()
        return names.index(name) if name in names else None

    def axis_index(self, axis: int | str) -> int:
        """A mesh axis given by index or name -> its index. Raises ValueError if unknown."""
        if isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < len(self.mesh_shape):
            return axis
        idx = self.get_axis_name_idx(axis) if isinstance(axis, str) else None
        if idx is None:
            raise ValueError(f"unknown mesh axis {axis!r}: the mesh has axes "
                             f"{list(self.shape().items())}; give a name or an index below "
                             f"{len(self.mesh_shape)}")
        return idx

    def _names(self) -> tuple[str, ...]:
        return self.axis_names or tuple(str(i) for i in range(len(self.mesh_shape)))

    def to_device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The torch DeviceMesh with the same ranks and axis names (built once; needs an
        initialised default process group whose world holds every device id)."""
        if self._device_mesh is None:
            if not dist.is_initialized():
                raise RuntimeError("Mesh.to_device_mesh: no process group; call "
                                   "torch.distributed.init_process_group first")
            if max(self.device_ids) >= dist.get_world_size():
                raise ValueError(f"Mesh.to_device_mesh: device ids up to {max(self.device_ids)} "
                                 f"but the world has {dist.get_world_size()} ranks")
            kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            self._device_mesh = DeviceMesh(kind, self.get_logical_mesh(),
                                           mesh_dim_names=self._names())
            set_axis_slowdown(self._device_mesh, self.axis_slowdown)
        return self._device_mesh

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> "Mesh":
        """The Mesh of a torch DeviceMesh (same ranks, axis names and axis costs)."""
        out = cls(mesh.mesh.flatten().tolist(), tuple(mesh.shape), mesh.mesh_dim_names,
                  axis_slowdown(mesh))
        out._device_mesh = mesh
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and (self.device_ids, self.mesh_shape, self.axis_names) \
            == (other.device_ids, other.mesh_shape, other.axis_names)

    def __hash__(self) -> int:
        return hash((self.device_ids, self.mesh_shape, self.axis_names))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self.shape().items())
        return f"{type(self).__name__}({axes}; ranks {self.device_ids[0]}..{self.device_ids[-1]})"


class HybridMesh(Mesh):
    """A mesh over slices: ``ici_mesh_shape`` inside each slice (fast links), ``dcn_mesh_shape``
    across slices (slow links), axis by axis. Axis i has size ``dcn[i] * ici[i]``; the DCN factor
    is the outer one, so ranks of one slice are consecutive (torch_xla's HybridMesh layout).
    Axes with ``dcn[i] > 1`` cross slices and are priced ``DCN_SLOWDOWN`` x per byte.

    Raises:
        ValueError: the two shapes differ in length, or their product is not the world size
            (when a process group is initialised).
    """

    def __init__(self, *, ici_mesh_shape: Sequence[int], dcn_mesh_shape: Sequence[int] | None = None,
                 axis_names: Sequence[str] | None = None) -> None:
        ici = tuple(int(s) for s in ici_mesh_shape)
        dcn = tuple(int(s) for s in dcn_mesh_shape) if dcn_mesh_shape else (1,) * len(ici)
        if len(ici) != len(dcn):
            raise ValueError(f"HybridMesh: ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must "
                             f"have one entry per mesh axis each")
        n = math.prod(ici) * math.prod(dcn)
        if dist.is_initialized() and n != dist.get_world_size():
            raise ValueError(f"HybridMesh: {ici} x {dcn} is {n} devices but the world has "
                             f"{dist.get_world_size()} ranks")
        # ranks laid out as (slice coordinates..., in-slice coordinates...), then each mesh axis
        # takes its DCN factor as the outer part of its index
        ids = torch.arange(n).reshape(*dcn, *ici)
        k = len(ici)
        order = [d for i in range(k) for d in (i, k + i)]
        ids = ids.permute(order).reshape([dcn[i] * ici[i] for i in range(k)])
        self.ici_mesh_shape, self.dcn_mesh_shape = ici, dcn
        super().__init__(ids.flatten().tolist(), tuple(ids.shape), axis_names,
                         [DCN_SLOWDOWN if d > 1 else 1.0 for d in dcn])


_GLOBAL_MESH: Mesh | None = None


def set_global_mesh(mesh: Mesh | DeviceMesh) -> None:
    """Make ``mesh`` the default of ``mark_sharding`` and friends when no mesh is given."""
    global _GLOBAL_MESH
    _GLOBAL_MESH = mesh if isinstance(mesh, Mesh) else Mesh.from_device_mesh(mesh)


def get_global_mesh() -> Mesh | None:
    """The mesh set by ``set_global_mesh`` (None if none was)."""
    return _GLOBAL_MESH


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """A 1-D mesh over every rank of the default process group (one rank if none)."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    return Mesh(list(range(n)), (n,), (axis_name,) if axis_name else None)


def as_device_mesh(mesh: Mesh | DeviceMesh | None) -> DeviceMesh:
    """``mesh`` (or the global mesh when None) as a torch DeviceMesh. Raises ValueError when no
    mesh is given and none is set."""
    if mesh is None:
        mesh = _GLOBAL_MESH
        if mesh is None:
            raise ValueError("no mesh given and no global mesh set; pass a Mesh/DeviceMesh or "
                             "call dynamo_dist.set_global_mesh(mesh) first")
    return mesh.to_device_mesh() if isinstance(mesh, Mesh) else mesh


def set_axis_slowdown(mesh: DeviceMesh, slowdown: Sequence[float]) -> None:
    """Record the relative per-byte cost of each mesh axis of ``mesh`` for the cost model."""
    mesh_facts.set_axis_weights(mesh, slowdown)


def axis_slowdown(mesh: DeviceMesh) -> tuple[float, ...]:
    """Per mesh axis, the relative per-byte cost the cost model uses (1.0 unless set)."""
    return mesh_facts.axis_weights(mesh)
