"""RNG semantics: random draws run replicated (every rank draws the GLOBAL tensor), so with the
same seed on every rank a sharded program draws the same numbers as one device."""

import torch
from torch.distributed.tensor import Shard, distribute_tensor

from dynamo_dist import compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd
from inductor_passes.sharding.rules import RuleKind


def test_dropout_on_a_sharded_input_matches_one_device(fake_mesh):
    mesh = fake_mesh((4,), ("x",))
    x = torch.randn(8, 6)

    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3

    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(x, mesh, [Shard(0)]))
    record = compile_records()[-1]
    assert not record.plan.fallbacks
    assert any(n.kind is RuleKind.RANDOM for n in record.plan.nodes.values())
    torch.manual_seed(7)
    (got,), _ = run_spmd(record, [x], None, mesh)  # each rank seeded alike
    torch.manual_seed(7)
    want = f(x)
    torch.testing.assert_close(got, want)
    assert (got == 0).any() and (got != 0).any()


class _CpuStandInTracker:
    """What a CUDA mesh gets from DTensor: an ``OffsetBasedRNGTracker`` whose random ops run in
    ``_distribute_region`` on the device's real generator state. DTensor builds none for CPU,
    so this one is made without its constructor, over the CPU generator."""

    def __new__(cls):
        import types

        from torch.distributed.tensor._random import OffsetBasedRNGTracker

        tracker = object.__new__(OffsetBasedRNGTracker)
        tracker._device = torch.device("cpu")
        tracker._device_handle = types.SimpleNamespace(
            get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state)
        tracker._use_distribute_region = True
        return tracker


def test_dtensor_rng_tracker_stays_out_of_dist_tracing(fake_mesh, monkeypatch):
    """DTensor's RNG tracker reads the real generator state; under Dynamo's fake tensors that
    failed (torch 2.11 on a GPU: every model with dropout). While tracing for dist the random
    op runs as a plain op, and the tracker is untouched and still on for eager DTensor."""
    import torch.distributed.tensor._random as dtensor_random

    mesh = fake_mesh((2,), ("x",))
    tracker = _CpuStandInTracker()
    monkeypatch.setattr(dtensor_random, "_rng_tracker", tracker)
    x = torch.randn(8, 6)

    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3

    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(x, mesh, [Shard(0)]))
    assert any(n.kind is RuleKind.RANDOM for n in compile_records()[-1].plan.nodes.values())
    assert tracker.distribute_region_enabled  # outside tracing it reads as it is
    from dynamo_dist import patches

    prop = type(tracker).distribute_region_enabled
    assert patches.install_plain_random_while_tracing()  # idempotent: not wrapped again
    assert type(tracker).distribute_region_enabled is prop


def test_simulated_calls_draw_one_after_another_as_one_device(fake_mesh):
    """A program run on simulated ranks advances each rank's generator as its draws do
    (LocalTensorMode keeps one state per rank): called twice, it draws the second call's
    numbers after the first's, as one device does. It used to leave the states where they
    were, so a model compiled block by block drew the same dropout masks in every block."""
    from torch.distributed._local_tensor import LocalTensorMode

    from dynamo_dist.testing.zoo.cell import SimRuntime, global_value

    rt = SimRuntime()
    mesh = rt.setup({"dp": 2})
    x = torch.randn(8, 6)

    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3

    compiled = torch.compile(f, backend="dist", fullgraph=True, options=rt.options())
    torch.manual_seed(7)
    with rt.eager():
        sharded = distribute_tensor(x, mesh, [Shard(0)])
        got = [compiled(sharded) for _ in range(2)]
        got = [g.full_tensor() for g in got]
    torch.manual_seed(7)
    want = [f(x) for _ in range(2)]
    for g, w in zip(got, want):
        torch.testing.assert_close(global_value(g, rt), w)
    assert not torch.equal(want[0], want[1])
    assert isinstance(rt.eager(), LocalTensorMode)
