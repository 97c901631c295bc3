"""SDPA calls the fused kernel does not take (dropout, a mask that requires grad) are captured as
``ops.attention_math``: the same numbers and random draws as torch's math path, with the head dim
visible to the sharding rules (no gather of q, k, v under head parallelism)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dynamo_dist import compile_records
from inductor_passes.core.ops import attention_math
from dynamo_dist.plans import TensorParallelPlanner, shard_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["dropout", "causal", "bool_mask", "float_mask", "gqa", "scale"])
def test_attention_math_is_torch_math_path(case, dtype):
    """fp16 and bf16 bit for bit: torch's math path computes them in fp32 and casts the output
    back (attention_math computed in bf16 once: 1 ulp off almost everywhere, gradients 3e-2 off
    in T5 under autocast)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g).to(dtype) for _ in range(3))
    kw = {}
    if case == "dropout":
        kw["dropout_p"] = 0.3
    elif case == "causal":
        kw["is_causal"] = True
    elif case == "bool_mask":
        kw["attn_mask"] = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(1, 4, 6, 6, generator=g).to(dtype)
    elif case == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw["enable_gqa"] = True
    else:
        kw["scale"] = 0.37
    torch.manual_seed(5)
    ours = attention_math(q, k, v, **kw)
    torch.manual_seed(5)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, **kw)
    assert ours.dtype == ref.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(ours, ref), (ours.float() - ref.float()).abs().max()


class Attention(torch.nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden) for _ in range(3))
        self.o = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                             dropout_p=0.1)
        return self.o(out.transpose(1, 2).reshape(b, s, h)).sum()


def test_head_parallel_attention_with_dropout_moves_only_megatron_collectives(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    model = Attention()
    plan = TensorParallelPlanner().build_plan(model, example_inputs=(torch.randn(2, 8, 32),))
    shard_module(model, mesh, plan)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    compiled(torch.randn(2, 8, 32, requires_grad=True)).backward()
    ledger = compile_records()[-1].ledger
    assert [e.kind for e in ledger.entries] == ["all_reduce", "all_reduce"], \
        [(e.kind, e.cause) for e in ledger.entries]  # one forward (o), one backward (x's grad)
