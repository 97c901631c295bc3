"""nested_compile_region calls must run each layer with its own tensors (``dynamo_dist.regions``):
torch 2.13's Dynamo stamps out a region marked on each layer separately with the first traced
layer's weights; the ``dist`` backend refuses that graph instead of training it."""

import copy
import types

import pytest
import torch
from torch.distributed.tensor import distribute_module

from inductor_passes.core.errors import DistCompileError

D = 8


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x, scale):
        return torch.relu(self.lin(x)) * scale


class _MarkedBlock(_Block):
    @torch.compiler.nested_compile_region  # marked once, on the class: reused right
    def forward(self, x, scale):
        return torch.relu(self.lin(x)) * scale


class _Stack(torch.nn.Module):
    """Four blocks; the parent hands each one its own parameter ``scale`` (a tensor every
    call reads that no layer holds)."""

    def __init__(self, block=_Block):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((D,), 0.5))
        self.layers = torch.nn.ModuleList(block() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.scale)
        return x.sum()


def _per_method(model):
    region = torch.compiler.nested_compile_region(_Block.forward)
    for layer in model.layers:
        layer.forward = types.MethodType(region, layer)


def _per_closure(model):
    for layer in model.layers:
        def forward(x, scale, layer=layer):
            return _Block.forward(layer, x, scale)
        layer.forward = torch.compiler.nested_compile_region(forward)


def _per_lambda(model):
    for layer in model.layers:
        bound = layer.forward
        layer.forward = torch.compiler.nested_compile_region(lambda x, s, f=bound: f(x, s))


PER_LAYER = {"method": _per_method, "closure": _per_closure, "lambda": _per_lambda}


def _models(block=_Block, mark=None, tie=False, mesh=None):
    """(reference, model): the model a copy, its parameters DTensors on ``mesh`` if given;
    ``tie``: every layer of both holds the first layer's weight."""
    torch.manual_seed(0)
    ref = _Stack(block)
    model = copy.deepcopy(ref)
    if mesh is not None:
        distribute_module(model, mesh)  # (makes a DTensor of each module's own parameters)
    for m in (ref, model) if tie else ():
        for layer in m.layers[1:]:
            layer.lin.weight = m.layers[0].lin.weight
    if mark is not None:
        mark(model)
    return ref, model


@pytest.mark.parametrize("mark", sorted(PER_LAYER))
def test_torch_reuses_a_region_marked_per_layer_with_one_layers_weights(mark):
    """The premise, on torch's own eager backend: the wrong numbers this module guards
    against (if this fails, torch fixed its reuse: the check then never fires)."""
    ref, model = _models(mark=PER_LAYER[mark])
    torch._dynamo.reset()
    x = torch.randn(4, D)
    wrong = torch.compile(model, backend="eager")(x)
    assert not torch.allclose(wrong, ref(x))


@pytest.mark.parametrize("mark", sorted(PER_LAYER))
def test_dist_refuses_a_region_marked_per_layer(mesh_of_one, mark):
    ref, model = _models(mark=PER_LAYER[mark], mesh=mesh_of_one(("tp",)))
    torch._dynamo.reset()
    with pytest.raises(Exception) as err:  # Dynamo wraps it: BackendCompilerFailed
        torch.compile(model, backend="dist", options={"inductor": False})(torch.randn(4, D))
    error = getattr(err.value, "inner_exception", err.value)
    assert isinstance(error, DistCompileError), err.value
    text = str(error)
    assert "layers.2" in text and "layers.1's 'lin.weight'" in text, text
    assert "test_regions.py" in text  # the user's line of the call
    assert "decorate _Block.forward with @torch.compiler.nested_compile_region" in text, text


@pytest.mark.parametrize("tie", [False, True], ids=["own weights", "tied weights"])
def test_a_region_marked_on_the_class_trains_each_layer_with_its_own_tensors(mesh_of_one, tie):
    """Marked on the class, with a parent's tensor passed to every call and (tied) every
    layer holding one weight: no error, and loss and gradients are one device's."""
    ref, model = _models(_MarkedBlock, tie=tie, mesh=mesh_of_one(("tp",)))
    assert len(list(model.parameters())) == len(list(ref.parameters())) == (6 if tie else 9)
    torch._dynamo.reset()
    x = torch.randn(4, D)
    loss = torch.compile(model, backend="dist", options={"inductor": False})(x)
    loss.backward()
    expected = ref(x)
    expected.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


# -- repeated layers traced once (``install_layer_regions``) --------------------------------

class _PlainBlock(_Block):
    def forward(self, x, scale):  # a function of its own: no other test marks it
        return torch.relu(self.lin(x)) * scale


class _NormBlock(_Block):
    """Updates buffers (BatchNorm's running statistics, in training) inside the region."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(D)

    def forward(self, x, scale):
        return torch.relu(self.norm(self.lin(x))) * scale


class _BreakingBlock(_Block):
    """Asks for a graph break: ``invoke_subgraph`` takes none, so the frame is traced again
    with every layer inline (and broken there)."""

    def forward(self, x, scale):
        y = torch.relu(self.lin(x))
        torch._dynamo.graph_break()
        return y * scale


def _inlined(records) -> int:
    """How many region calls the backend inlined (its log line), over ``records``."""
    import re

    found = [re.search(r"(\d+) nested_compile_region call", r.getMessage()) for r in records]
    return sum(int(m.group(1)) for m in found if m)


def _trains_like_one_device(mesh, block, caplog, steps=2):
    import logging

    ref, model = _models(block, mesh=mesh)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    with caplog.at_level(logging.INFO, logger="dynamo_dist"):
        for step in range(steps):
            x = torch.randn(4, D)
            loss = compiled(x)
            loss.backward()
            expected = ref(x)
            expected.backward()
            torch.testing.assert_close(loss.full_tensor(), expected, msg=f"step {step}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.full_tensor() if hasattr(b, "full_tensor") else b, c,
                                   msg=name)
    return ref, model


@pytest.mark.parametrize("block", [_PlainBlock, _NormBlock], ids=["linear", "batchnorm"])
def test_repeated_layers_are_traced_once_and_train_as_inline(mesh_of_one, caplog, block):
    """Loss, gradients and (BatchNorm) running statistics of two steps are one device's."""
    _trains_like_one_device(mesh_of_one(("tp",)), block, caplog)
    assert _inlined(caplog.records) >= 3  # Dynamo made the layers region calls
    assert not any("failed" in r.getMessage() for r in caplog.records)
    assert not hasattr(block.forward, "__marked_compile_region_max_reuse_entries__")


def test_layer_regions_off(mesh_of_one, caplog, monkeypatch):
    monkeypatch.setenv("DYNAMO_DIST_LAYER_REGIONS", "0")
    _trains_like_one_device(mesh_of_one(("tp",)), _PlainBlock, caplog)
    assert _inlined(caplog.records) == 0
    monkeypatch.setenv("DYNAMO_DIST_LAYER_REGIONS", "yes")
    from dynamo_dist import regions

    with pytest.raises(ValueError, match="DYNAMO_DIST_LAYER_REGIONS='yes'.*fix"):
        regions.enabled()


def test_a_layer_with_a_graph_break_is_traced_inline_after_a_warning(mesh_of_one, caplog):
    """Once per process: a later compile calls the refused class inline at once."""
    mesh = mesh_of_one(("tp",))
    _trains_like_one_device(mesh, _BreakingBlock, caplog)
    warned = [r.getMessage() for r in caplog.records if "tracing every layer inline" in
              r.getMessage()]
    assert len(warned) == 1 and "_BreakingBlock" in warned[0], warned
    assert "graph_break" in warned[0] or "graph break" in warned[0].lower(), warned
    assert _inlined(caplog.records) == 0
    caplog.clear()
    _trains_like_one_device(mesh, _BreakingBlock, caplog, steps=1)  # another model, compiled
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


def test_a_layer_with_a_hook_is_called_with_its_hook(mesh_of_one, caplog):
    """A region would skip a module's hooks: a hooked layer is called as usual, running its
    hook; the others are still regions."""
    ref, model = _models(_PlainBlock, mesh=mesh_of_one(("tp",)))
    model.layers[2].register_forward_hook(lambda mod, args, out: out * 2)
    ref.layers[2].register_forward_hook(lambda mod, args, out: out * 2)
    torch._dynamo.reset()
    import logging

    x = torch.randn(4, D)
    with caplog.at_level(logging.INFO, logger="dynamo_dist"):
        loss = torch.compile(model, backend="dist", options={"inductor": False})(x)
    torch.testing.assert_close(loss.full_tensor(), ref(x))
    assert _inlined(caplog.records) >= 2


def test_other_backends_trace_layers_inline():
    ref, model = _models(_PlainBlock)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(4, D))
    hop = torch.ops.higher_order.invoke_subgraph
    assert not seen[0].graph.find_nodes(op="call_function", target=hop)


def test_repeated_leaf_modules_are_traced_inline(mesh_of_one, caplog):
    """Only blocks (modules holding modules) become regions: a Sequential of Linear and ReLU
    pairs is traced inline, and trains as one device does."""
    import logging

    torch.manual_seed(0)
    ref = torch.nn.Sequential(*(m for _ in range(3) for m in (torch.nn.Linear(D, D),
                                                               torch.nn.ReLU())))
    model = copy.deepcopy(ref)
    distribute_module(model, mesh_of_one(("tp",)))
    torch._dynamo.reset()
    x = torch.randn(4, D)
    with caplog.at_level(logging.INFO, logger="dynamo_dist"):
        out = torch.compile(model, backend="dist", options={"inductor": False})(x)
    torch.testing.assert_close(out.full_tensor(), ref(x))
    assert _inlined(caplog.records) == 0


def _compiled_on_one(cls, mesh, caplog, *inputs):
    """(reference, model, the model's loss): ``cls()`` and a copy of it with DTensor
    parameters on ``mesh``, the copy compiled for ``dist`` without Inductor and called on
    ``inputs``, its log kept in ``caplog``."""
    import logging

    torch.manual_seed(0)
    ref = cls()
    model = copy.deepcopy(ref)
    distribute_module(model, mesh)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="dynamo_dist"):
        loss = torch.compile(model, backend="dist", options={"inductor": False})(*inputs)
    return ref, model, loss


class _KwBlock(_Block):
    """Called as transformers calls a decoder layer: keyword arguments, a tuple of tensors
    (the rotary ``(cos, sin)``), a None and a number."""

    def forward(self, x, pair=None, mask=None, scale=1.0):
        a, b = pair
        y = torch.relu(self.lin(x)) * a + b
        return y * scale if mask is None else y * mask


class _KwStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((D,), 0.5))
        self.b = torch.nn.Parameter(torch.full((D,), 0.25))
        self.layers = torch.nn.ModuleList(_KwBlock() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, pair=(self.a, self.b), mask=None, scale=0.5)
        return x.sum()


def test_region_arguments_are_fingerprinted_in_python_as_dynamo_does(mesh_of_one, caplog,
                                                                       monkeypatch):
    """The reuse lookup's fingerprint of keyword and tuple arguments
    (``compat.fast_region_fingerprints``) equals the one Dynamo traces through pytree: the
    same spec, leaf kinds, sources, graph values and constants; and the layers are reused
    and train as one device does."""
    from torch._dynamo.variables import invoke_subgraph as isg

    from inductor_passes.core import compat

    installed = isg.build_fingerprint_with_pytree
    assert getattr(installed, "_dynamo_dist_patch", False)
    seen = []

    def spy(tx, args, kwargs):
        ours = compat._fingerprint_in_python(isg, args, kwargs)
        seen.append((ours, installed.__wrapped__(tx, args, kwargs)))
        return installed(tx, args, kwargs)

    monkeypatch.setattr(isg, "build_fingerprint_with_pytree", spy)
    x = torch.randn(4, D)
    ref, model, loss = _compiled_on_one(_KwStack, mesh_of_one(("tp",)), caplog, x)
    loss.backward()
    expected = ref(x)
    expected.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)
    assert _inlined(caplog.records) >= 3  # as with Dynamo's own fingerprints
    assert len(seen) >= 3, "the later layers were not looked up for reuse"
    for ours, theirs in seen:
        assert ours is not None and not ours.has_unknown
        assert ours.treespec == theirs.treespec
        assert [t for t, _ in ours.flat_vts] == [t for t, _ in theirs.flat_vts]
        assert ours.arg_sources == theirs.arg_sources
        for (tag, a), (_, b) in zip(ours.flat_vts, theirs.flat_vts):
            if tag in (isg.InputTag.TENSOR, isg.InputTag.SYMNODE):
                assert a.as_proxy().node is b.as_proxy().node
            elif tag is isg.InputTag.CONSTANT:
                assert a.as_python_constant() == b.as_python_constant()


def test_a_transformers_model_compiled_directly_traces_its_layers_once(mesh_of_one, caplog,
                                                                        monkeypatch):
    """``torch.compile(hf_model)`` compiles transformers' wrapper frame
    (``wrapped_func(*args, **kwargs)``): its layers are found through ``args`` and made
    regions, looked up with the Python fingerprint, and the step is one device's."""
    import logging

    from torch._dynamo.variables import invoke_subgraph as isg

    from dynamo_dist import regions
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    # (a fresh process's state: a class refused by an earlier test in this worker is inline)
    monkeypatch.setattr(regions, "_REFUSED", set())
    size = LlamaSize(layers=3)
    ref = build_llama(size)
    model = copy.deepcopy(ref)
    distribute_module(model, mesh_of_one(("tp",)))
    torch._dynamo.reset()
    tokens = token_batch(size, 0)
    with caplog.at_level(logging.INFO, logger="dynamo_dist"):
        loss = torch.compile(model, backend="dist", options={"inductor": False})(
            tokens, labels=tokens).loss
    loss.backward()
    expected = ref(tokens, labels=tokens).loss
    expected.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    assert _inlined(caplog.records) == size.layers
    assert getattr(isg.build_fingerprint_with_pytree, "_dynamo_dist_patch", False)


def test_a_layer_handed_a_python_object_is_called_inline(mesh_of_one, caplog):
    """A call passing an object a region's reuse cannot compare (transformers' KV cache, which
    each layer updates in place) is traced inline, with no failed attempt: a region here made
    ``generate`` hand the backend a symbolic number, and its failure refused the layer class
    for the rest of the process."""
    from dynamo_dist import regions

    class Cache:
        def __init__(self):
            self.seen = []

    class Layer(_Block):
        def forward(self, x, cache=None):
            cache.seen.append(1)
            return torch.relu(self.lin(x))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(3))

        def forward(self, x, cache):
            for layer in self.layers:
                x = layer(x, cache=cache)
            return x.sum()

    x = torch.randn(4, D)
    ref, _, loss = _compiled_on_one(Stack, mesh_of_one(("tp",)), caplog, x, Cache())
    torch.testing.assert_close(loss.full_tensor(), ref(x, Cache()))
    assert _inlined(caplog.records) == 0
    assert not any("failed" in r.getMessage() for r in caplog.records)
    assert Layer not in regions._REFUSED
