"""torchtitan's Llama 3 debug model on a 2 x 2 mesh: FSDP2 (torchtitan's
``apply_fsdp_to_decoder``) over torchtitan's own tensor-parallel plan, each dp rank on its half
of the batch, the step (model and torchtitan's vocabulary-parallel loss) compiled with each
backend in ``argv[1]`` (comma-separated) in turn. Checks the first step's gradients (every
parameter, gathered) and 3 AdamW steps' losses against one process on the whole batch: AdamW
barely sees a gradient off by a constant factor, so the gradients are compared directly. Prints
one JSON line per backend on rank 0: loss and gradient errors, graphs, graph breaks, the
compiled graphs' planned collectives and the collectives of one step (``torch.profiler``).

usage: torchrun --nproc-per-node 4 tests/mp/torchtitan_fsdp_tp.py dist,inductor[,eager]"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_exit import finish  # noqa: E402
from parity import full, grad_rel  # noqa: E402

from dynamo_dist import clear_compile_records, compile_records  # noqa: E402
from inductor_passes.core.compat import graph_break_reasons  # noqa: E402
from dynamo_dist.testing import torchtitan as titan  # noqa: E402

STEPS = 3


def run(backend: str) -> dict:
    """Train with ``backend``; the row rank 0 prints."""
    torch._dynamo.reset()
    clear_compile_records()
    dp = 2
    size = titan.TitanSize(batch=4)
    ref, model, dims = titan.build(size, tp=2, sequence_parallel=False, dp_shard=dp)
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    half = slice(dp_rank * size.batch // dp, (dp_rank + 1) * size.batch // dp)

    def step_loss(ids, pos):
        return titan.vocab_parallel_loss(model(ids, pos), ids)

    run_step = step_loss if backend == "eager" else torch.compile(step_loss, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss_err = grad_err = 0.0
    for step in range(STEPS):
        ids, pos = titan.batch(size, step)
        loss = run_step(ids[half], pos[half])
        loss.backward()
        ref_loss = titan.vocab_parallel_loss(ref(ids, pos), ids)
        ref_loss.backward()
        if step == 0:
            grad_err = grad_rel(model.parameters(), ref.parameters())
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        mean = full(loss).detach().clone()  # each dp rank's loss is its half's mean
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        loss_err = max(loss_err, abs(mean.item() - ref_loss.item()) / abs(ref_loss.item()))
    ids, pos = titan.batch(size, STEPS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_step(ids[half], pos[half]).backward()
    counts = titan.collectives(prof)
    planned: dict[str, int] = {}  # the compiled graphs' collectives, by kind and mesh axis
    for record in compile_records():
        for e in record.ledger.entries:
            key = f"{e.kind}@{e.mesh_axis}"
            planned[key] = planned.get(key, 0) + 1
    return {"backend": backend, "loss_rel": loss_err, "grad_rel": grad_err, "planned": planned,
            "graphs": len(compile_records()), "breaks": len(graph_break_reasons()),
            "collectives": sum(counts.values()), "by_op": counts}


def main() -> None:
    dist.init_process_group("gloo")
    for backend in sys.argv[1].split(","):
        row = run(backend)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
