"""Placement helpers shared by rules, propagation and lowering.

A value's sharding is a tuple with one torch ``Placement`` per mesh axis (``Shard(d)``,
``Replicate()``, ``Partial(op)``), exactly DTensor's convention. Only these three exact types are
accepted in a plan: DTensor's internal variants (``_StridedShard``, ``MaskPartial``) change the
meaning of the local computation and would need lowering we do not do.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

Placements = tuple[Placement, ...]

SUPPORTED_PARTIAL_OPS = ("sum", "avg", "max", "min")


def replicate(ndim_mesh: int) -> Placements:
    return tuple(Replicate() for _ in range(ndim_mesh))


def is_placements(x) -> bool:
    """True for one value's placements (a tuple of Placement), False for a multi-output tuple."""
    return isinstance(x, tuple) and (not x or hasattr(x[0], "is_shard"))


def nonpartial(placements: Placements) -> Placements:
    """The placements with every pending reduction done (Partial -> Replicate)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def is_plain(p: Placement) -> bool:
    """True for exactly Shard / Replicate / Partial(sum|avg|max|min)."""
    if type(p) is Shard or type(p) is Replicate:
        return True
    return type(p) is Partial and p.reduce_op in SUPPORTED_PARTIAL_OPS


def normalize(placements: Sequence[Placement], ndim: int) -> Placements:
    """Shard(-1) -> Shard(ndim-1), so equal shardings compare equal."""
    out = []
    for p in placements:
        if type(p) is Shard and p.dim < 0:
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def shard_counts(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> list[int]:
    """For each tensor dim, how many pieces it is cut into."""
    counts = [1] * len(shape)
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            counts[p.dim] *= mesh_shape[axis]
    return counts


def valid_for(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """Placements a value can hold: plain types, dims in range, even splits, no tensor dim cut by
    two mesh axes (nested sharding is not lowered yet)."""
    seen: set[int] = set()
    for axis, p in enumerate(placements):
        if not is_plain(p):
            return False
        if type(p) is Shard:
            if not 0 <= p.dim < len(shape) or p.dim in seen:
                return False
            seen.add(p.dim)
            if shape[p.dim] % mesh_shape[axis] != 0:
                return False
    return True


def plannable(shape: Sequence[int], placements: Placements,
              mesh_shape: Sequence[int]) -> tuple[Placements, list[str]]:
    """``placements`` with every mesh axis the planner cannot hold replaced by Replicate, and
    why: an uneven split (a dim of GLOBAL size 5 over 4 ranks), a tensor dim split by two mesh
    axes, or an unsupported placement type. Inputs in such placements are redistributed (by
    DTensor, exactly) at the program boundary, and the caller logs the cost."""
    out, why, seen = list(placements), [], set()
    for axis, p in enumerate(placements):
        if not is_plain(p):
            why.append(f"mesh axis {axis}: {p!r} is not supported")
        elif type(p) is Shard and p.dim in seen:
            why.append(f"mesh axis {axis}: dim {p.dim} is already split by another mesh axis")
        elif type(p) is Shard and shape[p.dim] % mesh_shape[axis]:
            why.append(f"mesh axis {axis}: dim {p.dim} of size {shape[p.dim]} does not split "
                       f"evenly over {mesh_shape[axis]} ranks")
        else:
            if type(p) is Shard:
                seen.add(p.dim)
            continue
        out[axis] = Replicate()
    return tuple(out), why


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    counts = shard_counts(shape, placements, mesh_shape)
    return tuple(s // c for s, c in zip(shape, counts))


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def fmt(placements: Placements | None) -> str:
    """Short form: 'S(0)', 'R', 'P(sum)', joined by ',' per mesh axis."""
    if placements is None:
        return "-"
    parts = []
    for p in placements:
        if type(p) is Shard:
            parts.append(f"S({p.dim})")
        elif type(p) is Replicate:
            parts.append("R")
        elif isinstance(p, Partial):
            parts.append(f"P({p.reduce_op})")
        else:
            parts.append(repr(p))
    return "[" + ",".join(parts) + "]"


def parse(text: str) -> Placements:
    """Inverse of ``fmt``: '[S(0),R,P(sum)]' -> (Shard(0), Replicate(), Partial('sum'))."""
    body = text.strip().strip("[]")
    out: list[Placement] = []
    for part in filter(None, (s.strip() for s in body.split(","))):
        if part == "R":
            out.append(Replicate())
        elif part.startswith("S(") and part.endswith(")"):
            out.append(Shard(int(part[2:-1])))
        elif part.startswith("P(") and part.endswith(")"):
            out.append(Partial(part[2:-1]))
        else:
            raise ValueError(f"cannot parse placement '{part}' in '{text}'")
    return tuple(out)
