"""Node order before Inductor (``inductor_passes.schedule``): each gradient's landing collectives
run where the gradient is ready (as FSDP2 reduce-scatters after each layer's backward), not at
the end of the backward, and moving them changes no value."""

import torch
import torch.fx as fx

from conftest import sharded_llama
from dynamo_dist import compile_records
from dynamo_dist.testing.models import LlamaSize, token_batch
from inductor_passes import schedule
from inductor_passes.core import compat
from inductor_passes.core.collectives import collective_kind

_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "clone", "alias",
          "constant_pad_nd", "contiguous", "slice", "narrow", "expand"}


def test_output_only_chains_move_to_their_producers():
    """Views and copies that only feed outputs (what lowering wraps around a gradient's
    collective) move to right after what they read; arithmetic stays where it is."""
    def f(x, w1, w2):
        g1 = x @ w1
        g2 = torch.relu(g1) @ w2
        return g2.sum(), g1.t().clone(), g2.t(), g1 * 2

    args = [torch.randn(4, 4) for _ in range(3)]
    gm = compat.make_fx(f)(*args)
    out = next(iter(gm.graph.find_nodes(op="output")))
    aten = torch.ops.aten
    for n in [n for n in gm.graph.nodes if n.target in (aten.t.default, aten.clone.default,
                                                       aten.mul.Tensor)]:
        out.prepend(n)  # at the end, as lowering emits output redistributes
    gm.recompile()
    want = gm(*args)
    assert schedule.land_outputs_early(gm) > 0
    for a, b in zip(gm(*args), want):
        assert torch.equal(a, b)
    order = [n.target for n in gm.graph.nodes]
    mm = [k for k, t in enumerate(order) if t is aten.mm.default]
    assert order[mm[0] + 1: mm[0] + 3] == [aten.t.default, aten.clone.default], order
    assert order[mm[1] + 1] is aten.t.default, order
    assert order[-2] is aten.mul.Tensor  # arithmetic is not moved
    assert schedule.land_outputs_early(gm) == 0  # nothing left to move


def _source(node: fx.Node) -> fx.Node:
    """The op that computed what a landing chain moves (walks back through views and pads)."""
    while node.op == "call_function" and (collective_kind(node) or "wait_tensor" in str(
            node.target) or node.target.__name__.split(".")[0] in _VIEWS):
        node = node.args[0]
    return node


def test_fsdp_gradients_are_reduce_scattered_where_they_are_ready(fake_mesh):
    """A 2-layer Llama on dp=2 x tp=2 (FSDP on dp): between the op that computes a
    gradient and the reduce_scatter that lands it in its parameter's placement lies nothing but
    that gradient's own chain, so each layer's
    unsharded gradients are freed before the next layer's backward (they all lived to the end
    of the backward before)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    size = LlamaSize(layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64,
                     seq=8, batch=4)
    model = sharded_llama(mesh, size)
    ids = token_batch(size, 0)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    compiled(input_ids=ids, labels=ids).loss.backward()
    rec = compile_records()[-1]
    bw = rec.step.joint.bw_graph
    order = {n: k for k, n in enumerate(bw.graph.nodes)}
    out = next(iter(bw.graph.find_nodes(op="output")))

    def lands(node: fx.Node) -> bool:  # feeds only graph outputs, through waits and views
        return all(u is out or (u.target.__name__.split(".")[0] in _VIEWS or "wait_tensor" in
                                str(u.target)) and lands(u) for u in node.users)

    scatters = [n for n in bw.graph.nodes if collective_kind(n) == "reduce_scatter" and lands(n)]
    assert len(scatters) >= 9 * 2, len(scatters)  # every layer's weights, at least
    for r in scatters:
        src = _source(r)
        chain = set()
        todo = [r]
        while todo:
            n = todo.pop()
            if n is src or n in chain:
                continue
            chain.add(n)
            todo.extend(n.all_input_nodes)
        between = [n for n in bw.graph.nodes if order[src] < order[n] < order[r]]
        assert all(n in chain for n in between), (r.name, src.name, [n.name for n in between])
