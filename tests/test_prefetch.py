"""Prefetch (``inductor_passes.prefetch``): each layer's parameter gathers issued while the
layer before it runs, their waits where the layer starts. Fake process group: graphs and
generated code are read, not values (values: ``test_multiprocess``'s FSDP Llama with
prefetched gathers, on gloo)."""

import re

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import Stack
from dynamo_dist import compile_records
from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
from inductor_passes import comm, outline, prefetch
from inductor_passes.compile import _copy
from inductor_passes.core.collectives import collective_kind


def _fsdp_stack(fake_mesh, d=32, layers=3, inductor=True):
    mesh = fake_mesh((2,), ("dp",))
    torch.manual_seed(0)
    model = Stack(d, layers)
    shard_module(model, mesh, DataParallelPlanner(mesh_axis_size=2).build_plan(model))
    fn = torch.compile(model, backend="dist", options={"inductor": inductor})
    return fn, torch.randn(8, d)


_ISSUE = re.compile(r"(?:(\w+) = )?torch\.ops\._c10d_functional\.all_gather_into_tensor"
                    r"(?:_out)?\.default\((?:.*out=(\w+))?")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((\w+)\)")
_CALL = re.compile(r"= dd_layer_\d+\(")


def _gathers_across_calls(code: str) -> int:
    """Gathers of the generated calling code that are issued before a layer body call and
    waited for after it: communication in flight while a layer computes."""
    issued, across, seen_call = {}, 0, 0
    for line in code.splitlines():
        if (m := _ISSUE.search(line)) and (m.group(1) or m.group(2)):
            issued[m.group(2) or m.group(1)] = seen_call
        elif (m := _WAIT.search(line)) and m.group(1) in issued:
            across += issued.pop(m.group(1)) < seen_call
        elif _CALL.search(line):
            seen_call += 1
    return across


def _llama(fake_mesh, layers=3, hidden=64, tp=False, inductor=True):
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    mesh = fake_mesh((2, 2), ("dp", "tp")) if tp else fake_mesh((2,), ("dp",))
    size = LlamaSize(layers=layers, hidden=hidden, heads=2, kv_heads=2,
                     intermediate=hidden * 2, vocab=64, seq=8, batch=4)
    torch.manual_seed(0)
    model = build_llama(size)
    plan = TensorParallelPlanner(axis="tp").build_plan(model) if tp else None
    plan = DataParallelPlanner(axis="dp", mesh_axis_size=2).build_plan(model, plan)
    shard_module(model, mesh, plan)
    fn = torch.compile(model, backend="dist", options={"inductor": inductor})
    ids = token_batch(size, 0)
    return lambda: fn(input_ids=ids, labels=ids).loss.backward()


# off (CPU's default) in the full tier: most other compiled tests run without prefetch
@pytest.mark.parametrize("on", ["1", pytest.param("0", marks=pytest.mark.full)])
def test_generated_code_gathers_the_next_layer_while_this_one_runs(fake_mesh, monkeypatch, on):
    """A Llama with FSDP on dp=2 (ZeRO-3: the backward gathers again), 3 outlined layers: with
    prefetch the gathers of layers 1 and 2 (forward) and of the backward's second and third
    layers are issued before the body call of the layer before and waited for after it;
    without it no gather spans a call."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.delenv("DYNAMO_DIST_BUCKET_MB", raising=False)
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", on)
    _, (fw, bw) = run_and_get_code(_llama(fake_mesh, tp=True))
    joint = compile_records()[-1].step.joint
    assert [o.calls for o in joint.outlined] == [3, 3]
    layers = 2 if on == "1" else 0
    assert [len(p.layers) for p in joint.prefetched] == [layers, layers]
    # one bucket a layer; every gather on its own where this torch does not bucket (2.11)
    want = [layers if comm.bucket_cap_mb() > 0 else p.gathers for p in joint.prefetched]
    assert [_gathers_across_calls(fw), _gathers_across_calls(bw)] == want


def test_a_gathered_weight_the_forward_keeps_is_prefetched_with_its_views(fake_mesh,
                                                                          monkeypatch):
    """A small FSDP stack whose forward keeps its gathered weights for the backward (the
    partitioner's choice: their transposes are forward outputs). The gathers still move a
    layer early; the views of the gathered values stay in the calling graph with them (a body
    returning a view of its input is refused by outlining), so the layers share a body as
    without prefetch (layers 1 and 2: layer 0 also slices the batch; the bodies are small, so
    the least size outlined is lowered for the test)."""
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "1")
    monkeypatch.setattr(outline, "MIN_NODES", 3)
    fn, x = _fsdp_stack(fake_mesh)
    fn(x).backward()
    joint = compile_records()[-1].step.joint
    gm = joint.fw_graph
    layer = outline.assign_layers(gm)
    out = next(iter(gm.graph.find_nodes(op="output")))
    gathered = {outline.storage_of(w) for g in gm.graph.nodes if g in layer and
                collective_kind(g) == "all_gather" for w in g.users}
    kept = [a for a in out.args[0] if isinstance(a, fx.Node) and a in layer and
            outline.storage_of(a) in gathered]
    assert kept and all(a.meta.get(outline.OUTSIDE) for a in kept)
    assert len(joint.prefetched[0].layers) == 2 and joint.outlined[0].calls == 2


def _check_prefetched(before: fx.GraphModule, after: fx.GraphModule,
                      done: prefetch.Prefetched) -> None:
    """What ``prefetch_gathers`` promises, checked on the graph it rewrote: the same nodes with
    the same inputs in a valid order (so the same program), each prefetched layer's gathers
    issued before the last node of the layer before it (before its first node from the third
    layer on: the first layer gathers in place), after that layer's own gathers, and their
    waits still after every gather of the layer before."""
    def shape(gm):
        return {n.name: (str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes}

    assert shape(before) == shape(after)
    after.graph.lint()  # every node after its inputs
    order = {n: k for k, n in enumerate(after.graph.nodes)}
    layer = outline.assign_layers(after)
    nodes: dict = {}
    for n in after.graph.nodes:
        if n in layer and not n.meta.get(outline.OUTSIDE):
            nodes.setdefault(layer[n], []).append(n)
    runs = sorted(nodes, key=lambda k: order[nodes[k][0]])
    gathers = {k: [n for n in after.graph.nodes if layer.get(n) == k and
                   collective_kind(n) == "all_gather" and n.meta.get(outline.OUTSIDE)]
               for k in runs}
    assert done.layers == [k for k in runs[1:] if gathers[k]]
    for i, key in enumerate(runs[1:], 1):
        prev = runs[i - 1]
        for g in gathers[key]:
            assert order[g] < order[nodes[prev][-1]], (g, prev)
            if i >= 2 and gathers[prev]:
                assert order[g] < order[nodes[prev][0]], (g, prev)
            assert all(order[g] > order[p] for p in gathers[prev]), (g, prev)
            wait = next(iter(g.users))
            assert all(order[wait] > order[p] for p in gathers[prev])


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.integers(2, 4), hidden=st.sampled_from([32, 48]))
def test_prefetch_moves_only_and_keeps_one_layer_ahead(fake_mesh, monkeypatch, layers, hidden):
    """On Llamas of random depth and width under Megatron + FSDP on dp=2 x tp=2 (the backward
    gathers again), planned without prefetch: the pass on each flat graph keeps every node and
    input, in a valid order, with each layer's gathers one layer ahead (``_check_prefetched``).
    (FSDP on dp alone keeps the gathered parameters for the backward: nothing to prefetch.)"""
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "0")
    torch._dynamo.reset()
    _llama(fake_mesh, layers, hidden, tp=True, inductor=False)()
    joint = compile_records()[-1].step.joint
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "1")
    for gm in (joint.fw_graph, joint.bw_graph):
        after = _copy(gm)
        done = prefetch.prefetch_gathers(after)
        assert len(done.layers) == layers - 1  # every layer but the first gathers early
        _check_prefetched(gm, after, done)


def test_on_by_default_for_gpu_graphs_only(monkeypatch):
    """Unset or ``auto``: on for a graph whose inputs live off the CPU, off on CPU (where it
    costs compile time and did not win, ``benchmarks/results/prefetch.md``); 1 and 0 force it;
    another value is refused with the fix."""
    def graph(device):
        gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
        x = gm.graph.placeholder("x")
        x.meta["val"] = torch.empty(2, device=device)
        gm.graph.output(x)
        return gm

    cpu, meta = graph("cpu"), graph("meta")  # meta: a device that is not the CPU
    monkeypatch.delenv("DYNAMO_DIST_PREFETCH", raising=False)
    assert not prefetch.enabled(cpu) and prefetch.enabled(meta)
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "auto")
    assert not prefetch.enabled(cpu) and prefetch.enabled(meta)
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "1")
    assert prefetch.enabled(cpu)
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "0")
    assert not prefetch.enabled(meta)
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "yes")
    with pytest.raises(ValueError, match="DYNAMO_DIST_PREFETCH='yes'.*fix"):
        prefetch.enabled(cpu)


def test_a_gather_that_reads_another_gathers_wait_moves_after_it(fake_mesh, monkeypatch):
    """GPT-2 (the zoo's) on dp=2 x tp=2: a Conv1D weight is gathered over dp, laid
    out again, then gathered over tp, so one gather's chain holds another's wait. The first
    version put the next layer's chain before a node of that chain itself (the first layer's
    gathers end right before it) and made an invalid graph (a wait used before its gather);
    now it compiles, with the backward's gathers issued a layer early."""
    from dynamo_dist.testing.zoo.cell import plan_model
    from dynamo_dist.testing.zoo.models import MODELS, loss_of

    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "1")
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    zm = MODELS["gpt2"]
    model = zm.build()
    shard_module(model, mesh, plan_model(model, {"dp": 2, "tp": 2}))
    args, kwargs = zm.batch(0)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    loss_of(compiled(*args, **kwargs)).backward()
    moved = [len(p.layers) for r in compile_records() if r.step is not None
             for p in r.step.joint.prefetched]
    assert max(moved) >= 1, moved
