"""Op rules on small traced graphs (global semantics, no process group needed)."""

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_dist.ops import matmul_nd
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
