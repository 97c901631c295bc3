"""The model zoo's CI subset: real architectures with their default configs (ties, dropout,
caches as shipped) trained on simulated ranks, each against one process and against its
textbook collective plan (Megatron on tp, FSDP on dp). The whole matrix runs outside CI:
``python -m dynamo_dist.testing.zoo`` (docs/model_coverage.md)."""

import pytest
import torch
import torch.distributed as dist

from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell
from dynamo_dist.testing.zoo.models import MODELS

CELLS = [("gpt2", "tp=2"), ("gpt2", "dp=2,tp=2"), ("bert", "tp=2"), ("bert", "dp=2"),
         ("mixtral", "tp=2"), ("convnet", "dp=2")]


@pytest.fixture
def zoo_cell():
    yield lambda model, mesh: run_cell(MODELS[model], mesh, SimRuntime(), steps=2)
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()


@pytest.mark.parametrize("model,mesh", CELLS, ids=[f"{m}-{x}" for m, x in CELLS])
def test_zoo_cell_trains_like_one_process_with_the_textbook_collectives(zoo_cell, model, mesh):
    row = zoo_cell(model, mesh)
    assert row["status"] == "parity", (row.get("error"), row.get("trace"), row.get("grad_worst"))
    assert row["loss_rel"] <= 1e-5 and row["grad_rel"] <= 1e-4
    assert row["ties_kept"]
    more = [t for t in row["textbook"] if t["verdict"] == "MORE"]
    assert not more, more
    assert not row["fallbacks"], row["fallbacks"]
    assert not row["ledger_without_user_line"], row["ledger_without_user_line"]
    # every parameter a planner left replicated says why
    assert all(r["reason"] for r in row["params"]["replicated"])
