"""Fused attention (the CPU flash kernel, forward and backward).

Operands (GLOBAL shapes; B batch, Hq query heads, Hkv key/value heads, L/S query/key length):
query, grad_out, out [B, Hq, L, E|Ev], logsumexp [B, Hq, L], key [B, Hkv, S, E],
value [B, Hkv, S, Ev], attn_mask (float, added to the scores) of rank 2 [L|1, S|1] or rank 4
[B|1, Hq|1, L|1, S|1] (the kernel's ``reshape_attn_mask_to_4d`` takes a mask dim as real only
where it equals the query's size there, else it must be 1). Grouped-query attention
(``enable_gqa``): Hq = g * Hkv and query head h reads key/value head h // g.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .base import OpSpec, RuleKind, expand_multi_output, expand_per_axis, val_shape

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
ATTENTION = {FORWARD, BACKWARD}

_QUERY_SIDE = ("query", "grad_out", "out", "logsumexp")  # [B, Hq, ...]
_KV_SIDE = ("key", "value")                              # [B, Hkv, ...]


def _arguments(node: fx.Node) -> tuple[dict[str, object], list[str]]:
    """The op's arguments by schema name, and the schema name of each tensor argument in
    ``tensor_args`` order (positional args, then kwargs), so a caller passing anything by
    keyword still gets the right roles."""
    schema = node.target._schema.arguments
    by_name: dict[str, object] = {a.name: a.default_value for a in schema if a.has_default_value()}
    roles = []
    for a, value in zip(schema, node.args):
        by_name[a.name] = value
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            roles.append(a.name)
    for name, value in node.kwargs.items():
        by_name[name] = value
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            roles.append(name)
    return by_name, roles


def attention_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """OpSpecs of SDPA's CPU flash kernel (forward: -> (out, logsumexp); backward:
    -> (grad_query, grad_key, grad_value)). Per mesh axis of size n:

    - all Replicate;
    - batch: every operand and output Shard(0); a mask Shard(0) where its dim 0 is B, else
      (broadcast, or rank 2) Replicate;
    - heads, query and key/value together: Shard(1) on all, a mask Shard(1) where its dim 1 is
      Hq. Without GQA (Hq == Hkv) any split lines up (uneven ones are judged by
      ``rules._uneven_aligned``). With GQA only if n divides Hkv: the contiguous chunk of
      Hq / n query heads on a rank then reads exactly its Hkv / n key/value heads (head h uses
      h // g). Keeping key/value whole while splitting the query would pair local query head h
      with key/value head h // (g / n), a wrong value (the bug this rule had);
    - multi-query (Hkv == 1 < Hq): query side Shard(1), key/value Replicate (every query head
      reads the one key/value head); the backward's grad_key/grad_value are then Partial(sum),
      each rank holding its query heads' share.

    The sequence dims are never split (the softmax runs over all of S; causal masking uses
    global positions), nor the head dim (the default scale 1/sqrt(E) reads it). Dropout gets no
    rule (the kernel rejects dropout_p > 0; the op then runs replicated, as on one device).
    Inconsistent operands (batch sizes differ, Hq not a multiple of Hkv, a mask of another rank)
    get only the replicated option: the op then behaves exactly as on one device.
    """
    args, roles = _arguments(node)
    if args.get("dropout_p"):
        return []
    backward = node.target is BACKWARD
    shapes = {name: val_shape(args[name]) for name in set(roles)}
    in_shapes = [shapes[r] for r in roles]
    out_shapes = [tuple(v.shape) for v in node.meta["val"]]
    rep_option = (tuple(Replicate() for _ in roles), tuple(Replicate() for _ in out_shapes))
    q, k, v = shapes["query"], shapes["key"], shapes["value"]
    mask = shapes.get("attn_mask")
    if len(q) != 4 or len(k) != 4 or len(v) != 4 or not k[0] == v[0] == q[0] or \
            k[1] != v[1] or k[1] == 0 or q[1] % k[1] or \
            (mask is not None and len(mask) not in (2, 4)):
        return expand_multi_output([rep_option], mesh_shape, in_shapes, out_shapes,
                                   RuleKind.ATTENTION)
    batch, hq, hkv = q[0], q[1], k[1]

    def mask_placement(d: int, size: int) -> Placement:
        return Shard(d) if mask is not None and len(mask) == 4 and mask[d] == size and size > 1 \
            else Replicate()

    def option(query_side: Placement, kv_side: Placement, mask_p: Placement, kv_grad: Placement):
        place = {r: query_side for r in _QUERY_SIDE}
        place.update({r: kv_side for r in _KV_SIDE})
        place["attn_mask"] = mask_p
        outs = (query_side, kv_grad, kv_grad) if backward else (query_side, query_side)
        return tuple(place[r] for r in roles), outs

    per_axis = []
    for n in mesh_shape:  # the head split's legality depends on the mesh axis's size
        options = [rep_option, option(Shard(0), Shard(0), mask_placement(0, batch), Shard(0))]
        if hq == hkv or hkv % n == 0:
            options.append(option(Shard(1), Shard(1), mask_placement(1, hq), Shard(1)))
        elif hkv == 1:
            options.append(option(Shard(1), Replicate(), mask_placement(1, hq), Partial("sum")))
        per_axis.append(options)
    return expand_per_axis(per_axis, mesh_shape, in_shapes, out_shapes, RuleKind.ATTENTION)
