"""One tensor dim split by several mesh axes ([Shard(0), Shard(0)], the partition spec
(("a", "b"), None)), nested in mesh-axis order as DTensor lays it out. Such a pin inside a
program computed wrong numbers with no error (softmax, cat, a matmul over [S(1), S(1)]: issue
14); now every redistribute into or out of it acts on the innermost split only, checked here
against the definition on every rank, and the programs that went wrong match one device.
Random programs over such placements: tests/test_sharding_properties.py."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from dynamo_dist import compile_records, mark_sharding, with_sharding_constraint
from dynamo_dist.testing.conformance.simulate import run_spmd
from inductor_passes.core.placements import local_shape, plannable, valid_for
from inductor_passes.sharding.rules import RuleKind
from tests.test_strided import _check_redistribute, _redistribute_on_ranks

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial("sum")

PROGRAMS = {  # name: (program of x, w), global x shape, placements pinned on x
    "softmax": (lambda x, w: torch.softmax(x, 0) * w.sum(), (5,), [S0, S0]),
    "matmul": (lambda x, w: w @ x, (8, 8), [S1, S1]),
    "cat": (lambda x, w: torch.cat([x, 2 * x]), (5,), [S0, S0]),
    "pointwise": (lambda x, w: (3 * x).exp(), (6, 3), [S0, S0]),
    "uneven_matmul": (lambda x, w: w[:, :7] @ x, (7, 10), [S1, S1]),
}


def test_local_shape_nests_in_mesh_axis_order():
    # 10 over a (2, 2) mesh: axis 0 chunks 5 | 5, axis 1 chunks each 5 into 3 | 2 (DTensor's)
    assert [local_shape((10,), (S0, S0), (2, 2), c)[0]
            for c in itertools.product(range(2), repeat=2)] == [3, 2, 3, 2]
    assert valid_for((10,), (S0, S0), (2, 2), nested=True)
    assert not valid_for((10,), (S0, S0), (2, 2))  # op rules are not offered nested splits
    assert plannable((10, 4), (S0, S0), (2, 2)) == ((S0, S0), [])


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_nested_pin_inside_a_program_computes_exactly(fake_mesh, name):
    mesh = fake_mesh((2, 2), ("a", "b"))
    op, shape, pls = PROGRAMS[name]

    def f(x, w):
        return op(with_sharding_constraint(x, mesh, pls), w)

    x, w = torch.randn(shape), torch.randn(8, 8)
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(x, mesh, [R, R]), distribute_tensor(w, mesh, [R, R]))
    record = compile_records()[-1]
    by_name = {"L_x_": x, "L_w_": w}
    (got,), _ = run_spmd(record, [by_name[i.name] for i in record.program.primal_inputs], None,
                         mesh)
    torch.testing.assert_close(got, op(x, w))
    pinned = [p for p in record.plan.nodes.values() if p.kind is RuleKind.CONSTRAINT]
    assert pinned and tuple(pinned[0].output) == tuple(pls)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_an_input_split_by_two_axes_is_held_and_computes_exactly(fake_mesh, name):
    """x arrives as a DTensor in the nested layout: planned as it is (no gather at the
    boundary), redistributed inside the program where an op needs another layout."""
    mesh = fake_mesh((2, 2), ("a", "b"))
    op, shape, pls = PROGRAMS[name]
    x, w = torch.randn(shape), torch.randn(8, 8)
    torch.compile(op, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(x, mesh, pls), distribute_tensor(w, mesh, [R, R]))
    record = compile_records()[-1]
    by_name = {"L_x_": x, "L_w_": w}
    primals = record.program.primal_inputs
    x_node = next(f"primals_{k + 1}" for k, i in enumerate(primals) if i.name == "L_x_")
    assert tuple(record.plan.placement(x_node)) == tuple(pls)
    (got,), _ = run_spmd(record, [by_name[i.name] for i in primals], None, mesh)
    torch.testing.assert_close(got, op(x, w))


def test_mark_sharding_with_two_axes_on_one_dim_inside_a_program(fake_mesh):
    mesh = fake_mesh((2, 2), ("a", "b"))

    def f(x):
        return mark_sharding(x * 2, mesh, (("a", "b"), None)).softmax(0)

    x = torch.randn(10, 3)
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(x, mesh, [R, R]))
    (got,), _ = run_spmd(compile_records()[-1], [x], None, mesh)
    torch.testing.assert_close(got, (x * 2).softmax(0))


# ---------------------------------------------------------------------------------------------
# redistribute against the definition (the simulator's shard_global), every rank
# ---------------------------------------------------------------------------------------------
_AXIS = st.sampled_from([R, S0, S1, P])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.tuples(_AXIS, _AXIS), dst=st.tuples(_AXIS, _AXIS),
       shape=st.sampled_from([(12, 8), (5, 3), (7, 10)]))
def test_redistribute_2x2_with_nested_splits_matches_definition(fake_mesh, src, dst, shape):
    """(All 768 valid pairs on these shapes passed once, 26 s; a sample is kept.)"""
    mesh = fake_mesh((2, 2), ("a", "b"))
    _check_redistribute(mesh, torch.randn(shape, dtype=torch.float64), src, dst)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.tuples(_AXIS, _AXIS, _AXIS), dst=st.tuples(_AXIS, _AXIS, _AXIS),
       shape=st.sampled_from([(12, 8), (7, 10)]))
def test_redistribute_2x2x2_with_nested_splits_matches_definition(fake_mesh, src, dst, shape):
    """Three mesh axes, up to three on one dim (1800 sampled pairs passed once, 3 min)."""
    mesh = fake_mesh((2, 2, 2), ("a", "b", "c"))
    _check_redistribute(mesh, torch.randn(shape, dtype=torch.float64), src, dst)


@pytest.mark.parametrize("src,dst,kinds", [
    ((P, P), (S0, S0), ["reduce_scatter", "reduce_scatter"]),   # ZeRO over two axes
    ((S0, S0), (R, R), ["all_gather", "all_gather"]),
    ((R, R), (S0, S0), []),                                      # local slices
    ((S0, S0), (S0, R), ["all_gather"]),                         # the inner axis only
    ((S0, R), (S0, S0), []),
    ((S1, S0), (S0, S0), ["all_gather", "all_to_all"]),
])
def test_nested_redistribute_collectives(fake_mesh, src, dst, kinds):
    mesh = fake_mesh((2, 2), ("a", "b"))
    full = torch.randn(8, 6, dtype=torch.float64)
    _check_redistribute(mesh, full, src, dst)
    _, records, _ = _redistribute_on_ranks(mesh, full, src, dst)
    assert sorted(records[(0, 0)]) == sorted(kinds)


@pytest.mark.parametrize("src,dst,kinds", [
    ((S0, P), (R, S1), ["reduce_scatter", "all_gather"]),
    ((S0, P, R), (R, S1, R), ["reduce_scatter", "all_gather"]),
    ((S0, R, P), (R, R, S1), ["reduce_scatter", "all_gather"]),
    ((S0, S1), (R, Shard(2)), ["all_to_all", "all_gather"]),
])
def test_a_move_runs_before_the_gathers_that_grow_its_buffer(fake_mesh, src, dst, kinds):
    """A pending sum that ends split, or a split that moves to another dim, among dims no other
    axis splits, moves before an earlier axis gathers: the order the cost model prices (the
    embedding backward's token gradients, [S(0), P] -> [R, S(2)], were reduce-scattered at 8x
    the bytes after the gather)."""
    mesh = fake_mesh((2,) * len(src), ("a", "b", "c")[:len(src)])
    full = torch.randn(8, 6, 4, dtype=torch.float64)
    _check_redistribute(mesh, full, src, dst)
    _, records, _ = _redistribute_on_ranks(mesh, full, src, dst)
    assert records[(0,) * len(src)] == kinds


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.tuples(_AXIS, _AXIS, _AXIS), dst=st.tuples(_AXIS, _AXIS, _AXIS),
       one=st.sampled_from([0, 1, 2]), shape=st.sampled_from([(12, 8), (7, 10)]))
def test_a_size_one_mesh_axis_moves_nothing(fake_mesh, src, dst, one, shape):
    """A mesh axis of size 1 (dp=1 beside tp=2, a world of one): every placement on it holds
    the whole value, so a redistribute issues exactly the collectives of the same move on the
    mesh without that axis (none on a world of one) and still matches the definition."""
    sizes = [2, 2, 2]
    sizes[one] = 1
    mesh = fake_mesh(tuple(sizes), ("a", "b", "c"))
    full = torch.randn(shape, dtype=torch.float64)
    _check_redistribute(mesh, full, src, dst)
    _, records, _ = _redistribute_on_ranks(mesh, full, src, dst)
    drop = [k for k in range(3) if k != one]
    smaller = fake_mesh((2, 2), ("a", "b"))
    _, want, _ = _redistribute_on_ranks(smaller, full, tuple(src[k] for k in drop),
                                        tuple(dst[k] for k in drop))
    assert sorted(records[(0, 0, 0)]) == sorted(want[(0, 0)]), (src, dst, one)
