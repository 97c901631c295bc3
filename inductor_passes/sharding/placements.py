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


def valid_for(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """Placements a value can hold: plain types, dims in range, no tensor dim cut by two mesh
    axes (nested sharding is not lowered yet). Uneven splits are valid (chunk semantics, see
    ``shard_range``); ``rules.op_strategy`` decides which ops may compute on them."""
    seen: set[int] = set()
    for axis, p in enumerate(placements):
        if not is_plain(p):
            return False
        if type(p) is Shard:
            if not 0 <= p.dim < len(shape) or p.dim in seen:
                return False
            seen.add(p.dim)
    return True


def shard_range(size: int, n: int, k: int) -> tuple[int, int]:
    """(offset, length) of piece ``k`` when a dim of GLOBAL ``size`` is split over ``n`` ranks:
    torch.chunk's (and DTensor's) semantics, pieces of ceil(size / n), the last ones shorter or
    empty (size 5 over 4 ranks: 2, 2, 1, 0)."""
    step = -(-size // n)
    offset = min(k * step, size)
    return offset, min(step, size - offset)


def is_uneven(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    return any(type(p) is Shard and shape[p.dim] % mesh_shape[a]
               for a, p in enumerate(placements))


def plannable(shape: Sequence[int], placements: Placements,
              mesh_shape: Sequence[int]) -> tuple[Placements, list[str]]:
    """``placements`` with every mesh axis the planner cannot hold replaced by Replicate, and
    why: a tensor dim split by two mesh axes, or an unsupported placement type. Inputs in such placements are redistributed (by
    DTensor, exactly) at the program boundary, and the caller logs the cost."""
    out, why, seen = list(placements), [], set()
    for axis, p in enumerate(placements):
        if not is_plain(p):
            why.append(f"mesh axis {axis}: {p!r} is not supported")
        elif type(p) is Shard and p.dim in seen:
            why.append(f"mesh axis {axis}: dim {p.dim} is already split by another mesh axis")
        else:
            if type(p) is Shard:
                seen.add(p.dim)
            continue
        out[axis] = Replicate()
    return tuple(out), why


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int],
                coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
    """LOCAL shape of a value of GLOBAL ``shape``: of the rank at ``coordinate``, or without one
    the largest piece (what an uneven collective pads to, and what the cost model prices)."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            n = mesh_shape[axis]
            out[p.dim] = -(-out[p.dim] // n) if coordinate is None else \
                shard_range(out[p.dim], n, coordinate[axis])[1]
    return tuple(out)


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
