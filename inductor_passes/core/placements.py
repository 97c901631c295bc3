"""Placement helpers shared by rules, propagation and lowering.

A value's sharding is a tuple with one torch ``Placement`` per mesh axis (``Shard(d)``,
``Replicate()``, ``Partial(op)``, ``_StridedShard(d, split_factor=k)``), exactly DTensor's
convention. Other DTensor variants (``MaskPartial``...) change the meaning of the local
computation in ways we do not lower and are not accepted in a plan.

Block-strided sharding, ``_StridedShard(d, split_factor=k)`` on a mesh axis of size n ("SS(d,k)"):
tensor dim d (GLOBAL size D) is k blocks of D/k; each block is split in n contiguous pieces of
c = D/(k n), and rank r holds piece r of EVERY block, in block order (local size D/n). It is
Megatron-LM's layout of a fused projection (q|k|v, gate|up): rank r holds [q_r, k_r, v_r], so
splitting the local output at the block boundaries gives each rank its Shard of every part. Its
meaning is DTensor's (``placement_types._StridedShard._split_tensor``). We hold it only when D
is a multiple of k n (every piece the same size) and, where another mesh axis splits dim d
too, only nested inside one earlier even Shard(d): [Shard(0), SS(0, k)] splits the piece of D/n0
the Shard leaves (``valid_for``), attention's [B*H] batch with B split on the first axis and H
on the second. DTensor's right-to-left use of it (FSDP2 over TP: SS on the EARLIER axis) is not
planned: such inputs are gathered at the program boundary, see ``plannable``.

Nested splits: several mesh axes may ``Shard`` one tensor dim (``[Shard(0), Shard(0)]``, the
partition spec ``(("dp", "tp"), None)``), in mesh-axis order as DTensor lays it out: the first
axis chunks the dim, each later one chunks the piece the earlier ones left (``local_shape``).
Values the user pins may hold them; op rules are not offered them (``valid_for``), so values in
such a layout are redistributed (exactly, ``redistribute``) before an op computes on them. The
one nest op rules are offered is a Shard with a _StridedShard inside it (above).
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .compat import StridedShard

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
    """True for exactly Shard / Replicate / Partial(sum|avg|max|min) / _StridedShard with an
    integer split factor of at least 2 (factor 1 is Shard: ``normalize`` rewrites it)."""
    if type(p) is Shard or type(p) is Replicate:
        return True
    if type(p) is StridedShard:
        return isinstance(p.split_factor, int) and p.split_factor >= 2
    return type(p) is Partial and p.reduce_op in SUPPORTED_PARTIAL_OPS


def is_strided(p: Placement) -> bool:
    return type(p) is StridedShard


def is_split(p: Placement) -> bool:
    """Shard or _StridedShard: every rank holds a part of one tensor dim (``p.dim``).
    (DTensor's own ``is_shard()`` is False for _StridedShard.)"""
    return type(p) is Shard or type(p) is StridedShard


def split_factor(p: Placement) -> int:
    """k of _StridedShard(d, split_factor=k); 1 for Shard (one block)."""
    return int(p.split_factor) if type(p) is StridedShard else 1


def strided(dim: int, k: int) -> Placement:
    """The placement splitting ``dim`` in ``k`` blocks: Shard(dim) for one block."""
    return Shard(dim) if k == 1 else StridedShard(dim, split_factor=k)


def shard_twin(placements: Placements) -> Placements:
    """Every _StridedShard(d, k) as Shard(d): what rules that do not know block-strided
    sharding are asked with (``rules.strided`` lifts their answers back). One nested inside an
    earlier Shard(d) (``valid_for``) as Replicate: rules are not offered a dim split twice, and
    ``rules.strided.nest`` splits the answers' dim again on that axis."""
    out = []
    for axis, p in enumerate(placements):
        if type(p) is StridedShard:
            p = Replicate() if _outer_shards(placements, axis) else Shard(p.dim)
        out.append(p)
    return tuple(out)


def _outer_shards(placements: Placements, axis: int) -> list[int]:
    """The mesh axes before ``axis`` that cut, with a plain Shard, the dim that the split on
    ``axis`` splits: a _StridedShard there is nested in them (``valid_for``)."""
    dim = placements[axis].dim
    return [a for a in range(axis) if type(placements[a]) is Shard and placements[a].dim == dim]


def strided_factors(placements: Iterable) -> frozenset[int]:
    """The split factors of every _StridedShard in ``placements`` (Placements, or nested tuples
    of them for multi-output values; None entries skipped)."""
    out: set[int] = set()

    def walk(x) -> None:
        if x is None:
            return
        if isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif type(x) is StridedShard:
            out.add(int(x.split_factor))

    walk(placements)
    return frozenset(out)


def normalize(placements: Sequence[Placement], ndim: int) -> Placements:
    """Shard(-1) -> Shard(ndim-1) (the same for _StridedShard), _StridedShard(d, 1) -> Shard(d),
    so equal shardings compare equal."""
    out = []
    for p in placements:
        if type(p) is Shard and p.dim < 0:
            p = Shard(p.dim + ndim)
        elif type(p) is StridedShard:
            k = p.split_factor
            d = p.dim + ndim if p.dim < 0 else p.dim
            p = Shard(d) if k == 1 else (StridedShard(d, split_factor=k) if d != p.dim else p)
        out.append(p)
    return tuple(out)


def valid_for(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int],
              nested: bool = False) -> bool:
    """Placements a value can hold: plain types, dims in range. Uneven Shard splits are valid
    (chunk semantics, see ``shard_range``); ``rules.op_strategy`` decides which ops may compute
    on them. A _StridedShard(d, k) on a mesh axis of size n is valid only when the size of dim d
    it splits is a multiple of k * n (blocks split evenly: every rank holds D/n).

    ``nested``: whether one tensor dim may be split by several mesh axes with Shard only (nested
    in mesh-axis order, see ``local_shape``). Values the user pins (inputs, constraints) may;
    op rules, which are written for one split per dim, are not offered such placements.

    One nest is always valid: Shard(d) on one mesh axis, then a _StridedShard(d, k) on a later
    one (DTensor's left-to-right order: the Shard cuts D evenly, the _StridedShard splits the
    piece it leaves, of size L, so L % (k n) == 0). It is the layout of attention's merged
    [B*H] batch with B split on one axis and H on a later one ([B, H] -> [B*H] with [Shard(0),
    Shard(1)] gives [Shard(0), SS(0, B / n_0)]), which op rules offer (``rules.strided.nest``)
    so that data parallelism and a head split coexist there."""
    level = list(shape)
    split_by: dict[int, list[Placement]] = {}
    for axis, p in enumerate(placements):
        if not is_plain(p):
            return False
        if not is_split(p):
            continue
        if not 0 <= p.dim < len(shape):
            return False
        before = split_by.setdefault(p.dim, [])
        if type(p) is StridedShard:
            if any(type(q) is not Shard for q in before) or \
                    level[p.dim] % (p.split_factor * mesh_shape[axis]):
                return False
        elif before and not (nested and all(type(q) is Shard for q in before)):
            return False
        elif before and any(is_strided(q) for q in placements if is_split(q) and q.dim == p.dim):
            return False  # (the nest with a _StridedShard has one Shard outside it)
        if type(p) is Shard and any(is_strided(q) and q.dim == p.dim
                                    for q in placements[axis + 1:]) and \
                level[p.dim] % mesh_shape[axis]:
            return False  # an uneven cut under a _StridedShard: its blocks would differ by rank
        before.append(p)
        level[p.dim] //= mesh_shape[axis] if type(p) is Shard else 1
    return True


def intersect_axes(placements: Placements, mesh_shape: Sequence[int]) -> Placements:
    """N-D placements from one-axis ones planned apart (``propagate._separable_start``), where
    each axis's entry says which indices that axis's ranks hold on their own. A
    _StridedShard(d, k) on axis b whose dim an earlier axis a cuts with Shard(d) becomes
    SS(d, k / n_a): a's piece of D/n_a holds k/n_a whole blocks, and b's rank r holds piece r
    of each, the two subsets' intersection (in ``valid_for``'s nested reading, where SS(d, k)
    would take k blocks of a's piece). Unchanged where n_a does not divide k."""
    out = list(placements)
    for b, p in enumerate(out):
        if not is_strided(p):
            continue
        outer = _outer_shards(out, b)
        if len(outer) == 1 and p.split_factor % mesh_shape[outer[0]] == 0:
            out[b] = strided(p.dim, p.split_factor // mesh_shape[outer[0]])
    return tuple(out)


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


def returnable(shape: Sequence[int], placements: Placements,
               mesh_shape: Sequence[int]) -> Placements:
    """The layout a forward output leaves the program in, from the one it was produced in:
    reduced (Partial -> Replicate) and split only where the split is even (an uneven split ->
    Replicate on that mesh axis). User code runs DTensor's own ops on what the graph returns,
    and some cannot take a rank's empty piece (2.13's argmax/argmin over a split dim reduce each
    rank's piece locally, and an empty one has no maximum); a decode step's sequence length is
    1, so its logits split over the sequence would leave one rank nothing."""
    out = list(nonpartial(placements))
    for axis, p in enumerate(out):
        if type(p) is Shard and shape[p.dim] % mesh_shape[axis]:
            out[axis] = Replicate()
    return tuple(out)


def plannable(shape: Sequence[int], placements: Placements,
              mesh_shape: Sequence[int]) -> tuple[Placements, list[str]]:
    """``placements`` with every mesh axis the planner cannot hold replaced by Replicate, and
    why: an unsupported placement type, a _StridedShard that does not split its dim evenly, or
    one nested with another split of its dim (DTensor's right-to-left FSDP2-over-TP layout).
    Nested Shard splits (``[Shard(0), Shard(0)]``) are held. Inputs in other placements are
    redistributed (by DTensor, exactly) at the program boundary, and the caller logs the cost."""
    out, why, seen = list(placements), [], set()
    strided_dims = {p.dim for p in placements if is_strided(p)}
    for axis, p in enumerate(placements):
        if not is_plain(p):
            why.append(f"mesh axis {axis}: {p!r} is not supported")
        elif is_split(p) and p.dim in seen and (type(p) is StridedShard or p.dim in strided_dims):
            why.append(f"mesh axis {axis}: dim {p.dim} is already split by another mesh axis "
                       f"and one of the splits is block-strided")
        elif type(p) is StridedShard and (not 0 <= p.dim < len(shape) or p.dim in seen or
                                          shape[p.dim] % (p.split_factor * mesh_shape[axis])):
            why.append(f"mesh axis {axis}: {p!r} needs dim {p.dim} to be a multiple of "
                       f"split_factor x mesh axis size = {p.split_factor * mesh_shape[axis]}"
                       + (" and split by no other mesh axis" if p.dim in seen else ""))
        else:
            if is_split(p):
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
        elif type(p) is StridedShard:
            n = mesh_shape[axis]
            if out[p.dim] % (p.split_factor * n):
                raise ValueError(f"{p!r} on a mesh axis of size {n} cannot split a dim of size "
                                 f"{out[p.dim]} evenly")
            out[p.dim] //= n
    return tuple(out)


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _exactly(p: Placement, cls: type) -> bool:
    """``type(p) is cls``, also where Dynamo traces it: torch 2.11's Dynamo answers False for a
    placement made inside the traced code (``pin_placements`` encodes the user's placements
    while Dynamo traces), so its class is compared by name: a subclass (``_StridedShard`` of
    ``Shard``) still does not match."""
    return type(p) is cls or (isinstance(p, cls) and type(p).__name__ == cls.__name__)


def fmt(placements: Placements | None) -> str:
    """Short form: 'S(0)', 'SS(1,3)' (_StridedShard(1, split_factor=3)), 'R', 'P(sum)', joined
    by ',' per mesh axis."""
    if placements is None:
        return "-"
    parts = []
    for p in placements:
        if _exactly(p, Shard):
            parts.append(f"S({p.dim})")
        elif _exactly(p, StridedShard):
            parts.append(f"SS({p.dim},{p.split_factor})")
        elif _exactly(p, Replicate):
            parts.append("R")
        elif isinstance(p, Partial):
            parts.append(f"P({p.reduce_op})")
        else:
            parts.append(repr(p))
    return "[" + ",".join(parts) + "]"


_TOKEN = re.compile(r"\s*(R|S\((-?\d+)\)|SS\((-?\d+),\s*(\d+)\)|P\((\w+)\))\s*(,|$)")


def parse(text: str) -> Placements:
    """Inverse of ``fmt``: '[S(0),SS(1,3),R,P(sum)]' -> (Shard(0), _StridedShard(1,
    split_factor=3), Replicate(), Partial('sum')). Raises ValueError on anything else."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    out: list[Placement] = []
    pos = 0
    while body[pos:].strip():
        m = _TOKEN.match(body, pos)
        if m is None:
            raise ValueError(f"cannot parse placement at '{body[pos:]}' in '{text}'")
        if m.group(1) == "R":
            out.append(Replicate())
        elif m.group(2) is not None:
            out.append(Shard(int(m.group(2))))
        elif m.group(3) is not None:
            out.append(StridedShard(int(m.group(3)), split_factor=int(m.group(4))))
        else:
            out.append(Partial(m.group(5)))
        pos = m.end()
    return tuple(out)
