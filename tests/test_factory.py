"""Factory ops that fill a tensor with one value (``rules.factory``): planned split where their
consumers are, never Partial unless the fill is zero, and right on every rank (uneven pieces
included) against one device."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner
from inductor_passes.sharding.rules import RuleKind
from tests.test_conv import check_step, compile_once
from tests.test_solver import _graph, _plan

R = Replicate()


def _loss_grad_like(b: int, v: int):
    """The shape of a cross-entropy backward: a [B, V] fill, a scatter at the targets, a
    product with the logits (batch-split inputs)."""
    def fn(logits, tgt):
        g = torch.zeros(b, v).scatter(1, tgt.long().unsqueeze(1).clamp(0, v - 1), -1.0)
        return ((g * logits).sum() + (torch.full((b, v), 0.5) * logits).sum(),)
    return _graph(fn, (b, v), (b,))


def test_a_fill_is_made_where_its_consumer_needs_it(fake_mesh):
    """Batch-split logits and targets: both fills are planned Shard(0) (made locally, no
    collective), where before this rule they were Replicate: at Llama-3-8B shapes the loss
    gradient's fill was 8 GiB on every rank."""
    gm = _loss_grad_like(16, 8)
    plan = _plan(gm, fake_mesh((2,), ("dp",)), [(Shard(0),), (Shard(0),)])
    fills = {n: p for n, p in plan.nodes.items() if p.op in ("aten.zeros.default",
                                                             "aten.full.default")}
    assert len(fills) == 2 and all(p.output == (Shard(0),) for p in fills.values()), \
        plan.to_text()
    assert all(p.source.kind is RuleKind.FACTORY for p in fills.values())


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 9), v=st.integers(1, 9), fill=st.sampled_from([0.0, 0.5, 1.0]),
       two_d=st.booleans())
def test_only_a_zero_fill_may_be_a_pending_sum(fake_mesh, b, v, fill, two_d):
    """Every OpSpec the rule offers: one per mesh axis from Replicate, Shard(d) of each dim,
    and Partial(sum) only for a zero fill (ones summed over ranks are not ones); shapes
    that do not divide (uneven pieces, empty pieces) are offered too: a fill takes any shape."""
    from inductor_passes.sharding.rules import op_strategy

    gm = _graph(lambda x: (torch.full((b, v), fill) + x,), (b, v))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.full.default)
    mesh_shape = (2, 3) if two_d else (2,)
    specs = op_strategy(node, [], None, mesh_shape, lambda n: None)
    outs = {s.output for s in specs}
    per_axis = [R, Shard(0), Shard(1)] + ([Partial()] if fill == 0.0 else [])
    if two_d:
        # one split per tensor dim, as every op rule (``placements.valid_for``)
        assert outs == {(p, q) for p in per_axis for q in per_axis
                        if not (isinstance(p, Shard) and p == q)}
    else:
        assert outs == {(p,) for p in per_axis}


class _Fills(torch.nn.Module):
    """A model whose forward and backward make tensors from nothing: a gate filled with 0.5,
    an accumulator of zeros, and a cross-entropy loss (its backward fills the logits' shape)."""

    def __init__(self, d: int = 8, classes: int = 6):
        super().__init__()
        self.up = torch.nn.Linear(d, 16)
        self.down = torch.nn.Linear(16, classes)

    def forward(self, x, labels):
        h = torch.relu(self.up(x))
        h = h * torch.full(h.shape, 0.5) + torch.ones(h.shape[0], 16)
        acc = torch.zeros(x.shape[0], 16)
        acc = acc + h
        return torch.nn.functional.cross_entropy(self.down(acc), labels)


@pytest.mark.parametrize("mesh_shape,names,batch", [
    ((2,), ("dp",), 4), ((2,), ("dp",), 3),   # even and uneven batch pieces
    ((2, 2), ("dp", "tp"), 4), ((2,), ("tp",), 5)])
def test_fills_train_like_one_device(fake_mesh, mesh_shape, names, batch):
    """One step on every simulated rank against one device: loss and every gradient."""
    mesh = fake_mesh(mesh_shape, names)
    torch.manual_seed(0)
    ref = _Fills()
    model = copy.deepcopy(ref)
    plan = TensorParallelPlanner().build_plan(model) if "tp" in names else None
    if "dp" in names:
        plan = DataParallelPlanner(mesh_axis_size=2).build_plan(model, plan)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(batch, 8, generator=g), torch.randint(0, 6, (batch,), generator=g))
    record = compile_once(model, mesh, plan, data)
    fills = [p for p in record.plan.nodes.values() if p.source.kind is RuleKind.FACTORY and
             p.op != "aten.scalar_tensor.default"]
    assert fills, record.plan.to_text()
    if "dp" in names:  # the batch is split: so is every fill of a batch-sized shape
        assert all(any(isinstance(q, Shard) for q in p.output) for p in fills
                   if p.op in ("aten.full.default", "aten.zeros.default", "aten.ones.default")), \
            record.plan.to_text()
    check_step(record, ref, mesh, data)
