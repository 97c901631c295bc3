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
