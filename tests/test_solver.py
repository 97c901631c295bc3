"""The planner on its own (issue 16): hand-made global graphs whose optimal plan is known, solved
by ``propagate`` (ILP and greedy walk) with no capture, lowering or compile around it."""

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_passes.core import roles
from inductor_passes.sharding.config import PlannerConfig
from inductor_passes.sharding.cost import compute_cost, redistribute_cost
from inductor_passes.sharding.propagate import propagate

R, F32 = Replicate(), torch.float32


def _graph(fn, *shapes):
    """``fn`` traced on fakes of ``shapes``, its placeholders named as capture names primals."""
    gm = make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    for k, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        node.name = roles.primal_name(k)
    gm.recompile()
    return gm


def _plan(gm, mesh, placements, config=PlannerConfig(), origins=()):
    return propagate(gm, mesh, placements, 1, [], [], lambda n: None, origins, config=config)


@pytest.mark.parametrize("method", ["ilp", "greedy"])
def test_megatron_pair_is_one_all_reduce(fake_mesh, method):
    """Column- then row-parallel weights (Megatron-LM's MLP): both matmuls run locally and the
    only collective is the all_reduce of the output, so the plan's cost is that all_reduce plus
    the two matmuls' flops split over the mesh axis: the optimum, as no plan moves less."""
    mesh = fake_mesh((2,), ("tp",))
    b, d, h = 8, 16, 32
    gm = _graph(lambda x, w1, w2: (torch.relu(x @ w1) @ w2,), (b, d), (d, h), (h, d))
    plan = _plan(gm, mesh, [(R,), (Shard(1),), (Shard(0),)], PlannerConfig(method=method))
    outs = {name: n.output for name, n in plan.nodes.items() if n.op != "output"}
    assert outs["mm"] == (Shard(1),) and outs["relu"] == (Shard(1),)
    assert outs["mm_1"] == (Partial(),)
    all_reduce = redistribute_cost((b, d), F32, (Partial(),), (R,), (2,))
    assert plan.nodes["output"].cost == pytest.approx(all_reduce)
    if method == "ilp":  # the ILP's objective also counts the flops
        flops = compute_cost("aten.mm.default", (b, h), d, (Shard(1),), (2,)) + \
            compute_cost("aten.mm.default", (b, d), h, (Partial(),), (2,))
        assert plan.total_cost == pytest.approx(all_reduce + flops)


def test_param_gather_factor_decides_gather_weight_or_activation(fake_mesh):
    """A column-parallel matmul feeding a softmax over the split dim: move the activation (an
    all_to_all of 4 KiB per rank to split the rows instead) or gather the weight (256 B, but a
    gathered parameter stays resident, priced x ``param_gather_factor``). At the default (3)
    the activation moves and the weight stays split; at 1 the smaller weight is gathered."""
    mesh = fake_mesh((2,), ("tp",))
    b, d, h = 64, 4, 32
    gm = _graph(lambda x, w: (torch.softmax(x @ w, -1),), (b, d), (d, h))
    origins = [roles.InputOrigin(roles.InputKind.PLAIN, "x"),
               roles.InputOrigin(roles.InputKind.DTENSOR, "w")]
    default = _plan(gm, mesh, [(R,), (Shard(1),)], origins=origins)
    assert default.nodes["mm"].inputs[1] == (Shard(1),)
    assert default.nodes["_softmax"].inputs[0] != (Shard(1),)  # softmax's dim is whole
    cheap = _plan(gm, mesh, [(R,), (Shard(1),)], PlannerConfig(param_gather_factor=1.0), origins)
    assert cheap.nodes["mm"].inputs[1] == (R,)
    assert cheap.total_cost < default.total_cost


def test_a_pinned_layout_costs_the_collectives_it_forces(fake_mesh):
    """Row-parallel first (weights in the wrong order for Megatron): the first matmul's output
    is Partial, relu is not linear, so it must be reduced before relu; the plan pays at least
    that all_reduce, and no more than the naive plan that gathers both weights."""
    mesh = fake_mesh((2,), ("tp",))
    b, d, h = 8, 16, 32
    gm = _graph(lambda x, w1, w2: (torch.relu(x @ w1) @ w2,), (b, d), (d, h), (h, d))
    plan = _plan(gm, mesh, [(R,), (Shard(0),), (Shard(1),)])
    assert plan.nodes["relu"].inputs[0] != (Partial(),)
    gather_weights = redistribute_cost((d, h), F32, (Shard(0),), (R,), (2,)) + \
        redistribute_cost((h, d), F32, (Shard(1),), (R,), (2,)) + \
        compute_cost("aten.mm.default", (b, h), d, (R,), (2,)) + \
        compute_cost("aten.mm.default", (b, d), h, (R,), (2,))
    assert plan.total_cost <= gather_weights + 1e-6


def test_the_plan_records_how_planning_went(fake_mesh):
    """``Plan.stages``: each step that ran, timed, with the cost it reached (benchmarks read
    this rather than wrapping the planner)."""
    mesh = fake_mesh((2,), ("tp",))
    gm = _graph(lambda x, w1, w2: (torch.relu(x @ w1) @ w2,), (8, 16), (16, 32), (32, 16))
    pls = [(R,), (Shard(1),), (Shard(0),)]
    ilp = _plan(gm, mesh, pls)
    assert [s.stage for s in ilp.stages] == ["repeat classes", "ILP"]
    assert ilp.stages[1].solved and ilp.stages[1].objective == pytest.approx(ilp.total_cost)
    greedy = _plan(gm, mesh, pls, PlannerConfig(method="greedy", greedy_rounds=2))
    assert {s.stage for s in greedy.stages} == {"greedy walk"}
    assert 1 <= len(greedy.stages) <= 2 and all(s.seconds >= 0 for s in greedy.stages)
    capped = _plan(gm, mesh, pls, PlannerConfig(axis_max_vars=1))  # too large: greedy instead
    assert capped.stages[1].stage == "ILP" and not capped.stages[1].solved
    assert capped.stages[2].stage == "greedy walk"


def test_a_2d_plan_records_its_separable_start_and_descent(fake_mesh):
    """On a 2-D mesh too large for the joint ILP (cap 1 variable here): one ILP per mesh axis,
    their combination, its pricing and the per-axis descent, each recorded; the plan is the
    Megatron pair on tp whatever dp does."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    gm = _graph(lambda x, w1, w2: (torch.relu(x @ w1) @ w2,), (8, 16), (16, 32), (32, 16))
    plan = _plan(gm, mesh, [(Shard(0), R), (R, Shard(1)), (R, Shard(0))],
                 PlannerConfig(joint_max_vars=1))
    names = [s.stage for s in plan.stages]
    assert names[:5] == ["repeat classes", "joint N-D ILP", "per-axis start ILP (dp)",
                         "per-axis start ILP (tp)", "separable start (total)"], names
    # the joint ILPs (whole program, and outside repeated layers) are over the cap of 1
    assert not plan.stages[1].solved and all(s.solved for s in plan.stages[2:]
                                             if "joint" not in s.stage)
    assert any(n.startswith("descent ILP") for n in names)
    assert plan.nodes["mm"].output[1] == Shard(1) and plan.nodes["mm_1"].output[1] == Partial()


def test_lp_relaxation_taken_only_when_integral():
    """``solver._solve`` takes the LP relaxation's answer only where its binary variables come
    out 0/1; a fractional relaxation falls back to the MIP (whose answer is integral and costs
    more than the LP's bound), and an infeasible one is reported as infeasible."""
    import numpy as np
    from scipy.optimize import LinearConstraint

    from inductor_passes.sharding import solver

    binary = np.ones(2)
    # choose exactly one of two options: the relaxation's vertex is integral
    one = solver._solve(np.array([3.0, 1.0]), LinearConstraint(np.ones((1, 2)), 1, 1), binary,
                        10.0)
    assert one.status == 0 and list(np.round(one.x)) == [0, 1] and one.fun == pytest.approx(1.0)
    # max x1 + x2 with x1 + x2 <= 1.5: the relaxation takes 1.5 (one variable at 0.5), the MIP 1
    frac = solver._solve(np.array([-1.0, -1.0]), LinearConstraint(np.ones((1, 2)), -np.inf, 1.5),
                         binary, 10.0)
    assert frac.status == 0 and frac.fun == pytest.approx(-1.0)
    assert set(np.round(frac.x, 9)) <= {0.0, 1.0}
    infeasible = solver._solve(np.array([1.0, 1.0]), LinearConstraint(np.ones((1, 2)), 3, 3),
                               binary, 10.0)
    assert infeasible.status == 2


@pytest.mark.parametrize("parameter", [True, False])
def test_a_dtensor_input_that_is_no_parameter_is_priced_as_data_on_a_data_axis(fake_mesh,
                                                                               parameter):
    """A block compiled on its own gets the previous block's activations as a DTensor input,
    split over the batch on the data axis. A softmax over the batch needs it whole there: a
    parameter input may be gathered at no extra price (FSDP gathers parameters on a data
    axis), so the planner gathers the input, the larger value; an input that is no
    parameter (``InputOrigin.parameter``) is data, priced as any activation: the matmul runs
    on the batch split and its smaller output is moved instead (an all_to_all to a split of
    the other dim)."""
    mesh = fake_mesh((2,), ("dp",))
    b, d, h = 8, 64, 16
    gm = _graph(lambda x, w: (torch.softmax(x @ w, 0),), (b, d), (d, h))
    origins = [roles.InputOrigin(roles.InputKind.DTENSOR, "x", parameter=parameter),
               roles.InputOrigin(roles.InputKind.DTENSOR, "w")]
    plan = propagate(gm, mesh, [(Shard(0),), (R,)], 1, [], [], lambda n: None, origins,
                     data_axes=("dp",))
    if parameter:
        assert plan.nodes["mm"].inputs[0] == (R,)
    else:
        assert plan.nodes["mm"].inputs[0] == (Shard(0),)
        assert plan.nodes["_softmax"].inputs[0] == (Shard(1),)


def test_which_dtensor_inputs_the_planner_takes_for_parameters():
    """An ``nn.Parameter``, or a leaf that requires grad (a functional program's weight), is a
    parameter; a value computed before the program (a block's incoming activations: not a
    leaf) or a leaf that needs no gradient (data, optimizer state) is not."""
    from dynamo_dist.capture import ArgKind, InputInfo

    def origin(**kw):
        return InputInfo(0, "x", ArgKind.DTENSOR, **kw).origin().parameter

    assert origin(parameter=True, requires_grad=True)
    assert origin(requires_grad=True)  # distribute_tensor(w).requires_grad_()
    assert not origin(requires_grad=True, computed=True)
    assert not origin()
