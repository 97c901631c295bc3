"""transformers' own tensor-parallel plan (``model.tp_plan``, applied by
``transformers.distributed.tensor_parallel.apply_tensor_parallelism`` as ``from_pretrained(...,
tp_plan="auto")`` does: its layer wildcards expanded, each planned module's parameters sharded
as loading shards them) on a Llama, tp=2 on gloo: the model run
eagerly and compiled with ``backend="dist"``, each against one process (loss, every parameter's
gradient), with the collectives one forward+backward issues (``torch.profiler``). Prints one
JSON line per contestant on rank 0. (``backend="inductor"`` fails on this model in torch 2.13:
"Unexpected fake buffer _tensor_constant0".)

usage: torchrun --nproc-per-node 2 tests/mp/hf_tp_plan.py"""

import copy
import json
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_exit import finish  # noqa: E402
from parity import full, grad_rel  # noqa: E402

from dynamo_dist import clear_compile_records, compile_records  # noqa: E402
from inductor_passes.core.compat import graph_break_reasons  # noqa: E402
from dynamo_dist.testing.torchtitan import collectives  # noqa: E402


def hf_tensor_parallel(model, mesh):
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    modules = dict(model.named_modules())
    plan = {}
    for pattern, style in model.tp_plan.items():
        for name, module in modules.items():
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
                plan[name] = style  # its forward hooks
                for param, _ in module.named_parameters(recurse=False):
                    plan[f"{name}.{param}"] = style  # its parameters, as loading shards them
    return apply_tensor_parallelism(model, mesh, plan)


def main() -> None:
    import transformers as T

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=128, intermediate_size=512, vocab_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False)).train()
    ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    for contestant in ("eager_dtensor", "dist"):
        torch._dynamo.reset()
        clear_compile_records()
        model = hf_tensor_parallel(copy.deepcopy(ref), mesh)
        model.zero_grad(set_to_none=True)
        run = model if contestant == "eager_dtensor" else torch.compile(model, backend="dist")
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = grad_rel(model.parameters(), ref.parameters())
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(input_ids=ids, labels=ids).loss.backward()
        if dist.get_rank() == 0:
            print(json.dumps({
                "contestant": contestant, "grad_rel": grads,
                "loss_rel": abs(full(loss).item() - ref_loss.item()) / ref_loss.item(),
                "graphs": len(compile_records()), "breaks": len(graph_break_reasons()),
                "collectives": sum(collectives(prof).values())}), flush=True)
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
