"""Why the runtime compiles for the strides inputs arrive with instead of making them contiguous.

One process, a 1-rank ``fake`` mesh (every collective is the identity), Inductor, one intra-op
thread. Two programs, each compiled twice with ``backend="dist"`` (and, for reference, with
``backend="inductor"``): once for a non-contiguous input as it arrives, once with the input made
contiguous at the boundary (the copy included in the step):

- a channels-last [16, 16, 32, 32] image into Conv2d(16, 32, 3) + BatchNorm2d + ReLU, forward and
  backward;
- a transposed [2048, 512] input into ``(x @ w).relu().sum()``, forward and backward (w: [512, 256]).

Steps of the variants are interleaved (drift on a shared machine hits them alike); the median of
``--steps`` is printed in milliseconds.

    PYTHONPATH=$PWD python -m benchmarks.boundary_layout [--steps 40]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


def _one_rank_mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _interleaved(fns: dict[str, Callable[[], None]], steps: int) -> dict[str, float]:
    for fn in fns.values():  # compile and warm up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    from dynamo_dist.plans import DataParallelPlanner, shard_module
    from inductor_passes.core import compat

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    compat.allow_implicit_replication(True)
    mesh = _one_rank_mesh()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32),
                               torch.nn.ReLU())
    image = torch.randn(16, 16, 32, 32).to(memory_format=torch.channels_last)
    w0 = torch.randn(512, 256)
    xt = torch.randn(512, 2048).t()
    fns: dict[str, Callable[[], None]] = {}
    for backend in ("dist", "inductor"):
        for how in ("as it arrives", "made contiguous"):
            def inp(t, how=how):
                return t if how == "as it arrives" else t.contiguous()

            model = copy.deepcopy(base)
            if backend == "dist":
                shard_module(model, mesh, DataParallelPlanner(shard_params=False).build_plan(model))
            conv = torch.compile(model, backend=backend, dynamic=False)
            fns[f"{backend:<9} conv, channels-last input   {how}"] = \
                lambda conv=conv, inp=inp: _full(conv(inp(image))).sum().backward()
            w = torch.nn.Parameter(distribute_tensor(w0.clone(), mesh, [Replicate()])
                                   if backend == "dist" else w0.clone())
            mm = torch.compile(lambda x, w=w: (x @ w).relu().sum(), backend=backend,
                               dynamic=False)
            fns[f"{backend:<9} matmul, transposed input    {how}"] = \
                lambda mm=mm, inp=inp: _full(mm(inp(xt))).backward()
    for name, ms in _interleaved(fns, args.steps).items():
        print(f"{name:<58} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
