"""Cold compile time against model depth, with and without compiling each distinct layer once.

    python -m benchmarks.depth [--layers 2 4 8 16 32] [--mesh dp=2,tp=2] [--device cpu]
    python -m benchmarks.depth --device cuda --mesh tp=1 --baseline   # a GPU, world size 1

The demo-width Llama (``LlamaSize``: hidden 256, 8 heads, seq 128, batch 8; only the layer count
varies), sharded by the stock planners (Megatron on ``tp``, FSDP on ``dp``), one forward +
backward compiled with ``backend="dist"`` and Inductor. Every (depth, variant) runs in a fresh
process with an empty Inductor cache directory and the plan cache off: a cold compile. Variants:
``outline`` (the default: repeated layers share one compiled body, ``inductor_passes.outline``,
and lowering copies repeated layers, ``inductor_passes.stamp``), ``inline``
(``DYNAMO_DIST_OUTLINE=0``: every layer compiled in place), ``unstamped`` (outlined, but
``DYNAMO_DIST_STAMP=0``: every layer lowered node by node) and ``prefetched`` (outlined, and
``DYNAMO_DIST_PREFETCH=1``: each layer's gathers issued a layer early by the calling graph, not
inside its shared body; off by default on CPU), ``wholecut`` (outlined, but
``DYNAMO_DIST_LAYER_PARTITION=0``: the min-cut partitioner over the whole joint graph rather
than once per distinct layer, ``inductor_passes.layer_partition``), ``traced`` (outlined, but
``DYNAMO_DIST_CAPTURE_STAMP=0``: capture traces every layer op by op rather than copying one
traced layer, ``dynamo_dist.layer_capture``), ``fullgc`` (``DYNAMO_DIST_FULL_GC=1``: Python's
full garbage collections run on their own schedule during the backend's compile, not paused),
``noprobe`` (``DYNAMO_DIST_CPU_PROBE=0``: Inductor probes the CPU's vector instructions when its
first C++ kernel needs them, not on a thread from the start of the compile,
``inductor_passes.cpu_probe``), ``latekernels`` (``DYNAMO_DIST_EARLY_KERNELS=0``: each C++
kernel goes to g++ when Inductor loads its graph's module, not as it is generated,
``inductor_passes.early_kernels``), ``loadwait`` (``DYNAMO_DIST_DEFERRED_LOADS=0``: the
forward's module waits for its kernels when loaded, before the backward is generated),
``serial`` (the last three off: g++ runs only while the compile waits for it, as before
2026-12-07) and ``perblock`` (each decoder layer compiled on
its own with ``dynamo_dist.compile_blocks``, torchtitan's way: the embedding, final
norm and head run eagerly on DTensors, and Dynamo reuses one compiled block for every layer;
its stages are summed over the graphs compiled, ``graphs``).

On CPU with a mesh of more than one rank the process is rank 0 of torch's ``fake`` process group
(collectives compiled, never run): compile times only. With a mesh of one rank (``tp=1``) the
process group is real (gloo on CPU, nccl on CUDA), so the compiled step also runs: the median of
``--steps`` timed steps after two warm-ups, and the loss and every gradient against the same
model in eager mode (relative errors). ``--baseline`` adds plain ``torch.compile(model)``
(Inductor, one device) at each depth: its cold compile and step time, the ``world size 1
overhead`` the issue asks for.

Reported per run (seconds): first call (Dynamo + every backend stage + the first step), the
backend's stages (capture, plan, lower, schedule check, inductor: partitioning and Inductor),
Dynamo's share (first call minus the backend and one step), the layer calls that share a compiled
body (forward, backward). Results: ``benchmarks/results/depth-<device>.json`` (every run, the
machine, and the ratios: each variant's first call at the largest depth over the smallest, and
outline / each other variant per depth) and ``depth-<device>.md``. One cold compile
per cell (they take minutes); the machine's load average is recorded at each run's start and
end.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _child(args) -> dict:
    """One cold compile in this process; the row as a dict."""
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.bench.machine import load_average
    from dynamo_dist import compile_records
    from dynamo_dist.plans import shard_module
    from dynamo_dist.testing.demo import parse_mesh
    from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch
    from dynamo_dist.testing.zoo.cell import plan_model

    row = {"layers": args.layers, "variant": args.variant, "load_start": load_average()}
    axes = parse_mesh(args.mesh)
    world = math.prod(axes.values())
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    size = LlamaSize(layers=args.layers)
    ids = token_batch(size, 0).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed_steps(fn) -> float:
        for _ in range(2):
            fn()
        sync()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    if args.variant == "inductor":  # plain torch.compile, one device
        model = build_llama(size).to(device)
        compiled = torch.compile(model)

        def step():
            compiled(input_ids=ids, labels=ids).loss.backward()

        t = time.perf_counter()
        step()
        sync()
        row["first_call_s"] = time.perf_counter() - t
        row["step_s"] = timed_steps(step)
        row["load_end"] = load_average()
        return row

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0,
                                world_size=1)
    mesh = init_device_mesh(device.type, tuple(axes.values()), mesh_dim_names=tuple(axes))
    ref = build_llama(size).to(device)
    model = build_llama(size).to(device)
    shard_module(model, mesh, plan_model(model, axes))
    # "dist" is an entry point of the installed package; run from a checkout, pass the function
    import dynamo_dist
    backend = "dist" if "dist" in torch._dynamo.list_backends() else dynamo_dist.dist_backend
    if args.variant == "perblock":  # each decoder layer compiled on its own (torchtitan's way)
        dynamo_dist.compile_blocks(model, backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)

    def step():
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss

    t = time.perf_counter()
    loss = step()
    sync()
    row["first_call_s"] = time.perf_counter() - t
    records = compile_records()
    rec = records[-1]
    stages: dict[str, float] = {}
    for r in records:  # one record per compiled graph (several only for ``perblock``)
        for k, v in r.seconds.items():
            stages[k] = stages.get(k, 0.0) + v
    row["stages_s"] = {k: round(v, 3) for k, v in stages.items()}
    row["graphs"] = len(records)
    row["outlined"] = [f"{o.calls}/{len(o.bodies)}" for o in rec.step.joint.outlined]
    if world == 1:  # a real process group: the step ran; check it and time it
        from torch.distributed.tensor import DTensor

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        row["loss_rel"] = abs(full(loss).item() - ref_loss.item()) / abs(ref_loss.item())
        row["grad_rel"] = max(
            ((full(p.grad) - q.grad).norm() / q.grad.norm().clamp_min(1e-12)).item()
            for p, q in zip(model.parameters(), ref.parameters()))
        one = timed_steps(step)
        row["step_s"] = one
    backend = sum(stages.values())
    row["dynamo_s"] = row["first_call_s"] - backend - row.get("step_s", 0.0)
    row["load_end"] = load_average()
    dist.destroy_process_group()
    return row


def _run(args, layers: int, variant: str, port: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.depth", "--child", "--layers", str(layers),
           "--variant", variant, "--mesh", args.mesh, "--device", args.device,
           "--steps", str(args.steps), "--port", str(port)]
    with tempfile.TemporaryDirectory(prefix="depth-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, DYNAMO_DIST_PLAN_CACHE="0",
                   DYNAMO_DIST_OUTLINE="0" if variant == "inline" else "1",
                   DYNAMO_DIST_STAMP="0" if variant == "unstamped" else "1",
                   DYNAMO_DIST_PREFETCH="1" if variant == "prefetched" else "auto",
                   DYNAMO_DIST_LAYER_PARTITION="0" if variant == "wholecut" else "1",
                   DYNAMO_DIST_CAPTURE_STAMP="0" if variant == "traced" else "1",
                   DYNAMO_DIST_FULL_GC="1" if variant == "fullgc" else "0",
                   DYNAMO_DIST_CPU_PROBE="0" if variant in ("noprobe", "serial") else "1",
                   DYNAMO_DIST_EARLY_KERNELS="0" if variant in ("latekernels", "serial")
                   else "1",
                   DYNAMO_DIST_DEFERRED_LOADS="0" if variant in ("loadwait", "serial") else "1",
                   PYTHONPATH=ROOT)
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=args.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")]
    if proc.returncode or not lines:
        return {"layers": layers, "variant": variant, "error": (proc.stdout + proc.stderr)[-2000:],
                "wall_s": time.perf_counter() - t}
    return json.loads(lines[-1][4:])


def _ratios(rows: list[dict]) -> dict:
    ok = [r for r in rows if "first_call_s" in r]
    out: dict = {}
    for variant in sorted({r["variant"] for r in ok}):
        mine = sorted((r for r in ok if r["variant"] == variant), key=lambda r: r["layers"])
        if len(mine) > 1:
            out[f"{variant}: first call, {mine[-1]['layers']} / {mine[0]['layers']} layers"] = \
                round(mine[-1]["first_call_s"] / mine[0]["first_call_s"], 3)
    for layers in sorted({r["layers"] for r in ok}):
        at = {r["variant"]: r for r in ok if r["layers"] == layers}
        for other in ("inline", "unstamped", "prefetched", "wholecut", "traced", "fullgc",
                      "noprobe", "latekernels", "loadwait", "serial", "inductor"):
            if "outline" in at and other in at:
                out[f"{layers} layers: first call, outline / {other}"] = round(
                    at["outline"]["first_call_s"] / at[other]["first_call_s"], 3)
                if "step_s" in at["outline"] and "step_s" in at[other]:
                    out[f"{layers} layers: step, outline / {other}"] = round(
                        at["outline"]["step_s"] / at[other]["step_s"], 3)
    return out


def _markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Cold compile against depth ({result['device']}, mesh {result['mesh']})", "",
             f"Generated by `python -m benchmarks.depth` (see its docstring) on "
             f"{result['date']}: torch {m['torch']}, {m['cores']} cores ({m['cpu']})"
             f"{', ' + m['gpu'] if m.get('gpu') else ''}. One cold compile per cell.", "",
             "| layers | variant | first call | Dynamo | capture | plan | lower | inductor | "
             "layer calls sharing a body (fw, bw) | step (median) | loss / grad vs eager | "
             "load start / end |",
             "|--:|---|--:|--:|--:|--:|--:|--:|---|--:|---|---|"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['layers']} | {r['variant']} | failed: "
                         f"{r['error'].strip().splitlines()[-1][:120]} |")
            continue
        st = r.get("stages_s", {})

        def s(key, st=st):
            return f"{st[key]:.1f}" if key in st else "-"
        check = f"{r['loss_rel']:.1e} / {r['grad_rel']:.1e}" if "loss_rel" in r else "-"
        step = f"{r['step_s'] * 1e3:.1f} ms" if "step_s" in r else "-"
        dynamo = f"{r['dynamo_s']:.1f}" if "dynamo_s" in r else "-"
        load = [f"{r[k][0]}" if r.get(k) else "-" for k in ("load_start", "load_end")]
        graphs = f" ({r['graphs']} graphs)" if r.get("graphs", 1) > 1 else ""
        lines.append(
            f"| {r['layers']} | {r['variant']} | {r['first_call_s']:.1f} | {dynamo} | "
            f"{s('capture')} | {s('plan')} | {s('lower')} | {s('inductor')} | "
            f"{', '.join(r.get('outlined', [])) or '-'}{graphs} | {step} | {check} | "
            f"{load[0]} / {load[1]} |")
    lines += ["", "Ratios:", ""] + [f"- {k}: {v}" for k, v in result["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--variants", nargs="+", default=["outline", "inline"],
                    choices=["outline", "inline", "unstamped", "prefetched", "wholecut", "traced",
                             "fullgc", "noprobe", "latekernels", "loadwait", "serial",
                             "perblock"])
    ap.add_argument("--baseline", action="store_true",
                    help="also plain torch.compile (Inductor, one device) at each depth")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (world size 1)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--out", default=None, help="JSON path (default results/depth-<device>.json)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="outline", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29571, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.layers = args.layers[0]
        print("ROW " + json.dumps(_child(args)), flush=True)
        return 0
    sys.path.insert(0, ROOT)
    import torch

    from benchmarks.bench.machine import machine_info
    from dynamo_dist.testing.demo import parse_mesh

    variants = list(args.variants) + (["inductor"] if args.baseline else [])
    runs = []
    for k, layers in enumerate(args.layers):
        for j, variant in enumerate(variants):
            row = _run(args, layers, variant, 29571 + 7 * k + j)
            runs.append(row)
            print(json.dumps(row), flush=True)
    machine = machine_info(torch.device(args.device),
                           math.prod(parse_mesh(args.mesh).values()))
    if args.device == "cuda" and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device,
              "mesh": args.mesh, "machine": machine, "runs": runs, "ratios": _ratios(runs)}
    out = args.out or os.path.join(RESULTS, f"depth-{args.device}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(out[:-len(".json")] + ".md", "w") as f:
        f.write(_markdown(result))
    print(f"wrote {out}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
