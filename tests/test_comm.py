"""The comm pass: FSDP-style collectives bucketed in the code Inductor generates (fake process
group: the generated code is read, not its values; values are checked on 2 gloo ranks in
test_multiprocess.py)."""

import operator
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import Stack
from dynamo_dist import compile_records
from dynamo_dist.plans import DataParallelPlanner, shard_module
from inductor_passes import comm
from inductor_passes.core.collectives import collective_op


class MLP3(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))).square().mean()


def _compile_fsdp_step(fake_mesh):
    from torch._inductor.utils import run_and_get_code

    mesh = fake_mesh((2,), ("dp",))
    torch.manual_seed(0)
    model = MLP3()
    shard_module(model, mesh, DataParallelPlanner(mesh_axis_size=2).build_plan(model))
    fn = torch.compile(model, backend="dist")
    x = torch.randn(8, 64)
    _, (fw_code, bw_code) = run_and_get_code(lambda: fn(x).backward())
    return compile_records()[-1].ledger, fw_code, bw_code


def _calls(code: str, op: str) -> int:
    return len(re.findall(rf"_c10d_functional\.{op}\.default\(", code))


def test_fsdp_gathers_and_scatters_become_one_collective_each(fake_mesh, monkeypatch):
    monkeypatch.delenv("DYNAMO_DIST_BUCKET_MB", raising=False)  # on by default, 25 MiB
    ledger, fw, bw = _compile_fsdp_step(fake_mesh)
    # 6 parameters: gathered for the forward, gathered again in the backward, 6 gradients
    assert ledger.count("all_gather", phase="forward") == 6
    assert ledger.count("reduce_scatter") == 6
    assert _calls(fw, "all_gather_into_tensor_out") == 1 and _calls(fw, "all_gather_into_tensor") == 0
    assert _calls(bw, "reduce_scatter_tensor") == 1
    assert ledger.buckets["all_gather"][0] == 6 and ledger.buckets["reduce_scatter"] == [6]
    assert ledger.issued("reduce_scatter") == 1 and ledger.issued() < ledger.count()


def _issued(code: str, kind: str) -> int:
    ops = {"all_gather": ("all_gather_into_tensor_out", "all_gather_into_tensor"),
           "reduce_scatter": ("reduce_scatter_tensor",)}[kind]
    return sum(_calls(code, op) for op in ops)


def test_bucket_cap_splits_buckets_and_zero_turns_bucketing_off(fake_mesh, monkeypatch):
    # 36 KiB holds two gathered 64 x 64 weights (16 KiB each) and biases, not three weights
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", str(36 / 1024))
    ledger, fw, bw = _compile_fsdp_step(fake_mesh)
    assert 2 <= _issued(fw, "all_gather") < 6 and _calls(fw, "all_gather_into_tensor_out") >= 1
    assert all(n <= 5 for n in ledger.buckets["all_gather"])
    # what the ledger says is issued is what Inductor generated, forward and backward
    assert _issued(fw, "all_gather") + _issued(bw, "all_gather") == ledger.issued("all_gather")
    assert _issued(bw, "reduce_scatter") == ledger.issued("reduce_scatter") >= 2

    torch._dynamo.reset()
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", "0")
    ledger, fw, bw = _compile_fsdp_step(fake_mesh)
    assert not any(ledger.buckets.values())
    assert _calls(fw, "all_gather_into_tensor") == 6 and _calls(bw, "reduce_scatter_tensor") == 6
    assert ledger.issued("reduce_scatter") == 6


def test_bad_bucket_size_names_the_variable(monkeypatch):
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="DYNAMO_DIST_BUCKET_MB='lots'.*fix"):
        comm.bucket_cap_mb()


@pytest.mark.parametrize("outline,prefetch", [("1", "1"), ("1", "0"), ("0", "1")])
def test_buckets_stay_inside_one_layer(fake_mesh, monkeypatch, outline, prefetch):
    """FSDP on dp=2, bucketing at its default: each layer's 4 parameters are gathered in one
    bucket of their own (FSDP2's unit), never merged with another layer's or the head's, with
    the layers outlined into one shared body and with every layer inline, with the gathers
    prefetched a layer early and without; likewise each layer's 4 gradients are
    reduce-scattered in one bucket."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.delenv("DYNAMO_DIST_BUCKET_MB", raising=False)
    monkeypatch.setenv("DYNAMO_DIST_OUTLINE", outline)
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", prefetch)
    mesh = fake_mesh((2,), ("dp",))
    torch.manual_seed(0)
    model = Stack()
    shard_module(model, mesh, DataParallelPlanner(mesh_axis_size=2).build_plan(model))
    fn = torch.compile(model, backend="dist")
    _, (fw, bw) = run_and_get_code(lambda: fn(torch.randn(8, 32)).backward())
    record = compile_records()[-1]
    ledger = record.ledger
    assert ledger.count("all_gather", phase="forward") == 14  # 3 x 4 + the head's 2
    assert ledger.count("reduce_scatter") == 14
    # 3 layer buckets of 4 and the head's 2 in the forward; the same in the backward's scatters
    assert sorted(ledger.buckets["reduce_scatter"]) == [2, 4, 4, 4]
    assert ledger.issued("reduce_scatter") == 4
    assert sorted(ledger.buckets["all_gather"]).count(4) >= 3  # forward (the backward regathers)
    shared = [c for o in record.step.joint.outlined for layers, _ in o.bodies.values()
              for c in layers]
    assert bool(shared) == (outline == "1")
    assert ledger.issued("all_gather") == 4  # this small model's backward keeps the gathers
    assert sorted(ledger.buckets["all_gather"]) == [2, 4, 4, 4]
    # the generated code: each collective once, the shared body's bucket once for its calls
    # (a prefetched gather is issued by the calling graph, one per layer)
    assert _issued(fw, "all_gather") == (3 if (outline, prefetch) == ("1", "0") else 4)
    assert _issued(bw, "reduce_scatter") == (4 if outline == "0" else 3)


def test_zero_turns_bucketing_off(monkeypatch):
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", "0")
    assert comm.bucket_cap_mb() == 0
    import torch.fx as fx

    assert comm.bucket_pass(fx.symbolic_trace(torch.nn.Linear(2, 2))) is None


def test_a_shared_all_reduce_input_gets_its_own_copy_when_bucketing(monkeypatch):
    """Inductor computes each input of an all_reduce bucket into the bucket, which all_reduce_
    then overwrites in place: an input also read elsewhere must be a copy (see comm.py)."""
    import torch.fx as fx

    from inductor_passes import comm

    funcol = torch.ops._c10d_functional

    def f(x, y):
        s = x.sum(0)
        reduced = funcol.wait_tensor(funcol.all_reduce(s, "sum", "0"))
        alone = funcol.wait_tensor(funcol.all_reduce(y * 2, "sum", "0"))
        return reduced + s, alone

    def collective_inputs(gm):
        return [n.args[0] for n in gm.graph.nodes if collective_op(n) == "all_reduce"]

    gm = fx.symbolic_trace(f)
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", "0")
    assert comm.copy_shared_all_reduce_inputs(gm) == 0  # bucketing off: nothing to guard
    monkeypatch.delenv("DYNAMO_DIST_BUCKET_MB", raising=False)  # on by default
    assert comm.copy_shared_all_reduce_inputs(gm) == 1
    shared, alone = collective_inputs(gm)
    assert shared.target is torch.ops.aten.mul.Tensor and shared.args[1] == 1
    assert shared.args[0].name == "sum_1" and len(shared.args[0].users) == 2  # still read by add
    assert alone.target is not torch.ops.aten.mul.Tensor  # read once: no copy


def _bucket_graph(op_name: str):
    """x (4 x 6), y (6 x 4): a bucket's eager copy-in fed x's transpose made contiguous by a
    clone, y read by another op too (its clone also feeds the result), and y itself."""
    import torch.fx as fx

    import torch._inductor.fx_passes.bucketing  # noqa: F401  (registers torch.ops.bucketing)

    op = getattr(torch.ops.bucketing, op_name).default
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    xt = g.call_function(torch.ops.aten.clone.default,
                         (g.call_function(torch.ops.aten.permute.default, (x, [1, 0])),))
    yc = g.call_function(torch.ops.aten.clone.default, (y,))
    extra = (2,) if op_name == "_pre_bucket_reduce_scatter" else (2, torch.float32, [15] * 3, 0)
    bucket = g.call_function(op, ([xt, yc, y], *extra))
    bucket.meta["eager_input_vals"] = "traced strides"
    g.output((bucket, g.call_function(torch.ops.aten.mul.Tensor, (yc, 2))))
    return fx.GraphModule(torch.nn.Module(), g), bucket, yc


@pytest.mark.parametrize("op_name", ["_pre_bucket_reduce_scatter", "_pre_bucket_all_gather"])
def test_a_bucket_copies_in_transposed_views_without_a_clone(op_name):
    """A collective over tensor dim 1 is lowered as transpose, clone, collective on dim 0; a
    bucket's eager copy-in reads the transposed view in logical order, so the clone is dropped
    (one generated copy kernel less per shape), and the bucket's values are unchanged. A clone
    read by another op is kept, and the merge's traced input strides are forgotten (Inductor
    would copy the view back to them)."""
    import torch.fx as fx

    gm, bucket, kept = _bucket_graph(op_name)
    x, y = torch.randn(4, 6), torch.randn(6, 4)
    before = gm(x, y)
    assert comm.drop_layout_copies_into_buckets(gm.graph) == 1
    gm.recompile()
    inputs = bucket.args[0]
    assert inputs[0].target is torch.ops.aten.permute.default  # the view, not its clone
    assert inputs[1] is kept and len(kept.users) == 2  # read by mul too: kept
    assert "eager_input_vals" not in bucket.meta
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)) == 1
    after = gm(x, y)
    if op_name == "_pre_bucket_all_gather":  # rank 0's slice is copied in; the rest is empty
        before, after = (before[0][:72], before[1]), (after[0][:72], after[1])
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert comm.drop_layout_copies_into_buckets(fx.symbolic_trace(lambda a: a + 1).graph) == 0


def test_gathered_copy_out_op_makes_each_piece_contiguous_and_joined():
    """The copy-out op against its definition: piece i of ``[group, N]``'s columns, read as
    ``shapes[i]`` and permuted, contiguous. Both paths: all pieces plain (one
    ``split_with_sizes_copy``), and one joined along dim 1 of a [3, 4] parameter."""
    from inductor_passes.core.bucket_ops import GATHERED_COPY_OUT

    torch.manual_seed(0)
    gathered = torch.randn(2, 20)
    plain = GATHERED_COPY_OUT(gathered, [6, 14], [2, 2], [2, 6, 2, 14], [0, 1, 0, 1])
    assert [p.shape for p in plain] == [(2, 6), (2, 14)]
    assert all(p.is_contiguous() for p in plain)
    torch.testing.assert_close(plain[0], gathered[:, :6], rtol=0, atol=0)
    torch.testing.assert_close(plain[1], gathered[:, 6:], rtol=0, atol=0)
    joined = GATHERED_COPY_OUT(gathered, [6, 14], [2, 3], [2, 6, 2, 7, 2], [0, 1, 1, 0, 2])
    assert joined[1].shape == (7, 2, 2) and joined[1].is_contiguous()
    torch.testing.assert_close(joined[1], gathered[:, 6:].reshape(2, 7, 2).permute(1, 0, 2),
                               rtol=0, atol=0)
    assert joined[1].data_ptr() != gathered.data_ptr()  # a copy, never a view of the bucket
    one = torch.randn(1, 6)  # a group of one: each piece is contiguous already, still copied
    alone = GATHERED_COPY_OUT(one, [2, 4], [2, 2], [1, 2, 1, 4], [0, 1, 1, 0])
    assert alone[0].untyped_storage().data_ptr() != one.untyped_storage().data_ptr()
    torch.testing.assert_close(alone[1], one[:, 2:].t(), rtol=0, atol=0)


def test_a_gathered_bucket_is_copied_out_by_one_op_with_the_same_values():
    """Each piece's clone (and a dim-1 piece's permute and second clone) becomes one extern
    copy-out; the parameters come out equal to the whole tensors, bit for bit, before and after:
    ``a``'s ranks joined along dim 0, ``b``'s along dim 1."""
    from inductor_passes.core.bucket_ops import GATHERED_COPY_OUT

    gm = _bucket_graph_of(2, [(2, 3, False), (3, 2, True)])
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    before = _run_gathering(gm, 2, a, b)
    assert comm.copy_gathers_out_eagerly(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(GATHERED_COPY_OUT) == 1
    assert torch.ops.aten.clone.default not in targets
    assert torch.ops.aten.permute.default not in targets
    after = _run_gathering(gm, 2, a, b)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after[0], torch.cat([a, a + 1]), rtol=0, atol=0)
    torch.testing.assert_close(after[1], torch.cat([b, b + 1], dim=1), rtol=0, atol=0)
    copy_out = next(n for n in gm.graph.nodes if n.target is GATHERED_COPY_OUT)
    assert [tuple(v.shape) for v in copy_out.meta["val"]] == [(2, 6), (3, 2, 2)]


def test_a_gathered_bucket_whose_piece_is_read_elsewhere_is_left_alone():
    """A piece read by another op besides its clone could be written through once the clone
    is gone: the whole bucket keeps Inductor's copies."""
    gm = _bucket_graph_of(2, [(2, 3, False), (3, 2, True)], extra_reader=True)
    nodes = len(gm.graph.nodes)
    assert comm.copy_gathers_out_eagerly(gm.graph) == 0
    assert len(gm.graph.nodes) == nodes


def test_fsdp_gathers_are_copied_out_eagerly_in_the_generated_code(fake_mesh, monkeypatch):
    """End to end: the forward's one gather bucket is copied out by the extern op, and no
    generated kernel copies a gathered parameter."""
    monkeypatch.delenv("DYNAMO_DIST_BUCKET_MB", raising=False)
    _, fw, _ = _compile_fsdp_step(fake_mesh)  # (the backward reuses the forward's gathers)
    assert fw.count("torch.ops.dynamo_dist.gathered_copy_out.default(") == 1
    gathered = re.search(r"all_gather_into_tensor_out\.default\(.*out=(buf\d+)\)", fw).group(1)
    kernels = [ln for ln in fw.splitlines() if re.match(r"\s*cpp_fused_\w+\(", ln)]
    assert kernels and not any(re.search(rf"\b{gathered}\b", ln) for ln in kernels)


def _bucket_graph_of(group: int, pieces: list[tuple[int, int, bool]],
                     extra_reader: bool = False):
    """An all_gather bucket as Inductor's merge leaves it, on a group of ``group``: per piece
    (rows, cols, joined) a shard [rows, cols] of a parameter split on dim 0 (whole:
    [group * rows, cols]) or, joined, on dim 1 (whole: [rows, group * cols], its ranks' stacked
    pieces joined by views, a permute and a clone, as ``redistribute.all_gather`` lowers it).
    ``extra_reader``: the first piece is also read by another op. Fake values on every node,
    as Inductor's graphs have."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    shards = [g.placeholder(f"s{i}") for i in range(len(pieces))]
    flat = g.call_function(aten.cat.default, ([g.call_function(aten.view.default, (s, [r * c]))
                                               for s, (r, c, _) in zip(shards, pieces)],))
    wait = g.call_function(c10d.wait_tensor.default, (
        g.call_function(c10d.all_gather_into_tensor.default, (flat, group, "0")),))
    split = g.call_function(aten.split_with_sizes.default, (
        g.call_function(aten.view.default, (wait, [group, -1])), [r * c for r, c, _ in pieces], 1))
    outs = []
    for i, (r, c, joined) in enumerate(pieces):
        piece = g.call_function(aten.view.dtype, (g.call_function(operator.getitem, (split, i)),
                                                  torch.float32))
        if extra_reader and i == 0:
            outs.append(g.call_function(aten.mul.Tensor, (piece.args[0], 2)))
        whole = g.call_function(aten._unsafe_view.default, (
            g.call_function(aten.clone.default, (piece,),
                            {"memory_format": torch.contiguous_format}), [group * r, c]))
        if joined:
            stacked = g.call_function(aten.view.default, (whole, [group, r, c]))
            whole = g.call_function(aten.view.default, (
                g.call_function(aten.clone.default, (
                    g.call_function(aten.permute.default, (stacked, [1, 0, 2])),),
                    {"memory_format": torch.contiguous_format}), [r, group * c]))
        outs.append(whole)
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(torch.empty(r, c))
                                             for r, c, _ in pieces))
    return gm


def _run_gathering(gm, group: int, *args):
    """``gm`` run with its all_gather answered as ``group`` ranks would be, rank k holding
    its input plus k."""
    import torch.fx as fx

    class Gathering(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is torch.ops._c10d_functional.all_gather_into_tensor.default:
                return torch.cat([args[0] + k for k in range(group)])
            if target is torch.ops._c10d_functional.wait_tensor.default:
                return args[0]
            return super().call_function(target, args, kwargs)

    return Gathering(gm).run(*args)


@given(group=st.integers(2, 4),
       pieces=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4), st.booleans()),
                       min_size=1, max_size=4))
@settings(max_examples=25, deadline=None)
def test_any_gathered_bucket_copied_out_gives_the_whole_parameters(group, pieces):
    """Property: whatever the group, the pieces' shapes and which are joined along dim 1, the
    rewritten bucket gives every parameter whole, bit for bit: rank k's shard at its place
    along dim 0, or along dim 1 for a joined one; and no clone is left."""
    gm = _bucket_graph_of(group, pieces)
    shards = [torch.randn(r, c) for r, c, _ in pieces]
    before = _run_gathering(gm, group, *shards)
    assert comm.copy_gathers_out_eagerly(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    after = _run_gathering(gm, group, *shards)
    for (r, c, joined), s, b, a in zip(pieces, shards, before, after):
        whole = torch.cat([s + k for k in range(group)], dim=1 if joined else 0)
        torch.testing.assert_close(a, whole, rtol=0, atol=0)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.ops.aten.clone.default not in [n.target for n in gm.graph.nodes]
