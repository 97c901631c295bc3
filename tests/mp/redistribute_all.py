"""Under torchrun (gloo, 4 ranks, 2x2 mesh): every placement pair our lowering emits, checked
against the global value, for an evenly split tensor and an unevenly split one (pieces of 2 and
1, 3 and 2, 1 and 0), and every pair with a block-strided placement (_StridedShard) on either
side; pairs where a tensor dim is split by both mesh axes (nested, [S(0), S(0)]) included.
Exits non-zero on the first mismatch."""

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from inductor_passes.core.compat import StridedShard
from dynamo_dist.testing.conformance.simulate import strided_indices
from inductor_passes.redistribute import mesh_axes, redistribute
from inductor_passes.core.placements import fmt, local_shape, shard_range, valid_for


def local_of(full, placements, mesh, axes):
    """This rank's local tensor of ``full`` under ``placements`` (Partial: split as a sum)."""
    x = full
    for i, (p, ax) in enumerate(zip(placements, axes)):
        if isinstance(p, Shard):
            x = x.narrow(p.dim, *shard_range(x.shape[p.dim], ax.size, ax.coordinate))
        elif isinstance(p, StridedShard):
            x = x.index_select(p.dim, strided_indices(x.shape[p.dim], p.split_factor, ax.size,
                                                      ax.coordinate))
        elif isinstance(p, Partial):
            # rank-dependent split that sums (or maxes / averages) back to the value
            if p.reduce_op == "sum":
                x = x * (ax.coordinate + 1) / (ax.size * (ax.size + 1) / 2)
            elif p.reduce_op == "max":
                x = x - ax.coordinate  # max over coordinates is the coordinate-0 value
    return x


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    axes = mesh_axes(mesh)
    torch.manual_seed(0)
    one_axis = [Replicate(), Shard(0), Shard(1), Shard(2), Partial("sum"), Partial("max")]
    checked = 0
    strided = [Replicate(), Shard(0), StridedShard(1, split_factor=3),
               StridedShard(2, split_factor=2), Partial("sum")]
    cases = [(full, src, dst)
             for full in (torch.randn(4, 6, 8, dtype=torch.float64),
                          torch.randn(3, 5, 1, dtype=torch.float64))
             for src in itertools.product(one_axis, repeat=2)
             for dst in itertools.product(one_axis[:4], repeat=2)]
    full = torch.randn(4, 6, 8, dtype=torch.float64)
    cases += [(full, src, dst) for src in itertools.product(strided, repeat=2)
              for dst in itertools.product(strided[:4], repeat=2)
              if any(isinstance(p, StridedShard) for p in (*src, *dst))]
    for full, src, dst in cases:
        if not (valid_for(full.shape, src, (2, 2), nested=True) and
                valid_for(full.shape, dst, (2, 2), nested=True)):
            continue
        got = redistribute(local_of(full, src, mesh, axes), src, dst, axes, lambda *a: None,
                           full.shape)
        want = local_of(full, dst, mesh, axes)
        if got.shape != local_shape(full.shape, dst, (2, 2), [ax.coordinate for ax in axes]) or \
                not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            print(f"MISMATCH {fmt(src)} -> {fmt(dst)} on rank {dist.get_rank()}", flush=True)
            return 1
        checked += 1
    if dist.get_rank() == 0:
        print(f"REDISTRIBUTE OK {checked} pairs")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
