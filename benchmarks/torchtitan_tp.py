"""torchtitan's Llama 3 debug model with torchtitan's own TP plan, tp=2 on 2 gloo ranks:
``backend="dist"`` against ``backend="inductor"`` and eager DTensor on the same parallelized
model, sequence parallel off and on, with two losses: ``gather`` (the logits gathered, one
cross entropy, the model compiled alone) and ``parallel`` (torchtitan's own vocabulary-parallel
loss on the split logits, compiled with the model in one function).

Per contestant: the first step (compile included), the median of ``--steps`` timed steps
(forward, backward, ``AdamW.step()``, ``zero_grad()``; after ``--warmup`` untimed ones), the
collectives one forward+backward issues (``torch.profiler``, c10d ops; the loss's gather of the
logits included, the same for every contestant), and the largest relative loss difference from
one process over the steps. Ratios are against eager DTensor in the same run. Writes
``benchmarks/results/torchtitan_tp-<time>.json`` and ``torchtitan_tp.md``.

    PYTHONPATH=$PWD python -m benchmarks.torchtitan_tp [--steps 10 --warmup 2 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONTESTANTS = ("eager_dtensor", "inductor", "dist")


def _run_contestant(name: str, sp: bool, loss_name: str, args) -> dict:
    import torch.distributed as dist

    from dynamo_dist import clear_compile_records, compile_records
    from dynamo_dist.testing import torchtitan as titan

    torch._dynamo.reset()
    clear_compile_records()
    size = titan.TitanSize(layers=args.layers)
    ref, model, _ = titan.build(size, tp=2, sequence_parallel=sp)
    loss_fn = titan.LOSSES[loss_name]

    def step_loss(ids, pos):
        return loss_fn(model(ids, pos), ids)

    if name == "eager_dtensor":
        run = step_loss
    elif loss_name == "gather":  # the model alone: the loss gathers its logits outside it
        compiled = torch.compile(model, backend=name)

        def run(ids, pos):
            return loss_fn(compiled(ids, pos), ids)
    else:
        run = torch.compile(step_loss, backend=name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    times, worst = [], 0.0
    for step in range(1 + args.warmup + args.steps):
        ids, pos = titan.batch(size, step)
        dist.barrier()
        t = time.perf_counter()
        loss = run(ids, pos)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        ref_loss = loss_fn(ref(ids, pos), ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    ids, pos = titan.batch(size, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(ids, pos).backward()
    opt.zero_grad()
    counts = titan.collectives(prof)
    return {"contestant": name, "sp": sp, "loss": loss_name, "first_step_s": times[0],
            "step_ms_median": 1e3 * statistics.median(times[1 + args.warmup:]),
            "collectives_per_step": sum(counts.values()), "collectives": counts,
            "loss_rel_max": worst,
            "graphs": len(compile_records()) if name == "dist" else None}


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rows = [_run_contestant(name, sp, loss, args) for loss in args.losses.split(",")
            for sp in (False, True) for name in CONTESTANTS]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": args.steps, "warmup": args.warmup, "layers": args.layers,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def render(data: dict) -> str:
    lines = ["# torchtitan Llama 3 debug model, its own TP plan, tp=2 (2 gloo ranks, CPU)", "",
             f"{data['layers']} decoder layers of the debug model (dim 256, 16 heads, vocab "
             f"2048), batch 2 x seq 32; median of {data['steps']} steps after {data['warmup']} "
             f"warm-up; torch {data['torch']}. Ratios against eager DTensor in the same run.",
             "", "| loss | SP | contestant | first step (s) | step (ms) | step ratio | "
             "collectives per step | loss rel. diff |", "|---|---|---|---|---|---|---|---|"]
    for loss, sp in dict.fromkeys((r.get("loss", "gather"), r["sp"]) for r in data["rows"]):
        rows = [r for r in data["rows"] if r["sp"] == sp and r.get("loss", "gather") == loss]
        base = next(r for r in rows if r["contestant"] == "eager_dtensor")
        for r in rows:
            lines.append(f"| {loss} | {'on' if sp else 'off'} | {r['contestant']} | "
                         f"{r['first_step_s']:.1f} | {r['step_ms_median']:.0f} | "
                         f"{r['step_ms_median'] / base['step_ms_median']:.2f} | "
                         f"{r['collectives_per_step']} | {r['loss_rel_max']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--losses", default="gather,parallel")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"torchtitan_tp-{stamp}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-port=29671", "-m", "benchmarks.torchtitan_tp", "--worker", "--out", out,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--layers", str(args.layers), "--losses", args.losses]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        text = render(json.load(f))
    with open(os.path.join(HERE, "results", "torchtitan_tp.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
