"""Prefetch of the next layer's parameter gathers (``inductor_passes.prefetch``), on and off.

The demo Llama (``dynamo_dist.testing.models``, random weights), the stock planners (FSDP on
``dp``, Megatron on ``tp``), on real gloo ranks (one intra-op thread each), compiled by the dist
backend twice in each rank's process from the same weights: ``DYNAMO_DIST_PREFETCH=1`` and
``=0`` (the default on CPU), each with its own empty Inductor cache. The timed steps alternate between
the two (forward + backward + SGD step, a barrier before each), so both see the same machine
load. Per variant, on rank 0:

* step time: median and interquartile range of the timed steps (ms);
* exposed wait: the CPU time a step spends blocked in ``_c10d_functional::wait_tensor``
  (torch.profiler, self time, median over the profiled steps): the part of communication that
  compute did not hide. Issuing a gather a layer early is meant to shrink it;
* peak memory: ``bench.memory.step_peak`` (resident state + the profiler's peak rise), and the
  plan's prediction (``CompileRecord.predicted_peak``);
* the loss of each step, against the other variant and against one process in eager mode
  (rank 0, the global batch);
* the order check: in the compiled forward, how many layers' gathers are issued before the
  previous layer's body runs (``prefetched`` from the compile record).

Ratios are prefetch on / off, in the same run. Writes ``benchmarks/results/prefetch.json`` and
``prefetch.md``.

    python -m benchmarks.prefetch [--mesh dp=4] [--layers 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
VARIANTS = {"prefetch": "1", "no_prefetch": "0"}


def _mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    axes = [part.split("=") for part in text.split(",")]
    return tuple(int(n) for _, n in axes), tuple(name for name, _ in axes)


def _build(size, mesh, names):
    import torch

    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
    from dynamo_dist.testing.models import build_llama

    torch.manual_seed(0)
    model = build_llama(size)
    plan = None
    if "tp" in names:
        plan = TensorParallelPlanner(axis="tp").build_plan(model)
    if "dp" in names:
        plan = DataParallelPlanner(axis="dp", mesh_axis_size=mesh["dp"].size()).build_plan(
            model, plan)
    shard_module(model, mesh, plan)
    return model


def _own_frame(model, name: str):
    """``model`` behind a forward of its own code object. Dynamo caches compiled code per code
    object and guards the parameters as graph inputs, so a second model of the same class
    would reuse the first variant's compiled program instead of compiling under its own
    ``DYNAMO_DIST_PREFETCH``."""
    import types

    import torch.nn as nn

    def forward(self, **kwargs):
        return self.inner(**kwargs)

    code = forward.__code__.replace(co_name=f"forward_{name}")
    cls = type(f"Variant_{name}", (nn.Module,), {
        "forward": types.FunctionType(code, forward.__globals__, f"forward_{name}")})
    wrapper = cls()
    wrapper.inner = model
    return wrapper


def _exposed_wait_ms(step, steps: int) -> list[float]:
    """Per profiled step, the self CPU ms spent in wait_tensor."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        out.append(sum(e.self_cpu_time_total for e in prof.key_averages()
                       if "wait_tensor" in e.key) / 1e3)
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.bench.memory import local_bytes, step_peak
    from dynamo_dist import compile_records
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=20))
    rank = dist.get_rank()
    shape, names = _mesh(args.mesh)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    size = LlamaSize(layers=args.layers)
    batches = [token_batch(size, i) for i in range(args.warmup + args.steps + args.profile + 1)]
    runs = {}
    for name, flag in VARIANTS.items():
        model = _build(size, mesh, names)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        cache = tempfile.mkdtemp(prefix=f"prefetch-{name}-")
        runs[name] = {"model": model, "opt": opt, "flag": flag, "cache": cache,
                      "fn": torch.compile(_own_frame(model, name), backend="dist"),
                      "losses": [], "times": []}

    def step(run, ids):
        os.environ["DYNAMO_DIST_PREFETCH"] = run["flag"]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = run["cache"]
        loss = run["fn"](input_ids=ids, labels=ids).loss
        loss.backward()
        run["opt"].step()
        run["opt"].zero_grad(set_to_none=True)
        return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss)

    for name, run in runs.items():  # the first call compiles
        before = len(compile_records())
        dist.barrier()
        t = time.perf_counter()
        run["losses"].append(step(run, batches[0]))
        run["first_call_s"] = time.perf_counter() - t
        record = compile_records()[-1]
        joint = record.step.joint
        run["prefetched"] = [len(p.layers) for p in joint.prefetched]
        if len(compile_records()) == before or (run["flag"] == "0" and any(run["prefetched"])):
            raise RuntimeError(f"{name}: not a compile of its own ({run['prefetched']})")
        run["predicted_peak_mib"] = joint.predicted_peak.peak_bytes / 2 ** 20
        run["issued"] = dict(joint.issued)
    for i, ids in enumerate(batches[1:args.warmup + args.steps + 1]):
        for run in runs.values():
            dist.barrier()
            t = time.perf_counter()
            run["losses"].append(step(run, ids))
            if i >= args.warmup:
                run["times"].append((time.perf_counter() - t) * 1e3)
    tail = batches[args.warmup + args.steps + 1:]
    for run in runs.values():
        def one(run=run, ids=tail[0]):
            step(run, ids)
        run["wait_ms"] = _exposed_wait_ms(one, args.profile)
        resident = local_bytes(p for p in run["model"].parameters())
        dist.barrier()
        run["peak"] = step_peak(one, torch.device("cpu"), resident)
    if rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return
    torch.manual_seed(0)
    ref = build_llama(size)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    ref_losses = []
    for ids in batches[:args.warmup + args.steps + 1]:
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(float(loss))
    out = {"mesh": args.mesh, "layers": args.layers, "steps": args.steps,
           "warmup": args.warmup, "profiled_steps": args.profile,
           "torch": torch.__version__, "cores": os.cpu_count(),
           "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
           "load_avg_1min": os.getloadavg()[0], "variants": {}}
    for name, run in runs.items():
        q = statistics.quantiles(run["times"], n=4)
        rel = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref_losses))
        out["variants"][name] = {
            "DYNAMO_DIST_PREFETCH": run["flag"], "first_call_s": run["first_call_s"],
            "step_ms_median": statistics.median(run["times"]), "step_ms_q1": q[0],
            "step_ms_q3": q[2], "step_ms_all": run["times"],
            "exposed_wait_ms_median": statistics.median(run["wait_ms"]),
            "exposed_wait_ms_all": run["wait_ms"],
            "peak_mib": run["peak"]["peak_bytes"] / 2 ** 20,
            "predicted_peak_mib": run["predicted_peak_mib"],
            "layers_prefetched_fw_bw": run["prefetched"], "issued": run["issued"],
            "losses": run["losses"], "max_loss_rel_diff_vs_eager_1p": rel}
    on, off = out["variants"]["prefetch"], out["variants"]["no_prefetch"]
    out["ratios_on_over_off"] = {k: on[k] / off[k] for k in (
        "step_ms_median", "exposed_wait_ms_median", "peak_mib", "predicted_peak_mib")
        if off[k]}
    out["max_loss_rel_diff_on_vs_off"] = max(
        abs(a - b) / abs(b) for a, b in zip(on["losses"], off["losses"]))
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _markdown(results: list[dict]) -> str:
    lines = ["# Prefetch of the next layer's gathers, on and off", "",
             "Generated by `python -m benchmarks.prefetch` (see its docstring). Real gloo ranks "
             "on CPU, one intra-op thread each; the two variants' steps alternate in one run. "
             "Ratios are prefetch on / off.", "",
             "| mesh | layers | variant | step median (ms) | IQR | exposed wait (ms/step) | "
             "peak (MiB) | predicted peak (MiB) | layers prefetched (fw, bw) | "
             "max loss rel. diff vs eager 1p |",
             "|---|--:|---|--:|---|--:|--:|--:|---|--:|"]
    for r in results:
        for name, v in r["variants"].items():
            lines.append(
                f"| {r['mesh']} | {r['layers']} | {name} | {v['step_ms_median']:.1f} | "
                f"{v['step_ms_q1']:.1f}-{v['step_ms_q3']:.1f} | "
                f"{v['exposed_wait_ms_median']:.1f} | {v['peak_mib']:.1f} | "
                f"{v['predicted_peak_mib']:.1f} | {v['layers_prefetched_fw_bw']} | "
                f"{v['max_loss_rel_diff_vs_eager_1p']:.1e} |")
    lines.append("")
    for r in results:
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in r["ratios_on_over_off"].items())
        lines.append(f"- {r['mesh']}, {r['layers']} layers ({r['timestamp']}, torch "
                     f"{r['torch']}, {r['cores']} cores, load {r['load_avg_1min']:.2f}): "
                     f"{ratios}; losses on vs off: max rel. diff "
                     f"{r['max_loss_rel_diff_on_vs_off']:.1e}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", nargs="+", default=["dp=4", "dp=2,tp=2"],
                    help="meshes, each 'axis=size[,axis=size]' over 'dp' and 'tp'")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=5, help="profiled steps per variant")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.mesh = args.mesh[0]
        worker(args)
        return 0
    results = []
    for mesh in args.mesh:
        world = 1
        for n in _mesh(mesh)[0]:
            world *= n
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "-m", "benchmarks.prefetch",
               "--worker", "--mesh", mesh, "--layers", str(args.layers), "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--profile", str(args.profile)]
        print(f"== {mesh}: {world} gloo ranks", flush=True)
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=3600)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            return 1
        results.append(json.loads(line[len("RESULT "):]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefetch.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = _markdown(results)
    with open(os.path.join(args.out, "prefetch.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
