"""One zoo cell in its own process(es): on real gloo ranks, ``torchrun --nproc-per-node N -m
dynamo_dist.testing.zoo.worker MODEL MESH OUT.json [--steps S] [--no-inductor] [--per-block]
[--autocast] [--checkpointing]``
(rank 0 writes the cell's result row, JSON, to OUT.json); on simulated ranks, ``python -m
dynamo_dist.testing.zoo.worker --sim MODEL MESH OUT.json``; ``--cuda``: real ranks on GPUs
(``CudaRuntime``)."""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from inductor_passes.core import compat

from .cell import CudaRuntime, Runtime, SimRuntime, run_cell
from .models import MODELS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("mesh")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--sim", action="store_true", help="every rank simulated in this process")
    ap.add_argument("--cuda", action="store_true", help="real ranks on GPUs (Triton kernels)")
    ap.add_argument("--per-block", action="store_true",
                    help="compile each repeated block on its own, the rest eager")
    ap.add_argument("--autocast", action="store_true", help="the forward under bf16 autocast")
    ap.add_argument("--checkpointing", action="store_true",
                    help="transformers' gradient checkpointing on both sides")
    args = ap.parse_args()
    if args.sim:
        row = run_cell(MODELS[args.model], args.mesh, SimRuntime(), args.steps,
                       per_block=args.per_block, autocast=args.autocast,
                       checkpointing=args.checkpointing)
        _write(row, args.out)
        return 0
    rt = CudaRuntime(inductor=not args.no_inductor) if args.cuda else \
        Runtime(inductor=not args.no_inductor)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group(CudaRuntime.backend(world) if args.cuda else "gloo")
    row = run_cell(MODELS[args.model], args.mesh, rt, args.steps, per_block=args.per_block,
                   autocast=args.autocast, checkpointing=args.checkpointing)
    row["rank_status"] = _gather_status(row["status"])
    if dist.get_rank() == 0:
        _write(row, args.out)
    dist.destroy_process_group()
    return 0


def _write(row: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(row, f, default=str)
    os.replace(tmp, path)


def _gather_status(status: str) -> list[str]:
    """Every rank's status (a rank that fails alone must show): gathered through the store,
    which cannot hang on a rank that already failed."""
    store = compat.default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"zoo_status_{rank}", status)
    return [store.get(f"zoo_status_{r}").decode() for r in range(world)]


if __name__ == "__main__":
    raise SystemExit(main())
