"""Planning time with the sharding ILPs solved as their LP relaxation first, against the MIP alone.

    python -m benchmarks.planner_solve [--layers 2 4] [--mesh dp=2,tp=2] [--reps 3]

``sharding.solver._solve`` solves each ILP's LP relaxation and takes its answer where every choice
variable comes out 0 or 1; otherwise the MIP (HiGHS through scipy). This script measures what
that buys. The demo-width Llama (``LlamaSize``, only the layer count varies), sharded by the stock
planners (Megatron on ``tp``, FSDP on ``dp``), is captured once per depth on torch's ``fake``
process group (rank 0: nothing runs). The captured program's planning (``propagate``, the
whole pipeline of ILPs: per-axis start, pricing, the joint ILP outside the repeated layers,
descent) is then run ``--reps`` times per variant, the variants alternating, in one process:

* ``lp-first``: as shipped;
* ``mip``: ``solver._INTEGRAL_TOL`` set below zero, so no relaxed answer is ever taken.

Reported per depth and variant: the median planning seconds (wall) over the repeats, each
run's seconds, the plan's cost (the objective the planner minimises, bytes-equivalent; equal
costs are the check that the relaxation lost nothing) and the ratio lp-first / mip of the
medians. Writes ``benchmarks/results/planner_solve.json`` and
``planner_solve.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _captured_planning(layers: int, axes: dict[str, int]):
    """Compile the demo Llama once with the planner's ``propagate`` wrapped; return a function
    that plans the captured program again (a fresh ``Plan`` each call)."""
    import torch

    import dynamo_dist
    import dynamo_dist.backend as backend
    from dynamo_dist.plans import shard_module
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch
    from dynamo_dist.testing.zoo.cell import plan_model
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    size = LlamaSize(layers=layers)
    model = build_llama(size)
    shard_module(model, mesh, plan_model(model, axes))
    seen: list = []
    original = backend.propagate

    def recording(*args, **kwargs):
        seen.append((args, kwargs))
        return original(*args, **kwargs)

    backend.propagate = recording
    try:
        ids = token_batch(size, 0)
        compiled = torch.compile(model, backend=dynamo_dist.dist_backend,
                                 options={"inductor": False})
        compiled(input_ids=ids, labels=ids).loss.backward()
    finally:
        backend.propagate = original
    if not seen:
        raise RuntimeError("the planner was not called (a plan cache hit?): run with "
                           "DYNAMO_DIST_PLAN_CACHE=0")
    args, kwargs = seen[-1]
    return lambda: original(*args, **kwargs)


def _run(args) -> dict:
    sys.path.insert(0, ROOT)
    os.environ["DYNAMO_DIST_PLAN_CACHE"] = "0"
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.bench.machine import load_average, machine_info
    from dynamo_dist.testing.demo import parse_mesh
    from inductor_passes.sharding import solver

    axes = parse_mesh(args.mesh)
    world = math.prod(axes.values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    result = {"benchmark": "planner_solve", "mesh": args.mesh, "reps": args.reps,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(torch.device("cpu"), world), "rows": [], "ratios": {}}
    shipped = solver._INTEGRAL_TOL
    for layers in args.layers:
        plan_again = _captured_planning(layers, axes)
        times: dict[str, list[float]] = {"lp-first": [], "mip": []}
        costs: dict[str, set] = {"lp-first": set(), "mip": set()}
        load_start = load_average()
        for _ in range(args.reps):
            for variant in times:  # alternating: both see the same machine load
                solver._INTEGRAL_TOL = shipped if variant == "lp-first" else -1.0
                try:
                    t = time.perf_counter()
                    plan = plan_again()
                    times[variant].append(time.perf_counter() - t)
                finally:
                    solver._INTEGRAL_TOL = shipped
                costs[variant].add(round(plan.total_cost, 3))
        for variant, ts in times.items():
            result["rows"].append({"layers": layers, "variant": variant,
                                   "median_s": statistics.median(ts), "runs_s": ts,
                                   "plan_cost": sorted(costs[variant]),
                                   "load_start": load_start, "load_end": load_average()})
        result["ratios"][f"{layers} layers: planning, lp-first / mip (medians)"] = round(
            statistics.median(times["lp-first"]) / statistics.median(times["mip"]), 3)
        result["ratios"][f"{layers} layers: same plan cost"] = costs["lp-first"] == costs["mip"]
    dist.destroy_process_group()
    return result


def _markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Planning time: LP relaxation first against the MIP alone (mesh {result['mesh']})",
             "", f"Generated by `python -m benchmarks.planner_solve` (see its docstring) on "
             f"{result['date']}: torch {m['torch']}, {m['cores']} cores ({m['cpu']}). "
             f"{result['reps']} plannings per cell, the variants alternating in one process.", "",
             "| layers | variant | planning (median s) | runs (s) | plan cost | load start / end |",
             "|--:|---|--:|---|--:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['layers']} | {r['variant']} | {r['median_s']:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in r['runs_s'])} | "
                     f"{', '.join(f'{c:.6g}' for c in r['plan_cost'])} | "
                     f"{(r['load_start'] or ['-'])[0]} / {(r['load_end'] or ['-'])[0]} |")
    lines += ["", "Ratios:", ""] + [f"- {k}: {v}" for k, v in result["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "planner_solve.json"))
    args = ap.parse_args(argv)
    result = _run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
