"""The main job: train a small Llama with ``backend="dist"`` on CPU ranks and check it against one
process.

    python -m dynamo_dist.testing.demo                  # tp=2 on 2 ranks (launches torchrun itself)
    python -m dynamo_dist.testing.demo --mesh dp=2,tp=2 # 4 ranks

Prints per step the loss, the single-process reference loss and their difference; then compile
time, median step time, the collective ledger of one step, the largest first-step gradient
difference and the largest final parameter difference. Exits 1 when a loss or a first-step
gradient leaves the fp32 tolerance (relative, default 1e-4), or a final parameter leaves
``--param-tol`` (relative Frobenius per tensor, default 1e-3: after AdamW steps, gradient elements
at rounding level take Adam's update of about ``lr * sign(g)``, whose sign follows the reduction
order; torch's own DTensor eager differs from one process by 2.1e-4 on this model, see
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from inductor_passes.core.ledger import CollectiveLedger

from ..backend import compile_records
from .models import LlamaSize, build_llama, token_batch
from ..plans import DataParallelPlanner, TensorParallelPlanner, shard_module


def parse_mesh(text: str) -> dict[str, int]:
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--mesh: cannot read '{part}' (expected NAME=SIZE, e.g. dp=2,tp=2)")
        axes[name.strip()] = int(size)
    return axes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="tp=2", help="mesh axes, e.g. tp=2 or dp=2,tp=2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                    help="shard parameters over the dp axis (default) or replicate them (DDP)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="the Llama's attention: transformers' default (sdpa: the fused kernel) "
                         "or eager (matmul + softmax)")
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="relative fp32 tolerance of losses and first-step gradients")
    ap.add_argument("--param-tol", type=float, default=1e-3,
                    help="relative tolerance of the final parameters (AdamW amplifies rounding)")
    ap.add_argument("--no-inductor", action="store_true", help="run the local graphs as FX graphs")
    args = ap.parse_args(argv)
    axes = parse_mesh(args.mesh)
    world = math.prod(axes.values())
    if "RANK" not in os.environ:  # launch ourselves under torchrun
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "-m", "dynamo_dist.testing.demo", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd)
    return run(args, axes)


def run(args, axes: dict[str, int]) -> int:
    import torch.distributed as dist
    from rich.console import Console
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    console = Console(highlight=False)
    say = console.print if rank == 0 else (lambda *a, **k: None)
    if dist.get_world_size() != math.prod(axes.values()):
        raise SystemExit(f"mesh {axes} needs {math.prod(axes.values())} ranks, "
                         f"got {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    size = LlamaSize(layers=args.layers, batch=args.batch, seq=args.seq)
    ref = build_llama(size, attn=args.attn)
    model = copy.deepcopy(ref)

    plan = None
    if "tp" in axes:
        plan = TensorParallelPlanner(axis="tp").build_plan(model)
    if "dp" in axes:
        plan = DataParallelPlanner(axis="dp", shard_params=args.fsdp,
                                   mesh_axis_size=axes["dp"]).build_plan(model, plan)
    shard_module(model, mesh, plan)
    say(f"[bold]dynamo_dist demo[/]: Llama {size}, mesh {axes}, {args.steps} steps, AdamW")

    compiled = torch.compile(model, backend="dist",
                             options={"inductor": not args.no_inductor})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    worst, step_times, first = 0.0, [], None
    say(f"{'step':>4} {'loss':>12} {'reference':>12} {'abs diff':>10} {'rel diff':>10}")
    for step in range(args.steps):
        ids = token_batch(size, step)
        t = time.perf_counter()
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        if step == 0:  # the gradients themselves, before AdamW amplifies rounding differences
            grads0 = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        loss = out.loss.full_tensor().item() if isinstance(out.loss, DTensor) else out.loss.item()
        dt = time.perf_counter() - t
        if step == 0:
            first = dt
        else:
            step_times.append(dt)
        ref_out = ref(input_ids=ids, labels=ids)
        ref_out.loss.backward()
        if step == 0:
            grad_rel = max(((g - q.grad).norm() / q.grad.norm().clamp_min(1e-12)).item()
                           for g, q in zip(grads0, ref.parameters()))
        ref_opt.step()
        ref_opt.zero_grad()
        r = ref_out.loss.item()
        rel = abs(loss - r) / max(abs(r), 1e-12)
        worst = max(worst, rel)
        say(f"{step:>4} {loss:>12.6f} {r:>12.6f} {abs(loss - r):>10.2e} {rel:>10.2e}")

    records = compile_records()
    ledger = CollectiveLedger()
    for rec in records:
        ledger = ledger.merged(rec.ledger)
    compile_s = sum(sum(r.seconds.values()) for r in records)
    say(f"compile: first step {first:.1f} s (backend {compile_s:.1f} s: " +
        ", ".join(f"{k} {sum(r.seconds[k] for r in records):.1f}" for k in records[0].seconds) +
        f"), graphs {len(records)}")
    outlined = [o for r in records if r.step is not None for o in r.step.joint.outlined]
    if outlined:
        say("Inductor: " + "; ".join(
            f"{half}: {o.calls} layer calls share {len(o.bodies)} compiled bod"
            f"{'y' if len(o.bodies) == 1 else 'ies'}"
            for half, o in zip(("forward", "backward") * len(records), outlined)))
    peaks = [r.predicted_peak() for r in records if r.predicted_peak() is not None]
    if peaks:
        say(f"memory: {max(peaks, key=lambda e: e.peak_bytes)}")
    if step_times:
        say(f"step time: median {statistics.median(step_times) * 1e3:.1f} ms over "
            f"{len(step_times)} steps")
    if rank == 0:
        console.print(ledger.to_table())
    fallbacks = [f for r in records for f in r.plan.fallbacks]
    for f in fallbacks:
        say(f"[yellow]replicated fallback:[/] {f}")

    param_rel, param_abs = 0.0, 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        q = q.detach()
        param_abs = max(param_abs, (full - q).abs().max().item())
        param_rel = max(param_rel, ((full - q).norm() / q.norm().clamp_min(1e-12)).item())
    say(f"largest loss difference (relative): {worst:.2e}; largest first-step gradient "
        f"difference: {grad_rel:.2e} relative (Frobenius, per tensor); tolerance {args.tol:.0e}")
    say(f"largest final parameter difference: {param_rel:.2e} relative (Frobenius, per tensor), "
        f"{param_abs:.2e} absolute; tolerance {args.param_tol:.0e}")
    ok = worst <= args.tol and grad_rel <= args.tol and param_rel <= args.param_tol
    say("[green]PASS[/]" if ok else "[red]FAIL[/]: outside tolerance")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
