"""Op sharding rules: for one FX node, the OpStrategy (every acceptable OpSpec).

An ``OpSpec`` says: if the tensor inputs hold these placements, the op computed on local shards
gives outputs with these placements. Rules come from three sources, tried in order, and each
OpSpec records which one produced it (``source``):

1. native rules written here per op family, for ONE mesh axis and expanded to N-D meshes by
   ``expand_to_mesh``: pointwise ops (from ``torch.Tag.pointwise``, with Partial kept only
   through ops that are linear in that argument), matmuls as einsum strings, indexing,
   scatter and grouped GEMMs, embeddings (the vocabulary split, with a local computation of
   its own: ``local_impl``), factory ops, sharding constraints;
2. DTensor's strategy registry, through ``rules.dtensor`` (views, reductions, ...);
3. none: the op runs replicated (every input all-gathered), which propagation logs with its cost.

Each family lives in its own module (``pointwise``, ``matmul``, ``attention``, ``conv``,
``pool``, ``moments``, ``indexing``, ``embedding``, ``factory``, ``grouped_mm``, ``manual``,
``dtensor``);
this module dispatches a node to its family, applies the filters every OpSpec must pass
(``op_strategy``), and prices what an OpSpec costs beyond its input redistributes
(``node_cost``: compute, collectives inside the op).
Block-strided sharding (``_StridedShard``) is added on top of every family by ``strided``: rules
are asked with its Shard twin and their answers lifted.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Shard

from ...core import compat  # noqa: F401  (its Inductor imports register the prims ops)
from ...core.ops import MATMUL_ND
from ...core.placements import (Placements, is_placements, replicate, shard_range, shard_twin,
                                strided_factors)
from ..config import DEFAULT, PlannerConfig
from ..cost import ATTENTION_OPS, MATMUL_OPS, node_compute_cost
from .attention import ATTENTION, attention_strategy
from .base import (GETITEM, AxisOption, OpSpec, RuleKind, RuleSource, expand_multi_output,
                   expand_to_mesh, replicated_spec, tensor_args, val_shape)
from .conv import CONV, conv_flops, conv_strategy
from .dtensor import dtensor_strategy
from .embedding import EMBEDDING, EMBEDDING_PLANNED_WHOLE, embedding_strategy, local_impl
from .factory import FILLS, factory_strategy
from .grouped_mm import GROUPED_MM, grouped_mm_strategy
from .indexing import INDEXING, slice_scatter_strategy
from .manual import manual_strategy
from .matmul import EINSUM, einsum_strategy
from .moments import MOMENTS, in_op_cost, moments_strategy
from .pointwise import REVERSE, is_pointwise, is_random, pointwise_strategy, reverse_strategy
from .pool import POOL, POOL_PLANNED_WHOLE, pool_strategy
from .strided import RESHAPES, Strided, with_strided

__all__ = ["GETITEM", "AxisOption", "OpSpec", "RuleKind", "RuleSource", "Strided",
           "expand_multi_output",
           "expand_to_mesh", "PLANNED_WHOLE", "has_node_cost", "is_pointwise", "is_random",
           "local_impl", "node_cost", "op_strategy", "replicated_spec", "tensor_args", "val_shape"]

aten = torch.ops.aten
# ops capture keeps undecomposed so that their own rule plans them (lowering decomposes them
# on local shapes, so Inductor still sees the decomposed form)
PLANNED_WHOLE = POOL_PLANNED_WHOLE | EMBEDDING_PLANNED_WHOLE


def op_strategy(node: fx.Node, current: Sequence[Placements], mesh, mesh_shape: Sequence[int],
                constraint_of: Callable[[fx.Node], Placements | None],
                strided_in: Strided | None = None) -> list[OpSpec]:
    """All acceptable OpSpecs for ``node`` (empty list: no rule, caller falls back).

    ``current`` holds the placements its tensor inputs have now (DTensor's rules need them to
    enumerate). ``constraint_of`` returns the placements a sharding-constraint node pins.
    ``strided_in``: the _StridedShard split factors in play (``rules.strided``; default: those
    in ``current``, as if the program pinned them).
    """
    def kept(specs):
        specs = with_strided(node, specs, strided_in, mesh_shape)
        return [s for s in specs if _partial_only_on_numbers(node, s) and
                _one_placement_per_value(node, s) and _uneven_aligned(node, s, mesh_shape)]

    if strided_in is None:
        found = strided_factors(current)
        strided_in = Strided(found, found)
    twin = [shard_twin(c) for c in current]  # rules see Shard; SS options are lifted back
    specs = _op_strategy(node, twin, mesh, mesh_shape, constraint_of)
    if twin != list(current) and node.target in RESHAPES:
        # DTensor's view rules read _StridedShard themselves: a merge or split of the strided
        # dim ([B*H] SS(0, B) <-> [B, H] Shard(1)) that no lift can give
        specs = specs + dtensor_strategy(node, current, mesh, mesh_shape)
    specs = kept(specs)
    current = twin
    rep = tuple(replicate(len(mesh_shape)) for _ in current)
    if not specs and tuple(current) != rep:
        # DTensor's rules answer from the inputs' placements, and some have nothing usable for
        # a split they cannot compute on (amax over its uneven split dim): what they do for
        # replicated inputs is then the planned option (gather, compute), priced and in the
        # ledger, not a no-rule fallback. (Asked always, the extra options moved the Llama tp
        # plan from Megatron's 16 all_reduce to 32 gathers/scatters/reduces.)
        specs = kept(_op_strategy(node, rep, mesh, mesh_shape, constraint_of))
    return specs


# rules whose kernels compute right on an empty local piece (0 rows of a matmul, of a sum)
_EMPTY_OK = frozenset({
    RuleKind.POINTWISE, RuleKind.EINSUM, RuleKind.REVERSE, RuleKind.SLICE_SCATTER,
    RuleKind.INDEX_PUT, RuleKind.INDEX_PUT_ACCUMULATE, RuleKind.SCATTER, RuleKind.GATHER,
    RuleKind.HISTC, RuleKind.CUMSUM, RuleKind.GROUPED_MM_FALLBACK, RuleKind.MASKED_INDEX,
    RuleKind.MOMENTS, RuleKind.EMBEDDING, RuleKind.VOCAB_EMBEDDING, RuleKind.FACTORY})


def _uneven_aligned(node: fx.Node, spec: OpSpec, mesh_shape: Sequence[int]) -> bool:
    """An OpSpec that splits a dim unevenly (size 5 over 4 ranks: pieces 2, 2, 1, 0) is kept
    only where the local computation stays right on such pieces:

    - on that mesh axis, every split operand (inputs and outputs) has the same size on its
      split dim, so all pieces line up (a reshape that merges the dim, or a broadcast, does not);
    - a reduction over the split dim leaves Partial(sum) only: an average of uneven pieces is not
      the mean, and max/min of an empty piece is an error;
    - a split that leaves some rank an empty piece only for rules whose kernels take empty
      inputs (``_EMPTY_OK``); other kernels may reject them (MKL's FFT does).

    The same rule with an even split is DTensor's, so nothing else changes for uneven pieces.
    """
    if spec.kind in (RuleKind.CONSTRAINT, RuleKind.INPUT, RuleKind.MANUAL):
        return True  # the user's own placements
    pairs = [(val_shape(a), p) for a, p in zip(tensor_args(node), spec.inputs)]
    n_in = len(pairs)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and is_placements(spec.output):
        pairs.append((tuple(val.shape), spec.output))
    elif isinstance(val, (tuple, list)) and not is_placements(spec.output):
        pairs += [(tuple(v.shape), p) for v, p in zip(val, spec.output)
                  if isinstance(v, torch.Tensor) and p is not None]
    for axis, n in enumerate(mesh_shape):
        sizes = {shape[p[axis].dim] for shape, p in pairs if type(p[axis]) is Shard}
        if not any(s % n for s in sizes):
            continue
        if len(sizes) > 1:
            return False
        if shard_range(sizes.pop(), n, n - 1)[1] == 0 and spec.kind not in _EMPTY_OK:
            return False
        split_in = any(type(p[axis]) is Shard for _, p in pairs[:n_in])
        if split_in and any(isinstance(p[axis], Partial) and p[axis].reduce_op != "sum"
                            for _, p in pairs[n_in:]):
            return False
    return True


def _one_placement_per_value(node: fx.Node, spec: OpSpec) -> bool:
    """A value passed twice (``mul(x, x)``) is one local tensor: an OpSpec asking for it in two
    placements (mul's "linear in one operand" with (Partial, Replicate)) computes x * x as if it
    were linear in x."""
    seen: dict[fx.Node, object] = {}
    for a, p in zip(tensor_args(node), spec.inputs):
        if seen.setdefault(a, p) != p:
            return False
    return True


def _partial_only_on_numbers(node: fx.Node, spec: OpSpec) -> bool:
    """No pending reduction of booleans (masks); integers only as a pending sum, which is exact
    (a count of valid labels over a split batch: one all_reduce of a scalar, not a gather of the
    mask); an average or max of integers is not what integer code means."""
    vals = [(a.meta["val"], p) for a, p in zip(tensor_args(node), spec.inputs)]
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor) and is_placements(spec.output):
        vals.append((out, spec.output))
    for v, pls in vals:
        if v.is_floating_point() or v.is_complex():
            continue
        partial = [p for p in pls if isinstance(p, Partial)]
        if partial and (v.dtype is torch.bool or any(p.reduce_op != "sum" for p in partial)):
            return False
    return True


def _op_name(op) -> str:
    """'namespace::name.overload' of an OpOverload (custom ops of other libraries, such as
    transformers' grouped_mm_fallback, are matched by name: importing them is not ours)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ""
    return f"{schema.name}.{schema.overload_name or 'default'}"


def _op_strategy(node, current, mesh, mesh_shape, constraint_of) -> list[OpSpec]:
    op = node.target
    ndim = len(mesh_shape)
    if node.op == "get_attr":  # a tensor constant the trace captured (torch.tensor(0.) ...)
        return [replicated_spec(node, ndim, RuleKind.CONSTANT)]
    pinned = constraint_of(node)
    if pinned is not None:
        return [OpSpec((pinned,), pinned, RuleKind.CONSTRAINT)]
    manual = manual_strategy(node, ndim)
    if manual is not None:
        return [manual]
    if is_random(op) and op not in ATTENTION:  # SDPA's own rule handles its dropout
        # Random draws (bernoulli for dropout, rand, normal, ...) run replicated: every rank draws
        # the GLOBAL tensor from its own generator and consumers slice it. With the same seed on
        # every rank this gives the same numbers as one device; a sharded draw would not.
        return [replicated_spec(node, ndim, RuleKind.RANDOM)]
    if op in FILLS:
        return factory_strategy(node, mesh_shape)
    if not tensor_args(node):  # iota, scalar_tensor, ...: made whole on every rank
        return [replicated_spec(node, ndim, RuleKind.FACTORY)]
    if node.meta.get("val") is None:
        # an op with no tensor result checks its inputs (aten._linalg_check_errors raises on a
        # nonzero info): it reads the whole value on every rank, so all ranks raise together
        return [replicated_spec(node, ndim, RuleKind.CHECK)]
    if op in EINSUM:
        return einsum_strategy(node, EINSUM[op], mesh_shape)
    if op is MATMUL_ND:
        batch = "abcdefgh"[: val_shape(node).__len__() - 2]
        return einsum_strategy(node, f"{batch}mk,{batch}kn->{batch}mn", mesh_shape)
    if op is aten.slice_scatter.default:
        return slice_scatter_strategy(node, mesh_shape)
    if op in INDEXING:
        return INDEXING[op](node, mesh_shape)
    if op in EMBEDDING:
        return embedding_strategy(node, mesh_shape)
    if _op_name(op) in GROUPED_MM:
        return grouped_mm_strategy(node, mesh_shape)
    if op in ATTENTION:
        return attention_strategy(node, mesh_shape)
    if op in CONV:
        return conv_strategy(node, mesh_shape)
    if op in POOL:
        return pool_strategy(node, mesh_shape)
    if op in MOMENTS:
        return moments_strategy(node, mesh_shape)
    if op in REVERSE:
        return reverse_strategy(node, mesh_shape)
    if is_pointwise(op):
        return pointwise_strategy(node, mesh_shape)
    return dtensor_strategy(node, current, mesh, mesh_shape)




def has_node_cost(node: fx.Node) -> bool:
    """Whether ``node_cost`` can be nonzero for some OpSpec of ``node`` (the solver asks once
    per node, not per OpSpec)."""
    op = str(node.target)
    return node.target in CONV or node.target in MOMENTS or op in MATMUL_OPS or \
        op in ATTENTION_OPS


def node_cost(node: fx.Node, spec: OpSpec, mesh_shape: Sequence[int],
              config: PlannerConfig = DEFAULT) -> float:
    """What running ``node`` under ``spec`` costs one rank besides its input redistributes
    (bytes-equivalent, ``cost``'s unit): matmul and fused-attention flops
    (``cost.node_compute_cost``), convolution flops, split over the mesh axes the OpSpec splits
    the work on, and collectives an OpSpec runs inside the op (a variance over a split dim:
    ``moments.in_op_cost``). ``config``: the prices (bytes per flop, collective latency)."""
    if node.target in CONV:
        degree = 1
        for axis, n in enumerate(mesh_shape):  # work is split where any operand is
            if any(type(p[axis]) is Shard or isinstance(p[axis], Partial) for p in spec.inputs):
                degree *= n
        return conv_flops(node) / degree * config.bytes_per_flop
    if node.target in MOMENTS:
        return in_op_cost(node, spec, mesh_shape, config)
    return node_compute_cost(node, spec.output, mesh_shape, config)
