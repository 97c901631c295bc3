"""Partitioning a local joint graph the way torch.compile would, and alike in every copy of a
layer: Inductor's joint-graph passes run before the partitioner (a user's joint pass too), and
``align_saves`` gives a layer whose save choice differs from its copies their choice, so the
backward shares one compiled body across all of them."""

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from inductor_passes import align_saves as align


def _layered(n_layers: int, saved: dict[int, set[int]]):
    """A joint graph of ``n_layers`` copies of x -> a = x + 1 -> b = a * 2 -> c = b.sin() -> five
    cos (a layer as big as outlining takes: ``outline.MIN_NODES``), each node in module
    ``layers.<k>`` and tagged forward, and a forward graph whose saved outputs are, per layer k,
    the nodes at positions ``saved[k]`` (0 = a, 1 = b, 2 = c). Returns (joint, forward, each
    layer's nodes)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4)
    cur, positions = x, {}
    for k in range(n_layers):
        nodes = []
        for target, arg in ((torch.ops.aten.add.Tensor, 1), (torch.ops.aten.mul.Tensor, 2),
                            (torch.ops.aten.sin.default, None),
                            *[(torch.ops.aten.cos.default, None)] * 5):
            node = g.call_function(target, (cur,) if arg is None else (cur, arg))
            node.meta.update(val=torch.randn(4), partitioner_tag="is_forward",
                             nn_module_stack={f"m{k}": (f"layers.{k}", object)})
            nodes.append(node)
            cur = node
        positions[k] = nodes
    g.output((cur,))
    joint = fx.GraphModule(torch.nn.Module(), g)
    fw = fx.Graph()
    outs = []
    for k, nodes in positions.items():
        for p in sorted(saved[k]):
            ph = fw.placeholder(nodes[p].name)  # the partitioner keeps the joint's names
            outs.append(ph)
    fw.output((fw.placeholder("loss"), *outs))
    return joint, fx.GraphModule(torch.nn.Module(), fw), positions


def _must_save(joint: fx.GraphModule) -> list[fx.Node]:
    return [n for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE]


def test_a_layer_that_saved_otherwise_gets_the_majority_saves():
    joint, fw, layers = _layered(4, {0: {2}, 1: {1, 2}, 2: {1, 2}, 3: {1, 2}})
    assert align.align_saves(joint, fw, num_fwd_outputs=1) == 1
    assert _must_save(joint) == [layers[0][1]]  # layer 0's b (its a and c: as the others)


def test_agreeing_layers_are_left_alone_and_a_tie_follows_the_later_layers():
    joint, fw, _ = _layered(3, {0: {1}, 1: {1}, 2: {1}})
    assert align.align_saves(joint, fw, num_fwd_outputs=1) == 0
    assert not _must_save(joint)
    joint, fw, layers = _layered(2, {0: {0}, 1: {2}})
    assert align.align_saves(joint, fw, num_fwd_outputs=1) == 1
    assert _must_save(joint) == [layers[0][2]]  # layer 0 takes layer 1's choice: c


def _llama(mesh, monkeypatch, aligned: bool):
    """The demo Llama (3 layers) on a fake dp=2 x tp=2 mesh, ZeRO-3 over dp (the llama_dp_tp
    benchmark's plan), one compiled training step; returns its compile record's joint."""
    import inductor_passes.compile as compile_mod
    from dynamo_dist import compile_records
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    monkeypatch.setattr(compile_mod, "align_saves",
                        align.align_saves if aligned else lambda *args: 0)
    # partitioning each distinct layer once aligns the copies by itself; the whole-graph
    # partition is what align_saves exists for
    monkeypatch.setenv("DYNAMO_DIST_LAYER_PARTITION", "0")
    size = LlamaSize(layers=3)
    torch.manual_seed(0)
    model = build_llama(size)
    plan = TensorParallelPlanner(axis="tp").build_plan(model)
    shard_module(model, mesh, DataParallelPlanner(axis="dp", shard_params=True,
                                                  mesh_axis_size=2).build_plan(model, plan))
    ids = token_batch(size, 0)
    torch._dynamo.reset()
    torch.compile(model, backend="dist")(input_ids=ids, labels=ids).loss.backward()
    return compile_records()[-1].step.joint


def test_llama_backward_layers_share_one_body(fake_mesh, monkeypatch):
    """Unaligned, the partitioner saves the first layer's attention output and recomputes its
    residual sum (the other layers save the sum), so its backward is compiled apart; aligned,
    all three backward layers call one body. The loss's cross-entropy gradient is a select,
    not a scatter into zeros (Inductor's joint-graph rewrite), so it fuses; the backward's
    re-gathers read the parameters themselves, not copies saved by the forward."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    joint = _llama(mesh, monkeypatch, aligned=False)
    assert [len(layers) for layers, _ in joint.outlined[1].bodies.values()] == [2]
    joint = _llama(mesh, monkeypatch, aligned=True)
    assert [len(layers) for layers, _ in joint.outlined[0].bodies.values()] == [3]
    assert [len(layers) for layers, _ in joint.outlined[1].bodies.values()] == [3]
    assert not any(n.target is torch.ops.aten.scatter.value for n in joint.bw_graph.graph.nodes)
    # parameters are resident: the forward saves none of them transposed or copied (each layer
    # saved five such copies of its ZeRO-3 shards for the backward's re-gathers)
    graph = joint.fw_graph.graph
    of_params = {p for p in graph.find_nodes(op="placeholder")
                 if p.meta["val"].is_floating_point()}  # the weights; the ids are integers
    for n in graph.nodes:  # values computed from parameters alone (a gather is a new value)
        if n.op == "call_function" and n.all_input_nodes and \
                getattr(n.target, "namespace", None) != "_c10d_functional" and \
                all(a in of_params for a in n.all_input_nodes):
            of_params.add(n)
    out = next(iter(graph.find_nodes(op="output"))).args[0]
    copies = [n.name for n in out[joint.num_fwd_outputs:]
              if isinstance(n, torch.fx.Node) and n.op == "call_function" and n in of_params]
    assert not copies, copies


def test_a_users_joint_graph_pass_runs(fake_mesh):
    """A joint-graph pass set in Inductor's config sees our joint graph, as it would under
    torch.compile's own partitioning."""
    from torch._inductor import config

    seen = []

    def joint_pass(graph: fx.Graph) -> None:
        seen.append(sum(n.op == "call_function" for n in graph.nodes))

    mesh = fake_mesh((2,), ("tp",))
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]).requires_grad_()
    x = torch.randn(4, 8)
    with config.patch(joint_custom_post_pass=joint_pass):
        torch._dynamo.reset()
        torch.compile(lambda x, w: (x @ w).relu().sum(), backend="dist")(x, w).backward()
    assert seen and seen[0] > 0
