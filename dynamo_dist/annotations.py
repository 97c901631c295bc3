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
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

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


# per mesh OBJECT: DeviceMesh compares by value (ranks, axis names), so a new mesh equal to an
# old one (a new process group, another model) must not inherit the old one's data axes
_DATA_AXES: dict[int, tuple["weakref.ref[DeviceMesh]", tuple[str, ...]]] = {}


def register_data_axes(mesh: DeviceMesh, axes) -> None:
    """Record which mesh axes of ``mesh`` carry data parallelism (see ShardingPlan.data_axes)."""
    axes = tuple(dict.fromkeys(data_axes(mesh) + tuple(axes)))
    _DATA_AXES[id(mesh)] = (weakref.ref(mesh, lambda _, k=id(mesh): _DATA_AXES.pop(k, None)), axes)


def data_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """The data-parallel axes registered for this very mesh object (``()`` if none)."""
    ref, axes = _DATA_AXES.get(id(mesh), (None, ()))
    return axes if ref is not None and ref() is mesh else ()


def mesh_from_key(key: str) -> DeviceMesh:
    try:
        return _MESHES[key]
    except KeyError:
        raise KeyError(f"mesh '{key}' named by a sharding constraint no longer exists") from None


# a constraint spec whose text after "|" starts with this carries a bad annotation's message
PIN_ERROR = "!"


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

    Raises TypeError when ``t`` is not a tensor; DistCompileError when the placements cannot
    apply to ``t`` (``validate_placements``: a dim out of range, a Partial op other than sum,
    avg, max, min) or nest a block-strided split with another split of one tensor dim. Several
    mesh axes may Shard one dim (``[Shard(0), Shard(0)]``): nested in mesh-axis order, as DTensor.
    """
    require_tensor("with_sharding_constraint", t)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the raise of our error (fullgraph=True turned it into "Attempted
        # to call a super() attribute"): the backend checks the placements as written
        # (``backend._constraints`` calls ``checked_placements``), naming the user's line
        return sharding_constraint(t, encode_spec(mesh, tuple(placements)))
    return sharding_constraint(t, encode_spec(mesh, checked_placements(
        "with_sharding_constraint", tuple(t.shape), mesh, tuple(placements))))


def checked_placements(what: str, shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple,
                       source: str | None = None) -> Placements:
    """``placements`` validated for a value of GLOBAL ``shape`` on ``mesh`` and normalised
    (Shard(-1) -> Shard(ndim - 1)). Raises DistCompileError (``validate_placements``,
    ``refuse_strided_nesting``) naming ``what`` and the user's ``source`` line."""
    from .plans.spec import refuse_strided_nesting, validate_placements

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


CONSTRAINT_OP = torch.ops.dynamo_dist.sharding_constraint.default


# ---- manual regions (GSPMD's full-to-shard / shard-to-full; DTensor's to_local / from_local) ----
# Code between ``enter_manual`` and ``exit_manual`` computes on this rank's LOCAL tensor. In the
# global graph such values carry their local shapes and are planned as Replicate (nothing is
# moved between them); the two ops mark where values cross between the two worlds.

def gradient_spec(spec: str, entering: bool) -> str:
    """Placements of the cotangent that crosses a region boundary the other way, per mesh axis.

    Shard(d) stays Shard(d); Partial becomes Replicate (every rank's share of a sum has the
    sum's gradient). Replicate: the gradient of a value every rank read whole (``entering``) is
    Partial(sum), each rank's local code adding its own term; where that local code did the same
    on every rank (nothing in it varies over the axis) ``manual.mark_manual`` makes it
    Replicate again, so a redundant computation is not counted once per rank (JAX shard_map's
    replication tracking makes the same distinction). The gradient of a value that left a region
    as Replicate (``entering`` False) enters as Replicate (DTensor's from_local convention)."""
    key, pls = decode_spec(spec)
    swapped = tuple(Partial("sum") if isinstance(p, Replicate) and entering else
                    Replicate() if isinstance(p, Partial) else p for p in pls)
    return f"{key}|{fmt(swapped)}"


def manual_local_shape(shape, spec: str) -> list[int]:
    """The LOCAL shape a value of GLOBAL ``shape`` has inside a manual region under ``spec``."""
    from inductor_passes.sharding.placements import local_shape

    key, pls = decode_spec(spec)
    return list(local_shape(tuple(shape), pls, tuple(mesh_from_key(key).shape)))


def _outside_dist(name: str):
    raise RuntimeError(f"dynamo_dist::{name} marks a manual-sharding region boundary and runs "
                       f"only inside a program compiled with backend='dist'; eagerly, use "
                       f"DTensor.to_local / DTensor.from_local (enable_manual_sharding does)")


@torch.library.custom_op("dynamo_dist::enter_manual", mutates_args=())
def enter_manual(x: torch.Tensor, spec: str) -> torch.Tensor:
    """GLOBAL ``x`` in placements ``spec`` -> this rank's LOCAL tensor (full-to-shard)."""
    _outside_dist("enter_manual")


@enter_manual.register_fake
def _(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.new_empty(manual_local_shape(x.shape, spec))


@torch.library.custom_op("dynamo_dist::exit_manual", mutates_args=())
def exit_manual(x: torch.Tensor, spec: str, shape: list[int]) -> torch.Tensor:
    """This rank's LOCAL ``x`` -> the GLOBAL value of ``shape`` it is a piece of under
    placements ``spec`` (shard-to-full)."""
    _outside_dist("exit_manual")


@exit_manual.register_fake
def _(x: torch.Tensor, spec: str, shape: list[int]) -> torch.Tensor:
    return x.new_empty(shape)


def _enter_setup(ctx, inputs, output):
    ctx.spec, ctx.shape = inputs[1], list(inputs[0].shape)


def _enter_backward(ctx, grad):
    return exit_manual(grad, gradient_spec(ctx.spec, entering=True), ctx.shape), None


def _exit_setup(ctx, inputs, output):
    ctx.spec = inputs[1]


def _exit_backward(ctx, grad):
    return enter_manual(grad, gradient_spec(ctx.spec, entering=False)), None, None


enter_manual.register_autograd(_enter_backward, setup_context=_enter_setup)
exit_manual.register_autograd(_exit_backward, setup_context=_exit_setup)

ENTER_OP = torch.ops.dynamo_dist.enter_manual.default
EXIT_OP = torch.ops.dynamo_dist.exit_manual.default
