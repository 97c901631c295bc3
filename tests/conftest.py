"""Shared fixtures: a `fake` process group mesh (shapes and collective graphs are right, values
are not: used for plans, ledgers and lowering) and a launcher for real gloo runs."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The two tiers: CI runs the default one (under 25 minutes on 2 cores); DYNAMO_DIST_FULL_TESTS=1
# adds the tests marked ``full`` (slower variants of paths a default test covers) and the
# sweeps' larger sizes (FULL is read by the sweeps).
FULL = os.environ.get("DYNAMO_DIST_FULL_TESTS", "0") == "1"


def pytest_collection_modifyitems(config, items):
    """Outside the full tier, deselect the tests marked ``full`` (pytest reports how many)."""
    if FULL:
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item not in full]


class SmallMLP(torch.nn.Module):
    """16 -> 32 -> 16, ReLU, summed: the smallest program with a tensor-parallel pair."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(torch.nn.Module):
    """``layers`` blocks of 4 parameters in a ModuleList, then a head outside every layer."""

    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def sharded_llama(mesh, size):
    """The test Llama of ``size`` (``LlamaSize``), Megatron on the mesh's ``tp`` axis and FSDP on
    its ``dp`` axis (the stock planners), its parameters made DTensors on ``mesh``."""
    from dynamo_dist.testing.models import build_llama

    return _shard_llama(build_llama(size), mesh)


def one_step_without_inductor(mesh, layers: int) -> None:
    """A small test Llama of ``layers`` layers (hidden 64, 4 heads), sharded on ``mesh`` as
    ``sharded_llama`` shards it, one training step compiled by the ``dist`` backend without
    Inductor (capture, planning and lowering only)."""
    from dynamo_dist.testing.models import LlamaSize, token_batch

    size = LlamaSize(layers=layers, hidden=64, heads=4, kv_heads=2, intermediate=128,
                     vocab=256, seq=32, batch=4)
    # a fresh Dynamo: after another test's compile of this model at another length, automatic
    # dynamic shapes would make this one symbolic, which copying and these tests do not cover
    torch._dynamo.reset()
    model = sharded_llama(mesh, size)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    ids = token_batch(size, 0)
    compiled(input_ids=ids, labels=ids).loss.backward()


def _shard_llama(model, mesh):
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module

    names = mesh.mesh_dim_names
    plan = TensorParallelPlanner(axis="tp").build_plan(model) if "tp" in names else None
    if "dp" in names:
        plan = DataParallelPlanner(axis="dp", mesh_axis_size=mesh["dp"].size()).build_plan(
            model, plan)
    shard_module(model, mesh, plan)
    return model


def simulated_llama(rt, axes: dict, size):
    """(reference, model): the test Llama of ``size`` built from seed 0 on one process, and a
    copy sharded as ``sharded_llama`` shards it on the simulated ranks of ``rt`` (a
    ``SimRuntime``) over a mesh of ``axes`` (name -> size)."""
    import copy

    from dynamo_dist.testing.models import build_llama

    mesh = rt.setup(axes)
    torch.manual_seed(0)
    ref = build_llama(size)
    model = copy.deepcopy(ref)
    with rt.eager():
        _shard_llama(model, mesh)
        rt.localize(model)
    return ref, model


def lm_steps_at_parity(compiled, model, ref, rt, batches) -> None:
    """Train ``compiled`` (over ``model``, on the simulated ranks of ``rt``) and ``ref`` (one
    process) on each token batch of ``batches`` (labels = inputs): every step's loss within 1e-5
    and every gradient within 1e-4 of one process's."""
    from dynamo_dist.testing.zoo.cell import global_value

    for step, ids in enumerate(batches):
        loss = compiled(input_ids=ids, labels=ids).loss
        with rt.eager():
            loss.backward()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        assert abs(global_value(loss, rt).item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(global_value(p.grad, rt), q.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"step {step} ({tuple(ids.shape)}) {n}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def make_fake_mesh(shape, names, rank: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(shape))
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


@pytest.fixture
def fake_mesh():
    yield make_fake_mesh
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()


@pytest.fixture
def mesh_of_one():
    """A real gloo process group of one rank in this process; yields a maker of meshes of
    size-1 axes with the given names."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield lambda names: init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
    dist.destroy_process_group()
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    """Tests plan afresh (a cached plan would hide what a test changes in the planner's code
    or monkeypatches into it); tests/test_plan_cache.py turns the cache back on."""
    monkeypatch.setenv("DYNAMO_DIST_PLAN_CACHE", "0")


@pytest.fixture(autouse=True)
def _fresh_records():
    from dynamo_dist import clear_compile_records

    clear_compile_records()
    yield
    clear_compile_records()


def torchrun(script: str, nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run tests/mp/<script> on ``nproc`` gloo ranks; fail with its output if it fails."""
    # --standalone: the launcher's store takes a free port, so runs in parallel test workers
    # (scripts/test.sh runs pytest-xdist) never meet on one
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--standalone", os.path.join(ROOT, "tests", "mp", script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{script} failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc
