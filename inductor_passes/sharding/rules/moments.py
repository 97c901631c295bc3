"""Variance and mean over dims (``var_mean`` / ``var``), also over a split dim: batch norm.

Inductor's decomposition table turns training-mode batch norm into
``var_mean(x, [0, 2, 3], correction=0, keepdim=True)`` plus pointwise ops (the running statistics
are updated from its outputs), and its backward into sums. A variance is not linear: variances of
pieces do not add, so DTensor's rule gathers the input when a reduced dim is split, which under
data parallelism gathers every activation. Per mesh axis, the options here are:

- Replicate -> Replicate;
- Shard(d), d not reduced -> Shard(d') (d' = d's index in the output);
- Shard(d), d reduced -> Replicate, computed by ``lower_split`` from partial sums: each rank's
  sum over its piece is Partial(sum), all_reduced and divided by the GLOBAL count (the mean),
  then each rank's sum of squared deviations from that mean is all_reduced the same way (the
  variance). Statistics over the global batch, as torch's SyncBatchNorm computes them.

Why two passes (two all_reduces of the statistic's size, per channel for batch norm) and not
sum and sum of squares in one: E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std, and
the two-pass result is as accurate as one device's. torch's SyncBatchNorm keeps one round by
all-gathering every rank's (count, mean, invstd) and combining them (Chan et al., 1979); that
needs a gather-and-combine we do not lower. ``in_op_cost`` prices the two all_reduces.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ...core.placements import Placements
from ..config import DEFAULT, PlannerConfig
from ..cost import redistribute_cost
from .base import OpSpec, RuleKind, expand_multi_output, expand_to_mesh, val_shape

aten = torch.ops.aten
MOMENTS = {aten.var_mean.correction, aten.var.correction}


def _dims(node: fx.Node, ndim: int) -> tuple[int, ...]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not dims:  # None or []: every dim
        return tuple(range(ndim))
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


def _keepdim(node: fx.Node) -> bool:
    return bool(node.kwargs.get("keepdim", False))


def _correction(node: fx.Node) -> float:
    c = node.kwargs.get("correction")
    return 1.0 if c is None else float(c)


def moments_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    x = node.args[0]
    shape = val_shape(x)
    dims = _dims(node, len(shape))
    keep = _keepdim(node)
    options: list[tuple[tuple[Placement], Placement]] = [((Replicate(),), Replicate())]
    for d in range(len(shape)):
        if d not in dims:
            out_d = d if keep else d - sum(r < d for r in dims)
            options.append(((Shard(d),), Shard(out_d)))
        elif x.meta["val"].dtype.is_floating_point:
            options.append(((Shard(d),), Replicate()))
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        out_shapes = [tuple(v.shape) for v in val]
        return expand_multi_output([(ins, tuple(out for _ in out_shapes)) for ins, out in options],
                                   mesh_shape, [shape], out_shapes, RuleKind.MOMENTS)
    return expand_to_mesh(options, mesh_shape, [shape], tuple(val.shape), RuleKind.MOMENTS)


def _stat_placements(node: fx.Node, x_placements: Placements) -> tuple[Placements, Placements]:
    """(placements of the per-rank partial sums over the reduced dims, kept as size 1;
    placements after the reduction): Partial(sum) -> Replicate on the axes that split a reduced
    dim, the input's own elsewhere."""
    dims = _dims(node, len(val_shape(node.args[0])))
    partial = tuple(Partial("sum") if type(p) is Shard and p.dim in dims else p
                    for p in x_placements)
    return partial, tuple(Replicate() if isinstance(p, Partial) else p for p in partial)


def splits_reduced_dim(node: fx.Node, spec: OpSpec) -> bool:
    """True for an OpSpec of ``MOMENTS`` that reduces over a split dim (lowered by
    ``lower_split``, with collectives inside the op)."""
    if node.target not in MOMENTS or spec.kind is not RuleKind.MOMENTS:
        return False
    partial, _ = _stat_placements(node, spec.inputs[0])
    return any(isinstance(p, Partial) for p in partial)


def in_op_cost(node: fx.Node, spec: OpSpec, mesh_shape: Sequence[int],
               config: PlannerConfig = DEFAULT) -> float:
    """Bytes-equivalent of the two all_reduces ``lower_split`` runs (0 for other OpSpecs)."""
    if not splits_reduced_dim(node, spec):
        return 0.0
    x = node.args[0].meta["val"]
    dims = _dims(node, x.ndim)
    stat = tuple(1 if d in dims else s for d, s in enumerate(x.shape))
    partial, full = _stat_placements(node, spec.inputs[0])
    return 2 * redistribute_cost(stat, x.dtype, partial, full, mesh_shape, config=config)


Reduce = Callable[[torch.Tensor, Placements, Placements, tuple[int, ...]], torch.Tensor]


def lower_split(node: fx.Node, x: torch.Tensor, spec: OpSpec, reduce: Reduce):
    """Local computation of ``var_mean`` / ``var`` on this rank's piece ``x`` (LOCAL shape)
    when the OpSpec splits a reduced dim. ``reduce(t, partial, full, global_shape)`` turns the
    local partial sums ``t`` (placements ``partial``) into their ``full`` placements: the
    redistribute (all_reduce) lowering emits and records. Returns what the op returns, LOCAL."""
    xval = node.args[0].meta["val"]
    gshape = tuple(xval.shape)
    dims = _dims(node, len(gshape))
    stat_shape = tuple(1 if d in dims else s for d, s in enumerate(gshape))
    partial, full = _stat_placements(node, spec.inputs[0])
    n = math.prod(gshape[d] for d in dims)  # GLOBAL count per statistic
    # low-precision inputs accumulate in float32, as the CPU kernels do
    acc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = reduce(acc.sum(list(dims), keepdim=True), partial, full, stat_shape) / n
    dev = acc - mean
    sq = reduce((dev * dev).sum(list(dims), keepdim=True), partial, full, stat_shape)
    var = sq / max(n - _correction(node), 0)  # torch's divisor; 0 gives inf/nan as torch does
    if not _keepdim(node):
        var, mean = var.squeeze(list(dims)), mean.squeeze(list(dims))
    var, mean = var.to(x.dtype), mean.to(x.dtype)
    return (var, mean) if node.target is aten.var_mean.correction else var
