"""Run under torchrun (gloo): train a model with backend="dist" and compare every step's loss and
the final gradients/parameters with a single-process reference. Exits non-zero on mismatch."""

import argparse
import contextlib
import copy
import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dynamo_dist.blocks import compile_blocks
from dynamo_dist.testing.demo import parse_mesh
from dynamo_dist.testing.models import ConvNet, LlamaSize, build_llama, image_batch, token_batch
from dynamo_dist.plans import (DataParallelPlanner, ShardingPlan, TensorParallelPlanner,
                               shard_module)


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 128):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, hidden)
        self.fc2 = torch.nn.Linear(hidden, 32)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _recorder():
    from benchmarks.bench.comm import CollectiveRecorder  # counts what reaches the dispatcher

    return CollectiveRecorder()


def _check_issued(recorder) -> None:
    from dynamo_dist import compile_records

    ledger = compile_records()[-1].ledger
    seen = {k: v["count"] for k, v in recorder.summary()["by_kind"].items()}
    want = {k: n for k, n in ledger.issued_by_kind.items() if n}
    assert seen == want, f"run time {seen} != ledger issued {want} (buckets {ledger.buckets})"
    if dist.get_rank() == 0:
        print(f"ISSUED {sum(seen.values())} collectives for {ledger.count()} ledger entries; "
              f"buckets {ledger.buckets}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["mlp", "llama", "cnn"], default="mlp")
    ap.add_argument("--mesh", default="tp=2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--inductor", type=int, default=1)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--hidden", type=int, default=128,
                    help="MLP hidden size (odd: tensor-parallel weights split unevenly)")
    ap.add_argument("--check-issued", action="store_true",
                    help="count the last step's collectives at run time: they must equal the "
                         "ledger's issued count (after bucketing)")
    ap.add_argument("--local-logits", action="store_true",
                    help="output_plan: logits split over the vocabulary on tp, returned local")
    ap.add_argument("--ddp", action="store_true",
                    help="dp replicates parameters (DDP) instead of sharding them (FSDP)")
    ap.add_argument("--use-cache", action="store_true",
                    help="Llama with transformers' default use_cache=True: the forward also "
                         "returns the DynamicCache's key/value states (DTensors), checked too")
    ap.add_argument("--dynamic", action="store_true",
                    help="Llama compiled with dynamic=True, step k at sequence length "
                         "32, 48, 64, 32, then a batch of 4 at 40 (prints COMPILES)")
    ap.add_argument("--layers", type=int, default=2, help="the Llama's decoder layers")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: ranks and the reference on GPUs (Triton kernels; NCCL, a GPU "
                         "per rank)")
    ap.add_argument("--per-block", action="store_true",
                    help="Llama with each decoder layer compiled on its own (torchtitan's way), "
                         "the rest eager")
    ap.add_argument("--nested-regions", action="store_true",
                    help="Llama with every decoder layer a torch.compiler.nested_compile_region; "
                         "prints the ledger's collectives per phase")
    args = ap.parse_args()
    if args.model == "cnn":
        return train_cnn(args)
    axes = parse_mesh(args.mesh)
    dev = args.device
    if dev == "cuda":
        from dynamo_dist.testing.zoo.cell import CudaRuntime

        world = int(os.environ["WORLD_SIZE"])
        dist.init_process_group(CudaRuntime.backend(world))
        mesh = CudaRuntime().setup(axes)  # on the rank's GPU, TF32 off
    else:
        dist.init_process_group("gloo")
        mesh = init_device_mesh(dev, tuple(axes.values()), mesh_dim_names=tuple(axes))
    torch.manual_seed(0)
    if args.model == "mlp":
        ref = MLP(args.hidden)
        size = None
    else:
        size = LlamaSize(layers=args.layers, seq=32)
        ref = build_llama(size, attn=args.attn)
        # with the cache on and no mask, transformers calls SDPA with enable_gqa=True: the fused
        # kernel then sees query heads (8) and key/value heads (4) of different counts
        ref.config.use_cache = args.use_cache
    ref = ref.to(dev)
    model = copy.deepcopy(ref)
    if args.nested_regions:  # as a user marks a repeated block: its class's forward
        cls = type(model.model.layers[0])
        cls.forward = torch.compiler.nested_compile_region(cls.forward)
    plan = TensorParallelPlanner().build_plan(model) if "tp" in axes else None
    if "dp" in axes:
        plan = DataParallelPlanner(mesh_axis_size=axes["dp"]).build_plan(model, plan)
    if args.local_logits:
        plan = plan.merged(ShardingPlan(output_plan={"logits": {"tp": Shard(2)}},
                                        return_local_tensor=("logits",)))
    shard_module(model, mesh, plan)
    if args.per_block:
        compile_blocks(model, options={"inductor": bool(args.inductor)})
        compiled = model
    else:
        compiled = torch.compile(model, backend="dist",
                                 options={"inductor": bool(args.inductor)},
                                 dynamic=True if args.dynamic else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shapes = [(8, 32), (8, 48), (8, 64), (8, 32), (4, 40)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for step in range(args.steps):
        last = step == args.steps - 1
        recorder = _recorder() if args.check_issued and last else contextlib.nullcontext()
        recorder.__enter__()
        if size is None:
            g = torch.Generator().manual_seed(step)
            batch = (torch.randn(16, 32, generator=g).to(dev),
                     torch.randn(16, 32, generator=g).to(dev))
            loss, ref_loss = compiled(*batch), ref(*batch)
        else:
            ids = token_batch(size, step) if not args.dynamic else token_batch(
                dataclasses.replace(size, batch=shapes[step][0], seq=shapes[step][1]), step)
            ids = ids.to(dev)
            out, ref_out = compiled(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
            loss, ref_loss = out.loss, ref_out.loss
            if args.local_logits:  # this rank's vocabulary shard, as a plain tensor
                tp = mesh["tp"].get_local_rank()
                assert type(out.logits) is torch.Tensor, type(out.logits)
                want = ref_out.logits.chunk(axes["tp"], dim=2)[tp]
                torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-5)
            else:
                assert isinstance(out.logits, DTensor)
            if args.use_cache:  # key/value states [batch, kv_heads, seq, head_dim], global
                for layer, ref_layer in zip(out.past_key_values.layers,
                                            ref_out.past_key_values.layers, strict=True):
                    for got, want in ((layer.keys, ref_layer.keys),
                                      (layer.values, ref_layer.values)):
                        assert isinstance(got, DTensor), type(got)
                        torch.testing.assert_close(full(got), want, rtol=1e-4, atol=1e-5)
        loss.backward()
        recorder.__exit__(None, None, None)
        if args.check_issued and last:
            _check_issued(recorder)
        ref_loss.backward()
        if last:
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, \
                    (n, p.grad.placements, p.placements)
                torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-4, atol=1e-5, msg=n)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        a, b = full(loss).item(), ref_loss.item()
        worst = max(worst, abs(a - b) / abs(b))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(full(p).detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=n)
    if dist.get_rank() == 0:
        print(f"PARITY {args.model} {args.mesh}: max relative loss difference {worst:.2e}")
        from dynamo_dist import compile_records

        ledger = compile_records()[-1].ledger
        print(f"LEDGER forward {ledger.count(phase='forward')} "
              f"backward {ledger.count(phase='backward')}")
        print(f"COMPILES {len(compile_records())}")
        joint = compile_records()[-1].step.joint
        print("OUTLINED " + " ".join(f"{o.calls}/{len(o.bodies)}" for o in joint.outlined))
        print("PREFETCHED " + " ".join(str(len(p.layers)) for p in joint.prefetched))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if worst <= 1e-4 else 1


def train_cnn(args) -> int:
    """ConvNet (conv + batch norm + max pool + linear) with AdamW: every step's loss within
    1e-5 of one process's, the first step's gradients and running statistics equal, the batch
    never gathered on dp (ledger), BatchNorm statistics over the global batch."""
    axes = parse_mesh(args.mesh)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    torch.manual_seed(0)
    ref = ConvNet()
    model = copy.deepcopy(ref)
    plan = TensorParallelPlanner().build_plan(model) if "tp" in axes else None
    if "dp" in axes:
        plan = DataParallelPlanner(mesh_axis_size=axes["dp"],
                                   shard_params=not args.ddp).build_plan(model, plan)
    shard_module(model, mesh, plan)
    compiled = torch.compile(model, backend="dist", options={"inductor": bool(args.inductor)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(args.steps):
        x, y = image_batch(step)
        loss, ref_loss = compiled(x, labels=y), ref(x, labels=y)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, \
                    (n, p.grad.placements, p.placements)
                torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-4, atol=1e-6, msg=n)
            for (n, b), (_, q) in zip(model.named_buffers(), ref.named_buffers()):
                torch.testing.assert_close(b, q, rtol=1e-5, atol=1e-7, msg=n)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        a, b = full(loss).item(), ref_loss.item()
        worst = max(worst, abs(a - b) / abs(b))
    from dynamo_dist import compile_records

    record = compile_records()[-1]
    gathered = record.activation_gathers("dp") if "dp" in axes else []
    assert not gathered, gathered
    if dist.get_rank() == 0:
        print(f"PARITY cnn {args.mesh}: max relative loss difference {worst:.2e}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
