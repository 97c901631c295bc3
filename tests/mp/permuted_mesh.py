"""Run under torchrun (gloo, 2 or 4 ranks). Meshes whose device order is not 0..N-1 (a
DeviceMesh over [1, 0], over [[3, 2], [1, 0]], dynamo_dist's Mesh over reversed ids): an MLP
split Megatron-style whose hidden dim is gathered for a softmax (plus the batch on dp) compiles
with Inductor, and its loss and gradients equal one process's. DTensor puts piece k on the
axis's group rank k, which is not the mesh coordinate there (torch orders a group's ranks
ascending): lowering by coordinate gathered pieces in the wrong order. Prints
"PERMUTED OK <layout> rank <r> coord <c>"."""


import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def mlp_loss(x, w1, w2):  # the softmax over the column-split hidden dim gathers it
    return ((x @ w1.t()).softmax(-1) @ w2.t()).square().mean()


def check(mesh, label: str) -> None:
    torch.manual_seed(0)
    w1, w2, x = torch.randn(8, 4), torch.randn(4, 8), torch.randn(4, 4)
    ref = [w.clone().requires_grad_() for w in (w1, w2)]
    want = mlp_loss(x, *ref)
    want.backward()
    two_d = mesh.ndim == 2
    pl1 = [Replicate(), Shard(0)] if two_d else [Shard(0)]
    pl2 = [Replicate(), Shard(1)] if two_d else [Shard(1)]
    d1 = distribute_tensor(w1, mesh, pl1).requires_grad_()
    d2 = distribute_tensor(w2, mesh, pl2).requires_grad_()
    dx = distribute_tensor(x, mesh, [Shard(0), Replicate()]) if two_d else x
    torch._dynamo.reset()
    loss = torch.compile(mlp_loss, backend="dist")(dx, d1, d2)
    loss.backward()
    got = loss.full_tensor() if isinstance(loss, DTensor) else loss
    torch.testing.assert_close(got, want.detach())
    for d, r in zip((d1, d2), ref):
        torch.testing.assert_close(d.grad.full_tensor(), r.grad)
    print(f"PERMUTED OK {label} rank {dist.get_rank()} coord {mesh.get_coordinate()}",
          flush=True)


def main() -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world == 2:
        check(DeviceMesh("cpu", [1, 0], mesh_dim_names=("tp",)), "[1,0]")
        from dynamo_dist import Mesh

        check(Mesh([1, 0], (2,), ("tp",)).to_device_mesh("cpu"), "Mesh([1,0])")
    else:
        for layout in ([[3, 2], [1, 0]], [[2, 3], [0, 1]], [[0, 2], [1, 3]]):
            check(DeviceMesh("cpu", layout, mesh_dim_names=("dp", "tp")), str(layout))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
