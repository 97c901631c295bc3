"""Outlining repeated layers into shared ``invoke_subgraph`` bodies (``inductor_passes.outline``):
the outlined graph computes exactly what the original did, only identical layers share a body,
layers that cannot be outlined stay inline, and Inductor compiles the result right."""


import pytest
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inductor_passes import outline
from inductor_passes.core import compat

HOP = torch.ops.higher_order.invoke_subgraph
D = 8


class Block(torch.nn.Module):  # only its name is read: the module stack's type
    pass


def _in_module(path: str | None):
    """Nodes traced inside this context carry ``path`` as their module (None: no module at
    all, as lowering's collectives)."""
    class Ctx:
        def __enter__(self):
            self.saved = fx_traceback.current_meta.get("nn_module_stack")
            if path is None:
                fx_traceback.current_meta.pop("nn_module_stack", None)
            else:
                fx_traceback.current_meta["nn_module_stack"] = {path: (path, Block)}

        def __exit__(self, *exc):
            if self.saved is None:
                fx_traceback.current_meta.pop("nn_module_stack", None)
            else:
                fx_traceback.current_meta["nn_module_stack"] = self.saved
    return Ctx()


def _block(x, w, variant: int):
    """One layer: variants 0 and 1 differ in a constant only, 2 in ops; 3 draws random
    numbers; 4 is variant 0 with an untagged (module-less) tail."""
    scale = 0.5 if variant != 1 else 0.25
    h = torch.relu(x @ w) * scale
    h = h + torch.tanh(h) - h.mean(dim=-1, keepdim=True)
    if variant == 2:
        h = torch.sigmoid(h) * h
    if variant == 3:
        h = torch.nn.functional.dropout(h, 0.5)
    if variant == 4:
        with _in_module(None):
            h = h * 1.0 + 0.0
    return x + h


def _stack(variants: list[int], prefix: str = "model.layers") -> fx.GraphModule:
    """A traced local graph: layers ``prefix.k`` of the given variants, a head outside them."""
    def f(x, head, *ws):
        for k, (w, v) in enumerate(zip(ws, variants)):
            with _in_module(f"{prefix}.{k}"):
                x = _block(x, w, v)
        with _in_module("model.head"):
            return ((x @ head).sum(), x * 2)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, D, generator=g), torch.randn(D, 3, generator=g)] + \
        [torch.randn(D, D, generator=g) / D for _ in variants]
    with fx_traceback.preserve_node_meta():
        gm = compat.make_fx(f)(*args)
    return gm, args


def _bodies(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    calls = {}
    for n in gm.graph.find_nodes(op="call_function", target=HOP):
        calls.setdefault(n.args[0].target, []).append(n)
    return calls


def test_identical_layers_share_one_body_and_compute_the_same():
    gm, args = _stack([0] * 5)
    want = gm(*args)
    done = outline.outline_repeats(gm)
    assert len(done.bodies) == 1 and done.calls == 5, done
    assert len(_bodies(gm)["dd_layer_0"]) == 5
    assert len(gm.graph.find_nodes(op="get_attr")) == 1  # one body: Inductor lowers it once
    got = gm(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_layer_that_differs_in_a_constant_gets_its_own_body():
    gm, args = _stack([0, 0, 1, 1, 0, 2])
    want = gm(*args)
    done = outline.outline_repeats(gm)
    shared = sorted(sorted(k for _, k in layers) for layers, _ in done.bodies.values())
    assert shared == [[0, 1, 4], [2, 3]], done  # variant 2 appears once: inline
    for a, b in zip(gm(*args), want):
        assert torch.equal(a, b)


def test_random_layers_stay_inline():
    """Dropout draws from the generator: a shared body would not be one call per draw."""
    gm, _ = _stack([3, 3, 3, 0, 0])
    done = outline.outline_repeats(gm)
    assert sorted(k for layers, _ in done.bodies.values() for _, k in layers) == [3, 4]
    dropouts = [n for n in gm.graph.nodes if "bernoulli" in str(n.target) or
                "rand" in str(n.target)]
    assert dropouts, gm.code  # still in the outer graph


def test_module_less_nodes_join_the_layer_around_them():
    gm, args = _stack([4, 4, 4])
    want = gm(*args)
    done = outline.outline_repeats(gm)
    assert done.calls == 3
    for a, b in zip(gm(*args), want):
        assert torch.equal(a, b)


def test_an_effectful_node_between_a_layers_nodes_keeps_it_inline():
    gm, args = _stack([0, 0, 0])
    want = [t.clone() for t in gm(*args)]
    # an in-place write into an input, placed between layer 1's first and last node
    layer1 = [n for n in gm.graph.nodes if outline.layer_of(n) == ("model.layers", 1)]
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    with gm.graph.inserting_after(layer1[2]):
        gm.graph.call_function(torch.ops.aten.add_.Tensor, (x, 0.0))
    gm.recompile()
    done = outline.outline_repeats(gm)
    assert sorted(k for layers, _ in done.bodies.values() for _, k in layers) == [0, 2]
    for a, b in zip(gm(*[a.clone() for a in args]), want):
        assert torch.equal(a, b)


def test_the_pass_can_be_turned_off(monkeypatch):
    gm, _ = _stack([0, 0, 0])
    monkeypatch.setenv("DYNAMO_DIST_OUTLINE", "0")
    assert outline.outline_repeats(gm).calls == 0 and not _bodies(gm)
    monkeypatch.setenv("DYNAMO_DIST_OUTLINE", "yes")
    with pytest.raises(ValueError, match="DYNAMO_DIST_OUTLINE"):
        outline.outline_repeats(gm)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variants=st.lists(st.sampled_from([0, 0, 0, 1, 2, 4]), min_size=1, max_size=7))
def test_outlined_stacks_compute_exactly_what_they_did(variants):
    """Random stacks of layer variants: the outlined graph's outputs are bit-for-bit the
    original's, and every body is shared only by layers of one variant (variants 0 and 4
    compute the same but are different graphs)."""
    gm, args = _stack(variants)
    want = gm(*args)
    done = outline.outline_repeats(gm)
    for layers, _ in done.bodies.values():
        assert len({variants[k] for _, k in layers}) == 1, (variants, done)
        assert len(layers) >= 2
    counts = {v: variants.count(v) for v in set(variants)}
    assert done.calls == sum(c for c in counts.values() if c >= 2), (variants, done)
    for a, b in zip(gm(*args), want):
        assert torch.equal(a, b)


def _compiled(gm: fx.GraphModule, args):
    fake = compat.FakeTensorMode()
    inputs = [fake.from_tensor(a) for a in args]
    for p, v in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        p.meta["val"] = v
    with compat.tracing(compat.TracingContext(fake)):
        fn = compat.compile_fx_inner(gm, inputs)
    return fn(list(args))


def test_inductor_compiles_a_shared_body_right(tmp_path, monkeypatch):
    """One body for four layers, through Inductor, against the original graph run eagerly;
    and a second program that differs only inside its body is not served the first one's
    cached code (Inductor's FX-graph cache key sees the body)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    results = []
    for variant in (0, 1):
        gm, args = _stack([variant] * 4)
        want = gm(*args)
        assert outline.outline_repeats(gm).calls == 4
        got = _compiled(gm, args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        results.append(got[0])
    assert not torch.allclose(results[0], results[1])


@pytest.mark.parametrize("path,want", [
    ("L['args'][0].model.layers.3.self_attn", ("L['args'][0].model.layers", 3)),
    ("L['self'].blocks[12].mlp", ("L['self'].blocks", 12)),
    ("L['self']._modules['layers']._modules['7']", ("L['self']._modules['layers']._modules", 7)),
    ("G['net'].encoder.block.1.layer.0", ("G['net'].encoder.block", 1)),
    ("L['args'][0].model.norm", None),
    # a wrapper calling a decorated forward: the cell's index is not a layer's
    ("L['self'].inner.forward.__closure__[2].cell_contents.model.layers.3.mlp",
     ("L['self'].inner.forward.__closure__[2].cell_contents.model.layers", 3)),
    ("L['self'].inner.forward.__closure__[2].cell_contents.lm_head", None)])
def test_a_node_belongs_to_the_first_numbered_module_after_the_frames_own_source(path, want):
    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"k": (path, Block)}
    assert outline.layer_of(node) == want


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    @torch.compiler.nested_compile_region
    def forward(self, x):  # as a user marks a repeated block
        return x + torch.relu(self.fc(x))


def test_nested_compile_region_copies_name_their_own_layer():
    """Dynamo traces a region body once, at layer 0; once inlined, each copy's nodes carry the
    module stack of the call they replace, so outlining sees three layers, not one."""
    model = torch.nn.Sequential(*(_Layer() for _ in range(3)))
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(4, D))
    calls = seen["gm"].graph.find_nodes(op="call_function", target=HOP)
    # (Dynamo may inline the first call: its input is a graph input)
    assert len(calls) >= 2 and len({c.args[0].target for c in calls}) == 1  # one body
    gm = compat.inline_nested_compile_regions(seen["gm"])
    layers = [outline.layer_of(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert sorted({k for _, k in filter(None, layers)}) == [0, 1, 2], layers
    assert len({layers.count(k) for k in set(layers) if k}) == 1  # each copy whole


def test_a_failure_of_inductor_on_shared_bodies_falls_back_to_layers_in_place(
        mesh_of_one, monkeypatch, caplog):
    """Should Inductor fail on a graph with shared bodies, the flat graph is compiled instead,
    with a warning (every rank falls back alike): the step is right and nothing is shared."""
    import logging

    from conftest import sharded_llama
    from dynamo_dist import compile_records
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    real = compat.compile_fx_inner

    def failing(gm, *args, **kwargs):
        if gm.graph.find_nodes(op="call_function", target=HOP):
            raise RuntimeError("planted Inductor failure")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(compat, "compile_fx_inner", failing)
    size = LlamaSize(layers=3, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64,
                     seq=8, batch=2)
    model = sharded_llama(mesh_of_one(("tp",)), size)
    ref = build_llama(size)
    ids = token_batch(size, 0)
    with caplog.at_level(logging.WARNING, logger="dynamo_dist"):
        loss = torch.compile(model, backend="dist")(input_ids=ids, labels=ids).loss
    assert any("planted Inductor failure" in r.getMessage() for r in caplog.records)
    assert all(o.calls == 0 for o in compile_records()[-1].step.joint.outlined)
    torch.testing.assert_close(loss.full_tensor(), ref(input_ids=ids, labels=ids).loss)


def test_constants_equal_as_numbers_but_not_as_values_keep_bodies_apart():
    """-0.0 == 0.0 in Python, but x * -0.0 and x * 0.0 differ (their reciprocals are -inf and
    inf): layers that differ only so must not share a body."""
    def f(x, *ws):
        for k, (w, c) in enumerate(zip(ws, (0.0, -0.0, 0.0, -0.0))):
            with _in_module(f"model.layers.{k}"):
                h = torch.relu(x @ w) * c
                x = x + 1.0 / (h + h.mean() * 0.0) * 0.0 + torch.tanh(h) - h.sum(-1, True)
        return (x,)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, D, generator=g)] + [torch.randn(D, D, generator=g) for _ in range(4)]
    with fx_traceback.preserve_node_meta():
        gm = compat.make_fx(f)(*args)
    done = outline.outline_repeats(gm)
    shared = sorted(sorted(k for _, k in layers) for layers, _ in done.bodies.values())
    assert shared == [[0, 2], [1, 3]], done


def test_reducing_before_or_after_a_view_shares_one_body(fake_mesh):
    """The planner, between equal costs, all-reduces some layers' partial sums before a view
    and others' after it (a Llama's first and last layers under tp). ``reduce_before_views``
    writes every such pair one way, so all four layers share one body, and the rewritten graph
    computes what the original did."""
    mesh = fake_mesh((2,), ("tp",))
    group = mesh.get_group().group_name
    funcol = torch.ops._c10d_functional

    def f(x, *ws):
        for k, w in enumerate(ws):
            with _in_module(f"model.layers.{k}"):
                y = torch.relu(x.reshape(16, D)) @ w  # a partial sum under tp
            if k in (0, 3):  # reduced before the view
                r = funcol.wait_tensor(funcol.all_reduce(y, "sum", group)).view(4, 4, D)
            else:
                r = funcol.wait_tensor(funcol.all_reduce(y.view(4, 4, D), "sum", group))
            with _in_module(f"model.layers.{k}"):
                x = x + torch.tanh(r) * 0.5 - r.mean(dim=-1, keepdim=True)
        with _in_module("model.head"):
            return (x.sum(),)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, 4, D, generator=g)] + [torch.randn(D, D, generator=g) / D
                                                   for _ in range(4)]
    with fx_traceback.preserve_node_meta():
        gm = compat.make_fx(f)(*args)
    expected = gm(*args)
    done = outline.outline_repeats(gm)
    assert [len(layers) for layers, _ in done.bodies.values()] == [4]
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default
             and n.args[0].target is torch.ops._c10d_functional.wait_tensor.default]
    body = next(iter(_bodies(gm)))
    views += [n for n in getattr(gm, body).graph.nodes if n.target is torch.ops.aten.view.default
              and n.args[0].target is torch.ops._c10d_functional.wait_tensor.default]
    assert views  # the view follows the reduction
    assert torch.equal(gm(*args)[0], expected[0])


def test_a_layer_returning_a_view_of_its_input_stays_inline():
    """A body output that is a view of a body input (a batch slice kept for later) would let
    Inductor reuse the input's buffer after the call while the view still reads it (Mixtral on
    dp=2 x tp=2: gradients 82x off): such layers stay inline; the others are still shared."""
    def f(x, *ws):
        kept = []
        for k, w in enumerate(ws):
            with _in_module(f"model.layers.{k}"):
                h = torch.relu(x @ w) * 0.5
                h = h + torch.tanh(h) - h.mean(dim=-1, keepdim=True)
                if k < 3:
                    kept.append(x[1:])  # a view of the layer's input, used outside it
                x = x + h
        with _in_module("model.head"):
            return (x.sum(), *[v * 1.0 for v in kept])

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, D, generator=g)] + [torch.randn(D, D, generator=g) / D
                                              for _ in range(5)]
    with fx_traceback.preserve_node_meta():
        gm = compat.make_fx(f, tracing_mode="fake")(*args)
    done = outline.outline_repeats(gm)
    layers = sorted(k for called, _ in done.bodies.values() for _, k in called)
    assert layers == [3, 4], done  # layers 0-2 return a view of their input
