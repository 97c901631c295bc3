"""Workload ``llama_tp``: the demo's small Llama (``LlamaSize()`` defaults: hidden 256, 4 layers,
8 heads / 4 kv heads, intermediate 512, vocab 1024, batch 8 x seq 128; attention "sdpa"),
causal-LM loss, AdamW, tp=2 on 2 ranks.

torch's plan (torchtitan-style): q/k/v and gate/up column-parallel, o and down row-parallel;
embeddings, norms and the output head replicated.

    python -m benchmarks.llama_tp [options of benchmarks.run]
"""

from __future__ import annotations

import sys

import torch.nn as nn

from benchmarks.bench.workload import Batch, Workload
from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch

SIZE = LlamaSize()


def build_model() -> nn.Module:
    return build_llama(SIZE, attn="sdpa")


def batch(step: int) -> Batch:
    ids = token_batch(SIZE, step)
    return Batch(kwargs={"input_ids": ids, "labels": ids})


def torch_tp_plan(model: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        plan.update({f"{p}.self_attn.q_proj": ColwiseParallel(),
                     f"{p}.self_attn.k_proj": ColwiseParallel(),
                     f"{p}.self_attn.v_proj": ColwiseParallel(),
                     f"{p}.self_attn.o_proj": RowwiseParallel(),
                     f"{p}.mlp.gate_proj": ColwiseParallel(),
                     f"{p}.mlp.up_proj": ColwiseParallel(),
                     f"{p}.mlp.down_proj": RowwiseParallel()})
    return plan


def fsdp_units(model: nn.Module) -> list:
    """FSDP2 wraps each decoder layer, then the root (torchtitan's order)."""
    return list(model.model.layers)


WORKLOAD = Workload(
    name="llama_tp",
    description=f"Llama {SIZE} (sdpa), causal-LM loss, AdamW; tp=2",
    mesh={"tp": 2},
    build_model=build_model,
    batch=batch,
    loss=lambda out: out.loss,
    torch_tp_plan=torch_tp_plan,
    fsdp_units=fsdp_units,
)

if __name__ == "__main__":
    from benchmarks import run

    sys.exit(run.main(["--workloads", WORKLOAD.name, *sys.argv[1:]]))
