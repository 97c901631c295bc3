"""Advanced indexing and mixture-of-experts routing through backend="dist" on simulated ranks
(a `fake` process group; `run_spmd` runs every rank's local graph with real values): integer
indexing traces, data-dependent ops get a clear error, and a Mixtral MoE layer matches one
device."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dynamo_dist import DistCompileError, compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd
from dynamo_dist.plans import ShardingPlan, shard_module
from inductor_passes.core.compat import StridedShard
from inductor_passes.sharding.rules import RuleKind


def _compile(f, *args):
    return torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(*args)


def _check(record, mesh, f, args, grad_of=()):
    """run_spmd against one device: forward, and gradients of the inputs in ``grad_of``."""
    ref = [a.clone().requires_grad_(i in grad_of) for i, a in enumerate(args)]
    want = f(*ref)
    tangent = torch.randn_like(want)
    if grad_of:
        want.backward(tangent)
    # the program's inputs are those f reads (Dynamo drops unused ones), by argument name
    names = [f"L_{n}_" for n in inspect.signature(f).parameters]
    used = [names.index(i.name) for i in record.program.primal_inputs]
    (got,), grads = run_spmd(record, [args[i] for i in used], [tangent] if grad_of else None,
                             mesh)
    torch.testing.assert_close(got, want.detach())
    for i in grad_of:
        torch.testing.assert_close(grads[used.index(i)], ref[i].grad)


# ---------------------------------------------------------------------------------------------
# Integer advanced indexing: static shapes, traced and planned
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["rows", "two_indices", "none_slice", "index_select"])
def test_integer_indexing_traces_and_matches_one_device(fake_mesh, form):
    """``h[perm]`` was refused while Dynamo traced ("output shape depends on tensor data"):
    aten.index.Tensor is tagged dynamic_output_shape for its boolean-mask form only. Every
    form here has a static shape; h is sharded on its feature dim, the indices replicated."""
    mesh = fake_mesh((2,), ("tp",))
    h = torch.randn(6, 8)
    perm = torch.randperm(6)
    cols = torch.tensor([[1, 7], [3, 3]])
    f = {"rows": lambda h, p, c: h[p] * 2,
         "two_indices": lambda h, p, c: h[p[:4].view(2, 2), c] * 2,
         "none_slice": lambda h, p, c: h[:, c] * 2,
         "index_select": lambda h, p, c: h.index_select(0, p) * 2}[form]
    dh = distribute_tensor(h, mesh, [Shard(1)]).requires_grad_()
    _compile(f, dh, perm, cols)
    record = compile_records()[-1]
    assert not record.plan.fallbacks, record.plan.fallbacks
    _check(record, mesh, f, [h, perm, cols], grad_of=(0,))


def test_index_backward_accumulates_split_updates(fake_mesh):
    """Tokens split over the mesh, indexing a replicated table: the backward index_put
    (accumulate) adds each rank's rows into a Partial gradient; no gather of the updates.
    'dp' is declared a data axis (the tokens are batch data there): on a plain axis, gathering
    8 token ids costs less than reducing the table's gradient, and the planner does that."""
    from inductor_passes.core.mesh_facts import add_data_axes

    mesh = fake_mesh((2,), ("dp",))
    add_data_axes(mesh, ("dp",))
    table, idx = torch.randn(7, 4), torch.randint(0, 7, (8,))
    f = lambda t, i: t[i] * 3  # noqa: E731
    _compile(f, distribute_tensor(table, mesh, [Replicate()]).requires_grad_(),
             distribute_tensor(idx, mesh, [Shard(0)]))
    record = compile_records()[-1]
    put = next(n for n in record.plan.nodes.values() if n.op == "aten.index_put.default")
    assert put.kind is RuleKind.INDEX_PUT and put.output == (torch.distributed.tensor.Partial(),)
    _check(record, mesh, f, [table, idx], grad_of=(0,))


# ---------------------------------------------------------------------------------------------
# Data-dependent shapes: a clear error naming the fix, never a wrong number
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form,fix", [
    ("bool_mask", "torch.where(mask[..., None], x, 0)"),
    ("nonzero", "nonzero_static"),
    ("masked_select", "torch.where(mask, x, 0)"),
])
def test_data_dependent_shapes_get_a_clear_error(fake_mesh, form, fix):
    mesh = fake_mesh((2,), ("tp",))
    x = distribute_tensor(torch.randn(6, 4), mesh, [Shard(1)])
    f = {"bool_mask": lambda x: x[x[:, 0] > 0].sum(),
         "nonzero": lambda x: torch.nonzero(x > 0).float().sum(),
         "masked_select": lambda x: torch.masked_select(x, x > 0).sum()}[form]
    with pytest.raises(Exception) as e:
        _compile(f, x)
    msg = str(e.value)
    assert "depends on tensor data" in msg and "fix:" in msg and fix in msg, msg
    assert "tp=2" in msg and "(6," in msg, msg  # mesh and the global shape


# ---------------------------------------------------------------------------------------------
# Mixtral: the MoE block's routing (topk, sort, index, histc, cumsum, grouped GEMM)
# ---------------------------------------------------------------------------------------------
HAND_PLAN = {"*.q_proj.weight": {"tp": Shard(0)}, "*.k_proj.weight": {"tp": Shard(0)},
             "*.v_proj.weight": {"tp": Shard(0)}, "*.o_proj.weight": {"tp": Shard(1)}}
EXPERTS = {  # how the fused expert weights [E, 2I, H] / [E, H, I] are split
    "megatron": {"*.experts.gate_up_proj": {"tp": Shard(1)}, "*.experts.down_proj": {"tp": Shard(2)}},
    "expert_parallel": {"*.experts.gate_up_proj": {"tp": Shard(0)},
                        "*.experts.down_proj": {"tp": Shard(0)}},
    # gate|up block-strided: each rank holds its slice of gate AND of up (Megatron-LM's layout)
    "megatron_strided": {"*.experts.gate_up_proj": {"tp": StridedShard(1, split_factor=2)},
                         "*.experts.down_proj": {"tp": Shard(2)}},
}


def _mixtral(experts: str):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, vocab_size=256)
    cfg._experts_implementation = experts
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).float()


def _dynamo_name(fqn: str, kind: str) -> str:
    *mods, leaf = fqn.split(".")
    return "L_self_" + "".join(f"modules_{m}_" for m in mods) + f"{kind}_{leaf}_"


@pytest.mark.parametrize("experts,split", [("grouped_mm", "megatron"),
                                           ("grouped_mm", "megatron_strided"),
                                           ("grouped_mm", "expert_parallel"),
                                           ("batched_mm", "megatron")])
def test_mixtral_moe_matches_one_device(fake_mesh, experts, split):
    """One Mixtral layer, tp=2, attention Megatron, fused expert weights split on the
    intermediate dim (Megatron) or on the expert dim; router replicated. Loss and every
    gradient against one device, no replicated fallback. transformers' default experts path
    under torch.compile with fp32 weights is the ``grouped_mm_fallback`` custom op."""
    mesh = fake_mesh((2,), ("tp",))
    ref = _mixtral(experts)
    model = shard_module(_mixtral(experts), mesh,
                         ShardingPlan(plan={**HAND_PLAN, **EXPERTS[split]}))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.compile(model, backend="dist", options={"inductor": False})(input_ids=ids, labels=ids)
    record = compile_records()[-1]
    assert not record.plan.fallbacks, record.plan.fallbacks
    ops = {n.op for n in record.plan.nodes.values()}
    if experts == "grouped_mm":
        assert {"transformers.grouped_mm_fallback.default", "aten.sort.default",
                "aten.histc.default", "aten.index.Tensor"} <= ops, ops
    values = {_dynamo_name(k, "parameters"): v for k, v in ref.named_parameters()}
    values.update({_dynamo_name(k, "buffers"): v for k, v in ref.named_buffers()})
    values.update({"L_input_ids_": ids, "L_labels_": ids, "L_kwargs_input_ids_": ids,
                   "L_kwargs_labels_": ids})
    names = [i.name for i in record.program.primal_inputs]
    tangents = [torch.ones(()) if n.meta["val"].ndim == 0 else torch.zeros(n.meta["val"].shape)
                for n in record.program.graph_module.graph.find_nodes(op="placeholder")
                if n.name.startswith("tangents")]
    outs, grads = run_spmd(record, [values[n].detach() for n in names], tangents, mesh)
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    loss = next(o for o in outs if isinstance(o, torch.Tensor) and o.ndim == 0)
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    for n, g in zip(names, grads):
        if values[n].grad is not None:
            torch.testing.assert_close(g, values[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    kinds = {e.kind for e in record.ledger.entries}
    if split == "megatron":  # the fused [gate; up] output is gathered for its chunk()
        assert kinds <= {"all_reduce", "all_gather"}, record.ledger.entries
    elif split == "megatron_strided":  # the grouped GEMMs carry the strided split: Megatron's
        # one all_reduce per block and direction (attention's o_proj, the experts' down_proj)
        assert kinds == {"all_reduce"}, record.ledger.entries
        assert len(record.ledger.entries) == 4, record.ledger.entries
    else:  # the expert dim cannot feed a grouped GEMM: weights moved to the Megatron split
        assert "all_to_all" in kinds


def test_mixtral_eager_experts_loop_gets_a_clear_error(fake_mesh):
    """transformers' "eager" experts loop over ``nonzero()`` of the routing mask: a token
    dispatch of data-dependent size. Refused with the op, the mesh and the fix."""
    mesh = fake_mesh((2,), ("tp",))
    model = shard_module(_mixtral("eager"), mesh,
                         ShardingPlan(plan={**HAND_PLAN, **EXPERTS["megatron"]}))
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(Exception) as e:
        torch.compile(model, backend="dist", options={"inductor": False})(input_ids=ids,
                                                                          labels=ids)
    msg = str(e.value)
    assert "aten.nonzero" in msg and "depends on tensor data" in msg, msg
    assert 'experts_implementation="grouped_mm"' in msg and "tp=2" in msg, msg
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, DistCompileError) or "DistCompileError" in msg or "fix:" in msg
