"""PlannerConfig (issue 16): every planner knob in one frozen, validated object that reaches the
planner through the backend's options (or the environment), changes what it prices, and keys
the plan cache."""

import dataclasses
import logging
import os

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from conftest import SmallMLP
from dynamo_dist import compile_records
from dynamo_dist.plans import ShardingPlan, shard_module
from inductor_passes.sharding.config import DEFAULT, ENV, PlanMethod, PlannerConfig
from inductor_passes.sharding.cost import redistribute_cost


def test_defaults_are_the_planner_s_former_constants():
    assert DEFAULT == PlannerConfig()
    assert DEFAULT.method is PlanMethod.ILP
    assert (DEFAULT.joint_max_vars, DEFAULT.axis_max_vars) == (200_000, 1_000_000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.greedy_rounds = 5


@pytest.mark.parametrize("bad", [
    {"method": "simplex"}, {"greedy_rounds": 0}, {"ilp_time_limit_s": 0.0},
    {"joint_max_vars": 1.5}, {"max_options": True}, {"latency_bytes": -1.0},
    {"param_gather_factor": "3"}, {"descent_rounds": -1},
])
def test_bad_settings_are_refused_naming_the_field(bad):
    (field,) = bad
    with pytest.raises(ValueError, match=f"PlannerConfig.{field}"):
        PlannerConfig(**bad)


def test_the_environment_overrides_defaults_and_bad_text_is_refused():
    cfg = PlannerConfig.from_env({ENV: "method=greedy, ilp_time_limit_s=5 ,joint_max_vars=10"})
    assert cfg == PlannerConfig(method=PlanMethod.GREEDY, ilp_time_limit_s=5.0, joint_max_vars=10)
    assert PlannerConfig.from_env({}) == DEFAULT
    for text in ("nonsense", "unknown_knob=1", "joint_max_vars=ten", "method=simplex"):
        with pytest.raises(ValueError, match=ENV if "=" not in text or "unknown" in text
                           or "ten" in text else "method"):
            PlannerConfig.from_env({ENV: text})


def test_cost_knobs_change_the_prices_they_name():
    shape, f32, mesh = (64, 64), torch.float32, (4,)
    free = PlannerConfig(latency_bytes=0.0)
    gather = redistribute_cost(shape, f32, (Shard(0),), (Replicate(),), mesh)
    assert gather - redistribute_cost(shape, f32, (Shard(0),), (Replicate(),), mesh,
                                      config=free) == DEFAULT.latency_bytes
    reduce = redistribute_cost(shape, f32, (Partial(),), (Replicate(),), mesh, config=free)
    assert reduce == pytest.approx(2 * 64 * 64 * 4 * 3 / 4)  # ring all_reduce volume
    reslice = redistribute_cost(shape, f32, (Replicate(),), (Shard(1),), mesh,
                                config=PlannerConfig(reslice_cost=7.0))
    assert reslice == 7.0


def _compile(fake_mesh, **options):
    torch._dynamo.reset()
    mesh = fake_mesh((2,), ("tp",))
    torch.manual_seed(0)
    model = SmallMLP()
    shard_module(model, mesh, ShardingPlan(plan={"fc1.weight": {"tp": Shard(0)},
                                                 "fc2.weight": {"tp": Shard(1)}}))
    torch.compile(model, backend="dist", options={"inductor": False, **options})(
        torch.randn(4, 16)).backward()
    return compile_records()[-1].plan


def test_the_backend_s_planner_option_reaches_the_planner(fake_mesh):
    ilp = _compile(fake_mesh)
    greedy = _compile(fake_mesh, planner=PlannerConfig(method="greedy"))
    origins = lambda plan: {n.origin.split(" (")[0] for n in plan.nodes.values()}  # noqa: E731
    assert "propagated" not in origins(ilp) and "propagated" in origins(greedy)
    assert any(o.startswith("solver") for o in origins(ilp))


def test_compile_records_time_each_stage_in_wall_and_cpu_seconds(fake_mesh):
    _compile(fake_mesh)
    rec = compile_records()[-1]
    assert set(rec.seconds) == set(rec.cpu_seconds) >= {"capture", "plan", "lower", "inductor"}
    assert all(v >= 0 for v in rec.cpu_seconds.values())


def test_the_environment_reaches_the_planner_when_no_option_is_given(fake_mesh, monkeypatch):
    monkeypatch.setenv(ENV, "method=greedy")
    plan = _compile(fake_mesh)
    assert any(n.origin == "propagated" for n in plan.nodes.values())


def test_a_bad_option_is_refused(fake_mesh):
    with pytest.raises(Exception, match="options\\['planner'\\] must be"):
        _compile(fake_mesh, planner={"method": "greedy"})
    with pytest.raises(Exception, match="unknown option"):
        _compile(fake_mesh, plannr=PlannerConfig())


def test_the_config_keys_the_plan_cache(fake_mesh, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DYNAMO_DIST_PLAN_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="dynamo_dist")
    _compile(fake_mesh)
    _compile(fake_mesh, planner=PlannerConfig(param_gather_factor=5.0))
    assert "plan read from the plan cache" not in caplog.text  # another config: another key
    entries = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".pkl")]
    assert len(entries) == 2
    _compile(fake_mesh, planner=PlannerConfig(param_gather_factor=5.0))
    assert "plan read from the plan cache" in caplog.text
