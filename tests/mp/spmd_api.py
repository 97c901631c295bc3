"""Run under torchrun (gloo, 2 ranks): the torch_xla-style API and DTensor calls inside programs
compiled with backend="dist", each checked against one process computing the same function on
whole tensors (values and gradients). Prints "SPMD API OK <n> checks"; exits non-zero on a
mismatch."""

import copy
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import dynamo_dist
from dynamo_dist import (Mesh, disable_manual_sharding, enable_manual_sharding, local_map,
                         mark_sharding)

CHECKS = []


def check(name, got, want, tol=1e-5):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    CHECKS.append(name)
    if err > tol or got.shape != want.shape:
        print(f"rank {dist.get_rank()}: MISMATCH {name}: relative error {err:.2e}, shapes "
              f"{tuple(got.shape)} vs {tuple(want.shape)}", flush=True)
        sys.exit(1)


def grads(fn, *tensors):
    """One-process reference: value and gradients of ``fn`` on whole tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward()
    return out.detach(), [t.grad for t in leaves]


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh(list(range(world)), (world,), ("tp",))
    dm = mesh.to_device_mesh()
    torch.manual_seed(0)
    W, X, B = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6)

    # 1. mark_sharding inside the program; a manual region with an explicit collective
    def region(w, x, b):
        w = mark_sharding(w, mesh, ("tp", None))
        h = torch.tanh(w * x)
        local = enable_manual_sharding(h, ("tp", None), mesh=mesh)        # this rank's rows
        col = funcol.all_reduce(local.detach().sum(0), "sum", dm)        # local code's own collective
        local = local * 2 + col
        g = disable_manual_sharding(local, ("tp", None), (8, 6), mesh=mesh)
        return (g * b).sum()

    def region_ref(w, x, b):
        h = torch.tanh(w * x)
        return ((h * 2 + h.detach().sum(0)) * b).sum()

    w, b = W.clone().requires_grad_(), B.clone().requires_grad_()
    out = torch.compile(region, backend="dist", fullgraph=True)(w, X, b)
    out.backward()
    ref, (gw, _, gb) = grads(region_ref, W, X, B)
    check("manual region: value", out, ref)
    check("manual region: grad w", w.grad, gw)
    check("manual region: grad b (replicated, used by local code)", b.grad, gb)
    # the user's collective is compiled into the local forward graph, as written
    fw = dynamo_dist.compile_records()[-1].step.joint.fw_graph
    assert "_c10d_functional.all_reduce" in fw.code, fw.code

    # 2. local_map: a replicated argument enters local code (its gradient sums every rank's term)
    @local_map(out_specs=("tp", None), in_specs=[("tp", None), (None,)], mesh=mesh)
    def scale_rows(a, v):
        return a * v + v.sum()

    w, b = W.clone().requires_grad_(), B.clone().requires_grad_()
    out = torch.compile(lambda a, v: scale_rows(a, v).square().mean(), backend="dist",
                        fullgraph=True)(w, b)
    out.backward()
    ref, (gw, gb) = grads(lambda a, v: (a * v + v.sum()).square().mean(), W, B)
    check("local_map: value", out, ref)
    check("local_map: grad of the sharded argument", w.grad, gw)
    check("local_map: grad of the replicated argument", b.grad, gb)

    # 3. a value that enters and leaves local code replicated gets its gradient once
    def round_trip(v):
        local = enable_manual_sharding(v, (None,), mesh=mesh)
        g = disable_manual_sharding(local.exp() * 3, (None,), (6,), mesh=mesh)
        return (g * torch.arange(6.0)).sum()

    b = B.clone().requires_grad_()
    out = torch.compile(round_trip, backend="dist", fullgraph=True)(b)
    out.backward()
    ref, (gb,) = grads(lambda v: (v.exp() * 3 * torch.arange(6.0)).sum(), B)
    check("replicated round trip: value", out, ref)
    check("replicated round trip: grad", b.grad, gb)

    # 4. DTensor to_local / from_local inside the program: code between them is local
    wd = distribute_tensor(W, dm, [Shard(0)]).requires_grad_()
    xd = distribute_tensor(X, dm, [Replicate()])

    def dtensor_calls(w, x):
        local = w.to_local().cos()
        d = DTensor.from_local(local, dm, [Shard(0)], run_check=False)
        return (d * x).redistribute(dm, [Replicate()]).sum()

    out = torch.compile(dtensor_calls, backend="dist", fullgraph=True)(wd, xd)
    out.backward()
    ref, (gw, _) = grads(lambda w, x: (w.cos() * x).sum(), W, X)
    check("to_local/from_local: value", out, ref)
    check("to_local/from_local: grad", wd.grad, gw)

    # 5. from_local on a per-rank input (sequence-parallel style): the input is this rank's piece
    def gather_rows(xl):
        return DTensor.from_local(xl, dm, [Shard(0)], run_check=False).sin().sum(0)

    out = torch.compile(gather_rows, backend="dist", fullgraph=True)(X.chunk(world)[rank].clone())
    check("from_local on a per-rank input", out, X.sin().sum(0))

    # 6. mark_sharding eagerly on a plain input: the compiled program gets this rank's piece
    xs = X.clone()
    mark_sharding(xs, mesh, ("tp", None))
    out = torch.compile(lambda x: (x.sin() * 2).sum(0), backend="dist", fullgraph=True)(xs)
    check("eager mark_sharding on an input: value", out, (X.sin() * 2).sum(0))
    info = dynamo_dist.compile_records()[-1].program.primal_inputs[0]
    assert info.placements == (Shard(0),), info

    # 7. parallelize_module's hooks (from_local / redistribute / to_local around each Linear)
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 6)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x))) + x

    torch.manual_seed(1)
    ref_model = MLP()
    model = copy.deepcopy(ref_model)
    parallelize_module(model, dm, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    out = torch.compile(model, backend="dist", fullgraph=True)(X)
    out.sum().backward()
    ref = ref_model(X)
    ref.sum().backward()
    check("parallelize_module: output", out, ref.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        check(f"parallelize_module: grad {name}", p.grad, q.grad)
    kinds = [(e.phase, e.kind) for e in dynamo_dist.compile_records()[-1].ledger.entries]
    assert kinds.count(("forward", "all_reduce")) == 1, kinds  # Megatron's one per MLP

    print(f"SPMD API OK {len(CHECKS)} checks", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
