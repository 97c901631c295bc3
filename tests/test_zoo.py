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


def test_gradient_check_takes_rounding_noise_and_catches_a_wrong_zero_gradient():
    """A gradient that is zero in exact arithmetic (a convolution's bias before BatchNorm) is
    rounding noise on both sides: matched when ours stays within the floor of the largest
    gradient norm, flagged when ours is a real nonzero value."""
    from dynamo_dist.testing.zoo.cell import GRAD_TOL, _grad_errors

    ref = torch.nn.Module()
    ref.w = torch.nn.Parameter(torch.ones(4))
    ref.b = torch.nn.Parameter(torch.zeros(4))
    ref.w.grad = torch.full((4,), 10.0)
    ref.b.grad = torch.full((4,), 4e-7)  # noise: 1e-7 of the largest gradient
    noise = {"w": ref.w.grad * (1 + 1e-6), "b": torch.full((4,), -6e-7)}
    err, worst, zero = _grad_errors(noise, ref)
    assert err <= GRAD_TOL and zero == ["b"]
    wrong = {"w": ref.w.grad.clone(), "b": torch.full((4,), 0.05)}
    err, worst, _ = _grad_errors(wrong, ref)
    assert err > GRAD_TOL and worst == "b"
    wrong = {"w": ref.w.grad * 1.01, "b": ref.b.grad.clone()}
    err, worst, _ = _grad_errors(wrong, ref)
    assert err > GRAD_TOL and worst == "w"
