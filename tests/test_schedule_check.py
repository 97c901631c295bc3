"""The rank-divergence check compares the graphs as partitioned, before Inductor: a fresh Inductor
compile rewrites them in place (all_reduce -> all_reduce_, bucketing) and an FX-cache hit does
not, so a rank that compiled and a rank that hit the cache once looked divergent (a flaky 2-rank
failure)."""

import torch
from torch.distributed.tensor import Shard

from conftest import SmallMLP
from dynamo_dist import backend
from dynamo_dist.plans import ShardingPlan, shard_module


def test_schedule_checked_is_the_same_for_a_fresh_compile_and_a_cache_hit(
        fake_mesh, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    seen = []
    real = backend.check_same_schedule
    monkeypatch.setattr(backend, "check_same_schedule", lambda graphs, what: (
        seen.append([str(n.target) for g in graphs for n in g.graph.nodes
                     if "c10d" in str(n.target)]), real(graphs, what)))
    mesh = fake_mesh((2,), ("tp",))
    for _ in range(2):  # the first compile is fresh, the second hits Inductor's FX graph cache
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = SmallMLP()
        shard_module(model, mesh, ShardingPlan(plan={"fc1.weight": {"tp": Shard(0)},
                                                     "fc1.bias": {"tp": Shard(0)},
                                                     "fc2.weight": {"tp": Shard(1)}}))
        torch.compile(model, backend="dist")(torch.randn(4, 16)).backward()
    assert len(seen) == 2 and seen[0] == seen[1]
    assert "_c10d_functional.all_reduce.default" in seen[0]  # the functional form, as planned
