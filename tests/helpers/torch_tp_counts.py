"""Prints (JSON) the collectives of torch's own parallelize_module Megatron plan for the test
Llama on the stock compile path (DTensor + AOTAutograd), on a `fake` process group of 2 ranks.

Run in its own process: dynamo_dist's shard_module turns on DTensor implicit replication for the
whole process, which changes what the stock path produces.
"""

import collections
import json
import sys

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from dynamo_dist.testing.models import LlamaSize, build_llama, token_batch


def main() -> None:
    layers, seq = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    size = LlamaSize(layers=layers, seq=seq)
    model = build_llama(size)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
    counts = {}

    def counter(phase):
        def compiler(gm, example_inputs):
            counts[phase] = dict(collections.Counter(
                str(n.target).split(".")[1] for n in gm.graph.nodes
                if n.op == "call_function" and "_c10d_functional" in str(n.target)
                and "wait_tensor" not in str(n.target)))
            return gm
        return compiler

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=counter("forward"),
                                                         bw_compiler=counter("backward")))
    ids = token_batch(size, 0)
    compiled(input_ids=ids, labels=ids).loss.backward()
    print(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
