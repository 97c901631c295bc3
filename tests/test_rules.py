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


def test_two_axis_expansion_filters_uneven():
    mm = _node(torch.mm, (4, 6), (6, 6), target=torch.ops.aten.mm.default)
    for ins, out in _specs(mm, (2, 4)):
        for p, axis in zip(out, range(2)):
            if isinstance(p, Shard):
                assert (4, 6)[p.dim] % (2, 4)[axis] == 0
