"""The planner's memory term (``PlannerConfig.saved_memory_weight``): per-rank memory against
collectives, for a range of weights.

transformers' Llama at the demo's width (random weights), the stock planners (Megatron on
``tp``, FSDP on ``dp``), on torch's ``fake`` process group in one process (rank 0's program;
its collectives return buffers of their real sizes, so the step allocates what a real rank
does), compiled with Inductor, one training step per weight, each weight in a fresh process.
Per weight: the bytes the plan keeps for the backward (``cost.saved_bytes``, what the term
prices, before the partitioner's recomputation), the predicted per-rank peak
(``CompileRecord.predicted_peak``), the measured peak of the compiled step (torch's profiler,
``bench.memory.step_peak``), the collectives of one step from the ledger (count, buffer bytes)
and the planning seconds. Memory and collectives are deterministic for a plan; planning time
is one run (not a timing claim). The weight 0 (the default) is the baseline of each mesh.

Writes ``benchmarks/results/saved_memory.json`` and ``saved_memory.md``.

    PYTHONPATH=$PWD python -m benchmarks.saved_memory [--layers 4] [--weights 0 0.1 1 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = {"tp=2": ((2,), ("tp",)), "dp=2,tp=2": ((2, 2), ("dp", "tp"))}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.bench.memory import local_bytes, step_peak
    from dynamo_dist import compile_records
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch
    from inductor_passes.sharding.config import PlannerConfig
    from inductor_passes.sharding.cost import saved_bytes

    shape, names = MESHES[args.mesh]
    world = 1
    for n in shape:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    size = LlamaSize(layers=args.layers)
    torch.manual_seed(0)
    model = build_llama(size)
    plan = TensorParallelPlanner(axis="tp").build_plan(model)
    if "dp" in names:
        plan = DataParallelPlanner(axis="dp", mesh_axis_size=shape[0]).build_plan(model, plan)
    shard_module(model, mesh, plan)
    compiled = torch.compile(model, backend="dist", options={
        "planner": PlannerConfig(saved_memory_weight=args.weight)})
    ids = token_batch(size, 0)

    def step():
        compiled(input_ids=ids, labels=ids).loss.backward()

    step()  # compiles
    for p in model.parameters():
        p.grad = None
    measured = step_peak(step, torch.device("cpu"), local_bytes(model.parameters()))
    record = compile_records()[-1]
    graph = record.program.graph_module.graph
    kept = saved_bytes(graph, lambda n: record.plan.nodes[n.name].output, tuple(shape))
    est = record.predicted_peak()
    kinds: dict[str, int] = {}
    for e in record.ledger.entries:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    print(json.dumps({
        "mesh": args.mesh, "layers": args.layers, "weight": args.weight,
        "plan_saved_bytes": kept, "predicted_peak_bytes": est.peak_bytes,
        "predicted_saved_bytes": est.saved_bytes, "measured_peak_bytes": measured["peak_bytes"],
        "collectives": len(record.ledger.entries), "collectives_by_kind": kinds,
        "ledger_bytes": record.ledger.total_bytes(), "plan_seconds": record.seconds.get("plan"),
        "torch": torch.__version__}))


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f}"


def report(rows: list[dict]) -> str:
    lines = ["# The planner's memory term: per-rank memory against collectives", "",
             "`python -m benchmarks.saved_memory` (demo-width Llama, fake process group, rank 0, "
             "Inductor). Ratios against weight 0 (the default) of the same mesh. MiB per rank.", "",
             "| mesh | layers | weight | plan saved | predicted peak | measured peak | measured / "
             "w=0 | collectives | ledger MiB | plan s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["mesh"]: r for r in rows if r["weight"] == 0}
    for r in rows:
        b = base.get(r["mesh"])
        ratio = f"{r['measured_peak_bytes'] / b['measured_peak_bytes']:.2f}x" if b else "-"
        lines.append(f"| {r['mesh']} | {r['layers']} | {r['weight']:g} | "
                     f"{_mib(r['plan_saved_bytes'])} | {_mib(r['predicted_peak_bytes'])} | "
                     f"{_mib(r['measured_peak_bytes'])} | {ratio} | {r['collectives']} | "
                     f"{_mib(r['ledger_bytes'])} | {r['plan_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.01, 0.1, 1.0, 10.0])
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mesh", help=argparse.SUPPRESS)
    ap.add_argument("--weight", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for mesh in args.meshes:
        for weight in args.weights:
            cmd = [sys.executable, "-m", "benchmarks.saved_memory", "--worker", "--mesh", mesh,
                   "--weight", str(weight), "--layers", str(args.layers)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "saved_memory.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "saved_memory.md"), "w") as f:
        f.write(report(rows))
    print(report(rows))


if __name__ == "__main__":
    main()
