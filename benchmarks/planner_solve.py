"""Planning time of planner variants on the same captured program: what a planner change buys.

    python -m benchmarks.planner_solve [--layers 2 4] [--mesh dp=2,tp=2] [--reps 3]
    python -m benchmarks.planner_solve --variants shipped classes-only \
        --out benchmarks/results/planner_outside.json

The demo-width Llama (``LlamaSize``, only the layer count varies), sharded by the stock
planners (Megatron on ``tp``, FSDP on ``dp``), is captured once per depth on torch's ``fake``
process group (rank 0: nothing runs). The captured program's planning (``propagate``, the
whole pipeline of ILPs: per-axis start, pricing, the joint ILP outside the layers,
descent) is then run ``--reps`` times per variant, the variants alternating, in one process.
Variants (``--variants``, the first is the one the ratios put on top):

* ``shipped``: the planner as it is (each ILP solved as its LP relaxation first,
  ``sharding.solver._solve``);
* ``mip``: ``solver._INTEGRAL_TOL`` set below zero, so no relaxed answer is ever taken;
* ``classes-only``: the joint ILP outside the layers fixes only the nodes of repeat classes
  (``propagate.layer_of`` patched to see no layer), the rule before 2026-11-27.

Reported per depth and variant: the median planning seconds (wall) over the repeats, each
run's seconds, the plan's cost (the objective the planner minimises, bytes-equivalent; equal
costs are the check that the faster variant lost nothing) and the ratio of the medians, first
variant over each other. Writes ``--out`` (default ``benchmarks/results/planner_solve.json``)
and the same name with ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import statistics
import sys
import time
import unittest.mock

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


def _variant(name: str):
    """A context in which the planner plans as variant ``name`` (see the module docstring);
    ValueError if unknown."""
    from inductor_passes.sharding import propagate, solver

    patches = {"shipped": None,
               "mip": (solver, "_INTEGRAL_TOL", -1.0),
               "classes-only": (propagate, "layer_of", lambda node: None)}
    if name not in patches:
        raise ValueError(f"unknown variant {name!r}: use {', '.join(patches)}")
    patch = patches[name]
    return contextlib.nullcontext() if patch is None else unittest.mock.patch.object(*patch)


def _run(args) -> dict:
    sys.path.insert(0, ROOT)
    os.environ["DYNAMO_DIST_PLAN_CACHE"] = "0"
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.bench.machine import load_average, machine_info
    from dynamo_dist.testing.demo import parse_mesh

    axes = parse_mesh(args.mesh)
    world = math.prod(axes.values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    result = {"benchmark": "planner_solve", "mesh": args.mesh, "reps": args.reps,
              "variants": args.variants,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(torch.device("cpu"), world), "rows": [], "ratios": {}}
    first = args.variants[0]
    for layers in args.layers:
        plan_again = _captured_planning(layers, axes)
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        costs: dict[str, set] = {v: set() for v in args.variants}
        load_start = load_average()
        for _ in range(args.reps):
            for variant in times:  # alternating: every variant sees the same machine load
                with _variant(variant):
                    t = time.perf_counter()
                    plan = plan_again()
                    times[variant].append(time.perf_counter() - t)
                costs[variant].add(round(plan.total_cost, 3))
        for variant, ts in times.items():
            result["rows"].append({"layers": layers, "variant": variant,
                                   "median_s": statistics.median(ts), "runs_s": ts,
                                   "plan_cost": sorted(costs[variant]),
                                   "load_start": load_start, "load_end": load_average()})
        for other in args.variants[1:]:
            result["ratios"][f"{layers} layers: planning, {first} / {other} (medians)"] = round(
                statistics.median(times[first]) / statistics.median(times[other]), 3)
            result["ratios"][f"{layers} layers: same plan cost, {first} and {other}"] = \
                costs[first] == costs[other]
    dist.destroy_process_group()
    return result


def _markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Planning time by planner variant: {', '.join(result['variants'])} "
             f"(mesh {result['mesh']})",
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
    ap.add_argument("--variants", nargs="+", default=["shipped", "mip"],
                    help="shipped, mip, classes-only (2 or more; the first is compared to "
                         "each other)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "planner_solve.json"))
    args = ap.parse_args(argv)
    if len(args.variants) < 2:
        ap.error("--variants needs at least two variants to compare")
    from benchmarks.bench.report import write_json_and_markdown

    result = _run(args)
    write_json_and_markdown(args.out, result, _markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
