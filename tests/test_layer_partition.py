"""Partitioning each distinct repeated layer once (``inductor_passes.layer_partition``): the
forward and backward graphs compute exactly what the whole-graph partition's do, every copy of a
layer saves the same values, layers that cannot be shared (random draws) are left to the
whole-graph partition, and a Llama trains as before."""

import pytest
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inductor_passes import compile as compile_mod
from inductor_passes import layer_partition, outline
from inductor_passes.core import compat
from tests.test_outline import D, Block
from tests.test_outline import _block as _outline_block


def _block(x, w, variant: int):
    """One layer: ``test_outline``'s variants (0 and 1 differ in a constant only, 2 in ops, 3
    draws random numbers), and 4, variant 0 with a cheap pointwise tail the partitioner may
    recompute."""
    if variant == 4:
        y = _outline_block(x, w, 0)
        return y + (y * 1.5).sin().cos() * y
    return _outline_block(x, w, variant)


def _joint(variants: list[int]):
    """A local joint graph, as capture makes one: placeholders ``primals_*`` (x, head, one
    weight per layer) then ``tangents_*``; outputs (loss, *gradients); every node, backward
    ones too, in its layer's module (``model.layers.<k>``). Returns (joint, primals, tangents,
    number of forward outputs)."""
    n = 2 + len(variants)

    def f(*args):
        primals, tangents = args[:n], args[n:]
        with fx_traceback.preserve_node_meta(), torch.enable_grad():
            x, head, *ws = primals
            for k, (w, v) in enumerate(zip(ws, variants)):
                path = f"model.layers.{k}"
                fx_traceback.current_meta["nn_module_stack"] = {path: (path, Block)}
                x = _block(x, w, v)
                compat.tag_grad_fns([x], {path: (path, Block)})
            fx_traceback.current_meta["nn_module_stack"] = {"model.head": ("model.head", Block)}
            loss = (x @ head).square().mean()
            compat.tag_grad_fns([loss], {"model.head": ("model.head", Block)})
            fx_traceback.current_meta.pop("nn_module_stack", None)
            compat.preserve_backward_module_stacks([loss.grad_fn])
            grads = torch.autograd.grad([loss], list(primals), list(tangents))
        return (loss, *grads)

    g = torch.Generator().manual_seed(0)
    primals = [torch.randn(4, D, generator=g), torch.randn(D, 3, generator=g)] + \
        [torch.randn(D, D, generator=g) / D for _ in variants]
    primals = [p.requires_grad_() for p in primals]
    tangents = [torch.ones(())]
    gm = compat.make_fx(f)(*primals, *tangents)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for k, p in enumerate(placeholders):
        name = f"primals_{k + 1}" if k < n else f"tangents_{k - n + 1}"
        p._rename(name)
        p.target = name
    gm.recompile()
    compile_mod._tag_forward(gm, 1)
    return gm, [p.detach() for p in primals], tangents, 1


def _partitioned(gm, by_layer: bool):
    """(forward, backward) of ``gm``: once per distinct layer, or the whole graph at once."""
    part = compile_mod._min_cut
    if by_layer:
        got = layer_partition.partition_by_layer(
            gm, 1, [], lambda g, **kw: part(g, None, **kw))
        assert got is not None
        return got
    return part(gm, None, num_fwd_outputs=1, static=[])


def _run(fw, bw, primals, tangents, num_fwd):
    out = fw(*primals)
    saved = list(out[num_fwd:])
    sizes = [s for s in saved if not isinstance(s, torch.Tensor)]
    tensors = [s for s in saved if isinstance(s, torch.Tensor)]
    grads = bw(*sizes, *tensors, *tangents)
    return list(out[:num_fwd]), list(grads), len(tensors)


def _misattributed(joint: fx.GraphModule, gm: fx.GraphModule) -> list[str]:
    """Nodes of ``gm`` whose metadata (value, module stack, name) is that of a joint node that
    reads other values than the node itself does: metadata copied from the wrong layer."""
    of = {id(n.meta.get("val")): n for n in joint.graph.nodes if "val" in n.meta}
    wrong = []
    for n in gm.graph.nodes:
        src = of.get(id(n.meta.get("val"))) if n.op == "call_function" else None
        if src is None or src.op != "call_function":
            continue
        for a, b in zip(n.all_input_nodes, src.all_input_nodes):
            mine = of.get(id(a.meta.get("val")))
            if mine is not None and mine is not b:
                wrong.append(f"{n.name} reads {a.name}, its joint node {src.name} {b.name}")
    return wrong


def test_a_stack_partitioned_per_layer_computes_what_the_whole_graph_partition_does():
    gm, primals, tangents, nf = _joint([0] * 5)
    want = _run(*_partitioned(gm, False), primals, tangents, nf)
    fw, bw = _partitioned(gm, True)
    got = _run(fw, bw, primals, tangents, nf)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    # flat graphs: no body call survives, and each copy's nodes keep their own layer's module
    for g in (fw, bw):
        assert not g.graph.find_nodes(op="call_function", target=outline.INVOKE_SUBGRAPH)
        # the backward's copies come in the reverse order: each took its own layer's metadata
        assert not _misattributed(gm, g)
    layers = {outline.layer_of(n) for n in fw.graph.nodes
              if n.op == "call_function" and n.meta.get("nn_module_stack")}
    assert {("model.layers", k) for k in range(5)} <= layers


def _scale_sines(gm: fx.GraphModule) -> None:
    """A stand-in joint-graph rewrite: every ``sin`` read through a new ``mul(x, 1.0)``."""
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sin.default)):
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node.args[0], 1.0))
        scaled.meta = {k: v for k, v in node.meta.items() if k != "val"}
        val = node.args[0].meta["val"]
        with val.fake_mode:
            scaled.meta["val"] = val * 1.0
        node.replace_input_with(node.args[0], scaled)
    gm.recompile()


def test_a_rewrite_runs_on_the_representative_and_each_copy_gets_its_own_values():
    """``rewrite`` (Inductor's joint-graph passes in the compiler) runs on the representative
    and the outer graph only; the copies' nodes it made are named apart from the joint graph's
    and hold values of their own (one value shared by the copies read, to the peak prediction,
    as one buffer); the numbers are the whole-graph partition's."""
    gm, primals, tangents, nf = _joint([4] * 5)
    want = _run(*_partitioned(gm, False), primals, tangents, nf)
    calls = []

    def rewrite(g):
        calls.append(g)
        _scale_sines(g)

    fw, bw = layer_partition.partition_by_layer(
        gm, 1, [], lambda g, **kw: compile_mod._min_cut(g, None, **kw), rewrite)
    assert len(calls) == 2 and gm not in calls
    got = _run(fw, bw, primals, tangents, nf)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    joint_names = {n.name for n in gm.graph.nodes}
    made = [n for n in fw.graph.nodes if n.target is torch.ops.aten.mul.Tensor
            and n.args[1] == 1.0]
    assert len(made) >= 3  # one per copy partitioned as the representative
    assert all(n.name.startswith("dd_part_") and n.name not in joint_names for n in made)
    storages = [n.meta["val"].untyped_storage()._cdata for n in made]
    assert len(set(storages)) == len(storages)


def test_every_copy_saves_the_same_values():
    """The forward saves, for each copy partitioned as one, the values at the same positions
    of its nodes: one backward body serves them all (what ``align_saves`` otherwise
    re-partitions for). A copy's output is left out of the comparison: the next layer saves
    it as its own input."""
    gm, *_ = _joint([4] * 5)
    (copies,) = outline.instances(gm).values()
    assert len(copies) >= 3, [c.key for c in copies]
    fw, _ = _partitioned(gm, True)
    out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    saved = {a.name for a in out[1:] if isinstance(a, fx.Node)}
    patterns = set()
    for inst in copies:
        members = set(inst.nodes)
        inner = [n for n in inst.nodes if n.meta.get("partitioner_tag") == "is_forward"
                 and all(u in members for u in n.users)]
        patterns.add(tuple(n.name in saved for n in inner))
    assert len(patterns) == 1 and any(next(iter(patterns))), patterns


def test_random_layers_are_left_to_the_whole_graph_partition():
    gm, *_ = _joint([3, 3, 3])
    assert layer_partition.partition_by_layer(
        gm, 1, [], lambda g, **kw: compile_mod._min_cut(g, None, **kw)) is None


def test_the_pass_can_be_turned_off(monkeypatch):
    gm, *_ = _joint([0, 0, 0])
    monkeypatch.setenv("DYNAMO_DIST_LAYER_PARTITION", "0")
    assert layer_partition.partition_by_layer(gm, 1, [], None) is None
    monkeypatch.setenv("DYNAMO_DIST_LAYER_PARTITION", "yes")
    with pytest.raises(ValueError, match="DYNAMO_DIST_LAYER_PARTITION"):
        layer_partition.partition_by_layer(gm, 1, [], None)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(st.sampled_from([0, 1, 2, 4]), max_size=2),
       repeated=st.sampled_from([0, 1, 2, 4]), copies=st.integers(2, 5),
       after=st.lists(st.sampled_from([0, 1, 2, 4]), max_size=2))
def test_random_stacks_partition_to_the_same_numbers(before, repeated, copies, after):
    """Random stacks of layer variants around a run of copies of one: the forward outputs
    and every gradient equal the whole-graph partition's; with four copies or more (two
    interior ones at least) the pass does partition per layer. (Dropout layers are left out
    here: this toy trace of ``dropout`` is one the whole-graph partitioner rejects too;
    capture's is not.)"""
    variants = [*before, *[repeated] * copies, *after]
    gm, primals, tangents, nf = _joint(variants)
    part = compile_mod._min_cut
    got = layer_partition.partition_by_layer(gm, 1, [], lambda g, **kw: part(g, None, **kw))
    if got is None:
        assert copies < 4 and not outline.instances(gm), variants  # nothing refused
        return
    assert not _misattributed(gm, got[0]) and not _misattributed(gm, got[1]), variants
    want = _run(*part(gm, None, num_fwd_outputs=1, static=[]), primals, tangents, nf)
    have = _run(*got, primals, tangents, nf)
    for a, b in zip(have[0] + have[1], want[0] + want[1]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), variants


@pytest.fixture
def partitioned_per_layer(monkeypatch):
    """A list that gets, for each call of ``partition_by_layer``, whether it gave the graphs."""
    used = []
    real = layer_partition.partition_by_layer

    def counted(*args, **kwargs):
        got = real(*args, **kwargs)
        used.append(got is not None)
        return got
    monkeypatch.setattr(layer_partition, "partition_by_layer", counted)
    return used


def _llama_joint(mesh, monkeypatch, by_layer: bool):
    """The demo Llama (4 layers) on a fake dp=2 x tp=2 mesh, Megatron and ZeRO-3, one compiled
    training step with ``align_saves`` off (so nothing but this pass aligns the layers);
    returns the compile record's joint."""
    from conftest import sharded_llama
    from dynamo_dist import compile_records
    from dynamo_dist.testing.models import LlamaSize, token_batch

    monkeypatch.setattr(compile_mod, "align_saves", lambda *args: 0)
    monkeypatch.setenv("DYNAMO_DIST_LAYER_PARTITION", "1" if by_layer else "0")
    size = LlamaSize(layers=4)
    torch.manual_seed(0)
    model = sharded_llama(mesh, size)
    ids = token_batch(size, 0)
    torch._dynamo.reset()
    torch.compile(model, backend="dist")(input_ids=ids, labels=ids).loss.backward()
    return compile_records()[-1].step.joint


def _collectives(gm: fx.GraphModule) -> dict[str, int]:
    from inductor_passes.core.collectives import collective_kind

    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        kind = collective_kind(n)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def test_llama_layers_partitioned_once_share_bodies_with_the_same_collectives(
        fake_mesh, monkeypatch, partitioned_per_layer):
    """Demo Llama, dp=2 x tp=2: partitioned per layer, every forward and backward layer calls
    one body with no second partition (``align_saves`` off), and the forward and backward
    graphs hold the collectives the whole-graph partition's hold (none recomputed, none
    moved between them)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    joint = _llama_joint(mesh, monkeypatch, by_layer=True)
    assert partitioned_per_layer == [True]
    assert [len(layers) for layers, _ in joint.outlined[0].bodies.values()] == [4]
    assert [len(layers) for layers, _ in joint.outlined[1].bodies.values()] == [4]
    whole = _llama_joint(mesh, monkeypatch, by_layer=False)
    assert partitioned_per_layer == [True, False]
    assert _collectives(joint.fw_graph) == _collectives(whole.fw_graph)
    assert _collectives(joint.bw_graph) == _collectives(whole.bw_graph)
    # no more saved for the backward than the whole-graph partition saves
    assert joint.predicted_peak.peak_bytes <= whole.predicted_peak.peak_bytes * 1.02


def test_joint_rewrites_run_per_layer_and_leave_the_layers_aligned(fake_mesh, monkeypatch,
                                                                     partitioned_per_layer):
    """Demo Llama, dp=2 x tp=2, ``align_saves`` on: Inductor's joint-graph rewrites run twice
    (the representative, the outer graph), never over the whole joint graph; the layers save
    alike, so one partition (``align_saves`` marks nothing: a rewritten node once took a layer
    node's name, which read as that layer saving another value, and partitioned twice)."""
    from conftest import sharded_llama
    from dynamo_dist import compile_records
    from dynamo_dist.testing.models import LlamaSize, token_batch

    rewritten, marked = [], []
    rewrite, align = compile_mod._joint_rewrites, compile_mod.align_saves

    def counted_rewrite(gm):
        rewritten.append(len(gm.graph.nodes))
        rewrite(gm)

    def counted_align(*args):
        marked.append(align(*args))
        return marked[-1]

    monkeypatch.setattr(compile_mod, "_joint_rewrites", counted_rewrite)
    monkeypatch.setattr(compile_mod, "align_saves", counted_align)
    size = LlamaSize(layers=4)
    torch.manual_seed(0)
    model = sharded_llama(fake_mesh((2, 2), ("dp", "tp")), size)
    ids = token_batch(size, 0)
    torch._dynamo.reset()
    torch.compile(model, backend="dist")(input_ids=ids, labels=ids).loss.backward()
    assert compile_records()[-1].step is not None
    assert partitioned_per_layer == [True] and marked == [0] and len(rewritten) == 2


def _four_layers(name: str):
    """The zoo's ``name`` architecture with 4 decoder layers (the zoo's default 2 makes the
    first and last layer, which differ, the only ones)."""
    from dynamo_dist.testing.zoo import models as zoo

    if name == "gpt_neo":  # global and windowed local attention alternate: 2 distinct layers
        return zoo.ZooModel(name, "4 layers", zoo._hf(
            "GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=zoo.HIDDEN, num_layers=4,
            num_heads=zoo.HEADS, attention_types=[[["global", "local"], 2]],
            max_position_embeddings=64, window_size=8, **zoo._LM), zoo._lm_batch)
    config = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}),
              "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
              "gemma": ("GemmaForCausalLM", "GemmaConfig",
                        dict(head_dim=zoo.HIDDEN // zoo.HEADS, pad_token_id=0))}[name]
    kv = 1 if name == "gemma" else zoo.KV_HEADS
    return zoo.ZooModel(name, "4 layers", zoo._hf(
        config[0], config[1], hidden_size=zoo.HIDDEN, intermediate_size=zoo.FFN,
        num_hidden_layers=4, num_attention_heads=zoo.HEADS, num_key_value_heads=kv,
        **config[2], **zoo._LM), zoo._lm_batch)


@pytest.mark.parametrize("model,mesh,checkpointing,per_layer", [
    ("llama", "dp=2,tp=2", False, True), ("qwen2", "tp=2", False, True),
    ("gemma", "tp=2", False, True), ("gpt_neo", "tp=2", False, True),
    ("llama", "tp=2", True, False)])
def test_zoo_models_partitioned_per_layer_train_like_one_process(model, mesh, checkpointing,
                                                                  per_layer,
                                                                  partitioned_per_layer):
    """Simulated ranks, 2 AdamW steps of a 4-layer model against one process, with the pass
    in use (GPT-Neo: its local-attention mask is a tensor constant of the graph, which the
    outer graph must carry; it crashed), or left to the whole-graph partition (transformers'
    gradient checkpointing: the partitioner threads an RNG state from the layer's forward to
    its recompute, not a saved value)."""
    from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell

    row = run_cell(_four_layers(model), mesh, SimRuntime(), steps=2,
                   checkpointing=checkpointing)
    assert row["status"] == "parity", row
    used = partitioned_per_layer
    assert used and set(used) == {per_layer}, used
