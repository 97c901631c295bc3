"""Run under torchrun (gloo, 2 ranks): a Mixtral-like MoE model (transformers' default experts
path, grouped_mm) trained with backend="dist" on tp=2 with a hand-written plan (attention
Megatron, fused expert weights split on their intermediate dim, router replicated), against one
process: every step's loss (relative 1e-5), first-step gradients (1e-4) and the parameters
after a few AdamW steps (1e-3: AdamW divides rounding-level gradients by their own size)."""

import argparse
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dynamo_dist.plans import ShardingPlan, shard_module

PLAN = {"*.q_proj.weight": {"tp": Shard(0)}, "*.k_proj.weight": {"tp": Shard(0)},
        "*.v_proj.weight": {"tp": Shard(0)}, "*.o_proj.weight": {"tp": Shard(1)},
        "*.experts.gate_up_proj": {"tp": Shard(1)}, "*.experts.down_proj": {"tp": Shard(2)}}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def main() -> int:
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--inductor", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--experts", default="grouped_mm")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, vocab_size=256)
    cfg._experts_implementation = args.experts
    torch.manual_seed(0)
    ref = transformers.MixtralForCausalLM(cfg).float()
    model = shard_module(copy.deepcopy(ref), mesh, ShardingPlan(plan=PLAN))
    compiled = torch.compile(model, backend="dist", options={"inductor": bool(args.inductor)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    worst_loss = worst_grad = 0.0
    for step in range(args.steps):
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))
        loss = compiled(input_ids=ids, labels=ids).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        a, b = full(loss).item(), ref_loss.item()
        worst_loss = max(worst_loss, abs(a - b) / abs(b))
        if step == 0:
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, n
                worst_grad = max(worst_grad, rel(full(p.grad), q.grad))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    worst_param = max(rel(full(p).detach(), q.detach())
                      for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()))
    from dynamo_dist import compile_records

    record = compile_records()[-1]
    if dist.get_rank() == 0:
        kinds = sorted({e.kind for e in record.ledger.entries})
        print(f"MOE PARITY loss {worst_loss:.2e} grad {worst_grad:.2e} param {worst_param:.2e} "
              f"fallbacks {len(record.plan.fallbacks)} collectives {record.ledger.count()} "
              f"{kinds}")
    dist.barrier()
    dist.destroy_process_group()
    ok = worst_loss <= 1e-5 and worst_grad <= 1e-4 and worst_param <= 1e-3 and \
        not record.plan.fallbacks
    return 0 if ok else 1


if __name__ == "__main__":
    from mp_exit import finish

    finish(main() or 0)
