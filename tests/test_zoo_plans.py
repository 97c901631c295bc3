"""Every zoo architecture's plan against its textbook plan (Megatron on tp, FSDP on dp), planned
and lowered on a ``fake`` process group (no training: ``tests/test_zoo.py`` trains a subset).
A cell that moves more collectives on a mesh axis and phase than the textbook plan fails."""

import pytest
import torch

from dynamo_dist import compile_records
from dynamo_dist.plans import shard_module
from dynamo_dist.plans.dataflow import example_inputs, trace_projections
from dynamo_dist.testing.zoo.cell import parse_mesh, plan_model
from dynamo_dist.testing.zoo.expect import Expected, compare, data_parallel_shortfall, textbook
from dynamo_dist.testing.zoo.models import MODELS, loss_of

CELLS = [(name, "tp=2") for name in MODELS] + [
    (name, "dp=2") for name in ("llama", "bert", "t5", "vit", "convnet")]


@pytest.mark.parametrize("model,mesh", CELLS, ids=[f"{m}-{x}" for m, x in CELLS])
def test_plan_moves_no_more_than_the_textbook(fake_mesh, model, mesh):
    axes = parse_mesh(mesh)
    device_mesh = fake_mesh(tuple(axes.values()), tuple(axes))
    zm = MODELS[model]
    net = zm.build()
    plan = plan_model(net, axes)
    projections = None
    if "tp" in axes:
        projections = trace_projections(net, *(example_inputs(net) or zm.batch(0))).projections
    expected = textbook(net, plan, axes, projections)
    shard_module(net, device_mesh, plan)
    compiled = torch.compile(net, backend="dist", options={"inductor": False})
    args, kwargs = zm.batch(0)
    loss_of(compiled(*args, **kwargs)).backward()
    counts: dict = {}
    records = compile_records()
    for rec in records:
        for e in rec.ledger.entries:
            key = (e.mesh_axis, e.phase, e.kind)
            counts[key] = counts.get(key, 0) + 1
    rows = compare(expected, counts)
    assert not [r for r in rows if r["verdict"] == "MORE"], rows
    assert data_parallel_shortfall(rows) is None, rows
    assert not [f for rec in records for f in rec.plan.fallbacks]


EMB, HEAD = {"shard_embedding": True}, {"shard_embedding": True, "shard_output_head": True}


@pytest.mark.parametrize("model,options", [("llama", EMB), ("gpt2", EMB), ("gpt2", HEAD)],
                         ids=["llama", "gpt2", "gpt2-tied-head"])
def test_vocabulary_parallel_embeddings_train_at_parity(model, options):
    """``TensorParallelPlanner(shard_embedding=True)``: every embedding table not tied to the
    output head is split over its vocabulary (Llama's tokens; GPT-2's positions), two AdamW
    steps train like one process on simulated ranks, and the step moves exactly Megatron's
    collectives plus one forward all_reduce of looked-up rows (GPT-2 adds its two lookups'
    partial sums first: one). With ``shard_output_head`` too, GPT-2's token table, tied to the
    head, is split with it and looked up in place: the one gather left is of the logits, for
    the loss (before the vocabulary-parallel embedding rule the lowering moved the table)."""
    from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell

    row = run_cell(MODELS[model], "tp=2", SimRuntime(), steps=2, tp_options=options)
    assert row["status"] == "parity", row.get("error", row)
    assert not any("embedding table" in r["reason"] for r in row["params"]["replicated"]), \
        row["params"]
    coll = row["collectives"]
    rows = {(r["phase"], r["kind"]): r for r in row["textbook"]}
    assert rows["forward", "all_reduce"]["verdict"] == "=", row["textbook"]
    assert rows["backward", "all_reduce"]["verdict"] == "=", row["textbook"]
    if options is HEAD:
        assert coll["tp forward all_gather"][0] == 1, coll  # the logits, [4, 16, 256] fp32
        assert coll["tp forward all_gather"][1] == 4 * 16 * 256 * 4 // 2, coll
        del coll["tp forward all_gather"]
    assert set(coll) == {"tp forward all_reduce", "tp backward all_reduce"}, coll


def test_a_plan_that_reduces_few_gradients_on_dp_is_told_apart():
    """Per kind, a plan that reduces no gradient on dp reads "fewer" (as a cheaper stand-in
    does); ``data_parallel_shortfall`` flags fewer than half the textbook's gradient
    reductions there (the dp ranks computed on the whole batch: BLOOM on dp=2 x tp=2,
    2026-11-28), and the report says so."""
    from dynamo_dist.testing.zoo.report import _cell_text

    fsdp = [Expected("dp", "backward", "reduce_scatter", 85, True, "each gradient once"),
            Expected("dp", "backward", "all_reduce", 16, True, "replicated gradients")]
    lost = compare(fsdp, {("dp", "backward", "all_reduce"): 1})
    assert {r["verdict"] for r in lost} == {"fewer"}
    assert data_parallel_shortfall(lost) == (1, 101)
    row = {"status": "parity", "loss_rel": 0.0, "grad_rel": 0.0, "textbook": lost}
    assert "dp grads reduced 1/101" in _cell_text(row)
    # a small table's gradient all_reduced for its reduce_scatter is a stand-in, not a loss
    stand_in = compare(fsdp, {("dp", "backward", "reduce_scatter"): 84,
                              ("dp", "backward", "all_reduce"): 17})
    assert data_parallel_shortfall(stand_in) is None
    assert data_parallel_shortfall(compare(fsdp[:1], {})) == (0, 85)
    assert data_parallel_shortfall(compare([], {})) is None
