"""The model zoo: ``python -m dynamo_dist.testing.zoo`` trains every architecture on every mesh,
on simulated ranks and on real gloo ranks, and writes ``docs/model_coverage.md`` (+ JSON).

    python -m dynamo_dist.testing.zoo                       # everything (about an hour, 2 cores)
    python -m dynamo_dist.testing.zoo --models gpt2 bert --meshes tp=2 --runtimes sim
    python -m dynamo_dist.testing.zoo --fast                # the CI subset
    python -m dynamo_dist.testing.zoo --runtimes cuda --meshes tp=1 --jobs 3  # on one GPU
    python -m dynamo_dist.testing.zoo --per-block --out /tmp/pb.md --json /tmp/pb.json
    python -m dynamo_dist.testing.zoo --autocast --runtimes sim --out /tmp/ac.md --json /tmp/ac.json
    python -m dynamo_dist.testing.zoo --checkpointing --out /tmp/ck.md --json /tmp/ck.json

Each cell runs in its own process(es) under a time limit (a hang is reported as one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from .cell import checkpointable, parse_mesh
from .models import MODELS
from .report import write_report

MESHES = ("tp=2", "dp=2", "dp=2,tp=2")
RUNTIMES = ("sim", "gloo")
# not a default: real ranks on GPUs, one each (NCCL, Triton kernels)
ALL_RUNTIMES = RUNTIMES + ("cuda",)
# the CI subset: ties (GPT-2, BERT), a MoE model, the ConvNet
FAST_MODELS = ("gpt2", "bert", "mixtral", "convnet")


def run_one(model: str, mesh: str, runtime: str, steps: int, inductor: bool,
            timeout: float, per_block: bool = False, autocast: bool = False,
            checkpointing: bool = False) -> dict:
    """One cell in fresh process(es); a crash or hang becomes a result row. ``per_block``:
    each repeated block compiled on its own (``dynamo_dist.compile_blocks``), the rest eager;
    ``autocast``: the forward under bf16 autocast; ``checkpointing``: transformers' gradient
    checkpointing on both sides (``cell.run_cell``)."""
    world = math.prod(parse_mesh(mesh).values())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        worker = ["-m", "dynamo_dist.testing.zoo.worker", model, mesh, out, "--steps", str(steps),
                  *(["--per-block"] if per_block else []), *(["--autocast"] if autocast else []),
                  *(["--checkpointing"] if checkpointing else [])]
        if runtime == "sim":
            cmd = [sys.executable, *worker, "--sim"]
        else:  # --standalone: a free port, so that cells may run side by side (--jobs)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world}", *worker] + \
                ([] if inductor else ["--no-inductor"]) + (["--cuda"] if runtime == "cuda" else [])
        # plans are made afresh: a cached plan would hide what the current planner does
        env = dict(os.environ, OMP_NUM_THREADS="1", DYNAMO_DIST_PLAN_CACHE="0")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            proc, tail = None, f"timed out after {timeout:.0f} s: {str(exc.stdout or '')[-1500:]}"
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        status = "hang" if proc is None else "crash"
        return {"model": model, "family": MODELS[model].family, "mesh": mesh,
                "runtime": runtime, "inductor": inductor and runtime != "sim",
                "status": status, "error": tail, "seconds": round(time.perf_counter() - t0, 1),
                "autocast": autocast, "checkpointing": checkpointing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    ap.add_argument("--meshes", nargs="+", default=list(MESHES))
    ap.add_argument("--runtimes", nargs="+", choices=ALL_RUNTIMES, default=list(RUNTIMES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-inductor", action="store_true", help="real-rank cells (gloo, cuda) without Inductor")
    ap.add_argument("--fast", action="store_true", help=f"only {', '.join(FAST_MODELS)}")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per cell")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers per model (default 2; sets DYNAMO_DIST_ZOO_LAYERS)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cells run side by side (each in its own processes)")
    ap.add_argument("--per-block", action="store_true",
                    help="compile each repeated block (the entries of a ModuleList: decoder "
                         "layers) on its own, the rest eager on DTensors (torchtitan's way)")
    ap.add_argument("--autocast", action="store_true",
                    help="the forward under torch.autocast(bfloat16), held to DDP emulated on one "
                         "device and, with tp, to one device's bf16 precision")
    ap.add_argument("--checkpointing", action="store_true",
                    help="transformers' gradient checkpointing (use_reentrant=False, dropout on) "
                         "on both sides; architectures without it are left out")
    ap.add_argument("--out", default="docs/model_coverage.md")
    ap.add_argument("--json", default="docs/model_coverage.json")
    args = ap.parse_args(argv)
    if args.autocast and args.per_block:
        ap.error("--autocast and --per-block do not combine (cell.run_cell)")
    if args.checkpointing and (args.autocast or args.per_block):
        ap.error("--checkpointing combines with neither --autocast nor --per-block "
                 "(cell.run_cell)")
    if args.layers is not None:
        if args.layers < 1:
            ap.error("--layers must be at least 1")
        os.environ["DYNAMO_DIST_ZOO_LAYERS"] = str(args.layers)
    models = [m for m in args.models if not args.fast or m in FAST_MODELS]
    if args.checkpointing:
        left_out = [m for m in models if not checkpointable(MODELS[m])]
        models = [m for m in models if m not in left_out]
        if left_out:
            print(f"left out (no gradient checkpointing): {', '.join(left_out)}", flush=True)
    cells = [(model, mesh, runtime) for model in models for mesh in args.meshes
             for runtime in args.runtimes]

    def one(cell: tuple[str, str, str]) -> dict:
        model, mesh, runtime = cell
        row = run_one(model, mesh, runtime, args.steps, not args.no_inductor, args.timeout,
                      args.per_block, args.autocast, args.checkpointing)
        print(f"{model:<10} {mesh:<10} {runtime:<5} {row['status']:<7} "
              f"loss {row.get('loss_rel', float('nan')):.1e} "
              f"grad {row.get('grad_rel', float('nan')):.1e} "
              f"({row.get('seconds', 0):.0f} s)", flush=True)
        return row

    # threads only wait on each cell's subprocesses; rows keep the cells' order
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, cells))
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    write_report(rows, args.out)
    wrong = [r for r in rows if r["status"] == "WRONG"]
    print(f"wrote {args.out}: {len(rows)} cells, {len(wrong)} silently wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
