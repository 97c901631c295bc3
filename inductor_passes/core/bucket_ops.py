"""Custom ops our bucketing inserts into the graphs Inductor compiles.

``gathered_copy_out(gathered, split_sizes, ndims, shapes, perms)``: the parameters an all_gather
bucket gathered, each a new contiguous tensor. ``gathered`` is the bucket's flat output viewed
as ``[group_size, sum(split_sizes)]`` (one row per rank); piece i is its columns
``[sum(split_sizes[:i]), sum(split_sizes[:i+1]))``, read in row-major order as shape ``S_i``
(``[group_size, split_sizes[i]]`` or a reshape of it) and permuted by ``P_i``. ``shapes`` and
``perms`` are the ``S_i`` and ``P_i`` one after the other, ``ndims[i]`` numbers each (custom op
schemas take no nested lists). Output i has shape ``S_i`` permuted by ``P_i``, contiguous.

Why an op: the pieces are strided column slices, so each gathered parameter needs one copy to
be contiguous (and a parameter gathered along a tensor dim other than 0 a permuting one, which
joins the ranks' stacked pieces along that dim). Left to Inductor, every copy is a loop nest of
its own to generate and compile (9 per layer body on the demo Llama, forward and backward).
FSDP2 copies out eagerly (``split_with_sizes_copy`` in ``torch.distributed.fsdp``); so does
this op, as one extern call Inductor generates no code for.
"""

from __future__ import annotations

import torch


def pieces(ndims: list[int], flat: list[int]) -> list[list[int]]:
    """``flat`` cut into consecutive lists of ``ndims[i]`` numbers."""
    out, start = [], 0
    for n in ndims:
        out.append(list(flat[start:start + n]))
        start += n
    return out


@torch.library.custom_op("dynamo_dist::gathered_copy_out", mutates_args=())
def gathered_copy_out(gathered: torch.Tensor, split_sizes: list[int], ndims: list[int],
                      shapes: list[int], perms: list[int]) -> list[torch.Tensor]:
    shapes_, perms_ = pieces(ndims, shapes), pieces(ndims, perms)
    if all(p == [0, 1] and s == [gathered.shape[0], n]
           for s, p, n in zip(shapes_, perms_, split_sizes)):
        # (the out= form: on CUDA one fused kernel for every piece, as FSDP2 calls it)
        out = [gathered.new_empty(s) for s in shapes_]
        torch.split_with_sizes_copy(gathered, split_sizes, dim=1, out=out)
        return out
    out, offset = [], 0
    for size, shape, perm in zip(split_sizes, shapes_, perms_):
        piece = gathered.narrow(1, offset, size).reshape(shape).permute(perm)
        # (clone, not contiguous(): a piece already contiguous, on a group of one, would be
        # returned as a view of the input, which a custom op must not)
        out.append(piece.clone(memory_format=torch.contiguous_format))
        offset += size
    return out


@gathered_copy_out.register_fake
def _(gathered: torch.Tensor, split_sizes: list[int], ndims: list[int], shapes: list[int],
      perms: list[int]) -> list[torch.Tensor]:
    return [gathered.new_empty([shape[p] for p in perm])
            for shape, perm in zip(pieces(ndims, shapes), pieces(ndims, perms))]


GATHERED_COPY_OUT = torch.ops.dynamo_dist.gathered_copy_out.default
