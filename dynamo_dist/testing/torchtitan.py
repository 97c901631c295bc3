"""torchtitan's Llama 3 debug model with torchtitan's own tensor-parallel plan
(``Module.parallelize``), as a torchtitan user builds it, for the tests and benchmarks of
``backend="dist"`` against ``backend="inductor"`` and eager DTensor on the same model.

Needs ``torchtitan==0.3.0`` (``scripts/env.sh`` installs it without its training-loop
dependencies). What the harness sets, none of it the plan:
- attention is torchtitan's ``ScaledDotProductAttention`` (causal): 0.3.0 builds language
  models with FlexAttention only, which has no backward on CPU in torch 2.13;
- torchtitan picks its mesh device from the machine (``cuda`` when none is found): set to the
  device of the process group's backend;
- torchtitan's process-wide SPMD backend (``partial_dtensor``), which its trainer sets from the
  job config and its loss asserts.

``dp_shard > 1`` adds torchtitan's FSDP2 (``apply_fsdp_to_decoder``, fp32) over the TP plan;
gloo has no ``PREMUL_SUM``, so its reductions are plain sums with the mean's division applied
by FSDP (``set_force_sum_reduction_for_comms`` + ``set_gradient_divide_factor``; with the
first alone the gradients came out ``dp_shard`` times too large).

Sizes: the debug model as shipped (dim 256, 16 heads, vocab 2048, fused q|k|v, complex RoPE),
with its first ``layers`` of 6 decoder layers.
"""

from __future__ import annotations

import copy
import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TitanSize:
    layers: int = 2
    vocab: int = 2048  # the debug model's
    batch: int = 2
    seq: int = 32


def build(size: TitanSize, tp: int, sequence_parallel: bool, device: str = "cpu", seed: int = 0,
          dp_shard: int = 1):
    """(reference model on one process, the same weights parallelized with torchtitan's plan
    on a ``dp_shard`` x ``tp`` mesh, the ParallelDims). Needs an initialised process group of
    ``dp_shard * tp`` ranks."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    original = llama3.get_attention_config
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config() \
        if backend == "sdpa" else original(backend)
    try:
        config = llama3.model_registry("debugmodel", attn_backend="sdpa").model
    finally:
        llama3.get_attention_config = original
    if config.vocab_size != size.vocab:
        raise ValueError(f"vocab {size.vocab}: the debug model's is {config.vocab_size}")
    config.layers = config.layers[:size.layers]
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    torch.manual_seed(seed)
    model = config.build()
    ref = copy.deepcopy(model)
    parallel_dims.device_type = device
    # torchtitan's trainer sets its process-wide SPMD backend from the job config; its loss
    # (components/loss.py: vocabulary-parallel cross entropy) asserts it
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_spmd_backend("partial_dtensor")
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
                                      world_size=dist.get_world_size(),
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()
    model.parallelize(dims)
    if dp_shard > 1:  # FSDP2 over the tp plan, as torchtitan's parallelize_llama applies it
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        from torch.distributed.fsdp import FSDPModule

        apply_fsdp_to_decoder(model, dims.get_mesh(["fsdp"]), param_dtype=torch.float32,
                              reduce_dtype=torch.float32, pp_enabled=False)
        for m in model.modules():  # gloo has no PREMUL_SUM: divide, then sum
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(float(dp_shard))
    return ref, model, dims


def batch(size: TitanSize, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [batch, seq], positions [batch, seq]), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=g)
    return ids, torch.arange(size.seq).unsqueeze(0).expand(size.batch, size.seq)


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over the global logits (a DTensor output is gathered first)."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                             ids[:, 1:].flatten())


def vocab_parallel_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """torchtitan's own loss as its trainer uses it: ``components/loss.cross_entropy_loss`` on
    the plan's logits, which leave split over the vocabulary (a DTensor ``Shard(-1)``: its
    vocabulary-parallel cross entropy on the local pieces, three all_reduces forward and none
    backward; a plain tensor on one process), summed, over the number of predicted tokens."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits[:, :-1], ids[:, 1:]) / (ids.shape[0] * (ids.shape[1] - 1))


LOSSES = {"gather": loss_of, "parallel": vocab_parallel_loss}


def collectives(prof) -> dict[str, int]:
    """Collectives a ``torch.profiler`` window issued, by c10d op (each call once: the
    functional wrapper and its wait are not counted)."""
    out: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            out[e.name] = out.get(e.name, 0) + 1
    return out
