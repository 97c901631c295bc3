"""Programs that update their inputs in place (functionalised; the new value is an extra output
written back by the runtime), checked on simulated ranks against one device."""

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dynamo_dist import compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd
from inductor_passes.core import compat


def test_buffer_update_matches_one_device(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    compat.allow_implicit_replication(True)
    w_full, buf_full, x = torch.randn(8, 4), torch.randn(8), torch.randn(3, 4)
    w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Shard(0)]))
    buf = distribute_tensor(buf_full.clone(), mesh, [Shard(0)])

    def f(x, buf):
        y = x @ w.t()
        buf.mul_(0.9).add_(y.sum(0).detach())  # a running statistic
        return y.relu().sum()

    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(x, buf)
    record = compile_records()[-1]
    assert len(record.program.mutated_inputs) == 1
    # values on simulated ranks: primals in graph order are the inputs Dynamo lifted
    by_name = {"L_x_": x, "L_buf_": buf_full}
    args = [by_name.get(i.name, w_full) for i in record.program.primal_inputs]
    outs, _ = run_spmd(record, args, None, mesh)
    y = x @ w_full.t()
    torch.testing.assert_close(outs[0], y.relu().sum())
    torch.testing.assert_close(outs[1], buf_full * 0.9 + y.sum(0))


def test_runtime_writes_the_new_value_back(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    buf = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    before = buf.to_local().clone()

    def f(buf, x):
        buf.add_(1.0)  # local on every rank: no collective, so exact on the fake group
        return x * 2

    out = torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
        buf, distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    assert isinstance(out, DTensor)
    torch.testing.assert_close(buf.to_local(), before + 1)


def test_out_argument_into_a_buffer(fake_mesh):
    """``torch.mm(a, b, out=buf)``: the out= overload is not decomposed; functionalisation turns
    it into a new value written back into ``buf``."""
    mesh = fake_mesh((2,), ("tp",))
    compat.allow_implicit_replication(True)
    a, b = torch.randn(4, 6), torch.randn(6, 4)

    def f(a, b, buf):
        torch.mm(a, b, out=buf)
        return buf.sum() * 2

    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(
        distribute_tensor(a, mesh, [Shard(0)]), b, torch.zeros(4, 4))
    record = compile_records()[-1]
    assert len(record.program.mutated_inputs) == 1
    by_name = {"L_a_": a, "L_b_": b, "L_buf_": torch.zeros(4, 4)}
    outs, _ = run_spmd(record, [by_name[i.name] for i in record.program.primal_inputs], None, mesh)
    torch.testing.assert_close(outs[0], (a @ b).sum() * 2)
    torch.testing.assert_close(outs[1], a @ b)
