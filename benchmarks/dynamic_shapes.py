"""A training loop whose input shape changes, under ``backend="dist"``: compiles and time.

The demo Llama (2 layers) on 2 gloo ranks, Inductor, under the stock Megatron plan (tp=2) or
FSDP (dp=2, the batch split), trained one SGD step per batch at sequence lengths 32, 48, 64,
32 and then a last batch of 4 at 40 (a new shape at almost every step, as evaluation,
variable-length batches or an epoch's last batch give). Contestants: ``dynamic=False`` (one
static compile per distinct shape) and ``dynamic=True`` (sizes symbolic: one program for every
shape; Megatron splits no batch or sequence dim, FSDP's batch split is guarded even). Each run is a fresh pair of processes with an empty Inductor cache (cold
compiles). Per run: compiles, the loop's wall time (compiles included), each step's time, the
worst loss difference from one process, and the median step time at the first shape after the
loop (no compile left: the compiled program alone, symbolic against static). Medians over
``--runs``; ratio dynamic / static from the same invocation. Writes
``benchmarks/results/dynamic_shapes[_dp]-<time>.json`` and ``dynamic_shapes[_dp].md``.

    PYTHONPATH=$PWD python -m benchmarks.dynamic_shapes [--runs 2] [--mesh dp=2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from .bench.torchrun import run_worker, sharded_demo_llama

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [(8, 32), (8, 48), (8, 64), (8, 32), (4, 40)]  # (batch, sequence length) per step
STEADY_STEPS = 7


def worker(dynamic: bool, mesh_text: str) -> None:
    """One rank of one run (under torchrun): prints a JSON line on rank 0."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from dynamo_dist import compile_records
    from dynamo_dist.testing.models import token_batch

    size, ref, model = sharded_demo_llama(mesh_text)
    compiled = torch.compile(model, backend="dist", dynamic=dynamic)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps, worst = [], 0.0
    start = time.perf_counter()
    for step, (b, s) in enumerate(SHAPES):
        ids = token_batch(dataclasses.replace(size, batch=b, seq=s), step)
        t = time.perf_counter()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        steps.append(time.perf_counter() - t)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        worst = max(worst, abs(loss.full_tensor().item() - ref_loss.item()) / ref_loss.item())
    total = time.perf_counter() - start
    # steady state: the first shape again (compiled by both), the compiled program alone
    ids = token_batch(dataclasses.replace(size, batch=SHAPES[0][0], seq=SHAPES[0][1]), 0)
    steady = []
    for _ in range(STEADY_STEPS):
        t = time.perf_counter()
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step(), opt.zero_grad()
        steady.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        print(json.dumps({"dynamic": dynamic, "compiles": len(compile_records()),
                          "loop_s": total, "step_s": steps, "loss_rel": worst,
                          "steady_step_s": statistics.median(steady)}), flush=True)
    dist.destroy_process_group()


def run_once(dynamic: bool, port: int, mesh_text: str) -> dict:
    return run_worker("benchmarks.dynamic_shapes",
                      ["--dynamic", str(int(dynamic)), "--mesh", mesh_text], port)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--dynamic", type=int, default=0)
    ap.add_argument("--mesh", default="tp=2", choices=["tp=2", "dp=2"])
    args = ap.parse_args()
    if args.worker:
        return worker(bool(args.dynamic), args.mesh)
    runs = {False: [], True: []}
    for r in range(args.runs):
        for dynamic in (False, True):
            runs[dynamic].append(run_once(dynamic, 29600 + 2 * r + dynamic, args.mesh))
            print(json.dumps(runs[dynamic][-1]), flush=True)
    summary = {}
    for dynamic, rows in runs.items():
        summary["dynamic" if dynamic else "static"] = {
            "compiles": [r["compiles"] for r in rows],
            "loop_s_median": statistics.median(r["loop_s"] for r in rows),
            "later_steps_s_median": statistics.median(
                statistics.median(r["step_s"][1:]) for r in rows),
            "steady_step_s_median": statistics.median(r["steady_step_s"] for r in rows),
            "loss_rel_max": max(r["loss_rel"] for r in rows)}
    summary["loop_ratio_dynamic_over_static"] = (summary["dynamic"]["loop_s_median"] /
                                                 summary["static"]["loop_s_median"])
    summary["steady_step_ratio_dynamic_over_static"] = (
        summary["dynamic"]["steady_step_s_median"] / summary["static"]["steady_step_s_median"])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "dynamic_shapes" if args.mesh == "tp=2" else "dynamic_shapes_dp"
    result = {"mesh": args.mesh, "shapes": SHAPES, "runs": {str(k): v for k, v in runs.items()},
              "summary": summary}
    out_dir = os.path.join(HERE, "results")
    with open(os.path.join(out_dir, f"{name}-{stamp}.json"), "w") as f:
        json.dump(result, f, indent=1)
    s, d = summary["static"], summary["dynamic"]
    md = [f"# Changing shapes: `dynamic=False` vs `dynamic=True` ({stamp})", "",
          f"Demo Llama, 2 layers, {args.mesh} gloo + Inductor "
          f"({'Megatron' if args.mesh == 'tp=2' else 'FSDP'}), one SGD step per batch at "
          f"(batch, length) {SHAPES}; cold Inductor cache per run; medians of {args.runs} runs.",
          "", "| | compiles | loop (s, compiles included) | median later step (s) | "
          f"steady step at {SHAPES[0]} (s, median of {STEADY_STEPS}) | worst loss rel. |",
          "|---|---|---|---|---|---|",
          f"| dynamic=False | {s['compiles']} | {s['loop_s_median']:.1f} | "
          f"{s['later_steps_s_median']:.2f} | {s['steady_step_s_median']:.3f} | "
          f"{s['loss_rel_max']:.1e} |",
          f"| dynamic=True | {d['compiles']} | {d['loop_s_median']:.1f} | "
          f"{d['later_steps_s_median']:.2f} | {d['steady_step_s_median']:.3f} | "
          f"{d['loss_rel_max']:.1e} |", "",
          f"Ratios dynamic / static: loop {summary['loop_ratio_dynamic_over_static']:.2f}, "
          f"steady step {summary['steady_step_ratio_dynamic_over_static']:.2f}."]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
