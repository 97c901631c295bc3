"""Serving on tp=2 gloo ranks with transformers' Llama (GQA) under the stock Megatron plan:
``eval()`` + ``no_grad`` and ``inference_mode`` forwards (forward-only programs) match one
process, and ``generate`` (greedy, 8 new tokens, the default DynamicCache) through the compiled
forward gives one process's tokens exactly, with the KV cache left split over the key/value
heads. Prints one JSON line on rank 0.

usage: torchrun --nproc-per-node 2 tests/mp/serve_tp.py [--inductor]"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_exit import finish  # noqa: E402
from parity import full  # noqa: E402

from dynamo_dist import compile_records  # noqa: E402
from dynamo_dist.plans import shard_module  # noqa: E402
from dynamo_dist.testing.zoo.cell import plan_model  # noqa: E402
from dynamo_dist.testing.zoo.models import MODELS  # noqa: E402

NEW_TOKENS = 8



def main() -> None:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    options = {"inductor": "--inductor" in sys.argv}
    ref = MODELS["llama"].build().eval()
    model = copy.deepcopy(ref)
    shard_module(model, mesh, plan_model(model, {"tp": 2}))
    compiled = torch.compile(model, backend="dist", options=options)
    ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    row = {}
    with torch.no_grad():
        got, want = compiled(input_ids=ids), ref(input_ids=ids)
        row["no_grad_logits_err"] = (full(got.logits) - want.logits).abs().max().item()
        cache = got.past_key_values.layers[0]
        row["cache_placements"] = [str(p) for p in cache.keys.placements]
        row["cache_local_heads"] = cache.keys.to_local().shape[1]
        row["cache_global_heads"] = cache.keys.shape[1]
    with torch.inference_mode():
        got, want = compiled(input_ids=ids), ref(input_ids=ids)
        row["inference_mode_logits_err"] = (full(got.logits) - want.logits).abs().max().item()
    row["forward_compiles"] = len(compile_records())
    # generate() calls model.forward: compile that (the module's __call__ is not what it uses)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="dist", options=options)
    prompt = ids[:1]
    before = len(compile_records())
    tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    # decode steps change the cache length: symbolic from the second step, one program after
    row["generate_compiles"] = len(compile_records()) - before
    row["tokens"] = full(tokens).tolist()
    row["ref_tokens"] = ref.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
