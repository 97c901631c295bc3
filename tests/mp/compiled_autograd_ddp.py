"""Under torchrun (gloo, 2 ranks): data parallelism written by the user as a post-accumulate-grad
hook that all-reduces each gradient over the ``dp`` axis of a DeviceMesh (functional
collective, then divide by the world size), compiled with backend="dist" and compiled autograd
(forward and backward both fullgraph), against torch's DistributedDataParallel on a copy of the
model, same data (each rank its own batch shard), 3 SGD steps.

Checks, every step: every gradient equal to DDP's (1e-5) and the same on both ranks; the loss
equal to DDP's. Once: the backward graph the dist backend compiled holds one all_reduce per
parameter on the dp group (so the collectives ran inside the compiled graph, not eagerly:
the backward was compiled fullgraph), and Inductor's code for it issues them. Prints
``CA DDP OK ...`` on rank 0; exits non-zero on a mismatch."""

import copy

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo import compiled_autograd
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from dynamo_dist.compiled_autograd import backward_records


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)
        self.fc3 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def fail(msg: str) -> int:
    print(f"MISMATCH rank {dist.get_rank()}: {msg}", flush=True)
    return 1


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    group = mesh.get_group("dp")

    torch.manual_seed(0)  # the same initial model on every rank
    model = MLP()
    ddp = DistributedDataParallel(copy.deepcopy(model))

    def allreduce_grad(p):
        p.grad = funcol.all_reduce(p.grad, "sum", group) / world

    params = list(model.parameters())
    for p in params:
        p.register_post_accumulate_grad_hook(allreduce_grad)
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="dist", fullgraph=True)
    backward_compiler = torch.compile(backend="dist", fullgraph=True)

    gen = torch.Generator().manual_seed(1234)  # the same global batch on every rank
    worst = 0.0
    codes: list[str] = []
    for step in range(3):
        x, y = torch.randn(8 * world, 32, generator=gen), torch.randn(8 * world, 1, generator=gen)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]

        def train_step():
            with compiled_autograd._enable(backward_compiler):
                loss = torch.nn.functional.mse_loss(compiled(xs), ys)
                loss.backward()
            return loss

        if step == 0:
            with torch._inductor.config.patch(fx_graph_cache=False):
                loss, codes = run_and_get_code(train_step)
        else:
            loss = train_step()
        ref_loss = torch.nn.functional.mse_loss(ddp(xs), ys)
        ref_loss.backward()
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
            return fail(f"step {step} loss {loss.item()} vs DDP {ref_loss.item()}")
        for (name, p), q in zip(model.named_parameters(), ddp.parameters()):
            diff = (p.grad - q.grad).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5):
                return fail(f"step {step} grad of {name}: max abs diff {diff}")
            other = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(other, p.grad.contiguous())
            if not all(torch.equal(o, other[0]) for o in other):
                return fail(f"step {step} grad of {name} differs between ranks")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)

    backward = [r for r in backward_records() if r.phase == "backward"]
    if not backward:
        return fail("the dist backend compiled no compiled-autograd graph")
    summary = backward[0].ledger(mesh).summary()
    want = {("backward", "all_reduce", "dp"): (len(params), sum(p.numel() * 4 for p in params))}
    if summary != want:
        return fail(f"backward graph collectives {summary}, want {want}")
    issued = sum(c.count("torch.ops._c10d_functional.all_reduce_.default(") for c in codes)
    if issued != len(params):
        return fail(f"Inductor's code issues {issued} all_reduce, want {len(params)}")
    if rank == 0:
        print(f"CA DDP OK max grad diff {worst:.3g}; backward graphs compiled by dist: "
              f"{len(backward)}; all_reduce in the backward graph: "
              f"{len(backward[0].collectives)} for {len(params)} parameters", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
