"""Compiled autograd with backend="dist": the backward graph (AOT backward, module full-backward
hooks, tensor hooks, post-accumulate-grad hooks, user collectives) is compiled by the dist
backend, and gradients equal eager. The 2-rank DDP comparison is tests/mp/compiled_autograd_ddp.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch._dynamo import compiled_autograd

from dynamo_dist.compiled_autograd import backward_records, clear_backward_records


class MLP(torch.nn.Module):
    def __init__(self, tensor_hook: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 4)
        self.tensor_hook = tensor_hook

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.tensor_hook:  # a hook on an intermediate, registered inside the compiled region
            h.register_hook(lambda g: g * 0.25)
        return self.b(h)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    clear_backward_records()
    yield
    clear_backward_records()
    torch._dynamo.reset()


def _data(steps=2):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=gen) for _ in range(steps)]


def _run(model, xs, compiled: bool, options=None):
    """Forward + backward per batch (gradients accumulate); returns the gradients after each.

    Compiled: forward and compiled-autograd backward both fullgraph with backend="dist"; the
    forward runs inside the compiled-autograd context too (Dynamo routes module backward hooks
    to compiled autograd only when it is on while the forward is traced)."""
    fwd = torch.compile(model, backend="dist", fullgraph=True, options=options) \
        if compiled else model
    grads = []
    for x in xs:
        ctx = compiled_autograd._enable(torch.compile(backend="dist", fullgraph=True,
                                                      options=options)) \
            if compiled else contextlib.nullcontext()
        with ctx:
            loss = fwd(x).pow(2).sum()
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _assert_same(got, want):
    assert len(got) == len(want)
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _phases():
    return [r.phase for r in backward_records()]


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_module_full_backward_hooks(kind):
    """A submodule's full backward (pre-)hook that rescales the gradient and records what it
    saw: fullgraph forward and fullgraph compiled-autograd backward, both by the dist backend.
    The forward graph carries Dynamo's BackwardState (how it routes module hooks to compiled
    autograd), which the backend compiles as one device instead of planning it."""
    torch.manual_seed(0)
    eager = MLP()
    comp = copy.deepcopy(eager)
    seen = {id(eager): [], id(comp): []}
    for m in (eager, comp):
        log = seen[id(m)]
        if kind == "full":
            def hook(mod, grad_input, grad_output, log=log):
                log.append(grad_output[0].detach().clone())
                return (grad_input[0] * 3.0,)

            m.b.register_full_backward_hook(hook)
        else:
            def hook(mod, grad_output, log=log):
                log.append(grad_output[0].detach().clone())
                return (grad_output[0] * -2.0,)

            m.b.register_full_backward_pre_hook(hook)
    xs = _data()
    _assert_same(_run(comp, xs, compiled=True), _run(eager, xs, compiled=False))
    assert len(seen[id(comp)]) == len(seen[id(eager)]) == len(xs)
    for g, w in zip(seen[id(comp)], seen[id(eager)]):
        torch.testing.assert_close(g, w)
    # one forward graph (with the BackwardState) and one backward graph per grad state
    # (p.grad None at step 1, accumulated at step 2), all compiled by the dist backend
    assert _phases() == ["forward", "backward", "backward"], _phases()
    assert all(r.inductor and r.compiled_autograd_id is not None
               for r in backward_records() if r.phase == "backward")


def test_tensor_and_post_accumulate_grad_hooks():
    """Parameter ``register_hook`` (scales the gradient), a hook on an intermediate registered
    inside the compiled forward, and ``register_post_accumulate_grad_hook`` (in-place update of
    p.grad, and a record of the norm): equal to eager over two accumulating steps."""
    torch.manual_seed(0)
    eager = MLP(tensor_hook=True)
    comp = copy.deepcopy(eager)
    norms = {id(eager): [], id(comp): []}
    for m in (eager, comp):
        m.a.weight.register_hook(lambda g: g * 2.0)
        log = norms[id(m)]

        def post(p, log=log):
            p.grad.mul_(0.5)
            log.append(p.grad.norm().detach())

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(post)
    xs = _data()
    _assert_same(_run(comp, xs, compiled=True), _run(eager, xs, compiled=False))
    assert len(norms[id(comp)]) == len(norms[id(eager)]) == 4 * len(xs)
    torch.testing.assert_close(sorted(norms[id(comp)]), sorted(norms[id(eager)]))
    assert _phases().count("backward") == 2 and "forward" in _phases(), _phases()


def test_config_flag_compiles_backward_in_a_compiled_step():
    """``torch._dynamo.config.compiled_autograd = True`` (read when ``torch.compile`` wraps the
    step) and ``loss.backward()`` inside the step compiled with backend="dist" (Dynamo breaks
    the graph at backward): the backward graph, hooks included, goes to the dist backend."""
    torch.manual_seed(0)
    eager = MLP()
    comp = copy.deepcopy(eager)

    def triple(p):
        p.grad.mul_(3.0)

    for m in (eager, comp):
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(triple)
    xs = _data(2)
    want = _run(eager, xs, compiled=False)

    with torch._dynamo.config.patch(compiled_autograd=True):
        @torch.compile(backend="dist")
        def step(x):
            loss = comp(x).pow(2).sum()
            loss.backward()
            return loss

        got = []
        for x in xs:
            step(x)
            got.append([p.grad.clone() for p in comp.parameters()])
    _assert_same(got, want)
    assert _phases() == ["backward", "backward"], _phases()


@pytest.mark.parametrize("inductor", [True, False])
def test_backend_compiles_hook_collectives(fake_mesh, inductor):
    """A DDP-style post-accumulate-grad hook (funcol all_reduce over the dp axis, then divide):
    the compiled-autograd graph the dist backend received holds one all_reduce per parameter,
    they are kept in the compiled program (Inductor's output code runs them), and the record's
    ledger names the dp axis, the bytes and the hook's source line. The fake process group
    returns the input of a collective, so eager with the same hook is the reference."""
    from torch._inductor.utils import run_and_get_code

    mesh = fake_mesh((2,), ("dp",))
    group = mesh.get_group("dp")
    torch.manual_seed(0)
    eager = MLP()
    comp = copy.deepcopy(eager)

    def allreduce_hook(p):
        p.grad = funcol.all_reduce(p.grad, "sum", group) / 2  # HOOK LINE

    for m in (eager, comp):
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(allreduce_hook)
    xs = _data(1)
    want = _run(eager, xs, compiled=False)
    options = None if inductor else {"inductor": False}
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, codes = run_and_get_code(lambda: _run(comp, xs, compiled=True, options=options))
    _assert_same(got, want)

    backward = [r for r in backward_records() if r.phase == "backward"]
    assert len(backward) == 1 and backward[0].inductor == inductor
    rec = backward[0]
    params = list(comp.parameters())
    assert [c.kind for c in rec.collectives] == ["all_reduce"] * len(params)
    assert {c.group for c in rec.collectives} == {group.group_name}
    assert sorted(c.bytes for c in rec.collectives) == sorted(p.numel() * 4 for p in params)
    assert all(c.source and "HOOK LINE" in c.source and __file__ in c.source
               for c in rec.collectives), [c.source for c in rec.collectives]
    ledger = rec.ledger(mesh)
    assert ledger.summary() == {("backward", "all_reduce", "dp"):
                                (len(params), sum(p.numel() * 4 for p in params))}
    wait = torch.ops._c10d_functional.wait_tensor
    assert len(rec.graph_module.graph.find_nodes(op="call_function", target=wait)) == len(params)
    if inductor:  # the backward's Inductor code issues the collectives itself
        bw_code = [c for c in codes if "all_reduce" in c]
        assert len(bw_code) == 1, len(codes)
        assert bw_code[0].count("torch.ops._c10d_functional.all_reduce_.default(") == len(params)
    else:
        assert not any("all_reduce" in c for c in codes)


def test_sharded_program_under_compiled_autograd_is_refused(fake_mesh):
    """A DTensor program with a module backward hook under compiled autograd: the forward graph
    holds both a DTensor and Dynamo's BackwardState; the backend says it does not support it
    rather than failing inside capture."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from dynamo_dist import DistCompileError

    mesh = fake_mesh((2,), ("dp",))
    m = MLP()
    for mod in (m.a, m.b):
        for name, p in list(mod.named_parameters()):
            setattr(mod, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                                    [Replicate()])))
    m.b.register_full_backward_hook(lambda mod, gi, go: None)
    x = distribute_tensor(torch.randn(5, 6), mesh, [Replicate()])
    with compiled_autograd._enable(torch.compile(backend="dist")):
        with pytest.raises(Exception) as err:
            torch.compile(m, backend="dist", fullgraph=True)(x)
    assert isinstance(err.value, DistCompileError) or \
        isinstance(getattr(err.value, "inner_exception", None), DistCompileError), err.value
    assert "compiled autograd" in str(err.value)


def test_two_rank_user_allreduce_hook_matches_ddp():
    """2 gloo ranks: a post-accumulate-grad hook all-reduces each gradient over the dp axis
    (funcol, then / world size); forward and compiled-autograd backward compiled fullgraph with
    backend="dist"; 3 SGD steps: gradients equal torch DDP's (1e-5) every step, the backward
    graph the backend compiled holds one all_reduce per parameter, Inductor issues them."""
    import re

    from conftest import torchrun

    out = torchrun("compiled_autograd_ddp.py", 2, timeout=300).stdout
    m = re.search(r"CA DDP OK max grad diff ([0-9.e+-]+); backward graphs compiled by dist: "
                  r"(\d+); all_reduce in the backward graph: (\d+) for (\d+) parameters", out)
    assert m, out
    assert float(m.group(1)) <= 1e-5 and int(m.group(2)) >= 1, out
    assert int(m.group(3)) == int(m.group(4)) == 6, out


def test_backward_inside_a_compiled_step_does_not_deadlock():
    """``loss.backward()`` inside a function compiled with dist: AOTAutograd compiles the
    backward lazily and fires Dynamo's compile-start callbacks while Dynamo's frame hook is
    active; ours must not be compiled by it (it deadlocked on Dynamo's callback lock). Run in a
    subprocess so a regression fails by timeout instead of hanging the suite."""
    import subprocess
    import sys

    code = ("import torch, dynamo_dist\n"
            "m = torch.nn.Linear(4, 2)\n"
            "@torch.compile(backend='dist')\n"
            "def step(x):\n"
            "    loss = m(x).sum()\n"
            "    loss.backward()\n"
            "    return loss\n"
            "step(torch.randn(3, 4))\n"
            "print('OK', tuple(m.weight.grad.shape))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and "OK (2, 4)" in proc.stdout, proc.stderr[-3000:]
