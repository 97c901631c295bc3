"""Merging repeated pure computations of a local joint graph (``inductor_passes.dedup``): what
is merged computes the same values, collectives and random draws never are, scalars are
compared exactly, outputs stay distinct tensors, and on a Llama the attention mask is made and
saved once while every layer still shares one compiled body."""

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from inductor_passes import dedup
from inductor_passes.core import compat
from inductor_passes.core.collectives import collective_op

funcol = torch.ops._c10d_functional


def _ops(gm: fx.GraphModule, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def test_merges_repeats_and_nothing_else(fake_mesh):
    group = fake_mesh((2,), ("tp",)).get_group().group_name
    aten = torch.ops.aten

    def f(x, mask):
        a = torch.where(mask, 0.0, float("-inf")) + x  # the same mask twice
        b = torch.where(mask, 0.0, float("-inf")) * x
        z = x * 0.0 + x * -0.0  # 0.0 and -0.0 differ (1 / z)
        i = x + 1 + (x + 1.0) * 0  # an int and a float constant differ in type only
        drop = torch.nn.functional.dropout(x, 0.5) + torch.nn.functional.dropout(x, 0.5)
        r1 = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
        r2 = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))  # a second collective
        return a + b + z + i + r1 + r2, drop, x * 2, x * 2  # two outputs, alike

    x, mask = torch.randn(4, 4), torch.rand(4, 4) > 0.5
    gm = compat.make_fx(f)(x, mask)
    torch.manual_seed(0)
    expected = gm(x, mask)
    wheres = _ops(gm, aten.where.self)
    removed = dedup.dedup_pure(gm)
    assert removed >= 2 and _ops(gm, aten.where.self) == wheres - 1
    assert sum(collective_op(n) == "all_reduce" for n in gm.graph.nodes) == 2
    assert _ops(gm, funcol.wait_tensor.default) == 2
    # each dropout keeps its own buffer and its own draw
    assert _ops(gm, aten.empty_like.default) == 2 and _ops(gm, aten.bernoulli_.float) == 2
    consts = [n.args[1] for n in gm.graph.nodes if n.target in (aten.mul.Tensor, aten.add.Tensor)
              and isinstance(n.args[1], (int, float)) and n.args[0].op == "placeholder"]
    assert sorted(map(repr, consts)) == ["-0.0", "0.0", "1", "1.0", "2", "2"]  # 2: the outputs
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    assert out[2] is not out[3]  # two outputs computed alike stay two tensors
    torch.manual_seed(0)
    got = gm(x, mask)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[2], expected[2])
    assert got[2].data_ptr() != got[3].data_ptr()
    assert torch.equal(got[1], expected[1])  # the dropout draws as before


def test_a_mask_merged_across_layers_leaves_every_layer(fake_mesh):
    """A mask each layer converts alike is merged into the first layer's node; it (and its
    scalar) then belongs to no layer, so every layer still has the same nodes."""
    from inductor_passes import outline

    from test_outline import _in_module

    def f(x, mask, *ws):
        for k, w in enumerate(ws):
            with _in_module(f"model.layers.{k}"):
                bias = torch.where(mask, 0.0, float("-inf"))
                x = torch.softmax(x @ w + bias, -1) @ w + x
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        with _in_module("model.head"):
            return (x.sum(),)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 8, generator=g), torch.tril(torch.ones(8, 8)) > 0] + \
        [torch.randn(8, 8, generator=g) / 8 for _ in range(3)]
    with fx_traceback.preserve_node_meta():
        gm = compat.make_fx(f)(*args)
    expected = gm(*args)
    assert dedup.dedup_pure(gm) >= 2
    where = [n for n in gm.graph.nodes if n.target is torch.ops.aten.where.self]
    assert len(where) == 1 and outline.layer_of(where[0]) is None
    assert all(outline.layer_of(a) is None for a in where[0].all_input_nodes
               if a.op == "call_function")
    done = outline.outline_repeats(gm)
    assert [len(layers) for layers, _ in done.bodies.values()] == [3]
    assert torch.equal(gm(*args)[0], expected[0])


def test_llama_saves_one_mask_and_shares_every_forward_layer(fake_mesh):
    """The demo Llama (3 layers) on a fake dp=2 x tp=2 mesh under Inductor: one float attention
    mask saved for the backward (was one per layer), and all three forward layers call one
    body (the first and last differed before: ``outline.reduce_before_views``)."""
    from dynamo_dist import compile_records
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    mesh = fake_mesh((2, 2), ("dp", "tp"))
    size = LlamaSize(layers=3)
    torch.manual_seed(0)
    model = build_llama(size)
    plan = TensorParallelPlanner(axis="tp").build_plan(model)
    shard_module(model, mesh, DataParallelPlanner(axis="dp", mesh_axis_size=2)
                 .build_plan(model, plan))
    ids = token_batch(size, 0)
    torch.compile(model, backend="dist")(input_ids=ids, labels=ids).loss.backward()
    joint = compile_records()[-1].step.joint
    out = next(iter(joint.fw_graph.graph.find_nodes(op="output"))).args[0]
    masks = [n for n in out[joint.num_fwd_outputs:] if n.target is torch.ops.aten.where.self
             and n.meta["val"].dim() == 4]
    assert len(masks) == 1
    forward_body = joint.outlined[0].bodies
    assert [len(layers) for layers, _ in forward_body.values()] == [3]


def test_reads_of_a_tensor_written_in_place_are_not_merged():
    """``b * 2`` before and after ``b.add_(1)`` are two values, also where the graph reads ``b``
    itself after the write (as hand-built graphs do), not the in-place op's result."""
    def f(x):
        b = x.clone()
        y1 = b * 2
        b.add_(1)
        y2 = b * 2
        return y1 + 0, y2 + 0

    x = torch.randn(3)
    gm = compat.make_fx(f)(x)
    add_ = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add_.Tensor)
    late = next(u for u in add_.users if u.target is torch.ops.aten.mul.Tensor)
    late.args = (add_.args[0], *late.args[1:])  # read the clone itself after the write
    gm.recompile()
    dedup.dedup_pure(gm)
    y1, y2 = gm(x)
    assert torch.equal(y1, x * 2) and torch.equal(y2, (x + 1) * 2)
