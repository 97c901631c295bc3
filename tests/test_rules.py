"""Op rules on small traced graphs (global semantics, no process group needed)."""

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_passes.core.ops import matmul_nd
from inductor_passes.sharding import rules


def _node(fn, *shapes, target):
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
    return next(n for n in gm.graph.nodes if n.target == target)


def _specs(node, mesh_shape=(2,)):
    return {(s.inputs, s.output) for s in rules.op_strategy(node, [], None, mesh_shape, lambda n: None)}


def test_pointwise_add_keeps_partial_but_add_scalar_does_not():
    add = _node(lambda a, b: a + b, (4, 6), (4, 6), target=torch.ops.aten.add.Tensor)
    specs = _specs(add)
    P = (Partial("sum"),)
    assert ((P, P), P) in specs
    assert (((Shard(1),), (Shard(1),)), (Shard(1),)) in specs
    add_scalar = _node(lambda a: a + 1.0, (4, 6), target=torch.ops.aten.add.Tensor)
    assert all(not isinstance(s[1][0], Partial) for s in _specs(add_scalar))


def test_nonlinear_pointwise_never_partial():
    exp = _node(torch.exp, (4, 6), target=torch.ops.aten.exp.default)
    assert all(not isinstance(p, Partial) for ins, out in _specs(exp) for p in (*ins[0], *out))


def test_mul_is_linear_in_one_operand_only():
    mul = _node(lambda a, b: a * b, (4, 6), (4, 6), target=torch.ops.aten.mul.Tensor)
    specs = _specs(mul)
    P, R = (Partial("sum"),), (Replicate(),)
    assert ((P, R), P) in specs and ((R, P), P) in specs
    assert ((P, P), P) not in specs


def test_a_pending_sum_crosses_only_casts_that_hold_every_value():
    """fp32 -> fp64 and int -> float keep Partial (summing after the cast is exact or wider);
    fp32 -> bf16, bf16 -> fp16 and float -> int do not: each rank's term would be rounded or
    truncated before the sum, which the program never does."""
    P = (Partial("sum"),)
    cases = [(torch.float32, torch.float64, True), (torch.int64, torch.float32, True),
             (torch.bfloat16, torch.float32, True), (torch.float32, torch.bfloat16, False),
             (torch.bfloat16, torch.float16, False), (torch.float32, torch.int64, False),
             (torch.float32, torch.bool, False)]
    for src, dst, keeps in cases:
        gm = make_fx(lambda a: a.to(dst) * 1, tracing_mode="fake")(torch.ones(4, 6, dtype=src))
        cast = next(n for n in gm.graph.nodes
                    if n.target in (torch.ops.prims.convert_element_type.default,
                                    torch.ops.aten._to_copy.default))
        specs = _specs(cast)
        assert (((P,), P) in specs) is keeps, (src, dst)
        assert (((Shard(0),),), (Shard(0),)) in specs


def test_broadcast_input_stays_replicated():
    add = _node(lambda a, b: a + b, (4, 6), (6,), target=torch.ops.aten.add.Tensor)
    specs = _specs(add)
    assert (((Shard(0),), (Replicate(),)), (Shard(0),)) in specs
    assert (((Shard(1),), (Shard(0),)), (Shard(1),)) in specs


def test_mm_einsum_rule():
    mm = _node(torch.mm, (4, 8), (8, 6), target=torch.ops.aten.mm.default)
    specs = _specs(mm)
    S0, S1, R, P = (Shard(0),), (Shard(1),), (Replicate(),), (Partial("sum"),)
    assert ((S0, R), S0) in specs         # rows
    assert ((R, S1), S1) in specs         # columns (column parallel)
    assert ((S1, S0), P) in specs         # contraction (row parallel)
    assert ((S0, S1), S0) not in specs


def test_matmul_nd_keeps_batch_dims_visible():
    node = _node(matmul_nd, (2, 4, 3, 5), (2, 4, 5, 7), target=torch.ops.dynamo_dist.matmul_nd.default)
    S1 = (Shard(1),)
    assert ((S1, S1), S1) in _specs(node)  # heads sharded: no gather


def test_uneven_splits_line_up_or_are_dropped():
    """mm (5, 6) @ (6, 6) on a mesh of 4: rows split unevenly (2, 2, 1, 0) are fine, and so is
    the uneven contraction (a pending sum); but an uneven split is never paired with a
    different-sized one, and a mean over an uneven split never leaves Partial(avg)."""
    mm = _node(torch.mm, (5, 6), (6, 6), target=torch.ops.aten.mm.default)
    specs = _specs(mm, (4,))
    S0, S1, R, P = (Shard(0),), (Shard(1),), (Replicate(),), (Partial("sum"),)
    assert ((S0, R), S0) in specs and ((S1, S0), P) in specs
    for ins, out in specs:  # every split on the mesh axis covers a dim of one size
        sizes = {shape[p[0].dim] for shape, p in zip(((5, 6), (6, 6), (5, 6)), (*ins, out))
                 if isinstance(p[0], Shard)}
        assert len(sizes) <= 1 or all(s % 4 == 0 for s in sizes), (ins, out)
    mean = _node(lambda a: a.mean(0), (5, 6), target=torch.ops.aten.mean.dim)
    specs = rules.op_strategy(mean, [S0], None, (4,), lambda n: None)
    assert specs and all(s.output != (Partial("avg"),) for s in specs if s.inputs == (S0,))


def test_attention_splits_batch_or_heads_and_keeps_a_broadcast_mask_whole():
    aten = torch.ops.aten
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default

    def attn(q, k, v, mask):
        return fwd_op(q, k, v, 0.0, False, attn_mask=mask)[0]

    q = (2, 4, 8, 16)
    node = _node(attn, q, q, q, (2, 1, 8, 8), target=fwd_op)
    specs = _specs(node)
    S0, S1, R = (Shard(0),), (Shard(1),), (Replicate(),)
    assert ((S0, S0, S0, S0), (S0, S0)) in specs          # batch: the mask splits too
    assert ((S1, S1, S1, R), (S1, S1)) in specs           # heads: the mask's H is broadcast
    assert all(ins[0] != (Shard(2),) for ins, _ in specs)  # never the sequence
    assert all(not isinstance(p, Partial) for ins, outs in specs for pl in (*ins, *outs) for p in pl)

    def with_dropout(q, k, v):
        return fwd_op(q, k, v, 0.1, False)[0]

    node = _node(with_dropout, q, q, q, target=fwd_op)
    assert rules.attention_strategy(node, (2,)) == []  # replicated (and logged) instead


def test_attention_backward_splits_every_gradient_with_its_operands():
    aten = torch.ops.aten
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default

    def attn_grad(q, k, v, g):
        out, lse = fwd_op(q, k, v, 0.0, True)
        return bwd_op(g, q, k, v, out, lse, 0.0, True)

    q = (2, 4, 8, 16)
    node = _node(attn_grad, q, q, q, q, target=bwd_op)
    specs = _specs(node, mesh_shape=(2, 2))
    S01 = (Shard(0), Shard(1))
    assert ((S01,) * 6, (S01,) * 3) in specs  # batch on one mesh axis, heads on the other


def test_a_value_used_twice_holds_one_placement():
    """mul(x, x): "linear in one operand" must not pair Partial with Replicate for the same
    value (the sweep found x * x computed as if linear in x: gradients doubled)."""
    sq = _node(lambda a: a * a, (4, 6), target=torch.ops.aten.mul.Tensor)
    assert sq.args[0] is sq.args[1]
    specs = _specs(sq)
    assert specs and all(ins[0] == ins[1] for ins, _ in specs)


def _attention_node(q, k, v, mask=None, **kw):
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    shapes = [q, k, v] + ([mask] if mask else [])

    def attn(q, k, v, *m):
        return fwd_op(q, k, v, attn_mask=m[0] if m else None, **kw)[0]

    return _node(attn, *shapes, target=fwd_op)


def test_attention_gqa_splits_heads_only_where_key_value_heads_line_up():
    """Hq = 8, Hkv = 2: a head split needs the mesh axis to divide Hkv (query head h reads
    key/value head h // 4); the query is never split while key/value stay whole."""
    node = _attention_node((4, 8, 4, 16), (4, 2, 4, 16), (4, 2, 4, 16))
    S0, S1, R = Shard(0), Shard(1), Replicate()
    two = _specs(node, (2,))
    assert (((S1,),) * 3, ((S1,), (S1,))) in two
    assert not any(ins[0] == (S1,) and ins[1] == (R,) for ins, _ in two)
    four = _specs(node, (4,))
    assert not any(S1 in pl for ins, _ in four for pl in ins)
    assert (((S0,),) * 3, ((S0,), (S0,))) in _specs(node, (2,))  # batch: always
    # 2-D mesh: heads on the axis of size 2 only (nested splits are not planned)
    mixed = _specs(node, (4, 2))
    assert (((S0, S1),) * 3, ((S0, S1), (S0, S1))) in mixed
    assert not any(pl[0] == S1 for ins, _ in mixed for pl in ins)


def test_attention_arguments_by_keyword_keep_their_roles():
    """q, k, v passed by keyword: the rule reads roles from the schema, not positions."""
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    node = _node(lambda q, k, v: fwd_op(query=q, key=k, value=v, is_causal=True)[0],
                 (2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), target=fwd_op)
    S1 = (Shard(1),)
    assert ((S1, S1, S1), (S1, S1)) in _specs(node)


def test_attention_mask_placements_follow_its_broadcast():
    """A 4-D mask is split on a dim only where it has the query's size there (the kernel reads
    a size-1 dim as broadcast); a 2-D mask [L, S] is never split."""
    S0, S1, R = (Shard(0),), (Shard(1),), (Replicate(),)
    qkv = [(4, 4, 8, 16)] * 3
    for mask, batch_mask, head_mask in [((4, 4, 8, 8), S0, S1), ((1, 4, 8, 8), R, S1),
                                        ((4, 1, 1, 8), S0, R), ((8, 8), R, R)]:
        specs = _specs(_attention_node(*qkv, mask=mask))
        assert ((S0, S0, S0, batch_mask), (S0, S0)) in specs, mask
        assert ((S1, S1, S1, head_mask), (S1, S1)) in specs, mask
        assert all(ins[3] == want for ins, outs in specs if outs[0] in (S0, S1)
                   for want in [batch_mask if outs[0] == S0 else head_mask]), mask
