"""Op sharding rules: for one FX node, the OpStrategy (every acceptable OpSpec).

An ``OpSpec`` says: if the tensor inputs hold these placements, the op computed on local shards
gives outputs with these placements. Rules come from three sources, tried in order, and each
OpSpec records which one produced it (``source``):

1. native rules written here per op family, for ONE mesh axis and expanded to N-D meshes by
   ``expand_to_mesh``: pointwise ops (from ``torch.Tag.pointwise``, with Partial kept only
   through ops that are linear in that argument), matmuls as einsum strings, factory ops,
   sharding constraints;
2. DTensor's strategy registry, through ``dtensor_adapter`` (views, reductions, embedding, ...);
3. none: the op runs replicated (every input all-gathered), which propagation logs with its cost.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dynamo_dist import _compat  # noqa: F401  (its Inductor imports register the prims ops)
from dynamo_dist.ops import MATMUL_ND

from .placements import Placements, is_placements, replicate, shard_range, valid_for

aten = torch.ops.aten
prims = torch.ops.prims

@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Input placements (one per tensor argument, in ``tensor_args`` order) -> output placements
    (a tuple of Placements for a single tensor output, or a tuple of those for several)."""

    inputs: tuple[Placements, ...]
    output: object
    source: str


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The FX nodes holding tensors among a node's args and kwargs, in pytree order (FX
    arguments nest only lists, tuples and dicts; walked by hand: the planner asks this hundreds
    of thousands of times, and pytree's generic walk was a quarter of the planning time)."""
    out: list[fx.Node] = []
    _collect_tensor_nodes(node.args, out)
    _collect_tensor_nodes(node.kwargs, out)
    return out


def _collect_tensor_nodes(value, out: list[fx.Node]) -> None:
    if isinstance(value, fx.Node):
        if isinstance(value.meta.get("val"), torch.Tensor):
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_tensor_nodes(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_tensor_nodes(v, out)


def val_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


# ---------------------------------------------------------------------------------------------
# Expansion: per-axis options -> N-D OpSpecs
# ---------------------------------------------------------------------------------------------
AxisOption = tuple[tuple[Placement, ...], Placement]  # (per tensor arg, output) on one axis


def expand_to_mesh(options: Sequence[AxisOption], mesh_shape: Sequence[int], in_shapes, out_shape,
                   source: str) -> list[OpSpec]:
    """Cartesian product of one-axis options over the mesh axes, keeping only valid placements."""
    multi = [((ins, (out,))) for ins, out in options]
    return [OpSpec(s.inputs, s.output[0], source)
            for s in expand_multi_output(multi, mesh_shape, in_shapes, [out_shape], source)]


def expand_multi_output(options, mesh_shape: Sequence[int], in_shapes, out_shapes,
                        source: str) -> list[OpSpec]:
    """``expand_to_mesh`` for ops with several tensor outputs: each option is
    (per tensor arg, per output) on one axis; OpSpec.output is a tuple of Placements."""
    specs = []
    for combo in itertools.product(options, repeat=len(mesh_shape)):
        ins = tuple(tuple(opt[0][i] for opt in combo) for i in range(len(in_shapes)))
        outs = tuple(tuple(opt[1][j] for opt in combo) for j in range(len(out_shapes)))
        if all(valid_for(s, p, mesh_shape) for s, p in zip(out_shapes, outs)) and all(
                valid_for(s, p, mesh_shape) for s, p in zip(in_shapes, ins)):
            specs.append(OpSpec(ins, outs, source))
    return specs


# ---------------------------------------------------------------------------------------------
# Pointwise
# ---------------------------------------------------------------------------------------------
_EXTRA_POINTWISE = {
    prims.convert_element_type.default, prims.fma.default, aten.clone.default,
    aten.alias.default, aten._to_copy.default, aten.where.self, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.fill.Scalar, aten.copy.default, aten.lift_fresh_copy.default,
}
# Ops linear in a set of arguments jointly: Partial(sum/avg) in exactly those (all others
# Replicate) gives a Partial output. add(P, P) = P; mul(P, R) = P; add(P, 1.0) is NOT linear.
_LINEAR_JOINT = {aten.add.Tensor, aten.sub.Tensor}
# a*b + c: linear jointly in (b, c) with a Replicate, or in (a, c) with b Replicate
_LINEAR_SETS = {prims.fma.default: [(1, 2), (0, 2)]}
_LINEAR_ANY_ONE = {aten.mul.Tensor}
_LINEAR_FIRST = {aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default,
                 aten.clone.default, aten.alias.default, prims.convert_element_type.default,
                 aten._to_copy.default, aten.lift_fresh_copy.default}
# reversal along some dims (flip decomposes to prims.rev): any other dim may be split, and a
# pending sum stays pending (a permutation of elements is linear)
_REVERSE = {prims.rev.default: 1, aten.flip.default: 1}


def reverse_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    shape = val_shape(node)
    dims = {d % max(len(shape), 1) for d in node.args[_REVERSE[node.target]]}
    options: list[AxisOption] = [((Replicate(),), Replicate()), ((Partial(),), Partial())]
    options += [((Shard(d),), Shard(d)) for d in range(len(shape)) if d not in dims]
    return expand_to_mesh(options, mesh_shape, [shape], shape, "reverse")


def is_random(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def is_pointwise(op) -> bool:
    return op in _EXTRA_POINTWISE or (
        isinstance(op, torch._ops.OpOverload) and
        (torch.Tag.pointwise in op.tags or _prim_with_pointwise_twin(op)))


@functools.lru_cache(maxsize=None)
def _prim_with_pointwise_twin(op) -> bool:
    """prims.sqrt, prims.bitwise_and, ... carry no pointwise tag; their aten twin does. Prims
    take same-shape operands (no broadcasting), so the pointwise rule holds for them as is."""
    if op.namespace != "prims":
        return False
    twin = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
    return twin is not None and any(torch.Tag.pointwise in getattr(twin, o).tags
                                    for o in twin.overloads())


def _linear_sets(node: fx.Node, n_tensors: int) -> list[tuple[int, ...]]:
    op = node.target
    positional_tensors = sum(isinstance(a, fx.Node) for a in node.args[:2])
    if op in _LINEAR_JOINT and n_tensors == 2 and positional_tensors == 2:
        return [(0, 1)]
    if op in _LINEAR_SETS and n_tensors == 3 and all(isinstance(a, fx.Node) for a in node.args[:3]):
        return _LINEAR_SETS[op]
    if op in _LINEAR_ANY_ONE and n_tensors == 2:
        return [(0,), (1,)]
    if op in _LINEAR_ANY_ONE and n_tensors == 1:
        return [(0,)]
    if op in _LINEAR_FIRST and isinstance(node.args[0], fx.Node):
        return [(0,)]
    return []


def pointwise_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    if isinstance(node.meta["val"], (tuple, list)):
        return _pointwise_multi_output(node, mesh_shape)
    targs = tensor_args(node)
    in_shapes = [val_shape(a) for a in targs]
    out_shape = val_shape(node)
    nd = len(out_shape)
    n = len(targs)
    options: list[AxisOption] = [(tuple(Replicate() for _ in targs), Replicate())]
    for d in range(nd):
        options.append((_broadcast_shards(in_shapes, out_shape, d), Shard(d)))
    # Partial(avg) is kept by the same ops, but nothing here produces it except a mean, whose
    # consumers DTensor's rules cover; offering it on every pointwise op only grows the search.
    for group in _linear_sets(node, n):
        ins = tuple(Partial("sum") if i in group else Replicate() for i in range(n))
        options.append((ins, Partial("sum")))
    return expand_to_mesh(options, mesh_shape, in_shapes, out_shape, "pointwise")


def _pointwise_multi_output(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """frexp-like ops: every output (all of one shape) split like the inputs; no Partial."""
    targs = tensor_args(node)
    in_shapes = [val_shape(a) for a in targs]
    out_shapes = [tuple(v.shape) for v in node.meta["val"]]
    options = [(tuple(Replicate() for _ in targs), tuple(Replicate() for _ in out_shapes))]
    for d in range(len(out_shapes[0])):
        options.append((_broadcast_shards(in_shapes, out_shapes[0], d),
                        tuple(Shard(d) for _ in out_shapes)))
    return expand_multi_output(options, mesh_shape, in_shapes, out_shapes, "pointwise")


def _broadcast_shards(in_shapes, out_shape, d: int) -> tuple[Placement, ...]:
    """Each input's placement when the output is split on dim ``d``: the input dim broadcasting
    aligns with it (trailing dims align) if it has the full size there, else Replicate."""
    nd = len(out_shape)
    ins = []
    for s in in_shapes:
        k = d - (nd - len(s))
        ins.append(Shard(k) if k >= 0 and s[k] == out_shape[d] else Replicate())
    return tuple(ins)


# ---------------------------------------------------------------------------------------------
# Matmul family as einsum
# ---------------------------------------------------------------------------------------------
_EINSUM = {aten.mm.default: "mk,kn->mn", aten.bmm.default: "bmk,bkn->bmn"}


def einsum_strategy(node: fx.Node, equation: str, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Rule for a two-operand einsum: batch/free letters shard through, contraction -> Partial."""
    lhs_rhs, out = equation.split("->")
    lhs, rhs = lhs_rhs.split(",")
    options: list[AxisOption] = [((Replicate(), Replicate()), Replicate())]
    for letter in dict.fromkeys(lhs + rhs):
        in_l, in_r, in_o = letter in lhs, letter in rhs, letter in out
        a = Shard(lhs.index(letter)) if in_l else Replicate()
        b = Shard(rhs.index(letter)) if in_r else Replicate()
        if in_o:
            options.append(((a, b), Shard(out.index(letter))))
        elif in_l and in_r:
            options.append(((a, b), Partial("sum")))
    options.append(((Partial("sum"), Replicate()), Partial("sum")))
    options.append(((Replicate(), Partial("sum")), Partial("sum")))
    targs = tensor_args(node)
    return expand_to_mesh(options, mesh_shape, [val_shape(a) for a in targs], val_shape(node),
                          "einsum:" + equation)


# ---------------------------------------------------------------------------------------------
# Embedding backward: accumulate rows of ``values`` into ``self`` at ``indices``
# ---------------------------------------------------------------------------------------------
def index_put_accumulate_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """``_unsafe_masked_index_put_accumulate(self, mask, [idx], values)``, self: [V, *F],
    idx and mask: [*I], values: [*I, *F].

    Per mesh axis: all Replicate; values split on an index dim (with idx and mask split the same
    way) accumulates partial sums (self and output Partial); values split on a feature dim splits
    self and the output on that dim.
    """
    self_n, mask_n, idx_list, values_n = node.args
    if len(idx_list) != 1 or not isinstance(idx_list[0], fx.Node):
        return []
    targs = tensor_args(node)
    shapes = [val_shape(a) for a in targs]
    n_index = len(shapes[1])
    n_feat = len(shapes[0]) - 1
    options: list[AxisOption] = [(tuple(Replicate() for _ in targs), Replicate())]
    for d in range(n_index):
        options.append(((Partial("sum"), Shard(d), Shard(d), Shard(d)), Partial("sum")))
    for f in range(n_feat):
        options.append(((Shard(1 + f), Replicate(), Replicate(), Shard(n_index + f)), Shard(1 + f)))
    options.append(((Partial("sum"), Replicate(), Replicate(), Partial("sum")), Partial("sum")))
    return expand_to_mesh(options, mesh_shape, shapes, val_shape(node), "index_put_accumulate")


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
    return expand_to_mesh(options, mesh_shape, [shape, src_shape], shape, "slice_scatter")


# ---------------------------------------------------------------------------------------------
# Fused attention (CPU flash kernel, forward and backward)
# ---------------------------------------------------------------------------------------------
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def attention_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """SDPA on [B, H, S, D] operands: attention is independent per batch row and per head, so
    every operand (and the logsumexp [B, H, S] / gradient outputs) splits on B or on H together;
    a mask whose B or H is broadcast (size 1, or absent) stays Replicate. The sequence dims are
    never split (causal masking uses global positions). With dropout the op runs replicated
    (dropout draws would differ from one device's).
    """
    backward = node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dropout_at = 6 if backward else 3
    if len(node.args) > dropout_at and node.args[dropout_at]:
        return []
    mask = node.kwargs.get("attn_mask")
    targs = tensor_args(node)
    in_shapes = [val_shape(a) for a in targs]
    out_shapes = [tuple(v.shape) for v in node.meta["val"]]
    ref = out_shapes[0]  # [B, H, S, D]: the output, or grad_query
    options = [(tuple(Replicate() for _ in targs), tuple(Replicate() for _ in out_shapes))]
    for d in (0, 1):
        ins = []
        for a, s in zip(targs, in_shapes):
            k = d - (4 - len(s)) if a is mask else d  # a mask broadcasts from the right
            ins.append(Shard(k) if 0 <= k < len(s) and s[k] == ref[d] else Replicate())
        options.append((tuple(ins), tuple(Shard(d) for _ in out_shapes)))
    return expand_multi_output(options, mesh_shape, in_shapes, out_shapes, "attention")


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------
def replicated_spec(node: fx.Node, ndim_mesh: int, source: str) -> OpSpec:
    rep = tuple(Replicate() for _ in range(ndim_mesh))
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        out: object = tuple(rep if isinstance(v, torch.Tensor) else None for v in val)
    else:
        out = rep
    return OpSpec(tuple(rep for _ in tensor_args(node)), out, source)


def manual_strategy(node: fx.Node, ndim_mesh: int) -> OpSpec | None:
    """Manual regions (``to_local`` ... ``from_local``): a local value is planned as Replicate,
    so nothing moves between local values and lowering runs local code as written; the region's
    entry reads its input in the region's placements and the exit produces them."""
    from dynamo_dist.annotations import ENTER_OP, EXIT_OP, decode_spec  # lazy: imports us
    from dynamo_dist.manual import MANUAL

    rep = tuple(Replicate() for _ in range(ndim_mesh))
    if node.target is ENTER_OP:
        return OpSpec((decode_spec(node.args[1])[1],), rep, "manual")
    if node.target is EXIT_OP:
        return OpSpec((rep,), decode_spec(node.args[1])[1], "manual")
    if node.meta.get(MANUAL):
        return replicated_spec(node, ndim_mesh, "manual")
    return None


def op_strategy(node: fx.Node, current: Sequence[Placements], mesh, mesh_shape: Sequence[int],
                constraint_of: Callable[[fx.Node], Placements | None]) -> list[OpSpec]:
    """All acceptable OpSpecs for ``node`` (empty list: no rule, caller falls back).

    ``current`` holds the placements its tensor inputs have now (DTensor's rules need them to
    enumerate). ``constraint_of`` returns the placements a sharding-constraint node pins.
    """
    def kept(specs):
        return [s for s in specs if _partial_only_on_floats(node, s) and
                _one_placement_per_value(node, s) and _uneven_aligned(node, s, mesh_shape)]

    specs = kept(_op_strategy(node, current, mesh, mesh_shape, constraint_of))
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
_EMPTY_OK = ("pointwise", "einsum:", "reverse", "slice_scatter", "index_put_accumulate")


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
    if spec.source in ("constraint", "input", "manual"):
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
        if shard_range(sizes.pop(), n, n - 1)[1] == 0 and not spec.source.startswith(_EMPTY_OK):
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


def _partial_only_on_floats(node: fx.Node, spec: OpSpec) -> bool:
    """A pending sum of integers or booleans (indices, masks) is never what a program means."""
    vals = [(a.meta["val"], p) for a, p in zip(tensor_args(node), spec.inputs)]
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor) and is_placements(spec.output):
        vals.append((out, spec.output))
    return all(v.is_floating_point() or not any(isinstance(p, Partial) for p in pls)
               for v, pls in vals)


def _op_strategy(node, current, mesh, mesh_shape, constraint_of) -> list[OpSpec]:
    op = node.target
    ndim = len(mesh_shape)
    if node.op == "get_attr":  # a tensor constant the trace captured (torch.tensor(0.) ...)
        return [replicated_spec(node, ndim, "constant")]
    pinned = constraint_of(node)
    if pinned is not None:
        return [OpSpec((pinned,), pinned, "constraint")]
    manual = manual_strategy(node, ndim)
    if manual is not None:
        return [manual]
    if is_random(op) and op not in _ATTENTION:  # SDPA's own rule handles its dropout
        # Random draws (bernoulli for dropout, rand, normal, ...) run replicated: every rank draws
        # the GLOBAL tensor from its own generator and consumers slice it. With the same seed on
        # every rank this gives the same numbers as one device; a sharded draw would not.
        return [replicated_spec(node, ndim, "random")]
    if not tensor_args(node):
        return [replicated_spec(node, ndim, "factory")]
    if node.meta.get("val") is None:
        # an op with no tensor result checks its inputs (aten._linalg_check_errors raises on a
        # nonzero info): it reads the whole value on every rank, so all ranks raise together
        return [replicated_spec(node, ndim, "check")]
    if op in _EINSUM:
        return einsum_strategy(node, _EINSUM[op], mesh_shape)
    if op is MATMUL_ND:
        batch = "abcdefgh"[: val_shape(node).__len__() - 2]
        return einsum_strategy(node, f"{batch}mk,{batch}kn->{batch}mn", mesh_shape)
    if op is aten._unsafe_masked_index_put_accumulate.default:
        return index_put_accumulate_strategy(node, mesh_shape)
    if op is aten.slice_scatter.default:
        return slice_scatter_strategy(node, mesh_shape)
    if op in _ATTENTION:
        return attention_strategy(node, mesh_shape)
    if op in _REVERSE:
        return reverse_strategy(node, mesh_shape)
    if is_pointwise(op):
        return pointwise_strategy(node, mesh_shape)
    from .dtensor_adapter import dtensor_strategy

    return dtensor_strategy(node, current, mesh, mesh_shape)


GETITEM = operator.getitem
