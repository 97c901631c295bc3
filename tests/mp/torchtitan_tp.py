"""torchtitan's Llama 3 debug model, torchtitan's own tensor-parallel plan, tp=2 on gloo:
``backend="dist"`` trains 5 AdamW steps at parity with one process, sequence parallel off and
on, in one graph with no break, issuing no more collectives per step than eager DTensor does
on the same model (what ``backend="inductor"`` compiles; benchmarks/torchtitan_tp.py measures
that one). Two losses: the logits gathered then one cross entropy (the model compiled alone),
and torchtitan's own vocabulary-parallel loss on the split logits, compiled in one graph with
the model (its local code and all_reduces inside a manual region). Prints one JSON line per
run on rank 0.

usage: torchrun --nproc-per-node 2 tests/mp/torchtitan_tp.py"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_exit import finish  # noqa: E402
from parity import grad_rel  # noqa: E402

from dynamo_dist import clear_compile_records, compile_records  # noqa: E402
from inductor_passes.core.compat import graph_break_reasons  # noqa: E402
from dynamo_dist.testing import torchtitan as titan  # noqa: E402

STEPS = 5


def per_step_collectives(step_loss, size, step) -> int:
    ids, pos = titan.batch(size, step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step_loss(ids, pos).backward()
    return sum(titan.collectives(prof).values())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    size = titan.TitanSize()
    for loss_name, sp in (("gather", False), ("gather", True), ("parallel", False),
                          ("parallel", True)):
        torch._dynamo.reset()
        clear_compile_records()
        ref, model, _ = titan.build(size, tp=2, sequence_parallel=sp)
        loss_fn = titan.LOSSES[loss_name]

        def eager_loss(ids, pos, model=model, loss_fn=loss_fn):
            return loss_fn(model(ids, pos), ids)

        eager = per_step_collectives(eager_loss, size, 99)
        model.zero_grad(set_to_none=True)
        if loss_name == "gather":  # the model alone: the loss gathers its logits outside
            compiled_model = torch.compile(model, backend="dist")

            def compiled(ids, pos, loss_fn=loss_fn):
                return loss_fn(compiled_model(ids, pos), ids)
        else:  # model and loss in one graph
            compiled = torch.compile(eager_loss, backend="dist")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        worst = 0.0
        for step in range(STEPS):
            ids, pos = titan.batch(size, step)
            loss = compiled(ids, pos)
            loss.backward()
            ref_loss = loss_fn(ref(ids, pos), ids)
            ref_loss.backward()
            if step == 0:  # AdamW's losses barely see a gradient off by a constant factor
                grads = grad_rel(model.parameters(), ref.parameters())
            opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
            rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            worst = max(worst, rel)
        ours = per_step_collectives(compiled, size, 100)
        opt.zero_grad()
        if rank == 0:
            print(json.dumps({"loss": loss_name, "sp": sp, "loss_rel": worst,
                              "grad_rel": grads, "graphs": len(compile_records()),
                              "breaks": len(graph_break_reasons()), "collectives": ours,
                              "eager_dtensor_collectives": eager}), flush=True)
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
