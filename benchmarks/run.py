"""Run the benchmarks: every contestant on every chosen workload, one torchrun job per workload.

    python -m benchmarks.run                                   # all workloads, 30 timed steps
    python -m benchmarks.run --workloads mlp --steps 5 --warmup 2
    python -m benchmarks.run --workloads llama_tp --profile ours,dtensor_inductor

Launched without torchrun, it starts ``torch.distributed.run`` itself for each workload with the
workload's number of CPU ranks (gloo; one intra-op thread per rank unless --threads says
otherwise). Rank 0 writes, under --out:
  <workload>-<timestamp>.json   every metric, machine info, raw step times
  <workload>.md                 the tables (also printed), ratios ours / contestant, targets
  <workload>.png                median step time per contestant with IQR bars
  profiles/<workload>-<contestant>.txt (+ .trace.json.gz)   with --profile
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("mlp", "llama_tp", "llama_dp_tp")   # module benchmarks.<name> defines WORKLOAD


def load_workload(name: str):
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return importlib.import_module(f"benchmarks.{name}").WORKLOAD


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse(argv: list[str] | None):
    from benchmarks.bench.contestants import NAMES

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=_csv, default=list(WORKLOADS),
                    help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--contestants", type=_csv, default=list(NAMES),
                    help=f"comma-separated, from {', '.join(NAMES)} (default: all)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per contestant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed interleaved steps first")
    ap.add_argument("--profile", type=_csv, default=[],
                    help="contestants to run under torch.profiler after the measurements")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: nccl, one GPU per rank (memory from the CUDA allocator)")
    ap.add_argument("--render", nargs="+", metavar="JSON", default=[],
                    help="only rewrite <workload>.md and .png next to these result files")
    ap.add_argument("--skip-schedule-check", action="store_true",
                    help="turn off dynamo_dist's rank-divergence check for ours (before "
                         "94d2e33 it rejected every dp x tp program); recorded in the results")
    ap.add_argument("--ours-compile", choices=["model", "blocks"], default="model",
                    help="ours: compile the whole model (default) or each FSDP unit (decoder "
                         "layer) on its own, the rest eager (torchtitan's way); recorded")
    args = ap.parse_args(argv)
    for name in args.contestants + args.profile:
        if name not in NAMES:
            ap.error(f"unknown contestant {name!r}; known: {', '.join(NAMES)}")
    for name in args.workloads:
        load_workload(name)
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward_args(args, workload: str) -> list[str]:
    return ["--workloads", workload, "--contestants", ",".join(args.contestants),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            *(["--profile", ",".join(args.profile)] if args.profile else []),
            "--profile-steps", str(args.profile_steps), "--out", os.path.abspath(args.out),
            "--threads", str(args.threads), "--device", args.device,
            *(["--skip-schedule-check"] if args.skip_schedule_check else []),
            "--ours-compile", args.ours_compile]


def launch(args) -> int:
    """One torchrun job per workload; returns non-zero if any job failed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    rc = 0
    for name in args.workloads:
        w = load_workload(name)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={w.world_size}",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
               "-m", "benchmarks.run", *_forward_args(args, name)]
        print(f"== {name}: {w.world_size} ranks: {w.description}", flush=True)
        rc |= subprocess.call(cmd, env=env, cwd=ROOT)
    return rc


def run_rank(args) -> int:
    """Under torchrun: run one workload on this rank; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from benchmarks.bench.runner import Options, run

    if len(args.workloads) != 1:
        raise SystemExit("under torchrun, give exactly one workload")
    w = load_workload(args.workloads[0])
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=20))
    if dist.get_world_size() != w.world_size:
        raise SystemExit(f"{w.name} needs {w.world_size} ranks, got {dist.get_world_size()}")
    opts = Options(steps=args.steps, warmup=args.warmup, contestants=tuple(args.contestants),
                   profile=tuple(args.profile), profile_steps=args.profile_steps,
                   profile_dir=os.path.join(args.out, "profiles"), device=args.device,
                   skip_schedule_check=args.skip_schedule_check,
                   ours_compile=args.ours_compile)
    try:
        results = run(w, opts)
        if results is not None:
            write(results, args.out)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _file_name(results: dict) -> str:
    """The workload, and how ours was compiled where that is not the default (so a per-block
    run does not overwrite the whole-model run's report)."""
    how = results["config"].get("ours_compile", "model")
    return results["workload"] + ("" if how == "model" else f"-ours-{how}")


def write(results: dict, out: str) -> None:
    from benchmarks.bench.chart import step_time_chart
    from benchmarks.bench.report import targets, to_markdown

    os.makedirs(out, exist_ok=True)
    results["targets"] = targets(results)
    stamp = results["timestamp"].replace(":", "").replace("-", "").replace("T", "-")
    name = _file_name(results)
    with open(os.path.join(out, f"{name}-{stamp}.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = to_markdown(results)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    step_time_chart(results, os.path.join(out, f"{name}.png"))
    print(md, flush=True)
    print(f"wrote {out}/{name}-{stamp}.json, {name}.md, {name}.png", flush=True)


def render(paths: list[str]) -> int:
    """Rewrite the markdown and chart of existing result files (no run)."""
    from benchmarks.bench.chart import step_time_chart
    from benchmarks.bench.report import to_markdown

    for path in paths:
        with open(path) as f:
            results = json.load(f)
        out, name = os.path.dirname(os.path.abspath(path)), _file_name(results)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(to_markdown(results))
        step_time_chart(results, os.path.join(out, f"{name}.png"))
        print(f"rendered {out}/{name}.md, {name}.png from {os.path.basename(path)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    if args.render:
        return render(args.render)
    if "RANK" not in os.environ:
        return launch(args)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
