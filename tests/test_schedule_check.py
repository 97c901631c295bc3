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


def _entry(shapes, group):
    return {"kind": "all_gather_into_tensor", "args": [2, "group(size=2, strides=[2])"],
            "shapes": shapes, "dtype": "torch.int64", "group": group, "at": "x.py:1"}


def test_pieces_of_different_sizes_in_different_groups_are_one_schedule():
    """tp=2 splits 15 columns 8 + 7; a gather on dp then runs on [2, 8] in the group of ranks
    0 and 2 and on [2, 7] in that of ranks 1 and 3: the same schedule (it was reported as a
    divergence, failing T5 on dp=2 x tp=2 under torch 2.11). Two ranks of ONE group holding
    different sizes still clash."""
    from dynamo_dist.divergence import _key, _shape_clash

    even = {0: [_entry([[2, 8]], [0, 2])], 1: [_entry([[2, 7]], [1, 3])],
            2: [_entry([[2, 8]], [0, 2])], 3: [_entry([[2, 7]], [1, 3])]}
    assert len({_key(s[0]) for s in even.values()}) == 1
    assert _shape_clash(even) is None
    clash = dict(even)
    clash[2] = [_entry([[2, 7]], [0, 2])]
    assert _shape_clash(clash) == (0, [0, 2])
    # a schedule recorded without groups is compared across every rank
    flat = {r: [_entry(s[0]["shapes"], None)] for r, s in even.items()}
    assert _shape_clash(flat) == (0, [0, 1, 2, 3])
