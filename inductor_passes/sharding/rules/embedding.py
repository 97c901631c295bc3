"""Embedding lookups and their backward, the vocabulary split included.

``aten.embedding(weight [V, H], indices [*]) -> [*, H]`` and
``aten.embedding_dense_backward(grad [*, H], indices [*], V, padding_idx, scale) -> [V, H]``.
Per mesh axis the options are:

- forward: everything replicated; the hidden dim split (weight Shard(1) -> output Shard(-1));
  the indices split on any of their dims (output split there); a Partial weight (the lookup is
  linear in it); and the **vocabulary split**: weight Shard(0), indices Replicate -> output
  Partial(sum). Each rank looks up the rows it holds (indices shifted by its piece's offset)
  and zeroes the lookups of rows it does not hold, so the ranks' outputs add up to the global
  lookup: Megatron-LM's VocabParallelEmbedding (Shoeybi et al., 2019), DTensor's
  ``_MaskPartial``, which we do not lower as a placement;
- backward: the mirror images -- grad Shard(-1) -> Shard(1); grad and indices split on one of
  the indices' dims -> Partial(sum) (each rank adds its own tokens' rows); a Partial grad ->
  Partial; and grad and indices Replicate -> **Shard(0)**: each rank accumulates only the rows
  it holds (the other tokens masked to zero), so a vocabulary-split weight gets its gradient
  where it lives, with no collective.

The vocabulary options need a local computation of their own (``local_impl``); every other
option is the op run on local pieces. Uneven and empty pieces follow ``placements.shard_range``.
With ``scale_grad_by_freq`` the backward divides by each row's token count, which neither a
masked nor a token-split computation has: only the replicated, hidden-split and Partial options
are offered then.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ...core.placements import Placements, shard_range
from .base import OpSpec, RuleKind, expand_to_mesh, node_arg, val_shape

aten = torch.ops.aten
EMBEDDING = {aten.embedding.default, aten.embedding_dense_backward.default}
# Inductor decomposes the backward into zeros [V, H] plus a masked index_put, whose rule cannot
# split the indexed (vocabulary) dim: a token-split plan then adds each rank's tokens into a whole
# [V, H] buffer and reduce-scatters it (2 GiB per rank at Llama-3's vocabulary). Kept whole, the
# vocabulary option is on offer too: gather the tokens' gradients and accumulate only this
# rank's rows, where the cost model finds that cheaper.
EMBEDDING_PLANNED_WHOLE = {aten.embedding_dense_backward.default}
P, R = Partial("sum"), Replicate()


def _only_for_backward(value, backward: fx.Node) -> bool:
    """``value`` is a node whose every user is an embedding backward."""
    return isinstance(value, fx.Node) and all(u.target is backward.target for u in value.users)


def own_backward_indices(gm: fx.GraphModule) -> None:
    """Give each ``embedding_dense_backward`` an alias of its token ids of its own (in place;
    the caller recompiles). Its vocabulary option wants the ids whole; redistribute variables
    are per value, so with the ids shared with the forward lookup, a gather priced for the
    backward would be offered to the forward too (which would then repeat on every
    data-parallel rank). The alias is a free view that lowering and Inductor drop."""
    for node in list(gm.graph.find_nodes(op="call_function",
                                         target=aten.embedding_dense_backward.default)):
        ids = node.args[1]
        if not isinstance(ids, fx.Node) or _only_for_backward(ids, node):
            continue
        with gm.graph.inserting_before(node):
            alias = gm.graph.call_function(aten.alias.default, (ids,))
        alias.meta = {**node.meta, "val": ids.meta["val"]}
        node.replace_input_with(ids, alias)


def vocab_gradient_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """Values an embedding's gradient may gather across a data axis at their plain price
    (``propagate.EdgePricer``): the token ids and the lookup's output gradient of each
    ``embedding_dense_backward``, when they feed nothing else (``own_backward_indices``).
    Gathered there, the vocabulary split accumulates only the rows this rank holds of its
    parameter's gradient ([V/n, H] instead of a whole [V, H] to reduce-scatter): at Llama-3-8B
    shapes on dp=8 it moves 224 MiB per rank instead of 1.75 GiB and holds 1/8 of the 2 GiB
    buffer. The step is not repeated across the batch (each rank adds different rows), so the
    data-axis surcharge does not apply; the cost model still decides (with more tokens a step
    than vocabulary rows, reducing is cheaper)."""
    return {value for node in gm.graph.find_nodes(op="call_function",
                                                  target=aten.embedding_dense_backward.default)
            for value in node.args[:2] if _only_for_backward(value, node)}


def embedding_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """Every OpSpec of an embedding or its dense backward on ``mesh_shape`` (module doc)."""
    shapes = [val_shape(a) for a in node.args[:2]]
    out = val_shape(node)
    if node.target is aten.embedding.default:
        k = len(shapes[1])  # the indices' rank: the output's hidden dim is k
        options = [((R, R), R), ((Shard(1), R), Shard(k)), ((P, R), P)] + \
            [((R, Shard(d)), Shard(d)) for d in range(k)]
        vocab = [((Shard(0), R), P)]
    else:
        k = len(shapes[1])
        options = [((R, R), R), ((Shard(k), R), Shard(1)), ((P, R), P)]
        vocab = []
        if not node_arg(node, 4, "scale_grad_by_freq", False):
            options += [((Shard(d), Shard(d)), P) for d in range(k)]
            vocab = [((R, R), Shard(0))]
    specs = expand_to_mesh(options + vocab, mesh_shape, shapes, out, RuleKind.EMBEDDING)
    split = [s for s in specs if _vocab_axes(node, s)]  # lowered by local_impl: tagged
    return [s for s in specs if s not in split] + \
        [OpSpec(s.inputs, s.output, RuleKind.VOCAB_EMBEDDING) for s in split]


def _vocab_axes(node: fx.Node, spec: OpSpec) -> list[int]:
    """Mesh axes on which ``spec`` splits the vocabulary (the weight's, or its gradient's,
    dim 0)."""
    pls = spec.inputs[0] if node.target is aten.embedding.default else spec.output
    return [a for a, p in enumerate(pls) if type(p) is Shard and p.dim == 0]


def _vocab_piece(size: int, pls: Placements, mesh_shape: Sequence[int],
                 coord: Sequence[int]) -> tuple[int, int]:
    """(first GLOBAL row, rows) of this rank's piece of a vocabulary of ``size`` rows split
    on dim 0 by ``pls`` (nested splits in mesh-axis order, as ``local_shape`` reads them)."""
    offset = 0
    for axis, p in enumerate(pls):
        if type(p) is Shard and p.dim == 0:
            start, size = shard_range(size, mesh_shape[axis], coord[axis])
            offset += start
    return offset, size


def local_impl(node: fx.Node, spec: OpSpec) -> Callable | None:
    """The local computation of ``spec`` on one rank where it is not the op itself (the
    vocabulary split), else None. The callable takes (local args, kwargs, mesh_shape,
    coordinate) and returns the LOCAL result."""
    if node.target not in EMBEDDING or spec.kind is not RuleKind.VOCAB_EMBEDDING:
        return None
    vocab = node.args[0].meta["val"].shape[0] if node.target is aten.embedding.default \
        else node.meta["val"].shape[0]
    pls = spec.inputs[0] if node.target is aten.embedding.default else spec.output

    def run(args, kwargs, mesh_shape, coord):
        offset, rows = _vocab_piece(int(vocab), pls, mesh_shape, coord)
        if node.target is aten.embedding.default:
            return _masked_lookup(args[0], args[1], offset, rows)
        padding_idx = node_arg(node, 3, "padding_idx", -1)
        return _masked_accumulate(args[0], args[1], offset, rows, padding_idx)

    return run


def _outside(indices: torch.Tensor, offset: int, rows: int):
    local = indices - offset
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def _masked_lookup(weight, indices, offset: int, rows: int):
    """This rank's share of ``embedding(weight_global, indices)``: its rows looked up, the
    others zero."""
    if rows == 0:
        return weight.new_zeros((*indices.shape, weight.shape[1]))
    local, outside = _outside(indices, offset, rows)
    return aten.embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0)


def _masked_accumulate(grad, indices, offset: int, rows: int, padding_idx: int):
    """Rows [offset, offset + rows) of ``embedding_dense_backward(grad, indices, V, ...)``."""
    if rows == 0:
        return grad.new_zeros((0, grad.shape[-1]))
    local, outside = _outside(indices, offset, rows)
    pad = padding_idx - offset if 0 <= padding_idx - offset < rows else -1
    return aten.embedding_dense_backward(grad.masked_fill(outside.unsqueeze(-1), 0), local,
                                         rows, pad, False)
