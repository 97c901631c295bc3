"""Block-strided sharding (``_StridedShard(d, split_factor=k)``, "SS(d,k)") in op rules.

Megatron-LM shards a fused projection (GPT-2's ``c_attn`` q|k|v, gate|up) so that rank r holds
its piece of EVERY part: along the fused dim of size D, k blocks of D/k, each split in n, rank r
holding piece r of each block (``placements`` module doc). Two kinds of options come from here,
both only for split factors k the caller says are in play (``Strided``), so a program with no
strided placement plans exactly as before and one with them grows the search only around them:

1. **lifting** (``lift``): an OpSpec of a rule that is exact for ANY consistent subset of
   indices of the split dim (pointwise ops, matmul free / batch / contraction letters, reductions
   over other dims, views that only renumber dims), with every split operand on one mesh axis
   split on a dim of one GLOBAL size D (k n dividing D), holds with every ``Shard(d)`` on that
   axis replaced by ``SS(d, k)``: each rank computes on the same index subset of every operand,
   so a Shard output becomes SS and a contraction over the dim still leaves a Partial sum. The
   one-size condition is what makes the subsets consistent: a view that splits or merges the
   dim, a cat or split along it, grouped-query heads (Hq vs Hkv) all pair dims of different
   sizes and are never lifted. Rules whose exactness on contiguous pieces rests on more than
   index-wise independence are not lifted (allow-lists ``_LIFTED_SOURCES``/``_LIFTED_DTENSOR``;
   indexing and attention are not on them; grouped GEMMs are, as their splits never touch a dim
   ``offs`` cuts into groups).
2. **block-aligned cuts** of the strided dim itself: ``split`` / ``split_with_sizes`` / ``slice``
   cutting SS(d,k) exactly at block boundaries give each piece of m blocks ``SS(d, m)``
   (``Shard(d)`` for one block: q, k, v each split over heads as usual); ``cat`` of pieces that
   are whole blocks gives ``SS(d, k)`` (the backward of the split); ``slice_scatter`` of whole
   blocks into an SS(d,k) value keeps it. The local op then runs with its cut points divided by
   n (``lowering``), as every local block is D/(k n) long.

Rules that do not know SS are asked with its ``Shard`` twin (``placements.shard_twin``) and
their answers lifted. DTensor's view rules (``RESHAPES``) know SS and are also asked with it:
they merge and split the strided dim (flattening [a, b] split on b gives ``SS(0, a)``, the
head split of attention's [B*H, L, E] batched matmuls; unflattening gives ``Shard`` back), which
is how a split factor first appears in a program without strided parameters; such a factor is
kept only on the merged batch dim of batched matmuls (``_new_factor_ok``). Their answers are
checked against the definition by ``tests/test_strided.py``.

3. **nesting** (``nest``): with the batch on one mesh axis and the heads on a later one, the
   merge [B, H] -> [B*H] gives [Shard(0), SS(0, B / n_0)] (DTensor's view rule): an SS nested
   inside a Shard of its dim (``placements.valid_for``). Rules are asked with the inner SS as
   Replicate (``shard_twin``); an OpSpec that, on the later axis, has every tensor operand
   Replicate and, on the earlier one, every operand Shard on a dim of one GLOBAL size, is
   offered with each such dim also split by SS(d, k) on the later axis, for the factors of (1).
   Every rank then takes the same index subset of each operand's dim (the Shard's piece, then
   piece r of each of its k blocks), so an index-wise rule (the allow-lists of (1)) stays
   exact; a contraction or broadcast over the dim has an operand not Shard there and is never
   nested. Without it BLOOM's ALiBi attention on dp x tp gave up data parallelism (2026-11-28).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ...core.placements import Placements, is_placements, is_strided, strided, valid_for
from .base import OpSpec, RuleKind, RuleSource, node_arg, replicated_spec, tensor_args, val_shape

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Strided:
    """Split factors in play at one node: ``local``, those of _StridedShard placements its
    inputs may hold; ``program``, those of the program's pinned placements (parameters,
    constraints), the only ones ``cat`` and ``slice_scatter`` create from Shard pieces (the
    backward of a fused projection's split)."""

    local: frozenset[int] = frozenset()
    program: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.local or self.program)


NONE = Strided()

# native rules (by source prefix) and DTensor-registry ops (by overload packet) whose OpSpecs
# hold for any consistent index subset of a split dim; see the module doc
# grouped GEMMs: their N, K, M and batch splits are index-wise like a matmul's; the dims offs
# cuts into groups are never split by the rule, so never lifted either
_LIFTED_KINDS = frozenset({RuleKind.POINTWISE, RuleKind.REVERSE, RuleKind.EINSUM,
                           RuleKind.SLICE_SCATTER, RuleKind.GROUPED_MM,
                           RuleKind.GROUPED_MM_FALLBACK})
_LIFTED_DTENSOR = {
    # renumbering / index-preserving views
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "expand", "alias", "clone", "slice", "select", "split", "split_with_sizes", "cat",
    # matmuls DTensor's registry answers (addmm: a bias plus an einsum)
    "addmm", "mm", "bmm", "baddbmm",
    # reductions and normalisations over other dims (over the split dim: Partial)
    "sum", "mean", "amax", "amin", "_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward",
}


# A split factor that only a view created (SS(0, B) of attention's [B*H, L, S] batch) is lifted
# through batched matmuls and dim renumbering, and through any op on the merged batch dim of a
# rank >= 3 value (the softmax between attention's two bmm): the path such a merge serves.
# Lifted through every op, it spread over the whole program (a Llama's sequence splits, merged
# with the batch by every [B*T, H] view, doubled the planner's choices and took its ILP from
# 3.6 s to 20 s for no better plan). A factor the program pins lifts everywhere.
_VIEW_FACTOR_OPS = {aten.bmm.default, aten.baddbmm.default, aten.permute.default,
                    aten.transpose.int, aten.t.default, aten.expand.default, aten.clone.default,
                    aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim,
                    aten.squeeze.dims, aten.view.default, aten._unsafe_view.default,
                    aten.reshape.default}


def _liftable(node: fx.Node, spec: OpSpec) -> bool:
    if spec.kind in _LIFTED_KINDS:
        return True
    return spec.kind is RuleKind.DTENSOR and \
        getattr(node.target, "_overloadpacket", None) is not None and \
        node.target._overloadpacket.__name__ in _LIFTED_DTENSOR


def _out_shapes(node: fx.Node) -> list[tuple[int, ...] | None]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [tuple(val.shape)]
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in val]


def _outputs(spec: OpSpec) -> list[Placements | None]:
    return [spec.output] if is_placements(spec.output) else list(spec.output)


def _pack(spec: OpSpec, ins, outs) -> OpSpec:
    out = outs[0] if is_placements(spec.output) else tuple(outs)
    return OpSpec(tuple(ins), out, spec.source)


def _with(pls: Placements, axis: int, p: Placement) -> Placements:
    return pls[:axis] + (p,) + pls[axis + 1:]


def _twins(node: fx.Node, specs: Sequence[OpSpec], strided_in: Strided,
           mesh_shape: Sequence[int], substitutions) -> list[OpSpec]:
    """The OpSpecs ``substitutions(pairs)`` makes of each liftable spec: it yields, per way to
    split, the (shape, dim) operands the split touches (which pick the factors in play: those
    of the local inputs on attention's merged batch or through a view, else only factors the
    program also pins) and ``sub(k)``, a map of one placement (None: no twin for factor k);
    each twin is checked with ``valid_for``."""
    if not strided_in.local:
        return []
    in_shapes = [val_shape(a) for a in tensor_args(node)]
    out_shapes = _out_shapes(node)
    new: list[OpSpec] = []
    for spec in specs:
        if not _liftable(node, spec):
            continue
        outs = _outputs(spec)
        pairs = list(zip(in_shapes, spec.inputs)) + \
            [(s, p) for s, p in zip(out_shapes, outs) if s is not None and p is not None]
        for split, sub_of in substitutions(pairs):
            batched = all(d == 0 and len(s) >= 3 for s, d in split)
            factors = strided_in.local if batched or node.target in _VIEW_FACTOR_OPS \
                else strided_in.local & strided_in.program
            for k in sorted(factors):
                sub = sub_of(k)
                if sub is None:
                    continue
                ins = [sub(p) for p in spec.inputs]
                twin = [sub(p) for p in outs]
                if all(valid_for(s, p, mesh_shape) for s, p in zip(in_shapes, ins)) and all(
                        s is None or p is None or valid_for(s, p, mesh_shape)
                        for s, p in zip(out_shapes, twin)):
                    new.append(_pack(spec, ins, twin))
    return new


def lift(node: fx.Node, specs: Sequence[OpSpec], strided_in: Strided,
         mesh_shape: Sequence[int]) -> list[OpSpec]:
    """The lifted twins of ``specs`` (see the module doc), one per (spec, mesh axis, factor)
    that qualifies; each is checked with ``valid_for`` (k n divides the dim)."""
    def substitutions(pairs):
        for axis, n in enumerate(mesh_shape):
            if any(is_strided(p[axis]) for _, p in pairs):
                continue  # already strided on this axis (a DTensor view's own SS): as is
            split = [(s, p[axis].dim) for s, p in pairs if type(p[axis]) is Shard]
            sizes = {s[d] for s, d in split}
            if len(sizes) != 1:
                continue
            size = sizes.pop()

            def sub_of(k, axis=axis, n=n, size=size):
                if size % (k * n):
                    return None
                return lambda pls: pls if pls is None or type(pls[axis]) is not Shard else \
                    _with(pls, axis, strided(pls[axis].dim, k))

            yield split, sub_of

    return _twins(node, specs, strided_in, mesh_shape, substitutions)


def nest(node: fx.Node, specs: Sequence[OpSpec], strided_in: Strided,
         mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Nested twins of ``specs`` (module doc, 3.): for a liftable OpSpec, an axis b where every
    tensor operand (inputs and outputs) is Replicate and an earlier axis a where every one is
    Shard on a dim of one GLOBAL size D, the OpSpec with each operand's dim also split on b by
    SS(d, k), inside a's piece, for each split factor k in play that ``valid_for`` holds."""
    def substitutions(pairs):
        for b in range(1, len(mesh_shape)):
            if not all(type(p[b]) is Replicate for _, p in pairs):
                continue
            for a in range(b):
                if not all(type(p[a]) is Shard for _, p in pairs) or \
                        len({s[p[a].dim] for s, p in pairs}) != 1:
                    continue

                def sub_of(k, a=a, b=b):
                    return lambda pls: pls if pls is None else \
                        _with(pls, b, strided(pls[a].dim, k))

                yield [(s, p[a].dim) for s, p in pairs], sub_of

    return _twins(node, specs, strided_in, mesh_shape, substitutions)


# ---------------------------------------------------------------------------------------------
# Cuts of the strided dim at block boundaries
# ---------------------------------------------------------------------------------------------
_BIG = 2 ** 62  # slice ends past the dim (9223372036854775807) are clamped first


def _dim(value, ndim: int) -> int:
    return value % ndim if ndim else 0


def _blocks(bounds: Sequence[int], size: int, k: int) -> list[int] | None:
    """Blocks per piece when [0, size) is cut at ``bounds`` (offsets, first 0, last size) and
    every cut falls on a boundary of k blocks; None otherwise."""
    if size % k:
        return None
    block = size // k
    if any(b % block for b in bounds):
        return None
    return [(b1 - b0) // block for b0, b1 in zip(bounds, bounds[1:])]


def _from_replicated(node: fx.Node, base: Sequence[OpSpec], mesh_shape: Sequence[int],
                     make) -> list[OpSpec]:
    """For each base OpSpec that is Replicate on some mesh axis for every operand, the OpSpec
    ``make(axis, n)`` builds there (None: none); keeps the other axes' placements."""
    in_shapes = [val_shape(a) for a in tensor_args(node)]
    out_shapes = _out_shapes(node)
    new = []
    for spec in base:
        outs = _outputs(spec)
        for axis, n in enumerate(mesh_shape):
            if not all(p is None or type(p[axis]) is Replicate for p in (*spec.inputs, *outs)):
                continue
            made = make(axis, n)
            if made is None:
                continue
            for ins_axis, outs_axis, source in made:
                ins = [_with(p, axis, q) for p, q in zip(spec.inputs, ins_axis)]
                new_outs = [p if p is None else _with(p, axis, q)
                            for p, q in zip(outs, outs_axis)]
                if all(valid_for(s, p, mesh_shape) for s, p in zip(in_shapes, ins)) and all(
                        s is None or p is None or valid_for(s, p, mesh_shape)
                        for s, p in zip(out_shapes, new_outs)):
                    out = new_outs[0] if is_placements(spec.output) else tuple(new_outs)
                    new.append(OpSpec(tuple(ins), out, source))
    return new


def cut_options(node: fx.Node, base: Sequence[OpSpec], strided_in: Strided,
                mesh_shape: Sequence[int]) -> list[OpSpec]:
    """SS options of split / split_with_sizes / slice / cat / slice_scatter along the strided
    dim (module doc, 2.). ``base``: the op's other OpSpecs (the replicated one is added)."""
    op = node.target
    if op in (aten.split.Tensor, aten.split_with_sizes.default):
        return _split(node, base, strided_in.local, mesh_shape)
    if op is aten.slice.Tensor:
        return _slice(node, base, strided_in.local, mesh_shape)
    if op is aten.cat.default:
        return _cat(node, base, strided_in.program, mesh_shape)
    if op is aten.slice_scatter.default:
        return _slice_scatter(node, base, strided_in.program, mesh_shape)
    return []


def _split(node, base, factors, mesh_shape) -> list[OpSpec]:
    if not factors or not isinstance(node.args[0], fx.Node):
        return []
    shape = val_shape(node.args[0])
    d = _dim(node_arg(node, 2, "dim", 0), len(shape))
    sizes = [v.shape[d] for v in node.meta["val"]]
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)

    def make(axis, n):
        out = []
        for k in sorted(factors):
            m = _blocks(bounds, shape[d], k)
            if m is not None and all(b > 0 for b in m):
                out.append(((strided(d, k),), [strided(d, b) for b in m],
                            RuleSource(RuleKind.STRIDED, "split")))
        return out

    return _from_replicated(node, base, mesh_shape, make)


def _slice_bounds(node: fx.Node, shape, first: int):
    """(dim, start, end) of a unit-step slice whose dim argument is at ``first`` (start, end
    after it), clamped to the dim; None for a step or a symbolic bound."""
    d = _dim(node_arg(node, first, "dim", 0), len(shape))
    start, end, step = (node_arg(node, first + 1, "start", None), node_arg(node, first + 2, "end", None),
                        node_arg(node, first + 3, "step", 1))
    if step != 1 or not all(isinstance(v, (int, type(None))) for v in (start, end)):
        return None
    size = shape[d]
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None or end >= _BIG else (end + size if end < 0 else min(end, size))
    return d, start, end


def _whole_blocks(factors, start: int, end: int, size: int) -> list[tuple[int, int]]:
    """(k, blocks in [start, end)) for each split factor k whose block boundaries the cut
    [start, end) of a dim of ``size`` falls on."""
    return [(k, (end - start) // (size // k)) for k in sorted(factors)
            if end > start and _blocks(sorted({0, start, end, size}), size, k) is not None]


def _block_cuts(node, base, factors, mesh_shape, shape, first: int, spec_of) -> list[OpSpec]:
    """OpSpecs for a unit-step cut [start, end) of ``shape``'s dim (its dim argument at
    ``first``) that keeps whole blocks: ``spec_of(dim, k, blocks)`` per split factor k."""
    bounds = _slice_bounds(node, shape, first) if factors else None
    if bounds is None:
        return []
    d, start, end = bounds

    def make(axis, n):
        return [spec_of(d, k, blocks) for k, blocks in _whole_blocks(factors, start, end, shape[d])]

    return _from_replicated(node, base, mesh_shape, make)


def _slice(node, base, factors, mesh_shape) -> list[OpSpec]:
    return _block_cuts(node, base, factors, mesh_shape, val_shape(node.args[0]), 1,
                       lambda d, k, blocks: ((strided(d, k),), [strided(d, blocks)],
                                             RuleSource(RuleKind.STRIDED, "slice")))


def _cat(node, base, factors, mesh_shape) -> list[OpSpec]:
    tensors = node.args[0]
    targs = tensor_args(node)
    if not factors or len(targs) != len(tensors) or len(targs) < 2:
        return []
    out_shape = val_shape(node)
    d = _dim(node_arg(node, 1, "dim", 0), len(out_shape))
    if any(len(val_shape(a)) != len(out_shape) for a in targs):
        return []  # legacy cat of an empty 1-D tensor
    bounds = [0]
    for a in targs:
        bounds.append(bounds[-1] + val_shape(a)[d])

    def make(axis, n):
        out = []
        for k in sorted(factors):
            m = _blocks(bounds, out_shape[d], k)
            if m is not None and all(b > 0 for b in m):
                out.append((tuple(strided(d, b) for b in m), [strided(d, k)],
                            RuleSource(RuleKind.STRIDED, "cat")))
        return out

    return _from_replicated(node, base, mesh_shape, make)


def _slice_scatter(node, base, factors, mesh_shape) -> list[OpSpec]:
    if not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return []
    return _block_cuts(node, base, factors, mesh_shape, val_shape(node), 2,
                       lambda d, k, blocks: ((strided(d, k), strided(d, blocks)),
                                             [strided(d, k)],
                                             RuleSource(RuleKind.STRIDED, "slice_scatter")))


RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _new_factor_ok(node: fx.Node, spec: OpSpec, allowed: frozenset[int]) -> bool:
    """A DTensor OpSpec whose output holds a _StridedShard of a factor not in play (a view that
    merges a split dim with outer ones) is kept only where that serves batched matmuls: the
    merged dim is dim 0 of a rank >= 3 result ([B, H, L, E] -> [B*H, L, E], H split). A merge
    into the rows of a matrix ([B, T, H] -> [B*T, H], T split: every sequence split of a
    program) would offer a new layout for nearly every activation (measured on a Llama: +40%
    ILP flow variables for the same plan)."""
    if spec.kind is not RuleKind.DTENSOR:
        return True
    for shape, pls in zip(_out_shapes(node), _outputs(spec)):
        for p in pls or ():
            if is_strided(p) and int(p.split_factor) not in allowed and \
                    not (p.dim == 0 and shape is not None and len(shape) >= 3):
                return False
    return True


def with_strided(node: fx.Node, specs: list[OpSpec], strided_in: Strided,
                 mesh_shape: Sequence[int]) -> list[OpSpec]:
    """``specs`` (asked with Shard twins of the inputs' placements) plus their SS options for
    the factors in play (``lift``, ``cut_options``)."""
    allowed = strided_in.local | strided_in.program
    specs = [s for s in specs if _new_factor_ok(node, s, allowed)]
    if not strided_in or not specs:
        return specs
    base = specs + [replicated_spec(node, len(mesh_shape), RuleKind.STRIDED)]
    new = lift(node, specs, strided_in, mesh_shape) + nest(node, specs, strided_in, mesh_shape) \
        + cut_options(node, base, strided_in, mesh_shape)
    return list(dict.fromkeys(specs + new))
