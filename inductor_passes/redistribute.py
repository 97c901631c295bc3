"""Lower one placement change (redistribute) to local ops + ``_c10d_functional`` collectives.

Runs while tracing the local graph (``make_fx``), on local tensors. Per mesh axis:

    Shard(a)   -> Shard(b)    all_to_all_single
    Shard(d)   -> Replicate   all_gather_into_tensor (pieces stacked on dim 0, joined on d)
    Partial    -> Replicate   all_reduce (avg = sum then divide: gloo has no AVG)
    Partial    -> Shard(d)    reduce_scatter_tensor (sum/avg); max/min reduce then slice
    Replicate  -> Shard(d)    local slice at this rank's coordinate (no communication)
    Replicate  -> Partial     this rank keeps the value at coordinate 0, zeros elsewhere
    anything   -> Partial     via Replicate

_StridedShard(d, k) ("SS", see ``placements``): the same collectives with a local block
reorder of the whole dim d (view [k, n, c] <-> [n, k, c]: block-major <-> rank-major):

    SS(d,k)    -> Replicate   all_gather along d (rank-major), then reorder to block-major
    Replicate  -> SS(d,k)     local slice: piece r of every block (no communication)
    Partial    -> SS(d,k)     reorder to rank-major, then reduce_scatter along d
    SS / Shard -> SS / Shard  on two different dims: all_to_all, reordering the dim that is
                              strided before (target) or after (source) it
    SS(d,k)   <-> Shard(d), SS(d,k) -> SS(d,k'): all_gather and local slice (the pieces rank r
                              holds before and after overlap on few ranks; an all_to_all with
                              uneven sends would move less, at the price of a second code path)

A mesh axis of size 1 moves nothing (every placement there holds the whole value).

Order of the per-axis steps: see ``redistribute``.
Every collective is appended to the ``CollectiveLedger`` with its cause.

Uneven splits (a dim of GLOBAL size 5 over 4 ranks: pieces 2, 2, 1, 0, torch.chunk's semantics,
as DTensor's) pad each piece to the largest one before a collective and cut the padding off
after it, as DTensor's own redistribute does. The pad is emitted on every rank (of zero width on
some), so every rank's graph keeps the same structure.

Graphs are specialised per rank (the coordinate is a constant), as Dynamo's own handling of mesh
queries already is.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .core.placements import (Placements, is_split, is_strided, local_shape, shard_range,
                              split_factor)

c10d = torch.ops._c10d_functional


class AxisGroup:
    """What lowering needs to know about one mesh axis on this rank."""

    def __init__(self, name: str, size: int, coordinate: int, group_name: str) -> None:
        self.name, self.size, self.coordinate, self.group_name = name, size, coordinate, group_name


def local_coordinate(mesh) -> tuple[int, ...] | None:
    """This rank's piece index on each mesh axis as DTensor lays data out: its rank within the
    axis's process group (``get_local_rank``); None when the rank is not in the mesh. On a mesh
    whose device ids do not ascend along an axis (a DeviceMesh over [1, 0]) this differs from
    ``get_coordinate()``: torch orders a group's ranks ascending, and ``distribute_tensor``, the
    collectives and ``full_tensor`` follow the group (rank 0 holds piece 0). Lowering by
    ``get_coordinate()`` there gathered pieces in the wrong order: wrong numbers, no error. On
    the ``fake`` process group (tracing, simulation: no collective runs, and a re-created group
    leaves a mesh's groups unregistered) it is ``get_coordinate()``."""
    import torch.distributed as dist

    coord = mesh.get_coordinate()
    if coord is None or not dist.is_initialized() or dist.get_backend() == "fake":
        return None if coord is None else tuple(coord)  # no collective runs on ``fake``
    return tuple(mesh.get_local_rank(i) for i in range(mesh.ndim))


def mesh_axes(mesh, coordinate: Sequence[int] | None = None) -> list[AxisGroup]:
    """Per mesh axis: name, size, this rank's piece index (``local_coordinate``; or
    ``coordinate``, to lower the graph of another rank: the SPMD simulator does) and the process
    group's name."""
    coord = local_coordinate(mesh) if coordinate is None else list(coordinate)
    if coord is None:
        raise RuntimeError(f"this rank is not part of {mesh}")
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
    return [AxisGroup(names[i], mesh.size(i), coord[i], mesh.get_group(i).group_name)
            for i in range(mesh.ndim)]


Record = Callable[[str, AxisGroup, torch.Tensor], None]


def _wait(t: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(t)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A bool value travels as uint8 (the same bytes): Inductor's C++ backend types a bool
    collective's output as int64 where a vectorized ``where`` reads it as its condition, and
    fails to compile (a gathered ReLU mask; torch 2.13). ``_as_sent`` undoes it."""
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def _as_sent(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.to(torch.bool) if x.dtype == torch.bool else out


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` (always one op, maybe of width 0)."""
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, size - x.shape[dim]]
    return torch.ops.aten.constant_pad_nd(x, pad)


def all_gather(x: torch.Tensor, dim: int, ax: AxisGroup, record: Record,
               size: int) -> torch.Tensor:
    """Shard(dim) -> Replicate; ``size``: the dim's GLOBAL size."""
    step = -(-size // ax.size)
    uneven = size % ax.size != 0
    if uneven:
        x = _pad_to(x, dim, step)
    record("all_gather", ax, x)
    x = x.contiguous()
    out = _as_sent(_wait(c10d.all_gather_into_tensor(_as_bytes(x), ax.size,
                                                     ax.group_name)), x)
    if dim != 0:
        # the ranks' pieces come stacked on dim 0: joined along ``dim`` by one copy (DTensor's
        # cat of chunks). Moving ``dim`` to the front before the gather and back after cost
        # two, and a generated kernel each
        pieces = out.view(ax.size, *x.shape).movedim(0, dim)
        out = pieces.reshape(*x.shape[:dim], ax.size * x.shape[dim], *x.shape[dim + 1:])
    # contiguous, as DTensor's gather (a cat) is: some kernels read a layout they assume
    # (fractional_max_pool3d_backward took permuted indices for contiguous ones)
    return out.narrow(dim, 0, size).contiguous() if uneven else out


def all_reduce(x: torch.Tensor, op: str, ax: AxisGroup, record: Record) -> torch.Tensor:
    record("all_reduce", ax, x)
    red = "sum" if op == "avg" else op
    out = _wait(c10d.all_reduce(x.contiguous(), red, ax.group_name))
    return out / ax.size if op == "avg" else out


def reduce_scatter(x: torch.Tensor, op: str, dim: int, ax: AxisGroup, record: Record) -> torch.Tensor:
    """Partial -> Shard(dim); ``x`` holds the whole dim (its GLOBAL size)."""
    size = x.shape[dim]
    step = -(-size // ax.size)
    uneven = size % ax.size != 0
    if uneven:
        x = _pad_to(x, dim, step * ax.size)
    record("reduce_scatter", ax, x)
    moved = x.movedim(dim, 0).contiguous() if dim != 0 else x.contiguous()
    out = _wait(c10d.reduce_scatter_tensor(moved, "sum", ax.size, ax.group_name))
    out = out.movedim(0, dim) if dim != 0 else out
    if uneven:
        out = out.narrow(dim, 0, shard_range(size, ax.size, ax.coordinate)[1])
    return out / ax.size if op == "avg" else out


def all_to_all(x: torch.Tensor, src: int, dst: int, ax: AxisGroup, record: Record,
               src_size: int) -> torch.Tensor:
    """Shard(src) -> Shard(dst): send piece j of dim ``dst`` to rank j, concat received on
    ``src``. ``src_size``: GLOBAL size of dim ``src`` (``x`` holds all of dim ``dst``)."""
    dst_size = x.shape[dst]
    src_step, dst_step = -(-src_size // ax.size), -(-dst_size // ax.size)
    uneven = src_size % ax.size != 0 or dst_size % ax.size != 0
    if uneven:  # every piece sent is (src_step, ..., dst_step): padded, cut after
        x = _pad_to(_pad_to(x, src, src_step), dst, dst_step * ax.size)
    record("all_to_all", ax, x)
    send = torch.stack(torch.chunk(x, ax.size, dim=dst)).contiguous()
    split = [1] * ax.size
    recv = _as_sent(_wait(c10d.all_to_all_single(_as_bytes(send), split, split,
                                                 ax.group_name)), x)
    out = torch.cat(torch.unbind(recv, 0), dim=src)
    if uneven:  # pieces before the last non-empty one are full, so the padding is at the end
        out = out.narrow(src, 0, src_size)
        out = out.narrow(dst, 0, shard_range(dst_size, ax.size, ax.coordinate)[1])
    return out


def _reorder(x: torch.Tensor, dim: int, outer: int, inner: int) -> torch.Tensor:
    """Dim ``dim`` (whole, local) viewed as [outer, inner, c] -> [inner, outer, c]: with
    (outer, inner) = (k, n) block-major -> rank-major, with (n, k) the inverse."""
    size = x.shape[dim]
    c = size // (outer * inner)
    return x.unflatten(dim, (outer, inner, c)).transpose(dim, dim + 1).reshape(x.shape)


def gather_strided(x: torch.Tensor, dim: int, k: int, ax: AxisGroup, record: Record,
                   size: int) -> torch.Tensor:
    """_StridedShard(dim, k) -> Replicate; ``size``: the dim's GLOBAL size (k * n divides it).
    The gather puts rank r's [block 0 piece r, ..., block k-1 piece r] at r: rank-major."""
    out = all_gather(x, dim, ax, record, size)
    return _reorder(out, dim, ax.size, k)


def slice_strided(x: torch.Tensor, dim: int, k: int, ax: AxisGroup) -> torch.Tensor:
    """Replicate -> _StridedShard(dim, k): piece ``coordinate`` of each of the k blocks."""
    n, size = ax.size, x.shape[dim]
    c = size // (k * n)
    return x.unflatten(dim, (k, n * c)).narrow(dim + 1, ax.coordinate * c, c) \
        .reshape(*x.shape[:dim], size // n, *x.shape[dim + 1:])


def local_slice(x: torch.Tensor, dim: int, ax: AxisGroup) -> torch.Tensor:
    """Replicate -> Shard(dim): this rank's piece (``x`` holds the whole dim)."""
    offset, length = shard_range(x.shape[dim], ax.size, ax.coordinate)
    return x.narrow(dim, offset, length)


def to_partial(x: torch.Tensor, op: str, ax: AxisGroup) -> torch.Tensor:
    """Replicate -> Partial(sum): keep the value at coordinate 0, zero elsewhere. Written as a
    multiply by a per-rank constant so every rank's graph has the same structure (a structural
    difference would let the partitioner split ranks differently and hang a collective)."""
    if op == "sum":
        keep = 1 if ax.coordinate == 0 else 0
        return x * (float(keep) if x.is_floating_point() else keep)
    return x


def redistribute(x: torch.Tensor, src: Placements, dst: Placements, axes: list[AxisGroup],
                 record: Record, shape: Sequence[int]) -> torch.Tensor:
    """Move local tensor ``x`` from ``src`` to ``dst`` placements (both one entry per mesh axis).
    ``shape``: the value's GLOBAL shape.

    A tensor dim split by several mesh axes (``[Shard(0), Shard(0)]``) is nested in mesh-axis
    order, as DTensor lays it out: the first axis splits the dim, each later one splits the piece
    the earlier ones left (torch.chunk at every level). Every step below acts on the INNERMOST
    split of a dim only (the last mesh axis splitting it), on the piece the outer axes leave
    ("level" size), so any pair of placements redistributes exactly; a step that would reach an
    outer split first gathers the inner ones, which the last phase slices again.

    Order: (1) last axis first, axes that end Replicate/Partial, or go to another layout of the
    same dim, are gathered or reduced, and a Partial -> Shard or Shard -> Shard of another dim
    among dims no other axis splits is reduce-scattered or all_to_all'ed; (2) the other
    Shard->Shard and Partial->Shard moves (all_to_all, reduce_scatter), outer axes first, each
    once the axes after it no longer split the dims it touches (if none is ready, the inner
    splits in the way are gathered); (3) local slices, first axis first.
    """
    if any(ax.size == 1 for ax in axes):
        # one rank holds the whole value in every placement of a size-1 axis (a piece of one
        # is the whole dim, a sum over one rank is the value): nothing moves there, and a
        # collective over one rank would still be a launch and a wait
        src = tuple(Replicate() if ax.size == 1 else p for p, ax in zip(src, axes))
        dst = tuple(Replicate() if ax.size == 1 else p for p, ax in zip(dst, axes))
    if src == dst:
        return x
    cur = list(src)
    mesh_shape = [ax.size for ax in axes]
    coord = [ax.coordinate for ax in axes]

    def inner(i: int, dim: int) -> list[int]:
        """Axes after ``i`` that split ``dim`` now (nested inside axis i's split)."""
        return [j for j in range(i + 1, len(axes)) if is_split(cur[j]) and cur[j].dim == dim]

    def level(i: int, dim: int) -> int:
        """Size of ``dim`` across axis i's group: what the outer axes leave of it (the same on
        every rank of the group, which shares their coordinates)."""
        outer = tuple(p if j != i else Replicate() for j, p in enumerate(cur))
        return local_shape(shape, outer, mesh_shape, coord)[dim]

    def to_replicate(i: int) -> None:
        nonlocal x
        s = cur[i]
        if is_split(s):
            for j in reversed(inner(i, s.dim)):
                to_replicate(j)
            size = level(i, s.dim)
            if type(s) is Shard:
                x = all_gather(x, s.dim, axes[i], record, size)
            else:
                x = gather_strided(x, s.dim, split_factor(s), axes[i], record, size)
        else:
            x = all_reduce(x, s.reduce_op, axes[i], record)
        cur[i] = Replicate()

    def alone(i: int, dims: set[int]) -> bool:
        """No axis but ``i`` splits any of ``dims``, now or at the end."""
        return not any(is_split(p) and p.dim in dims
                       for j, p in enumerate((*cur, *dst)) if j % len(axes) != i)

    for i in reversed(range(len(axes))):
        s, d = cur[i], dst[i]
        if s == d or type(s) is Replicate:
            continue
        # a reduce_scatter or all_to_all among dims no other axis splits goes now, before the
        # gathers of the earlier axes make the buffer larger: the order ``redistribute_cost``
        # prices ((S(0), P) -> (R, S(2)) reduce-scatters 1/n of what it would after the gather)
        if type(d) is Shard and isinstance(s, Partial) and s.reduce_op in ("sum", "avg") and \
                alone(i, {d.dim}):
            x = reduce_scatter(x, s.reduce_op, d.dim, axes[i], record)
            cur[i] = d
            continue
        if type(d) is Shard and type(s) is Shard and s.dim != d.dim and alone(i, {s.dim, d.dim}):
            x = all_to_all(x, s.dim, d.dim, axes[i], record, level(i, s.dim))
            cur[i] = d
            continue
        # a split moves to a split of ANOTHER dim (all_to_all); one dim in two layouts
        # (Shard <-> _StridedShard) goes through Replicate
        movable = is_split(d) and ((is_split(s) and s.dim != d.dim) or
                                   (not is_split(s) and s.reduce_op in ("sum", "avg")))
        if not movable:
            to_replicate(i)
    pending = [i for i in range(len(axes)) if cur[i] != dst[i] and type(cur[i]) is not Replicate]

    def ready(i: int) -> bool:
        s, d = cur[i], dst[i]
        if inner(i, d.dim) or (is_split(s) and inner(i, s.dim)):
            return False
        # a _StridedShard never nests with another split of its dim (the all_to_all's reorder
        # needs the whole dim): such a move waits, or goes through Replicate
        others = [p for j, p in enumerate(cur) if j != i and is_split(p) and p.dim == d.dim]
        return not others or (type(d) is Shard and not any(is_strided(p) for p in others))

    while pending:
        now = [i for i in pending if ready(i)]
        i = min(now or pending)
        if not now:  # gather the inner splits in the way (sliced again in phase 3): cheaper
            s, d = cur[i], dst[i]  # than gathering axis i, whose re-slice would need them too
            for j in sorted({*inner(i, d.dim), *(inner(i, s.dim) if is_split(s) else ())},
                            reverse=True):
                if is_split(cur[j]):
                    to_replicate(j)
            if not ready(i):
                to_replicate(i)  # sliced in phase 3
        pending = [j for j in pending if j != i and type(cur[j]) is not Replicate]
        if type(cur[i]) is Replicate:
            continue
        s, d, ax = cur[i], dst[i], axes[i]
        if is_split(s):
            if is_strided(d):  # the target dim, whole here, to rank-major
                x = _reorder(x, d.dim, split_factor(d), ax.size)
            x = all_to_all(x, s.dim, d.dim, ax, record, level(i, s.dim))
            if is_strided(s):  # received rank by rank: back to block-major
                x = _reorder(x, s.dim, ax.size, split_factor(s))
        else:
            if is_strided(d):
                x = _reorder(x, d.dim, split_factor(d), ax.size)
            x = reduce_scatter(x, s.reduce_op, d.dim, ax, record)
        cur[i] = d
    for i, ax in enumerate(axes):
        d = dst[i]
        if cur[i] == d:
            continue
        if is_split(d):
            for j in reversed(inner(i, d.dim)):
                to_replicate(j)  # sliced again below, inside this axis's piece
            x = local_slice(x, d.dim, ax) if type(d) is Shard else \
                slice_strided(x, d.dim, split_factor(d), ax)
        elif isinstance(d, Partial):
            x = to_partial(x, d.reduce_op, ax)
        cur[i] = d
    return x
