"""torchtitan's Llama 3 debug model, torchtitan's own tensor-parallel plan, tp=2 on gloo:
``backend="dist"`` trains 5 AdamW steps at parity with one process, sequence parallel off and
on, in one graph with no break, issuing no more collectives per step than eager DTensor does
on the same model (what ``backend="inductor"`` compiles; benchmarks/torchtitan_tp.py measures
that one). Prints one JSON line per run on rank 0.

usage: torchrun --nproc-per-node 2 tests/mp/torchtitan_tp.py"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_exit import finish  # noqa: E402

from dynamo_dist import clear_compile_records, compile_records  # noqa: E402
from dynamo_dist._compat import graph_break_reasons  # noqa: E402
from dynamo_dist.testing import torchtitan as titan  # noqa: E402

STEPS = 5


def per_step_collectives(run, size, step) -> int:
    ids, pos = titan.batch(size, step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        titan.loss_of(run(ids, pos), ids).backward()
    # the loss gathers the logits outside the model (one all_gather for every contestant)
    return sum(titan.collectives(prof).values())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    size = titan.TitanSize()
    for sp in (False, True):
        torch._dynamo.reset()
        clear_compile_records()
        ref, model, _ = titan.build(size, tp=2, sequence_parallel=sp)
        eager = per_step_collectives(model, size, 99)
        model.zero_grad(set_to_none=True)
        compiled = torch.compile(model, backend="dist")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        worst = 0.0
        for step in range(STEPS):
            ids, pos = titan.batch(size, step)
            loss = titan.loss_of(compiled(ids, pos), ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = titan.loss_of(ref(ids, pos), ids)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            worst = max(worst, rel)
        ours = per_step_collectives(compiled, size, 100)
        opt.zero_grad()
        if rank == 0:
            print(json.dumps({"sp": sp, "loss_rel": worst, "graphs": len(compile_records()),
                              "breaks": len(graph_break_reasons()), "collectives": ours,
                              "eager_dtensor_collectives": eager}), flush=True)
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
