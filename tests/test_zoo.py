"""The model zoo's CI subset: real architectures with their default configs (ties, dropout,
caches as shipped) trained on simulated ranks, each against one process and against its
textbook collective plan (Megatron on tp, FSDP on dp). The whole matrix runs outside CI:
``python -m dynamo_dist.testing.zoo`` (docs/model_coverage.md)."""

import pytest
import torch
import torch.distributed as dist

from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell
from dynamo_dist.testing.zoo.expect import data_parallel_shortfall
from dynamo_dist.testing.zoo.models import MODELS

CELLS = [("gpt2", "tp=2"), ("gpt2", "dp=2,tp=2"), ("bert", "tp=2"), ("bert", "dp=2"),
         ("mixtral", "tp=2"), ("convnet", "dp=2"), ("bloom", "dp=2,tp=2")]


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
    # data parallelism kept: the gradients reduced on dp, not the batch computed whole there
    assert data_parallel_shortfall(row["textbook"]) is None, row["textbook"]
    assert not row["fallbacks"], row["fallbacks"]
    assert not row["ledger_without_user_line"], row["ledger_without_user_line"]
    # every parameter a planner left replicated says why
    assert all(r["reason"] for r in row["params"]["replicated"])


def test_gpt2_compiled_block_by_block_trains_like_one_process():
    """``--per-block``: each of GPT-2's blocks compiled on its own, the rest eager on DTensors,
    FSDP on dp. GPT-2 has two row-split embeddings (the position embedding's batch of 1
    cannot be split over dp, so its lookup is summed to Replicate, and its gradient arrives
    as a pending sum DTensor cannot move to the lookup's _MaskPartial: a crash), a tied head,
    and dropout inside the blocks (the simulated ranks drew the first block's masks again in
    the second: 'WRONG')."""
    try:
        row = run_cell(MODELS["gpt2"], "dp=2", SimRuntime(), steps=2, per_block=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()
    assert row["status"] == "parity", (row.get("error"), row.get("trace"), row.get("grad_worst"))
    assert row["loss_rel"] <= 1e-5 and row["grad_rel"] <= 1e-4
    assert row["blocks"] == 2 and row["ties_kept"]


def _autocast_cell(model: str, mesh: str) -> dict:
    try:
        return run_cell(MODELS[model], mesh, SimRuntime(), steps=2, autocast=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()


def test_mixtral_under_autocast_matches_ddp_or_one_device_gradient_by_gradient():
    """``--autocast`` on dp=2: Mixtral's router weights' gradients are summed over the batch
    before a cast down to bf16 (a pending sum cannot cross a narrowing cast), as one device
    sums them, where DDP rounds each rank's half first (2e-3 apart); every other gradient is
    DDP's. Both are right: a cell takes each gradient against the nearer reference."""
    row = _autocast_cell("mixtral", "dp=2")
    assert row["status"] == "parity", (row.get("error"), row.get("trace"), row.get("bf16"))
    bf16 = row["bf16"]
    assert bf16["matches_ddp"] and not bf16["within_bf16_error"]  # no tp: no bf16 allowance
    assert row["loss_rel"] <= 1e-5 and row["grad_rel"] <= 1e-4, row["grad_worst"]
    nearer = bf16["one_device_nearer"]
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= set(nearer), nearer


def test_an_autocast_cell_catches_gradients_summed_in_bf16(monkeypatch):
    """The criterion can fail: with ``widening_reduction_factor=0`` the planner reduce-scatters
    GPT-2's bf16 weight gradients before their cast to fp32 (FSDP's ``reduce_dtype=bf16``),
    one rounding neither DDP nor one device makes; on dp, with no bf16 allowance, the cell
    is WRONG. With the default (the fp32 sum) it is at parity."""
    monkeypatch.setenv("DYNAMO_DIST_PLAN_CACHE", "0")
    row = _autocast_cell("gpt2", "dp=2")
    assert row["status"] == "parity", (row.get("error"), row.get("trace"), row.get("bf16"))
    monkeypatch.setenv("DYNAMO_DIST_PLANNER", "widening_reduction_factor=0")
    row = _autocast_cell("gpt2", "dp=2")
    assert row["status"] == "WRONG" and not row["bf16"]["ok"], row.get("bf16")
    assert row["grad_rel"] > 10 * max(1e-4, 2 * row["bf16"]["floor_grad"])


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


def test_a_wrong_cell_is_run_again_on_plain_inductor(monkeypatch, tmp_path):
    """A WRONG cell compiled by Inductor gets plain torch.compile on one device against eager
    beside it (Inductor's own difference from eager is then told from the sharding's), and
    the report shows both; a cell that passes gets none."""
    from dynamo_dist.testing.zoo import cell
    from dynamo_dist.testing.zoo.report import write_report

    def wrong(zm, axes, rt, steps, row, tp_options, per_block, autocast, checkpointing):
        row.update(status="WRONG", loss_rel=0.1, grad_rel=0.5)

    monkeypatch.setattr(cell, "_train", wrong)
    row = cell.run_cell(MODELS["convnet"], "dp=1", cell.Runtime(inductor=True), steps=1)
    base = row["baseline"]
    assert base["loss_rel"] <= 1e-5 and base["grad_rel"] <= 1e-4, base
    assert row["torch"] == torch.__version__
    write_report([row], str(tmp_path / "r.md"))
    assert "**WRONG** 1e-01/5e-01 (plain Inductor: " in (tmp_path / "r.md").read_text()
    monkeypatch.setattr(cell, "_train", lambda *args: args[4].update(  # the row
        status="parity", loss_rel=0.0, grad_rel=0.0))
    assert "baseline" not in cell.run_cell(MODELS["convnet"], "dp=1", cell.Runtime(), steps=1)


def test_a_dist_error_wrapped_by_dynamo_is_reported_as_an_error_not_a_crash(monkeypatch):
    from dynamo_dist.testing.zoo import cell
    from inductor_passes.core.errors import DistCompileError

    def raises(message):
        def train(*args):
            wrapped = RuntimeError("backend='dist' raised")  # as BackendCompilerFailed does
            wrapped.__cause__ = DistCompileError(message, fix="a fix")
            raise wrapped
        return train

    monkeypatch.setattr(cell, "_train", raises("aten.x cannot be traced"))
    assert cell.run_cell(MODELS["convnet"], "dp=1", cell.Runtime())["status"] == "error"
    monkeypatch.setattr(cell, "_train", raises("internal error: a bug of ours"))
    assert cell.run_cell(MODELS["convnet"], "dp=1", cell.Runtime())["status"] == "crash"


def test_cells_run_side_by_side_keep_their_order(monkeypatch, tmp_path):
    import time

    from dynamo_dist.testing.zoo import __main__ as zoo

    def run_one(model, mesh, runtime, steps, inductor, timeout, per_block, autocast,
                checkpointing):
        time.sleep(0.2 if model == "gpt2" else 0.0)  # the first cell ends last
        return {"model": model, "family": MODELS[model].family, "mesh": mesh,
                "runtime": runtime, "inductor": inductor, "status": "parity", "loss_rel": 0.0,
                "grad_rel": 0.0}

    monkeypatch.setattr(zoo, "run_one", run_one)
    out = tmp_path / "z.json"
    rc = zoo.main(["--models", "gpt2", "bert", "convnet", "--meshes", "tp=2", "--runtimes",
                   "gloo", "--jobs", "3", "--out", str(tmp_path / "z.md"), "--json", str(out)])
    import json

    assert rc == 0
    assert [r["model"] for r in json.loads(out.read_text())] == ["gpt2", "bert", "convnet"]
