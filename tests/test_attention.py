"""Fused attention (SDPA's CPU flash kernel) under sharding, against one device: forward values
and the gradients of query/key/value, run on simulated ranks (fake process group + run_spmd).

Covers what the attention rule could get silently wrong: grouped-query and multi-query attention
(key/value heads fewer than query heads), masks of every accepted rank and broadcast, is_causal,
a non-default scale, uneven head counts, cross attention, a 2-D mesh."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from dynamo_dist import compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd
from inductor_passes.sharding.rules import RuleKind

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _run(mesh, q, k, v, placements, mask=None, mask_pl=None, **sdpa_kwargs):
    """Compile SDPA on DTensor inputs, run every rank with real values; return the simulated
    (out, grads) and the one-device reference, plus the plan's attention nodes."""
    gqa = q.shape[1] != k.shape[1]

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa,
                                              **sdpa_kwargs) * 2

    leaves = [t.requires_grad_() for t in (q, k, v)]
    want = f(*leaves, mask)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    want_grads = torch.autograd.grad(want, leaves, cot)

    d_in = [distribute_tensor(t.detach(), mesh, pl).requires_grad_()
            for t, pl in zip((q, k, v), placements)]
    d_mask = mask if mask is None or mask_pl is None else distribute_tensor(mask, mesh, mask_pl)
    torch._dynamo.reset()
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(*d_in, d_mask)
    record = compile_records()[-1]
    assert not record.plan.fallbacks, record.plan.fallbacks
    fused = [n for n in record.plan.nodes.values() if n.kind is RuleKind.ATTENTION]
    assert len(fused) == 2, "the fused kernel (forward and backward) was not used"
    by_name = {"q": q, "k": k, "v": v, "mask": mask}
    args = [by_name[next(s for s in by_name if f"_{s}_" in i.name.lower())].detach()
            for i in record.program.primal_inputs]
    (got,), grads = run_spmd(record, args, [cot], mesh)
    grad_of = {next(s for s in by_name if f"_{s}_" in i.name.lower()): g
               for i, g in zip(record.program.primal_inputs, grads)}
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    for name, g in zip("qkv", want_grads):
        torch.testing.assert_close(grad_of[name], g, atol=1e-5, rtol=1e-5, msg=name)
    return fused


def _fmt(placements) -> str:
    return ",".join("R" if p == R else f"S({p.dim})" if isinstance(p, Shard) else "P"
                    for p in placements)


def _attn_inputs(fused):
    """(query, key, value) placements of the forward and backward kernels, as 'S(0),S(1)'."""
    fwd, bwd = fused
    return [_fmt(p) for p in fwd.inputs[:3]], [_fmt(p) for p in bwd.inputs[1:4]]


def _qkv(b, hq, hkv, l, s=None, e=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = s or l
    return (torch.randn(b, hq, l, e, generator=g), torch.randn(b, hkv, s, e, generator=g),
            torch.randn(b, hkv, s, e, generator=g))


def test_gqa_splits_query_and_key_value_heads_together(fake_mesh):
    """Hq = 4, Hkv = 2 on 2 ranks: rank r holds query heads 2r, 2r+1 and their key/value head r.
    The old rule kept key/value whole while splitting the query (forward silently wrong)."""
    mesh = fake_mesh((2,), ("tp",))
    fused = _run(mesh, *_qkv(2, 4, 2, 8), [[S1]] * 3, is_causal=True)
    fwd, bwd = _attn_inputs(fused)
    assert fwd == ["S(1)"] * 3 and bwd == ["S(1)"] * 3
    assert fused[1].output == ((S1,), (S1,), (S1,))


def test_gqa_key_value_heads_not_divisible_by_the_mesh_axis(fake_mesh):
    """Hkv = 2 on 4 ranks: no head split lines up; whatever the plan does must be right."""
    mesh = fake_mesh((4,), ("tp",))
    fused = _run(mesh, *_qkv(2, 8, 2, 8), [[S1], [R], [R]])
    assert all(_fmt(p) != "S(1)" for n in fused for p in n.inputs)


def test_mqa_keeps_the_one_key_value_head_whole_and_sums_its_gradient(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    fused = _run(mesh, *_qkv(2, 4, 1, 8), [[S1], [R], [R]])
    fwd, bwd = _attn_inputs(fused)
    assert fwd == ["S(1)", "R", "R"] and bwd == ["S(1)", "R", "R"]
    assert fused[1].output == ((S1,), (Partial("sum"),), (Partial("sum"),))


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("mask_shape,mask_pl", [
    ((2, 4, 8, 8), [S1]),   # an additive bias per head (T5's position bias), split with heads
    ((1, 4, 8, 8), [R]),    # one bias per head, broadcast over the batch: split with heads
    ((2, 1, 8, 8), [R]),    # per batch row, broadcast over heads
    ((2, 1, 1, 8), [R]),    # a padding mask
    ((8, 8), [R]),          # rank 2
])
def test_masks_split_with_heads_or_stay_whole(fake_mesh, hkv, mask_shape, mask_pl):
    mesh = fake_mesh((2,), ("tp",))
    mask = torch.randn(mask_shape, generator=torch.Generator().manual_seed(3))
    fused = _run(mesh, *_qkv(2, 4, hkv, 8), [[S1]] * 3, mask=mask, mask_pl=mask_pl)
    mask_in = _fmt(fused[0].inputs[3])
    heads_split = _fmt(fused[0].inputs[0]) == "S(1)"
    assert mask_in == ("S(1)" if heads_split and len(mask_shape) == 4 and mask_shape[1] == 4
                       else "R") or (mask_in == "S(0)" and not heads_split), mask_in


@pytest.mark.parametrize("mask_shape", [(4, 4, 8, 8), (4, 1, 1, 8), (1, 4, 8, 8)])
def test_batch_split_with_masks(fake_mesh, mask_shape):
    mesh = fake_mesh((2,), ("dp",))
    mask = torch.randn(mask_shape, generator=torch.Generator().manual_seed(3))
    fused = _run(mesh, *_qkv(4, 4, 2, 8), [[S0]] * 3, mask=mask, mask_pl=[R])
    assert _attn_inputs(fused)[0] == ["S(0)"] * 3
    assert _fmt(fused[0].inputs[3]) == ("S(0)" if mask_shape[0] == 4 else "R")


def test_causal_scale_and_cross_attention(fake_mesh):
    """L != S, a non-default scale, is_causal (top-left aligned). (A value head dim other than
    the query's is not taken by the fused kernel: SDPA decomposes it into matmuls.)"""
    mesh = fake_mesh((2,), ("tp",))
    _run(mesh, *_qkv(2, 4, 2, 6, s=10), [[S1]] * 3, is_causal=True, scale=0.3)


def test_uneven_head_split(fake_mesh):
    """3 heads on 2 ranks: pieces of 2 and 1, the same for query and key/value."""
    mesh = fake_mesh((2,), ("tp",))
    _run(mesh, *_qkv(2, 3, 3, 8), [[S1]] * 3, is_causal=True)


def test_gqa_on_a_2d_mesh_batch_and_heads(fake_mesh):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    mask = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    fused = _run(mesh, *_qkv(2, 4, 2, 8), [[S0, S1]] * 3, mask=mask, mask_pl=[S0, S1])
    assert _attn_inputs(fused)[0] == ["S(0),S(1)"] * 3
