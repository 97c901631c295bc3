"""Plans and ledgers for the demo's Llama traced on a `fake` process group (no communication):
the tensor-parallel forward must use exactly Megatron's collectives, 2 all_reduce per layer."""

import pytest
import torch

from dynamo_dist import compile_records
from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch
from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
from inductor_passes.sharding.rules import RuleKind

LAYERS = 2


def _compile_step(model, size):
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    ids = token_batch(size, 0)
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    return compile_records()


@pytest.mark.parametrize("attn,seq", [("eager", 32), ("sdpa", 128)])  # 128: the demo's
def test_tp_forward_matches_megatron_collectives(fake_mesh, attn, seq):
    mesh = fake_mesh((2,), ("tp",))
    size = LlamaSize(layers=LAYERS, seq=seq)
    model = build_llama(size, attn=attn)
    shard_module(model, mesh, TensorParallelPlanner().build_plan(model))
    records = _compile_step(model, size)
    assert len(records) == 1, "one graph, no graph break"
    ledger = records[0].ledger
    # torch's parallelize_module Megatron plan: one all_reduce of the hidden states after
    # attention and one after the MLP of each layer. Ours: exactly those and nothing else.
    fwd = [e for e in ledger.entries if e.phase == "forward"]
    assert [e.kind for e in fwd] == ["all_reduce"] * (2 * LAYERS)
    assert all(e.bytes == size.batch * size.seq * size.hidden * 4 for e in fwd)
    assert ledger.total_bytes(phase="forward") == sum(
        e.bytes for e in ledger.entries if e.phase == "forward")
    # backward: Megatron's two all_reduces of the hidden-state gradient per layer, nothing else
    bwd = [e for e in ledger.entries if e.phase == "backward"]
    assert [e.kind for e in bwd] == ["all_reduce"] * (2 * LAYERS)
    assert all(e.bytes == size.batch * size.seq * size.hidden * 4 for e in bwd)
    if attn == "sdpa":  # the fused CPU attention kernel, split over heads, forward and backward
        fused = [n for n in records[0].plan.nodes.values() if n.kind is RuleKind.ATTENTION]
        assert len(fused) == 2 * LAYERS
        assert all(str(n.inputs[0]) == "(Shard(dim=1),)" for n in fused), records[0].plan.to_text()
    # the compiled halves run each op once: the backward does not recompute the forward (it
    # did, collectives included, when the partitioner saw no forward tags)
    joint = records[0].step.joint

    def count(gm, word):
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and word in str(n.target))

    glob = records[0].program.graph_module
    assert count(joint.fw_graph, "aten.mm") + count(joint.bw_graph, "aten.mm") == \
        count(glob, "aten.mm")
    assert count(joint.bw_graph, "all_reduce") == len(bwd)
    assert count(joint.bw_graph, "flash_attention_for_cpu.default") == 0  # not recomputed
    assert count(joint.fw_graph, "all_reduce") == len(fwd)
    assert records[0].plan.nodes["output"].origin  # the plan is printable data
    assert "solver" in records[0].plan.to_text()
    assert not records[0].plan.fallbacks
    for p in model.parameters():
        assert p.grad is not None and p.grad.placements == p.placements


def test_tp_plan_finds_megatron_pairs():
    size = LlamaSize(layers=1)
    plan = TensorParallelPlanner().build_plan(build_llama(size))
    from torch.distributed.tensor.placement_types import Shard

    assert plan.placement_for("model.layers.0.self_attn.q_proj.weight") == {"tp": Shard(0)}
    assert plan.placement_for("model.layers.0.self_attn.o_proj.weight") == {"tp": Shard(1)}
    assert plan.placement_for("model.layers.0.mlp.up_proj.weight") == {"tp": Shard(0)}
    assert plan.placement_for("model.layers.0.mlp.down_proj.weight") == {"tp": Shard(1)}
    assert plan.placement_for("model.embed_tokens.weight") is None


def test_structural_tp_planner_without_known_names():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 64)
            self.b = torch.nn.Linear(16, 64)
            self.c = torch.nn.Linear(64, 16)

    plan = TensorParallelPlanner().build_plan(Block())
    from torch.distributed.tensor.placement_types import Shard

    assert plan.placement_for("a.weight") == {"tp": Shard(0)}
    assert plan.placement_for("b.bias") == {"tp": Shard(0)}
    assert plan.placement_for("c.weight") == {"tp": Shard(1)}


def test_fsdp_tp_plan_avoids_nested_dims(fake_mesh):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    size = LlamaSize(layers=1, seq=32)
    model = build_llama(size)
    plan = TensorParallelPlanner().build_plan(model)
    plan = DataParallelPlanner(mesh_axis_size=2).build_plan(model, plan)
    shard_module(model, mesh, plan)
    q = model.model.layers[0].self_attn.q_proj.weight
    o = model.model.layers[0].self_attn.o_proj.weight
    assert tuple(q.placements) == (torch.distributed.tensor.Shard(1), torch.distributed.tensor.Shard(0))
    assert tuple(o.placements) == (torch.distributed.tensor.Shard(0), torch.distributed.tensor.Shard(1))
    records = _compile_step(model, size)
    ledger = sum((r.ledger.entries for r in records), [])
    # data parallelism on dp (FSDP): the forward gathers parameters there and reduces nothing
    # but the 4-byte loss and the 8-byte count of valid labels it divides by; activations never
    # cross dp (the batch stays split; the label mask was gathered before the count could be a
    # pending integer sum); the backward re-gathers parameters and reduce-scatters every
    # gradient into its dp shard
    params = {tuple(p.to_local().shape) for p in model.parameters()}
    for e in ledger:
        if e.mesh_axis != "dp":
            continue
        if e.kind == "all_reduce":
            assert e.phase == "forward" and e.bytes in (4, 8), e
        else:
            assert e.kind in ("all_gather", "reduce_scatter"), e
    assert not any(r.activation_gathers("dp") for r in records)
    fwd_dp = [e for e in ledger if e.phase == "forward" and e.mesh_axis == "dp"]
    bwd_dp = [e for e in ledger if e.phase == "backward" and e.mesh_axis == "dp"]
    assert sum(e.kind == "all_gather" for e in fwd_dp) >= len(params)
    assert sum(e.kind == "reduce_scatter" for e in bwd_dp) >= len(params)
    # tensor parallelism on tp: exactly Megatron's all_reduces of the (dp-local) hidden states
    hidden = size.batch * size.seq * size.hidden * 4 // 2
    for phase in ("forward", "backward"):
        tp = [(e.kind, e.bytes) for e in ledger if e.phase == phase and e.mesh_axis == "tp"]
        assert tp == [("all_reduce", hidden)] * 2, (phase, tp)
    for p in model.parameters():
        assert p.grad.placements == p.placements



def test_no_more_collectives_than_torch_parallelize_module(fake_mesh):
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "torch_tp_counts.py"),
                           str(LAYERS), "32"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    torch_fw, torch_bw = sum(counts["forward"].values()), sum(counts["backward"].values())
    assert counts["forward"] == {"all_reduce": 2 * LAYERS}  # the stock plan is Megatron's

    mesh = fake_mesh((2,), ("tp",))
    size = LlamaSize(layers=LAYERS, seq=32)
    model = build_llama(size)
    shard_module(model, mesh, TensorParallelPlanner().build_plan(model))
    ledger = _compile_step(model, size)[0].ledger
    # ours: the same hidden-state all_reduces in the forward; fewer in total (the stock
    # backward has 2 * LAYERS + 2 more)
    assert ledger.count(phase="forward") == torch_fw
    assert ledger.count() < torch_fw + torch_bw
