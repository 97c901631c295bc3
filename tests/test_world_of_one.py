"""A mesh of one rank (a real gloo process group in this process): the sharded program must be
the single-device program, with no collective and no per-parameter DTensor autograd hop at the
boundary (both were per-step overhead: on an H200, 26 ms a step where plain Inductor took 8 at
8 layers of the demo Llama)."""

import copy
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor

from conftest import SmallMLP
from dynamo_dist import compile_records
from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
from inductor_passes.core.collectives import collective_kind


def _autograd_nodes(root) -> list[str]:
    seen, todo, names = set(), [root], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("names", [("tp",), ("dp", "tp")])
def test_a_world_of_one_is_one_device_with_no_collective(mesh_of_one, names):
    mesh = mesh_of_one(names)
    torch.manual_seed(0)
    ref = SmallMLP()
    model = copy.deepcopy(ref)
    plan = TensorParallelPlanner(axis="tp").build_plan(model)
    if "dp" in names:
        plan = DataParallelPlanner(axis="dp", mesh_axis_size=1).build_plan(model, plan)
    shard_module(model, mesh, plan)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    x = torch.randn(8, 16)
    for step in range(2):  # the second call accumulates into the DTensor gradients
        loss = compiled(x)
        nodes = _autograd_nodes(loss.grad_fn)
        assert "_ToTorchTensorBackward" not in nodes, nodes  # parameters went in as they are
        loss.backward()
        ref(x).backward()
    joint = compile_records()[-1].step.joint
    assert not [n for g in (joint.fw_graph, joint.bw_graph) for n in g.graph.nodes
                if collective_kind(n)]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        assert p.grad.shape == q.grad.shape and p.grad.stride() == p.grad.to_local().stride()
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)


class _Deep(torch.nn.Module):
    def __init__(self, width: int = 256, depth: int = 6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _freed_before_backward_returns(compiled, x) -> int:
    """How many of the compiled function's saved activations are freed while its backward
    runs (a weakref finalizer fires before the node's post-hook), of one step."""
    events: list[str] = []
    loss = compiled(x)
    node = loss.grad_fn
    while type(node).__name__ != "_DistFunctionBackward":
        node = next(f for f, _ in node.next_functions if f is not None)
    for t in node.saved_tensors:
        weakref.finalize(t, events.append, "freed")
    node.register_hook(lambda *_: events.append("end"))
    del t
    loss.backward()
    return events.index("end") if "end" in events else -1


def test_the_backward_frees_each_saved_activation_after_its_last_use(mesh_of_one, monkeypatch):
    """The compiled backward drops each saved activation after its last use, as AOTAutograd's
    does: autograd's own references go first (``compat.release_saved_tensors``); before, every
    layer's activations lived until the backward returned."""
    from inductor_passes.core import compat

    mesh = mesh_of_one(("tp",))
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    freed = []
    for release in (True, False):
        if not release:
            monkeypatch.setattr(compat, "release_saved_tensors", lambda ctx: None)
        model = _Deep(width=32)
        shard_module(model, mesh, TensorParallelPlanner(axis="tp").build_plan(model))
        compiled = torch.compile(model, backend="dist")
        compiled(x).backward()
        freed.append(_freed_before_backward_returns(compiled, x))
        torch._dynamo.reset()
    assert freed[0] >= 5 and freed[1] == 0, freed  # one activation a layer, the last kept


def test_a_retained_graph_runs_its_backward_twice(mesh_of_one):
    """``backward(retain_graph=True)`` keeps the saved activations (autograd's references are
    released only when the graph is not kept), so a second backward adds the same gradients."""
    mesh = mesh_of_one(("tp",))
    torch.manual_seed(0)
    # another width than the test above: compiling the same shapes again after the process
    # group is destroyed and made anew meets the old group's mesh (a known gap: design notes)
    ref = _Deep(width=24)
    model = copy.deepcopy(ref)
    shard_module(model, mesh, TensorParallelPlanner(axis="tp").build_plan(model))
    x = torch.randn(16, 24)
    loss = torch.compile(model, backend="dist")(x)
    loss.backward(retain_graph=True)
    loss.backward()
    want = ref(x)
    want.backward(retain_graph=True)
    want.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
