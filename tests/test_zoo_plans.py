"""Every zoo architecture's plan against its textbook plan (Megatron on tp, FSDP on dp), planned
and lowered on a ``fake`` process group (no training: ``tests/test_zoo.py`` trains a subset).
A cell that moves more collectives on a mesh axis and phase than the textbook plan fails."""

import pytest
import torch

from dynamo_dist import compile_records
from dynamo_dist.plans import shard_module
from dynamo_dist.plans.dataflow import example_inputs, trace_projections
from dynamo_dist.testing.zoo.cell import parse_mesh, plan_model
from dynamo_dist.testing.zoo.expect import compare, textbook
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
