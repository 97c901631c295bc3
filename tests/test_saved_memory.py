"""The planner's memory term (``PlannerConfig.saved_memory_weight``) and budget
(``saved_memory_budget_bytes``): what it counts, the trade it makes (a split saved activation
for a collective's latency: sequence parallelism), that the trade is monotone in the weight,
that a budget is kept or refused, and that the plans it makes train at parity."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_dist import compile_records
from dynamo_dist.testing.models import LlamaSize, token_batch
from dynamo_dist.testing.zoo.cell import SimRuntime
from inductor_passes.core import roles
from inductor_passes.core.errors import DistCompileError
from inductor_passes.sharding.config import PlannerConfig
from inductor_passes.sharding.cost import saved_bytes, saved_values
from inductor_passes.sharding.propagate import propagate

from conftest import lm_steps_at_parity, simulated_llama

R = Replicate()


def _joint(b: int, d: int, h: int):
    """The joint graph of ``z = gelu(relu(x @ w1) @ w2) @ w3`` (Megatron's column/row pair, then
    a pointwise op whose output feeds a column-parallel matmul), its backward written out as
    capture traces it: forward outputs z, then the gradients of w1, w2, w3. The backward reads
    x, relu's output, the row-parallel matmul's output y and gelu(y)."""
    def step(x, w1, w2, w3, tangent):
        pre = x @ w1
        a = torch.relu(pre)
        y = a @ w2
        g = torch.nn.functional.gelu(y)
        z = g @ w3
        dg = tangent @ w3.t()
        dw3 = g.t() @ tangent
        dy = torch.ops.aten.gelu_backward(dg, y)
        dw2 = a.t() @ dy
        da = dy @ w2.t()
        dpre = torch.ops.aten.threshold_backward(da, a, 0)
        dw1 = x.t() @ dpre
        return z, dw1, dw2, dw3

    shapes = [(b, d), (d, h), (h, d), (d, h), (b, h)]
    gm = make_fx(step, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for k, node in enumerate(placeholders[:-1]):
        node.name = roles.primal_name(k)
    placeholders[-1].name = roles.tangent_name(0)
    gm.recompile()
    return gm


_PINNED = [(R,), (Shard(1),), (Shard(0),), (Shard(1),)]  # x; Megatron's w1, w2; w3 column


def _plan(gm, mesh, weight: float, method: str = "ilp", budget: float = 0.0):
    origins = [roles.InputOrigin(roles.InputKind.PLAIN, "x")] + [
        roles.InputOrigin(roles.InputKind.DTENSOR, f"w{i}") for i in (1, 2, 3)]
    return propagate(gm, mesh, _PINNED, 1, [0], [None, *_PINNED[1:]], lambda n: None, origins,
                     config=PlannerConfig(method=method, saved_memory_weight=weight,
                                          saved_memory_budget_bytes=budget))


def _saved(gm, plan, mesh_shape) -> int:
    return saved_bytes(gm.graph, lambda n: plan.nodes[n.name].output, mesh_shape)


def test_saved_values_are_the_forward_values_the_backward_reads():
    gm = _joint(8, 4, 16)
    names = {n.name for n in saved_values(gm.graph)}
    # relu's output (its own and w2's gradient), y (gelu's backward) and gelu(y) (w3's
    # gradient, read through its transpose: counted once, as its base); not the inputs
    # (pinned) nor their transposes, not the forward output z (the caller's)
    assert names == {"relu", "mm_1", "gelu"}, names


@pytest.mark.parametrize("method", ["ilp", "greedy"])
def test_a_priced_saved_activation_is_split_where_megatron_replicates_it(fake_mesh, method):
    """Unpriced, the plan is Megatron's: y all-reduced, gelu(y) computed and saved whole on
    every rank. Priced at 4 bytes on the wire per saved byte, gelu runs on a split of y (y
    reduce-scattered, as sequence parallelism does, Korthikanti et al. 2022, or w2 turned
    column-parallel), for more bytes on the wire. The ILP keeps no saved value whole: half the
    bytes of y and gelu(y). The greedy walk, one node at a time, still saves y as its pending
    sum (whole), but splits gelu."""
    mesh = fake_mesh((2,), ("tp",))
    gm = _joint(256, 64, 128)
    megatron, priced = _plan(gm, mesh, 0.0, method), _plan(gm, mesh, 4.0, method)
    assert megatron.nodes["gelu"].output == (R,)  # y: a Partial sum, all-reduced for gelu
    assert isinstance(priced.nodes["gelu"].output[0], Shard), priced.to_text()
    kept = [_saved(gm, p, (2,)) for p in (megatron, priced)]
    if method == "ilp":
        for node in saved_values(gm.graph):
            assert isinstance(priced.nodes[node.name].output[0], Shard), priced.to_text()
        assert kept[0] - kept[1] == 2 * 256 * 64 * 4 // 2  # y and gelu(y): half of each
    else:
        assert kept[1] < kept[0]
    wire = [sum(n.cost for n in p.nodes.values()) for p in (megatron, priced)]
    assert wire[1] > wire[0]


# one mesh for every example (it is not changed by planning)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.sampled_from([16, 64, 256]), d=st.sampled_from([8, 32, 64]),
       h=st.sampled_from([16, 64]), weights=st.lists(st.sampled_from([0.0, 0.05, 0.5, 4.0, 64.0]),
                                                     min_size=2, max_size=2, unique=True))
def test_the_trade_is_monotone_in_the_weight(fake_mesh, b, d, h, weights):
    """For exact optima of cost + w x memory, a larger w never keeps more bytes and never pays
    less for everything else (the two optimality inequalities, added): a property of the ILP's
    answer on any shapes."""
    mesh = fake_mesh((2,), ("tp",))
    gm = _joint(b, d, h)
    lo, hi = sorted(weights)
    plan_lo, plan_hi = _plan(gm, mesh, lo), _plan(gm, mesh, hi)
    mem_lo, mem_hi = _saved(gm, plan_lo, (2,)), _saved(gm, plan_hi, (2,))
    assert mem_hi <= mem_lo
    rest_lo, rest_hi = plan_lo.total_cost - lo * mem_lo, plan_hi.total_cost - hi * mem_hi
    assert rest_hi >= rest_lo - 1e-6 * max(1.0, rest_lo)


@pytest.mark.parametrize("method", ["ilp", "greedy"])
def test_a_budget_gets_the_plan_of_the_least_weight_that_fits(fake_mesh, method):
    """Budgets between the least a plan can keep and what the unpriced plan keeps: the plan
    fits and records its bytes and weight; the ILP's is the constrained optimum (the budget a
    row of its program), the greedy walk's is re-priced until it fits. A budget the unpriced plan meets changes
    nothing; one below the least found is refused, naming both figures."""
    mesh = fake_mesh((2,), ("tp",))
    gm = _joint(256, 64, 128)
    free, frugal = _plan(gm, mesh, 0.0, method), _plan(gm, mesh, 1e4, method)
    assert free.saved_bytes == _saved(gm, free, (2,)) > frugal.saved_bytes
    assert f"{free.saved_bytes} bytes per rank" in free.to_text()
    for budget in (frugal.saved_bytes, (free.saved_bytes + frugal.saved_bytes) // 2):
        fit = _plan(gm, mesh, 0.0, method, budget=budget)
        assert fit.saved_bytes <= budget
        assert fit.saved_bytes == _saved(gm, fit, (2,))
        if method == "ilp":
            # the budget is a row of the one ILP: its optimum, at weight 0, is the constrained
            # one, no dearer (communication and compute) than any priced plan that fits
            assert fit.saved_memory_weight == 0.0
            for weight in (0.01, 0.1, 1.0, 10.0, 100.0, 1e4):
                priced = _plan(gm, mesh, weight)
                if priced.saved_bytes <= budget:
                    rest = priced.total_cost - weight * priced.saved_bytes
                    assert fit.total_cost <= rest * (1 + 1e-6)
        else:  # the walk cannot take a row: re-priced until it fits
            assert fit.saved_memory_weight > 0
    same = _plan(gm, mesh, 0.0, method, budget=free.saved_bytes)
    assert {k: n.output for k, n in same.nodes.items()} == \
        {k: n.output for k, n in free.nodes.items()}
    with pytest.raises(DistCompileError, match="saved_memory_budget_bytes") as err:
        _plan(gm, mesh, 0.0, method, budget=frugal.saved_bytes - 1)
    assert str(frugal.saved_bytes) in str(err.value) and "fix:" in str(err.value)


# one mesh of each test in the default tier: the budget on the 2-D mesh, the parity on tp=2
@pytest.mark.parametrize("shape", [pytest.param({"tp": 2}, marks=pytest.mark.full),
                                   {"dp": 2, "tp": 2}])
def test_a_compiled_program_keeps_to_its_budget(fake_mesh, shape):
    """Through ``torch.compile``'s options: the demo's Llama (narrowed) on tp=2 and dp=2 x tp=2
    (FSDP and Megatron) with a budget of 80% of what the unbudgeted plan keeps for the
    backward."""
    from conftest import sharded_llama

    mesh = fake_mesh(tuple(shape.values()), tuple(shape))
    size = LlamaSize(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512,
                     seq=64, batch=8)
    kept = []
    for budget in (0.0, None):
        torch.manual_seed(0)
        model = sharded_llama(mesh, size)
        budget = budget if budget is not None else 0.8 * kept[0]
        compiled = torch.compile(model, backend="dist", options={
            "inductor": False, "planner": PlannerConfig(saved_memory_budget_bytes=budget)})
        ids = token_batch(size, 0)
        compiled(input_ids=ids, labels=ids).loss.backward()
        kept.append(compile_records()[-1].plan.saved_bytes)
        torch._dynamo.reset()
    assert kept[1] <= 0.8 * kept[0], kept


def test_the_weight_is_validated_and_read_from_the_environment():
    with pytest.raises(ValueError, match="saved_memory_weight"):
        PlannerConfig(saved_memory_weight=-1.0)
    with pytest.raises(ValueError, match="saved_memory_budget_bytes"):
        PlannerConfig(saved_memory_budget_bytes=-1.0)
    env = {"DYNAMO_DIST_PLANNER": "saved_memory_weight=0.5"}
    assert PlannerConfig.from_env(env).saved_memory_weight == 0.5
    assert PlannerConfig().saved_memory_weight == 0.0  # off: the textbook plans by default


@pytest.mark.parametrize("shape", [{"tp": 2},
                                   pytest.param({"dp": 2, "tp": 2}, marks=pytest.mark.full)])
def test_a_memory_priced_llama_trains_at_parity(shape):
    """The demo's Llama (transformers), narrowed, with the weight high enough to move the plan
    off Megatron's (sequence-split norms and loss): two steps' losses and gradients equal one
    process's on simulated ranks (every rank's local graph, run as FX); it keeps fewer bytes
    for the backward and runs more collectives than the unpriced plan. (Under Inductor on real
    gloo ranks: the zoo with ``DYNAMO_DIST_PLANNER=saved_memory_weight=100``.)"""
    size = LlamaSize(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256,
                     seq=16, batch=4)
    records = []
    for weight in (0.0, 100.0):
        rt = SimRuntime()
        ref, model = simulated_llama(rt, shape, size)
        options = {**rt.options(), "planner": PlannerConfig(saved_memory_weight=weight)}
        compiled = torch.compile(model, backend="dist", options=options)
        if weight:
            lm_steps_at_parity(compiled, model, ref, rt,
                               [token_batch(size, step) for step in range(2)])
        else:
            ids = token_batch(size, 0)
            compiled(input_ids=ids, labels=ids)
        records.append(compile_records()[-1])
        torch._dynamo.reset()
    unpriced, priced = records
    gm = unpriced.program.graph_module
    mesh_shape = tuple(shape.values())
    kept = [saved_bytes(gm.graph, lambda n, r=r: r.plan.nodes[n.name].output, mesh_shape)
            for r in records]
    assert kept[1] < kept[0], kept
    assert len(priced.ledger.entries) > len(unpriced.ledger.entries)
