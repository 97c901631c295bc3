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
