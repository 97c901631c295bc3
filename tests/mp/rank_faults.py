"""Run under torchrun (gloo, 2 or 4 ranks). One rank's compilation fails at each stage (capture,
planning on the planning rank, lowering) while its process stays alive: every rank must raise
within seconds, the others with an error naming the failing rank and its message, instead of
blocking in the plan hand-off or the schedule check. Prints "FAULT <stage> rank <r> <seconds>
<message head>" per rank and stage; exits non-zero on a rank that compiled or hung."""

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dynamo_dist.backend as backend

INJECTED = "injected failure"


def _failing(original, stage):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{INJECTED} in {stage}")
    return fail


def main() -> int:
    os.environ["DYNAMO_DIST_PLAN_CACHE"] = "0"  # the plan must be made, not read
    os.environ["DYNAMO_DIST_PLAN_TIMEOUT"] = "60"  # a hang shows as a timeout, not forever
    os.environ["DYNAMO_DIST_SCHEDULE_TIMEOUT"] = "60"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    # stage -> (the backend's function to break, the rank it breaks on): the planner runs on the
    # mesh's first rank only, so planning fails there; the others fail on the last rank
    stages = {"capture": ("trace_joint", world - 1), "planning": ("propagate", 0),
              "lowering": ("lower", world - 1)}
    ok = True
    for n, (stage, (name, bad_rank)) in enumerate(stages.items()):
        original = getattr(backend, name)
        if rank == bad_rank:
            setattr(backend, name, _failing(original, stage))
        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])

        def step(x, w):  # a new function per stage: a fresh compilation, nothing cached
            return (x @ w.t()).relu().sum() * (n + 1)

        t = time.perf_counter()
        try:
            torch.compile(step, backend="dist", fullgraph=True, options={"inductor": False})(
                torch.randn(3, 4), w)
        except Exception as exc:
            msg = str(exc)
            seconds = time.perf_counter() - t
            mine = rank == bad_rank
            expect = f"{INJECTED} in {stage}" if mine else f"rank {bad_rank} failed"
            if expect not in msg or (not mine and f"{INJECTED} in {stage}" not in msg):
                print(f"rank {rank} {stage}: unexpected error:\n{msg}", flush=True)
                ok = False
            head = next((ln for ln in msg.splitlines() if INJECTED in ln or "PeerFailed" in ln),
                        "")[:120]
            print(f"FAULT {stage} rank {rank} {seconds:.1f} {head}", flush=True)
        else:
            print(f"rank {rank} {stage}: compiled despite the failure", flush=True)
            ok = False
        setattr(backend, name, original)
        torch._dynamo.reset()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
