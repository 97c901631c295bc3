"""``core.fresh_stack``: the sharding ILP's build runs at the bottom of a thread of its own, so its
speed does not depend on how deep inside ``torch.compile`` the planner was called (CPython
3.11's frame chunks: ``benchmarks/stack_depth.py``)."""

import threading
import traceback

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_passes.core import roles
from inductor_passes.core.fresh_stack import on_fresh_stack
from inductor_passes.sharding import solver
from inductor_passes.sharding.propagate import propagate


def _at_depth(depth, fn):
    return fn() if depth == 0 else _at_depth(depth - 1, fn)


def _frames() -> int:
    return len(traceback.extract_stack())


def test_runs_at_the_bottom_of_another_thread_and_returns_the_result():
    """Called under 400 frames, the function sees a handful (the thread's bootstrap), runs in
    another thread, and its result (with keyword arguments) comes back."""
    caller = threading.get_ident()

    def probe(a, *, b):
        return a + b, _frames(), threading.get_ident()

    deep = _at_depth(400, lambda: (_frames(), on_fresh_stack(probe, 2, b=3)))
    caller_frames, (total, frames, ident) = deep
    assert caller_frames > 400 and total == 5
    assert frames < 10 and ident != caller


def test_the_functions_exception_is_raised_in_the_caller():
    """The same exception object, with the raising frame in its traceback; BaseExceptions too."""
    err = ValueError("bad op")

    def fails():
        raise err

    with pytest.raises(ValueError) as info:
        on_fresh_stack(fails)
    assert info.value is err
    assert any(entry.name == "fails" for entry in info.traceback)
    with pytest.raises(KeyboardInterrupt):
        on_fresh_stack(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_the_planners_ilp_is_solved_on_a_fresh_stack(fake_mesh, monkeypatch):
    """The ILP goes through ``on_fresh_stack`` and plans what the direct call plans, from any
    caller depth (Megatron's pair: column- then row-parallel, one all_reduce)."""
    mesh = fake_mesh((2,), ("tp",))
    gm = make_fx(lambda x, w1, w2: (torch.relu(x @ w1) @ w2,), tracing_mode="fake")(
        torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16))
    for k, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        node.name = roles.primal_name(k)
    gm.recompile()
    placements = [(Replicate(),), (Shard(1),), (Shard(0),)]

    def plan():
        p = propagate(gm, mesh, placements, 1, [], [], lambda n: None, ())
        return {name: (n.inputs, n.output) for name, n in p.nodes.items()}, p.total_cost

    threads = []

    def spy(fn, *args, **kwargs):
        threads.append(fn.__name__)
        return on_fresh_stack(fn, *args, **kwargs)

    monkeypatch.setattr(solver, "on_fresh_stack", spy)
    shipped = _at_depth(300, plan)
    assert threads == ["_build_and_solve"]
    monkeypatch.setattr(solver, "on_fresh_stack", lambda fn, *a, **k: fn(*a, **k))
    assert plan() == shipped
