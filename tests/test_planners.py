"""The stock planners on real architectures: Megatron pairs found from the dataflow (agreeing
with transformers' own tensor-parallel plans where a model ships one), a reason for every
replicated parameter, tied parameters kept tied, and plan keys that match nothing refused."""

import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from dynamo_dist.plans import (DataParallelPlanner, ShardingPlan, TensorParallelPlanner,
                               parameter_groups, shard_module)
from dynamo_dist.testing.zoo.models import MODELS
from inductor_passes.core.compat import StridedShard
from inductor_passes.core.errors import DistCompileError

_HF_ROLE = {"colwise": "column", "rowwise": "row", "packed_colwise": "column"}


def _decisions(plan, axis="tp"):
    return {n: d for d in plan.decisions if d.axis == axis for n in d.names}


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "qwen2", "gemma", "phi", "mixtral"])
def test_dataflow_roles_match_transformers_tp_plan(name):
    """Where transformers ships a tensor-parallel plan (``base_model_tp_plan``), the roles our
    planner reads from the program's dataflow are the same, with no names involved."""
    model = MODELS[name].build()
    hf_plan = model.config.base_model_tp_plan
    decisions = _decisions(TensorParallelPlanner().build_plan(model))
    import fnmatch

    checked = 0
    for fqn in decisions:
        for pattern, style in hf_plan.items():
            if style not in _HF_ROLE:
                continue
            if fnmatch.fnmatchcase(fqn, f"*{pattern}.weight") or \
                    fnmatch.fnmatchcase(fqn, f"*{pattern}"):
                assert decisions[fqn].role == _HF_ROLE[style], (fqn, style, decisions[fqn])
                checked += 1
    assert checked >= 4 * 2  # every projection of both layers was compared


def test_gpt2_conv1d_is_planned_with_its_transposed_layout():
    model = MODELS["gpt2"].build()
    d = _decisions(TensorParallelPlanner().build_plan(model))
    h = "transformer.h.0."
    # Conv1D's weight is [in, out]: columns split dim 1, rows split dim 0; the fused q|k|v
    # projection block-strided (every rank its slice of q, k and v), its bias likewise
    assert d[h + "attn.c_attn.weight"].placement == StridedShard(1, split_factor=3)
    assert d[h + "attn.c_attn.bias"].placement == StridedShard(0, split_factor=3)
    assert "fused" in d[h + "attn.c_attn.weight"].reason  # q|k|v split after it: said so
    assert d[h + "attn.c_proj.weight"].placement == Shard(0)
    assert d[h + "mlp.c_fc.weight"].placement == Shard(1)
    assert d[h + "mlp.c_fc.bias"].placement == Shard(0)
    assert d[h + "mlp.c_proj.weight"].placement == Shard(0)
    assert d[h + "mlp.c_proj.bias"].placement == Replicate()


def test_fused_projection_contiguous_where_blocks_do_not_split_evenly():
    """With the mesh axis size known, a fused width that k parts x n ranks does not divide
    (gate|up of 2 x 3 on 2 ranks) stays Shard (a contiguous split; the compiler regathers
    it), and the reason says why; where it divides, _StridedShard."""
    class GLU(nn.Module):
        def __init__(self, inter):
            super().__init__()
            self.gate_up, self.down = nn.Linear(8, 2 * inter), nn.Linear(inter, 8)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(torch.relu(gate) * up)

    x = torch.randn(2, 8)
    d = _decisions(TensorParallelPlanner(mesh_axis_size=2).build_plan(GLU(3), example_inputs=x))
    assert d["gate_up.weight"].placement == Shard(0)
    assert "is not 2 parts x 2 ranks" in d["gate_up.weight"].reason
    d = _decisions(TensorParallelPlanner(mesh_axis_size=2).build_plan(GLU(4), example_inputs=x))
    assert d["gate_up.weight"].placement == StridedShard(0, split_factor=2)
    assert d["gate_up.bias"].placement == StridedShard(0, split_factor=2)


def test_bert_pairs_across_parent_modules():
    """BERT's column and row projections live under different parents (attention.self.* then
    attention.output.dense; intermediate.dense then output.dense)."""
    model = MODELS["bert"].build()
    d = _decisions(TensorParallelPlanner().build_plan(model))
    layer = "bert.encoder.layer.1."
    for col in ("attention.self.query", "attention.self.key", "attention.self.value",
                "intermediate.dense"):
        assert d[layer + col + ".weight"].role == "column", col
    for row in ("attention.output.dense", "output.dense"):
        assert d[layer + row + ".weight"].role == "row", row
    # the prediction head's transform ends in a LayerNorm before the tied decoder: no pair
    assert not d["cls.predictions.transform.dense.weight"].sharded


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_has_one_decision_with_a_reason(name):
    model = MODELS[name].build()
    plan = TensorParallelPlanner().build_plan(model)
    plan = DataParallelPlanner(mesh_axis_size=2).build_plan(model, plan)
    for axis in ("tp", "dp"):
        seen = [d.names[0] for d in plan.decisions if d.axis == axis]
        assert sorted(seen) == sorted(n[0] for _, n in parameter_groups(model)), axis
    assert all(d.reason for d in plan.decisions)
    assert plan.summary().count("\n") == len(plan.decisions)


def test_mixtral_experts_and_router():
    model = MODELS["mixtral"].build()
    d = _decisions(TensorParallelPlanner().build_plan(model))
    experts = "model.layers.0.mlp.experts."
    # [E, 2I, H]: output features, gate|up fused (chunked in 2): block-strided, which the
    # grouped GEMMs carry (their column split lifted)
    assert d[experts + "gate_up_proj"].placement == StridedShard(1, split_factor=2)
    assert d[experts + "down_proj"].placement == Shard(2)     # [E, H, I]: input features
    assert not d["model.layers.0.mlp.gate.weight"].sharded    # the router pairs with nothing
    assert "router" in d["model.layers.0.mlp.gate.weight"].reason


def test_unknown_plan_key_is_refused_with_nearest_names(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    model = MODELS["llama"].build()
    plan = ShardingPlan(plan={"model.layers.0.self_attn.q_prj.weight": {"tp": Shard(0)}})
    with pytest.raises(DistCompileError, match="q_proj.weight") as err:
        shard_module(model, mesh, plan)
    assert "match no parameter" in str(err.value) and "fix" in str(err.value)

    class Net(nn.Module):
        def forward(self, input_ids, labels=None):
            return input_ids

    with pytest.raises(DistCompileError, match="input_ids"):
        shard_module(Net(), mesh, ShardingPlan(input_plan={"input_id": {"tp": Shard(0)}}))


def test_input_key_a_kwargs_forward_never_receives_is_logged(fake_mesh, caplog):
    """transformers' forwards take ``**kwargs``: any name may arrive, so a typo can only be seen
    at the call, where it is logged once."""
    mesh = fake_mesh((2,), ("tp",))

    class Net(nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    model = shard_module(Net(), mesh, ShardingPlan(input_plan={"input_id": {"tp": Shard(0)}}))
    with caplog.at_level("WARNING", logger="dynamo_dist"):
        model(torch.ones(2, 2, dtype=torch.long))
        model(torch.ones(2, 2, dtype=torch.long))
    assert sum("input_id" in r.getMessage() for r in caplog.records) == 1


def test_a_deep_copy_of_a_sharded_model_runs_its_own_weights(mesh_of_one):
    """``shard_module`` wraps the forward of a model with an input or output plan (and of an
    embedding split by rows on two axes). The wrapper was a closure over the model, so
    ``copy.deepcopy(model)`` (an EMA or teacher copy) ran the ORIGINAL model's forward: its
    outputs came from the original's weights, silently (seen on 2 gloo ranks). The copy must
    compute with its own weights, and the original with its own, through the same plans."""
    import copy

    mesh = mesh_of_one(("dp", "tp"))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj = nn.Embedding(8, 4), nn.Linear(4, 4)

        def forward(self, ids):
            return self.proj(self.embed(ids))

    torch.manual_seed(0)
    model, ids = Net(), torch.tensor([[1, 2], [3, 4]])
    want = model(ids).detach()
    plan = ShardingPlan(plan={"embed.weight": {"dp": Shard(0), "tp": Shard(0)}},
                        input_plan={"*": {"dp": Shard(0)}}, output_plan={0: {"dp": Shard(0)}})
    shard_module(model, mesh, plan)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert list(inspect.signature(twin.forward).parameters) == ["ids"]  # transformers reads it
    assert twin(ids).full_tensor().abs().max().item() == 0.0
    torch.testing.assert_close(model(ids).full_tensor(), want)
    assert twin.embed.forward.__self__ is twin.embed and twin.forward.__self__ is twin


@pytest.mark.parametrize("name,aliases", [
    ("gpt2", {"transformer.wte.weight", "lm_head.weight"}),
    ("bert", {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"}),
    ("t5", {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "lm_head.weight"}),
])
def test_tied_parameters_become_one_dtensor(fake_mesh, name, aliases):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    model = MODELS[name].build()
    plan = TensorParallelPlanner().build_plan(model)
    plan = DataParallelPlanner(mesh_axis_size=2).build_plan(model, plan)
    shard_module(model, mesh, plan)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {id(params[a]) for a in aliases}
    assert len(tied) == 1 and isinstance(params[next(iter(aliases))], DTensor)
    assert sum(1 for _ in model.parameters()) == len(parameter_groups(model))


def test_conflicting_placements_of_a_tie_are_refused(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    model = MODELS["gpt2"].build()
    plan = ShardingPlan(plan={"transformer.wte.weight": {"tp": Shard(0)},
                              "lm_head.weight": {"tp": Shard(1)}})
    with pytest.raises(DistCompileError, match="tied parameter") as err:
        shard_module(model, mesh, plan)
    assert "lm_head.weight" in str(err.value) and "same placement" in str(err.value)


def test_structural_fallback_without_example_inputs():
    """A module that is not a transformers model and gets no example inputs is paired by its
    structure (Linear children that widen and narrow back), and says so."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    plan = TensorParallelPlanner().build_plan(Block())
    d = _decisions(plan)
    assert d["a.weight"].placement == Shard(0) and "structure" in d["a.weight"].reason
    assert d["b.weight"].placement == Shard(1)
    with_inputs = _decisions(TensorParallelPlanner().build_plan(
        Block(), example_inputs=(torch.randn(2, 8),)))
    assert "dataflow" in with_inputs["a.weight"].reason


def test_data_parallel_inputs_default_to_every_batch_argument(fake_mesh, monkeypatch):
    """``DataParallelPlanner``'s default input plan splits every tensor argument whose dim 0 is
    the batch (T5's decoder ids, a ConvNet's labels), and not a broadcast [1, S] argument."""
    import dynamo_dist.plans.apply as apply

    mesh = fake_mesh((2,), ("dp",))
    calls = []
    monkeypatch.setattr(apply, "pin_placements",
                        lambda t, m, p, *_: calls.append((tuple(t.shape), tuple(p))) or t)

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x, labels, position_ids=None):
            return (x * self.w).sum() + labels.sum() + position_ids.sum()

    model = Probe()
    shard_module(model, mesh, DataParallelPlanner().build_plan(model))
    model(torch.ones(6, 4), torch.ones(6), position_ids=torch.ones(1, 4))
    assert calls == [((6, 4), (Shard(0),)), ((6,), (Shard(0),))]


def test_heads_a_split_would_cut_stay_whole():
    """Gemma's multi-query attention has one key/value head: with the tp size known, k/v stay
    replicated (the attention rule reads them whole beside the head-split query) instead of
    splitting head_dim, which would gather them back before attention."""
    model = MODELS["gemma"].build()
    d = _decisions(TensorParallelPlanner(mesh_axis_size=2).build_plan(model))
    attn = "model.layers.0.self_attn."
    assert d[attn + "q_proj.weight"].placement == Shard(0)
    for kv in ("k_proj", "v_proj"):
        assert d[attn + kv + ".weight"].role == "whole heads" and "1 attention head" in \
            d[attn + kv + ".weight"].reason
    assert d[attn + "o_proj.weight"].placement == Shard(1)
    llama = _decisions(TensorParallelPlanner(mesh_axis_size=2).build_plan(MODELS["llama"].build()))
    assert llama["model.layers.0.self_attn.k_proj.weight"].placement == Shard(0)  # 2 kv heads


def test_relative_position_bias_table_splits_with_the_heads():
    """T5's relative_attention_bias is an embedding of [buckets, heads] added to each head's
    scores: split on its head columns, its gradient stays local (no gather of it or of the
    head-split scores' gradient)."""
    model = MODELS["t5"].build()
    d = _decisions(TensorParallelPlanner(mesh_axis_size=2).build_plan(model))
    table = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert d[table].placement == Shard(1) and d[table].role == "head table"
    assert not d["shared.weight"].sharded  # the word embedding is not a head table
    odd = _decisions(TensorParallelPlanner(mesh_axis_size=3).build_plan(MODELS["t5"].build()))
    assert not odd[table].sharded and "does not divide" in odd[table].reason


def test_data_axes_belong_to_one_mesh_object_not_to_equal_meshes(fake_mesh):
    """DeviceMesh compares by value: a later mesh with the same ranks and axis names (a new
    process group, another model) must not inherit the data axes a planner gave an earlier one
    (it changed how the later program was planned)."""
    from inductor_passes.core.mesh_facts import add_data_axes, data_axes

    first = fake_mesh((2,), ("dp",))
    add_data_axes(first, ("dp",))
    second = fake_mesh((2,), ("dp",))
    assert second == first and second is not first
    assert data_axes(first) == ("dp",) and data_axes(second) == ()


class _BrokenMLP(nn.Module):
    """Two linears with a graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).sum()


def test_data_axes_reach_the_planner_when_dynamo_passes_the_mesh_as_an_opaque_input(
        fake_mesh, monkeypatch):
    """torch 2.13's Dynamo passes a DeviceMesh that is a graph input (here the closure of the
    data-parallel input constraint, in the graph before a break) as a FakeScriptObject, and
    DTensors fakeified with it carry that stand-in. The data axes live on the real mesh
    object: read through the stand-in they were lost, and the graph was planned as if its
    data axis were a free tensor-parallel axis (GPT-2 in the zoo on dp=2 x tp=2)."""
    import dynamo_dist.backend as backend

    mesh = fake_mesh((2, 2), ("dp", "tp"))
    model = _BrokenMLP()
    shard_module(model, mesh, DataParallelPlanner(axis="dp", mesh_axis_size=2).build_plan(model))
    seen, planner = [], backend.propagate

    def recording(gm, m, *args, **kwargs):
        seen.append((m, kwargs.get("data_axes")))
        return planner(gm, m, *args, **kwargs)

    monkeypatch.setattr(backend, "propagate", recording)
    torch.compile(model, backend="dist", options={"inductor": False})(torch.randn(4, 8)).backward()
    assert len(seen) >= 2  # the break: two programs or more
    assert all(m is mesh for m, _ in seen)
    assert [axes for _, axes in seen] == [("dp",)] * len(seen)


class _Scorer(nn.Module):
    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.lin, self.mix = nn.Linear(4, 4), mix

    def forward(self, x):
        h = self.lin(x)
        if self.mix:  # a sort over every sample's scores mixes the batch
            h = torch.sort(h.flatten()).values.cumsum(0)
        return h.square().mean()


@pytest.mark.parametrize("mix", [False, True])
def test_a_batch_gathered_on_a_data_axis_is_logged(fake_mesh, caplog, mix):
    """Data parallelism never gathers the batch; when an op leaves no other placement the
    compile says so (which op, bytes, the user's line), and a plain data-parallel model is
    silent."""
    import logging

    mesh = fake_mesh((2,), ("dp",))
    model = _Scorer(mix)
    shard_module(model, mesh, DataParallelPlanner(mesh_axis_size=2).build_plan(model))
    with caplog.at_level(logging.WARNING, logger="dynamo_dist"):
        torch.compile(model, backend="dist", options={"inductor": False})(torch.randn(8, 4))
    said = [r.getMessage() for r in caplog.records if "data axis 'dp'" in r.getMessage()]
    if not mix:
        assert not said, said
    else:
        assert len(said) == 1 and "all_gathered" in said[0] and "B per rank" in said[0], said
        assert "test_planners.py" in said[0] and "local_map" in said[0], said
