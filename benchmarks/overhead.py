"""World size 1: ours' training step against plain Inductor's, and where the extra time goes.

    python -m benchmarks.overhead --layers 2 32 [--device cuda] [--out results/overhead-cuda.json]

The demo-width Llama (``LlamaSize``, only the layer count varies) on one device: plain
``torch.compile`` (Inductor) and ``backend="dist"`` on a mesh of one rank (``tp=1``: nccl on
CUDA, gloo on CPU), each step forward + backward + ``zero_grad(set_to_none=True)``. Per variant
(ms): the median of 20 steps after 3 warm-ups (``step_ms``), of 20 forwards (``forward_ms``),
the host time to issue one step without waiting for the device (``issue_ms``: a step whose
issue time is its step time is launch-bound), device kernels per step, and the top 25 host-side
entries of a ``torch.profiler`` trace of 3 steps (name, calls per step, self time per step in
ms; profiled, so slower than unprofiled). One process per run; results as JSON (one object per
depth, plus the ratios of ours to Inductor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _median_ms(fn, sync, n: int = 20) -> float:
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def _child(layers: int, device_type: str, port: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import dynamo_dist
    from dynamo_dist.plans import TensorParallelPlanner, shard_module
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    cuda = device_type == "cuda"
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device(device_type)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    size = LlamaSize(layers=layers)
    ids = token_batch(size, 0).to(device)
    row: dict = {"layers": layers, "torch": torch.__version__}
    for variant in ("inductor", "dist"):
        torch._dynamo.reset()
        model = build_llama(size).to(device)
        if variant == "dist":
            mesh = init_device_mesh(device_type, (1,), mesh_dim_names=("tp",))
            shard_module(model, mesh, TensorParallelPlanner(axis="tp").build_plan(model))
            compiled = torch.compile(model, backend=dynamo_dist.dist_backend)
        else:
            compiled = torch.compile(model)

        def forward():
            return compiled(input_ids=ids, labels=ids).loss

        def step():
            forward().backward()
            model.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        r = {"step_ms": _median_ms(step, sync), "forward_ms": _median_ms(forward, sync)}
        sync()
        t = time.perf_counter()
        step()
        r["issue_ms"] = (time.perf_counter() - t) * 1e3
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
            sync()
        events = prof.key_averages()
        r["kernels_per_step"] = sum(e.count for e in events
                                    if e.device_type.name == "CUDA") / 3
        r["top_host"] = [(e.key, e.count // 3, round(e.self_cpu_time_total / 3 / 1e3, 3))
                         for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]]
        row[variant] = r
    row["step_ratio"] = row["dist"]["step_ms"] / row["inductor"]["step_ms"]
    row["forward_ratio"] = row["dist"]["forward_ms"] / row["inductor"]["forward_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="JSON path (default results/overhead-<device>.json)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print("ROW " + json.dumps(_child(args.child, args.device, 29581)), flush=True)
        return 0
    rows = []
    for layers in args.layers:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.overhead", "--device",
                               args.device, "--child", str(layers)], cwd=ROOT,
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(lines[-1][4:]) if lines else \
            {"layers": layers, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("dist", "inductor")}),
              flush=True)
    out = args.out or os.path.join(RESULTS, f"overhead-{args.device}.json")
    with open(out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device,
                   "runs": rows}, f, indent=1)
    print(f"wrote {out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
