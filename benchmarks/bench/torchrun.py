"""Benchmarks that run each contestant as its own pair of gloo ranks: the launcher and the
demo model both sides build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_worker(module: str, args: list[str], port: int, timeout: int = 1800) -> dict:
    """``python -m <module> --worker <args>`` on 2 gloo ranks with an empty Inductor cache (a
    cold compile) and one thread each; the JSON line rank 0 prints. Raises RuntimeError with the
    run's output tail when it fails."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache,
                   PYTHONPATH=ROOT)
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
             f"--master-port={port}", "-m", module, "--worker", *args],
            capture_output=True, text=True, env=env, timeout=timeout)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line)


def sharded_demo_llama(mesh_text: str, layers: int = 2, seq: int = 32):
    """Inside a worker: the gloo process group, a 2-rank mesh named by ``mesh_text`` ("tp=2":
    Megatron, "dp=2": FSDP), and the demo Llama twice -- the one-process reference and a copy
    sharded by the stock planner. Returns (size, reference, sharded model)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_dist.testing.models import LlamaSize, build_llama
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module

    dist.init_process_group("gloo")
    axis = mesh_text.split("=")[0]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    torch.manual_seed(0)
    size = LlamaSize(layers=layers, seq=seq)
    ref = build_llama(size)
    ref.config.use_cache = False
    model = copy.deepcopy(ref)
    planner = TensorParallelPlanner() if axis == "tp" else DataParallelPlanner(mesh_axis_size=2)
    shard_module(model, mesh, planner.build_plan(model))
    return size, ref, model
