"""transformers models with their default configs, compiled on a `fake` process group and run
on simulated ranks with real values (``run_spmd``): the loss, the other forward outputs and every
parameter's first-step gradient against one device.

Gradient metric: per tensor, ||g - ref|| <= 1e-4 ||ref|| + 1e-6 ||all gradients||. The absolute
floor matters: attention's key bias gets a gradient that is exactly zero in exact arithmetic
(softmax over keys is invariant to adding q.b to a whole row of scores), so both sides hold
rounding noise (~5e-12 in float32, ~1e-20 in float64) and a purely relative comparison of the
two reports 126% for BERT (found as a "wrong gradient"; it is not).
"""

import copy
import re

import pytest
import torch
import transformers as T

from dynamo_dist import compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd
from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
from inductor_passes.sharding.rules import RuleKind

SMALL = dict(vocab_size=256)


def _param_name(placeholder: str) -> str:
    """Dynamo's placeholder name -> the module's attribute path
    (L_self_modules_bert_modules_encoder_..._parameters_bias_ -> bert.encoder....bias,
    L_args_0_modules_model_..._weight_ -> model....weight, L_kwargs_input_ids_ -> input_ids)."""
    name = re.sub(r"^[LG]_", "", placeholder).rstrip("_")
    name = re.sub(r"_(modules|parameters|buffers)_", ".", name)
    # the model's own forward (self), shard_module's wrapper around it (inner_self) under an
    # input plan, or a decorator's (*args, **kwargs) wrapper (transformers 5.24's
    # deprecate_kwarg on LlamaForCausalLM.forward): self is then args_0
    return re.sub(r"^(inner_self|self|args_0)\.", "", name).removeprefix("kwargs_")


def _simulate(ref: torch.nn.Module, mesh, mesh_axes: dict[str, int], ids: torch.Tensor):
    """Shard a copy of ``ref`` with the planners, compile one step, run it on every simulated
    rank. Returns (record, forward outputs, {reference parameter: summed gradient})."""
    model = copy.deepcopy(ref)
    plan = TensorParallelPlanner().build_plan(model) if "tp" in mesh_axes else None
    if "dp" in mesh_axes:
        plan = DataParallelPlanner(mesh_axis_size=mesh_axes["dp"]).build_plan(model, plan)
    shard_module(model, mesh, plan)
    torch.compile(model, backend="dist", options={"inductor": False})(input_ids=ids, labels=ids)
    record = compile_records()[-1]
    assert len(compile_records()) == 1 and not record.plan.fallbacks
    values = dict(ref.named_parameters(remove_duplicate=False))
    values.update(ref.named_buffers(remove_duplicate=False))
    values.update(input_ids=ids, labels=ids)
    names = [_param_name(i.name) for i in record.program.primal_inputs]
    gm = record.program.graph_module
    tangents = [torch.ones(()) if n.meta["val"].ndim == 0 else torch.zeros(n.meta["val"].shape)
                for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    assert sum(t.ndim == 0 for t in tangents) == 1  # the loss: what .backward() starts from
    outs, grads = run_spmd(record, [values[n].detach() for n in names], tangents, mesh)
    params = dict(ref.named_parameters(remove_duplicate=False))
    by_param: dict[torch.nn.Parameter, torch.Tensor] = {}
    for n, g in zip(names, grads):
        if n in params and g is not None:  # a tied parameter may reach the graph twice: sum
            p = params[n]
            by_param[p] = by_param[p] + g if p in by_param else g
    return record, outs, by_param


def _check_grads(ref: torch.nn.Module, got: dict) -> dict[str, float]:
    total = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()
    rel = {}
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        diff = (got[p] - p.grad).norm()
        assert diff <= 1e-4 * p.grad.norm() + 1e-6 * total, (name, diff, p.grad.norm(), total)
        rel[name] = (diff / p.grad.norm()).item()
    return rel


def _close_to_one_of(reference: torch.Tensor, outs) -> bool:
    return any(isinstance(o, torch.Tensor) and o.shape == reference.shape and
               torch.allclose(o, reference, atol=1e-5, rtol=1e-5) for o in outs)


@pytest.mark.parametrize("mesh_axes", [{"tp": 2}, {"dp": 2}])
def test_llama_gqa_default_config_trains_and_returns_its_cache(fake_mesh, mesh_axes):
    """HF Llama with grouped-query attention and use_cache=True (the default): transformers
    calls SDPA with enable_gqa=True, so the fused kernel sees 4 query heads and 2 key/value
    heads; the forward also returns the DynamicCache's key/value states. Before the attention
    rule split query and key/value heads together this failed to compile on tp=2 (and, with
    the key/value heads not split by the mesh axis, computed a wrong forward)."""
    mesh = fake_mesh(tuple(mesh_axes.values()), tuple(mesh_axes))
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, **SMALL)).train()
    assert ref.config.use_cache
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    record, outs, grads = _simulate(ref, mesh, mesh_axes, ids)
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    cache = [t for layer in want.past_key_values.layers for t in (layer.keys, layer.values)]
    assert len(cache) == 4
    for reference in [want.loss, want.logits, *cache]:
        assert _close_to_one_of(reference.detach(), outs), tuple(reference.shape)
    _check_grads(ref, grads)
    fused = [n for n in record.plan.nodes.values() if n.kind is RuleKind.ATTENTION]
    assert len(fused) == 4
    ledger = record.ledger
    if "tp" in mesh_axes:  # heads split with their key/value heads; Megatron's collectives only
        assert all(str(n.inputs[1]) == "(Shard(dim=1),)" for n in fused)
        for phase in ("forward", "backward"):
            assert [e.kind for e in ledger.entries if e.phase == phase] == ["all_reduce"] * 4
    else:  # the cache leaves split over the batch: nothing is gathered for it
        assert all(str(n.inputs[1]) == "(Shard(dim=0),)" for n in fused)
        assert not any("output" in e.cause and e.kind == "all_gather" for e in ledger.entries)


def test_bert_tp_with_the_planners_plan_matches_one_device(fake_mesh):
    """BertForMaskedLM on tp=2 with TensorParallelPlanner's plan (query/key column-parallel,
    value Shard(1)): every gradient matches one device. Its key biases' reference gradients are
    rounding noise of an exact zero (see the module docstring)."""
    mesh = fake_mesh((2,), ("tp",))
    torch.manual_seed(0)
    ref = T.BertForMaskedLM(T.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **SMALL)).train()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    _, outs, grads = _simulate(ref, mesh, {"tp": 2}, ids)
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    for reference in (want.loss, want.logits):
        assert _close_to_one_of(reference.detach(), outs), tuple(reference.shape)
    rel = _check_grads(ref, grads)
    total = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    key_bias = ref.bert.encoder.layer[0].attention.self.key.bias.grad
    assert key_bias.norm() < 1e-9 * total  # analytically zero: only the floor can judge it
    assert max(v for k, v in rel.items() if "key.bias" not in k) < 1e-4
