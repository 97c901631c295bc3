"""The on-disk plan cache: a recompile of the same program reads its plan instead of planning;
anything the planner reads changes the key."""

import logging
import os

import torch
from torch.distributed.tensor import Replicate, Shard

from conftest import SmallMLP
from dynamo_dist import compile_records, plan_cache
from dynamo_dist.plans import ShardingPlan, shard_module


def _plan(fake_mesh, fc1_weight):
    torch._dynamo.reset()
    mesh = fake_mesh((2,), ("tp",))
    torch.manual_seed(0)
    model = SmallMLP()
    shard_module(model, mesh, ShardingPlan(plan={"fc1.weight": {"tp": fc1_weight},
                                                 "fc2.weight": {"tp": Shard(1)}}))
    torch.compile(model, backend="dist", options={"inductor": False})(torch.randn(4, 16)).backward()
    return compile_records()[-1].plan


def _entries(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".pkl")]


def test_recompile_reads_the_plan_and_other_placements_miss(fake_mesh, monkeypatch, tmp_path,
                                                            caplog):
    monkeypatch.setenv("DYNAMO_DIST_PLAN_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="dynamo_dist")
    first = _plan(fake_mesh, Shard(0))
    assert len(_entries(tmp_path)) == 1 and "plan cache" not in caplog.text
    again = _plan(fake_mesh, Shard(0))
    assert "plan read from the plan cache" in caplog.text
    assert again.to_text() == first.to_text()
    other = _plan(fake_mesh, Replicate())  # another input placement: another key
    assert len(_entries(tmp_path)) == 2 and other.to_text() != first.to_text()


def test_a_broken_entry_is_planned_again(fake_mesh, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DYNAMO_DIST_PLAN_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="dynamo_dist")
    first = _plan(fake_mesh, Shard(0))
    (path,) = _entries(tmp_path)
    with open(path, "wb") as f:
        f.write(b"not a pickle")
    again = _plan(fake_mesh, Shard(0))
    assert "unreadable" in caplog.text and again.to_text() == first.to_text()
    with open(path, "rb") as f:
        assert f.read() != b"not a pickle"  # rewritten


def test_cache_off_writes_nothing(fake_mesh, monkeypatch, tmp_path):
    monkeypatch.setenv("DYNAMO_DIST_PLAN_CACHE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _plan(fake_mesh, Shard(0))
    assert not _entries(tmp_path) and not plan_cache.enabled()


def test_editing_an_op_rule_changes_the_key(monkeypatch, tmp_path):
    """The rules live in a subpackage (sharding/rules/); a key blind to them answered an edited
    rule with the stale plan (the GQA attention fix was invisible until the cache was cleared).
    The bottom layer's custom ops (core/ops.py), which the rules read, count too."""
    import shutil

    import inductor_passes

    copy = tmp_path / "inductor_passes"
    shutil.copytree(os.path.dirname(inductor_passes.__file__), copy)
    monkeypatch.setattr(inductor_passes, "__file__", str(copy / "__init__.py"))
    plan_cache._planner_fingerprint.cache_clear()
    try:
        for edited in (copy / "sharding" / "rules" / "attention.py", copy / "core" / "ops.py"):
            before = plan_cache._planner_fingerprint()
            with open(edited, "a") as f:
                f.write("\n# edited\n")
            plan_cache._planner_fingerprint.cache_clear()
            assert plan_cache._planner_fingerprint() != before, edited
        before = plan_cache._planner_fingerprint()
        with open(copy / "comm.py", "a") as f:  # not the planner: same key
            f.write("\n# edited\n")
        plan_cache._planner_fingerprint.cache_clear()
        assert plan_cache._planner_fingerprint() == before
    finally:
        plan_cache._planner_fingerprint.cache_clear()
