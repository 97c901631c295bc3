"""Indexing, scatter and routing ops (the MoE token dispatch: sort/gather/scatter/histc/cumsum;
the embedding backward's masked accumulate).

Every rule here is written for ONE mesh axis and expanded by ``expand_to_mesh``. The shared
reasoning:

- a dim may be split only where every operand that has it agrees on its SIZE (an index of 3
  columns split beside a source of 8 columns would pair column 0..1 of one with 0..3 of the
  other): checked here, since ``rules._uneven_aligned`` only compares sizes of uneven splits;
- the indexed/scattered dim of the indexed tensor is never split (an index names a GLOBAL
  position, a local piece holds other positions); the index tensors' own dims may be split;
- an op that ADDS its source into its destination (scatter_add, index_put with accumulate) may
  split the source and its indices where the index VALUES say where each element goes: each
  rank adds its share, the destination is a pending sum (Partial) -- the embedding backward's
  rule, generalised (off the scattered dim of scatter/gather an element goes to its own
  position, which a local piece shifts: not split there);
- Partial passes only through ops linear in that operand (overwrite-scatters are linear in the
  destination and source together: sum_r where(hit, src_r, self_r) = where(hit, sum src, sum
  self)); never through max/min/prod reductions or a scalar fill;
- integer values (indices, counts) are never Partial (``rules._partial_only_on_floats``).

DTensor's registry (``rules.dtensor``) keeps the ops it gets right: ``index.Tensor``, ``sort``,
``topk``. Written here are the ones it lacks (``scatter_reduce``, the accumulate splits,
Inductor's ``_unsafe_masked_index*`` forms) or gets wrong (``gather`` and ``scatter_add`` split
dims where index and source differ in size; ``histc`` leaves Partial counts for a data-derived
range, min == max). Every OpSpec offered here is checked on local pieces against the global op
by ``tests/test_indexing_rules.py``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .base import AxisOption, OpSpec, RuleKind, expand_to_mesh, node_arg, tensor_args, val_shape

aten = torch.ops.aten
P = Partial("sum")
R = Replicate()


def _expand(node: fx.Node, options: list[AxisOption], mesh_shape: Sequence[int],
            source: str) -> list[OpSpec]:
    shapes = [val_shape(a) for a in tensor_args(node)]
    return expand_to_mesh(options, mesh_shape, shapes, val_shape(node), source)


# ---------------------------------------------------------------------------------------------
# slice_scatter(input, src, dim, start, end, step): src written into a slice of input
# ---------------------------------------------------------------------------------------------
def slice_scatter_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Both operands split on any dim but the scattered one; Partial in both (linear)."""
    if not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return []
    shape = val_shape(node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim % len(shape)
    src_shape = val_shape(node.args[1])
    options: list[AxisOption] = [((Replicate(), Replicate()), Replicate())]
    for d in range(len(shape)):
        if d != dim:
            options.append(((Shard(d), Shard(d)), Shard(d)))
    options.append(((Partial("sum"), Partial("sum")), Partial("sum")))
    return expand_to_mesh(options, mesh_shape, [shape, src_shape], shape, RuleKind.SLICE_SCATTER)


# ---------------------------------------------------------------------------------------------
# index_put(self, indices, values, accumulate): advanced-index assignment (x[i, :, j] = v)
# ---------------------------------------------------------------------------------------------
def index_layout(self_shape: Sequence[int], index_shapes: Sequence[Sequence[int] | None]):
    """Where advanced indexing puts each dim. ``index_shapes[i]``: the shape of the index
    tensor on dim i of ``self``, or None (a full slice); trailing dims of self are slices.

    Returns (broadcast shape B of the index tensors, position p of B's dims in the result,
    {non-indexed self dim: its result dim}). NumPy's rule: B replaces the indexed dims where
    they are adjacent, and goes first when they are not. The result has len(B) + #slices dims.
    """
    indexed = [i for i, s in enumerate(index_shapes) if s is not None]
    bshape = tuple(torch.broadcast_shapes(*[tuple(s) for s in index_shapes if s is not None]))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    p = indexed[0] if adjacent else 0
    out_dim, k = {}, 0
    for d in range(len(self_shape)):
        if d in indexed:
            continue
        out_dim[d] = k if k < p else k + len(bshape)
        k += 1
    return bshape, p, out_dim


def _aligned_dim(shape: Sequence[int], full_ndim: int, d: int) -> int:
    """Dim of a tensor right-aligned against a broadcast shape of ``full_ndim`` dims (-1:
    absent)."""
    return d - (full_ndim - len(shape))


def index_put_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """``index_put(self, indices, values, accumulate)``: ``self[indices] = values`` (or +=).
    self: [*S]; indices: one int tensor or None per leading dim of self, broadcast to B;
    values broadcastable to the index result [..B.., slices...].

    Per mesh axis:
    - all Replicate;
    - self split on a dim no index names (a slice dim), values split on its result dim (or
      Replicate where values broadcast there), indices Replicate: each rank writes its columns;
    - self and values Partial, indices Replicate (linear in both, with or without accumulate);
    - accumulate only: the indices and values split on a dim of B, self Partial: each rank adds
      its share of the updates (duplicate indices sum on one device as across ranks).
    Without accumulate, splitting B is wrong (a later write wins over an earlier one).
    """
    self_n, indices, values_n = node.args[0], node_arg(node, 1, "indices"), node_arg(node, 2, "values")
    accumulate = bool(node_arg(node, 3, "accumulate", False))
    if not isinstance(values_n, fx.Node):
        return []
    layout = _layout(self_n, indices)
    if layout is None:
        return []  # a boolean mask index: data-dependent shapes (rejected before planning)
    bshape, p, out_dim, i_shapes = layout
    s_shape, v_shape, n_idx = val_shape(self_n), val_shape(values_n), len(i_shapes)
    r_ndim = len(bshape) + len(out_dim)
    options: list[AxisOption] = [((R,) * (n_idx + 2), R)]
    for d, rd in out_dim.items():
        vp = _along(v_shape, r_ndim, rd, s_shape[d])
        if vp is not None:
            options.append(((Shard(d), *([R] * n_idx), vp), Shard(d)))
    options.append(((P, *([R] * n_idx), P), P))
    if accumulate:
        for bd, size in enumerate(bshape):
            vp = _along(v_shape, r_ndim, p + bd, size)
            if size > 1 and vp is not None:
                options.append(((P, *_index_split(i_shapes, len(bshape), bd), vp), P))
    return _expand(node, options, mesh_shape, RuleKind.INDEX_PUT)


# ---------------------------------------------------------------------------------------------
# Inductor's masked forms (embedding, padding and upsampling decompositions use them):
# _unsafe_masked_index(self, mask, indices, fill) = where(mask, self[indices], fill)
# _unsafe_masked_index_put_accumulate(self, mask, indices, values)
#     = index_put(self, indices, where(mask, values, 0), accumulate=True)
# mask broadcasts against the index result (values' shape for the put)
# ---------------------------------------------------------------------------------------------
def masked_index_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Per mesh axis: all Replicate; self split on a slice dim (mask split with the result or
    broadcast); the indices and mask split on a dim of their broadcast shape B with self
    Replicate; self Partial -> Partial when the fill is 0 (a nonzero fill would be summed once
    per rank). Tensor args: self, mask, indices..."""
    self_n, mask_n, indices, fill = node.args
    layout = _layout(self_n, indices)
    if layout is None or not isinstance(mask_n, fx.Node):
        return []
    bshape, p, out_dim, i_shapes = layout
    m_shape, r_ndim, n_idx = val_shape(mask_n), len(val_shape(node)), len(i_shapes)
    options: list[AxisOption] = [((R,) * (n_idx + 2), R)]
    for d, rd in out_dim.items():
        mp = _along(m_shape, r_ndim, rd, val_shape(self_n)[d])
        if mp is not None:
            options.append(((Shard(d), mp, *([R] * n_idx)), Shard(rd)))
    for bd, size in enumerate(bshape):
        mp = _along(m_shape, r_ndim, p + bd, size)
        if size > 1 and mp is not None:
            options.append(((R, mp, *_index_split(i_shapes, len(bshape), bd)), Shard(p + bd)))
    if fill == 0:
        options.append(((P, R, *([R] * n_idx)), P))
    return _expand(node, options, mesh_shape, RuleKind.MASKED_INDEX)


def masked_index_put_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """The embedding backward (and padding backward): updates added into self at indices.
    Per mesh axis: all Replicate; self split on a slice dim with values (and mask) split on
    its result dim; indices, mask and values split on a dim of B with self Partial (each rank
    adds its share); self and values Partial. Tensor args: self, mask, indices..., values."""
    self_n, mask_n, indices, values_n = node.args
    layout = _layout(self_n, indices)
    if layout is None or not isinstance(mask_n, fx.Node) or not isinstance(values_n, fx.Node):
        return []
    bshape, p, out_dim, i_shapes = layout
    m_shape, v_shape, n_idx = val_shape(mask_n), val_shape(values_n), len(i_shapes)
    r_ndim = len(bshape) + len(out_dim)
    options: list[AxisOption] = [((R,) * (n_idx + 3), R)]
    for d, rd in out_dim.items():
        size = val_shape(self_n)[d]
        mp, vp = _along(m_shape, r_ndim, rd, size), _along(v_shape, r_ndim, rd, size)
        if mp is not None and vp is not None:
            options.append(((Shard(d), mp, *([R] * n_idx), vp), Shard(d)))
    for bd, size in enumerate(bshape):
        mp, vp = _along(m_shape, r_ndim, p + bd, size), _along(v_shape, r_ndim, p + bd, size)
        if size > 1 and mp is not None and vp is not None:
            options.append(((P, mp, *_index_split(i_shapes, len(bshape), bd), vp), P))
    options.append(((P, R, *([R] * n_idx), P), P))
    return _expand(node, options, mesh_shape, RuleKind.INDEX_PUT_ACCUMULATE)


def _layout(self_n, indices):
    """index_layout of an op's (self, indices) plus the index tensors' shapes; None when an
    index is not a tensor node or is a mask."""
    if not isinstance(self_n, fx.Node) or \
            not all(i is None or isinstance(i, fx.Node) for i in indices):
        return None
    idx = [i for i in indices if i is not None]
    if not idx or any(i.meta["val"].dtype in (torch.bool, torch.uint8) for i in idx):
        return None
    bshape, p, out_dim = index_layout(val_shape(self_n), [None if i is None else val_shape(i)
                                                          for i in indices])
    return bshape, p, out_dim, [val_shape(i) for i in idx]


def _along(shape: Sequence[int], full_ndim: int, rd: int, size: int) -> Placement | None:
    """Placement of a tensor right-aligned against a result of ``full_ndim`` dims when the
    result is split on its dim ``rd`` (of ``size``): Shard of its own dim there, Replicate where
    it broadcasts (absent or size 1), None if it has another size there."""
    d = _aligned_dim(shape, full_ndim, rd)
    if d < 0 or shape[d] == 1:
        return R
    return Shard(d) if shape[d] == size else None


def _index_split(i_shapes, b_ndim: int, bd: int) -> list[Placement]:
    """Each index tensor split on its dim that broadcasts to dim ``bd`` of B (Replicate where
    it broadcasts)."""
    out: list[Placement] = []
    for s in i_shapes:
        d = _aligned_dim(s, b_ndim, bd)
        out.append(R if d < 0 or s[d] == 1 else Shard(d))
    return out


# ---------------------------------------------------------------------------------------------
# scatter family: scatter.src / scatter.value / scatter_add / scatter_reduce.two
# ---------------------------------------------------------------------------------------------
SCATTER = {aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two}


def scatter_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """``scatter*(self, dim, index, src|value, ...)``: ``out[..index[i]..] (op)= src[i]`` along
    ``dim``; self and out: [*S]; index: [*I] (I[d] <= S[d] off ``dim``, I[d] <= src[d]).

    Per mesh axis:
    - all Replicate;
    - self, index and src split together on a dim d != dim where all three have the same size;
    - summing scatters (scatter_add; scatter_reduce "sum" with include_self): index and src split
      on ``dim`` (where they agree in size), self Partial -> out Partial (each rank adds its
      share); not off ``dim``, where an element's destination is its own position;
    - linear scatters (scatter.src, scatter_add, scatter_reduce "sum"/"mean"): self and src
      Partial, index Replicate -> Partial. Not scatter.value (the fill would be counted once
      per rank) nor "prod"/"amax"/"amin".
    """
    op = node.target
    self_n, dim, index_n = node.args[0], node.args[1], node.args[2]
    src_n = node.args[3] if op is not aten.scatter.value else None
    reduce = node.args[4] if op is aten.scatter_reduce.two else None
    include_self = bool(node_arg(node, 5, "include_self", True)) if reduce else True
    if not isinstance(index_n, fx.Node) or not isinstance(self_n, fx.Node) or \
            (src_n is not None and not isinstance(src_n, fx.Node)):
        return []
    s_shape, i_shape = val_shape(self_n), val_shape(index_n)
    src_shape = val_shape(src_n) if src_n is not None else None
    if len(i_shape) != len(s_shape):
        return []  # a 0-d index against a 0-d self: nothing to split
    dim = dim % max(len(s_shape), 1)
    n = 3 if src_n is not None else 2

    def same(d: int, *shapes) -> bool:
        return all(s is None or s[d] == i_shape[d] for s in shapes)

    options: list[AxisOption] = [((R,) * n, R)]
    for d in range(len(s_shape)):
        if d != dim and same(d, s_shape, src_shape):
            options.append(((Shard(d),) * n, Shard(d)))
    summing = op is aten.scatter_add.default or (reduce == "sum" and include_self)
    if summing and same(dim, src_shape):
        # only along ``dim``, where index VALUES name the destination; off ``dim`` an element's
        # position is its own (implicit), which a local piece of index would shift
        options.append(((P, Shard(dim), Shard(dim)), P))
    linear = op in (aten.scatter.src, aten.scatter_add.default) or reduce in ("sum", "mean")
    if linear and src_n is not None:
        options.append(((P, R, P), P))
    return _expand(node, options, mesh_shape, RuleKind.SCATTER)


# ---------------------------------------------------------------------------------------------
# gather(self, dim, index): out[i] = self[..index[i]..] along dim; out has index's shape
# ---------------------------------------------------------------------------------------------
def gather_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """self: [*S], index and out: [*I] (I[d] <= S[d] off ``dim``).

    Per mesh axis: all Replicate; index (and out) split on ``dim`` with self Replicate (off
    ``dim`` an index element reads self at its OWN position, which a local piece shifts); self
    and index split together on a dim d != dim of the same size in both; self Partial, index
    Replicate -> Partial (a gather is linear in self).
    """
    self_n, dim, index_n = node.args[0], node.args[1], node.args[2]
    if not isinstance(index_n, fx.Node):
        return []
    s_shape, i_shape = val_shape(self_n), val_shape(index_n)
    if len(i_shape) != len(s_shape):
        return []
    dim = dim % max(len(s_shape), 1)
    options: list[AxisOption] = [((R, R), R), ((P, R), P), ((R, Shard(dim)), Shard(dim))]
    for d in range(len(i_shape)):
        if d != dim and s_shape[d] == i_shape[d]:
            options.append(((Shard(d), Shard(d)), Shard(d)))
    return _expand(node, options, mesh_shape, RuleKind.GATHER)


# ---------------------------------------------------------------------------------------------
# histc(self, bins, min, max) -> [bins] counts; cumsum(self, dim) -> running sums
# ---------------------------------------------------------------------------------------------
def histc_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Counts of self's elements in ``bins`` equal bins over [min, max].

    Per mesh axis: Replicate; self split on any dim -> Partial counts (each rank counts its
    elements), but only for a fixed range, min < max: with min == max (the default) torch
    takes the range from the data, which differs per rank. Never a Partial self (not linear).
    """
    lo, hi = node_arg(node, 2, "min", 0), node_arg(node, 3, "max", 0)
    shape = val_shape(node.args[0])
    options: list[AxisOption] = [((R,), R)]
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi:
        options += [((Shard(d),), P) for d in range(len(shape))]
    return _expand(node, options, mesh_shape, RuleKind.HISTC)


def cumsum_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Running sums along ``dim``: split on any other dim; Partial in, Partial out (linear).
    The scanned dim itself is not split (each piece would need the sum of those before it)."""
    shape = val_shape(node.args[0])
    dim = node.args[1] % max(len(shape), 1)
    options: list[AxisOption] = [((R,), R), ((P,), P)]
    options += [((Shard(d),), Shard(d)) for d in range(len(shape)) if d != dim]
    return _expand(node, options, mesh_shape, RuleKind.CUMSUM)


INDEXING = {aten.index_put.default: index_put_strategy, aten.gather.default: gather_strategy,
            aten._unsafe_masked_index.default: masked_index_strategy,
            aten._unsafe_masked_index_put_accumulate.default: masked_index_put_strategy,
            aten.histc.default: histc_strategy, aten.cumsum.default: cumsum_strategy,
            **{op: scatter_strategy for op in SCATTER}}
