"""Custom ops that keep structure visible to the sharding rules.

``matmul_nd(a, b)``: ``a @ b`` for operands with the same batch dims (``[*B, m, k] @ [*B, k, n]``).
``torch.matmul`` on 4-D operands decomposes into ``view(B*H, m, k) -> bmm -> view``; when H is
sharded, the merged dim B*H has no plain placement and propagation would have to gather. Capture
swaps such matmuls for this op, whose rule is the einsum ``...mk,...kn->...mn``; lowering turns it
back into ``torch.matmul`` on local shapes, so Inductor never sees it.
"""

from __future__ import annotations

import torch


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


def wants_matmul_nd(a, b) -> bool:
    """True for matmuls with two or more equal batch dims (the case bmm's view would hide)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim == b.ndim
            and a.ndim >= 4 and a.shape[:-2] == b.shape[:-2])

