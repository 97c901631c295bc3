"""The custom ops that carry sharding annotations through Dynamo, AOTAutograd and make_fx.

``dynamo_dist::sharding_constraint(Tensor x, str spec)`` pins a value's placements; ``enter_manual``
/ ``exit_manual`` bound code that computes on this rank's LOCAL tensor. Each op's string argument
(``encode_spec``: mesh key and placements) is a constant to Dynamo, so an annotation never breaks
the graph and a different spec is a different graph. The user API that emits them is
``dynamo_dist.annotations``; the planner and the lowering read them back (``decode_spec``).
Here at the bottom so both sides use one definition.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate

from . import compat
from .placements import Placements, fmt, local_shape, parse

_MESHES: "weakref.WeakValueDictionary[str, DeviceMesh]" = weakref.WeakValueDictionary()


_KEYS: "weakref.WeakKeyDictionary[DeviceMesh, str]" = weakref.WeakKeyDictionary()


@compat.assume_constant_result
def mesh_key(mesh: DeviceMesh) -> str:
    """A stable name for a mesh: axis names, shape and the ranks it spans.

    Cached per mesh: the first call reads the rank tensor, which must not happen under a fake
    or tracing mode (the backend's capture asks again while tracing). Dynamo's stand-in for the
    mesh (``compat.real_object``) names the mesh behind it.
    """
    mesh = compat.real_object(mesh)
    key = _KEYS.get(mesh)
    if key is None:
        names = ",".join(mesh.mesh_dim_names or ())
        ranks = mesh.mesh.flatten().tolist()
        key = f"{names}/{'x'.join(map(str, mesh.shape))}/{ranks[0]}-{ranks[-1]}:{len(ranks)}"
        _KEYS[mesh] = key
    _MESHES[key] = mesh
    return key


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
