"""Custom ops that keep structure visible to the sharding rules.

``matmul_nd(a, b)``: ``a @ b`` for operands with the same batch dims (``[*B, m, k] @ [*B, k, n]``).
``torch.matmul`` on 4-D operands decomposes into ``view(B*H, m, k) -> bmm -> view``; when H is
sharded, the merged dim B*H has no plain placement and propagation would have to gather. Capture
swaps such matmuls for this op, whose rule is the einsum ``...mk,...kn->...mn``; lowering turns it
back into ``torch.matmul`` on local shapes, so Inductor never sees it.

``attention_math``: SDPA's math path written with ``matmul_nd``, for the calls the fused kernel
does not take (dropout, a mask that requires grad, other head dims).
"""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree


@torch.library.custom_op("dynamo_dist::matmul_nd", mutates_args=())
def matmul_nd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


@matmul_nd.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    a, b = ctx.saved_tensors
    return matmul_nd(grad, b.transpose(-1, -2)), matmul_nd(a.transpose(-1, -2), grad)


matmul_nd.register_autograd(_backward, setup_context=_setup)

MATMUL_ND = torch.ops.dynamo_dist.matmul_nd.default


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast hands ``t`` to an op of its lower-precision list (``torch.matmul``
    and SDPA are on it, on CPU and CUDA): its autocast dtype where autocast is on for its
    device and ``t`` is floating but not float64, else its own. A meta tensor is read as a CPU
    one (a meta-device plan stands for the CPU; autocast knows no "meta" and raises on it)."""
    device = "cpu" if t.device.type == "meta" else t.device.type
    if t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


def under_autocast(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` as autocast hands them to an op of its lower-precision list,
    every tensor cast to its ``autocast_dtype``. The ops capture swaps in for matmul and SDPA
    (``matmul_nd``, ``attention_math``'s) are on no autocast list, so the cast is made here;
    without it an autocast matmul_nd ran in fp32 against a bf16 operand (HF Llama's attention
    under ``torch.autocast``: the compile failed in lowering)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(autocast_dtype(t)), (args, kwargs))


def wants_matmul_nd(a, b) -> bool:
    """True for matmuls with two or more equal batch dims (the case bmm's view would hide)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim == b.ndim
            and a.ndim >= 4 and a.shape[:-2] == b.shape[:-2])



def attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s math path, step for step as torch's
    ``_scaled_dot_product_attention_math`` computes it (so the same numbers and random draws),
    with its two batched matmuls as ``matmul_nd`` (fp16 and bf16 computed in fp32 and the
    output cast back, as torch's math path does): torch's own decomposition views [B, H, L, E]
    as [B*H, L, E] for ``bmm``, which hides the head dim from the sharding rules and makes a
    head-parallel attention with dropout (BERT, T5 as shipped) gather q, k and v. Shapes as
    SDPA's: [*B, H, L, E] x [*B, Hkv, S, E] x [*B, Hkv, S, Ev] -> [*B, H, L, Ev]."""
    length, source, width = query.size(-2), key.size(-2), query.size(-1)
    dtype = query.dtype
    if dtype in (torch.float16, torch.bfloat16):  # torch's math path computes these in fp32
        query, key, value = query.float(), key.float(), value.float()
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(width))
    query = query * (-factor if negative else factor)
    if is_causal:
        attn_mask = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    key_t = key.transpose(-2, -1) * factor
    attn = _batched_matmul(query, key_t)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.nn.functional.dropout(attn, dropout_p, training=True)
    return _batched_matmul(attn, value).to(dtype)


def _batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return matmul_nd(a, b) if wants_matmul_nd(a, b) else torch.matmul(a, b)
