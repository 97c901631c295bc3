"""A whole training step -- forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()`` --
in one compiled function is one planned program (Dynamo's ``trace_autograd_ops`` and
``patches.install_whole_step``), on simulated ranks against one process.

Each case checks the parameters after every one of 5 steps against eager one-process training,
that the step compiled to one program with its backward and update inside (the parameters and
optimizer state written back), and its collectives against the same model with the forward and
backward compiled alone (the update adds none: it runs on each rank's own shards)."""

import copy

import pytest
import torch
from test_training_loops import TinyLM, _ids

from dynamo_dist import compile_records
from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
from dynamo_dist.testing.zoo.cell import SimRuntime, global_value

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),                 # foreach (the default)
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
}
PLANNERS = {"tp": ({"tp": 2}, lambda: TensorParallelPlanner()),
            "fsdp": ({"dp": 2}, lambda: DataParallelPlanner(axis="dp"))}


def _setup(parallel: str, make_opt):
    from torch._dynamo.utils import counters

    counters.clear()
    rt, ref = SimRuntime(), TinyLM()
    axes, planner = PLANNERS[parallel]
    mesh = rt.setup(axes)
    model = copy.deepcopy(ref)
    plan = planner().build_plan(model, example_inputs=(_ids(4, 8, 0),))
    assert any(d.sharded for d in plan.decisions), plan.summary()
    with rt.eager():
        shard_module(model, mesh, plan)
        rt.localize(model)
        opt = make_opt(model.parameters())
    return rt, ref, model, opt, make_opt(ref.parameters())


def _graph_breaks() -> dict:
    from torch._dynamo.utils import counters

    return {k.split("\n")[0]: v for k, v in counters["graph_break"].items()}


def _train(rt, ref, model, opt, ref_opt, step, steps: int = 5) -> None:
    """``steps`` calls of ``step`` against eager one-process training: losses and every
    parameter after each step."""
    for k in range(steps):
        ids = _ids(4, 8, k)
        loss = step(ids)
        ref_opt.zero_grad()
        ref_loss = ref(ids)
        ref_loss.backward()
        ref_opt.step()
        assert global_value(loss, rt).item() == pytest.approx(ref_loss.item(), rel=1e-5), k
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(global_value(p, rt), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"step {k}: {name}")


def _forward_backward_collectives(parallel: str) -> list:
    """The ledger of the same model's forward and backward compiled alone (the step split)."""
    torch._dynamo.reset()
    rt, _, model, _, _ = _setup(parallel, OPTIMIZERS["sgd"])
    torch.compile(model, backend="dist", options=rt.options())(_ids(4, 8, 0))
    return sorted((e.phase, e.kind, e.mesh_axis) for e in compile_records()[-1].ledger.entries)


@pytest.mark.parametrize("parallel,opt_name,zero_grad", [
    ("tp", "adamw", "end"), ("tp", "adamw", "start"), ("tp", "adamw_loop", "end"),
    ("tp", "sgd", "end"), ("fsdp", "adamw", "end")])
def test_whole_step_is_one_program(fake_mesh, parallel, opt_name, zero_grad):
    """The step compiles to one program (``zero_grad()`` at the top of the step is Dynamo's one
    split, before any work), trains like one process, and issues exactly the collectives of
    its forward and backward: Megatron's two all_reduces on tp, FSDP's gathers and
    reduce-scatters on dp. It failed before: Dynamo split at ``backward()``, the optimizer's
    own graph breaks, and ``_init_group`` (8 graphs, 24 breaks on HF Llama)."""
    rt, ref, model, opt, ref_opt = _setup(parallel, OPTIMIZERS[opt_name])

    def train_step(ids):
        if zero_grad == "start":
            opt.zero_grad()
        loss = model(ids)
        loss.backward()
        opt.step()
        if zero_grad == "end":
            opt.zero_grad()
        return loss.detach()

    step = torch.compile(train_step, backend="dist", options=rt.options())
    _train(rt, ref, model, opt, ref_opt, step)
    records = compile_records()
    # SGD's first step creates its momentum buffers, which later steps read: a second program
    assert len(records) == (2 if opt_name == "sgd" else 1), [r.ledger.count() for r in records]
    breaks = _graph_breaks()
    assert set(breaks) <= ({"Attempted to inline function marked as skipped"}
                           if zero_grad == "start" else set()), breaks
    params = len(list(model.parameters()))
    alone = _forward_backward_collectives(parallel)
    for record in records:
        program = record.program
        assert len(program.mutated_inputs) >= params  # parameters (and state) updated in place
        assert not program.diff_outputs and not record.plan.fallbacks
        got = sorted((e.phase, e.kind, e.mesh_axis) for e in record.ledger.entries)
        assert got, "a sharded step communicates"
        # traced in, the backward is part of the forward program: compare kinds and axes only
        assert [g[1:] for g in got] == [w[1:] for w in alone]


def test_backward_that_would_miss_a_parameter_is_split_off(fake_mesh):
    """A step that reads ``opt.param_groups`` before its forward (a learning-rate log) makes
    Dynamo hold the parameters as constants; its traced ``backward()`` then had no leaf and was
    dropped: no gradient, parameters never updated, no error (caught here by the parity check
    before the fix). For dist that backward is a graph break with the reason and a fix:
    ``fullgraph=True`` shows it at trace time (the split step itself is Dynamo's usual one)."""
    rt, ref, model, opt, ref_opt = _setup("tp", OPTIMIZERS["adamw"])

    def train_step(ids):
        lrs = [g["lr"] for g in opt.param_groups]
        loss = model(ids) * (lrs[0] / 1e-2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = torch.compile(train_step, backend="dist", fullgraph=True, options=rt.options())
    with pytest.raises(torch._dynamo.exc.Unsupported, match="would miss a parameter"):
        step(_ids(4, 8, 0))


def test_other_backends_keep_dynamo_s_own_behaviour():
    """The patches act only while Dynamo traces for dist: under another backend the same step
    stops at ``backward()`` as torch 2.13 does (``trace_autograd_ops`` stays off)."""
    torch._dynamo.reset()
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(ids):
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    with pytest.raises(torch._dynamo.exc.Unsupported, match="backward"):
        torch.compile(train_step, backend="eager", fullgraph=True)(_ids(4, 8, 0))
    assert not torch._dynamo.config.trace_autograd_ops
    torch._dynamo.reset()


def test_capture_refuses_a_traced_backward_that_misses_a_leaf():
    """Capture's own check, under Dynamo's: a traced ``backward()`` (``autograd.grad`` with
    ``allow_unused`` from a ``.backward(`` line) must list every leaf the loss reaches, or it
    raises naming the missing leaf's shape; a user's own ``autograd.grad`` is left as asked."""
    import torch.fx as fx

    from dynamo_dist.capture import _check_backward_reaches_every_leaf
    from inductor_passes.core.errors import DistCompileError

    graph = fx.Graph()
    node = graph.call_function(torch.autograd.grad, ())
    node.meta["stack_trace"] = '  File "train.py", line 7, in step\n    loss.backward()\n'
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    loss = (a * b).sum()
    _check_backward_reaches_every_leaf(node, (loss, [a, b]), {"allow_unused": True})
    with pytest.raises(DistCompileError, match=r"\(2, 3\)"):
        _check_backward_reaches_every_leaf(node, (loss, [a]), {"allow_unused": True})
    _check_backward_reaches_every_leaf(node, (loss, [a]), {})  # the user's own autograd.grad


def test_split_step_never_frees_dtensor_caches_under_dtensor_s_dispatch(fake_mesh, monkeypatch):
    """A step Dynamo splits at ``loss.backward()`` (it returns ``loss``) runs the backward
    eagerly under Dynamo's frame hook. DTensor's C++ dispatch, on a sharding-cache miss, runs
    Python between taking a pointer to its thread's cache and inserting into it; Dynamo compiled
    frames there, and each compile's callbacks cleared DTensor's caches, freeing the map being
    written: SIGSEGV on real ranks in about 3 runs of 4. Here every real clear is recorded with
    whether DTensor's dispatch was on the stack: none may be, at least one happens (the
    callbacks still run), and the split step trains like one process."""
    import inspect

    import torch.distributed.tensor.debug as dtensor_debug

    clears = []
    real_clear = dtensor_debug._clear_fast_path_sharding_prop_cache

    def recording_clear():
        clears.append(any(f.filename.endswith(("tensor/_dispatch.py", "tensor\\_dispatch.py"))
                          for f in inspect.stack(context=0)))
        real_clear()

    monkeypatch.setattr(dtensor_debug, "_clear_fast_path_sharding_prop_cache", recording_clear)
    torch._dynamo.reset()
    rt, ref, model, opt, ref_opt = _setup("tp", OPTIMIZERS["adamw"])

    def train_step(ids):
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = torch.compile(train_step, backend="dist", options=rt.options())
    _train(rt, ref, model, opt, ref_opt, step, steps=2)
    assert clears and not any(clears), clears
