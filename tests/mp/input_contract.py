"""Run under torchrun (gloo, 2 ranks). The input contract, checked on request: with
DYNAMO_DIST_CHECK_INPUTS=1 a plain tensor input (a GLOBAL value) that differs on rank 1 makes
every rank raise, naming the input and the ranks; the same program with equal inputs runs, and
a replicated DTensor whose local tensors differ is caught too. Without the variable the
mismatch runs unchecked (documented: the check is opt-in). Prints "CONTRACT OK rank <r>"."""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    x = torch.randn(3, 4)

    def f(x, w):
        return (x @ w.t()).relu().sum()

    step = torch.compile(f, backend="dist", options={"inductor": False})
    skewed = x + rank  # rank 1 passes another "global" value
    step(skewed, w)  # unchecked by default: runs
    os.environ["DYNAMO_DIST_CHECK_INPUTS"] = "1"
    step(x, w)  # equal everywhere: fine
    for bad, name in ((skewed, "plain tensor input L_x_"),
                      (DTensor.from_local(x + rank, mesh, [Replicate()], run_check=False),
                       "replicated DTensor input L_x_")):
        try:
            step(bad, w)
        except Exception as exc:
            msg = str(exc)
            assert "input contract" in msg and name in msg, msg
            assert "ranks [0]; ranks [1]" in msg and "fix:" in msg, msg
        else:
            print(f"rank {rank}: the mismatched input ran", flush=True)
            return 1
    print(f"CONTRACT OK rank {rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
