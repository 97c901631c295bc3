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
