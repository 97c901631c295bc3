"""A training step compiled whole vs compiled in parts, under ``backend="dist"``.

The demo Llama (2 layers) on 2 gloo ranks, Inductor, AdamW, under the stock Megatron plan
(``--mesh tp=2``) or FSDP (``--mesh dp=2``). Contestants, each a fresh pair of processes with an
empty Inductor cache:
  parts  the model compiled, ``loss.backward()`` and ``opt.step()`` (compiled on its own, as
         ``torch.compile(opt.step)``) called outside: three programs per step;
  whole  one compiled function doing forward, ``backward()``, ``opt.step()``,
         ``opt.zero_grad()``: one program.
Per run: compile time (the first step), the median of ``STEADY_STEPS`` later steps, programs
compiled, collectives per step and the worst loss difference from one process. Medians over
``--runs``; ratios whole / parts from the same invocation. Writes
``benchmarks/results/whole_step[_dp]-<time>.json`` and ``whole_step[_dp].md``.

    PYTHONPATH=$PWD python -m benchmarks.whole_step [--runs 2] [--mesh dp=2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from .bench.torchrun import run_worker, sharded_demo_llama

HERE = os.path.dirname(os.path.abspath(__file__))
STEADY_STEPS = 8


def worker(mode: str, mesh_text: str) -> None:
    """One rank of one run (under torchrun): prints a JSON line on rank 0."""
    import torch
    import torch.distributed as dist

    from dynamo_dist import compile_records
    from dynamo_dist.testing.models import token_batch

    size, ref, model = sharded_demo_llama(mesh_text)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    if mode == "whole":
        def train_step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = torch.compile(train_step, backend="dist")
    else:
        forward = torch.compile(model, backend="dist")
        update = torch.compile(opt.step, backend="dist")

        def step(ids):
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            update()
            opt.zero_grad()
            return loss.detach()

    times, worst = [], 0.0
    for k in range(1 + STEADY_STEPS):
        ids = token_batch(size, k)
        t = time.perf_counter()
        loss = step(ids)
        times.append(time.perf_counter() - t)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        worst = max(worst, abs(loss.full_tensor().item() - ref_loss.item()) / ref_loss.item())
    records = compile_records()
    if dist.get_rank() == 0:
        print(json.dumps({"mode": mode, "programs": len(records),
                          "collectives": sum(r.ledger.count() for r in records),
                          "first_step_s": times[0], "step_s": statistics.median(times[1:]),
                          "loss_rel": worst}), flush=True)
    dist.destroy_process_group()


def run_once(mode: str, port: int, mesh_text: str) -> dict:
    return run_worker("benchmarks.whole_step", ["--mode", mode, "--mesh", mesh_text], port)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", default="whole", choices=["whole", "parts"])
    ap.add_argument("--mesh", default="tp=2", choices=["tp=2", "dp=2"])
    args = ap.parse_args()
    if args.worker:
        return worker(args.mode, args.mesh)
    runs: dict[str, list] = {"parts": [], "whole": []}
    for r in range(args.runs):
        for k, mode in enumerate(runs):
            runs[mode].append(run_once(mode, 29650 + 2 * r + k, args.mesh))
            print(json.dumps(runs[mode][-1]), flush=True)
    summary = {mode: {"programs": [r["programs"] for r in rows],
                      "collectives": [r["collectives"] for r in rows],
                      "first_step_s_median": statistics.median(r["first_step_s"] for r in rows),
                      "step_s_median": statistics.median(r["step_s"] for r in rows),
                      "loss_rel_max": max(r["loss_rel"] for r in rows)}
               for mode, rows in runs.items()}
    p, w = summary["parts"], summary["whole"]
    summary["first_step_ratio_whole_over_parts"] = w["first_step_s_median"] / \
        p["first_step_s_median"]
    summary["step_ratio_whole_over_parts"] = w["step_s_median"] / p["step_s_median"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "whole_step" if args.mesh == "tp=2" else "whole_step_dp"
    out_dir = os.path.join(HERE, "results")
    with open(os.path.join(out_dir, f"{name}-{stamp}.json"), "w") as f:
        json.dump({"mesh": args.mesh, "runs": runs, "summary": summary}, f, indent=1)
    rows = [f"| {mode} | {s['programs']} | {s['collectives']} | "
            f"{s['first_step_s_median']:.1f} | {s['step_s_median']:.3f} | "
            f"{s['loss_rel_max']:.1e} |" for mode, s in (("parts", p), ("whole", w))]
    md = [f"# A training step compiled whole vs in parts ({stamp})", "",
          f"Demo Llama, 2 layers, {args.mesh} gloo + Inductor "
          f"({'Megatron' if args.mesh == 'tp=2' else 'FSDP'}), AdamW; cold Inductor cache per "
          f"run; medians of {args.runs} runs.", "",
          "| | programs | collectives (all programs) | first step (s, compile included) | "
          f"later step (s, median of {STEADY_STEPS}) | worst loss rel. |",
          "|---|---|---|---|---|---|", *rows, "",
          f"Ratios whole / parts: first step "
          f"{summary['first_step_ratio_whole_over_parts']:.2f}, later step "
          f"{summary['step_ratio_whole_over_parts']:.2f}."]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
