"""One tensor dim split by two mesh axes ([Shard(0), Shard(0)], the partition spec
(("a", "b"), None)): never planned inside a program, where it computed wrong numbers with no
error (softmax, cat, a matmul over [S(1), S(1)]); an input in that layout is gathered on the
extra axis at the boundary and computes exactly. (Issue 14: nested splits are not planned yet.)"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dynamo_dist import DistCompileError, compile_records, with_sharding_constraint
from dynamo_dist.conformance.simulate import run_spmd

S0, S1, R = Shard(0), Shard(1), Replicate()

PROGRAMS = {  # name: (program of x, w), global x shape, placements pinned on x
    "softmax": (lambda x, w: torch.softmax(x, 0) * w.sum(), (5,), [S0, S0]),
    "matmul": (lambda x, w: w @ x, (8, 8), [S1, S1]),
    "cat": (lambda x, w: torch.cat([x, 2 * x]), (5,), [S0, S0]),
    "pointwise": (lambda x, w: (3 * x).exp(), (6, 3), [S0, S0]),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_nested_constraint_inside_a_program_is_refused_naming_the_line(fake_mesh, name):
    mesh = fake_mesh((2, 2), ("a", "b"))
    op, shape, pls = PROGRAMS[name]

    def f(x, w):
        return op(with_sharding_constraint(x, mesh, pls), w)

    x = distribute_tensor(torch.randn(shape), mesh, [R, R])
    w = distribute_tensor(torch.randn(8, 8), mesh, [R, R])
    with pytest.raises(Exception) as err:  # Dynamo wraps a backend's error
        torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(x, w)
    msg = str(err.value)
    assert "DistCompileError" in msg and "nested sharding" in msg, msg
    assert "test_nested_splits.py" in msg and "with_sharding_constraint(x, mesh, pls)" in msg
    assert str(tuple(shape)) in msg and "DeviceMesh(a=2, b=2)" in msg and "fix:" in msg


def test_mark_sharding_with_two_axes_on_one_dim_is_refused_inside_a_program(fake_mesh):
    from dynamo_dist import mark_sharding

    mesh = fake_mesh((2, 2), ("a", "b"))

    def f(x):
        return mark_sharding(x * 2, mesh, (("a", "b"), None)).sum(0)

    with pytest.raises(Exception, match="nested sharding"):
        torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
            distribute_tensor(torch.randn(8, 3), mesh, [R, R]))


def test_a_nested_constraint_called_eagerly_is_refused(fake_mesh):
    mesh = fake_mesh((2, 2), ("a", "b"))
    with pytest.raises(DistCompileError, match="tensor dim 0 is split by mesh axes 'a', 'b'"):
        with_sharding_constraint(torch.randn(8, 3), mesh, [S0, S0])


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_an_input_split_by_two_axes_computes_exactly(fake_mesh, name):
    """The same programs with x arriving as a DTensor in the nested layout: gathered on the
    second axis at the boundary (logged), then planned; simulated ranks match one device."""
    mesh = fake_mesh((2, 2), ("a", "b"))
    op, shape, pls = PROGRAMS[name]
    x, w = torch.randn(shape), torch.randn(8, 8)
    torch.compile(op, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(x, mesh, pls), distribute_tensor(w, mesh, [R, R]))
    record = compile_records()[-1]
    by_name = {"L_x_": x, "L_w_": w}  # Dynamo orders inputs by first use (w @ x: w first)
    (got,), _ = run_spmd(record, [by_name[i.name] for i in record.program.primal_inputs], None,
                         mesh)
    torch.testing.assert_close(got, op(x, w))
