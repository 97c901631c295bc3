"""Compiling a model's blocks one by one (torchtitan's way, ``dynamo_dist.compile_blocks``:
the embedding, final norm and head run eagerly on DTensors) on a model ``shard_module`` sharded:
the row-split embedding's eager output is settled before the first compiled block, every
gradient lands in its parameter's placement, and the blocks train at parity with one
process."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Shard

import dynamo_dist
from conftest import simulated_llama
from dynamo_dist.testing.models import LlamaSize, token_batch
from dynamo_dist.testing.zoo.cell import SimRuntime, global_value


def test_blocks_compiled_one_by_one_train_at_parity():
    """FSDP on dp=2 (the 4-rank dp=2 x tp=2 run under Inductor is in the full tier,
    tests/test_multiprocess.py; the hook's dp x tp output is checked below)."""
    rt, size = SimRuntime(), LlamaSize(layers=3)
    ref, model = simulated_llama(rt, {"dp": 2}, size)
    assert len(dynamo_dist.compile_blocks(model, options={"simulate": True})) == size.layers
    for step in range(2):
        ids = token_batch(size, step)
        with rt.eager():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        assert abs(global_value(loss, rt).item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # the eager embedding, norm and head too: DTensor made a whole or pending-sum
            # gradient, shard_module's hook moved it
            assert tuple(p.grad.placements) == tuple(p.placements), name
            torch.testing.assert_close(global_value(p.grad, rt), q.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"step {step} {name}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    # one compiled block serves every layer, the first included (the embedding's output and a
    # block's output meet the same guards), so the compile count does not grow with depth
    records = dynamo_dist.compile_records()
    assert len(records) == 1
    # data parallelism: the block gathers parameters on dp, never its incoming activations (a
    # DTensor input, but no parameter); its output stays split over the batch
    assert not records[0].activation_gathers("dp")
    out = next(n for n in records[0].plan.nodes.values() if n.op == "output")
    assert out.inputs[0] == (Shard(0),)


def test_a_row_split_embedding_returns_a_settled_value_eagerly():
    """Eagerly, DTensor returns a row-split embedding's lookup as a pending sum (_MaskPartial),
    which Dynamo cannot take as a compiled block's input; the hook ``shard_module`` adds reduces
    it: over the batch on the data axis, to a whole value on the tensor-parallel one."""
    rt, size = SimRuntime(), LlamaSize(layers=1)
    _, model = simulated_llama(rt, {"dp": 2, "tp": 2}, size)
    embed = model.model.embed_tokens
    assert any(isinstance(p, Shard) and p.dim == 0 for p in embed.weight.placements)
    ids = token_batch(size, 0)
    with rt.eager():
        out = embed(ids)
        hooks = dict(embed._forward_hooks)
        embed._forward_hooks.clear()
        try:
            raw = embed(ids)
        finally:
            embed._forward_hooks.update(hooks)
    assert isinstance(raw, DTensor) and any(isinstance(p, Partial) for p in raw.placements)
    assert isinstance(out, DTensor) and not any(isinstance(p, Partial) for p in out.placements)
    assert out.placements[0] == Shard(0)  # the data axis: split over the batch
    torch.testing.assert_close(global_value(out, rt), global_value(raw.full_tensor(), rt))
