"""Fused attention (the CPU flash kernel, forward and backward)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from .base import OpSpec, expand_multi_output, tensor_args, val_shape

aten = torch.ops.aten
# ---------------------------------------------------------------------------------------------
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
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

