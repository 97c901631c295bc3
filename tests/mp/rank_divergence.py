"""Run under torchrun (gloo, 2 ranks). A rank-specialised program whose ranks issue the same
collectives compiles and runs; one whose collective exists on rank 0 only fails compilation on
EVERY rank with a clear error (instead of rank 0 hanging in its all_reduce); one that calls
another op per rank is refused on every rank (the planning rank's plan does not fit). Prints
"DIVERGENCE CAUGHT rank <r>" and "OTHER PROGRAM CAUGHT rank <r>"; exits non-zero otherwise."""

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor



def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def same_schedule(x):  # specialised per rank, same collectives: fine
        return funcol.all_reduce(x + dist.get_rank(), "sum", mesh) * 2

    out = torch.compile(same_schedule, backend="dist", fullgraph=True)(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 6.0)), out

    def rank_zero_only(x):
        if dist.get_rank() == 0:
            x = funcol.all_reduce(x, "sum", mesh)
        return x * 2

    try:
        torch.compile(rank_zero_only, backend="dist", fullgraph=True)(torch.ones(4))
    except Exception as exc:  # Dynamo wraps backend errors (BackendCompilerFailed)
        msg = str(exc)
        assert "DistCompileError" in msg, msg
        assert "rank divergence" in msg and "rank 1: no collective" in msg, msg
        assert "rank 0: all_reduce" in msg, msg
        assert 'rank_divergence.py", line' in msg and 'x = funcol.all_reduce(x, "sum", mesh)' \
            in msg, msg  # the user's line, not torch's
        print(f"DIVERGENCE CAUGHT rank {rank}:\n{msg}", flush=True)
    else:
        print(f"rank {rank}: the divergent program compiled", flush=True)
        return 1

    # another op per rank (a Python branch on the rank): the plan made on rank 0 does not fit
    # rank 1's program (it was a KeyError there); both raise, rank 0 through rank 1's failure
    def rank_dependent_op(x, w):
        op = torch.sin if dist.get_rank() == 0 else torch.cos
        return op(x @ w.t()).sum()

    w = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    try:
        torch.compile(rank_dependent_op, backend="dist", fullgraph=True)(torch.ones(3, 4), w)
    except Exception as exc:
        msg = str(exc)
        assert "rank divergence: this rank traced another program" in msg, msg
        assert "aten.cos" in msg and "aten.sin" in msg, msg
        print(f"OTHER PROGRAM CAUGHT rank {rank}", flush=True)
    else:
        return 1

    # a graph only rank 0 compiles (a rank-dependent graph break would do this): rank 0 stops
    # waiting for rank 1's schedule after DYNAMO_DIST_SCHEDULE_TIMEOUT seconds
    if rank == 0:
        os.environ["DYNAMO_DIST_SCHEDULE_TIMEOUT"] = "3"
        try:
            torch.compile(lambda x: funcol.all_reduce(x, "sum", mesh), backend="dist")(
                torch.ones(2))
            return 1
        except Exception as exc:
            assert "ranks [1] did not compile graph #4" in str(exc), str(exc)
            print("MISSING RANK CAUGHT", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
