"""Time of Python-heavy loops against the depth of the caller's frame stack: on the caller's stack
vs on a fresh thread's (``inductor_passes.core.fresh_stack``).

    python -m benchmarks.stack_depth [--depths 320] [--iters 50000] [--ilp-depths 160]

CPython 3.11+ mmaps a 16 KiB frame chunk when a call does not fit in the current one and
munmaps it when that call returns, so a loop of small calls that straddles a chunk boundary pays
two system calls per call. Inside ``torch.compile`` the caller's depth decides where the
boundary falls. Two measurements, each at every caller depth from 0 to ``--depths`` /
``--ilp-depths`` (padding frames added below the timed call; one depth step moves the boundary
by one small frame, so a sweep of one chunk's worth of frames meets every alignment):

* ``loop``: ``--iters`` iterations of a dict store and a two-element comprehension (the shape
  of the sharding ILP's build loop);
* ``ilp``: the build of the sharding ILP of one decoder layer of the demo-width Llama on a
  fake dp=2 x tp=2 mesh (compiled with ``dynamo_dist.compile_blocks``, Inductor off; the
  joint N-D ILP), HiGHS stubbed out so that only our Python runs.

Each on the caller's stack (``same``: ``on_fresh_stack`` replaced by a direct call) and as
shipped (``fresh``). Reported per (measurement, variant): min, median and max seconds over the
depths, max / min, and the depths over 3x the min. The cyclic garbage collector runs before
each timed call (a collection inside one is noise of another kind). Writes ``--out`` (default
``benchmarks/results/stack_depth.json``) and the same name with ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import statistics
import sys
import time
import types
import unittest.mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _at_depth(depth: int, fn):
    """``fn()`` called under ``depth`` extra frames."""
    if depth == 0:
        return fn()
    return _at_depth(depth - 1, fn)


def _loop(iters: int) -> None:
    d = {}
    for i in range(iters):
        d[i] = [j for j in (1, 2)]


def _direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _block_ilp():
    """The joint N-D ShardingILP of one decoder layer (the largest ILP built while compiling a
    2-layer Llama's blocks one by one); its ``solve`` then only builds (HiGHS stubbed)."""
    import dynamo_dist
    from dynamo_dist.plans import shard_module
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch
    from dynamo_dist.testing.zoo.cell import plan_model
    from inductor_passes.sharding import propagate
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    size = LlamaSize(layers=2)
    model = build_llama(size)
    shard_module(model, mesh, plan_model(model, {"dp": 2, "tp": 2}))
    built: list = []

    class Recording(propagate.ShardingILP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    with unittest.mock.patch.object(propagate, "ShardingILP", Recording):
        dynamo_dist.compile_blocks(model, options={"inductor": False})
        ids = token_batch(size, 0)
        model(input_ids=ids, labels=ids).loss.backward()
    if not built:
        raise RuntimeError("no ILP was built (a plan cache hit?): DYNAMO_DIST_PLAN_CACHE=0")
    return max(built, key=lambda ilp: len(ilp.options))


def _sweep(depths: int, timed) -> dict:
    """``timed()`` (seconds) at caller depths 0 .. depths-1, as the shipped code and on the
    caller's stack."""
    from inductor_passes.sharding import solver

    out = {}
    for variant in ("same", "fresh"):
        runs = []
        for depth in range(depths):
            gc.collect()  # a collection inside a timed call would be noise of its own
            if variant == "same":
                with unittest.mock.patch.object(solver, "on_fresh_stack", _direct):
                    runs.append(_at_depth(depth, lambda: timed(_direct)))
            else:
                runs.append(_at_depth(depth, lambda: timed(solver.on_fresh_stack)))
        low = min(runs)
        out[variant] = {"min_s": low, "median_s": statistics.median(runs), "max_s": max(runs),
                        "max_over_min": round(max(runs) / low, 2),
                        "slow_depths": [d for d, t in enumerate(runs) if t > 3 * low],
                        "runs_s": [round(t, 4) for t in runs]}
    return out


def _run(args) -> dict:
    sys.path.insert(0, ROOT)
    os.environ["DYNAMO_DIST_PLAN_CACHE"] = "0"
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.bench.machine import load_average, machine_info
    from inductor_passes.sharding import solver

    result = {"benchmark": "stack_depth", "python": sys.version.split()[0],
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(torch.device("cpu"), 1), "load_start": load_average()}
    def loop(run) -> float:
        t = time.perf_counter()
        run(_loop, args.iters)
        return time.perf_counter() - t

    result["loop"] = _sweep(args.depths, loop)
    if args.ilp_depths:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        ilp = _block_ilp()
        result["ilp_variables"] = len(ilp.options)
        stub = types.SimpleNamespace(status=1, x=None, message="stubbed", fun=0.0)
        logging.getLogger("dynamo_dist.sharding").setLevel(logging.ERROR)  # the stub's warning

        def build(run) -> float:
            t = time.perf_counter()
            run(ilp.solve)
            return time.perf_counter() - t

        with unittest.mock.patch.object(solver, "_solve", lambda *a, **k: stub):
            result["ilp"] = _sweep(args.ilp_depths, build)
        dist.destroy_process_group()
    result["load_end"] = load_average()
    return result


def _markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Python loops against the caller's stack depth", "",
             f"Generated by `python -m benchmarks.stack_depth` (see its docstring) on "
             f"{result['date']}: Python {result['python']}, torch {m['torch']}, {m['cores']} "
             f"cores ({m['cpu']}). Load {result['load_start']} -> {result['load_end']}.", "",
             "| loop | variant | depths | min s | median s | max s | max / min | depths > 3x min |",
             "|---|---|--:|--:|--:|--:|--:|---|"]
    for name in ("loop", "ilp"):
        for variant, r in result.get(name, {}).items():
            slow = r["slow_depths"]
            lines.append(f"| {name} | {variant} | {len(r['runs_s'])} | {r['min_s']:.3f} | "
                         f"{r['median_s']:.3f} | {r['max_s']:.3f} | {r['max_over_min']} | "
                         f"{', '.join(map(str, slow[:12])) + (' ...' if len(slow) > 12 else '') or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, default=320, help="caller depths of the loop sweep")
    ap.add_argument("--iters", type=int, default=50_000, help="iterations of the loop")
    ap.add_argument("--ilp-depths", type=int, default=160,
                    help="caller depths of the ILP-build sweep (0: skip it)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "stack_depth.json"))
    args = ap.parse_args(argv)
    from benchmarks.bench.report import write_json_and_markdown

    result = _run(args)
    write_json_and_markdown(args.out, result, _markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
